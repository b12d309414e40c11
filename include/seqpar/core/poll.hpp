#pragma once
/// \file
/// The one loop for waits that have nothing to block in: the MPI and NCCL communicators'
/// time-outs (MPI_Test*, cudaStreamQuery) and CpuFlashKernel backward's dQ turns poll a
/// condition until it holds or a deadline passes, with one back-off policy (Backoff).
///
/// The back-off, in three stages from the start of the wait:
///  1. spin: `spins` polls with only a CPU pause between them, for a condition due within
///     microseconds (a kernel thread a tile behind another); no clock is read;
///  2. yield: until `yield_for` has passed, yield the core between polls, so that a thread
///     ready to run on it (perhaps the one waited for) runs, and poll again as soon as it is back;
///  3. nap: then sleep `nap` between polls. A waiter leaves the cores to the threads and ranks
///     that compute, and a preempted peer on an oversubscribed machine gets its core back, at
///     the cost of at most `nap` of latency on a wait that is already long.
/// The deadline is read after every poll of stages 2 and 3 (stage 1 is a few microseconds).

#include <chrono>
#include <thread>

namespace seqpar {

/// The back-off of poll_until (see the file comment); the defaults are the communicators'.
struct Backoff {
  int spins = 0;                                  ///< stage 1: polls with a CPU pause between them
  std::chrono::microseconds yield_for{1000};      ///< stage 2 lasts until this long after the start
  std::chrono::microseconds nap{100};             ///< stage 3: sleep between polls
};

/// The deadline of a wait that never gives up.
inline constexpr std::chrono::steady_clock::time_point no_deadline = std::chrono::steady_clock::time_point::max();

/// A hint to the CPU that this thread spins (x86 `pause`: the sibling hyper-thread gets the
/// core's resources); elsewhere a yield.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

/// Calls `done()` until it returns true (then returns true) or `deadline` passes (then returns
/// false), backing off between calls as `backoff` says. `done` may throw: the error of the
/// thing waited for leaves through it. `done` is always called at least once.
template <class Done>
bool poll_until(Done&& done, std::chrono::steady_clock::time_point deadline, const Backoff& backoff = {}) {
  for (int spin = 0; spin < backoff.spins; ++spin) {
    if (done()) return true;
    cpu_relax();
  }
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  for (;;) {
    if (done()) return true;
    const Clock::time_point now = Clock::now();
    if (now >= deadline) return false;
    if (now - start < backoff.yield_for)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(backoff.nap);
  }
}

}  // namespace seqpar
