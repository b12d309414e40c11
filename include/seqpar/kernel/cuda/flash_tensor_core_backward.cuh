#pragma once
/// \file
/// The tensor-core backward of CudaFlashKernel: flash_bwd_mma, for __half and __nv_bfloat16
/// at head dims (D, D_v) = (64, 64), (128, 128) or (192, 128) on sm_80+, with or without a
/// soft-cap, all five products (S, dP, dV, dK, dQ) by mma.sync with
/// ldmatrix operands, one block per 64-key tile keeping its dK, dV in registers. The host
/// class (kernel/cuda/flash_kernel.cuh) picks it on the forward's conditions (and dout's rows
/// 16-byte aligned) and the SIMT backward otherwise; its primitives are in
/// kernel/cuda/flash_mma.cuh.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "seqpar/kernel/cuda/flash_args.cuh"
#include "seqpar/kernel/cuda/flash_mask.cuh"
#include "seqpar/kernel/cuda/flash_mma.cuh"
#include "seqpar/cuda/launch.cuh"
#include "seqpar/ops/cuda_ops.cuh"
#include "seqpar/kernel/tile_math.hpp"

namespace seqpar {
namespace cuda_detail {

// ---------------------------------------------------------------------------------------
// Tensor-core backward: half / bf16, (D, D_v) of mma_backward_dims. One block per (key tile, query head,
// batch); each of the four warps owns 16 keys of the tile and keeps their dK, dV in registers
// while the query tiles stream past (FlashAttention-2's backward loop order).

inline constexpr int mma_bwd_bk = 64;  // keys per block: 16 per warp

/// Query rows per tile of the tensor-core backward: 64 at head_dim 64; 32 at 128, where the
/// dK and dV accumulators take 64 registers each and 64-query S and dP tiles would take the
/// rest (ptxas, sm_90: 255 registers with 64 query rows, 240 with 32); 16 at (192, 128), whose
/// dK accumulators take 96.
template <int D, int DV>
inline constexpr int mma_bwd_bq = D <= 64 ? 64 : D + DV <= 256 ? 32 : 16;

/// Dynamic shared memory of the tensor-core backward: K [64][D + 8] and V [64][D_v + 8] for
/// the whole block; Q [BQ][D + 8], dO [BQ][D_v + 8] and dS [BQ][64 + 8] (T) per query tile;
/// D_i and LSE [BQ] (float); the rows' key spans [BQ].
template <class T, int D, int DV>
constexpr std::size_t mma_bwd_smem() {
  constexpr std::size_t bq = mma_bwd_bq<D, DV>;
  return sizeof(T) * ((mma_bwd_bk + bq) * (D + 8 + DV + 8) + bq * (mma_bwd_bk + 8)) + 2 * sizeof(float) * bq +
         sizeof(KeySpan32) * bq;
}

/// P^T and dS^T of one query tile on the accumulators of S^T (in s, the dot products) and
/// dP^T (in dp): row = key, column = query (a column past nq has LSE = -inf); with a soft-cap,
/// dS^T takes the cap's factor. dS^T also goes to shared memory as
/// dS, for dQ = dS K, which needs every warp's keys. CUT (a tile the mask cuts): a (key,
/// query) pair the mask hides (the query's span in `spans` misses local key `kj`) gets P =
/// dS = 0 exactly, whatever its dP (NaN when the key's V is: 0 x NaN = NaN); fully visible
/// tiles take CUT = false, unchanged.
template <class T, int BQ, bool CUT>
__device__ __forceinline__ void bwd_p_ds(float (&s)[BQ / 8][4], float (&dp)[BQ / 8][4], const bool (&key_ok)[2],
                                         const std::int64_t (&kj)[2], const KeySpan32* spans, const BwdArgs<T>& a,
                                         int key0, const float* sL, const float* sD, T* sS) {
  constexpr int ds_stride = mma_bwd_bk + 8;
  const int lane = threadIdx.x & 31;
  const bool capped = a.score.capped();
#pragma unroll
  for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const tile::FragCoord c = tile::mma_c_coord(lane, i);
      const int col = nt * 8 + c.col;
      const float lse = sL[col];
      bool visible = key_ok[i >> 1] && lse != -INFINITY;
      if (CUT && visible) visible = spans[col].sees(kj[i >> 1]);
      float cap = 1.0f, x = s[nt][i] * a.score.mul;
      if (capped) x = a.score.finish(x, cap);
      const float p = visible ? tile::exp2_fast(x - lse) : 0.0f;
      s[nt][i] = p;
      if constexpr (CUT)
        dp[nt][i] = visible ? p * (dp[nt][i] - sD[col]) * cap : 0.0f;
      else
        dp[nt][i] = p * (dp[nt][i] - sD[col]) * cap;
      sS[col * ds_stride + key0 + c.row] = convert<T>(dp[nt][i]);
    }
}

/// dQ += scale dS K for one query tile of nq rows: warp task rows 16 rb .. 16 rb + 15 (A = dS
/// rows from sS), head-dim n-tiles of column group cg (B = K from sK); float atomics, since other
/// key blocks add to the same rows. CUT (a tile the mask cuts): the K operands' NaN and
/// +-Inf elements are replaced by 0, so that a key hidden from a row (dS = 0) adds exactly 0
/// to it, and the rows that do see such an element get dS_ij K_jd back in float (the reference's
/// NaN or Inf); fully visible tiles take CUT = false, unchanged.
template <class T, int D, int BQ, bool CUT>
__device__ __forceinline__ void bwd_add_dq(const BwdArgs<T>& a, const T* sS, const T* sK, std::int64_t b,
                                           std::int64_t h, std::int64_t i0, int nq, std::int64_t j0, int nk) {
  constexpr int bk = mma_bwd_bk, bq = BQ, stride = D + 8, ds_stride = bk + 8;
  constexpr int row_blocks = bq / 16, col_groups = (mma_threads / 32) / row_blocks, nt_per_group = (D / 8) / col_groups;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rb = warp % row_blocks, cg = warp / row_blocks;
  if (16 * rb >= nq) return;  // the same in the whole warp
  const int off_t = tile::ldmatrix_v_offset(lane, stride);
  std::uint32_t sa[bk / 16][4];
#pragma unroll
  for (int kc = 0; kc < bk / 16; ++kc)
    ldmatrix_x4<false>(sa[kc], sS + 16 * rb * ds_stride + kc * 16 + tile::ldmatrix_a_offset(lane, ds_stride));
#pragma unroll
  for (int n = cg * nt_per_group; n < (cg + 1) * nt_per_group; n += 2) {
    float acc[2][4] = {};
    bool zeroed = false;
#pragma unroll
    for (int kc = 0; kc < bk / 16; ++kc) {
      const T* kb = sK + kc * 16 * stride + n * 8 + off_t;
      if constexpr (CUT) {
        std::uint32_t kr[4];
        ldmatrix_x4<true>(kr, kb);
        zeroed |= zero_nonfinite<T>(kr);
        mma_16816<T>(acc[0], sa[kc], kr[0], kr[1]);
        mma_16816<T>(acc[1], sa[kc], kr[2], kr[3]);
      } else {
        mma_x2<true>(acc[0], acc[1], sa[kc], kb);
      }
    }
    if (CUT && warp_any(zeroed)) {
      // This lane's rows (C rows g, g + 8) and columns ((n + t) 8 + 2 (lane % 4) + e).
      KeySpan32 rsp[2];  // (the shared spans may already hold the next tile's)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = 16 * rb + tile::mma_c_coord(lane, 2 * hf).row;
        rsp[hf] = row < nq ? row_span(a, b, i0 + row) : KeySpan32{0, -1};
      }
      for (int j = 0; j < nk; ++j) {
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const tile::FragCoord c = tile::mma_c_coord(lane, i);
            const T x = sK[j * stride + (n + t) * 8 + c.col];
            if (nonfinite(x) && rsp[i >> 1].sees(j0 + j))
              acc[t][i] += to_float(sS[(16 * rb + c.row) * ds_stride + j]) * to_float(x);
          }
      }
    }
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

/// Block-wide, on a query tile of nq rows the mask cuts, once its Q and dO (sQ, sG: rows of D
/// and D_v) and the
/// rows' spans have landed and a barrier has published them: zeroes the Q and dO rows of the
/// rows that see none of the block's keys j0 .. j1. Their P and dS are exactly 0 already, but
/// dV += P^T dO and dK += dS^T Q would multiply that 0 by the row's dO and Q, and 0 x NaN = NaN:
/// a NaN in such a row (one past a window's or a document's end, one that sees no key at all)
/// must stay in that row. One more barrier, only when some row is zeroed (the same answer in
/// every thread: call from a block-uniform branch). A row that sees some of the keys keeps its
/// values, so a NaN there reaches the dK, dV of every key of the tile.
template <class T, int D, int DV>
__device__ __forceinline__ void clear_rows_missing_keys(T* sQ, T* sG, const KeySpan32* spans, int nq, std::int64_t j0,
                                                        std::int64_t j1) {
  if (!rows_reach<false>(spans, nq, j0, j1)) return;
  // 16-byte chunks per row of Q, then of dO.
  constexpr int chunks_q = D / 8, chunks = chunks_q + DV / 8;
  for (int c = threadIdx.x; c < nq * chunks; c += mma_threads) {
    const int r = c / chunks, e = c - r * chunks;
    if (spans[r].reaches(j0, j1)) continue;
    T* at = e < chunks_q ? sQ + r * (D + 8) + e * 8 : sG + r * (DV + 8) + (e - chunks_q) * 8;
    *reinterpret_cast<uint4*>(at) = uint4{0u, 0u, 0u, 0u};
  }
  __syncthreads();
}

/// The tensor-core backward, D columns of Q, K, dQ, dK and DV of V, dO, dV. Per query tile
/// (on a cut one, after clear_rows_missing_keys), warp w (keys 16w .. 16w + 15):
///   S^T = K Q^T and dP^T = V dO^T (mma, B operands by ldmatrix exactly as K^T in the forward);
///   P^T = exp2(S^T scale log2e - LSE), dS^T = P^T (dP^T - D) on the accumulators (with a
///   soft-cap, the score map's capped scores, and dS^T times 1 - (s / c)^2);
///   dV += P^T dO and dK += dS^T Q, with P^T and dS^T fed back as A operands from registers;
///   dS^T goes to shared memory as dS, and after one barrier each warp adds its share of
///   dQ = scale dS K into global memory (float atomics: other key blocks add to the same rows),
///   while the next query tile's Q and dO load.
/// P and dS are rounded to T as mma inputs (FlashAttention-2 does the same); every product
/// accumulates in float.
template <class T, int D, int DV>
__global__ void __launch_bounds__(mma_threads) flash_bwd_mma(BwdArgs<T> a) {
  constexpr int bk = mma_bwd_bk, bq = mma_bwd_bq<D, DV>, stride = D + 8, stride_v = DV + 8, ds_stride = bk + 8;
  constexpr int nt_q = bq / 8, nt_d = D / 8, nt_v = DV / 8;
  // dQ: the tile's bq / 16 row blocks times column groups make four warp tasks.
  constexpr int row_blocks = bq / 16, col_groups = (mma_threads / 32) / row_blocks, nt_per_group = nt_d / col_groups;
  static_assert(row_blocks * col_groups == mma_threads / 32 && nt_per_group % 2 == 0, "flash_bwd_mma: dQ split");
  T* sK = dynamic_smem<T>();
  T* sV = sK + bk * stride;
  T* sQ = sV + bk * stride_v;
  T* sG = sQ + bq * stride;     // dO
  T* sS = sG + bq * stride_v;   // dS, [query][key]
  float* sL = reinterpret_cast<float*>(sS + bq * ds_stride);
  float* sD = sL + bq;
  KeySpan32* spans = reinterpret_cast<KeySpan32*>(sD + bq);  // the query tile's rows' visible keys

  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * bk;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  const int nk = static_cast<int>(a.sk - j0 < bk ? a.sk - j0 : bk);
  const std::int64_t kh = a.heads.kv_head(h);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int key0 = warp * 16;  // this warp's first key in the tile

  const std::int64_t j_last = j0 + nk - 1;
  auto rows_of = [&](std::int64_t i0) { return static_cast<int>(a.sq - i0 < bq ? a.sq - i0 : bq); };
  auto tile_mask = [&](std::int64_t i0) { return classify_query_tile(a, b, i0, rows_of(i0), j0, j_last); };
  auto next_tile = [&](std::int64_t i0) { return next_query_tile(a, b, i0, bq, j0, j_last); };
  auto start_tile = [&](std::int64_t i0) {
    const int nq = rows_of(i0);
    load_tile_async<T, D, bq>(sQ, a.q, b, i0, h, nq);
    load_tile_async<T, DV, bq>(sG, a.dout, b, i0, h, nq);
    cp_async_commit();
    backward_row_stats<bq / 4>(a, b, h, i0, nq, sD, sL);
    fill_spans<bq>(spans, a, b, i0, nq);
  };
  std::int64_t i0 = next_tile(first_row_reaching(a, b, j0));
  if (i0 >= a.sq) return;  // no query sees these keys: nothing to add (the same for every thread)

  // This lane's keys: accumulator rows g and g + 8 of the warp's 16.
  bool key_ok[2];
  std::int64_t kj[2];  // local indices
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int kr = key0 + tile::mma_c_coord(lane, 2 * hf).row;
    key_ok[hf] = kr < nk;
    kj[hf] = j0 + kr;
  }
  float dk[nt_d][4], dv[nt_v][4];
#pragma unroll
  for (int n = 0; n < nt_d; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) dk[n][i] = 0.0f;
#pragma unroll
  for (int n = 0; n < nt_v; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) dv[n][i] = 0.0f;

  // B = X^T from a row-major X tile, and B = X loaded transposed: rows of Q, K, then of V, dO.
  const int off_b = tile::ldmatrix_k_offset(lane, stride), off_bv = tile::ldmatrix_k_offset(lane, stride_v);
  const int off_t = tile::ldmatrix_v_offset(lane, stride), off_tv = tile::ldmatrix_v_offset(lane, stride_v);
  load_tile_async<T, D>(sK, a.k, b, j0, kh, nk);
  load_tile_async<T, DV>(sV, a.v, b, j0, kh, nk);
  start_tile(i0);
  cp_async_wait<0>();
  __syncthreads();
  while (i0 < a.sq) {
    const int nq = rows_of(i0);
    const TileClass mask = tile_mask(i0);
    if (mask == TileClass::cut) clear_rows_missing_keys<T, D, DV>(sQ, sG, spans, nq, j0, j_last);

    float s[nt_q][4], dp[nt_q][4];
#pragma unroll
    for (int nt = 0; nt < nt_q; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = dp[nt][i] = 0.0f;
    // acc += k-chunk kc of (this warp's keys of `keys`) (the query tile's rows of `rows`)^T, both
    // of row stride `st` (off: the B operand's ldmatrix offset): S^T from K, Q and dP^T from V, dO.
    auto add_chunk = [&](float(&acc)[nt_q][4], const T* keys, const T* rows, int st, int off, int kc) {
      std::uint32_t ka[4];
      ldmatrix_x4<false>(ka, keys + key0 * st + kc * 16 + tile::ldmatrix_a_offset(lane, st));
#pragma unroll
      for (int nt = 0; nt < nt_q; nt += 2) mma_x2<false>(acc[nt], acc[nt + 1], ka, rows + nt * 8 * st + kc * 16 + off);
    };
#pragma unroll
    for (int kc = 0; kc < (D > DV ? D : DV) / 16; ++kc) {
      if (kc < D / 16) add_chunk(s, sK, sQ, stride, off_b, kc);
      if (kc < DV / 16) add_chunk(dp, sV, sG, stride_v, off_bv, kc);
    }
    const bool cut = mask == TileClass::cut;
    if (cut)
      bwd_p_ds<T, bq, true>(s, dp, key_ok, kj, spans, a, key0, sL, sD, sS);
    else
      bwd_p_ds<T, bq, false>(s, dp, key_ok, kj, spans, a, key0, sL, sD, sS);
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
      for (int n = 0; n < nt_v; n += 2) mma_x2<true>(dv[n], dv[n + 1], pa, sG + kc * 16 * stride_v + n * 8 + off_tv);
#pragma unroll
      for (int n = 0; n < nt_d; n += 2) mma_x2<true>(dk[n], dk[n + 1], da, sQ + kc * 16 * stride + n * 8 + off_t);
    }
    __syncthreads();  // dS is complete; every warp is done with sQ, sG, sL, sD, spans
    const std::int64_t i1 = next_tile(i0 + bq);
    if (i1 < a.sq) start_tile(i1);  // lands while dQ is computed

    if (cut)
      bwd_add_dq<T, D, bq, true>(a, sS, sK, b, h, i0, nq, j0, nk);
    else
      bwd_add_dq<T, D, bq, false>(a, sS, sK, b, h, i0, nq, j0, nk);
    cp_async_wait<0>();
    __syncthreads();  // the next tile is in; every warp is done with sS
    i0 = i1;
  }

  // This warp's keys of the dK or dV accumulators `acc`, times `f`, added to `g`.
  auto add_keys = [&](const auto& acc, const DeviceView<float>& g, float f) {
    constexpr int tiles = static_cast<int>(std::extent_v<std::remove_reference_t<decltype(acc)>>);
#pragma unroll
    for (int n = 0; n < tiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const tile::FragCoord c = tile::mma_c_coord(lane, i);
        const int kr = key0 + c.row;
        if (kr < nk) atomicAdd(g.row(b, j0 + kr, kh) + n * 8 + c.col, acc[n][i] * f);
      }
  };
  add_keys(dk, a.dk, a.scale);
  add_keys(dv, a.dv, 1.0f);
}

}  // namespace cuda_detail
}  // namespace seqpar
