#pragma once
/// \file
/// The SIMT kernels of CudaFlashKernel: flash_fwd_simt and flash_bwd_simt, for every element
/// type (__half, __nv_bfloat16, float), any D and D_v and any strides, float in shared memory,
/// with or without a soft-cap. They are the path every call can take; the host class
/// (kernel/cuda/flash_kernel.cuh) picks them whenever the tensor-core kernels do not apply.
/// Kept apart from the tensor-core kernels because they share nothing with them but
/// kernel/cuda/flash_args.cuh.

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
// Both SIMT kernels hold at most simt_chunk_max columns of a tensor's rows in shared memory and
// 32 DC columns of accumulators per lane (DC <= 8). Wider heads are walked in chunks (Q K^T,
// dO V^T) and split over blocks by column slices of the output (the forward's O; the
// backward's dQ, dK, dV), each block recomputing the scores: any D and D_v, at bounded shared
// memory and registers, for the price of that recomputation on wide heads only.

inline constexpr int simt_chunk_max = 256;  // the most columns of a row in shared memory

/// Padded row length of the float Q and K tiles (float4 loads of Q need a multiple of 4).
__host__ __device__ constexpr int simt_padded_dim(int dim) { return (dim + 3) & ~3; }

/// Columns of Q and K the SIMT forward holds at once: all of them (padded) up to
/// simt_chunk_max, else chunks of simt_chunk_max.
__host__ __device__ constexpr int simt_chunk(int dim) {
  return simt_padded_dim(dim) <= simt_chunk_max ? simt_padded_dim(dim) : simt_chunk_max;
}

/// Column slices of width `width` that cover `dim` columns (blocks per row tile).
__host__ __device__ constexpr int simt_slices(int dim, int width) { return (dim + width - 1) / width; }

/// Accumulator columns per lane (DC) for rows of `dim` columns: 2, 4 or 8 (wider rows take
/// slices of 256 columns).
constexpr int simt_columns_per_lane(int dim) { return dim <= 64 ? 2 : dim <= 128 ? 4 : 8; }

// ---------------------------------------------------------------------------------------
// SIMT forward: any type, any D (Q K^T in chunks of simt_chunk(D) columns), any D_v (output
// slices of 32 DC columns, one per block).

inline constexpr int simt_bq = 32;       // query rows per block (8 per warp)
inline constexpr int simt_bk = 32;       // keys per tile (one per lane)
inline constexpr int simt_threads = 128;
inline constexpr int simt_rows = simt_bq / (simt_threads / 32);  // rows per warp

/// Dynamic shared memory of the SIMT forward: Q [bq][C], K [bk][C + 1] (odd stride: a lane
/// per key reads without bank conflicts) with C = simt_chunk(dim), V [bk][32 DC], P [bq][bk].
constexpr std::size_t simt_fwd_smem(int dim, int dc) {
  const int c = simt_chunk(dim);
  return sizeof(float) *
         (static_cast<std::size_t>(simt_bq) * c + static_cast<std::size_t>(simt_bk) * (c + 1) +
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

/// The SIMT forward: one block per (32-row query tile and output slice, query head, batch),
/// query tiles launched last first; each lane holds DC output columns of its rows, columns
/// v0 + lane + 32 c of the block's slice (v0 = 32 DC slice). A head of D <= simt_chunk_max
/// loads its Q tile once; a wider one streams Q and K in chunks for every key tile.
template <class T, class O, int DC>
__global__ void __launch_bounds__(simt_threads) flash_fwd_simt(FwdArgs<T, O> a) {
  constexpr int W = 32 * DC;  // output columns of a block
  float* smem = dynamic_smem<float>();
  const int D = a.dim, Dp = simt_padded_dim(D), C = simt_chunk(D), Dv = a.dim_v;
  float* sQ = smem;
  float* sK = sQ + simt_bq * C;
  float* sV = sK + simt_bk * (C + 1);
  float* sP = sV + simt_bk * W;

  const int slices = simt_slices(Dv, W), v0 = static_cast<int>(blockIdx.x % slices) * W;
  const std::int64_t i0 = static_cast<std::int64_t>(gridDim.x / slices - 1 - blockIdx.x / slices) * simt_bq;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  const int nq = static_cast<int>(a.sq - i0 < simt_bq ? a.sq - i0 : simt_bq);
  const std::int64_t kh = a.heads.kv_head(h);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  // Q's columns d0 .. d0 + n (n a multiple of 4), times the score map's factor.
  auto load_q = [&](int d0, int n) {
    for (int idx = tid; idx < simt_bq * n; idx += simt_threads) {
      const int r = idx / n, d = idx - r * n;
      sQ[r * C + d] = (r < nq && d0 + d < D) ? to_float(a.q.row(b, i0 + r, h)[d0 + d]) * a.score.mul : 0.0f;
    }
  };
  const bool whole = C == Dp;  // one chunk: Q stays for the whole block
  if (whole) load_q(0, C);
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
    float s[simt_rows];
#pragma unroll
    for (int rr = 0; rr < simt_rows; ++rr) s[rr] = 0.0f;
    for (int d0 = 0; d0 < Dp; d0 += C) {
      const int n = Dp - d0 < C ? Dp - d0 : C;  // this chunk's columns (a multiple of 4)
      __syncthreads();  // the previous chunk's (tile's) Q, K, and the previous tile's V, P are consumed
      if (!whole) load_q(d0, n);
      for (int idx = tid; idx < simt_bk * n; idx += simt_threads) {
        const int j = idx / n, d = idx - j * n;
        sK[j * (C + 1) + d] = (j < nk && d0 + d < D) ? to_float(a.k.row(b, j0 + j, kh)[d0 + d]) : 0.0f;
      }
      if (d0 == 0)
        for (int idx = tid; idx < simt_bk * W; idx += simt_threads) {
          const int j = idx / W, d = idx - j * W;
          sV[idx] = (j < nk && v0 + d < Dv) ? to_float(a.v.row(b, j0 + j, kh)[v0 + d]) : 0.0f;
        }
      __syncthreads();
      const float* kr = sK + lane * (C + 1);
      for (int d = 0; d < n; d += 4) {
        const float k0 = kr[d], k1 = kr[d + 1], k2 = kr[d + 2], k3 = kr[d + 3];
#pragma unroll
        for (int rr = 0; rr < simt_rows; ++rr) {
          const float4 qv = *reinterpret_cast<const float4*>(sQ + (warp * simt_rows + rr) * C + d);
          s[rr] += qv.x * k0 + qv.y * k1 + qv.z * k2 + qv.w * k3;
        }
      }
    }
    const bool key_ok = lane < nk;
#pragma unroll
    for (int rr = 0; rr < simt_rows; ++rr) {
      const bool visible = key_ok && (mask != TileClass::cut || rs[rr].sees(j0 + lane));
      const float x = visible ? a.score.finish(s[rr]) : -INFINITY;
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
      simt_add_pv<DC, true>(o, sP, sV, W, nk, j0, rs);
    else
      simt_add_pv<DC, false>(o, sP, sV, W, nk, j0, rs);
  }

#pragma unroll
  for (int rr = 0; rr < simt_rows; ++rr) {
    const int r = warp * simt_rows + rr;
    if (r >= nq) continue;
    const tile::RowFinish f = tile::finish_row(m[rr], l[rr]);
    O* orow = a.out.row(b, i0 + r, h);
#pragma unroll
    for (int c = 0; c < DC; ++c) {
      const int d = v0 + lane + 32 * c;
      if (d < Dv) orow[d] = convert<O>(o[rr][c] * f.inv_sum);
    }
    if (lane == 0 && v0 == 0 && a.lse.data) *a.lse.row(b, i0 + r, h) = f.lse;
  }
}

// ---------------------------------------------------------------------------------------
// SIMT backward: any type, any D and D_v. One block per (32-key tile and column slice, query
// head, batch); the slice, 32 DC columns, is the block's share of dQ, dK and dV.

inline constexpr int bwd_bq = 32, bwd_bk = 32, bwd_threads = 128;
inline constexpr int bwd_rows = bwd_bq / (bwd_threads / 32);  // query rows (or keys) per warp

/// Columns of the backward's chunks at DC columns per lane: max(D, D_v) padded when that is at
/// most 32 DC (one slice, every tensor whole in shared memory), else 32 DC (a slice).
__host__ __device__ constexpr int simt_bwd_width(int dim, int dim_v, int dc) {
  const int widest = simt_padded_dim(dim > dim_v ? dim : dim_v);
  return widest <= 32 * dc ? widest : 32 * dc;
}

/// Dynamic shared memory of the backward with chunks of `width` columns (simt_bwd_width): K, V
/// [bk][width + 1]; Q, dO [bq][width]; P, dS [bq][bk + 1]; D_i, LSE [bq].
constexpr std::size_t simt_bwd_smem(int width) {
  const std::size_t w = static_cast<std::size_t>(width);
  return sizeof(float) * (2 * bwd_bk * (w + 1) + 2 * bwd_bq * w + 2 * bwd_bq * (bwd_bk + 1) + 2 * bwd_bq);
}

/// dQ += scale * dS K for this warp's rows of the query tile (dS in sS; K's columns c0 .. c0 +
/// Cw in sK, rows of Ks): warp rows, lane columns; other key tiles add to the same rows. CUT
/// (a tile the mask cuts): a key a row does not see (its span in `spans`) adds exactly 0
/// whatever K holds (its dS is 0, but 0 x NaN = NaN); fully visible tiles take CUT = false,
/// unchanged.
template <int DC, bool CUT, class T>
__device__ __forceinline__ void simt_add_dq(const BwdArgs<T>& a, const float* sS, const float* sK, int Cw, int c0,
                                            int nq, int nk, std::int64_t b, std::int64_t h, std::int64_t i0,
                                            std::int64_t j0, const KeySpan32* spans) {
  const int Ks = Cw + 1, Ps = bwd_bk + 1;
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
        acc[c] += ds * (d < Cw ? sK[j * Ks + d] : 0.0f);
      }
    }
    float* dqr = a.dq.row(b, i0 + r, h);
#pragma unroll
    for (int c = 0; c < DC; ++c) {
      const int d = c0 + lane + 32 * c;
      if (d < a.dim) atomicAdd(dqr + d, acc[c] * a.scale);
    }
  }
}

/// The SIMT backward: one block per (32-key tile and column slice, query head, batch) keeps
/// its slice of that tile's dK, dV in registers while the query tiles stream past, and adds
/// them and its slice of dQ with atomics. S = Q K^T and dP = dO V^T need every column: a
/// block of one slice holds K, V whole for its life and Q, dO per query tile; with several
/// slices it walks the columns in chunks per query tile, its own slice last, so that the
/// chunk left in shared memory is the one dK, dV and dQ need.
template <class T, int DC>
__global__ void __launch_bounds__(bwd_threads) flash_bwd_simt(BwdArgs<T> a) {
  constexpr int W = 32 * DC;
  float* smem = dynamic_smem<float>();
  const int D = a.dim, Dv = a.dim_v, Cw = simt_bwd_width(D, Dv, DC), Ks = Cw + 1, Ps = bwd_bk + 1;
  float* sK = smem;
  float* sV = sK + bwd_bk * Ks;
  float* sQ = sV + bwd_bk * Ks;
  float* sO = sQ + bwd_bq * Cw;  // dO
  float* sP = sO + bwd_bq * Cw;
  float* sS = sP + bwd_bq * Ps;  // dS
  float* sD = sS + bwd_bq * Ps;  // rowsum(dO * O)
  float* sL = sD + bwd_bq;       // LSE in log2 units; -inf: the row contributes nothing

  const int slices = simt_slices(D > Dv ? D : Dv, W), slice = static_cast<int>(blockIdx.x % slices);
  const int c0 = slice * W;  // the block's first column of dQ, dK, dV
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x / slices) * bwd_bk;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  const int nk = static_cast<int>(a.sk - j0 < bwd_bk ? a.sk - j0 : bwd_bk);
  const std::int64_t kh = a.heads.kv_head(h);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  // K and V columns from `col` (Cw of them; zeros past D and D_v).
  auto load_kv = [&](int col) {
    for (int idx = tid; idx < bwd_bk * Cw; idx += bwd_threads) {
      const int j = idx / Cw, d = idx - j * Cw, e = col + d;
      sK[j * Ks + d] = j < nk && e < D ? to_float(a.k.row(b, j0 + j, kh)[e]) : 0.0f;
      sV[j * Ks + d] = j < nk && e < Dv ? to_float(a.v.row(b, j0 + j, kh)[e]) : 0.0f;
    }
  };
  // Q and dO columns from `col` of query rows i0 .. i0 + nq.
  auto load_q = [&](int col, std::int64_t i0, int nq) {
    for (int idx = tid; idx < bwd_bq * Cw; idx += bwd_threads) {
      const int r = idx / Cw, d = idx - r * Cw, e = col + d;
      sQ[idx] = r < nq && e < D ? to_float(a.q.row(b, i0 + r, h)[e]) : 0.0f;
      sO[idx] = r < nq && e < Dv ? to_float(a.dout.row(b, i0 + r, h)[e]) : 0.0f;
    }
  };
  if (slices == 1) load_kv(0);
  __shared__ KeySpan32 spans[bwd_bq];  // the query tile's rows' visible keys (on cut tiles)
  const std::int64_t j_last = j0 + nk - 1;

  // dK, dV of keys warp * 8 + kk, columns c0 + lane + 32 c.
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
    // S and dP: lane = key, warp rows, summed over the chunks.
    float s[bwd_rows], dp[bwd_rows];
#pragma unroll
    for (int rr = 0; rr < bwd_rows; ++rr) s[rr] = dp[rr] = 0.0f;
    for (int t = 0; t < slices; ++t) {
      const int chunk = (slice + 1 + t) % slices;  // the block's own slice comes last
      __syncthreads();  // the previous chunk (query tile) is consumed
      if (slices > 1) load_kv(chunk * W);
      load_q(chunk * W, i0, nq);
      if (t == 0) {
        backward_row_stats<bwd_rows>(a, b, h, i0, nq, sD, sL);
        if (mask == TileClass::cut) fill_spans<bwd_bq>(spans, a, b, i0, nq);
      }
      __syncthreads();
      const float* kr = sK + lane * Ks;
      const float* vr = sV + lane * Ks;
#pragma unroll
      for (int rr = 0; rr < bwd_rows; ++rr) {
        const float* qr = sQ + (warp * bwd_rows + rr) * Cw;
        const float* gr = sO + (warp * bwd_rows + rr) * Cw;
        for (int d = 0; d < Cw; d += 4) {
          const float4 q4 = *reinterpret_cast<const float4*>(qr + d);
          const float4 g4 = *reinterpret_cast<const float4*>(gr + d);
          s[rr] += q4.x * kr[d] + q4.y * kr[d + 1] + q4.z * kr[d + 2] + q4.w * kr[d + 3];
          dp[rr] += g4.x * vr[d] + g4.y * vr[d + 1] + g4.z * vr[d + 2] + g4.w * vr[d + 3];
        }
      }
    }

    // P and dS (times the cap's factor).
#pragma unroll
    for (int rr = 0; rr < bwd_rows; ++rr) {
      const int r = warp * bwd_rows + rr;
      bool visible = lane < nk && r < nq && sL[r] != -INFINITY;
      if (visible && mask == TileClass::cut) visible = spans[r].sees(j0 + lane);
      float cap = 1.0f;
      const float x = a.score.finish(s[rr] * a.score.mul, cap);
      const float p = visible ? tile::exp2_fast(x - sL[r]) : 0.0f;
      sP[r * Ps + lane] = p;
      // Not p * (...) alone: a hidden key's dP is NaN when its V is, and 0 x NaN = NaN.
      sS[r * Ps + lane] = visible ? p * (dp[rr] - sD[r]) * cap : 0.0f;
    }
    __syncthreads();

    // dV += P^T dO, dK += dS^T Q: warp keys, lane columns (of the block's slice, in shared
    // memory now).
    for (int i = 0; i < nq; ++i) {
      // A row that sees none of these keys adds nothing: its P and dS are 0, but 0 x NaN = NaN
      // (a NaN in its Q or dO must stay in that row). The same in the whole warp.
      if (mask == TileClass::cut && !spans[i].reaches(j0, j_last)) continue;
      float gq[DC], qq[DC];
#pragma unroll
      for (int c = 0; c < DC; ++c) {
        const int d = lane + 32 * c;
        gq[c] = d < Cw ? sO[i * Cw + d] : 0.0f;
        qq[c] = d < Cw ? sQ[i * Cw + d] : 0.0f;
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
      simt_add_dq<DC, true>(a, sS, sK, Cw, c0, nq, nk, b, h, i0, j0, spans);
    else
      simt_add_dq<DC, false>(a, sS, sK, Cw, c0, nq, nk, b, h, i0, j0, spans);
  }

#pragma unroll
  for (int kk = 0; kk < bwd_rows; ++kk) {
    const int j = warp * bwd_rows + kk;
    if (j >= nk) continue;
    float* dkr = a.dk.row(b, j0 + j, kh);
    float* dvr = a.dv.row(b, j0 + j, kh);
#pragma unroll
    for (int c = 0; c < DC; ++c) {
      const int d = c0 + lane + 32 * c;
      if (d < D) atomicAdd(dkr + d, dk[kk][c] * a.scale);
      if (d < Dv) atomicAdd(dvr + d, dv[kk][c]);
    }
  }
}

}  // namespace cuda_detail
}  // namespace seqpar
