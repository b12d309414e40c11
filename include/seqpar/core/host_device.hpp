#pragma once
/// \file
/// SEQPAR_HOST_DEVICE marks the small math functions that host code and CUDA kernels share
/// (the LSE merge, the online-softmax tile steps), so that one definition is tested on the
/// CPU and run on the GPU. Without nvcc it expands to nothing.

#if defined(__CUDACC__) || defined(__HIPCC__)
/// Callable from host and device code.
#define SEQPAR_HOST_DEVICE __host__ __device__
#else
/// Callable from host and device code (host-only build: nothing to add).
#define SEQPAR_HOST_DEVICE
#endif
