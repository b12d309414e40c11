#pragma once
/// \file
/// The Communicator concept: how bytes move between ranks.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "seqpar/core/error.hpp"

namespace seqpar {

/// Traffic a communicator (and every communicator split from it) has sent from this rank.
/// Self-copies are not counted. Tests and benchmarks hold these against the formulas.
struct CommStats {
  std::uint64_t bytes_sent = 0;     ///< payload bytes sent to other ranks
  std::uint64_t messages_sent = 0;  ///< messages sent to other ranks (all-to-all pieces and ring sends)
  std::uint64_t host_gathers = 0;   ///< metadata all-gathers (a forward call must do none)
  std::uint64_t all_to_alls = 0;    ///< variable-count all-to-all calls
  std::uint64_t exchanges = 0;      ///< paired send/recv calls
  /// Zeroes every counter.
  void reset() { *this = CommStats{}; }
  /// Counts one all-to-all: every non-empty piece to another rank is a message.
  void count_all_to_all(std::span<const std::size_t> send_counts, int self) {
    for (std::size_t j = 0; j < send_counts.size(); ++j)
      if (static_cast<int>(j) != self && send_counts[j] > 0) {
        bytes_sent += send_counts[j];
        ++messages_sent;
      }
    ++all_to_alls;
  }
};

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
///   (or its wait) returns.
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
