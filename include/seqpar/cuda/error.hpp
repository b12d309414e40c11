#pragma once
/// \file
/// CUDA runtime error checks: every CUDA call seqpar makes goes through SEQPAR_CUDA_CHECK, which
/// throws seqpar::CudaError naming the call, the error and file:line. Host code only; a plain
/// C++ compiler can include it (with the CUDA include directory).

#include <cuda_runtime_api.h>

#include "seqpar/core/error.hpp"

namespace seqpar::detail {

/// Throws CudaError for a failed CUDA runtime call `what`.
[[noreturn]] inline void throw_cuda_error(cudaError_t rc, const char* what, const char* file, int line) {
  throw_error<CudaError>(file, line, what, " failed: ", cudaGetErrorName(rc), " (", cudaGetErrorString(rc), ")");
}

/// Number of CUDA devices, or 0 when there is no usable device or driver (never throws:
/// programs use it to decide whether to skip GPU work). Clears the error it may leave.
inline int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace seqpar::detail

/// Evaluates a CUDA runtime call and throws seqpar::CudaError unless it returns cudaSuccess.
#define SEQPAR_CUDA_CHECK(call)                                                            \
  do {                                                                                     \
    const cudaError_t seqpar_cuda_rc_ = (call);                                            \
    if (seqpar_cuda_rc_ != cudaSuccess)                                                    \
      ::seqpar::detail::throw_cuda_error(seqpar_cuda_rc_, #call, __FILE__, __LINE__);      \
  } while (0)
