#pragma once
/// \file
/// ThreadCommunicator over device memory: P ranks as threads of one process, all on one GPU
/// (or several, with unified addressing). It exists so that every policy can be checked on a
/// single GPU; real multi-GPU runs use NcclCommunicator.
///
/// Stream ordering (the choice, and why): the thread communicator moves bytes from the
/// receiving rank's thread, out of buffers that the sending rank's kernels filled on the
/// sender's stream, which the communicator cannot see. So each copy first waits for the whole
/// device (cudaDeviceSynchronize): everything any rank enqueued before it reached the
/// communicator — the sender's packing and this rank's kernels still reading the buffer about
/// to be overwritten — is then complete. The copy itself is synchronous (issued on the
/// per-thread default stream and waited for), so work a rank enqueues after the call sees the
/// bytes. This serialises the ranks on the device, which a correctness harness can afford; it
/// needs no stream from the user and works with any streams the ranks use.

#include <cuda_runtime_api.h>

#include <cstddef>

#include "seqpar/comm/thread_communicator.hpp"
#include "seqpar/cuda/error.hpp"
#include "seqpar/core/types.hpp"

namespace seqpar {

/// Device copies of BasicThreadCommunicator<CudaSpace> (see the file comment for the ordering).
template <>
struct SpaceCopy<CudaSpace> {
  /// Copies `bytes` from src to dst (device pointers, or any pointers CUDA can address), after
  /// all work enqueued on the device so far; returns when the bytes have landed.
  static void copy(std::byte* dst, const std::byte* src, std::size_t bytes) {
    if (bytes == 0) return;
    SEQPAR_CUDA_CHECK(cudaDeviceSynchronize());
    SEQPAR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cudaStreamPerThread));
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
  }
};

/// P ranks as threads over device memory (create them with run_ranks<CudaSpace>).
using CudaThreadCommunicator = BasicThreadCommunicator<CudaSpace>;

static_assert(Communicator<CudaThreadCommunicator>);

}  // namespace seqpar
