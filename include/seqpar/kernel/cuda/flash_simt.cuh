#pragma once
/// \file
/// The SIMT kernels of CudaFlashKernel: flash_fwd_simt and flash_bwd_simt, for every element
/// type (__half, __nv_bfloat16, float), any head_dim <= 256 and any strides, float in shared
/// memory. They are the path every call can take; the host class (kernel/cuda/flash_kernel.cuh)
/// picks them whenever the tensor-core kernels do not apply. Kept apart from the tensor-core
/// kernels because they share nothing with them but kernel/cuda/flash_args.cuh.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "seqpar/kernel/cuda/flash_args.cuh"
#include "seqpar/kernel/cuda/flash_mask.cuh"
#include "seqpar/cuda/launch.cuh"
#include "seqpar/ops/cuda_ops.cuh"
#include "seqpar/kernel/tile_math.hpp"

namespace seqpar {
namespace cuda_detail {

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

/// O += P V for this warp's rows over the tile's nk keys from local key j0 (P in sP, V in sV
/// with rows of Dv). CUT (a tile the mask cuts): a key a row does not see (span `rs`) adds
/// exactly 0 to it whatever V holds (its weight is 0, but 0 x NaN = NaN); fully visible tiles
/// take CUT = false, unchanged.
template <int DC, bool CUT>
__device__ __forceinline__ void simt_add_pv(float (&o)[simt_rows][DC], const float* sP, const float* sV, int Dv,
                                            int nk, std::int64_t j0, const KeySpan32 (&rs)[simt_rows]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int j = 0; j < nk; ++j) {
    float vv[DC];
#pragma unroll
    for (int c = 0; c < DC; ++c) vv[c] = sV[j * Dv + lane + 32 * c];
#pragma unroll
    for (int rr = 0; rr < simt_rows; ++rr) {
      if (CUT && !rs[rr].sees(j0 + j)) continue;
      const float p = sP[(warp * simt_rows + rr) * simt_bk + j];
#pragma unroll
      for (int c = 0; c < DC; ++c) o[rr][c] += p * vv[c];
    }
  }
}

/// The SIMT forward: one block per (32-row query tile, query head, batch), launched last tile
/// first; each lane holds DC output columns of its rows (head_dim <= 32 DC).
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
  __shared__ KeySpan32 spans[simt_bq];  // each row's visible keys
  fill_spans<simt_bq>(spans, a, b, i0, nq);
  __syncthreads();
  float m[simt_rows], l[simt_rows], o[simt_rows][DC];
  KeySpan32 rs[simt_rows];
#pragma unroll
  for (int rr = 0; rr < simt_rows; ++rr) {
    m[rr] = -INFINITY;
    l[rr] = 0.0f;
#pragma unroll
    for (int c = 0; c < DC; ++c) o[rr][c] = 0.0f;
    rs[rr] = spans[warp * simt_rows + rr];
  }
  // The block's keys: from its first row's first to its last row's last (spans increase);
  // keys past the last are neither loaded nor tested.
  const std::int64_t k_end = spans[nq - 1].last + std::int64_t{1};
  for (std::int64_t j0 = spans[0].first; j0 < k_end; j0 += simt_bk) {
    const int nk = static_cast<int>(k_end - j0 < simt_bk ? k_end - j0 : simt_bk);
    const TileClass mask = classify_rows(spans, nq, j0, j0 + nk - 1);
    if (mask == TileClass::skip) continue;
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
#pragma unroll
    for (int rr = 0; rr < simt_rows; ++rr) {
      const bool visible = key_ok && (mask != TileClass::cut || rs[rr].sees(j0 + lane));
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
    if (mask == TileClass::cut)
      simt_add_pv<DC, true>(o, sP, sV, Dv, nk, j0, rs);
    else
      simt_add_pv<DC, false>(o, sP, sV, Dv, nk, j0, rs);
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
// SIMT backward: any type, head_dim <= 32 * DC. One block per (key tile, query head, batch).

inline constexpr int bwd_bq = 32, bwd_bk = 32, bwd_threads = 128;
inline constexpr int bwd_rows = bwd_bq / (bwd_threads / 32);  // query rows (or keys) per warp

/// Dynamic shared memory of the backward: K, V [bk][Dp + 1]; Q, dO [bq][Dp]; P, dS [bq][bk + 1];
/// D_i, LSE [bq].
constexpr std::size_t simt_bwd_smem(int dim) {
  const std::size_t dp = static_cast<std::size_t>(simt_padded_dim(dim));
  return sizeof(float) * (2 * bwd_bk * (dp + 1) + 2 * bwd_bq * dp + 2 * bwd_bq * (bwd_bk + 1) + 2 * bwd_bq);
}

/// dQ += scale * dS K for this warp's rows of the query tile (dS in sS, K in sK, strides as
/// flash_bwd_simt's): warp rows, lane columns; other key tiles add to the same rows. CUT (a
/// tile the mask cuts): a key a row does not see (its span in `spans`) adds exactly 0 whatever
/// K holds (its dS is 0, but 0 x NaN = NaN); fully visible tiles take CUT = false, unchanged.
template <int DC, bool CUT, class T>
__device__ __forceinline__ void simt_add_dq(const BwdArgs<T>& a, const float* sS, const float* sK, int nq, int nk,
                                            std::int64_t b, std::int64_t h, std::int64_t i0, std::int64_t j0,
                                            const KeySpan32* spans) {
  const int D = a.dim, Dp = simt_padded_dim(D), Ks = Dp + 1, Ps = bwd_bk + 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int rr = 0; rr < bwd_rows; ++rr) {
    const int r = warp * bwd_rows + rr;
    if (r >= nq) continue;
    float acc[DC];
#pragma unroll
    for (int c = 0; c < DC; ++c) acc[c] = 0.0f;
    for (int j = 0; j < nk; ++j) {
      if (CUT && !spans[r].sees(j0 + j)) continue;
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

/// The SIMT backward: one block per (32-key tile, query head, batch) keeps that tile's dK, dV
/// in registers while the query tiles stream past, and adds them and its share of dQ with atomics.
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
  __shared__ KeySpan32 spans[bwd_bq];  // the query tile's rows' visible keys (on cut tiles)
  const std::int64_t j_last = j0 + nk - 1;

  // dK, dV of keys warp * 8 + kk, columns lane + 32 c.
  float dk[bwd_rows][DC], dv[bwd_rows][DC];
#pragma unroll
  for (int kk = 0; kk < bwd_rows; ++kk)
#pragma unroll
    for (int c = 0; c < DC; ++c) dk[kk][c] = dv[kk][c] = 0.0f;

  // Query tiles from the first row that sees a key of the tile, up to the first row whose span
  // starts after it.
  for (std::int64_t i0 = next_query_tile(a, b, first_row_reaching(a, b, j0), bwd_bq, j0, j_last); i0 < a.sq;
       i0 = next_query_tile(a, b, i0 + bwd_bq, bwd_bq, j0, j_last)) {
    const int nq = static_cast<int>(a.sq - i0 < bwd_bq ? a.sq - i0 : bwd_bq);
    const TileClass mask = classify_query_tile(a, b, i0, nq, j0, j_last);
    __syncthreads();  // the previous query tile is consumed
    for (int idx = tid; idx < bwd_bq * Dp; idx += bwd_threads) {
      const int r = idx / Dp, d = idx - r * Dp;
      const bool ok = r < nq && d < D;
      sQ[idx] = ok ? to_float(a.q.row(b, i0 + r, h)[d]) : 0.0f;
      sO[idx] = ok ? to_float(a.dout.row(b, i0 + r, h)[d]) : 0.0f;
    }
    backward_row_stats<bwd_rows>(a, b, h, i0, nq, sD, sL);
    if (mask == TileClass::cut) fill_spans<bwd_bq>(spans, a, b, i0, nq);
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
      if (visible && mask == TileClass::cut) visible = spans[r].sees(j0 + lane);
      const float p = visible ? tile::exp2_fast(s * a.scale_log2 - sL[r]) : 0.0f;
      sP[r * Ps + lane] = p;
      // Not p * (...) alone: a hidden key's dP is NaN when its V is, and 0 x NaN = NaN.
      sS[r * Ps + lane] = visible ? p * (dp - sD[r]) : 0.0f;
    }
    __syncthreads();

    // dV += P^T dO, dK += dS^T Q: warp keys, lane columns.
    for (int i = 0; i < nq; ++i) {
      // A row that sees none of these keys adds nothing: its P and dS are 0, but 0 x NaN = NaN
      // (a NaN in its Q or dO must stay in that row). The same in the whole warp.
      if (mask == TileClass::cut && !spans[i].reaches(j0, j_last)) continue;
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
    if (mask == TileClass::cut)
      simt_add_dq<DC, true>(a, sS, sK, nq, nk, b, h, i0, j0, spans);
    else
      simt_add_dq<DC, false>(a, sS, sK, nq, nk, b, h, i0, j0, spans);
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

}  // namespace cuda_detail
}  // namespace seqpar
