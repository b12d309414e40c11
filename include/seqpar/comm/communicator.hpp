#pragma once
/// \file
/// The Communicator concept: how bytes move between ranks.

#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string_view>

#include "seqpar/core/error.hpp"

namespace seqpar {

/// Traffic a communicator (and every communicator split from it) has sent from this rank.
/// Self-copies are not counted. Tests and benchmarks hold these against the formulas.
///
/// Thread safety: the communicators update the counters with relaxed atomic operations
/// (std::atomic_ref), so objects on different threads that share one communicator (or its
/// splits) count without a data race. Reading a field as a plain integer is fine once the
/// updating threads are done; while they still run, read through snapshot(). reset() and
/// copying are not atomic as a whole (each field is read or written on its own).
struct CommStats {
  std::uint64_t bytes_sent = 0;     ///< payload bytes sent to other ranks
  std::uint64_t messages_sent = 0;  ///< messages sent to other ranks (all-to-all pieces and ring sends)
  std::uint64_t host_gathers = 0;   ///< metadata all-gathers (a forward call must do none)
  std::uint64_t all_to_alls = 0;    ///< variable-count all-to-all calls
  std::uint64_t exchanges = 0;      ///< paired send/recv calls
  /// Zeroes every counter (each one atomically).
  void reset() {
    for (std::uint64_t* f : fields()) std::atomic_ref<std::uint64_t>(*f).store(0, std::memory_order_relaxed);
  }
  /// A copy read field by field with atomic loads (safe while other threads count).
  CommStats snapshot() const {
    CommStats out;
    auto* self = const_cast<CommStats*>(this);  // atomic_ref needs a non-const object; only loads
    const auto from = self->fields();
    const auto to = out.fields();
    for (std::size_t i = 0; i < from.size(); ++i)
      *to[i] = std::atomic_ref<std::uint64_t>(*from[i]).load(std::memory_order_relaxed);
    return out;
  }
  /// Counts one all-to-all: every non-empty piece to another rank is a message.
  void count_all_to_all(std::span<const std::size_t> send_counts, int self) {
    std::uint64_t bytes = 0, messages = 0;
    for (std::size_t j = 0; j < send_counts.size(); ++j)
      if (static_cast<int>(j) != self && send_counts[j] > 0) {
        bytes += send_counts[j];
        ++messages;
      }
    add(bytes_sent, bytes);
    add(messages_sent, messages);
    add(all_to_alls, 1);
  }
  /// Counts one exchange sending `bytes` (traffic only when `to_other`, i.e. not to itself).
  void count_exchange(std::size_t bytes, bool to_other) {
    if (to_other) {
      add(bytes_sent, bytes);
      add(messages_sent, 1);
    }
    add(exchanges, 1);
  }
  /// Counts one metadata all-gather.
  void count_host_gather() { add(host_gathers, 1); }
  /// Takes back one metadata all-gather (set-up gathers that are not per-call metadata).
  void uncount_host_gather() {
    std::atomic_ref<std::uint64_t>(host_gathers).fetch_sub(1, std::memory_order_relaxed);
  }

 private:
  static void add(std::uint64_t& field, std::uint64_t n) {
    if (n) std::atomic_ref<std::uint64_t>(field).fetch_add(n, std::memory_order_relaxed);
  }
  std::array<std::uint64_t*, 5> fields() { return {&bytes_sent, &messages_sent, &host_gathers, &all_to_alls, &exchanges}; }
};

/// The environment variable that sets the default time-out (milliseconds) of every
/// communicator's waits; unset, empty or 0: wait forever (see each communicator's timeout).
inline constexpr const char* comm_timeout_env = "SEQPAR_COMM_TIMEOUT_MS";

/// The time-out SEQPAR_COMM_TIMEOUT_MS asks for: zero (none) when it is unset or empty; one
/// too long for the clock (up to and past INT64_MAX ms) means never. Throws ConfigError when
/// it is not a non-negative integer of milliseconds.
inline std::chrono::milliseconds comm_timeout_from_env() {
  const char* env = std::getenv(comm_timeout_env);
  if (env == nullptr || *env == '\0') return std::chrono::milliseconds{0};
  const std::string_view text(env);
  long long ms = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), ms);
  const bool whole = end == text.data() + text.size() && text.front() != '-';
  // A number of digits too large for 64 bits is still a time-out: "never", as any time-out too
  // long for the clock is.
  if (whole && ec == std::errc::result_out_of_range) return std::chrono::milliseconds::max();
  SEQPAR_CHECK(ec == std::errc{} && whole && ms >= 0, ConfigError, comm_timeout_env,
               ": expected a whole number of milliseconds >= 0 (0: no time-out), got \"", text, "\"");
  return std::chrono::milliseconds{ms};
}

namespace detail {
/// The argument check every communicator's all_to_all_v shares: four spans of size() entries.
inline void check_all_to_all_spans(const char* who, std::size_t n, std::size_t a, std::size_t b, std::size_t c,
                                   std::size_t d) {
  SEQPAR_CHECK(a == n && b == n && c == n && d == n, ConfigError, who,
               ": all_to_all_v: counts and displacements must have size() = ", n, " entries, got ", a, ", ", b, ", ",
               c, ", ", d);
}
}  // namespace detail

/// Opt-in for the Communicator concept: true when the type declares
/// `static constexpr bool is_seqpar_communicator = true;`. Specialise to opt in a type you
/// cannot change.
template <class C>
inline constexpr bool enable_communicator = requires { requires C::is_seqpar_communicator; };

/// A Communicator moves bytes between the ranks of a group. Requirements:
/// - opt-in: `enable_communicator<C>` (see above);
/// - `C` is move-constructible (the engine keeps the communicators it splits off);
/// - `typename C::memory_space`: where the buffers it moves live (HostSpace, CudaSpace);
/// - `typename C::request_type`: handle of a started exchange, default-constructible (a
///   request not started yet);
/// - `c.rank()`, `c.size()`: this rank and the group size, as int;
/// - `c.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs)`: every
///   rank sends send_counts[j] bytes at send + send_displs[j] to rank j and receives
///   recv_counts[j] bytes from rank j at recv + recv_displs[j] (counts and displacements in
///   bytes, spans of size()); the piece to itself is copied;
/// - `c.start_exchange(send, send_bytes, dest, recv, recv_bytes, source)`: starts sending to
///   `dest` and receiving from `source` without blocking, returns a request;
///   `c.wait(request)` completes both. Messages between one pair of ranks arrive in order,
///   and requests that receive from the same source are waited in the order they started;
/// - optional: `c.test(request)` -> bool: moves the exchange along without blocking and says
///   whether it is done (wait() is still called). A transport that moves bytes only inside
///   its own calls (MPI) offers it, and the ring polls it between chunks of its compute;
/// - `c.all_gather_host(mine, all)`: host integers, `all` = concatenation of every rank's
///   `mine` in rank order (the metadata channel; counted in stats().host_gathers);
/// - `c.barrier()`;
/// - `c.split(color, key)`: a new communicator per color, ranked by key (collective). It
///   shares the parent's stats;
/// - `c.stats()`: the CommStats counters (const and mutable access);
/// - every operation is collective over the group where MPI's is, and reports failures by
///   throwing CommError (never by aborting, and never by hanging forever when a peer has
///   failed); a send buffer stays untouched, and a receive buffer unread, until the operation
///   (or its wait) returns. A peer that stays alive but never joins is bounded by the
///   communicator's time-out (SEQPAR_COMM_TIMEOUT_MS, or its own setting; off by default):
///   then CommError naming the operation and, where it can know, the peer;
/// - thread safety: no operation on one communicator (or its copies) runs concurrently with
///   another; the stats() counters are updated atomically (CommStats).
/// The concept checks the syntax; the semantics above are what the policies rely on.
template <class C>
concept Communicator =
    enable_communicator<C> && std::move_constructible<C> && std::default_initializable<typename C::request_type> &&
    requires(C& c, const C& cc, const std::byte* send, std::byte* recv, std::span<const std::size_t> counts,
             std::span<const std::int64_t> mine, std::span<std::int64_t> all, typename C::request_type& req) {
      typename C::memory_space;
      { cc.rank() } -> std::same_as<int>;
      { cc.size() } -> std::same_as<int>;
      c.all_to_all_v(send, counts, counts, recv, counts, counts);
      { c.start_exchange(send, std::size_t{}, int{}, recv, std::size_t{}, int{}) } -> std::same_as<typename C::request_type>;
      c.wait(req);
      c.all_gather_host(mine, all);
      c.barrier();
      { c.split(int{}, int{}) } -> std::same_as<C>;
      { cc.stats() } -> std::same_as<const CommStats&>;
      { c.stats() } -> std::same_as<CommStats&>;
    };

}  // namespace seqpar
