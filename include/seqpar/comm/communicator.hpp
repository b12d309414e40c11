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
#include <exception>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <tuple>

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

/// What kind of call a tagged exchange belongs to: the low two bits of its tag (call_tag).
enum class CallKind : std::uint8_t {
  forward = 0,   ///< SequenceParallelAttention::forward
  backward = 1,  ///< SequenceParallelAttention::backward
  decode = 2,    ///< a decode step (none exchanges today: decode steps move data by all-to-all)
  other = 3,     ///< free for a user's own numbered calls
};

/// The tag of every exchange of call number `call` (0, 1, 2, ... per object) of kind `kind`.
/// Calls are collective and made in the same order on every rank, so each rank numbers an
/// object's calls alike (a call refused by a local argument check takes no number: see
/// detail::CallGuard), and a message carries the number of the call that sent it. A receiver
/// that expects another number knows the message is not for it, instead of taking bytes of
/// another call that happen to have the expected size.
constexpr std::uint64_t call_tag(CallKind kind, std::uint64_t call) noexcept {
  return call << 2 | static_cast<std::uint64_t>(kind);
}

/// The tag of an exchange started without one (the six-argument start_exchange).
inline constexpr std::uint64_t untagged_exchange = ~std::uint64_t{0};

/// "backward call 7" for a tag of call_tag ("an untagged exchange" for untagged_exchange). With
/// `modulo` > 0 the call number is only known modulo it (a transport with a small tag range).
inline std::string describe_call_tag(std::uint64_t tag, std::uint64_t modulo = 0) {
  if (tag == untagged_exchange) return "an untagged exchange";
  static constexpr const char* kinds[4] = {"forward", "backward", "decode", "other"};
  std::string s = std::string(kinds[tag & 3]) + " call " + std::to_string(tag >> 2);
  if (modulo > 0) s += " (counted modulo " + std::to_string(modulo) + ")";
  return s;
}

/// One rank's failure latch, shared by a communicator, its copies and its splits (as CommStats
/// are). A call that fails part-way on a rank (an exception leaves it after its communication
/// began, or an operation of the communicator itself failed or timed out) sets it; from then
/// on every operation of those communicators on this rank throws CommError at once (refuse()).
/// Why: the rank's peers may still wait in the failed call, and the transports match messages
/// by order (MPI collectives, NCCL, same-tag MPI messages), so a further call would hand its
/// bytes to the peers' old call: results of the wrong call, with no error. Refusing leaves the
/// peers a time-out or an error instead. Set once, never cleared: recovery is a new
/// communicator on every rank (or, with MPI, ending the job).
///
/// Thread safety: set() and the reads may run on different threads (a rank's communicators of
/// different groups may serve different threads); the flag is atomic, the reason locked.
class FailureLatch {
 public:
  /// True once set().
  bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }

  /// Sets the latch, keeping the first reason. Never throws: it runs while exceptions unwind
  /// (without memory the reason is dropped, never the latch). A trailing " (at file:line)" is
  /// dropped from the reason: the error that quotes it has its own.
  void set(std::string_view reason) noexcept {
    const std::lock_guard lock(mu_);
    if (failed_.load(std::memory_order_relaxed)) return;
    if (const auto at = reason.rfind(" (at "); at != std::string_view::npos && reason.ends_with(')'))
      reason = reason.substr(0, at);
    try {
      reason_.assign(reason);
    } catch (...) {
      reason_.clear();
    }
    failed_.store(true, std::memory_order_release);
  }

  /// set() with the message of the exception being handled (call it inside a catch block).
  void set_from_current_exception() noexcept {
    try {
      throw;
    } catch (const std::exception& e) {
      set(e.what());
    } catch (...) {
      set("an exception that is not a std::exception");
    }
  }

  /// Runs `body` (an operation's communication, after its local argument checks) and returns
  /// its result; an exception leaving it sets the latch with its message on the way out.
  template <class Body>
  decltype(auto) latch_on_failure(Body&& body) {
    try {
      return body();
    } catch (...) {
      set_from_current_exception();
      throw;
    }
  }

  /// The first reason ("" while not set).
  std::string reason() const {
    const std::lock_guard lock(mu_);
    return reason_;
  }

  /// Throws the CommError of operation `what` of communicator `who`, refused because the latch
  /// is set; `then` says what the caller can do (the remedy depends on the transport).
  [[noreturn]] void refuse(std::string_view who, std::string_view what, std::string_view then) const {
    throw CommError(std::string(who) + ": " + std::string(what) + ": a previous call failed part-way on this rank (" +
                    reason() + "): " + std::string(then));
  }

 private:
  mutable std::mutex mu_;
  std::atomic<bool> failed_{false};
  std::string reason_;
};

namespace detail {
/// The argument check every communicator's all_to_all_v shares: four spans of size() entries.
inline void check_all_to_all_spans(const char* who, std::size_t n, std::size_t a, std::size_t b, std::size_t c,
                                   std::size_t d) {
  SEQPAR_CHECK(a == n && b == n && c == n && d == n, ConfigError, who,
               ": all_to_all_v: counts and displacements must have size() = ", n, " entries, got ", a, ", ", b, ", ",
               c, ", ", d);
}

/// True when `C` has the optional tagged start_exchange (see the Communicator concept).
template <class C>
inline constexpr bool has_tagged_exchange =
    requires(C& c, const std::byte* send, std::byte* recv) {
      { c.start_exchange(send, std::size_t{}, int{}, recv, std::size_t{}, int{}, std::uint64_t{}) }
          -> std::same_as<typename C::request_type>;
    };

/// True when `C` has the optional failure latch: `fail(reason)` and `failed()`.
template <class C>
inline constexpr bool has_failure_latch = requires(C& c, const C& cc, std::string_view reason) {
  c.fail(reason);
  { cc.failed() } -> std::convertible_to<bool>;
};

/// c.start_exchange with `tag` when the communicator takes one, else the plain call (a user
/// communicator without tags keeps working; its messages are then matched by order alone).
template <class C>
typename C::request_type start_exchange(C& c, const std::byte* send, std::size_t send_bytes, int dest,
                                        std::byte* recv, std::size_t recv_bytes, int source, std::uint64_t tag) {
  if constexpr (has_tagged_exchange<C>)
    return c.start_exchange(send, send_bytes, dest, recv, recv_bytes, source, tag);
  else
    return c.start_exchange(send, send_bytes, dest, recv, recv_bytes, source);
}

/// Sets `c`'s failure latch, when it has one. Never throws (it runs while an exception unwinds).
template <class C>
void fail_communicator(C& c, std::string_view reason) noexcept {
  if constexpr (has_failure_latch<C>) {
    try {
      c.fail(reason);
    } catch (...) {  // a user's fail() that throws: nothing more can be done while unwinding
    }
  }
}

/// The commit point of a call (see FailureLatch): made once the call's local checks passed and
/// before its first message, it sets the failure latch of the given communicators if an
/// exception leaves the scope after it. Checks made before it are local and transactional:
/// their errors leave the object usable, and every rank's next call still matches its peers'.
/// The latch's reason is a fixed text naming the call: a destructor cannot read the exception
/// in flight (a communicator that failed by itself has latched first, with its own message).
template <class... Comms>
class CallGuard {
 public:
  /// Guards a call over `comms`; `reason` (static text) becomes the latch's reason.
  explicit CallGuard(const char* reason, Comms&... comms) noexcept
      : reason_(reason), unwinding_(std::uncaught_exceptions()), comms_{&comms...} {}
  CallGuard(const CallGuard&) = delete;
  CallGuard& operator=(const CallGuard&) = delete;
  /// Latches the communicators when an exception that began after the guard unwinds it.
  ~CallGuard() {
    if (!armed_ || std::uncaught_exceptions() <= unwinding_) return;
    std::apply([&](auto*... c) { (fail_communicator(*c, reason_), ...); }, comms_);
  }
  /// Disarms the guard: what follows are checks every rank makes alike on data all of them
  /// received, which leave no peer waiting.
  void complete() noexcept { armed_ = false; }

 private:
  const char* reason_;
  int unwinding_;
  bool armed_ = true;
  std::tuple<Comms*...> comms_;
};
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
/// - optional: `c.start_exchange(send, send_bytes, dest, recv, recv_bytes, source, tag)`, the
///   same with a `std::uint64_t` tag (call_tag: the call's kind and number): a message is
///   delivered only into a receive of the same tag, and one of another tag is refused with a
///   CommError naming "a message of another call" (or, where the transport cannot tell at
///   once, left for the time-out), never taken as this call's bytes. The engine tags its ring
///   exchanges with the call's tag when the communicator has this overload, and calls the
///   plain one otherwise (messages are then told apart by order alone);
/// - optional: `c.test(request)` -> bool: moves the exchange along without blocking and says
///   whether it is done (wait() is still called). A transport that moves bytes only inside
///   its own calls (MPI) offers it, and the ring polls it between chunks of its compute;
/// - `c.all_gather_host(mine, all)`: host integers, `all` = concatenation of every rank's
///   `mine` in rank order (the metadata channel; counted in stats().host_gathers);
/// - `c.barrier()`;
/// - `c.split(color, key)`: a new communicator per color, ranked by key (collective). It
///   shares the parent's stats;
/// - `c.stats()`: the CommStats counters (const and mutable access);
/// - optional: the failure latch, `c.fail(reason)` (noexcept: it sets the latch, keeping the
///   first reason) and `c.failed()` -> bool, with the semantics of FailureLatch: shared by the
///   communicator, its copies and its splits on this rank; set by the engine when a call fails
///   part-way (an exception leaves forward, backward or a decode step after its communication
///   began: detail::CallGuard) and by the communicator's own failures (time-out, transport
///   error, size mismatch); once set, every operation on this rank throws CommError at once.
///   A communicator without it still works, but a rank that catches a failed call's exception
///   and calls again may then meet its peers' old call;
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
