#pragma once
/// \file
/// The per-tile math of the CUDA flash kernels, as __host__ __device__ functions so that the
/// CPU tests exercise the very code the GPU runs (tests/test_tile_math.cpp):
/// - the online-softmax steps (FlashAttention-2, Alg. 1) in base 2: scores are pre-multiplied
///   by scale * log2(e), so each exponential is one exp2 and the row state is (m, l) in log2
///   units; the natural-log LSE is (m + log2 l) * ln 2;
/// - the guards that keep a row that sees no key at O = 0, LSE = -inf, never NaN (and a row
///   that saw a NaN at NaN), and the zeroing of NaN/Inf 16-bit elements at keys a mask hides;
/// - a device copy of the query-to-K/V head map (a plain struct, cheap to pass by value);
/// - the register layout of the mma.sync m16n8k16 fragments the tensor-core kernel uses.
/// The LSE merge of partial results is merge_row (kernel/merge_state.hpp), and which keys a row
/// sees and what that makes of a tile is core/key_span.hpp, both shared the same way.

#include <cmath>
#include <cstdint>

#include "seqpar/core/host_device.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"

namespace seqpar::tile {

/// log2(e): multiplies the softmax scale so that exp(x) becomes exp2(x * log2e).
inline constexpr float log2e = 1.4426950408889634f;
/// ln(2): turns a base-2 LSE back into the natural-log LSE the library reports.
inline constexpr float ln2 = 0.6931471805599453f;

/// 2^x; on the device the fast hardware exp2 (relative error ~2 ulp), on the host std::exp2.
SEQPAR_HOST_DEVICE inline float exp2_fast(float x) {
#if defined(__CUDA_ARCH__)
  return exp2f(x);
#else
  return std::exp2(x);
#endif
}

/// log2(x) for x > 0.
SEQPAR_HOST_DEVICE inline float log2_fast(float x) {
#if defined(__CUDA_ARCH__)
  return log2f(x);
#else
  return std::log2(x);
#endif
}

/// The value subtracted from a row's scores before exp2: the running max, or 0 while the row
/// has seen no visible key (max = -inf), so that exp2(-inf - offset) = 0 instead of NaN.
SEQPAR_HOST_DEVICE inline float softmax_offset(float row_max) { return row_max == -INFINITY ? 0.0f : row_max; }

/// Factor that rescales a row's running sum and output when its max moves from `m_old` to
/// `m_new` (>= m_old): exp2(m_old - m_new), and 0 for a row that had seen nothing.
SEQPAR_HOST_DEVICE inline float rescale_factor(float m_old, float m_new) {
  return exp2_fast(m_old - softmax_offset(m_new));
}

/// Weight of a score `s` (log2 units) in a row whose max is `m_new`; 0 for a hidden score.
SEQPAR_HOST_DEVICE inline float softmax_weight(float s, float m_new) { return exp2_fast(s - softmax_offset(m_new)); }

/// What a finished row writes: output = accumulator * inv_sum; lse in natural log.
struct RowFinish {
  float inv_sum;  ///< 1 / l, or 0 for a row that saw no key (its output is then 0)
  float lse;      ///< (m + log2 l) * ln 2, or -inf for a row that saw no key
};

/// Closes a row with running max `m` (log2 units) and running sum `l`. A NaN sum (the row saw
/// a NaN score, or an Inf one) stays NaN in both, as the reference's: marking such a row as one
/// that saw nothing (LSE = -inf) would let a merge or the backward drop the NaN silently.
SEQPAR_HOST_DEVICE inline RowFinish finish_row(float m, float l) {
  if (l == 0.0f) return {0.0f, -INFINITY};
  return {1.0f / l, (m + log2_fast(l)) * ln2};
}

/// Exponent bits of the 16-bit float formats: an element whose exponent bits are all set is
/// NaN or +-Inf.
inline constexpr std::uint32_t half_exponent = 0x7c00u;
/// Exponent bits of bf16 (see half_exponent).
inline constexpr std::uint32_t bf16_exponent = 0x7f80u;

/// Whether the 16-bit float in the low half of `bits` (exponent mask `exponent`: half_exponent
/// or bf16_exponent) is NaN or +-Inf.
SEQPAR_HOST_DEVICE constexpr bool nonfinite16(std::uint32_t bits, std::uint32_t exponent) {
  return (bits & exponent) == exponent;
}

/// A register of two packed 16-bit floats with each NaN or +-Inf element replaced by +0 (the
/// others untouched). The kernels apply it to the K or V elements of a tile the mask cuts
/// (TileClass::cut): a hidden key's weight is exactly 0, and 0 x NaN would otherwise be NaN.
SEQPAR_HOST_DEVICE constexpr std::uint32_t zero_nonfinite_pair(std::uint32_t pair, std::uint32_t exponent) {
  const std::uint32_t keep_lo = nonfinite16(pair, exponent) ? 0xffff0000u : 0xffffffffu;
  const std::uint32_t keep_hi = nonfinite16(pair >> 16, exponent) ? 0x0000ffffu : 0xffffffffu;
  return pair & keep_lo & keep_hi;
}

/// KernelParams::kv_head as a kernel argument.
struct HeadMap {
  std::int64_t group_size = 1;     ///< query heads per K/V head (global)
  std::int64_t q_head_begin = 0;   ///< global index of local query head 0
  std::int64_t kv_head_begin = 0;  ///< global index of local K/V head 0

  /// Copies the head map of `p` (host side).
  static HeadMap from(const KernelParams& p) { return {p.group_size, p.q_head_begin, p.kv_head_begin}; }
  /// Local K/V head read by local query head h.
  SEQPAR_HOST_DEVICE std::int64_t kv_head(std::int64_t h) const {
    return (q_head_begin + h) / group_size - kv_head_begin;
  }
};

/// Row and column of one element of an mma fragment.
struct FragCoord {
  int row;  ///< row of the element in the operand tile
  int col;  ///< column of the element in the operand tile
};

/// mma.sync.m16n8k16 operand A (16 x 16, row-major), element i (0..7) of `lane`. Registers
/// hold elements (0,1), (2,3), (4,5), (6,7); each pair is two adjacent columns of one row.
SEQPAR_HOST_DEVICE constexpr FragCoord mma_a_coord(int lane, int i) {
  return {(lane >> 2) + 8 * ((i >> 1) & 1), 2 * (lane & 3) + (i & 1) + 8 * (i >> 2)};
}
/// Operand B (16 x 8, "col": k down, n across), element i (0..3): (k, n). Each register pair
/// is two adjacent k of one column n.
SEQPAR_HOST_DEVICE constexpr FragCoord mma_b_coord(int lane, int i) {
  return {2 * (lane & 3) + (i & 1) + 8 * (i >> 1), lane >> 2};
}
/// Accumulator C/D (16 x 8), element i (0..3). Elements 0, 1 are row lane/4, elements 2, 3 row
/// lane/4 + 8: a row lives in the four lanes of one quad, which reduce it with shuffles.
SEQPAR_HOST_DEVICE constexpr FragCoord mma_c_coord(int lane, int i) {
  return {(lane >> 2) + 8 * (i >> 1), 2 * (lane & 3) + (i & 1)};
}
/// Offset, in a row-major shared tile with row stride `stride` (elements), of the two adjacent
/// elements A-register r (0..3) of `lane` holds: one 32-bit load.
SEQPAR_HOST_DEVICE constexpr int mma_a_offset(int lane, int r, int stride) {
  return mma_a_coord(lane, 2 * r).row * stride + mma_a_coord(lane, 2 * r).col;
}
/// Offset of B-register r (0..1) when B^T is stored row-major ([n][k], e.g. K as keys x dims):
/// the register's two k are adjacent, so this is one 32-bit load.
SEQPAR_HOST_DEVICE constexpr int mma_b_offset_nk(int lane, int r, int stride) {
  return mma_b_coord(lane, 2 * r).col * stride + mma_b_coord(lane, 2 * r).row;
}
/// Offset of B-element i (0..3) when B is stored row-major ([k][n], e.g. V as keys x dims): a
/// register's two elements sit in consecutive rows and are loaded separately.
SEQPAR_HOST_DEVICE constexpr int mma_b_offset_kn(int lane, int i, int stride) {
  return mma_b_coord(lane, i).row * stride + mma_b_coord(lane, i).col;
}
/// ldmatrix.m8n8.x4 (16-bit elements): lane l supplies the address of row (l % 8) of matrix
/// (l / 8); register j of every lane receives two elements of matrix j. This is the element
/// (row, col) of matrix j that `lane` receives in the low (e = 0) or high (e = 1) half: row
/// lane/4 and columns 2 (lane%4) + e, or with .trans the transposed position.
SEQPAR_HOST_DEVICE constexpr FragCoord ldmatrix_elem(int lane, int e, bool trans) {
  return trans ? FragCoord{2 * (lane & 3) + e, lane >> 2} : FragCoord{lane >> 2, 2 * (lane & 3) + e};
}
/// Offset, in a row-major [key][dim] tile with row stride `stride`, of the row that `lane`
/// passes to ldmatrix.x4 (no transpose) to load operand B = K^T for n-tiles nt, nt + 1 of one
/// 16-wide k-chunk (the base points at key 8 nt, dim 16 kc). The four matrices are (n-tile,
/// k-half) = (nt, 0), (nt, 1), (nt+1, 0), (nt+1, 1): registers b0, b1 of nt, then of nt + 1.
SEQPAR_HOST_DEVICE constexpr int ldmatrix_k_offset(int lane, int stride) {
  return ((lane >> 4) * 8 + (lane & 7)) * stride + ((lane >> 3) & 1) * 8;
}
/// Offset of the row `lane` passes to ldmatrix.x4.trans to load operand B = V for n-tiles
/// n, n + 1 of one 16-key chunk (the base points at key 16 kc, dim 8 n) from a row-major
/// [key][dim] tile: matrices (keys 0-7, n), (keys 8-15, n), (0-7, n+1), (8-15, n+1), which
/// transposed are registers b0, b1 of n, then of n + 1.
SEQPAR_HOST_DEVICE constexpr int ldmatrix_v_offset(int lane, int stride) {
  return (((lane >> 3) & 1) * 8 + (lane & 7)) * stride + (lane >> 4) * 8;
}
/// Offset of the row `lane` passes to ldmatrix.x4 (no transpose) to load operand A of one
/// 16 x 16 block of a row-major tile (the base points at its top-left element): matrices
/// (rows 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) are registers a0..a3. The
/// addressing is that of ldmatrix_v_offset: the same four 8 x 8 blocks, here not transposed.
SEQPAR_HOST_DEVICE constexpr int ldmatrix_a_offset(int lane, int stride) { return ldmatrix_v_offset(lane, stride); }
/// The accumulator element that becomes A-element i when a 16 x 16 block of C (two n-tiles of
/// 8 columns) is fed back as operand A: n-tile (i >> 2) of the pair, element (i & 3). This is
/// what lets the kernel keep P = softmax(S) in registers between the two products.
SEQPAR_HOST_DEVICE constexpr int a_from_c_tile(int i) { return i >> 2; }
/// See a_from_c_tile: the element index inside that n-tile.
SEQPAR_HOST_DEVICE constexpr int a_from_c_elem(int i) { return i & 3; }

}  // namespace seqpar::tile
