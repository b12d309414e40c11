#pragma once
/// \file
/// The in-process state behind ThreadCommunicator (comm/thread_communicator.hpp), shared by the
/// ranks of one run_ranks call: ThreadFamily (the one lock, the condition variable, failure
/// and time-out handling, and the drain that keeps a failing rank's buffers alive while peers
/// copy them), Channel (the per-pair mailbox of posted exchange messages) and ThreadGroup (one
/// communicator group: collective slots, barrier, channels, split children). All of it is
/// detail: split out so that the communicator's header holds only the communicator and
/// run_ranks. Include comm/thread_communicator.hpp to use them.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "seqpar/core/checked.hpp"
#include "seqpar/core/error.hpp"

namespace seqpar {

namespace detail {

/// ": what()" of the exception being handled, or "" when it is no std::exception (call
/// inside a catch block): the tail of the reason a failure gives the woken peers.
inline std::string current_what() {
  try {
    throw;
  } catch (const std::exception& e) {
    return std::string(": ") + e.what();
  } catch (...) {
    return {};
  }
}

/// State shared by every communicator of one run_ranks call (the world and all its splits).
/// One lock guards it all: the bookkeeping is tiny and the copies happen outside the lock.
///
/// Buffer safety rests on one rule: a copy out of (or into) another rank's buffer starts only
/// under the lock in a family that has not failed, and is counted in `active_reads` until it
/// ends. So once the family is aborted, `drain` bounds every copy that can still touch a
/// failing rank's memory.
struct ThreadFamily {
  std::mutex mu;
  std::condition_variable cv;
  bool aborted = false;
  std::string reason;
  int active_reads = 0;  // copies in progress between two ranks' buffers
  std::chrono::milliseconds timeout{0};
  std::vector<char> returned;  // per world rank: its rank function returned normally

  /// " (waiting for rank r ...)" naming the ranks of `world_ranks` a wait is for (group rank,
  /// world rank where it differs, and whether its rank function already returned).
  std::string waiting_for(const std::vector<std::pair<int, int>>& ranks) const {
    if (ranks.empty()) return {};
    std::string out = ranks.size() == 1 ? " (waiting for rank " : " (waiting for ranks ";
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      const auto [group_rank, world_rank] = ranks[i];
      if (i) out += ", ";
      out += std::to_string(group_rank);
      if (world_rank != group_rank) out += " (world rank " + std::to_string(world_rank) + ")";
      if (world_rank >= 0 && static_cast<std::size_t>(world_rank) < returned.size() &&
          returned[static_cast<std::size_t>(world_rank)])
        out += ", which returned from its rank function without calling it";
    }
    return out + ")";
  }

  /// Fails the family under the lock (the first reason is kept) and wakes every waiter.
  void abort_locked(std::string why) {
    if (!aborted) {
      aborted = true;
      reason = std::move(why);
    }
    cv.notify_all();
  }

  /// abort_locked, taking the lock.
  void abort(std::string why) {
    std::lock_guard lock(mu);
    abort_locked(std::move(why));
  }

  /// Blocks until no copy is in progress; after an abort no new one starts (see above).
  void drain(std::unique_lock<std::mutex>& lock) {
    cv.wait(lock, [&] { return active_reads == 0; });
  }

  /// Fails the whole family from a rank that found an error under `lock`, then throws
  /// CommError once no peer copies out of this rank's buffers any more.
  [[noreturn]] void fail(std::unique_lock<std::mutex>& lock, const std::string& why) {
    abort_locked(why);
    drain(lock);
    throw CommError("ThreadCommunicator: " + why);
  }

  /// Waits for `ready` under `lock`; throws CommAborted when a peer failed or on time-out.
  /// Before throwing it drains, so no peer reads a buffer that the unwinding stack is about
  /// to free. With `completed_wins`, a wait whose condition did come true returns normally
  /// even if a peer failed meanwhile: only for the last barrier of an operation (no buffer is
  /// read after it), so that ranks which then evaluate one check on the same gathered data
  /// all throw the same error, instead of a race deciding which of them see CommAborted.
  template <class Pred>
  void wait(std::unique_lock<std::mutex>& lock, Pred ready, const char* what, bool completed_wins = false) {
    wait_for(lock, ready, what, [] { return std::vector<std::pair<int, int>>{}; }, completed_wins);
  }

  /// wait(), where `peers()` lists the (group rank, world rank) pairs the wait is for: a
  /// time-out names them, and says which of them returned from its rank function.
  template <class Pred, class Peers>
  void wait_for(std::unique_lock<std::mutex>& lock, Pred ready, const char* what, Peers peers,
                bool completed_wins = false) {
    auto stop = [&] { return aborted || ready(); };
    // A time-out too large for the clock (milliseconds::max()) means "never": its deadline
    // saturates, and a deadline at the end of time is a plain wait.
    using Clock = std::chrono::steady_clock;
    const Clock::time_point deadline = saturating_deadline<Clock>(Clock::now(), timeout);
    if (timeout.count() > 0 && deadline != Clock::time_point::max()) {
      if (!cv.wait_until(lock, deadline, stop))
        abort_locked(std::string("time-out after ") + std::to_string(timeout.count()) + " ms in " + what +
                     waiting_for(peers()));
    } else {
      cv.wait(lock, stop);
    }
    if (ready() && (completed_wins || !aborted)) return;
    drain(lock);
    throw CommAborted(std::string("ThreadCommunicator: ") + what + " interrupted: " + reason);
  }

  /// Runs `copy` (between this rank's buffers and a peer's) with the lock released, counted
  /// in active_reads; `done` then runs under the lock, also when the copy throws (a device
  /// error). A copy that throws fails the family and drains before the exception leaves, as
  /// peers may be copying out of this rank's buffers.
  template <class Copy, class Done>
  void copy_unlocked(std::unique_lock<std::mutex>& lock, Copy&& copy, Done&& done) {
    ++active_reads;
    lock.unlock();
    try {
      copy();
    } catch (...) {
      lock.lock();
      --active_reads;
      done();
      abort_locked("a copy failed" + current_what());
      drain(lock);
      throw;
    }
    lock.lock();
    --active_reads;
    done();
    cv.notify_all();
  }
};

/// The exchange messages one rank posted to another, in posting order: a ring of reusable
/// slots, so that a steady stream of exchanges posts without allocating (the ring grows only
/// when more messages are outstanding on this pair than ever before). Message n lives in
/// slot n mod capacity from its post until its copy ends.
struct Channel {
  /// One posted message.
  struct Slot {
    const std::byte* data = nullptr;
    std::size_t bytes = 0;
    std::uint64_t tag = 0;   // the sender's call tag (call_tag, or untagged_exchange)
    bool withdrawn = false;  // its sender unwound: never to be read
  };
  std::vector<Slot> ring = std::vector<Slot>(2);  // two: a ring backward's hops in flight
  std::uint64_t posted = 0;     // messages posted by the sender
  std::uint64_t taken = 0;      // messages whose copy the receiver started (in order)
  std::uint64_t delivered = 0;  // messages whose copy ended (or that were refused)

  /// The slot of message `n`.
  Slot& at(std::uint64_t n) { return ring[n % ring.size()]; }
  /// True when the receiver can take the next message.
  bool ready() { return taken < posted && !at(taken).withdrawn; }

  /// Posts a message with its call tag; returns its number.
  std::uint64_t post(const std::byte* data, std::size_t bytes, std::uint64_t tag) {
    if (posted - delivered == ring.size()) {
      std::vector<Slot> bigger(2 * ring.size());
      for (std::uint64_t n = delivered; n < posted; ++n) bigger[n % bigger.size()] = at(n);
      ring.swap(bigger);
    }
    at(posted) = {data, bytes, tag, false};
    return posted++;
  }

  /// The sender gives message `n` up (its request dies unwaited): withdraws it if no copy
  /// started, else waits until the copy under way has ended. Either way nothing reads the
  /// buffer after this returns.
  void give_up(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, std::uint64_t n) {
    if (taken <= n) {
      at(n) = {nullptr, 0, 0, true};
      return;
    }
    cv.wait(lock, [&] { return delivered > n; });
  }
};

/// One group of ranks (the world or one color of a split).
struct ThreadGroup {
  /// What one rank publishes for a collective.
  struct Slot {
    const std::byte* data = nullptr;
    const std::size_t* counts = nullptr;
    const std::size_t* displs = nullptr;
    const std::int64_t* ints = nullptr;
    std::size_t n = 0;
  };

  /// A group of `n` ranks; `world` maps its ranks to world ranks (empty: it is the world).
  ThreadGroup(std::shared_ptr<ThreadFamily> f, int n, std::vector<int> world = {})
      : family(std::move(f)), size(n), slots(static_cast<std::size_t>(n)),
        channels(static_cast<std::size_t>(n) * static_cast<std::size_t>(n)), world_rank(std::move(world)),
        present(static_cast<std::size_t>(n), 0) {
    if (world_rank.empty())
      for (int r = 0; r < n; ++r) world_rank.push_back(r);
  }

  std::shared_ptr<ThreadFamily> family;
  int size;
  std::vector<Slot> slots;
  std::vector<Channel> channels;  // [src * size + dst]
  std::vector<int> world_rank;    // [group rank]
  std::vector<char> present;      // [group rank]: arrived at the barrier under way
  int arrived = 0;
  std::uint64_t generation = 0;
  std::map<std::pair<std::uint64_t, int>, std::shared_ptr<ThreadGroup>> children;  // (split #, color)

  /// The messages `src` posts to `dst`.
  Channel& channel(int src, int dst) { return channels[static_cast<std::size_t>(src * size + dst)]; }

  /// The (group rank, world rank) pair of group rank `r`.
  std::pair<int, int> peer(int r) const { return {r, world_rank[static_cast<std::size_t>(r)]}; }

  /// Waits until every rank of the group has arrived; `rank` is the caller's group rank (see
  /// ThreadFamily::wait for `last`). A time-out names the ranks that have not arrived.
  void barrier_locked(std::unique_lock<std::mutex>& lock, const char* what, int rank, bool last = false) {
    const std::uint64_t gen = generation;
    // A failed family completes no barrier: the ranks that arrived first may have been woken
    // and have unwound the buffers they published, which the last one would then read.
    if (family->aborted) family->wait(lock, [] { return false; }, what);
    if (++arrived == size) {
      arrived = 0;
      std::fill(present.begin(), present.end(), char{0});
      ++generation;
      family->cv.notify_all();
      return;
    }
    present[static_cast<std::size_t>(rank)] = 1;
    family->wait_for(
        lock, [&] { return generation != gen; }, what,
        [&] {
          std::vector<std::pair<int, int>> missing;
          for (int r = 0; r < size; ++r)
            if (!present[static_cast<std::size_t>(r)]) missing.push_back(peer(r));
          return missing;
        },
        last);
  }
};

}  // namespace detail

}  // namespace seqpar
