#pragma once
/// \file
/// ThreadCommunicator: P ranks as threads of one process. Used by the tests, by single-process
/// programs, and (over device memory) to check every policy on one GPU.
///
/// The state the ranks share (ThreadFamily, Channel, ThreadGroup) is in
/// comm/detail/thread_state.hpp; this header holds the communicator and run_ranks.

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/comm/detail/thread_state.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/types.hpp"

namespace seqpar {

/// How ThreadCommunicator copies bytes in a memory space; the CUDA header specialises it.
template <class Space>
struct SpaceCopy;

/// Host copies are plain memcpy.
template <>
struct SpaceCopy<HostSpace> {
  /// Copies `bytes` from src to dst.
  static void copy(std::byte* dst, const std::byte* src, std::size_t bytes) {
    if (bytes) std::memcpy(dst, src, bytes);
  }
};

/// Options of run_ranks.
struct ThreadRunOptions {
  /// A blocking operation that waits longer than this fails the run: the waiting rank throws
  /// CommAborted (a CommError) naming the operation and the ranks it waits for (and whether
  /// they returned from their rank function without calling it), and every other waiting rank
  /// is woken with it. Zero: the environment variable SEQPAR_COMM_TIMEOUT_MS if set, else
  /// wait forever.
  std::chrono::milliseconds timeout{0};
};

/// P ranks as threads of one process, over memory space `Space`. A handle: cheap to copy,
/// every copy is the same rank. Create the ranks with run_ranks(). If any rank throws, the
/// others are woken from whatever they wait on with CommAborted, so nothing hangs, and no
/// rank's buffers are freed while a peer still copies them (see request_type).
///
/// Fast paths allocate nothing: all_to_all_v, barrier and waits never do; start_exchange
/// reuses per-pair message slots, so once a plan's first forward (and backward) has run, the
/// later ones allocate nothing here.
///
/// Time-out: ThreadRunOptions::timeout, or SEQPAR_COMM_TIMEOUT_MS, bounds every wait
/// (all-to-all, exchange wait, host all-gather, barrier, split); see ThreadRunOptions.
///
/// Calls never mix their messages: an exchange carries its call's tag (the seven-argument
/// start_exchange; the plain one sends untagged_exchange), and a receive that finds a message
/// of another tag fails the group with a CommError naming "a message of another call" instead
/// of copying it. A rank whose call failed part-way is latched (FailureLatch, shared by its
/// copies and splits): its next operation throws CommError at once and wakes its peers with
/// CommAborted, and a rank function that returns while latched wakes them too, so peers left
/// in the failed call never wait for the time-out.
///
/// Thread safety: one rank of one group is used by one thread at a time. Two threads must
/// not call operations concurrently on copies of the same communicator (they are one rank of
/// one group: the collectives would interleave), and no call is safe concurrently with
/// another on it. Communicators of different groups may run on different threads, also
/// when they share counters (split() shares stats with its parent): the counters are updated
/// atomically, so stats() never races; see CommStats for reading them while others count.
template <class Space = HostSpace>
class BasicThreadCommunicator {
 public:
  static constexpr bool is_seqpar_communicator = true;  ///< opts in to the Communicator concept
  using memory_space = Space;                           ///< buffers live here

  /// A started exchange; complete it with wait(). Move-only, because it stands for a send
  /// buffer the receiver may be copying. One destroyed unwaited (its rank is unwinding from
  /// an exception, or dropped it) first withdraws its send, or waits out the copy already
  /// under way, so its owner may free the buffer right after; the receiver then waits for
  /// the failure, woken with CommAborted. Dropping one while no exception unwinds fails the
  /// group itself (the receiver would wait forever); while one unwinds, run_ranks fails it
  /// with that exception's message once it leaves the rank function.
  class request_type {
   public:
    /// A request not started: wait() on it returns at once.
    request_type() = default;
    /// Takes over `other`'s exchange.
    request_type(request_type&& other) noexcept { take(other); }
    /// Gives up this exchange (see the class comment), then takes over `other`'s.
    request_type& operator=(request_type&& other) noexcept {
      if (this != &other) {
        give_up();
        take(other);
      }
      return *this;
    }
    /// Gives up an exchange that was started and not waited for (see the class comment).
    ~request_type() { give_up(); }

   private:
    friend class BasicThreadCommunicator;
    /// What a started exchange holds.
    struct State {
      std::shared_ptr<detail::ThreadGroup> group;  // null: not started, or complete
      std::uint64_t seq = 0;                       // our message's number on (rank, dest)
      std::uint64_t tag = untagged_exchange;       // the call tag the message from source must carry
      int rank = 0, dest = 0, source = 0;
      std::byte* recv = nullptr;
      std::size_t recv_bytes = 0;
      int unwinding = 0;  // exceptions in flight when it started (to tell unwinding from a drop)
    };

    explicit request_type(State s) : state_(std::move(s)) {}
    void take(request_type& o) { state_ = std::move(o.state_); }  // leaves o.state_.group null
    void give_up() noexcept {
      if (!state_.group) return;
      auto& fam = *state_.group->family;
      {
        std::unique_lock lock(fam.mu);
        state_.group->channel(state_.rank, state_.dest).give_up(lock, fam.cv, state_.seq);
        if (std::uncaught_exceptions() <= state_.unwinding)
          fam.abort_locked("rank " + std::to_string(state_.rank) + " dropped an exchange (to rank " +
                           std::to_string(state_.dest) + ") without waiting for it");
      }
      state_.group.reset();
    }

    State state_;
  };

  /// Rank `rank` of `group`; made by run_ranks() and split(), not by users.
  BasicThreadCommunicator(std::shared_ptr<detail::ThreadGroup> group, int rank,
                          std::shared_ptr<CommStats> stats = std::make_shared<CommStats>(),
                          std::shared_ptr<FailureLatch> latch = std::make_shared<FailureLatch>())
      : group_(std::move(group)), rank_(rank), stats_(std::move(stats)), latch_(std::move(latch)) {}

  /// This rank.
  int rank() const { return rank_; }
  /// Ranks in the group.
  int size() const { return group_->size; }
  /// Counters (shared with communicators split from this one).
  const CommStats& stats() const { return *stats_; }
  /// Counters, mutable (to reset them).
  CommStats& stats() { return *stats_; }
  /// Sets this rank's failure latch (shared with copies and splits; the first reason stays):
  /// every later operation on this rank throws CommError (see the class comment).
  void fail(std::string_view reason) noexcept { latch_->set(reason); }
  /// True once this rank's failure latch is set.
  bool failed() const noexcept { return latch_->failed(); }
  /// The reason the latch was set with first ("" while it is not set).
  std::string failure_reason() const { return latch_->reason(); }

  /// Variable-count all-to-all (see the Communicator concept). Each rank pulls its pieces out
  /// of the senders' buffers between two barriers.
  void all_to_all_v(const std::byte* send, std::span<const std::size_t> send_counts,
                    std::span<const std::size_t> send_displs, std::byte* recv,
                    std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    detail::check_all_to_all_spans("ThreadCommunicator", static_cast<std::size_t>(size()), send_counts.size(),
                                   send_displs.size(), recv_counts.size(), recv_displs.size());
    communicate("all_to_all_v", [&] {
      auto& fam = *group_->family;
      std::unique_lock lock(fam.mu);
      group_->slots[rank_] = {send, send_counts.data(), send_displs.data(), nullptr, 0};
      group_->barrier_locked(lock, "all_to_all_v", rank_);
      for (int j = 0; j < size(); ++j) {
        const auto& s = group_->slots[j];
        if (s.counts[rank_] != recv_counts[j])
          fam.fail(lock, "all_to_all_v: rank " + std::to_string(j) + " sends " + std::to_string(s.counts[rank_]) +
                             " bytes to rank " + std::to_string(rank_) + ", which expects " +
                             std::to_string(recv_counts[j]));
      }
      fam.copy_unlocked(
          lock,
          [&] {
            for (int j = 0; j < size(); ++j) {
              const auto& s = group_->slots[j];
              SpaceCopy<Space>::copy(recv + recv_displs[j], s.data + s.displs[rank_], recv_counts[j]);
            }
          },
          [] {});
      stats_->count_all_to_all(send_counts, rank_);
      group_->barrier_locked(lock, "all_to_all_v", rank_, true);
    });
  }

  /// Starts sending `send_bytes` to `dest` and receiving `recv_bytes` from `source`; both
  /// messages carry `tag` (call_tag; untagged_exchange by default), and wait() refuses a
  /// message from `source` with another tag. The send buffer must stay untouched until
  /// wait() returns.
  request_type start_exchange(const std::byte* send, std::size_t send_bytes, int dest, std::byte* recv,
                              std::size_t recv_bytes, int source, std::uint64_t tag = untagged_exchange) {
    check_rank(dest, "dest");
    check_rank(source, "source");
    return communicate("exchange", [&] {
      std::uint64_t seq = 0;
      {
        std::lock_guard lock(group_->family->mu);
        seq = group_->channel(rank_, dest).post(send, send_bytes, tag);
        group_->family->cv.notify_all();
      }
      request_type req({group_, seq, tag, rank_, dest, source, recv, recv_bytes, std::uncaught_exceptions()});
      stats_->count_exchange(send_bytes, dest != rank_);
      return req;
    });
  }

  /// Completes an exchange: copies the next message from `source`, then waits until `dest`
  /// has copied ours. A request not started returns at once. A message from `source` whose
  /// tag is not the request's, or whose size is not the one expected, is refused: the group
  /// fails with a CommError here, and nothing is copied.
  void wait(request_type& req) {
    auto& st = req.state_;
    refuse_if_failed("exchange");
    if (!st.group) return;
    SEQPAR_CHECK(st.group == group_ && st.rank == rank_, ConfigError,
                 "ThreadCommunicator: wait: the request was started on another communicator");
    communicate("exchange", [&] {
      auto& fam = *group_->family;
      std::unique_lock lock(fam.mu);
      auto& in = group_->channel(st.source, rank_);
      fam.wait_for(lock, [&] { return in.ready(); }, "exchange (receive)",
                   [&] { return std::vector<std::pair<int, int>>{group_->peer(st.source)}; });
      const detail::Channel::Slot msg = in.at(in.taken++);
      if (msg.tag != st.tag) {
        ++in.delivered;  // refused: nothing will read it
        fam.fail(lock, "exchange: rank " + std::to_string(st.source) + " sent a message of another call (" +
                           describe_call_tag(msg.tag) + ") to rank " + std::to_string(rank_) +
                           ", which waits for one of " + describe_call_tag(st.tag) +
                           " (a rank went on after a call failed on it, or the ranks' calls differ)");
      }
      if (msg.bytes != st.recv_bytes) {
        ++in.delivered;  // refused: nothing will read it
        fam.fail(lock, "exchange: rank " + std::to_string(st.source) + " sent " + std::to_string(msg.bytes) +
                           " bytes to rank " + std::to_string(rank_) + ", which expects " +
                           std::to_string(st.recv_bytes));
      }
      fam.copy_unlocked(
          lock, [&] { SpaceCopy<Space>::copy(st.recv, msg.data, msg.bytes); }, [&] { ++in.delivered; });
      auto& out = group_->channel(rank_, st.dest);
      fam.wait_for(lock, [&] { return out.delivered > st.seq; }, "exchange (send)",
                   [&] { return std::vector<std::pair<int, int>>{group_->peer(st.dest)}; });
    });
    st.group.reset();  // complete: nothing left to give up
  }
  /// Metadata all-gather of host integers (every rank gives the same count).
  void all_gather_host(std::span<const std::int64_t> mine, std::span<std::int64_t> all) {
    SEQPAR_CHECK(all.size() == mine.size() * static_cast<std::size_t>(size()), ConfigError,
                 "all_gather_host: output size: expected ", mine.size() * size(), ", got ", all.size());
    communicate("all_gather_host", [&] {
      auto& fam = *group_->family;
      std::unique_lock lock(fam.mu);
      group_->slots[rank_] = {nullptr, nullptr, nullptr, mine.data(), mine.size()};
      group_->barrier_locked(lock, "all_gather_host", rank_);
      for (int j = 0; j < size(); ++j) {
        const auto& s = group_->slots[j];
        if (s.n != mine.size()) {
          const std::string why = "all_gather_host: rank " + std::to_string(j) + " gives " + std::to_string(s.n) +
                                  " integers, rank " + std::to_string(rank_) + " gives " + std::to_string(mine.size());
          fam.fail(lock, why);
        }
        std::copy(s.ints, s.ints + s.n, all.begin() + static_cast<std::ptrdiff_t>(j * mine.size()));
      }
      stats_->count_host_gather();
      group_->barrier_locked(lock, "all_gather_host", rank_, true);
    });
  }

  /// Blocks until every rank of the group arrives.
  void barrier() {
    communicate("barrier", [&] {
      std::unique_lock lock(group_->family->mu);
      group_->barrier_locked(lock, "barrier", rank_, true);
    });
  }

  /// Splits into one communicator per color, ranked by (key, rank). Collective. The result
  /// shares this one's stats and failure latch.
  BasicThreadCommunicator split(int color, int key) {
    refuse_if_failed("split");
    const std::int64_t mine[2] = {color, key};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size()));
    all_gather_host(mine, all);
    stats_->uncount_host_gather();  // construction-time bookkeeping, not metadata traffic
    std::vector<std::pair<std::int64_t, int>> members;  // (key, rank) of my color
    for (int j = 0; j < size(); ++j)
      if (all[2 * j] == color) members.emplace_back(all[2 * j + 1], j);
    std::sort(members.begin(), members.end());
    int new_rank = 0;
    while (members[new_rank].second != rank_) ++new_rank;
    std::shared_ptr<detail::ThreadGroup> child;
    {
      std::lock_guard lock(group_->family->mu);
      auto& slot = group_->children[{splits_, color}];
      if (!slot) {
        std::vector<int> world;  // the members' world ranks, in their new rank order
        for (const auto& m : members) world.push_back(group_->world_rank[static_cast<std::size_t>(m.second)]);
        slot = std::make_shared<detail::ThreadGroup>(group_->family, static_cast<int>(members.size()), std::move(world));
      }
      child = slot;
    }
    ++splits_;
    return BasicThreadCommunicator(std::move(child), new_rank, stats_, latch_);
  }

 private:
  /// Runs `body` (an operation's communication, after its local argument checks): refused at
  /// once when this rank is latched; any exception leaving it latches the rank.
  template <class Body>
  decltype(auto) communicate(const char* what, Body&& body) {
    refuse_if_failed(what);
    return latch_->latch_on_failure(std::forward<Body>(body));
  }

  /// When this rank is latched: fails the family, so that peers still waiting in the failed
  /// call are woken with CommAborted, then throws the latch's CommError for `what`.
  void refuse_if_failed(const char* what) {
    if (!latch_->failed()) return;
    group_->family->abort("rank " + std::to_string(group_->world_rank[static_cast<std::size_t>(rank_)]) +
                          " refused " + what + ": a previous call failed part-way on it (" + latch_->reason() + ")");
    latch_->refuse("ThreadCommunicator", what,
                   "its peers are woken with CommAborted; start the ranks again (a new run_ranks)");
  }

  void check_rank(int r, const char* name) const {
    SEQPAR_CHECK(r >= 0 && r < size(), ConfigError, "ThreadCommunicator: ", name, ": expected a rank in [0, ",
                 size(), "), got ", r);
  }
  std::shared_ptr<detail::ThreadGroup> group_;
  int rank_;
  std::shared_ptr<CommStats> stats_;
  std::shared_ptr<FailureLatch> latch_;
  std::uint64_t splits_ = 0;
};

/// Threads over host memory.
using ThreadCommunicator = BasicThreadCommunicator<HostSpace>;

/// Runs `fn(comm)` on `ranks` threads, each with its own rank of a fresh world, and returns
/// when all have finished. If a rank throws, the others are woken with CommAborted, and the
/// first original exception (not a CommAborted it caused) is rethrown here. A rank function
/// that returns normally while its rank is latched (a call failed part-way and it caught the
/// error) wakes the others too: they may be waiting in that call.
template <class Space = HostSpace, class Fn>
void run_ranks(int ranks, Fn&& fn, ThreadRunOptions options = {}) {
  SEQPAR_CHECK(ranks >= 1, ConfigError, "run_ranks: ranks: expected >= 1, got ", ranks);
  auto family = std::make_shared<detail::ThreadFamily>();
  family->timeout = options.timeout.count() > 0 ? options.timeout : comm_timeout_from_env();
  family->returned.assign(static_cast<std::size_t>(ranks), 0);
  auto world = std::make_shared<detail::ThreadGroup>(family, ranks);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        BasicThreadCommunicator<Space> comm(world, r);
        fn(comm);
        if (comm.failed())
          family->abort("rank " + std::to_string(r) + " returned from its rank function after a call failed part-way on it (" +
                        comm.failure_reason() + ")");
        std::lock_guard lock(family->mu);
        family->returned[static_cast<std::size_t>(r)] = 1;  // named by a peer's time-out
      } catch (...) {
        errors[r] = std::current_exception();
        family->abort("rank " + std::to_string(r) + " failed" + detail::current_what());
      }
    });
  for (auto& t : threads) t.join();
  std::exception_ptr first_aborted;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const CommAborted&) {
      if (!first_aborted) first_aborted = e;
    } catch (...) {
      std::rethrow_exception(e);
    }
  }
  if (first_aborted) std::rethrow_exception(first_aborted);
}

static_assert(Communicator<ThreadCommunicator>);

}  // namespace seqpar
