#pragma once
/// \file
/// ThreadCommunicator: P ranks as threads of one process. Used by the tests, by single-process
/// programs, and (over device memory) to check every policy on one GPU.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "seqpar/comm/communicator.hpp"
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
  /// A blocking operation that waits longer than this throws CommError; zero waits forever.
  std::chrono::milliseconds timeout{0};
};

namespace detail {

/// State shared by every communicator of one run_ranks call (the world and all its splits).
/// One lock guards it all: the bookkeeping is tiny and the copies happen outside the lock.
struct ThreadFamily {
  std::mutex mu;
  std::condition_variable cv;
  bool aborted = false;
  std::string reason;
  int active_reads = 0;  // copies in progress out of another rank's buffer
  std::chrono::milliseconds timeout{0};

  void abort(std::string why) {
    std::lock_guard lock(mu);
    if (!aborted) {
      aborted = true;
      reason = std::move(why);
    }
    cv.notify_all();
  }

  /// Fails the whole family from a rank that found an error under `lock`: marks it aborted,
  /// then lets every in-flight copy out of this rank's buffers finish before throwing
  /// CommError, so that no peer reads memory the unwinding stack is about to free.
  [[noreturn]] void fail(std::unique_lock<std::mutex>& lock, const std::string& why) {
    if (!aborted) {
      aborted = true;
      reason = why;
    }
    cv.notify_all();
    cv.wait(lock, [&] { return active_reads == 0; });
    throw CommError("ThreadCommunicator: " + why);
  }

  /// Waits for `ready` under `lock`; throws CommAborted when a peer failed or on time-out.
  /// Before throwing it lets every in-flight copy finish, so no peer reads a buffer that the
  /// unwinding stack is about to free. With `completed_wins`, a wait whose condition did come
  /// true returns normally even if a peer failed meanwhile: only for the last barrier of an
  /// operation (no buffer is read after it), so that ranks which then evaluate one check on
  /// the same gathered data all throw the same error, instead of a race deciding which of
  /// them see CommAborted.
  template <class Pred>
  void wait(std::unique_lock<std::mutex>& lock, Pred ready, const char* what, bool completed_wins = false) {
    auto stop = [&] { return aborted || ready(); };
    if (timeout.count() > 0) {
      if (!cv.wait_for(lock, timeout, stop)) {
        aborted = true;
        reason = std::string("time-out after ") + std::to_string(timeout.count()) + " ms in " + what;
        cv.notify_all();
      }
    } else {
      cv.wait(lock, stop);
    }
    if (ready() && (completed_wins || !aborted)) return;
    cv.wait(lock, [&] { return active_reads == 0; });
    throw CommAborted(std::string("ThreadCommunicator: ") + what + " interrupted: " + reason);
  }
};

/// One group of ranks (the world or one color of a split).
struct ThreadGroup {
  struct Message {
    const std::byte* data = nullptr;
    std::size_t bytes = 0;
    bool done = false;
  };
  struct Slot {
    const std::byte* data = nullptr;
    const std::size_t* counts = nullptr;
    const std::size_t* displs = nullptr;
    const std::int64_t* ints = nullptr;
    std::size_t n = 0;
  };

  ThreadGroup(std::shared_ptr<ThreadFamily> f, int n)
      : family(std::move(f)), size(n), slots(static_cast<std::size_t>(n)), mailbox(static_cast<std::size_t>(n * n)) {}

  std::shared_ptr<ThreadFamily> family;
  int size;
  std::vector<Slot> slots;
  int arrived = 0;
  std::uint64_t generation = 0;
  std::vector<std::deque<std::shared_ptr<Message>>> mailbox;  // [src * size + dst]
  std::map<std::pair<std::uint64_t, int>, std::shared_ptr<ThreadGroup>> children;  // (split #, color)

  void barrier_locked(std::unique_lock<std::mutex>& lock, const char* what, bool last = false) {
    const std::uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      family->cv.notify_all();
      return;
    }
    family->wait(lock, [&] { return generation != gen; }, what, last);
  }
};

}  // namespace detail

/// P ranks as threads of one process, over memory space `Space`. A handle: cheap to copy,
/// every copy is the same rank. Create the ranks with run_ranks(). If any rank throws, the
/// others are woken from whatever they wait on with CommAborted, so nothing hangs.
template <class Space = HostSpace>
class BasicThreadCommunicator {
 public:
  static constexpr bool is_seqpar_communicator = true;  ///< opts in to the Communicator concept
  using memory_space = Space;                           ///< buffers live here

  /// A started exchange.
  struct request_type {
    std::shared_ptr<detail::ThreadGroup::Message> sent;  ///< our posted send
    std::byte* recv = nullptr;                           ///< where the receive lands
    std::size_t recv_bytes = 0;                          ///< expected size
    int source = -1;                                     ///< rank we receive from
  };

  /// Rank `rank` of `group`; made by run_ranks() and split(), not by users.
  BasicThreadCommunicator(std::shared_ptr<detail::ThreadGroup> group, int rank,
                          std::shared_ptr<CommStats> stats = std::make_shared<CommStats>())
      : group_(std::move(group)), rank_(rank), stats_(std::move(stats)) {}

  /// This rank.
  int rank() const { return rank_; }
  /// Ranks in the group.
  int size() const { return group_->size; }
  /// Counters (shared with communicators split from this one).
  const CommStats& stats() const { return *stats_; }
  /// Counters, mutable (to reset them).
  CommStats& stats() { return *stats_; }

  /// Variable-count all-to-all (see the Communicator concept). Each rank pulls its pieces out
  /// of the senders' buffers between two barriers.
  void all_to_all_v(const std::byte* send, std::span<const std::size_t> send_counts,
                    std::span<const std::size_t> send_displs, std::byte* recv,
                    std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    detail::check_all_to_all_spans("ThreadCommunicator", static_cast<std::size_t>(size()), send_counts.size(),
                                   send_displs.size(), recv_counts.size(), recv_displs.size());
    auto& fam = *group_->family;
    std::unique_lock lock(fam.mu);
    group_->slots[rank_] = {send, send_counts.data(), send_displs.data(), nullptr, 0};
    group_->barrier_locked(lock, "all_to_all_v");
    std::string mismatch;
    for (int j = 0; j < size() && mismatch.empty(); ++j) {
      const auto& s = group_->slots[j];
      if (s.counts[rank_] != recv_counts[j])
        mismatch = "all_to_all_v: rank " + std::to_string(j) + " sends " + std::to_string(s.counts[rank_]) +
                   " bytes to rank " + std::to_string(rank_) + ", which expects " + std::to_string(recv_counts[j]);
    }
    if (!mismatch.empty()) {
      fam.fail(lock, mismatch);
    }
    ++fam.active_reads;
    lock.unlock();
    for (int j = 0; j < size(); ++j) {
      const auto& s = group_->slots[j];
      SpaceCopy<Space>::copy(recv + recv_displs[j], s.data + s.displs[rank_], recv_counts[j]);
    }
    lock.lock();
    --fam.active_reads;
    fam.cv.notify_all();
    stats_->count_all_to_all(send_counts, rank_);
    group_->barrier_locked(lock, "all_to_all_v", true);
  }

  /// Starts sending `send_bytes` to `dest` and receiving `recv_bytes` from `source`. The send
  /// buffer must stay untouched until wait() returns.
  request_type start_exchange(const std::byte* send, std::size_t send_bytes, int dest, std::byte* recv,
                              std::size_t recv_bytes, int source) {
    check_rank(dest, "dest");
    check_rank(source, "source");
    auto msg = std::make_shared<detail::ThreadGroup::Message>();
    msg->data = send;
    msg->bytes = send_bytes;
    {
      std::lock_guard lock(group_->family->mu);
      group_->mailbox[static_cast<std::size_t>(rank_ * size() + dest)].push_back(msg);
      group_->family->cv.notify_all();
    }
    if (dest != rank_) {
      stats_->bytes_sent += send_bytes;
      ++stats_->messages_sent;
    }
    ++stats_->exchanges;
    return {std::move(msg), recv, recv_bytes, source};
  }

  /// Completes an exchange: copies the message from `source`, then waits until `dest` has
  /// taken ours.
  void wait(request_type& req) {
    auto& fam = *group_->family;
    std::unique_lock lock(fam.mu);
    auto& box = group_->mailbox[static_cast<std::size_t>(req.source * size() + rank_)];
    fam.wait(lock, [&] { return !box.empty(); }, "exchange (receive)");
    auto msg = box.front();
    box.pop_front();
    if (msg->bytes != req.recv_bytes) {
      const std::string why = "exchange: rank " + std::to_string(req.source) + " sent " +
                              std::to_string(msg->bytes) + " bytes to rank " + std::to_string(rank_) +
                              ", which expects " + std::to_string(req.recv_bytes);
      fam.fail(lock, why);
    }
    ++fam.active_reads;
    lock.unlock();
    SpaceCopy<Space>::copy(req.recv, msg->data, msg->bytes);
    lock.lock();
    --fam.active_reads;
    msg->done = true;
    fam.cv.notify_all();
    fam.wait(lock, [&] { return req.sent->done; }, "exchange (send)");
  }

  /// Metadata all-gather of host integers (every rank gives the same count).
  void all_gather_host(std::span<const std::int64_t> mine, std::span<std::int64_t> all) {
    SEQPAR_CHECK(all.size() == mine.size() * static_cast<std::size_t>(size()), ConfigError,
                 "all_gather_host: output size: expected ", mine.size() * size(), ", got ", all.size());
    auto& fam = *group_->family;
    std::unique_lock lock(fam.mu);
    group_->slots[rank_] = {nullptr, nullptr, nullptr, mine.data(), mine.size()};
    group_->barrier_locked(lock, "all_gather_host");
    for (int j = 0; j < size(); ++j) {
      const auto& s = group_->slots[j];
      if (s.n != mine.size()) {
        const std::string why = "all_gather_host: rank " + std::to_string(j) + " gives " + std::to_string(s.n) +
                                " integers, rank " + std::to_string(rank_) + " gives " + std::to_string(mine.size());
        fam.fail(lock, why);
      }
      std::copy(s.ints, s.ints + s.n, all.begin() + static_cast<std::ptrdiff_t>(j * mine.size()));
    }
    ++stats_->host_gathers;
    group_->barrier_locked(lock, "all_gather_host", true);
  }

  /// Blocks until every rank of the group arrives.
  void barrier() {
    std::unique_lock lock(group_->family->mu);
    group_->barrier_locked(lock, "barrier", true);
  }

  /// Splits into one communicator per color, ranked by (key, rank). Collective.
  BasicThreadCommunicator split(int color, int key) {
    const std::int64_t mine[2] = {color, key};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size()));
    all_gather_host(mine, all);
    --stats_->host_gathers;  // construction-time bookkeeping, not metadata traffic
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
      if (!slot) slot = std::make_shared<detail::ThreadGroup>(group_->family, static_cast<int>(members.size()));
      child = slot;
    }
    ++splits_;
    return BasicThreadCommunicator(std::move(child), new_rank, stats_);
  }

 private:
  void check_rank(int r, const char* name) const {
    SEQPAR_CHECK(r >= 0 && r < size(), ConfigError, "ThreadCommunicator: ", name, ": expected a rank in [0, ",
                 size(), "), got ", r);
  }
  std::shared_ptr<detail::ThreadGroup> group_;
  int rank_;
  std::shared_ptr<CommStats> stats_;
  std::uint64_t splits_ = 0;
};

/// Threads over host memory.
using ThreadCommunicator = BasicThreadCommunicator<HostSpace>;

/// Runs `fn(comm)` on `ranks` threads, each with its own rank of a fresh world, and returns
/// when all have finished. If a rank throws, the others are woken with CommAborted, and the
/// first original exception (not a CommAborted it caused) is rethrown here.
template <class Space = HostSpace, class Fn>
void run_ranks(int ranks, Fn&& fn, ThreadRunOptions options = {}) {
  SEQPAR_CHECK(ranks >= 1, ConfigError, "run_ranks: ranks: expected >= 1, got ", ranks);
  auto family = std::make_shared<detail::ThreadFamily>();
  family->timeout = options.timeout;
  auto world = std::make_shared<detail::ThreadGroup>(family, ranks);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        BasicThreadCommunicator<Space> comm(world, r);
        fn(comm);
      } catch (const std::exception& e) {
        errors[r] = std::current_exception();
        family->abort("rank " + std::to_string(r) + " failed: " + e.what());
      } catch (...) {
        errors[r] = std::current_exception();
        family->abort("rank " + std::to_string(r) + " failed");
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
