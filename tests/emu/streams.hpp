#pragma once
// Emulated CUDA streams (internal to tests/emu; runtime.cpp implements them, nccl.cpp queues
// its transfers on them).
//
// Work is queued, not run: a stream's work runs only when something synchronises with it
// (cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize, a blocking copy, or
// another stream's work that waits for it through an event or an NCCL receive), and then only
// as far as needed, after whatever it waits for. So work runs at the latest moment CUDA
// allows: a host read without the synchronisation it needs, or a stream that does not wait
// for the event it should, sees data that is not there yet, every time, instead of by chance.
// Legacy default stream semantics follow CUDA: the legacy stream and the blocking streams of a
// device wait for each other; non-blocking streams wait for nothing they are not told to.

#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

namespace seqpar_emu {

/// One queued piece of work; its result is reported by the synchronisation that runs it.
using Work = std::function<cudaError_t()>;

struct Stream;

/// "Wait until `stream` has run its first `count` pieces of work."
struct Dep {
  Stream* stream;
  std::uint64_t count;
};

/// The stream a handle names: the legacy default stream (0, cudaStreamLegacy) and the
/// per-thread default stream resolved for the calling thread's current device.
Stream* stream_of(cudaStream_t handle);
/// Queues `work` on `s` after `deps`; returns the number of pieces `s` has queued so far,
/// this one included (a Dep on that count waits for it).
std::uint64_t enqueue(Stream* s, Work work, std::vector<Dep> deps = {});
/// Runs `s` up to its first `count` pieces (and what they wait for); the first error.
cudaError_t run_until(Stream* s, std::uint64_t count);

/// The lock over every stream's queue, and its condition variable (notified whenever work
/// finishes; NCCL's matching waits on it too).
std::mutex& queue_mutex();
std::condition_variable& queue_cv();

}  // namespace seqpar_emu
