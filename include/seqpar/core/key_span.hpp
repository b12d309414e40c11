#pragma once
/// \file
/// Which keys a query row sees, as local key indices of one kernel call, and what that makes
/// of a tile: the one vocabulary of the CPU kernel (kernel/cpu), the CUDA kernels
/// (kernel/cuda) and the plan's work count and ring-step skipping (core/plan.hpp), callable
/// from host and device code.
///
/// How a mask becomes tile decisions. Every mask family, and every combination, leaves a
/// query row one contiguous range of visible key *positions* (MaskView::keys). A call's key
/// positions strictly increase (k_positions), so the keys below a position are a prefix of
/// the call's keys (keys_below), and a row's visible keys are one run of local key indices:
/// its KeySpan, two numbers (row_span). Both ends of a row's range are non-decreasing down the
/// rows (query diagonals increase, and every bound moves with the diagonal: causal, the
/// window, the document holding the query, the batch element's padding, decode's row key
/// ends), and keys_below keeps them so, empty spans included. So for a run of rows and a tile
/// of keys j0 .. j1, the run's first and last rows decide (classify_tile):
/// - skip: the first row's span starts after the tile, or the last row's ends before it, or
///   the first row's starts after the last row's ends (every row of the run is then empty);
/// - visible: the last row's span starts at or before the tile and the first row's ends at or
///   after it, so every row sees every key: no per-element test;
/// - cut: a span boundary crosses the tile; test `span.sees(j)` per element. A cut tile may
///   still reach no row (a gap between the rows' spans, e.g. at a document boundary); a
///   kernel that wants skips to be exact checks the rows in between.
/// A hidden key is never read into a row, so NaN or Inf stored there (padding, a stale cache
/// slot) reaches no row.

#include <algorithm>
#include <cstdint>

#include "seqpar/core/host_device.hpp"
#include "seqpar/core/mask.hpp"
#include "seqpar/core/sequence_layout.hpp"

namespace seqpar {

/// A query row's visible keys as local key indices of a call, first .. last inclusive; empty
/// when first > last. `Index`: std::int64_t on the host (KeySpan), int in the CUDA kernels
/// (KeySpan32: half the registers and shared memory per row; their host side checks that the
/// call's keys fit). No default member initialisers: CUDA's __shared__ arrays need a trivial
/// default constructor.
template <class Index>
struct BasicKeySpan {
  Index first;  ///< first visible local key
  Index last;   ///< last visible local key

  /// True when the row sees no key.
  SEQPAR_HOST_DEVICE constexpr bool empty() const { return first > last; }
  /// True when local key j is visible to the row.
  SEQPAR_HOST_DEVICE constexpr bool sees(std::int64_t j) const { return first <= j && j <= last; }
  /// True when the row sees some key of the local keys j0 .. j1 (j0 <= j1).
  SEQPAR_HOST_DEVICE constexpr bool reaches(std::int64_t j0, std::int64_t j1) const {
    return first <= last && first <= j1 && last >= j0;
  }
};

/// A row's visible keys on the host and in the plan.
using KeySpan = BasicKeySpan<std::int64_t>;
/// A row's visible keys in the CUDA kernels (local key indices fit an int there).
using KeySpan32 = BasicKeySpan<std::int32_t>;

/// How many of a call's keys (positions `k`, increasing across its runs too) lie below
/// position x: the local index of the first key at or after x.
SEQPAR_HOST_DEVICE constexpr std::int64_t keys_below(const PositionMap& k, std::int64_t x) {
  std::int64_t n = 0;
  for (int s = 0; s < k.segments; ++s) {
    const PositionSegment& g = k.seg[s];
    if (x <= g.start) break;  // this run and every later one lie at or above x
    const std::int64_t d = x - g.start;  // start + t * stride < x for t < ceil(d / stride)
    const std::int64_t t = g.stride == 1 ? d : (d + g.stride - 1) / g.stride;
    n += t < g.count ? t : g.count;
  }
  return n;
}

/// The span of local query row i of batch element b in a call of `sk` keys at positions
/// `k_positions`, with query diagonals `q_diagonals` (KernelParams::q_positions) and `mask`
/// (causal merged in, KernelParams::full_mask; on a device its tables in device memory).
/// Without a mask every row sees 0 .. sk - 1, whatever the maps hold. The ends come from
/// keys_below, which keeps them non-decreasing down the rows even for empty spans.
template <class Span = KeySpan>
SEQPAR_HOST_DEVICE constexpr Span row_span(const MaskView& mask, const PositionMap& q_diagonals,
                                           const PositionMap& k_positions, std::int64_t sk, std::int64_t b,
                                           std::int64_t i) {
  using Index = decltype(Span::first);
  if (!mask.any()) return {Index{0}, static_cast<Index>(sk - 1)};
  const KeyRange r = mask.keys(b, q_diagonals(i));
  const std::int64_t first = keys_below(k_positions, r.lo), end = keys_below(k_positions, r.hi + 1);
  return {static_cast<Index>(first < sk ? first : sk), static_cast<Index>((end < sk ? end : sk) - 1)};
}

/// What a kernel does with a tile of keys for a run of query rows (see the file comment).
enum class TileClass : int {
  skip = 0,     ///< no row of the run sees a key of the tile
  visible = 1,  ///< every row sees every key: no per-element test
  cut = 2,      ///< a span boundary crosses the tile: test each (row, key); may still reach no row
};

/// Classifies local keys j0 .. j1 (j0 <= j1) for a run of rows whose first row has span `top`
/// and last row span `bottom` (both ends non-decreasing down the run, as row_span gives them).
template <class Index>
SEQPAR_HOST_DEVICE constexpr TileClass classify_tile(BasicKeySpan<Index> top, BasicKeySpan<Index> bottom,
                                                     std::int64_t j0, std::int64_t j1) {
  // The run's keys lie between its first row's first key and its last row's last.
  const std::int64_t lo = j0 > top.first ? j0 : top.first, hi = j1 < bottom.last ? j1 : bottom.last;
  if (lo > hi) return TileClass::skip;
  return bottom.first <= j0 && top.last >= j1 ? TileClass::visible : TileClass::cut;
}

namespace detail {

/// 128-bit integers for the closed-form pair counts (`__extension__`: no -Wpedantic warning in
/// users' builds).
__extension__ typedef __int128 wide_int;

/// ceil(p / q) for q > 0.
constexpr wide_int ceil_div(wide_int p, wide_int q) { return p >= 0 ? (p + q - 1) / q : -((-p) / q); }

/// The sum over i = 0 .. n-1 of floor((a + b i) / m), for n >= 0, m > 0, a >= 0, b >= 0, in
/// O(log m) steps (the Euclid-like floor-sum reduction: take the whole multiples of m out of a
/// and b, then count the lattice points under the line with the axes swapped).
constexpr wide_int floor_sum(wide_int n, wide_int m, wide_int a, wide_int b) {
  wide_int total = 0;
  while (n > 0) {
    if (b >= m) {
      total += n * (n - 1) / 2 * (b / m);
      b %= m;
    }
    if (a >= m) {
      total += n * (a / m);
      a %= m;
    }
    const wide_int top = b * n + a;  // the line's value at i = n
    if (top < m) break;
    n = top / m;
    a = top % m;
    const wide_int swap = m;
    m = b;
    b = swap;
  }
  return total;
}

/// Pairs (query i, key j) of one query run and one key run with key position <= query
/// diagonal + d: the sum over the run's diagonals x of the run's keys at or below x + d.
constexpr wide_int pairs_up_to(const PositionSegment& q, const PositionSegment& k, wide_int d) {
  // Keys at or below x + d: clamp(floor((x + d - k.start) / k.stride) + 1, 0, k.count), with
  // x + d - k.start = u + i q.stride; the count is 0 for i < i0, k.count from i1 on.
  const wide_int u = static_cast<wide_int>(q.start) + d - k.start, n = q.count;
  const wide_int i0 = std::clamp<wide_int>(ceil_div(-u, q.stride), 0, n);
  const wide_int i1 = std::clamp<wide_int>(ceil_div(static_cast<wide_int>(k.count) * k.stride - u, q.stride), i0, n);
  return floor_sum(i1 - i0, k.stride, u + i0 * q.stride, q.stride) + (i1 - i0) + (n - i1) * k.count;
}

/// True when every row's keys are [x - left, x + right] about its diagonal x (causal and
/// windows only): then visible_pairs and any_visible count in closed form.
constexpr bool counts_in_closed_form(const MaskView& mask) {
  return mask.doc_count == 0 && mask.kv_valid == nullptr && mask.row_key_end == nullptr;
}

}  // namespace detail

/// Visible (query, key) pairs between query diagonals `q` and key positions `k` of batch
/// element b under `mask` (causal included): the plan's work count. Causal masks and windows
/// are counted in closed form, O(log S) a pair of runs (the advisor costs ring steps of
/// sequences of millions this way); documents, key padding and decode's row ends row by row.
inline std::int64_t visible_pairs(const MaskView& mask, std::int64_t b, const PositionMap& q, const PositionMap& k) {
  const std::int64_t sk = k.size();
  if (!mask.any()) return q.size() * sk;
  if (detail::counts_in_closed_form(mask)) {
    // A row with diagonal x sees the keys in [x - left, x + right] (MaskView::keys): those at
    // or below x + right less those at or below x - left - 1.
    const bool bounded = mask.causal || mask.window_right >= 0;
    const std::int64_t right = mask.window_right < 0 ? 0 : clamp_window_side(mask.window_right);
    const std::int64_t hi = mask.causal ? 0 : right;
    detail::wide_int n = 0;
    for (int qs = 0; qs < q.segments; ++qs)
      for (int ks = 0; ks < k.segments; ++ks) {
        n += bounded ? detail::pairs_up_to(q.seg[qs], k.seg[ks], hi)
                     : static_cast<detail::wide_int>(q.seg[qs].count) * k.seg[ks].count;
        if (mask.window_left >= 0)
          n -= detail::pairs_up_to(q.seg[qs], k.seg[ks], -static_cast<detail::wide_int>(clamp_window_side(mask.window_left)) - 1);
      }
    return static_cast<std::int64_t>(n);
  }
  std::int64_t n = 0;
  for (std::int64_t i = 0; i < q.size(); ++i) {
    const KeySpan s = row_span(mask, q, k, sk, b, i);
    if (!s.empty()) n += s.last + 1 - s.first;
  }
  return n;
}

/// True when some query diagonal of `q` sees some key position of `k` in batch element b
/// (a ring step with no such pair is skipped).
inline bool any_visible(const MaskView& mask, std::int64_t b, const PositionMap& q, const PositionMap& k) {
  const std::int64_t sk = k.size();
  if (q.size() == 0 || sk == 0) return false;
  // Where visible_pairs counts in closed form, a hidden step costs no pass over its rows.
  if (detail::counts_in_closed_form(mask)) return visible_pairs(mask, b, q, k) > 0;
  for (std::int64_t i = 0; i < q.size(); ++i)
    if (!row_span(mask, q, k, sk, b, i).empty()) return true;
  return false;
}

}  // namespace seqpar
