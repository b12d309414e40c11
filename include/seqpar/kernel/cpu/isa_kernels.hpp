#pragma once
/// \file
/// CpuFlashKernel's code compiled once per instruction set (kernel/cpu/isa.hpp), and the
/// run-time switch between the copies.
///
/// How: kernel/cpu/isa/kernels.inl (the SIMD layer, forward and backward) is included three
/// times, into namespaces detail::isa_avx512, detail::isa_avx2 and detail::isa_vec128, the
/// first two under a function-level target (`#pragma GCC target`, or Clang's
/// `#pragma clang attribute`) that covers every function, template and lambda defined there.
/// So the AVX-512 copy uses 512-bit vectors and 32 registers whatever flags the including
/// translation unit has, and nothing else in that unit is compiled for AVX-512 (a GCC 12
/// miscompile of constant vector initialisers under -mavx512f cannot reach user code). The
/// copies call each other never; the switch calls into one through a plain function call.
/// With SEQPAR_CPU_ISA_DISPATCH 0 only the copy of the unit's own target is compiled, without
/// a pragma.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "seqpar/core/bfloat16.hpp"
#include "seqpar/core/float16.hpp"
#include "seqpar/kernel/cpu/flash_backward.hpp"
#include "seqpar/kernel/cpu/flash_decode.hpp"
#include "seqpar/kernel/cpu/flash_scratch.hpp"
#include "seqpar/kernel/cpu/isa.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"

#if SEQPAR_CPU_ISA_X86
#include <immintrin.h>
#endif

/// _Pragma with its argument stringified.
#define SEQPAR_PRAGMA(x) _Pragma(#x)
#if defined(__CUDACC__)
/// Nothing under nvcc: its front end warns of `#pragma GCC unroll` in host code (a .cu file
/// that includes the CPU kernel), and the loops are correct without it.
#define SEQPAR_UNROLL(n)
#else
/// Unrolls the loop that follows `n` times (`#pragma GCC unroll`, which Clang reads too): for
/// small fixed-count loops over vectors that GCC at -O2 leaves rolled.
#define SEQPAR_UNROLL(n) SEQPAR_PRAGMA(GCC unroll n)
#endif
#if defined(__clang__)
/// Starts a region whose functions are compiled for the target `features` (a string literal).
#define SEQPAR_TARGET_PUSH(features) \
  SEQPAR_PRAGMA(clang attribute push(__attribute__((target(features))), apply_to = function))
/// Ends the region of SEQPAR_TARGET_PUSH.
#define SEQPAR_TARGET_POP() SEQPAR_PRAGMA(clang attribute pop)
#else
/// Starts a region whose functions are compiled for the target `features` (a string literal).
#define SEQPAR_TARGET_PUSH(features) SEQPAR_PRAGMA(GCC push_options) SEQPAR_PRAGMA(GCC target(features))
/// Ends the region of SEQPAR_TARGET_PUSH.
#define SEQPAR_TARGET_POP() SEQPAR_PRAGMA(GCC pop_options)
#endif
/// The target features of the AVX-512 and AVX2 copies (what cpu_isa_supported checks).
#define SEQPAR_TARGET_AVX512 "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma"
/// The target features of the AVX2 copy (F16C: its fp16 loads).
#define SEQPAR_TARGET_AVX2 "avx2,fma,f16c"

#if SEQPAR_CPU_ISA_DISPATCH && SEQPAR_CPU_ISA_X86
SEQPAR_TARGET_PUSH(SEQPAR_TARGET_AVX512)
#endif
#if SEQPAR_CPU_ISA_DISPATCH ? SEQPAR_CPU_ISA_X86 : defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && defined(__FMA__)
/// The AVX-512 copy.
namespace seqpar::detail::isa_avx512 {
/// Vector width of the copy being compiled, in bytes (read by cpu_isa_kernels.inl).
#define SEQPAR_ISA_BYTES 64
/// Vector registers of the copy being compiled (read by cpu_isa_kernels.inl).
#define SEQPAR_ISA_REGISTERS 32
#include "seqpar/kernel/cpu/isa/kernels.inl"
#undef SEQPAR_ISA_BYTES
#undef SEQPAR_ISA_REGISTERS
}  // namespace seqpar::detail::isa_avx512
/// Defined when the AVX-512 copy was compiled.
#define SEQPAR_HAS_ISA_AVX512 1
#endif
#if SEQPAR_CPU_ISA_DISPATCH && SEQPAR_CPU_ISA_X86
SEQPAR_TARGET_POP()
SEQPAR_TARGET_PUSH(SEQPAR_TARGET_AVX2)
#endif
#if SEQPAR_CPU_ISA_DISPATCH ? SEQPAR_CPU_ISA_X86 : !defined(SEQPAR_HAS_ISA_AVX512) && defined(__AVX2__) && defined(__FMA__)
/// The AVX2 copy.
namespace seqpar::detail::isa_avx2 {
/// Vector width of the copy being compiled, in bytes (read by cpu_isa_kernels.inl).
#define SEQPAR_ISA_BYTES 32
/// Vector registers of the copy being compiled (read by cpu_isa_kernels.inl).
#define SEQPAR_ISA_REGISTERS 16
#include "seqpar/kernel/cpu/isa/kernels.inl"
#undef SEQPAR_ISA_BYTES
#undef SEQPAR_ISA_REGISTERS
}  // namespace seqpar::detail::isa_avx2
/// Defined when the AVX2 copy was compiled.
#define SEQPAR_HAS_ISA_AVX2 1
#endif
#if SEQPAR_CPU_ISA_DISPATCH && SEQPAR_CPU_ISA_X86
SEQPAR_TARGET_POP()
#endif

#if SEQPAR_CPU_ISA_DISPATCH || !(defined(SEQPAR_HAS_ISA_AVX512) || defined(SEQPAR_HAS_ISA_AVX2))
/// The 128-bit copy, compiled for the including unit's own target (SSE2, NEON, ...).
namespace seqpar::detail::isa_vec128 {
/// Vector width of the copy being compiled, in bytes (read by cpu_isa_kernels.inl).
#define SEQPAR_ISA_BYTES 16
#if defined(__aarch64__)
/// Vector registers of the copy being compiled (read by cpu_isa_kernels.inl).
#define SEQPAR_ISA_REGISTERS 32
#else
/// Vector registers of the copy being compiled (read by cpu_isa_kernels.inl).
#define SEQPAR_ISA_REGISTERS 16
#endif
#include "seqpar/kernel/cpu/isa/kernels.inl"
#undef SEQPAR_ISA_BYTES
#undef SEQPAR_ISA_REGISTERS
}  // namespace seqpar::detail::isa_vec128
/// Defined when the 128-bit copy was compiled.
#define SEQPAR_HAS_ISA_VEC128 1
#endif

namespace seqpar::detail {

/// Calls `Fn::template run<Kernels>(args...)` with the IsaKernels of level `isa` (resolved,
/// not automatic: a compiled level, see cpu_isa_compiled). (A named functor
/// rather than a generic lambda: nvcc's front end crashes on the lambda form.)
template <class Fn, class... Args>
decltype(auto) dispatch_cpu_isa(CpuIsa isa, Args&&... args) {
  switch (isa) {
#ifdef SEQPAR_HAS_ISA_AVX512
    case CpuIsa::amx_bf16:     // the AVX-512 copy; its forward_amx is chosen by the caller
    case CpuIsa::avx512_bf16:  // the AVX-512 copy; its forward_bf16_dot is chosen by the caller
    case CpuIsa::avx512: return Fn::template run<isa_avx512::IsaKernels>(std::forward<Args>(args)...);
#endif
#ifdef SEQPAR_HAS_ISA_AVX2
    case CpuIsa::avx2: return Fn::template run<isa_avx2::IsaKernels>(std::forward<Args>(args)...);
#endif
    default:
#ifdef SEQPAR_HAS_ISA_VEC128
      return Fn::template run<isa_vec128::IsaKernels>(std::forward<Args>(args)...);
#elif defined(SEQPAR_HAS_ISA_AVX512)
      return Fn::template run<isa_avx512::IsaKernels>(std::forward<Args>(args)...);
#else
      return Fn::template run<isa_avx2::IsaKernels>(std::forward<Args>(args)...);
#endif
  }
}

/// dispatch_cpu_isa functor: IsaKernels::fma_burst(rounds, seed) into *sink; returns the
/// flops it did.
struct FmaBurst {
  /// See FmaBurst.
  template <class Kernels>
  static double run(std::int64_t rounds, float seed, float* sink) {
    *sink = Kernels::fma_burst(rounds, seed);
    return 2.0 * (Kernels::vector_bits / 32) * Kernels::burst_chains * static_cast<double>(rounds);
  }
};

}  // namespace seqpar::detail
