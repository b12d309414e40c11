#pragma once
/// \file
/// Compile CudaFlashKernel once per program instead of once per file. Its device code is most
/// of a .cu file's compile time (about a minute of CPU per 16-bit element type and
/// architecture). `forward` and `backward` are member templates defined outside the class, so
/// one file can instantiate the ones a program runs and every other file declare them extern:
///
///     // flash_instances.cu, compiled once:
///     #include "seqpar/kernel/cuda/flash_kernel_instances.cuh"
///     SEQPAR_CUDA_FLASH_FORWARD_INSTANCE(, __nv_bfloat16, __nv_bfloat16)
///
///     // each other .cu that runs attention, after including seqpar:
///     SEQPAR_CUDA_FLASH_FORWARD_INSTANCE(extern, __nv_bfloat16, __nv_bfloat16)
///
/// What SequenceParallelAttention<Policy, Comm, CudaFlashKernel> refers to, with any policy:
/// `forward<T, T>`; for half and bf16 also `forward<T, float>` (ring steps write partial outputs
/// in float, to merge them); `backward<T>` once it calls backward. An instance declared extern
/// and defined nowhere is a link error that names it. examples/cuda (flash_instances.cu) and
/// tests/gpu (support/kernel_instances.hpp) do this. The instances carry the MLA kernels unless
/// SEQPAR_CUDA_MLA_KERNELS is 0, which must then hold in every file of the program alike.

#include "seqpar/kernel/cuda/flash_kernel.cuh"

/// `prefix template` (prefix `extern`: a declaration; empty: the definition) of
/// CudaFlashKernel::forward<T, O>: inputs in T, output in O.
#define SEQPAR_CUDA_FLASH_FORWARD_INSTANCE(prefix, T, O)                                                        \
  prefix template void seqpar::CudaFlashKernel::forward<T, O>(                                                 \
      seqpar::TensorView<const T, seqpar::CudaSpace>, seqpar::TensorView<const T, seqpar::CudaSpace>,         \
      seqpar::TensorView<const T, seqpar::CudaSpace>, seqpar::TensorView<O, seqpar::CudaSpace>,               \
      seqpar::TensorView<seqpar::acc_t<T>, seqpar::CudaSpace>, const seqpar::KernelParams&) const;

/// The same for CudaFlashKernel::backward<T>.
#define SEQPAR_CUDA_FLASH_BACKWARD_INSTANCE(prefix, T)                                                          \
  prefix template void seqpar::CudaFlashKernel::backward<T>(                                                   \
      seqpar::TensorView<const T, seqpar::CudaSpace>, seqpar::TensorView<const T, seqpar::CudaSpace>,         \
      seqpar::TensorView<const T, seqpar::CudaSpace>, seqpar::TensorView<const T, seqpar::CudaSpace>,         \
      seqpar::TensorView<const T, seqpar::CudaSpace>, seqpar::TensorView<const seqpar::acc_t<T>, seqpar::CudaSpace>, \
      seqpar::TensorView<seqpar::acc_t<T>, seqpar::CudaSpace>, seqpar::TensorView<seqpar::acc_t<T>, seqpar::CudaSpace>, \
      seqpar::TensorView<seqpar::acc_t<T>, seqpar::CudaSpace>, const seqpar::KernelParams&) const;
