#pragma once
/// \file
/// The tensor-core forward of CudaFlashKernel: flash_fwd_mma, for __half and __nv_bfloat16 at
/// head dims (D, D_v) = (64, 64), (128, 128) or (192, 128) on sm_80+, with or without a
/// soft-cap, 64 (or 128) query rows x 64 keys per tile, Q K^T and P V by
/// mma.sync with P kept in registers, K/V streamed into shared memory with cp.async. The host
/// class (kernel/cuda/flash_kernel.cuh) picks it when its conditions hold and SIMT otherwise;
/// the primitives it is built from are in kernel/cuda/flash_mma.cuh.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "seqpar/kernel/cuda/flash_args.cuh"
#include "seqpar/kernel/cuda/flash_mask.cuh"
#include "seqpar/kernel/cuda/flash_mma.cuh"
#include "seqpar/ops/cuda_ops.cuh"
#include "seqpar/kernel/tile_math.hpp"

namespace seqpar {
namespace cuda_detail {

// ---------------------------------------------------------------------------------------
// Tensor-core forward: half / bf16, (D, D_v) of mma_forward_dims.

/// Query rows per block of the tensor-core forward with MT m-tiles (16 rows each) per warp.
template <int MT>
inline constexpr int mma_block_rows = 16 * MT * (mma_threads / 32);

/// Dynamic shared memory of the tensor-core forward: none with one m-tile per warp (K and V
/// are static, Q lives in registers); with two, Q [128][D + 8], K [64][D + 8] and V [64][D_v + 8].
template <class T, int D, int DV, int MT>
constexpr std::size_t mma_fwd_smem() {
  return MT == 1 ? 0
                 : sizeof(T) * (static_cast<std::size_t>(mma_block_rows<MT> + mma_bk) * (D + 8) +
                                static_cast<std::size_t>(mma_bk) * (DV + 8));
}

/// Block-wide, on a key tile the mask cuts: replaces each NaN and +-Inf element of the
/// [KEYS][D + 8] V tile in shared memory by 0, so that P V adds exactly 0 for a key hidden
/// from a row (its weight P is 0, but 0 x NaN = NaN). mma_threads / KEYS threads per key
/// (two for the 64-key tiles): thread t scans part t % that of key t / that's row and sets
/// bad[t] when it replaced anything. Returns whether any thread did, the same in every thread
/// (one barrier: call it from a block-uniform branch).
template <class T, int D, int KEYS = mma_bk>
__device__ __forceinline__ bool zero_nonfinite_keys(T* tile, int* bad, int* bad_warp) {
  constexpr int per_key = mma_threads / KEYS, shift = per_key == 4 ? 2 : 1;
  static_assert(per_key * KEYS == mma_threads && (per_key == 2 || per_key == 4) && D % (2 * per_key) == 0,
                "zero_nonfinite_keys: two or four threads per key");
  const int t = threadIdx.x;
  std::uint32_t* row =
      reinterpret_cast<std::uint32_t*>(tile + (t >> shift) * (D + 8) + (t & (per_key - 1)) * (D / per_key));
  bool found = false;
#pragma unroll
  for (int w = 0; w < D / (2 * per_key); ++w) {
    const std::uint32_t x = row[w], y = tile::zero_nonfinite_pair(x, exponent_bits<T>);
    if (y != x) {
      row[w] = y;
      found = true;
    }
  }
  bad[t] = found;
  const bool any = warp_any(found);
  if ((t & 31) == 0) bad_warp[t >> 5] = any;
  __syncthreads();
  bool block_any = false;
#pragma unroll
  for (int w = 0; w < mma_threads / 32; ++w) block_any |= bad_warp[w] != 0;
  return block_any;
}

/// On a tile whose V zero_nonfinite_keys cleaned (for P V): gives back to each row that sees
/// key j the terms P_ij V_jd of the NaN and +-Inf elements V_jd (read again from global
/// memory), in float, so that exactly the rows that see a non-finite value get it, as the
/// reference's do. `p`: the tile's P accumulators; `rs`: the spans of this thread's rows;
/// `bad`: zero_nonfinite_keys's marks. Every index into p and oacc is a compile-time constant,
/// so that they stay in registers (a run-time index would put them in local memory for the
/// whole kernel): P element e of n-tile nt in the lane `lane ^ m` of the quad is the row's
/// weight of key 8 nt + 2 ((lane % 4) ^ m) + e, which each lane takes with a shuffle.
template <class T, class O, int D, int MT>
__device__ __forceinline__ void restore_nonfinite_v(float (&oacc)[MT][D / 8][4], const float (&p)[MT][mma_bk / 8][4],
                                                    const KeySpan32 (&rs)[MT][2], const FwdArgs<T, O>& a,
                                                    std::int64_t b, std::int64_t kh, std::int64_t j0,
                                                    const int* bad) {
  const int quad = threadIdx.x & 3;
#pragma unroll
  for (int nt = 0; nt < mma_bk / 8; ++nt) {
    bool any = false;  // the same in every thread
#pragma unroll
    for (int t = 0; t < 16; ++t) any |= bad[16 * nt + t] != 0;
    if (!any) continue;
#pragma unroll 1
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = nt * 8 + 2 * (quad ^ m) + e;  // this lane's key in this round
        float pj[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) pj[mt][hf] = __shfl_xor_sync(0xffffffffu, p[mt][nt][2 * hf + e], m);
        if (!(bad[2 * j] | bad[2 * j + 1])) continue;
        const T* vr = a.v.row(b, j0 + j, kh);
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const T x = vr[n * 8 + 2 * quad + c];
            if (!nonfinite(x)) continue;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
              for (int hf = 0; hf < 2; ++hf)
                if (rs[mt][hf].sees(j0 + j)) oacc[mt][n][2 * hf + c] += pj[mt][hf] * to_float(x);
          }
      }
  }
}

/// The tensor-core forward, D columns of Q and K, DV of V and O. `ldsm`: K, V (and Q) fragments
/// come from ldmatrix (four registers per instruction); otherwise from 32- and 16-bit shared
/// loads (the simpler, slower variant, kept as a cross-check and fallback). MT m-tiles of 16
/// query rows per warp: MT = 1 keeps Q in registers (64-row blocks, no dynamic shared memory);
/// MT = 2 is FlashAttention-2's tile for H100 (128-row blocks): each K and V fragment feeds two
/// m-tiles, halving shared-memory traffic per FLOP, and Q stays in shared memory to leave
/// registers to the two accumulators.
template <class T, class O, int D, int DV, bool ldsm, int MT>
__global__ void __launch_bounds__(mma_threads) flash_fwd_mma(FwdArgs<T, O> a) {
  static_assert(MT == 1 || MT == 2, "flash_fwd_mma: one or two m-tiles per warp");
  constexpr int stride = D + 8;     // Q and K rows; +8 elements: fragment loads hit 32 distinct banks
  constexpr int stride_v = DV + 8;  // V rows
  constexpr int kc_steps = D / 16, nt_s = mma_bk / 8, nt_o = DV / 8, bq = mma_block_rows<MT>;
  T* sK;
  T* sV;
  T* sQ;
  __shared__ int bad_keys[mma_threads], bad_warps[mma_threads / 32];  // zero_nonfinite_keys's marks
  __shared__ KeySpan32 spans[bq];                                     // each row's visible keys
  if constexpr (MT == 1) {
    __shared__ __align__(16) T sK1[mma_bk * stride];
    __shared__ __align__(16) T sV1[mma_bk * stride_v];
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
  fill_spans<bq>(spans, a, b, i0, nq);
  __syncthreads();
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
  KeySpan32 rs[MT][2];
  int rows[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      rows[mt][hf] = warp_row + 16 * mt + tile::mma_c_coord(lane, 2 * hf).row;
      rs[mt][hf] = spans[rows[mt][hf]];
    }
  // The block's keys: from its first row's first to its last row's last (spans increase);
  // keys past the last are neither loaded nor tested.
  // Local key indices fit an int (the host checks): fewer registers than int64.
  const int k_end = spans[nq - 1].last + 1;
  auto keys_of = [&](int j0) { return k_end - j0 < mma_bk ? k_end - j0 : mma_bk; };
  auto tile_mask = [&](int j0) { return classify_rows(spans, nq, j0, j0 + keys_of(j0) - 1); };
  // The first tile at or after j0 that some row sees, or k_end.
  auto next_tile = [&](int j0) {
    while (j0 < k_end && tile_mask(j0) == TileClass::skip) j0 += mma_bk;
    return j0;
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

  int j0 = next_tile(spans[0].first);
  if (j0 < k_end) load_tile_async<T, D>(sK, a.k, b, j0, kh, keys_of(j0));
  cp_async_commit();

  while (j0 < k_end) {
    const int nk = keys_of(j0);
    const TileClass mask = tile_mask(j0);
    // Decided here, while no accumulator of the tile is live, for the prefetch below.
    const int j1 = next_tile(j0 + mma_bk);
    load_tile_async<T, DV>(sV, a.v, b, j0, kh, nk);
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
    if (j1 < k_end) load_tile_async<T, D>(sK, a.k, b, j1, kh, keys_of(j1));
    cp_async_commit();

    // Scores in log2 units, soft-capped when asked (a branch the whole block takes alike).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < nt_s; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) sacc[mt][nt][i] *= a.score.mul;
    if (a.score.capped()) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < nt_s; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) sacc[mt][nt][i] = a.score.finish(sacc[mt][nt][i]);
    }
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
          if (visible && mask == TileClass::cut) visible = rs[mt][i >> 1].sees(j0 + col);
          const float x = visible ? sacc[mt][nt][i] : -INFINITY;
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
    // A tile the mask cuts: NaN/Inf in V become 0 for P V, and their terms go to the rows that
    // see them (before P V, while P is live anyway: the order of the terms only matters to
    // rows that become NaN or Inf). Fully visible tiles skip both.
    if (mask == TileClass::cut && zero_nonfinite_keys<T, DV>(sV, bad_keys, bad_warps))
      restore_nonfinite_v<T, O, DV, MT>(oacc, sacc, rs, a, b, kh, j0, bad_keys);
    int vb[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) vb[i] = tile::mma_b_offset_kn(lane, i, stride_v);
    const int voff = tile::ldmatrix_v_offset(lane, stride_v);
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
      const T* vk = sV + kc * 16 * stride_v;
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
    j0 = j1;
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

}  // namespace cuda_detail
}  // namespace seqpar
