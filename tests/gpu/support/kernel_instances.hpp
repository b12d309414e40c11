#pragma once
/// \file
/// CudaFlashKernel's forward and backward for every element type the GPU tests use, compiled
/// once (kernel_instances_{f16,bf16,f32}.cu, one object per type) instead of in every program
/// (see seqpar/kernel/cuda/flash_kernel_instances.cuh). Where the build links those objects it
/// defines SEQPAR_EXTERN_KERNEL_INSTANCES, and this header declares the instantiations extern;
/// without it (a program compiled on its own) each program instantiates them as usual.

#include "seqpar/kernel/cuda/flash_kernel_instances.cuh"

/// Every instance of element type T: out in T, and in float (ring partial results) when T is not.
#define SEQPAR_KERNEL_INSTANCES(prefix, T)          \
  SEQPAR_CUDA_FLASH_FORWARD_INSTANCE(prefix, T, T) \
  SEQPAR_CUDA_FLASH_BACKWARD_INSTANCE(prefix, T)
#define SEQPAR_KERNEL_INSTANCES_16BIT(prefix, T) \
  SEQPAR_KERNEL_INSTANCES(prefix, T)             \
  SEQPAR_CUDA_FLASH_FORWARD_INSTANCE(prefix, T, float)

#if defined(SEQPAR_EXTERN_KERNEL_INSTANCES)
SEQPAR_KERNEL_INSTANCES_16BIT(extern, __half)
SEQPAR_KERNEL_INSTANCES_16BIT(extern, __nv_bfloat16)
SEQPAR_KERNEL_INSTANCES(extern, float)
#endif
