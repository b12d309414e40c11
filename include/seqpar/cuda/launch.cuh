#pragma once
/// \file
/// How seqpar's CUDA code launches kernels and reaches dynamic shared memory. Both go through
/// here, instead of `<<<...>>>` and `extern __shared__` at each site, so that the same sources
/// also build with a host compiler for the CPU emulation of the device (tests/emu, which
/// defines SEQPAR_CUDA_EMULATION): the GPU code is then tested on machines without a GPU.

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "seqpar/cuda/error.hpp"

namespace seqpar::cuda_detail {

/// kernel<<<grid, block, smem, stream>>>(args...), then the launch error check.
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, Args&&... args) {
#if defined(SEQPAR_CUDA_EMULATION)
  ::seqpar_emu::launch(kernel, grid, block, smem, stream, std::forward<Args>(args)...);
#else
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
#endif
  SEQPAR_CUDA_CHECK(cudaGetLastError());
}

/// The block's dynamic shared memory, as T (16-byte aligned).
template <class T>
__device__ __forceinline__ T* dynamic_smem() {
#if defined(SEQPAR_CUDA_EMULATION)
  return static_cast<T*>(::seqpar_emu::dynamic_shared_memory());
#else
  extern __shared__ float4 seqpar_dynamic_smem[];
  return reinterpret_cast<T*>(seqpar_dynamic_smem);
#endif
}

}  // namespace seqpar::cuda_detail
