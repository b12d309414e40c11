#pragma once
/// \file
/// The tensor-core building blocks of CudaFlashKernel's sm_80+ kernels: mma.sync m16n8k16
/// (mma_16816, mma_x2), ldmatrix.x4, cp.async (cp_async_16, commit, wait, load_tile_async),
/// register packing of 16-bit pairs, and the block shape they assume (mma_bk keys per tile,
/// mma_threads threads). Each wraps inline PTX; under SEQPAR_CUDA_EMULATION (tests/emu) it
/// calls the CPU emulation instead, and below sm_80 it traps (the host never picks these paths
/// there). Also the NaN/Inf tests of 16-bit operands that tiles cut by the causal mask apply.
/// Used by kernel/cuda/flash_tensor_core_forward.cuh and
/// kernel/cuda/flash_tensor_core_backward.cuh.

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "seqpar/cuda/types.hpp"
#include "seqpar/ops/cuda_ops.cuh"
#include "seqpar/kernel/tile_math.hpp"

namespace seqpar {
namespace cuda_detail {

// ---------------------------------------------------------------------------------------
// Tensor-core primitives (the kernels: half / bf16, head_dim 64 or 128).

inline constexpr int mma_bk = 64;  // keys per tile
inline constexpr int mma_threads = 128;

/// Packs two floats into the 32-bit register of two T (first in the low half).
template <class T>
__device__ __forceinline__ std::uint32_t pack_pair(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    union {
      __half2 h;
      std::uint32_t u;
    } x{__floats2half2_rn(lo, hi)};
    return x.u;
  } else {
    union {
      __nv_bfloat162 h;
      std::uint32_t u;
    } x{__floats2bfloat162_rn(lo, hi)};
    return x.u;
  }
}

/// Packs two 16-bit elements read from shared memory (first in the low half).
template <class T>
__device__ __forceinline__ std::uint32_t pack_bits(const T& lo, const T& hi) {
  return static_cast<std::uint32_t>(reinterpret_cast<const std::uint16_t&>(lo)) |
         (static_cast<std::uint32_t>(reinterpret_cast<const std::uint16_t&>(hi)) << 16);
}

/// The exponent bits of T (__half or __nv_bfloat16): all set in a NaN or +-Inf element.
template <class T>
inline constexpr std::uint32_t exponent_bits = std::is_same_v<T, __half> ? tile::half_exponent : tile::bf16_exponent;

/// Whether one element of T (__half or __nv_bfloat16) is NaN or +-Inf.
template <class T>
__device__ __forceinline__ bool nonfinite(const T& x) {
  return tile::nonfinite16(reinterpret_cast<const std::uint16_t&>(x), exponent_bits<T>);
}

/// Replaces each NaN and +-Inf element of four packed operand registers by 0; returns whether
/// there was one.
template <class T>
__device__ __forceinline__ bool zero_nonfinite(std::uint32_t (&r)[4]) {
  bool found = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::uint32_t x = tile::zero_nonfinite_pair(r[i], exponent_bits<T>);
    found |= x != r[i];
    r[i] = x;
  }
  return found;
}

/// c += a * b for one m16n8k16 tile, float accumulators.
template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                          std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#elif defined(SEQPAR_CUDA_EMULATION)
  ::seqpar_emu::mma_16816<T>(c, a, b0, b1);
#else
  __trap();  // the host never picks this path below sm_80
#endif
}

/// 16-byte asynchronous copy global -> shared; `valid == false` writes zeros instead.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
#elif defined(SEQPAR_CUDA_EMULATION)
  ::seqpar_emu::cp_async_16(smem, gmem, valid);
#else
  __trap();
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#elif defined(SEQPAR_CUDA_EMULATION)
  ::seqpar_emu::cp_async_commit();
#endif
}
/// Waits until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#elif defined(SEQPAR_CUDA_EMULATION)
  ::seqpar_emu::cp_async_wait(N);
#endif
}

/// ldmatrix.x4: four 8 x 8 matrices of 16-bit elements from shared memory, one row address per
/// lane (see tile::ldmatrix_elem); `trans` loads them transposed.
template <bool trans>
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* smem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
#elif defined(SEQPAR_CUDA_EMULATION)
  ::seqpar_emu::ldmatrix_x4<trans>(r, smem);
#else
  __trap();
#endif
}

/// c0 += a B0 and c1 += a B1 for two adjacent n-tiles whose B fragments one ldmatrix.x4 loads
/// from `smem` (the row address of this lane: see tile::ldmatrix_k_offset, ldmatrix_v_offset).
template <bool trans, class T>
__device__ __forceinline__ void mma_x2(float (&c0)[4], float (&c1)[4], const std::uint32_t (&a)[4], const T* smem) {
  std::uint32_t b[4];
  ldmatrix_x4<trans>(b, smem);
  mma_16816<T>(c0, a, b[0], b[1]);
  mma_16816<T>(c1, a, b[2], b[3]);
}

/// Starts loading rows [j0, j0 + ROWS) of one head of `x` into a [ROWS][D + 8] shared tile;
/// rows past `n` become zeros (a zero V row keeps 0 * garbage from turning into NaN).
template <class T, int D, int ROWS = mma_bk>
__device__ __forceinline__ void load_tile_async(T* tile, const DeviceView<const T>& x, std::int64_t b,
                                                std::int64_t j0, std::int64_t head, int n) {
  constexpr int stride = D + 8, chunks = D / 8;
  for (int c = threadIdx.x; c < ROWS * chunks; c += mma_threads) {
    const int r = c / chunks, col = (c - r * chunks) * 8;
    const bool valid = r < n;
    const T* src = valid ? x.row(b, j0 + r, head) + col : x.data;
    cp_async_16(tile + r * stride + col, src, valid);
  }
}

}  // namespace cuda_detail
}  // namespace seqpar
