#pragma once
/// \file
/// Attention masks by global position: causal (top-left or bottom-right), a sliding window,
/// packed documents and key padding, in any combination.
///
/// Every mask family this library offers leaves each query row a *contiguous range* of
/// visible key positions: with d(i) the query's diagonal (i top-left, i + S_kv - S_q
/// bottom-right),
///   lo = max(start of i's document, d(i) - window.left),
///   hi = min(end of i's document - 1, d(i) if causal, d(i) + window.right, kv_valid[b] - 1),
/// and key j is visible iff lo <= j <= hi (MaskView::keys). How kernels and the plan turn
/// these ranges into per-row key spans and per-tile decisions is core/key_span.hpp.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "seqpar/core/checked.hpp"
#include "seqpar/core/host_device.hpp"
#include "seqpar/core/sequence_layout.hpp"

namespace seqpar {

/// Where the causal diagonal sits when S_q != S_kv.
enum class CausalAlign : std::uint8_t {
  top_left = 0,      ///< query i sees keys 0..i (by global position)
  bottom_right = 1,  ///< the last query sees the last key: query i sees keys 0..i + S_kv - S_q (FlashAttention 2+)
};

/// A sliding window around the diagonal: query i sees keys d(i) - left .. d(i) + right.
/// -1 on a side means unbounded; {-1, -1} is no window. A side may be any value >= 0 up to
/// INT64_MAX: one at least as long as the sequence hides nothing on its side (the mask
/// computes with it clamped, core/checked.hpp's clamp_window_side, so it never wraps).
struct Window {
  std::int64_t left = -1;   ///< keys before the diagonal (-1: all)
  std::int64_t right = -1;  ///< keys after the diagonal (-1: all; causal caps it at 0)
  /// True when a side is bounded.
  constexpr bool active() const { return left >= 0 || right >= 0; }
};

/// An inclusive range of key positions; empty when lo > hi.
struct KeyRange {
  std::int64_t lo = 0;   ///< first visible key position
  std::int64_t hi = -1;  ///< last visible key position
  /// True when no key is visible.
  SEQPAR_HOST_DEVICE constexpr bool empty() const { return lo > hi; }
};

/// The mask as a kernel sees it: plain values and pointers into the plan (host memory), cheap
/// to copy. Built by the engine from the agreed problem; kernels call keys() and visible().
/// Queries are given by their *diagonal* position d(i): KernelParams::q_positions already
/// hold d(i) (the engine adds S_kv - S_q for bottom-right alignment; documents need
/// S_q == S_kv, so there d(i) = i).
struct MaskView {
  bool causal = false;                 ///< keys after the diagonal are hidden
  std::int64_t window_left = -1;       ///< -1: unbounded
  std::int64_t window_right = -1;      ///< -1: unbounded
  const std::int64_t* doc_starts = nullptr;  ///< per batch row: starts of the documents, then the total
  std::int64_t doc_count = 0;          ///< documents per batch row (0: no documents)
  std::int64_t doc_batch_stride = 0;   ///< entries between batch rows of doc_starts (0: shared)
  const std::int64_t* kv_valid = nullptr;  ///< valid keys per batch element (null: all)
  /// Per query row: the keys before this *local index* are the row's keys, [B x row_stride]
  /// entries indexed by the row's diagonal (decode over a cache shard gives every row its own
  /// count of visible local slots; q_positions are then 0..T-1). Null: not used.
  const std::int64_t* row_key_end = nullptr;
  std::int64_t row_stride = 0;  ///< entries per batch element of row_key_end

  /// True when some key can be hidden (any family is on).
  SEQPAR_HOST_DEVICE constexpr bool any() const {
    return causal || window_left >= 0 || window_right >= 0 || doc_count > 0 || kv_valid != nullptr ||
           row_key_end != nullptr;
  }

  /// The visible key positions of the query with diagonal position `d` in batch element `b`.
  SEQPAR_HOST_DEVICE constexpr KeyRange keys(std::int64_t b, std::int64_t d) const {
    constexpr std::int64_t big = std::numeric_limits<std::int64_t>::max() / 4;
    KeyRange r{-big, big};
    const std::int64_t q = d;  // documents: S_q == S_kv, so the diagonal is the position
    if (causal) r.hi = d;
    // Sides are clamped (2^60 at most) before the arithmetic: |d| < 2^58, so d - side and
    // d + side never wrap, whatever the caller put in the view.
    if (window_left >= 0) r.lo = d - clamp_window_side(window_left);
    if (window_right >= 0) {
      const std::int64_t right = d + clamp_window_side(window_right);
      r.hi = r.hi < right ? r.hi : right;
    }
    if (doc_count > 0) {
      const std::int64_t* starts = doc_starts + b * doc_batch_stride;
      // The document holding q: the last start <= q (binary search; documents are not empty).
      std::int64_t a = 0, z = doc_count;  // starts[a] <= q < starts[z]
      while (z - a > 1) {
        const std::int64_t m = (a + z) / 2;
        if (starts[m] <= q) a = m; else z = m;
      }
      r.lo = r.lo > starts[a] ? r.lo : starts[a];
      r.hi = r.hi < starts[a + 1] - 1 ? r.hi : starts[a + 1] - 1;
    }
    if (kv_valid) r.hi = r.hi < kv_valid[b] - 1 ? r.hi : kv_valid[b] - 1;
    if (row_key_end) {
      const std::int64_t end = row_key_end[b * row_stride + d];
      r.hi = r.hi < end - 1 ? r.hi : end - 1;
    }
    if (r.lo < 0) r.lo = 0;
    return r;
  }

  /// True when key position `k` is visible to the query with diagonal `d` of batch element `b`.
  SEQPAR_HOST_DEVICE constexpr bool visible(std::int64_t b, std::int64_t d, std::int64_t k) const {
    const KeyRange r = keys(b, d);
    return r.lo <= k && k <= r.hi;
  }
};

/// The tables a MaskView points into, built once from the problem's documents and key
/// padding: a Plan owns one, and so can a check against a reference that has no plan.
class MaskTables {
 public:
  /// No documents, no key padding.
  MaskTables() = default;
  /// Document starts per batch row (a single list is shared by every row; lists of different
  /// lengths are padded with empty documents at the end, which no search finds) and the key
  /// padding (valid keys per batch element; empty: none).
  MaskTables(const std::vector<std::vector<std::int64_t>>& documents, std::vector<std::int64_t> kv_valid)
      : kv_valid_(std::move(kv_valid)) {
    for (const auto& docs : documents) doc_count_ = std::max(doc_count_, static_cast<std::int64_t>(docs.size()));
    doc_stride_ = documents.size() > 1 ? doc_count_ + 1 : 0;
    for (const auto& docs : documents) {
      std::int64_t at = 0;
      for (std::int64_t len : docs) doc_starts_.push_back(std::exchange(at, at + len));
      for (auto d = static_cast<std::int64_t>(docs.size()); d <= doc_count_; ++d) doc_starts_.push_back(at);
    }
  }
  /// The view with `causal` and `window`, pointing into this object (valid while it lives).
  MaskView view(bool causal, Window window) const {
    MaskView m;
    m.causal = causal;
    m.window_left = window.left;
    m.window_right = window.right;
    m.doc_count = doc_count_;
    m.doc_starts = doc_count_ > 0 ? doc_starts_.data() : nullptr;
    m.doc_batch_stride = doc_stride_;
    m.kv_valid = kv_valid_.empty() ? nullptr : kv_valid_.data();
    return m;
  }

 private:
  std::vector<std::int64_t> doc_starts_;  // per batch row (or shared): document starts, then the total
  std::int64_t doc_count_ = 0, doc_stride_ = 0;
  std::vector<std::int64_t> kv_valid_;
};

}  // namespace seqpar
