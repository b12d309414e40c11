#pragma once
/// \file
/// Which global sequence positions each rank holds, for every layout, even or uneven.
///
/// The world is a mesh of ring_degree x ulysses_degree ranks. The sequence is first cut into
/// ring blocks, one per ring rank, placed by the layout (contiguous, zigzag or stripe); each
/// ring block is then cut into contiguous pieces, one per member of that ring rank's Ulysses
/// group, in Ulysses order. After the Ulysses all-to-all a member holds its whole ring block
/// again, in local order, so positions within a block always increase.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/core/host_device.hpp"

namespace seqpar {

/// Contiguous layout: ring rank r holds one run of positions.
struct Contiguous {
  static constexpr const char* name = "contiguous";  ///< readable name
};
/// Zigzag layout (head-tail): 2R chunks; ring rank r holds chunks r and 2R-1-r, which balances
/// causal work. A block of odd length puts the extra token in its first chunk.
struct Zigzag {
  static constexpr const char* name = "zigzag";  ///< readable name
};
/// Stripe layout: position t on ring rank t mod R. Lengths follow from the total.
struct Stripe {
  static constexpr const char* name = "stripe";  ///< readable name
};

/// Runtime tag of a layout.
enum class LayoutKind : std::int64_t { contiguous = 0, zigzag = 1, stripe = 2 };

/// LayoutKind of a layout type; fails to compile for anything else.
template <class L>
constexpr LayoutKind layout_kind_of() {
  if constexpr (std::is_same_v<L, Contiguous>) return LayoutKind::contiguous;
  else if constexpr (std::is_same_v<L, Zigzag>) return LayoutKind::zigzag;
  else if constexpr (std::is_same_v<L, Stripe>) return LayoutKind::stripe;
  else static_assert(sizeof(L) == 0, "seqpar: a layout must be Contiguous, Zigzag or Stripe");
}

/// Readable name of a LayoutKind.
constexpr const char* layout_name(LayoutKind k) {
  return k == LayoutKind::contiguous ? "contiguous" : k == LayoutKind::zigzag ? "zigzag" : "stripe";
}

/// A run of `count` local tokens at global positions start, start + stride, ...
struct PositionSegment {
  std::int64_t count = 0;   ///< tokens in the run
  std::int64_t start = 0;   ///< global position of the first
  std::int64_t stride = 1;  ///< distance between consecutive global positions (>= 1)
};

/// Global positions of a local slice, as at most two increasing runs (every layout needs no
/// more). Cheap to copy and passed to device kernels as it is (a plain array, members callable
/// from host and device code); positions strictly increase.
struct PositionMap {
  PositionSegment seg[2]{};  ///< the runs, in local order
  int segments = 0;          ///< runs in use (0, 1 or 2)

  /// One run of `count` positions from `start` with `stride`.
  SEQPAR_HOST_DEVICE static constexpr PositionMap run(std::int64_t count, std::int64_t start, std::int64_t stride = 1) {
    PositionMap m;
    if (count > 0) m.seg[m.segments++] = {count, start, stride};
    return m;
  }
  /// Number of local tokens.
  SEQPAR_HOST_DEVICE constexpr std::int64_t size() const {
    return (segments > 0 ? seg[0].count : 0) + (segments > 1 ? seg[1].count : 0);
  }
  /// Global position of local token i (0 <= i < size()).
  SEQPAR_HOST_DEVICE constexpr std::int64_t operator()(std::int64_t i) const {
    if (segments > 1 && i >= seg[0].count) return seg[1].start + (i - seg[0].count) * seg[1].stride;
    return seg[0].start + i * seg[0].stride;
  }
  /// First (smallest) position; the map must not be empty.
  SEQPAR_HOST_DEVICE constexpr std::int64_t first() const { return (*this)(0); }
  /// Last (largest) position; the map must not be empty.
  SEQPAR_HOST_DEVICE constexpr std::int64_t last() const { return (*this)(size() - 1); }
  /// The positions of local tokens [begin, begin + count).
  constexpr PositionMap sub(std::int64_t begin, std::int64_t count) const {
    PositionMap m;
    std::int64_t base = 0;
    for (int s = 0; s < segments; ++s) {
      const PositionSegment& g = seg[s];
      const std::int64_t lo = std::max(begin, base), hi = std::min(begin + count, base + g.count);
      if (lo < hi) m.seg[m.segments++] = {hi - lo, g.start + (lo - base) * g.stride, g.stride};
      base += g.count;
    }
    return m;
  }
};

/// Splits `total` into `parts` lengths as evenly as possible: the first total mod parts get
/// one more.
inline std::vector<std::int64_t> split_evenly(std::int64_t total, std::int64_t parts) {
  SEQPAR_CHECK(total >= 0 && parts >= 0, ConfigError, "split_evenly: expected a total and a part count >= 0, got ", total,
               " and ", parts);
  std::vector<std::int64_t> out(static_cast<std::size_t>(parts), parts > 0 ? total / parts : 0);
  for (std::int64_t i = 0; i < (parts > 0 ? total % parts : 0); ++i) ++out[static_cast<std::size_t>(i)];
  return out;
}

/// Global positions of every rank of a ring_degree x ulysses_degree mesh, built from the
/// local lengths of every rank. Ranks are addressed by mesh coordinates (ring rank, Ulysses
/// rank); mapping them to world ranks is the policy's business.
class SequenceLayout {
 public:
  /// One rank holding nothing.
  SequenceLayout() : SequenceLayout(LayoutKind::contiguous, 1, 1, std::vector<std::int64_t>(1, 0)) {}

  /// Builds the layout. `lengths[r * ulysses_degree + u]` is the local length of mesh rank
  /// (r, u). Throws ConfigError if the stripe layout gets lengths that do not follow from
  /// their total.
  SequenceLayout(LayoutKind kind, int ring_degree, int ulysses_degree, std::vector<std::int64_t> lengths)
      : kind_(kind), ring_(ring_degree), ulysses_(ulysses_degree), lengths_(std::move(lengths)) {
    SEQPAR_CHECK(ring_ >= 1 && ulysses_ >= 1, ConfigError, "SequenceLayout: degrees must be >= 1, got ring ",
                 ring_, " ulysses ", ulysses_);
    SEQPAR_CHECK(static_cast<int>(lengths_.size()) == ring_ * ulysses_, ConfigError,
                 "SequenceLayout: expected ", ring_ * ulysses_, " lengths, got ", lengths_.size());
    std::vector<std::int64_t> block(static_cast<std::size_t>(ring_), 0);
    for (int r = 0; r < ring_; ++r)
      for (int u = 0; u < ulysses_; ++u) {
        const std::int64_t len = length(r, u);
        SEQPAR_CHECK(len >= 0, ConfigError, "SequenceLayout: local length of mesh rank (", r, ",", u,
                     ") must be >= 0, got ", len);
        block[static_cast<std::size_t>(r)] += len;
      }
    total_ = 0;
    for (auto b : block) total_ += b;
    blocks_.resize(static_cast<std::size_t>(ring_));
    if (kind_ == LayoutKind::contiguous) {
      std::int64_t off = 0;
      for (int r = 0; r < ring_; ++r) {
        blocks_[r] = PositionMap::run(block[r], off);
        off += block[r];
      }
    } else if (kind_ == LayoutKind::zigzag) {
      // Chunk i < R is ring rank i's first half; chunk i >= R is ring rank (2R-1-i)'s second.
      std::vector<std::int64_t> chunk(2 * static_cast<std::size_t>(ring_));
      for (int r = 0; r < ring_; ++r) {
        chunk[r] = (block[r] + 1) / 2;
        chunk[2 * ring_ - 1 - r] = block[r] / 2;
      }
      std::vector<std::int64_t> start(chunk.size() + 1, 0);
      for (std::size_t i = 0; i < chunk.size(); ++i) start[i + 1] = start[i] + chunk[i];
      for (int r = 0; r < ring_; ++r) {
        PositionMap m = PositionMap::run(chunk[r], start[r]);
        const std::size_t hi = 2 * ring_ - 1 - r;
        if (chunk[hi] > 0) m.seg[m.segments++] = {chunk[hi], start[hi], 1};
        blocks_[r] = m;
      }
    } else {
      for (int r = 0; r < ring_; ++r) {
        const std::int64_t want = total_ > r ? (total_ - r + ring_ - 1) / ring_ : 0;
        SEQPAR_CHECK(block[r] == want, ConfigError, "stripe layout: ring rank ", r, " must hold ", want,
                     " of the ", total_, " tokens (token t lives on ring rank t mod ", ring_, "), got ", block[r],
                     "; use split_sequence() for the lengths, or the contiguous or zigzag layout");
        blocks_[r] = PositionMap::run(block[r], r, ring_);
      }
    }
  }

  /// Layout kind.
  LayoutKind kind() const { return kind_; }
  /// Ring degree R.
  int ring_degree() const { return ring_; }
  /// Ulysses degree U.
  int ulysses_degree() const { return ulysses_; }
  /// Global sequence length.
  std::int64_t total() const { return total_; }
  /// Local length of mesh rank (r, u).
  std::int64_t length(int r, int u) const { return lengths_[static_cast<std::size_t>(r * ulysses_ + u)]; }
  /// Offset of mesh rank (r, u)'s tokens inside its ring block.
  std::int64_t offset_in_block(int r, int u) const {
    std::int64_t off = 0;
    for (int v = 0; v < u; ++v) off += length(r, v);
    return off;
  }
  /// Positions of ring rank r's whole block (what a Ulysses group holds after its all-to-all).
  const PositionMap& block(int r) const { return blocks_[static_cast<std::size_t>(r)]; }
  /// Positions of mesh rank (r, u)'s local tokens.
  PositionMap positions(int r, int u) const { return block(r).sub(offset_in_block(r, u), length(r, u)); }

 private:
  LayoutKind kind_ = LayoutKind::contiguous;
  int ring_ = 1, ulysses_ = 1;
  std::vector<std::int64_t> lengths_;
  std::vector<PositionMap> blocks_;
  std::int64_t total_ = 0;
};

/// Local lengths of every mesh rank for a global length `total`, as even as the layout
/// allows: ring blocks differ by at most one token, and so do the pieces of a block. Indexed
/// like SequenceLayout's lengths (r * ulysses_degree + u).
inline std::vector<std::int64_t> split_mesh(std::int64_t total, int ring_degree, int ulysses_degree) {
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(ring_degree * ulysses_degree));
  for (std::int64_t block : split_evenly(total, ring_degree))
    for (std::int64_t piece : split_evenly(block, ulysses_degree)) out.push_back(piece);
  return out;
}

}  // namespace seqpar
