#pragma once
/// \file
/// Compiling CpuFlashKernel once per build instead of once per translation unit.
///
/// Nearly all of the CPU kernel's compile time is its per-instruction-set copies (three on x86:
/// AVX-512, AVX2, 128-bit), instantiated for each element type a unit uses: 8-10 s of a 17 s
/// example at -O3 with GCC 12. A build that links the CMake target `seqpar::cpu_kernels`
/// compiles them in four files of its own (src/cpu_kernels_f32.cpp and the like) and defines
/// SEQPAR_CPU_KERNELS_COMPILED=1 for the C++ units that link it: there the list below is
/// declared `extern template`, so those units call the compiled copies and instantiate none.
/// The copies are the same code either way (built with the build's own flags, not the linking
/// target's; the width they run is chosen at run time). A unit compiled without the definition
/// still instantiates what it uses, so both kinds of unit mix in one program.

#include <cstddef>
#include <cstdint>

#include "seqpar/core/bfloat16.hpp"
#include "seqpar/core/float16.hpp"
#include "seqpar/kernel/cpu/flash_kernel.hpp"  // (which includes this file at its end)

/// The explicit instantiations (`prefix` `template` to define them, `extern template` to
/// declare them) of CpuFlashKernel's entry points into its copies for element type T with
/// output T.
#define SEQPAR_CPU_KERNEL_INSTANCES(prefix, T)                                                             \
  SEQPAR_CPU_KERNEL_FORWARD(prefix, T, T)                                                                   \
  SEQPAR_CPU_KERNEL_DECODE(prefix, T, T)                                                                    \
  prefix void ::seqpar::CpuFlashKernel::backward_tasks<T>(                                                  \
      const ::seqpar::detail::FlashBackward<T, ::seqpar::acc_t<T>>&, std::byte*, std::int32_t*);
/// SEQPAR_CPU_KERNEL_INSTANCES of a 16-bit type T, and its forward and decode path with float
/// output.
#define SEQPAR_CPU_KERNEL_INSTANCES_16(prefix, T) \
  SEQPAR_CPU_KERNEL_INSTANCES(prefix, T) SEQPAR_CPU_KERNEL_FORWARD(prefix, T, float) SEQPAR_CPU_KERNEL_DECODE(prefix, T, float)

/// The forward entry point of (T, O), for SEQPAR_CPU_KERNEL_INSTANCES.
#define SEQPAR_CPU_KERNEL_FORWARD(prefix, T, O)                                                                   \
  prefix void ::seqpar::CpuFlashKernel::forward_tasks<T, O>(                                                     \
      ::seqpar::TensorView<const T>, ::seqpar::TensorView<const T>, ::seqpar::TensorView<const T>,               \
      ::seqpar::TensorView<O>, ::seqpar::TensorView<::seqpar::acc_t<T>>, const ::seqpar::KernelParams&);
/// The decode path's entry point of (T, O), for SEQPAR_CPU_KERNEL_INSTANCES.
#define SEQPAR_CPU_KERNEL_DECODE(prefix, T, O) \
  prefix void ::seqpar::CpuFlashKernel::decode_tasks<T, O>(const ::seqpar::detail::FlashDecode<T, O, ::seqpar::acc_t<T>>&);

#if defined(SEQPAR_CPU_KERNELS_COMPILED) && SEQPAR_CPU_KERNELS_COMPILED
SEQPAR_CPU_KERNEL_INSTANCES(extern template, float)
SEQPAR_CPU_KERNEL_INSTANCES(extern template, double)
SEQPAR_CPU_KERNEL_INSTANCES_16(extern template, ::seqpar::bf16)
SEQPAR_CPU_KERNEL_INSTANCES_16(extern template, ::seqpar::f16)
#endif
