#pragma once
/// \file
/// The tensor-core forward of CudaFlashKernel at MLA decode's head dims, D = 576 and D_v = 512
/// (DeepSeek V3's latent attention with the projections absorbed: one K/V head, the latent,
/// read by every query head; 1-16 new query rows per sequence): flash_decode_mma, for __half
/// and __nv_bfloat16 on sm_80+, with or without a soft-cap. The prefill kernel's shape
/// (kernel/cuda/flash_tensor_core_forward.cuh: a warp owns 16 query rows and every output
/// column) does not fit these dims: 16 x 512 float accumulators are 256 registers per thread.
/// Here the query heads sharing a K/V head are packed with the query rows into the mma's M
/// dimension (32 rows per block, token-major: 32 heads of one new token, or fewer heads of
/// several), the four warps split the key tile for S = Q K^T and the 512 output columns for
/// P V, and the online softmax passes through shared memory between the two. Every K/V tile a
/// block loads serves 32 query heads, which is what decode with MQA needs: its work is reading
/// the cache. The host class (kernel/cuda/flash_kernel.cuh) picks it for (576, 512) on the
/// prefill kernel's conditions; the backward at these dims is SIMT's.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "seqpar/cuda/launch.cuh"
#include "seqpar/kernel/cuda/flash_args.cuh"
#include "seqpar/kernel/cuda/flash_mask.cuh"
#include "seqpar/kernel/cuda/flash_mma.cuh"
#include "seqpar/kernel/cuda/flash_tensor_core_forward.cuh"
#include "seqpar/kernel/tile_math.hpp"

namespace seqpar {
namespace cuda_detail {

inline constexpr int decode_dim = 576;    // D of the MLA decode kernel
inline constexpr int decode_dim_v = 512;  // D_v of the MLA decode kernel
inline constexpr int decode_rows = 32;    // packed (token, head) rows per block: two m-tiles
inline constexpr int decode_bk = 32;      // keys per tile

/// Shared-memory strides of the decode kernel (elements): Q and K rows, V rows, P rows (T) and
/// score rows (float); the +8 (+1) pads spread fragment loads over the banks.
inline constexpr int decode_stride = decode_dim + 8, decode_stride_v = decode_dim_v + 8,
                     decode_p_stride = decode_bk + 8, decode_s_stride = decode_bk + 1;

/// Dynamic shared memory of the decode kernel: Q [32][D + 8], K [32][D + 8], V [32][D_v + 8]
/// and P [32][32 + 8] in T; the scores [32][32 + 1] and each row's max, sum and rescale
/// factor [32] in float.
template <class T>
constexpr std::size_t decode_smem() {
  return sizeof(T) * (static_cast<std::size_t>(decode_rows + decode_bk) * decode_stride +
                      static_cast<std::size_t>(decode_bk) * decode_stride_v +
                      static_cast<std::size_t>(decode_rows) * decode_p_stride) +
         sizeof(float) * static_cast<std::size_t>(decode_rows) * (decode_s_stride + 3);
}

/// The local query heads that read local K/V head `kh`: [first, first + count), clipped to the
/// call's `heads` (a Ulysses rank may hold part of a group).
struct HeadGroup {
  std::int64_t first, count;
};
SEQPAR_HOST_DEVICE inline HeadGroup head_group(const tile::HeadMap& m, std::int64_t kh, std::int64_t heads) {
  const std::int64_t lo = (kh + m.kv_head_begin) * m.group_size - m.q_head_begin;
  const std::int64_t first = lo > 0 ? lo : 0, end = lo + m.group_size < heads ? lo + m.group_size : heads;
  return {first, end - first};
}

/// On a key tile the mask cuts, after zero_nonfinite_keys cleaned V for P V: gives back to each
/// of this thread's rows that sees key j the terms P_rj V_jd of the NaN and +-Inf elements V_jd
/// (read again from global memory) in this warp's columns, so that exactly the rows that see a
/// non-finite value get it. `sPf`: the tile's P in float; `bad`: zero_nonfinite_keys's marks,
/// four threads per key. Every index into oacc is a compile-time constant (registers).
template <class T, class O>
__device__ __forceinline__ void decode_restore_v(float (&oacc)[2][decode_dim_v / 32][4], const FwdArgs<T, O>& a,
                                                 const KeySpan32* spans, const float* sPf, const int* bad,
                                                 std::int64_t b, std::int64_t kh, int j0) {
  constexpr int tpk = mma_threads / decode_bk;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, col0 = warp * (decode_dim_v / 4);
  for (int j = 0; j < decode_bk; ++j) {
    bool hit = false;
#pragma unroll
    for (int t = 0; t < tpk; ++t) hit |= bad[tpk * j + t] != 0;
    if (!hit) continue;
    const T* vr = a.v.row(b, j0 + j, kh) + col0;
#pragma unroll
    for (int n = 0; n < decode_dim_v / 32; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const T x = vr[n * 8 + tile::mma_c_coord(lane, c).col];
        if (!nonfinite(x)) continue;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int row = 16 * mt + tile::mma_c_coord(lane, 2 * hf).row;
            if (spans[row].sees(j0 + j)) oacc[mt][n][2 * hf + c] += sPf[row * decode_s_stride + j] * to_float(x);
          }
      }
  }
}

/// The MLA decode forward: one block per (32 packed rows, local K/V head, batch element).
/// Packed row r of the block is token (r0 + r) / G and query head first + (r0 + r) % G of the
/// group of G heads reading K/V head blockIdx.y; token-major, so the rows' key spans still
/// increase down the block. Per key tile: warp w computes S for m-tile w % 2 and keys
/// 16 (w / 2) .. + 15 (mma over the 576 columns, Q and K by ldmatrix) into shared memory; each
/// warp then runs the online softmax of eight rows (a lane per key) and writes P (T, the mma
/// operand, and float) and each row's rescale factor; each warp finally rescales and adds P V
/// for output columns 128 w .. + 127 of all 32 rows. V(j) loads while S(j) is computed, and
/// K(j + 1) while the softmax and P V run.
template <class T, class O>
__global__ void __launch_bounds__(mma_threads) flash_decode_mma(FwdArgs<T, O> a) {
  constexpr int D = decode_dim, DV = decode_dim_v, BM = decode_rows, BK = decode_bk;
  constexpr int stride = decode_stride, stride_v = decode_stride_v, p_stride = decode_p_stride,
                s_stride = decode_s_stride, nt_o = DV / 32;  // n-tiles of a warp's columns
  static_assert(mma_threads == 128 && BM == 32 && BK == 32, "flash_decode_mma: four warps, 32 x 32 tiles");
  T* sQ = dynamic_smem<T>();
  T* sK = sQ + BM * stride;
  T* sV = sK + BK * stride;
  T* sP = sV + BK * stride_v;
  float* sS = reinterpret_cast<float*>(sP + BM * p_stride);  // scores, then P in float
  float* sM = sS + BM * s_stride;  // running max (log2 units)
  float* sL = sM + BM;             // running sum
  float* sA = sL + BM;             // this tile's rescale factor
  __shared__ int bad_keys[mma_threads], bad_warps[mma_threads / 32];  // zero_nonfinite_keys's marks
  __shared__ KeySpan32 spans[BM];

  const std::int64_t kh = blockIdx.y, b = blockIdx.z;
  const HeadGroup grp = head_group(a.heads, kh, a.q.heads);
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.x) * BM, rows = a.sq * grp.count;
  if (grp.count <= 0 || r0 >= rows) return;  // the same for the whole block
  const int nr = static_cast<int>(rows - r0 < BM ? rows - r0 : BM);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  auto token = [&](int r) { return (r0 + r) / grp.count; };
  auto head = [&](int r) { return grp.first + (r0 + r) % grp.count; };

  // Q rows (zeros past nr), the rows' spans and softmax state.
  for (int c = threadIdx.x; c < BM * (D / 8); c += mma_threads) {
    const int r = c / (D / 8), col = (c - r * (D / 8)) * 8;
    const bool valid = r < nr;
    cp_async_16(sQ + r * stride + col, valid ? a.q.row(b, token(r), head(r)) + col : a.q.data, valid);
  }
  cp_async_commit();
  for (int r = threadIdx.x; r < BM; r += mma_threads) {
    spans[r] = r < nr ? row_span(a, b, token(r)) : KeySpan32{0, -1};
    sM[r] = -INFINITY;
    sL[r] = 0.0f;
  }
  __syncthreads();

  // The block's keys, as in flash_fwd_mma: tiles no row sees are skipped.
  const int k_end = spans[nr - 1].last + 1;
  auto keys_of = [&](int j0) { return k_end - j0 < BK ? k_end - j0 : BK; };
  auto tile_mask = [&](int j0) { return classify_rows(spans, nr, j0, j0 + keys_of(j0) - 1); };
  auto next_tile = [&](int j0) {
    while (j0 < k_end && tile_mask(j0) == TileClass::skip) j0 += BK;
    return j0;
  };

  float oacc[2][nt_o][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int n = 0; n < nt_o; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) oacc[mt][n][i] = 0.0f;
  const int s_mt = warp & 1, s_key0 = 16 * (warp >> 1);  // this warp's part of S
  const int col0 = warp * (DV / 4);                        // and of O

  int j0 = next_tile(spans[0].first);
  if (j0 < k_end) load_tile_async<T, D, BK>(sK, a.k, b, j0, kh, keys_of(j0));
  cp_async_commit();
  while (j0 < k_end) {
    const int nk = keys_of(j0);
    const TileClass mask = tile_mask(j0);
    const int j1 = next_tile(j0 + BK);
    load_tile_async<T, DV, BK>(sV, a.v, b, j0, kh, nk);
    cp_async_commit();
    cp_async_wait<1>();  // Q and K(j0) have landed; V may still be in flight
    __syncthreads();

    // S for rows 16 s_mt .. + 15 and keys s_key0 .. + 15, in log2 units, masked to -inf.
    float sacc[2][4] = {};
#pragma unroll 4
    for (int kc = 0; kc < D / 16; ++kc) {
      std::uint32_t qa[4];
      ldmatrix_x4<false>(qa, sQ + 16 * s_mt * stride + kc * 16 + tile::ldmatrix_a_offset(lane, stride));
      mma_x2<false>(sacc[0], sacc[1], qa, sK + s_key0 * stride + kc * 16 + tile::ldmatrix_k_offset(lane, stride));
    }
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const tile::FragCoord c = tile::mma_c_coord(lane, i);
        const int row = 16 * s_mt + c.row, col = s_key0 + 8 * t + c.col;
        const bool visible = col < nk && (mask != TileClass::cut || spans[row].sees(j0 + col));
        sS[row * s_stride + col] = visible ? a.score.finish(sacc[t][i] * a.score.mul) : -INFINITY;
      }
    __syncthreads();  // S is complete; every warp is done with sK: prefetch the next K tile into it
    if (j1 < k_end) load_tile_async<T, D, BK>(sK, a.k, b, j1, kh, keys_of(j1));
    cp_async_commit();

    // Online softmax, eight rows per warp, a lane per key (keys past nk are -inf: weight 0).
#pragma unroll
    for (int rr = 0; rr < BM / 4; ++rr) {
      const int r = warp * (BM / 4) + rr;
      const float x = sS[r * s_stride + lane], m_old = sM[r];
      const float m_new = fmaxf(m_old, warp_max(x));
      const float p = tile::softmax_weight(x, m_new), sum = warp_sum(p);
      sP[r * p_stride + lane] = convert<T>(p);
      sS[r * s_stride + lane] = p;
      if (lane == 0) {
        const float alpha = tile::rescale_factor(m_old, m_new);
        sA[r] = alpha;
        sL[r] = sL[r] * alpha + sum;
        sM[r] = m_new;
      }
    }
    cp_async_wait<1>();  // V(j0) has landed (the next K may still be in flight)
    __syncthreads();

    // Rescale this thread's rows, give back V's non-finite terms on a cut tile, then P V.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float alpha = sA[16 * mt + tile::mma_c_coord(lane, 2 * hf).row];
#pragma unroll
        for (int n = 0; n < nt_o; ++n) {
          oacc[mt][n][2 * hf] *= alpha;
          oacc[mt][n][2 * hf + 1] *= alpha;
        }
      }
    if (mask == TileClass::cut && zero_nonfinite_keys<T, DV, BK>(sV, bad_keys, bad_warps))
      decode_restore_v<T, O>(oacc, a, spans, sS, bad_keys, b, kh, j0);
#pragma unroll
    for (int kc = 0; kc < BK / 16; ++kc) {
      std::uint32_t pa[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
        ldmatrix_x4<false>(pa[mt], sP + 16 * mt * p_stride + kc * 16 + tile::ldmatrix_a_offset(lane, p_stride));
      const T* vk = sV + kc * 16 * stride_v + col0 + tile::ldmatrix_v_offset(lane, stride_v);
#pragma unroll
      for (int n = 0; n < nt_o; n += 2) {
        std::uint32_t vb[4];
        ldmatrix_x4<true>(vb, vk + n * 8);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma_16816<T>(oacc[mt][n], pa[mt], vb[0], vb[1]);
          mma_16816<T>(oacc[mt][n + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with sV, sP, sS and sA before the next tile
    j0 = j1;
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int row = 16 * mt + tile::mma_c_coord(lane, 2 * hf).row;
      if (row >= nr) continue;
      const tile::RowFinish f = tile::finish_row(sM[row], sL[row]);
      O* orow = a.out.row(b, token(row), head(row)) + col0;
#pragma unroll
      for (int n = 0; n < nt_o; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c)
          orow[n * 8 + tile::mma_c_coord(lane, c).col] = convert<O>(oacc[mt][n][2 * hf + c] * f.inv_sum);
      if (warp == 0 && (lane & 3) == 0 && a.lse.data) *a.lse.row(b, token(row), head(row)) = f.lse;
    }
}

}  // namespace cuda_detail
}  // namespace seqpar
