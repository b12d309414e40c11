#pragma once
/// \file
/// CudaFlashKernel's forward and backward for every element type the GPU tests use, compiled
/// once (kernel_instances_{f16,bf16,f32}.cu, one object per type) instead of in every program:
/// their device code is most of each program's build time. Where the build links those objects
/// it defines SEQPAR_EXTERN_KERNEL_INSTANCES, and this header declares the instantiations extern;
/// without it (a program compiled on its own) each program instantiates them as usual.

#include "seqpar/kernel/cuda_flash_kernel.cuh"

/// `prefix template` declaration (prefix `extern`) or definition (prefix empty) of
/// CudaFlashKernel::forward<T, O>.
#define SEQPAR_KERNEL_FORWARD_INSTANCE(prefix, T, O)                                                          \
  prefix template void seqpar::CudaFlashKernel::forward<T, O>(                                               \
      seqpar::TensorView<const T, seqpar::CudaSpace>, seqpar::TensorView<const T, seqpar::CudaSpace>,       \
      seqpar::TensorView<const T, seqpar::CudaSpace>, seqpar::TensorView<O, seqpar::CudaSpace>,             \
      seqpar::TensorView<float, seqpar::CudaSpace>, const seqpar::KernelParams&) const;

/// The same for CudaFlashKernel::backward<T>.
#define SEQPAR_KERNEL_BACKWARD_INSTANCE(prefix, T)                                                            \
  prefix template void seqpar::CudaFlashKernel::backward<T>(                                                 \
      seqpar::TensorView<const T, seqpar::CudaSpace>, seqpar::TensorView<const T, seqpar::CudaSpace>,       \
      seqpar::TensorView<const T, seqpar::CudaSpace>, seqpar::TensorView<const T, seqpar::CudaSpace>,       \
      seqpar::TensorView<const T, seqpar::CudaSpace>, seqpar::TensorView<const float, seqpar::CudaSpace>,   \
      seqpar::TensorView<float, seqpar::CudaSpace>, seqpar::TensorView<float, seqpar::CudaSpace>,           \
      seqpar::TensorView<float, seqpar::CudaSpace>, const seqpar::KernelParams&) const;

/// Every instance of element type T: out in T, and in float (ring partial results) when T is not.
#define SEQPAR_KERNEL_INSTANCES(prefix, T)      \
  SEQPAR_KERNEL_FORWARD_INSTANCE(prefix, T, T)  \
  SEQPAR_KERNEL_BACKWARD_INSTANCE(prefix, T)
#define SEQPAR_KERNEL_INSTANCES_16BIT(prefix, T) \
  SEQPAR_KERNEL_INSTANCES(prefix, T)             \
  SEQPAR_KERNEL_FORWARD_INSTANCE(prefix, T, float)

#if defined(SEQPAR_EXTERN_KERNEL_INSTANCES)
SEQPAR_KERNEL_INSTANCES_16BIT(extern, __half)
SEQPAR_KERNEL_INSTANCES_16BIT(extern, __nv_bfloat16)
SEQPAR_KERNEL_INSTANCES(extern, float)
#endif
