#pragma once
/// \file
/// Which vector instructions the CPU kernels use, chosen at run time.
///
/// A header-only library cannot choose its users' compiler flags, and the flags rarely name
/// the machine a program runs on: a binary built for plain x86-64 runs on cores with two
/// 512-bit FMA pipes, where a 256-bit kernel reaches half the peak. So CpuFlashKernel is
/// compiled once per instruction set, each copy under a function-level target (GCC/Clang
/// `#pragma GCC target` / `#pragma clang attribute`, see kernel/cpu/isa_kernels.hpp), and picks
/// the widest copy this CPU runs, once per process. No translation unit needs -mavx512f, so
/// nothing outside the kernel is compiled for instructions the CPU may not have.
///
/// The levels:
///  - `avx512`: 512-bit vectors, 32 registers (AVX-512 F/BW/DQ/VL with FMA).
///  - `avx2`: 256-bit vectors with FMA (and F16C, for fp16), 16 registers.
///  - `avx512_bf16`: `avx512` plus AVX512-BF16's dot product (vdpbf16ps), which forms two
///    bf16 products per float lane and instruction: bf16 inputs' forward runs its products on
///    it (twice the float FMA's work per instruction); everything else runs the avx512 copy.
///    Compiled by GCC only (its function-level target takes the BF16 intrinsics).
///  - `amx_bf16`: `avx512_bf16` plus AMX tiles (TDPBF16PS: a 16 x 16 float tile += a 16 x 32
///    bf16 tile times a 32 x 16 one per instruction, some 14x a core's FMA rate): bf16 inputs'
///    forward runs both products on tiles where its head dims are whole tiles (D a multiple of
///    32, D_v of 16), its backward all five where both are multiples of 32 (up to 512); the OS
///    must grant the tile state (Linux: arch_prctl, asked once).
///  - `vec128`: 128-bit vectors of whatever the compile target has (SSE2 on x86-64, NEON on
///    AArch64); always available, and the only level off x86.
/// The environment variable `SEQPAR_CPU_ISA` (amx_bf16, avx512_bf16, avx512, avx2 or vec128) caps the automatic
/// choice, e.g. to compare the paths on one machine; CpuFlashOptions::isa picks one per kernel.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "seqpar/core/error.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
/// 1 when the compiler can build the AVX2 and AVX-512 copies (GCC or Clang on x86).
#define SEQPAR_CPU_ISA_X86 1
#include <cpuid.h>
#else
/// 0: only the 128-bit copy of the CPU kernels (not GCC or Clang on x86).
#define SEQPAR_CPU_ISA_X86 0
#endif

#ifndef SEQPAR_CPU_ISA_DISPATCH
/// 1 (default): the CPU kernels are compiled once per level and the widest the CPU runs is
/// chosen at run time. 0: one copy only, for the translation unit's own target (AVX-512 with
/// -mavx512f, AVX2 with -mavx2 -mfma, else 128-bit vectors): a third of the compile time, for
/// programs built for the machine they run on (and for tests of code around the kernels).
#define SEQPAR_CPU_ISA_DISPATCH 1
#endif

#if SEQPAR_CPU_ISA_X86 && !defined(__clang__) && \
    (SEQPAR_CPU_ISA_DISPATCH || (defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
                                 defined(__AVX512DQ__) && defined(__AVX512VL__) && defined(__FMA__)))
/// 1 when the AVX512-BF16 products are compiled (GCC on x86, dispatching or built for a target
/// that has them).
#define SEQPAR_CPU_ISA_BF16_DOT 1
#else
/// 0: no AVX512-BF16 products (not GCC on x86, or a single-copy build for a target without them).
#define SEQPAR_CPU_ISA_BF16_DOT 0
#endif

#if SEQPAR_CPU_ISA_BF16_DOT && defined(__linux__) && \
    (SEQPAR_CPU_ISA_DISPATCH || (defined(__AMX_TILE__) && defined(__AMX_BF16__)))
/// 1 when the AMX tile products are compiled (as SEQPAR_CPU_ISA_BF16_DOT, on Linux, whose
/// arch_prctl grants the tile state).
#define SEQPAR_CPU_ISA_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
/// 0: no AMX tile products.
#define SEQPAR_CPU_ISA_AMX 0
#endif

namespace seqpar {

/// Vector instruction sets of the CPU kernels, narrowest first (see the file comment).
enum class CpuIsa {
  automatic = -1,  ///< the widest the CPU supports (capped by SEQPAR_CPU_ISA)
  vec128 = 0,      ///< 128-bit vectors of the compile target (SSE2, NEON)
  avx2 = 1,        ///< 256-bit AVX2 + FMA
  avx512 = 2,      ///< 512-bit AVX-512 (F, BW, DQ, VL) + FMA
  avx512_bf16 = 3, ///< avx512 plus AVX512-BF16 dot products for bf16 inputs
  amx_bf16 = 4,    ///< avx512_bf16 plus AMX tiles for bf16 inputs' forward and backward
};

/// The level's name as SEQPAR_CPU_ISA spells it ("avx512", "avx2", "vec128", "automatic").
constexpr const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::amx_bf16: return "amx_bf16";
    case CpuIsa::avx512_bf16: return "avx512_bf16";
    case CpuIsa::avx512: return "avx512";
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::vec128: return "vec128";
    default: return "automatic";
  }
}

/// Bits of one vector register at this level.
constexpr int cpu_isa_vector_bits(CpuIsa isa) {
  return isa == CpuIsa::avx512 || isa == CpuIsa::avx512_bf16 || isa == CpuIsa::amx_bf16 ? 512 : isa == CpuIsa::avx2 ? 256 : 128;
}

/// The level of the translation unit's own target: the one copy compiled when
/// SEQPAR_CPU_ISA_DISPATCH is 0.
inline constexpr CpuIsa target_cpu_isa =
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && defined(__FMA__)
    CpuIsa::avx512;
#elif defined(__AVX2__) && defined(__FMA__)
    CpuIsa::avx2;
#else
    CpuIsa::vec128;
#endif


/// Whether the kernels' copy for the level is compiled into this program (every level with
/// SEQPAR_CPU_ISA_DISPATCH, else target_cpu_isa alone; AVX levels only on x86).
constexpr bool cpu_isa_compiled(CpuIsa isa) {
  if (isa == CpuIsa::avx512_bf16) return SEQPAR_CPU_ISA_BF16_DOT;
  if (isa == CpuIsa::amx_bf16) return SEQPAR_CPU_ISA_AMX;
  if (!SEQPAR_CPU_ISA_DISPATCH) return isa == target_cpu_isa;
  return isa == CpuIsa::vec128 || (SEQPAR_CPU_ISA_X86 && (isa == CpuIsa::avx2 || isa == CpuIsa::avx512));
}

namespace detail {

#if SEQPAR_CPU_ISA_X86
/// Whether this CPU has F16C (CPUID leaf 1: ECX bit 29; Clang 14's __builtin_cpu_supports does
/// not know it).
inline bool cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && ((c >> 29) & 1u);
}
#endif

#if SEQPAR_CPU_ISA_AMX
/// Whether this CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22; GCC 12's
/// __builtin_cpu_supports does not know them) and the OS grants this process the tile data
/// state (Linux 5.16+: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once).
inline bool amx_granted() {
  static const bool granted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1u) || !((d >> 22) & 1u)) return false;
    constexpr long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
    return syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0;
  }();
  return granted;
}
#else
/// No AMX in this build.
inline bool amx_granted() { return false; }
#endif


}  // namespace detail

/// Whether this CPU (and OS: the register state must be saved) runs the level's copy, and the
/// copy is compiled in (cpu_isa_compiled).
inline bool cpu_isa_supported(CpuIsa isa) {
  if (!cpu_isa_compiled(isa)) return false;
#if SEQPAR_CPU_ISA_X86
  __builtin_cpu_init();  // idempotent; needed when called from a static initializer before libgcc's
#endif
  switch (isa) {
    case CpuIsa::vec128: return true;
#if SEQPAR_CPU_ISA_X86
    case CpuIsa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && detail::cpu_has_f16c();
    case CpuIsa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("fma");
    case CpuIsa::avx512_bf16: return cpu_isa_supported(CpuIsa::avx512) && __builtin_cpu_supports("avx512bf16");
    case CpuIsa::amx_bf16: return cpu_isa_supported(CpuIsa::avx512_bf16) && detail::amx_granted();
#endif
    default: return false;
  }
}

/// Parses a level name ("avx512_bf16", "avx512", "avx2", "vec128"; "scalar" and "sse2" mean
/// vec128); `fallback` for anything else.
constexpr CpuIsa parse_cpu_isa(std::string_view name, CpuIsa fallback) {
  if (name == "avx512_bf16") return CpuIsa::avx512_bf16;
  if (name == "amx_bf16") return CpuIsa::amx_bf16;
  if (name == "avx512") return CpuIsa::avx512;
  if (name == "avx2") return CpuIsa::avx2;
  if (name == "vec128" || name == "scalar" || name == "sse2" || name == "neon") return CpuIsa::vec128;
  return fallback;
}

#if SEQPAR_CPU_ISA_BF16_DOT
namespace detail {

/// Seconds of `rounds` x 16 independent 512-bit vdpbf16ps (`dot`) or vfmadd231ps, on zeroed
/// registers. Written in assembly so that the chains stay in registers at any optimisation
/// level (the figure decides a kernel path; the tests build at -O1).
__attribute__((target("avx512f"), noinline)) inline double time_vector_chains(std::int64_t rounds, bool dot) {
#define SEQPAR_CHAINS_OF(op) \
  op " %%zmm16, %%zmm17, %%zmm0\n\t" op " %%zmm16, %%zmm17, %%zmm1\n\t" op " %%zmm16, %%zmm17, %%zmm2\n\t"     \
  op " %%zmm16, %%zmm17, %%zmm3\n\t" op " %%zmm16, %%zmm17, %%zmm4\n\t" op " %%zmm16, %%zmm17, %%zmm5\n\t"     \
  op " %%zmm16, %%zmm17, %%zmm6\n\t" op " %%zmm16, %%zmm17, %%zmm7\n\t" op " %%zmm16, %%zmm17, %%zmm8\n\t"     \
  op " %%zmm16, %%zmm17, %%zmm9\n\t" op " %%zmm16, %%zmm17, %%zmm10\n\t" op " %%zmm16, %%zmm17, %%zmm11\n\t"   \
  op " %%zmm16, %%zmm17, %%zmm12\n\t" op " %%zmm16, %%zmm17, %%zmm13\n\t" op " %%zmm16, %%zmm17, %%zmm14\n\t"  \
  op " %%zmm16, %%zmm17, %%zmm15\n\t"
#define SEQPAR_ZERO_CHAINS \
  "vpxord %%zmm0, %%zmm0, %%zmm0\n\tvmovaps %%zmm0, %%zmm1\n\tvmovaps %%zmm0, %%zmm2\n\t"                 \
  "vmovaps %%zmm0, %%zmm3\n\tvmovaps %%zmm0, %%zmm4\n\tvmovaps %%zmm0, %%zmm5\n\tvmovaps %%zmm0, %%zmm6\n\t" \
  "vmovaps %%zmm0, %%zmm7\n\tvmovaps %%zmm0, %%zmm8\n\tvmovaps %%zmm0, %%zmm9\n\tvmovaps %%zmm0, %%zmm10\n\t" \
  "vmovaps %%zmm0, %%zmm11\n\tvmovaps %%zmm0, %%zmm12\n\tvmovaps %%zmm0, %%zmm13\n\t"                         \
  "vmovaps %%zmm0, %%zmm14\n\tvmovaps %%zmm0, %%zmm15\n\tvmovaps %%zmm0, %%zmm16\n\tvmovaps %%zmm0, %%zmm17\n\t"
#define SEQPAR_CLOBBERED_CHAINS                                                                              \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", \
      "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "cc"
  std::int64_t n = rounds;
  const auto t0 = std::chrono::steady_clock::now();
  if (dot)
    asm volatile(SEQPAR_ZERO_CHAINS "1:\n\t" SEQPAR_CHAINS_OF("vdpbf16ps") "dec %0\n\tjnz 1b\n\tvzeroupper"
                 : "+r"(n)::SEQPAR_CLOBBERED_CHAINS);
  else
    asm volatile(SEQPAR_ZERO_CHAINS "1:\n\t" SEQPAR_CHAINS_OF("vfmadd231ps") "dec %0\n\tjnz 1b\n\tvzeroupper"
                 : "+r"(n)::SEQPAR_CLOBBERED_CHAINS);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#undef SEQPAR_CHAINS_OF
#undef SEQPAR_ZERO_CHAINS
#undef SEQPAR_CLOBBERED_CHAINS
}

/// Float FLOP/s of 512-bit vdpbf16ps (64 per instruction) over those of 512-bit FMA (32),
/// both measured on this core in a short burst (about 1 ms in all; the better of three tries).
/// Only to be called where avx512_bf16 is supported.
inline double bf16_dot_over_fma() {
  constexpr std::int64_t rounds = 40000;
  double dot = 1e30, fma = 1e30;
  for (int tries = 0; tries < 3; ++tries) {
    dot = std::min(dot, time_vector_chains(rounds, true));
    fma = std::min(fma, time_vector_chains(rounds, false));
  }
  return (64.0 / dot) / (32.0 / fma);
}

}  // namespace detail
#endif

/// Whether the AVX512-BF16 dot product runs at least 1.25x the float FMA's FLOP/s on this
/// core, so that avx512_bf16's bf16 forward can beat the avx512 one. Its instruction forms
/// twice an FMA's flops, but cores issue it at different rates: measured 0.5x the FMA's FLOP/s
/// on the Intel Xeon of this library's perf notes (half an instruction per cycle against two
/// FMAs). Measured once per process; false where the level is not supported.
inline bool bf16_dot_pays() {
#if SEQPAR_CPU_ISA_BF16_DOT
  static const bool pays = cpu_isa_supported(CpuIsa::avx512_bf16) && detail::bf16_dot_over_fma() >= 1.25;
  return pays;
#else
  return false;
#endif
}

/// The widest level this CPU supports (and the program has compiled in): amx_bf16 where the
/// CPU and the OS give the tiles; avx512_bf16 only where its dot product pays
/// (bf16_dot_pays), since it changes only bf16's products.
inline CpuIsa widest_cpu_isa() {
  if (cpu_isa_supported(CpuIsa::amx_bf16)) return CpuIsa::amx_bf16;
  if (bf16_dot_pays()) return CpuIsa::avx512_bf16;
  for (CpuIsa isa : {CpuIsa::avx512, CpuIsa::avx2})
    if (cpu_isa_supported(isa)) return isa;
  return cpu_isa_compiled(CpuIsa::vec128) ? CpuIsa::vec128 : target_cpu_isa;
}

/// The level CpuIsa::automatic resolves to in this process: the widest supported, capped by
/// the environment variable SEQPAR_CPU_ISA when set. Decided once (the first call). A value
/// that names no level throws ConfigError (every call): a misspelt cap would otherwise run
/// the level the user meant to avoid, silently.
inline CpuIsa default_cpu_isa() {
  static const CpuIsa chosen = [] {
    CpuIsa isa = widest_cpu_isa();
    const char* env = std::getenv("SEQPAR_CPU_ISA");
    const std::string_view text = env ? env : "";
    if (!text.empty() && text != "automatic") {
      // A level parse_cpu_isa knows never parses to `automatic`: that is the unknown name.
      const CpuIsa cap = parse_cpu_isa(text, CpuIsa::automatic);
      SEQPAR_CHECK(cap != CpuIsa::automatic, ConfigError, "SEQPAR_CPU_ISA: expected amx_bf16, avx512_bf16, avx512, ",
                   "avx2 or vec128 (also scalar, sse2, neon: vec128; automatic: no cap), got '", text, "'");
      if (static_cast<int>(cap) < static_cast<int>(isa) && cpu_isa_supported(cap)) isa = cap;
    }
    return isa;
  }();
  return chosen;
}

/// Resolves `requested`: automatic becomes default_cpu_isa(); a level the CPU cannot run is a
/// ConfigError naming it.
inline CpuIsa resolve_cpu_isa(CpuIsa requested) {
  if (requested == CpuIsa::automatic) return default_cpu_isa();
  SEQPAR_CHECK(cpu_isa_supported(requested), ConfigError, "CpuFlashOptions::isa: ", cpu_isa_name(requested),
               cpu_isa_compiled(requested) ? " is not supported by this CPU" : " is not compiled in (SEQPAR_CPU_ISA_DISPATCH=0)",
               " (widest available: ", cpu_isa_name(widest_cpu_isa()), ")");
  return requested;
}

}  // namespace seqpar
