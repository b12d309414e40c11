#pragma once
/// \file
/// CudaFlashKernel: flash attention on NVIDIA GPUs for __half, __nv_bfloat16 and float inputs,
/// float32 accumulation and a natural-log float32 LSE, with the causal mask taken from global
/// positions and GQA through KernelParams. It models LocalAttentionKernel in CudaSpace.
///
/// Two forward paths, chosen per call:
/// - tensor cores (sm_80+, half/bf16, head_dim 64 or 128, 16-byte aligned rows): 64 query
///   rows x 64 keys per tile, four warps of 16 query rows (or, with set_query_tile(128), 128
///   rows: two m-tiles per warp), mma.sync m16n8k16 for Q K^T and P V with P kept in
///   registers, K/V fragments by ldmatrix, K/V tiles streamed into shared memory with cp.async
///   (the V load overlaps Q K^T, the next K load overlaps softmax and P V);
/// - SIMT (every type, any head_dim <= 256, any strides): 32 x 32 tiles, one warp per eight
///   query rows, float in shared memory.
/// Both walk key tiles with the online softmax of kernel/tile_math.hpp, skip tiles a causal
/// mask hides (and stop at the first: positions increase), and test the mask per element
/// only on tiles it cuts. Query tiles are launched last-first so the heaviest causal tiles
/// start early.
///
/// Backward follows the LocalAttentionKernel contract: it recomputes P from the saved LSE and
/// ADDS into float dq, dk, dv with atomics, so ring steps and query heads sharing a K/V head
/// accumulate. One block per 64-key (SIMT: 32-key) tile keeps that tile's dK, dV in registers
/// while the query tiles stream past, and adds its share of dQ to global memory. It needs no
/// scratch: each block recomputes rowsum(dO * O) for the query tiles it visits. Two paths, on
/// the forward's conditions (and dout's rows 16-byte aligned):
/// - tensor cores (half/bf16, head_dim 64 or 128): all five products (S, dP, dV, dK, dQ) by
///   mma.sync with ldmatrix operands, P and dS fed back from the accumulators as A operands;
/// - SIMT (every type, any head_dim <= 256): float in shared memory.
///
/// Every launch goes on `stream()`; nothing synchronises the host and nothing is allocated.

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <limits>
#include <mutex>
#include <type_traits>

#include "seqpar/core/cuda_error.hpp"
#include "seqpar/core/cuda_types.hpp"
#include "seqpar/kernel/cuda_ops.cuh"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/kernel/tile_math.hpp"

namespace seqpar {
namespace cuda_detail {

/// Everything a forward kernel reads besides shared memory.
template <class T, class O>
struct FwdArgs {
  DeviceView<const T> q, k, v;
  DeviceView<O> out;
  DeviceView<float> lse;  // data == nullptr: not written
  std::int64_t sq, sk;
  int dim;
  float scale_log2;  // softmax scale * log2(e)
  bool causal;
  tile::Positions qpos, kpos;
  tile::HeadMap heads;
};

/// Everything the backward kernel reads.
template <class T>
struct BwdArgs {
  DeviceView<const T> dout, q, k, v, out;
  DeviceView<const float> lse;
  DeviceView<float> dq, dk, dv;
  std::int64_t sq, sk;
  int dim;
  float scale;       // softmax scale
  float scale_log2;  // scale * log2(e)
  bool causal;
  tile::Positions qpos, kpos;
  tile::HeadMap heads;
};

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

inline constexpr std::int64_t no_position = std::numeric_limits<std::int64_t>::max();

// ---------------------------------------------------------------------------------------
// SIMT forward: any type, head_dim <= 32 * DC.

inline constexpr int simt_bq = 32;       // query rows per block (8 per warp)
inline constexpr int simt_bk = 32;       // keys per tile (one per lane)
inline constexpr int simt_threads = 128;
inline constexpr int simt_rows = simt_bq / (simt_threads / 32);  // rows per warp

/// Padded row length of the float Q and K tiles (float4 loads of Q need a multiple of 4).
__host__ __device__ constexpr int simt_padded_dim(int dim) { return (dim + 3) & ~3; }

/// Dynamic shared memory of the SIMT forward: Q [bq][Dp], K [bk][Dp + 1] (odd stride: a lane
/// per key reads without bank conflicts), V [bk][32 DC], P [bq][bk].
constexpr std::size_t simt_fwd_smem(int dim, int dc) {
  const int dp = simt_padded_dim(dim);
  return sizeof(float) *
         (static_cast<std::size_t>(simt_bq) * dp + static_cast<std::size_t>(simt_bk) * (dp + 1) +
          static_cast<std::size_t>(simt_bk) * 32 * dc + static_cast<std::size_t>(simt_bq) * simt_bk);
}

template <class T, class O, int DC>
__global__ void __launch_bounds__(simt_threads) flash_fwd_simt(FwdArgs<T, O> a) {
  float* smem = dynamic_smem<float>();
  const int D = a.dim, Dp = simt_padded_dim(D), Dv = 32 * DC;
  float* sQ = smem;
  float* sK = sQ + simt_bq * Dp;
  float* sV = sK + simt_bk * (Dp + 1);
  float* sP = sV + simt_bk * Dv;

  const std::int64_t i0 = static_cast<std::int64_t>(gridDim.x - 1 - blockIdx.x) * simt_bq;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  const int nq = static_cast<int>(a.sq - i0 < simt_bq ? a.sq - i0 : simt_bq);
  const std::int64_t kh = a.heads.kv_head(h);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  for (int idx = tid; idx < simt_bq * Dp; idx += simt_threads) {
    const int r = idx / Dp, d = idx - r * Dp;
    sQ[idx] = (r < nq && d < D) ? to_float(a.q.row(b, i0 + r, h)[d]) * a.scale_log2 : 0.0f;
  }
  float m[simt_rows], l[simt_rows], o[simt_rows][DC];
  std::int64_t qp[simt_rows];
#pragma unroll
  for (int rr = 0; rr < simt_rows; ++rr) {
    m[rr] = -INFINITY;
    l[rr] = 0.0f;
#pragma unroll
    for (int c = 0; c < DC; ++c) o[rr][c] = 0.0f;
    const int r = warp * simt_rows + rr;
    qp[rr] = (a.causal && r < nq) ? a.qpos(i0 + r) : no_position;
  }
  const std::int64_t q_first = a.qpos(i0), q_last = a.qpos(i0 + nq - 1);

  for (std::int64_t j0 = 0; j0 < a.sk; j0 += simt_bk) {
    const int nk = static_cast<int>(a.sk - j0 < simt_bk ? a.sk - j0 : simt_bk);
    const tile::TileMask mask = tile::classify_tile(a.causal, q_first, q_last, a.kpos(j0), a.kpos(j0 + nk - 1));
    if (mask == tile::TileMask::hidden) break;
    __syncthreads();  // the previous tile's K, V, P are consumed
    for (int idx = tid; idx < simt_bk * Dp; idx += simt_threads) {
      const int j = idx / Dp, d = idx - j * Dp;
      sK[j * (Dp + 1) + d] = (j < nk && d < D) ? to_float(a.k.row(b, j0 + j, kh)[d]) : 0.0f;
    }
    for (int idx = tid; idx < simt_bk * Dv; idx += simt_threads) {
      const int j = idx / Dv, d = idx - j * Dv;
      sV[idx] = (j < nk && d < D) ? to_float(a.v.row(b, j0 + j, kh)[d]) : 0.0f;
    }
    __syncthreads();

    float s[simt_rows];
#pragma unroll
    for (int rr = 0; rr < simt_rows; ++rr) s[rr] = 0.0f;
    const float* kr = sK + lane * (Dp + 1);
    for (int d = 0; d < Dp; d += 4) {
      const float k0 = kr[d], k1 = kr[d + 1], k2 = kr[d + 2], k3 = kr[d + 3];
#pragma unroll
      for (int rr = 0; rr < simt_rows; ++rr) {
        const float4 qv = *reinterpret_cast<const float4*>(sQ + (warp * simt_rows + rr) * Dp + d);
        s[rr] += qv.x * k0 + qv.y * k1 + qv.z * k2 + qv.w * k3;
      }
    }
    const bool key_ok = lane < nk;
    const std::int64_t kp = (mask == tile::TileMask::partial && key_ok) ? a.kpos(j0 + lane) : 0;
#pragma unroll
    for (int rr = 0; rr < simt_rows; ++rr) {
      const bool visible = key_ok && (mask != tile::TileMask::partial || kp <= qp[rr]);
      const float x = visible ? s[rr] : -INFINITY;
      const float m_new = fmaxf(m[rr], warp_max(x));
      const float alpha = tile::rescale_factor(m[rr], m_new);
      const float p = tile::softmax_weight(x, m_new);
      l[rr] = l[rr] * alpha + warp_sum(p);
      m[rr] = m_new;
#pragma unroll
      for (int c = 0; c < DC; ++c) o[rr][c] *= alpha;
      sP[(warp * simt_rows + rr) * simt_bk + lane] = p;
    }
    __syncwarp();
    for (int j = 0; j < nk; ++j) {
      float vv[DC];
#pragma unroll
      for (int c = 0; c < DC; ++c) vv[c] = sV[j * Dv + lane + 32 * c];
#pragma unroll
      for (int rr = 0; rr < simt_rows; ++rr) {
        const float p = sP[(warp * simt_rows + rr) * simt_bk + j];
#pragma unroll
        for (int c = 0; c < DC; ++c) o[rr][c] += p * vv[c];
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < simt_rows; ++rr) {
    const int r = warp * simt_rows + rr;
    if (r >= nq) continue;
    const tile::RowFinish f = tile::finish_row(m[rr], l[rr]);
    O* orow = a.out.row(b, i0 + r, h);
#pragma unroll
    for (int c = 0; c < DC; ++c) {
      const int d = lane + 32 * c;
      if (d < D) orow[d] = convert<O>(o[rr][c] * f.inv_sum);
    }
    if (lane == 0 && a.lse.data) *a.lse.row(b, i0 + r, h) = f.lse;
  }
}

// ---------------------------------------------------------------------------------------
// Tensor-core forward: half / bf16, head_dim 64 or 128.

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

/// Query rows per block of the tensor-core forward with MT m-tiles (16 rows each) per warp.
template <int MT>
inline constexpr int mma_block_rows = 16 * MT * (mma_threads / 32);

/// Dynamic shared memory of the tensor-core forward: none with one m-tile per warp (K and V
/// are static, Q lives in registers); with two, Q [128][D + 8], K and V [64][D + 8].
template <class T, int D, int MT>
constexpr std::size_t mma_fwd_smem() {
  return MT == 1 ? 0 : sizeof(T) * static_cast<std::size_t>(mma_block_rows<MT> + 2 * mma_bk) * (D + 8);
}

/// The tensor-core forward. `ldsm`: K, V (and Q) fragments come from ldmatrix (four registers
/// per instruction); otherwise from 32- and 16-bit shared loads (the simpler, slower variant,
/// kept as a cross-check and fallback). MT m-tiles of 16 query rows per warp: MT = 1 keeps Q
/// in registers (64-row blocks, no dynamic shared memory); MT = 2 is FlashAttention-2's tile
/// for H100 (128-row blocks): each K and V fragment feeds two m-tiles, halving shared-memory
/// traffic per FLOP, and Q stays in shared memory to leave registers to the two accumulators.
template <class T, class O, int D, bool ldsm, int MT>
__global__ void __launch_bounds__(mma_threads) flash_fwd_mma(FwdArgs<T, O> a) {
  static_assert(MT == 1 || MT == 2, "flash_fwd_mma: one or two m-tiles per warp");
  constexpr int stride = D + 8;  // +8 elements: fragment loads hit 32 distinct banks
  constexpr int kc_steps = D / 16, nt_s = mma_bk / 8, nt_o = D / 8, bq = mma_block_rows<MT>;
  T* sK;
  T* sV;
  T* sQ;
  if constexpr (MT == 1) {
    __shared__ __align__(16) T sK1[mma_bk * stride];
    __shared__ __align__(16) T sV1[mma_bk * stride];
    sK = sK1;
    sV = sV1;
    sQ = sK1;  // Q is staged through sK on its way to registers
  } else {
    sQ = dynamic_smem<T>();
    sK = sQ + bq * stride;
    sV = sK + mma_bk * stride;
  }

  const std::int64_t i0 = static_cast<std::int64_t>(gridDim.x - 1 - blockIdx.x) * bq;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  const int nq = static_cast<int>(a.sq - i0 < bq ? a.sq - i0 : bq);
  const std::int64_t kh = a.heads.kv_head(h);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int warp_row = warp * 16 * MT;  // first query row of this warp in the block

  load_tile_async<T, D, bq>(sQ, a.q, b, i0, h, nq);
  cp_async_commit();
  // MT = 1: Q as A fragments in registers for the whole block. MT = 2: Q stays in shared
  // memory; its group completes with the first K tile's wait below.
  std::uint32_t qf[MT == 1 ? kc_steps : 1][4];
  if constexpr (MT == 1) {
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int kc = 0; kc < kc_steps; ++kc)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        qf[kc][r] = *reinterpret_cast<const std::uint32_t*>(sQ + warp_row * stride + kc * 16 +
                                                            tile::mma_a_offset(lane, r, stride));
    __syncthreads();
  }
  // The A fragment of m-tile mt, k-chunk kc.
  auto q_fragment = [&](std::uint32_t(&qa)[4], int mt, int kc) {
    if constexpr (MT == 1) {
#pragma unroll
      for (int r = 0; r < 4; ++r) qa[r] = qf[kc][r];
    } else {
      const T* base = sQ + (warp_row + 16 * mt) * stride + kc * 16;
      if constexpr (ldsm) {
        ldmatrix_x4<false>(qa, base + tile::ldmatrix_a_offset(lane, stride));
      } else {
#pragma unroll
        for (int r = 0; r < 4; ++r)
          qa[r] = *reinterpret_cast<const std::uint32_t*>(base + tile::mma_a_offset(lane, r, stride));
      }
    }
  };

  // This thread's query rows: C fragment rows g and g + 8 of each of its warp's m-tiles.
  std::int64_t qp[MT][2];
  int rows[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      rows[mt][hf] = warp_row + 16 * mt + tile::mma_c_coord(lane, 2 * hf).row;
      qp[mt][hf] = (a.causal && rows[mt][hf] < nq) ? a.qpos(i0 + rows[mt][hf]) : no_position;
    }
  const std::int64_t q_first = a.qpos(i0), q_last = a.qpos(i0 + nq - 1);
  auto tile_mask = [&](std::int64_t j0) {
    const std::int64_t last = (a.sk - j0 < mma_bk ? a.sk : j0 + mma_bk) - 1;
    return tile::classify_tile(a.causal, q_first, q_last, a.kpos(j0), a.kpos(last));
  };

  float oacc[MT][nt_o][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < nt_o; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) oacc[mt][n][i] = 0.0f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.0f;
  }

  bool tile_ok = a.sk > 0 && tile_mask(0) != tile::TileMask::hidden;
  if (tile_ok) load_tile_async<T, D>(sK, a.k, b, 0, kh, static_cast<int>(a.sk < mma_bk ? a.sk : mma_bk));
  cp_async_commit();

  for (std::int64_t j0 = 0; tile_ok; j0 += mma_bk) {
    const int nk = static_cast<int>(a.sk - j0 < mma_bk ? a.sk - j0 : mma_bk);
    const tile::TileMask mask = tile_mask(j0);
    load_tile_async<T, D>(sV, a.v, b, j0, kh, nk);
    cp_async_commit();
    cp_async_wait<1>();  // K(j0) (and Q) have landed; V may still be in flight
    __syncthreads();

    float sacc[MT][nt_s][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < nt_s; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) sacc[mt][nt][i] = 0.0f;
    // B = K^T: element (k = dim, n = key) is K[key][dim]; a register holds two adjacent dims.
#pragma unroll
    for (int kc = 0; kc < kc_steps; ++kc) {
      std::uint32_t qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) q_fragment(qa[mt], mt, kc);
      if constexpr (ldsm) {
        const int koff = tile::ldmatrix_k_offset(lane, stride);
#pragma unroll
        for (int nt = 0; nt < nt_s; nt += 2) {
          std::uint32_t kb[4];
          ldmatrix_x4<false>(kb, sK + nt * 8 * stride + kc * 16 + koff);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(sacc[mt][nt], qa[mt], kb[0], kb[1]);
            mma_16816<T>(sacc[mt][nt + 1], qa[mt], kb[2], kb[3]);
          }
        }
      } else {
        const int kb0 = tile::mma_b_offset_nk(lane, 0, stride), kb1 = tile::mma_b_offset_nk(lane, 1, stride);
#pragma unroll
        for (int nt = 0; nt < nt_s; ++nt) {
          const T* kr = sK + nt * 8 * stride + kc * 16;
          const std::uint32_t b0 = *reinterpret_cast<const std::uint32_t*>(kr + kb0);
          const std::uint32_t b1 = *reinterpret_cast<const std::uint32_t*>(kr + kb1);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma_16816<T>(sacc[mt][nt], qa[mt], b0, b1);
        }
      }
    }
    __syncthreads();  // every warp is done with sK: prefetch the next K tile into it
    const std::int64_t j1 = j0 + mma_bk;
    const bool next_ok = j1 < a.sk && tile_mask(j1) != tile::TileMask::hidden;
    if (next_ok) load_tile_async<T, D>(sK, a.k, b, j1, kh, static_cast<int>(a.sk - j1 < mma_bk ? a.sk - j1 : mma_bk));
    cp_async_commit();

    // Online softmax on the S fragments (row half 0: elements 0, 1; half 1: elements 2, 3).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < nt_s; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int col = nt * 8 + tile::mma_c_coord(lane, i).col;
          bool visible = col < nk;
          if (visible && mask == tile::TileMask::partial) visible = a.kpos(j0 + col) <= qp[mt][i >> 1];
          const float x = visible ? sacc[mt][nt][i] * a.scale_log2 : -INFINITY;
          sacc[mt][nt][i] = x;
          mx[i >> 1] = fmaxf(mx[i >> 1], x);
        }
      float alpha[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        // A row lives in the four lanes of a quad.
        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 1));
        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 2));
        const float mn = fmaxf(m[mt][hf], mx[hf]);
        alpha[hf] = tile::rescale_factor(m[mt][hf], mn);
        m[mt][hf] = mn;
      }
      float sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int nt = 0; nt < nt_s; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          sacc[mt][nt][i] = tile::softmax_weight(sacc[mt][nt][i], m[mt][i >> 1]);
          sum[i >> 1] += sacc[mt][nt][i];
        }
      // Partial sums stay per lane (alpha is the same in the four lanes); the quad adds them
      // at the end.
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) l[mt][hf] = l[mt][hf] * alpha[hf] + sum[hf];
#pragma unroll
      for (int n = 0; n < nt_o; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) oacc[mt][n][i] *= alpha[i >> 1];
    }

    cp_async_wait<1>();  // V(j0) has landed (the next K may still be in flight)
    __syncthreads();
    int vb[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) vb[i] = tile::mma_b_offset_kn(lane, i, stride);
    const int voff = tile::ldmatrix_v_offset(lane, stride);
#pragma unroll
    for (int kc = 0; kc < mma_bk / 16; ++kc) {
      // P's accumulator fragments of n-tiles 2kc, 2kc + 1 are exactly A's fragment of k-chunk kc.
      std::uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float* c = sacc[mt][2 * kc + tile::a_from_c_tile(2 * r)];
          const int e = tile::a_from_c_elem(2 * r);
          pa[mt][r] = pack_pair<T>(c[e], c[e + 1]);
        }
      // B = V: element (k = key, n = dim); a register holds two adjacent keys of one dim.
      const T* vk = sV + kc * 16 * stride;
      if constexpr (ldsm) {
#pragma unroll
        for (int n = 0; n < nt_o; n += 2) {
          std::uint32_t vb4[4];
          ldmatrix_x4<true>(vb4, vk + n * 8 + voff);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(oacc[mt][n], pa[mt], vb4[0], vb4[1]);
            mma_16816<T>(oacc[mt][n + 1], pa[mt], vb4[2], vb4[3]);
          }
        }
      } else {
#pragma unroll
        for (int n = 0; n < nt_o; ++n) {
          const T* vc = vk + n * 8;
          const std::uint32_t b0 = pack_bits(vc[vb[0]], vc[vb[1]]);
          const std::uint32_t b1 = pack_bits(vc[vb[2]], vc[vb[3]]);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma_16816<T>(oacc[mt][n], pa[mt], b0, b1);
        }
      }
    }
    __syncthreads();  // every warp is done with sV before the next V load
    tile_ok = next_ok;
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    tile::RowFinish f[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      l[mt][hf] += __shfl_xor_sync(0xffffffffu, l[mt][hf], 1);
      l[mt][hf] += __shfl_xor_sync(0xffffffffu, l[mt][hf], 2);
      f[hf] = tile::finish_row(m[mt][hf], l[mt][hf]);
    }
#pragma unroll
    for (int n = 0; n < nt_o; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = rows[mt][i >> 1];
        if (row < nq)
          a.out.row(b, i0 + row, h)[n * 8 + tile::mma_c_coord(lane, i).col] = convert<O>(oacc[mt][n][i] * f[i >> 1].inv_sum);
      }
    if ((lane & 3) == 0 && a.lse.data) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        if (rows[mt][hf] < nq) *a.lse.row(b, i0 + rows[mt][hf], h) = f[hf].lse;
    }
  }
}

// ---------------------------------------------------------------------------------------
// SIMT backward: any type, head_dim <= 32 * DC. One block per (key tile, query head, batch).

inline constexpr int bwd_bq = 32, bwd_bk = 32, bwd_threads = 128;
inline constexpr int bwd_rows = bwd_bq / (bwd_threads / 32);  // query rows (or keys) per warp

/// Dynamic shared memory of the backward: K, V [bk][Dp + 1]; Q, dO [bq][Dp]; P, dS [bq][bk + 1];
/// D_i, LSE [bq].
constexpr std::size_t simt_bwd_smem(int dim) {
  const std::size_t dp = static_cast<std::size_t>(simt_padded_dim(dim));
  return sizeof(float) * (2 * bwd_bk * (dp + 1) + 2 * bwd_bq * dp + 2 * bwd_bq * (bwd_bk + 1) + 2 * bwd_bq);
}

/// What the backward needs per query row besides Q and dO: D_i = rowsum(dO * O) into sD and
/// the LSE in log2 units into sL, for query rows i0 .. i0 + nq of head h; each warp fills ROWS
/// consecutive rows. Rows past nq get D = 0 and LSE = -inf, the marker of a row that
/// contributes nothing (so does a row that saw no key in the forward).
template <int ROWS, class T>
__device__ __forceinline__ void backward_row_stats(const BwdArgs<T>& a, std::int64_t b, std::int64_t h,
                                                   std::int64_t i0, int nq, float* sD, float* sL) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int rr = 0; rr < ROWS; ++rr) {
    const int r = warp * ROWS + rr;
    float acc = 0.0f;
    if (r < nq) {
      const T* orow = a.out.row(b, i0 + r, h);
      const T* grow = a.dout.row(b, i0 + r, h);
      for (int d = lane; d < a.dim; d += 32) acc += to_float(orow[d]) * to_float(grow[d]);
    }
    acc = warp_sum(acc);
    if (lane == 0) {
      sD[r] = acc;
      sL[r] = r < nq ? *a.lse.row(b, i0 + r, h) * tile::log2e : -INFINITY;
    }
  }
}

template <class T, int DC>
__global__ void __launch_bounds__(bwd_threads) flash_bwd_simt(BwdArgs<T> a) {
  float* smem = dynamic_smem<float>();
  const int D = a.dim, Dp = simt_padded_dim(D), Ks = Dp + 1, Ps = bwd_bk + 1;
  float* sK = smem;
  float* sV = sK + bwd_bk * Ks;
  float* sQ = sV + bwd_bk * Ks;
  float* sO = sQ + bwd_bq * Dp;  // dO
  float* sP = sO + bwd_bq * Dp;
  float* sS = sP + bwd_bq * Ps;  // dS
  float* sD = sS + bwd_bq * Ps;  // rowsum(dO * O)
  float* sL = sD + bwd_bq;       // LSE in log2 units; -inf: the row contributes nothing

  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * bwd_bk;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  const int nk = static_cast<int>(a.sk - j0 < bwd_bk ? a.sk - j0 : bwd_bk);
  const std::int64_t kh = a.heads.kv_head(h);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  for (int idx = tid; idx < bwd_bk * Dp; idx += bwd_threads) {
    const int j = idx / Dp, d = idx - j * Dp;
    const bool ok = j < nk && d < D;
    sK[j * Ks + d] = ok ? to_float(a.k.row(b, j0 + j, kh)[d]) : 0.0f;
    sV[j * Ks + d] = ok ? to_float(a.v.row(b, j0 + j, kh)[d]) : 0.0f;
  }
  const std::int64_t k_first = a.kpos(j0), k_last = a.kpos(j0 + nk - 1);
  const std::int64_t kp = (a.causal && lane < nk) ? a.kpos(j0 + lane) : 0;

  // dK, dV of keys warp * 8 + kk, columns lane + 32 c.
  float dk[bwd_rows][DC], dv[bwd_rows][DC];
#pragma unroll
  for (int kk = 0; kk < bwd_rows; ++kk)
#pragma unroll
    for (int c = 0; c < DC; ++c) dk[kk][c] = dv[kk][c] = 0.0f;

  for (std::int64_t i0 = 0; i0 < a.sq; i0 += bwd_bq) {
    const int nq = static_cast<int>(a.sq - i0 < bwd_bq ? a.sq - i0 : bwd_bq);
    const tile::TileMask mask = tile::classify_tile(a.causal, a.qpos(i0), a.qpos(i0 + nq - 1), k_first, k_last);
    if (mask == tile::TileMask::hidden) continue;
    __syncthreads();  // the previous query tile is consumed
    for (int idx = tid; idx < bwd_bq * Dp; idx += bwd_threads) {
      const int r = idx / Dp, d = idx - r * Dp;
      const bool ok = r < nq && d < D;
      sQ[idx] = ok ? to_float(a.q.row(b, i0 + r, h)[d]) : 0.0f;
      sO[idx] = ok ? to_float(a.dout.row(b, i0 + r, h)[d]) : 0.0f;
    }
    backward_row_stats<bwd_rows>(a, b, h, i0, nq, sD, sL);
    __syncthreads();

    // P and dS: lane = key, warp rows.
    const float* kr = sK + lane * Ks;
    const float* vr = sV + lane * Ks;
#pragma unroll
    for (int rr = 0; rr < bwd_rows; ++rr) {
      const int r = warp * bwd_rows + rr;
      const float* qr = sQ + r * Dp;
      const float* gr = sO + r * Dp;
      float s = 0.0f, dp = 0.0f;
      for (int d = 0; d < Dp; d += 4) {
        const float4 q4 = *reinterpret_cast<const float4*>(qr + d);
        const float4 g4 = *reinterpret_cast<const float4*>(gr + d);
        s += q4.x * kr[d] + q4.y * kr[d + 1] + q4.z * kr[d + 2] + q4.w * kr[d + 3];
        dp += g4.x * vr[d] + g4.y * vr[d + 1] + g4.z * vr[d + 2] + g4.w * vr[d + 3];
      }
      bool visible = lane < nk && r < nq && sL[r] != -INFINITY;
      if (visible && mask == tile::TileMask::partial) visible = kp <= a.qpos(i0 + r);
      const float p = visible ? tile::exp2_fast(s * a.scale_log2 - sL[r]) : 0.0f;
      sP[r * Ps + lane] = p;
      sS[r * Ps + lane] = p * (dp - sD[r]);
    }
    __syncthreads();

    // dV += P^T dO, dK += dS^T Q: warp keys, lane columns.
    for (int i = 0; i < nq; ++i) {
      float gq[DC], qq[DC];
#pragma unroll
      for (int c = 0; c < DC; ++c) {
        const int d = lane + 32 * c;
        gq[c] = d < Dp ? sO[i * Dp + d] : 0.0f;
        qq[c] = d < Dp ? sQ[i * Dp + d] : 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < bwd_rows; ++kk) {
        const float p = sP[i * Ps + warp * bwd_rows + kk], ds = sS[i * Ps + warp * bwd_rows + kk];
#pragma unroll
        for (int c = 0; c < DC; ++c) {
          dv[kk][c] += p * gq[c];
          dk[kk][c] += ds * qq[c];
        }
      }
    }
    // dQ += scale * dS K: warp rows, lane columns; other key tiles add to the same rows.
#pragma unroll
    for (int rr = 0; rr < bwd_rows; ++rr) {
      const int r = warp * bwd_rows + rr;
      if (r >= nq) continue;
      float acc[DC];
#pragma unroll
      for (int c = 0; c < DC; ++c) acc[c] = 0.0f;
      for (int j = 0; j < nk; ++j) {
        const float ds = sS[r * Ps + j];
#pragma unroll
        for (int c = 0; c < DC; ++c) {
          const int d = lane + 32 * c;
          acc[c] += ds * (d < Dp ? sK[j * Ks + d] : 0.0f);
        }
      }
      float* dqr = a.dq.row(b, i0 + r, h);
#pragma unroll
      for (int c = 0; c < DC; ++c) {
        const int d = lane + 32 * c;
        if (d < D) atomicAdd(dqr + d, acc[c] * a.scale);
      }
    }
  }

#pragma unroll
  for (int kk = 0; kk < bwd_rows; ++kk) {
    const int j = warp * bwd_rows + kk;
    if (j >= nk) continue;
    float* dkr = a.dk.row(b, j0 + j, kh);
    float* dvr = a.dv.row(b, j0 + j, kh);
#pragma unroll
    for (int c = 0; c < DC; ++c) {
      const int d = lane + 32 * c;
      if (d < D) {
        atomicAdd(dkr + d, dk[kk][c] * a.scale);
        atomicAdd(dvr + d, dv[kk][c]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Tensor-core backward: half / bf16, head_dim 64 or 128. One block per (key tile, query head,
// batch); each of the four warps owns 16 keys of the tile and keeps their dK, dV in registers
// while the query tiles stream past (FlashAttention-2's backward loop order).

inline constexpr int mma_bwd_bk = 64;  // keys per block: 16 per warp

/// Query rows per tile of the tensor-core backward: 64 at head_dim 64; 32 at 128, where the
/// dK and dV accumulators take 64 registers each and 64-query S and dP tiles would take the
/// rest (ptxas, sm_90: 255 registers with 64 query rows, 240 with 32).
template <int D>
inline constexpr int mma_bwd_bq = D <= 64 ? 64 : 32;

/// Dynamic shared memory of the tensor-core backward: K, V [64][D + 8] for the whole block;
/// Q, dO [BQ][D + 8] and dS [BQ][64 + 8] (T) per query tile; D_i and LSE [BQ] (float).
template <class T, int D>
constexpr std::size_t mma_bwd_smem() {
  constexpr std::size_t bq = mma_bwd_bq<D>;
  return sizeof(T) * ((2 * mma_bwd_bk + 2 * bq) * (D + 8) + bq * (mma_bwd_bk + 8)) + 2 * sizeof(float) * bq;
}

/// The tensor-core backward. Per query tile, warp w (keys 16w .. 16w + 15):
///   S^T = K Q^T and dP^T = V dO^T (mma, B operands by ldmatrix exactly as K^T in the forward);
///   P^T = exp2(S^T scale log2e - LSE), dS^T = P^T (dP^T - D) on the accumulators;
///   dV += P^T dO and dK += dS^T Q, with P^T and dS^T fed back as A operands from registers;
///   dS^T goes to shared memory as dS, and after one barrier each warp adds its share of
///   dQ = scale dS K into global memory (float atomics: other key blocks add to the same rows),
///   while the next query tile's Q and dO load.
/// P and dS are rounded to T as mma inputs (FlashAttention-2 does the same); every product
/// accumulates in float.
template <class T, int D>
__global__ void __launch_bounds__(mma_threads) flash_bwd_mma(BwdArgs<T> a) {
  constexpr int bk = mma_bwd_bk, bq = mma_bwd_bq<D>, stride = D + 8, ds_stride = bk + 8;
  constexpr int nt_q = bq / 8, nt_d = D / 8;
  // dQ: the tile's bq / 16 row blocks times column groups make four warp tasks.
  constexpr int row_blocks = bq / 16, col_groups = (mma_threads / 32) / row_blocks, nt_per_group = nt_d / col_groups;
  static_assert(row_blocks * col_groups == mma_threads / 32 && nt_per_group % 2 == 0, "flash_bwd_mma: dQ split");
  T* sK = dynamic_smem<T>();
  T* sV = sK + bk * stride;
  T* sQ = sV + bk * stride;
  T* sG = sQ + bq * stride;  // dO
  T* sS = sG + bq * stride;  // dS, [query][key]
  float* sL = reinterpret_cast<float*>(sS + bq * ds_stride);
  float* sD = sL + bq;

  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * bk;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  const int nk = static_cast<int>(a.sk - j0 < bk ? a.sk - j0 : bk);
  const std::int64_t kh = a.heads.kv_head(h);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int key0 = warp * 16;  // this warp's first key in the tile

  const std::int64_t k_first = a.kpos(j0), k_last = a.kpos(j0 + nk - 1);
  auto rows_of = [&](std::int64_t i0) { return static_cast<int>(a.sq - i0 < bq ? a.sq - i0 : bq); };
  auto tile_mask = [&](std::int64_t i0) {
    return tile::classify_tile(a.causal, a.qpos(i0), a.qpos(i0 + rows_of(i0) - 1), k_first, k_last);
  };
  // The first query tile at or after i0 that sees a key of this block (positions increase, so
  // the hidden tiles of a causal mask come first), or sq.
  auto next_tile = [&](std::int64_t i0) {
    while (i0 < a.sq && tile_mask(i0) == tile::TileMask::hidden) i0 += bq;
    return i0;
  };
  auto start_tile = [&](std::int64_t i0) {
    const int nq = rows_of(i0);
    load_tile_async<T, D, bq>(sQ, a.q, b, i0, h, nq);
    load_tile_async<T, D, bq>(sG, a.dout, b, i0, h, nq);
    cp_async_commit();
    backward_row_stats<bq / 4>(a, b, h, i0, nq, sD, sL);
  };
  std::int64_t i0 = next_tile(0);
  if (i0 >= a.sq) return;  // no query sees these keys: nothing to add (the same for every thread)

  // This lane's keys: accumulator rows g and g + 8 of the warp's 16.
  bool key_ok[2];
  std::int64_t kp[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int kr = key0 + tile::mma_c_coord(lane, 2 * hf).row;
    key_ok[hf] = kr < nk;
    kp[hf] = key_ok[hf] ? a.kpos(j0 + kr) : 0;
  }
  float dk[nt_d][4], dv[nt_d][4];
#pragma unroll
  for (int n = 0; n < nt_d; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) dk[n][i] = dv[n][i] = 0.0f;

  const int off_b = tile::ldmatrix_k_offset(lane, stride);   // B = X^T from a row-major X tile
  const int off_t = tile::ldmatrix_v_offset(lane, stride);   // B = X, loaded transposed
  load_tile_async<T, D>(sK, a.k, b, j0, kh, nk);
  load_tile_async<T, D>(sV, a.v, b, j0, kh, nk);
  start_tile(i0);
  cp_async_wait<0>();
  __syncthreads();
  while (i0 < a.sq) {
    const int nq = rows_of(i0);
    const tile::TileMask mask = tile_mask(i0);

    float s[nt_q][4], dp[nt_q][4];
#pragma unroll
    for (int nt = 0; nt < nt_q; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = dp[nt][i] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      std::uint32_t ka[4], va[4];
      ldmatrix_x4<false>(ka, sK + key0 * stride + kc * 16 + tile::ldmatrix_a_offset(lane, stride));
      ldmatrix_x4<false>(va, sV + key0 * stride + kc * 16 + tile::ldmatrix_a_offset(lane, stride));
#pragma unroll
      for (int nt = 0; nt < nt_q; nt += 2) {
        mma_x2<false>(s[nt], s[nt + 1], ka, sQ + nt * 8 * stride + kc * 16 + off_b);
        mma_x2<false>(dp[nt], dp[nt + 1], va, sG + nt * 8 * stride + kc * 16 + off_b);
      }
    }
    // P^T and dS^T: row = key, column = query (a column past nq has LSE = -inf). dS^T also
    // goes to shared memory as dS, for dQ = dS K, which needs every warp's keys.
#pragma unroll
    for (int nt = 0; nt < nt_q; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const tile::FragCoord c = tile::mma_c_coord(lane, i);
        const int col = nt * 8 + c.col;
        const float lse = sL[col];
        bool visible = key_ok[i >> 1] && lse != -INFINITY;
        if (visible && mask == tile::TileMask::partial) visible = kp[i >> 1] <= a.qpos(i0 + col);
        const float p = visible ? tile::exp2_fast(s[nt][i] * a.scale_log2 - lse) : 0.0f;
        s[nt][i] = p;
        dp[nt][i] = p * (dp[nt][i] - sD[col]);
        sS[col * ds_stride + key0 + c.row] = convert<T>(dp[nt][i]);
      }
#pragma unroll
    for (int kc = 0; kc < bq / 16; ++kc) {
      std::uint32_t pa[4], da[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int t = 2 * kc + tile::a_from_c_tile(2 * r), e = tile::a_from_c_elem(2 * r);
        pa[r] = pack_pair<T>(s[t][e], s[t][e + 1]);
        da[r] = pack_pair<T>(dp[t][e], dp[t][e + 1]);
      }
#pragma unroll
      for (int n = 0; n < nt_d; n += 2) {
        mma_x2<true>(dv[n], dv[n + 1], pa, sG + kc * 16 * stride + n * 8 + off_t);
        mma_x2<true>(dk[n], dk[n + 1], da, sQ + kc * 16 * stride + n * 8 + off_t);
      }
    }
    __syncthreads();  // dS is complete; every warp is done with sQ, sG, sL, sD
    const std::int64_t i1 = next_tile(i0 + bq);
    if (i1 < a.sq) start_tile(i1);  // lands while dQ is computed

    // dQ rows 16 rb .. 16 rb + 15, head-dim n-tiles of column group cg: A = dS rows, B = K.
    const int rb = warp % row_blocks, cg = warp / row_blocks;
    if (16 * rb < nq) {
      std::uint32_t sa[bk / 16][4];
#pragma unroll
      for (int kc = 0; kc < bk / 16; ++kc)
        ldmatrix_x4<false>(sa[kc], sS + 16 * rb * ds_stride + kc * 16 + tile::ldmatrix_a_offset(lane, ds_stride));
#pragma unroll
      for (int n = cg * nt_per_group; n < (cg + 1) * nt_per_group; n += 2) {
        float acc[2][4] = {};
#pragma unroll
        for (int kc = 0; kc < bk / 16; ++kc)
          mma_x2<true>(acc[0], acc[1], sa[kc], sK + kc * 16 * stride + n * 8 + off_t);
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const tile::FragCoord c = tile::mma_c_coord(lane, i);
            const int row = 16 * rb + c.row;
            if (row < nq) atomicAdd(a.dq.row(b, i0 + row, h) + (n + t) * 8 + c.col, acc[t][i] * a.scale);
          }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile is in; every warp is done with sS
    i0 = i1;
  }

#pragma unroll
  for (int n = 0; n < nt_d; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const tile::FragCoord c = tile::mma_c_coord(lane, i);
      const int kr = key0 + c.row;
      if (kr < nk) {
        atomicAdd(a.dk.row(b, j0 + kr, kh) + n * 8 + c.col, dk[n][i] * a.scale);
        atomicAdd(a.dv.row(b, j0 + kr, kh) + n * 8 + c.col, dv[n][i]);
      }
    }
}

/// Raises a kernel's dynamic shared memory limit when it needs more than the default 48 KiB.
/// The opt-in (cudaFuncSetAttribute, per kernel and device) is a host call into the driver, so
/// it is made once per kernel, device and size rather than on every launch; the record is
/// process-wide (a cudaDeviceReset, which forgets the opt-in, is not seen).
inline void allow_smem(const void* kernel, std::size_t bytes) {
  if (bytes <= 48 * 1024) return;
  int device = 0;
  SEQPAR_CUDA_CHECK(cudaGetDevice(&device));
  struct Grant {
    const void* kernel;
    int device;
    std::size_t bytes;
  };
  static std::mutex mu;
  static std::array<Grant, 128> grants{};  // more kernels x devices than this: no record, a call each time
  static std::size_t used = 0;
  std::lock_guard lock(mu);
  Grant* grant = nullptr;
  for (std::size_t i = 0; i < used; ++i)
    if (grants[i].kernel == kernel && grants[i].device == device) grant = &grants[i];
  if (grant && grant->bytes >= bytes) return;
  SEQPAR_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  if (grant)
    grant->bytes = bytes;
  else if (used < grants.size())
    grants[used++] = {kernel, device, bytes};
}
/// allow_smem for a typed kernel pointer.
template <class Kernel>
void allow_smem(Kernel* kernel, std::size_t bytes) {
  allow_smem(reinterpret_cast<const void*>(kernel), bytes);
}

template <class T, class Space>
bool rows_aligned_16(const TensorView<T, Space>& v) {
  constexpr std::int64_t per16 = 16 / static_cast<std::int64_t>(sizeof(T));
  return reinterpret_cast<std::uintptr_t>(v.data) % 16 == 0 && v.stride[0] % per16 == 0 &&
         v.stride[1] % per16 == 0 && v.stride[2] % per16 == 0;
}

}  // namespace cuda_detail

/// Flash attention in CUDA device memory (see the file comment). Set the stream with the
/// constructor, set_stream(), or use_stream() on a SequenceParallelAttention.
class CudaFlashKernel {
 public:
  static constexpr bool is_seqpar_kernel = true;  ///< opts in to LocalAttentionKernel
  using memory_space = CudaSpace;                 ///< device tensors
  static constexpr std::int64_t max_head_dim = 256;  ///< largest head_dim supported

  /// A kernel that launches on the legacy default stream (set_stream changes it).
  CudaFlashKernel() = default;
  /// A kernel that launches on `stream`.
  explicit CudaFlashKernel(cudaStream_t stream) : stream_(stream) {}

  /// The stream every launch goes on.
  cudaStream_t stream() const { return stream_; }
  /// Sets the stream.
  void set_stream(cudaStream_t s) { stream_ = s; }
  /// Allows (default) or forbids the tensor-core path; without it every call runs SIMT.
  void set_tensor_cores(bool on) { tensor_cores_ = on; }
  /// Whether the tensor-core path may be used.
  bool tensor_cores() const { return tensor_cores_; }
  /// Tensor-core path: load K and V fragments with ldmatrix (default, faster) or with plain
  /// shared loads (false; a cross-check of the ldmatrix layouts).
  void set_ldmatrix(bool on) { ldmatrix_ = on; }
  /// Whether the tensor-core path uses ldmatrix.
  bool ldmatrix() const { return ldmatrix_; }
  /// Tensor-core path: query rows per block, 64 (default: one 16-row m-tile per warp, Q in
  /// registers) or 128 (two m-tiles per warp sharing every K and V fragment, Q in shared
  /// memory: FlashAttention-2's H100 tile). tests/gpu/run.sh times both.
  void set_query_tile(int rows) {
    SEQPAR_CHECK(rows == 64 || rows == 128, ConfigError, "CudaFlashKernel::set_query_tile: expected 64 or 128, got ",
                 rows);
    query_tile_ = rows;
  }
  /// Query rows per block of the tensor-core path.
  int query_tile() const { return query_tile_; }

  /// Called when a plan is made: rejects head dims the kernels do not cover, before any forward.
  void prepare(std::int64_t head_dim) const {
    SEQPAR_CHECK(head_dim >= 1 && head_dim <= max_head_dim, ConfigError,
                 "CudaFlashKernel: head_dim: expected 1..", max_head_dim, ", got ", head_dim);
  }

  /// Which forward path these arguments take: "mma" (tensor cores) or "simt".
  template <class T>
  const char* forward_path(TensorView<const T, CudaSpace> q, TensorView<const T, CudaSpace> k,
                           TensorView<const T, CudaSpace> v) const {
    return uses_mma(q, k, v) ? "mma" : "simt";
  }

  /// Which backward path these arguments take: "mma" (tensor cores: the forward's conditions,
  /// dout's rows 16-byte aligned too) or "simt".
  template <class T>
  const char* backward_path(TensorView<const T, CudaSpace> dout, TensorView<const T, CudaSpace> q,
                            TensorView<const T, CudaSpace> k, TensorView<const T, CudaSpace> v) const {
    return uses_mma_backward(dout, q, k, v) ? "mma" : "simt";
  }

  /// See LocalAttentionKernel. `out` may be T or float (ring partial results); `lse` may be
  /// absent. Enqueued on stream(); returns without waiting.
  template <class T, class O>
  void forward(TensorView<const T, CudaSpace> q, TensorView<const T, CudaSpace> k, TensorView<const T, CudaSpace> v,
               TensorView<O, CudaSpace> out, TensorView<acc_t<T>, CudaSpace> lse, const KernelParams& p) const;

  /// See LocalAttentionKernel: adds this key block's contribution to dq, dk, dv (float).
  template <class T>
  void backward(TensorView<const T, CudaSpace> dout, TensorView<const T, CudaSpace> q, TensorView<const T, CudaSpace> k,
                TensorView<const T, CudaSpace> v, TensorView<const T, CudaSpace> out,
                TensorView<const acc_t<T>, CudaSpace> lse, TensorView<acc_t<T>, CudaSpace> dq,
                TensorView<acc_t<T>, CudaSpace> dk, TensorView<acc_t<T>, CudaSpace> dv, const KernelParams& p) const;

 private:
  template <class T>
  static constexpr bool is_element =
      std::is_same_v<T, float> || std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

  template <class T>
  static dim3 grid_of(const TensorView<T, CudaSpace>& rows, int tile) {
    const std::int64_t tiles = (rows.seq() + tile - 1) / tile;
    SEQPAR_CHECK(rows.heads() <= 65535 && rows.batch() <= 65535 && tiles <= 0x7fffffff, ConfigError,
                 "CudaFlashKernel: heads and batch must be <= 65535 each, got heads ", rows.heads(), ", batch ",
                 rows.batch());
    return dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(rows.heads()), static_cast<unsigned>(rows.batch()));
  }

  static void check_same(const char* name, const std::array<std::int64_t, 4>& got,
                         const std::array<std::int64_t, 4>& want) {
    for (int i = 0; i < 4; ++i)
      SEQPAR_CHECK(got[i] == want[i], ConfigError, "CudaFlashKernel: ", name, ".extent[", i, "]: expected ", want[i],
                   ", got ", got[i]);
  }

  template <class T>
  void check_shapes(const TensorView<const T, CudaSpace>& q, const TensorView<const T, CudaSpace>& k,
                    const TensorView<const T, CudaSpace>& v, const std::array<std::int64_t, 4>& out,
                    const char* what) const {
    SEQPAR_CHECK(q.dim() >= 1 && q.dim() <= max_head_dim, ConfigError, "CudaFlashKernel::", what,
                 ": head_dim: expected 1..", max_head_dim, ", got ", q.dim());
    SEQPAR_CHECK(k.dim() == q.dim() && v.dim() == q.dim() && k.batch() == q.batch() && v.batch() == q.batch(),
                 ConfigError, "CudaFlashKernel::", what, ": k and v must have q's batch ", q.batch(), " and head_dim ",
                 q.dim(), ", got k [", k.batch(), ", ", k.dim(), "], v [", v.batch(), ", ", v.dim(), "]");
    SEQPAR_CHECK(v.seq() == k.seq() && v.heads() == k.heads(), ConfigError, "CudaFlashKernel::", what,
                 ": v: expected k's seq ", k.seq(), " and heads ", k.heads(), ", got ", v.seq(), " and ", v.heads());
    check_same("out", out, q.extent);
  }

  template <class T>
  bool uses_mma(const TensorView<const T, CudaSpace>& q, const TensorView<const T, CudaSpace>& k,
                const TensorView<const T, CudaSpace>& v) const {
    if constexpr (std::is_same_v<T, float>) {
      return false;
    } else {
      if (!tensor_cores_ || (q.dim() != 64 && q.dim() != 128)) return false;
      if (!cuda_detail::rows_aligned_16(q) || !cuda_detail::rows_aligned_16(k) || !cuda_detail::rows_aligned_16(v))
        return false;
      return device_major() >= 8;
    }
  }

  template <class T>
  bool uses_mma_backward(const TensorView<const T, CudaSpace>& dout, const TensorView<const T, CudaSpace>& q,
                         const TensorView<const T, CudaSpace>& k, const TensorView<const T, CudaSpace>& v) const {
    return cuda_detail::rows_aligned_16(dout) && uses_mma(q, k, v);  // uses_mma: false for float
  }

  /// Compute capability (major) of the current device, remembered per device.
  int device_major() const {
    int dev = 0;
    SEQPAR_CUDA_CHECK(cudaGetDevice(&dev));
    if (dev != cached_device_) {
      int major = 0;
      SEQPAR_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
      cached_major_ = major;
      cached_device_ = dev;
    }
    return cached_major_;
  }

  template <class T, class O, int D>
  void launch_mma(const cuda_detail::FwdArgs<T, O>& a, const TensorView<const T, CudaSpace>& q) const {
    if (query_tile_ == 128)
      launch_mma_tiles<T, O, D, 2>(a, q);
    else
      launch_mma_tiles<T, O, D, 1>(a, q);
  }

  template <class T, class O, int D, int MT>
  void launch_mma_tiles(const cuda_detail::FwdArgs<T, O>& a, const TensorView<const T, CudaSpace>& q) const {
    auto* kernel = ldmatrix_ ? cuda_detail::flash_fwd_mma<T, O, D, true, MT> : cuda_detail::flash_fwd_mma<T, O, D, false, MT>;
    constexpr std::size_t smem = cuda_detail::mma_fwd_smem<T, D, MT>();
    cuda_detail::allow_smem(kernel, smem);
    cuda_detail::launch(kernel, grid_of(q, cuda_detail::mma_block_rows<MT>), cuda_detail::mma_threads, smem, stream_, a);
  }

  template <class T, class O, int DC>
  void launch_simt(const cuda_detail::FwdArgs<T, O>& a, const TensorView<const T, CudaSpace>& q) const {
    const std::size_t smem = cuda_detail::simt_fwd_smem(a.dim, DC);
    cuda_detail::allow_smem(cuda_detail::flash_fwd_simt<T, O, DC>, smem);
    cuda_detail::launch(cuda_detail::flash_fwd_simt<T, O, DC>, grid_of(q, cuda_detail::simt_bq),
                        cuda_detail::simt_threads, smem, stream_, a);
  }

  /// Launches a backward kernel: one block per `key_tile` keys, per query head (it reads K/V
  /// head kv_head(h)), per batch.
  template <class T>
  void launch_bwd(void (*kernel)(cuda_detail::BwdArgs<T>), const cuda_detail::BwdArgs<T>& a, int key_tile,
                  int threads, std::size_t smem, const TensorView<const T, CudaSpace>& k,
                  const TensorView<const T, CudaSpace>& q) const {
    cuda_detail::allow_smem(kernel, smem);
    const dim3 grid = grid_of(k, key_tile);
    cuda_detail::launch(kernel, dim3(grid.x, static_cast<unsigned>(q.heads()), grid.z), threads, smem, stream_, a);
  }
  template <class T, int DC>
  void launch_bwd_simt(const cuda_detail::BwdArgs<T>& a, const TensorView<const T, CudaSpace>& k,
                       const TensorView<const T, CudaSpace>& q) const {
    launch_bwd<T>(cuda_detail::flash_bwd_simt<T, DC>, a, cuda_detail::bwd_bk, cuda_detail::bwd_threads,
                  cuda_detail::simt_bwd_smem(a.dim), k, q);
  }
  template <class T, int D>
  void launch_bwd_mma(const cuda_detail::BwdArgs<T>& a, const TensorView<const T, CudaSpace>& k,
                      const TensorView<const T, CudaSpace>& q) const {
    launch_bwd<T>(cuda_detail::flash_bwd_mma<T, D>, a, cuda_detail::mma_bwd_bk, cuda_detail::mma_threads,
                  cuda_detail::mma_bwd_smem<T, D>(), k, q);
  }

  cudaStream_t stream_ = nullptr;
  bool tensor_cores_ = true;
  bool ldmatrix_ = true;
  int query_tile_ = 64;
  mutable int cached_device_ = -1;
  mutable int cached_major_ = 0;
};

// forward and backward are defined outside the class so that they are not inline: a program can
// then compile them once (explicit instantiation) and declare them `extern template` elsewhere.
template <class T, class O>
void CudaFlashKernel::forward(TensorView<const T, CudaSpace> q, TensorView<const T, CudaSpace> k,
                              TensorView<const T, CudaSpace> v, TensorView<O, CudaSpace> out,
                              TensorView<acc_t<T>, CudaSpace> lse, const KernelParams& p) const {
  static_assert(is_element<T>, "CudaFlashKernel: the element type must be __half, __nv_bfloat16 or float");
  static_assert(std::is_same_v<O, T> || std::is_same_v<O, float>, "CudaFlashKernel: out must have the input type or float");
  check_shapes(q, k, v, out.extent, "forward");
  SEQPAR_CHECK(lse.absent() || (lse.batch() == q.batch() && lse.seq() == q.seq() && lse.heads() == q.heads()),
               ConfigError, "CudaFlashKernel::forward: lse: expected [", q.batch(), ", ", q.seq(), ", ", q.heads(),
               ", 1], got [", lse.batch(), ", ", lse.seq(), ", ", lse.heads(), ", ", lse.dim(), "]");
  if (q.numel() == 0) return;
  cuda_detail::FwdArgs<T, O> a{cuda_detail::device_view(q), cuda_detail::device_view(k), cuda_detail::device_view(v),
                               cuda_detail::device_view(out), cuda_detail::device_view(lse),
                               q.seq(), k.seq(), static_cast<int>(q.dim()),
                               static_cast<float>(p.scale) * tile::log2e, p.causal,
                               tile::Positions::from(p.q_positions), tile::Positions::from(p.k_positions),
                               tile::HeadMap::from(p)};
  if (lse.absent()) a.lse.data = nullptr;
  if constexpr (!std::is_same_v<T, float>) {
    if (uses_mma(q, k, v)) {
      if (q.dim() == 64)
        launch_mma<T, O, 64>(a, q);
      else
        launch_mma<T, O, 128>(a, q);
      return;
    }
  }
  const int dim = static_cast<int>(q.dim());
  if (dim <= 64)
    launch_simt<T, O, 2>(a, q);
  else if (dim <= 128)
    launch_simt<T, O, 4>(a, q);
  else
    launch_simt<T, O, 8>(a, q);
}

template <class T>
void CudaFlashKernel::backward(TensorView<const T, CudaSpace> dout, TensorView<const T, CudaSpace> q,
                               TensorView<const T, CudaSpace> k, TensorView<const T, CudaSpace> v,
                               TensorView<const T, CudaSpace> out, TensorView<const acc_t<T>, CudaSpace> lse,
                               TensorView<acc_t<T>, CudaSpace> dq, TensorView<acc_t<T>, CudaSpace> dk,
                               TensorView<acc_t<T>, CudaSpace> dv, const KernelParams& p) const {
  static_assert(is_element<T>, "CudaFlashKernel: the element type must be __half, __nv_bfloat16 or float");
  check_shapes(q, k, v, out.extent, "backward");
  check_same("dout", dout.extent, q.extent);
  check_same("dq", dq.extent, q.extent);
  check_same("dk", dk.extent, k.extent);
  check_same("dv", dv.extent, v.extent);
  SEQPAR_CHECK(lse.batch() == q.batch() && lse.seq() == q.seq() && lse.heads() == q.heads(), ConfigError,
               "CudaFlashKernel::backward: lse: expected [", q.batch(), ", ", q.seq(), ", ", q.heads(), ", 1], got [",
               lse.batch(), ", ", lse.seq(), ", ", lse.heads(), ", ", lse.dim(), "]");
  if (q.numel() == 0 || k.seq() == 0) return;
  cuda_detail::BwdArgs<T> a{cuda_detail::device_view(dout), cuda_detail::device_view(q), cuda_detail::device_view(k),
                            cuda_detail::device_view(v), cuda_detail::device_view(out), cuda_detail::device_view(lse),
                            cuda_detail::device_view(dq), cuda_detail::device_view(dk), cuda_detail::device_view(dv),
                            q.seq(), k.seq(), static_cast<int>(q.dim()), static_cast<float>(p.scale),
                            static_cast<float>(p.scale) * tile::log2e, p.causal,
                            tile::Positions::from(p.q_positions), tile::Positions::from(p.k_positions),
                            tile::HeadMap::from(p)};
  if constexpr (!std::is_same_v<T, float>) {
    if (uses_mma_backward(dout, q, k, v)) {
      if (q.dim() == 64)
        launch_bwd_mma<T, 64>(a, k, q);
      else
        launch_bwd_mma<T, 128>(a, k, q);
      return;
    }
  }
  const int dim = static_cast<int>(q.dim());
  if (dim <= 64)
    launch_bwd_simt<T, 2>(a, k, q);
  else if (dim <= 128)
    launch_bwd_simt<T, 4>(a, k, q);
  else
    launch_bwd_simt<T, 8>(a, k, q);
}

/// Puts every launch and copy of `attn` (a SequenceParallelAttention over CUDA) on `stream`:
/// its kernel, its tensor operations and, when they have one, its communicators.
template <class Attention>
void use_stream(Attention& attn, cudaStream_t stream) {
  attn.kernel().set_stream(stream);
  attn.ops().set_stream(stream);
  if constexpr (requires { attn.world().set_stream(stream); }) {
    attn.world().set_stream(stream);
    attn.ulysses_comm().set_stream(stream);
    attn.ring_comm().set_stream(stream);
  }
}

}  // namespace seqpar
