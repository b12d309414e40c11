#pragma once
/// \file
/// Per-thread scratch of CpuFlashKernel's forward and backward: which buffers, their sizes,
/// and how they are carved from one byte range. The layouts serve every instruction set
/// (kernel/cpu/isa.hpp): rows are padded to whole panels of the widest one (two 512-bit
/// vectors), which is a whole number of panels of every narrower one.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

#include "seqpar/core/key_span.hpp"

namespace seqpar::detail {

/// Elements of A in the widest micro-kernel panel of any instruction set (two 64-byte vectors).
template <class A>
inline constexpr std::int64_t max_panel = 128 / sizeof(A);

/// Elements of A in the widest query panel of the forward (three 64-byte vectors: the float
/// forward's panel on AVX-512, isa/simd.inl's forward_vectors).
template <class A>
inline constexpr std::int64_t max_forward_panel = 192 / sizeof(A);

/// Query rows and key rows of a forward block (query blocks may be fewer rows, see
/// CpuFlashKernel::query_block_rows).
inline constexpr std::int64_t fwd_block_q = 512, fwd_block_k = 128;

/// Most query rows the forward's scratch holds: a sequence is cut into equal query blocks of
/// whole panels (CpuFlashKernel's forward), so one may be fwd_block_q rounded up to a panel.
inline constexpr std::int64_t fwd_block_rows = fwd_block_q + max_forward_panel<float>;

/// Query rows and key rows of a backward tile. Each task streams every query row of its heads
/// once per key block, so wide key blocks pay: 256 against 64 keys takes 7-18% less time at
/// head_dim 256 to 64 (seq 2048, 8 heads, non-causal). 96 query rows are whole register tiles
/// of 6 and 8 rows and whole AMX tile products (32 queries): against 72 rows, the AMX backward
/// took 10-15% less time (each tile of dK^T and dV^T is loaded and stored once per 96 queries
/// summed instead of 72 in 96) and the float backward the same or up to 4% less (Xeon with
/// AVX-512 and AMX, S 2048, D 64 and 128, causal and not); 256 keys are whole panels on every
/// target.
inline constexpr std::int64_t bwd_block_q = 96, bwd_block_k = 256;

/// Most key blocks one backward task takes (FlashBackward::blocks_per_task): its tiles then
/// span them all, so each query row is packed once per two blocks.
inline constexpr std::int64_t bwd_task_blocks = 2;

/// Whether head dims (dim, dim_v) suit the AMX forward's tiles: dim a multiple of 32 (a
/// tile's 16 pairs along the summed head dims), dim_v of 16 (a tile's rows of O^T).
constexpr bool amx_fits(std::int64_t dim, std::int64_t dim_v) { return dim % 32 == 0 && dim_v % 16 == 0; }

/// Query rows of a backward tile's scratch: bwd_block_q rounded up to whole AMX tiles (16 rows),
/// which read and write whole tiles (rows past the tile's are formed and never read).
inline constexpr std::int64_t bwd_tile_rows = (bwd_block_q + 15) / 16 * 16;

/// Queries of a backward tile as the AMX backward sums over them: bwd_block_q rounded up to
/// whole tile products (32 bf16 a row), zero past the tile's.
inline constexpr std::int64_t bwd_tile_queries = (bwd_block_q + 31) / 32 * 32;


/// A growable byte range whose growth neither copies nor zero-fills: every call rewrites the
/// scratch it reads, so what the range held is never needed, and zero-filling a plan's
/// reserve of backward slices (megabytes a thread) was most of a small test's time under
/// ThreadSanitizer. CpuFlashKernel's forward, backward and decode scratch are all of this
/// kind. Builds without NDEBUG fill new bytes with 0xFF instead (NaN in every float and double
/// lane), so that a path reading a scratch byte it did not write shows in tests; but not under
/// ThreadSanitizer, which looks for races, and pays for every byte written.
class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  /// Takes over `other`'s range; `other` is left empty.
  ScratchBuffer(ScratchBuffer&& other) noexcept
      : data_(std::move(other.data_)), size_(std::exchange(other.size_, 0)) {}
  /// Takes over `other`'s range; `other` is left empty.
  ScratchBuffer& operator=(ScratchBuffer&& other) noexcept {
    data_ = std::move(other.data_);
    size_ = std::exchange(other.size_, 0);
    return *this;
  }

  /// First byte (null while empty).
  std::byte* data() const { return data_.get(); }
  /// Bytes held.
  std::size_t size() const { return size_; }
  /// At least `n` bytes from now on; a larger range replaces the old one, contents not kept.
  void grow(std::size_t n) {
    if (n <= size_) return;
    data_.reset(new std::byte[n]);
    size_ = n;
#if !defined(NDEBUG) && !defined(__SANITIZE_THREAD__)
    std::memset(data_.get(), 0xFF, n);
#endif
  }

 private:
  std::unique_ptr<std::byte[]> data_;
  std::size_t size_ = 0;
};

/// Hands out 64-byte aligned sub-ranges of one byte range (or, with a null base, only counts).
class ScratchCarver {
 public:
  /// Carves from `base` (null: measure only).
  explicit ScratchCarver(std::byte* base) : base_(base) {}
  /// Points `ptr` at the next `count` elements.
  template <class E>
  void take(E*& ptr, std::int64_t count) {
    ptr = reinterpret_cast<E*>(base_ + used_);
    used_ += (static_cast<std::size_t>(count) * sizeof(E) + 63) / 64 * 64;
  }
  /// Bytes handed out so far.
  std::size_t used() const { return used_; }

 private:
  std::byte* base_;
  std::size_t used_ = 0;
};

/// The keys a forward query panel reaches, as local key indices: some lane sees each key of
/// `reach` (up to gaps between the lanes' spans), every lane sees each key of `all`.
struct PanelKeys {
  KeySpan reach;  ///< the lanes' spans joined
  KeySpan all;    ///< the lanes' spans intersected

  /// The keys rows [0, n) reach together and the keys all of them see, from the ends of the
  /// rows' spans, first[i] .. last[i], among `sk` keys.
  static PanelKeys join(const std::int64_t* first, const std::int64_t* last, std::int64_t n, std::int64_t sk) {
    PanelKeys r{{sk, -1}, {0, sk - 1}};
    for (std::int64_t i = 0; i < n; ++i) {
      if (first[i] <= last[i]) {
        r.reach.first = std::min(r.reach.first, first[i]);
        r.reach.last = std::max(r.reach.last, last[i]);
      }
      r.all.first = std::max(r.all.first, first[i]);
      r.all.last = std::min(r.all.last, last[i]);
    }
    return r;
  }

  /// The panel's part of key block j0 .. j1: keys [ja, ja + n) it reaches (n <= 0: none), of
  /// which [f0, f1), counted from ja, every lane sees (no mask there).
  struct Part {
    std::int64_t ja, n, f0, f1;
  };
  /// See Part.
  Part in_block(std::int64_t j0, std::int64_t j1) const {
    const std::int64_t ja = std::max(j0, reach.first), n = std::min(j1, reach.last) + 1 - ja;
    if (n <= 0) return {ja, n, 0, 0};
    const std::int64_t f0 = std::clamp<std::int64_t>(all.first - ja, 0, n);
    return {ja, n, f0, std::clamp<std::int64_t>(all.last + 1 - ja, f0, n)};
  }
};

/// One thread's forward scratch for accumulation type A, head dim `dim` (Q, K) and value dim
/// `dim_v` (V, O).
template <class A>
struct ForwardScratch {
  A *qt, *ot, *st, *m, *l, *alpha, *kbuf, *vbuf;
  A* ones;  ///< one panel of 1 (the alpha of an accumulating micro-kernel call: the decode path's P V)
  std::int64_t *first, *last;  ///< per query row: the ends of its KeySpan
  std::int64_t *lane_lo, *lane_hi;  ///< per key of a panel's masked part: lanes [lo, hi) see it
  PanelKeys* panel;  ///< per query panel of the block
  /// The AVX512-BF16 forward's pairs of bf16 (one 32-bit word each): V packed in pairs of
  /// keys, and one panel's P^T in pairs of keys (rows up to whole AMX tiles, zero-padded).
  /// (Its Q^T and K pairs take qt's and kbuf's bytes.)
  std::uint32_t *vpairs, *ppairs;
  /// The AMX forward's V^T in bf16: per head dim, the block's keys, vt_keys apart.
  std::uint16_t* vtrans;

  /// Stride of vtrans' rows, in keys: a block (fwd_block_k), one more key ahead of it (a panel
  /// starting at an odd key), up to a whole tile of 32 keys past it, and not a power of two.
  static constexpr std::int64_t vt_keys = fwd_block_k + 48;

  /// Stride of kbuf's rows: an odd number of 64-byte lines, so that consecutive rows start in
  /// different L1 sets.
  static constexpr std::int64_t ld_keys(std::int64_t dim) {
    constexpr std::int64_t line = 64 / sizeof(A);
    return ((dim + line - 1) / line | 1) * line;
  }

  /// Stride of the bf16 forward's K rows of head-dim pairs (32-bit words): an odd number of
  /// 64-byte lines, as ld_keys.
  static constexpr std::int64_t ld_pairs(std::int64_t dim) { return (((dim + 1) / 2 + 15) / 16 | 1) * 16; }

  /// Carves the scratch at `base` (or, with a null base, only measures it); returns the bytes.
  static std::size_t carve(std::byte* base, std::int64_t dim, std::int64_t dim_v, ForwardScratch* s) {
    ForwardScratch tmp;
    ForwardScratch& r = s ? *s : tmp;
    ScratchCarver c(base);
    c.take(r.qt, dim * fwd_block_rows);
    c.take(r.ot, dim_v * fwd_block_rows);
    c.take(r.st, fwd_block_k * max_forward_panel<A>);  // one query panel's S^T at a time
    c.take(r.m, fwd_block_rows);
    c.take(r.l, fwd_block_rows);
    c.take(r.alpha, max_forward_panel<A>);
    // The key block's K rows in A; or (AMX) rows of bf16 pairs, read in blocks of 32 rows from
    // any key of the block, so up to 32 rows past it.
    c.take(r.kbuf, std::max<std::int64_t>(fwd_block_k * ld_keys(dim),
                                          (fwd_block_k + 32) * ld_pairs(dim) * 4 / std::int64_t(sizeof(A))));
    c.take(r.vbuf, fwd_block_k * (dim_v + 8));  // V packed in tiles of up to 8 head dims
    c.take(r.first, fwd_block_rows);
    c.take(r.last, fwd_block_rows);
    c.take(r.lane_lo, fwd_block_k);
    c.take(r.lane_hi, fwd_block_k);
    c.take(r.panel, fwd_block_rows);  // at most one panel per query row
    c.take(r.ones, max_panel<A>);
    c.take(r.vpairs, (fwd_block_k / 2) * (dim_v + 8));  // key pairs x V dims padded to whole tiles
    c.take(r.ppairs, (fwd_block_k / 2 + 16) * max_panel<float>);  // key pairs (to whole tiles) x a panel's lanes
    c.take(r.vtrans, (dim_v + 16) * vt_keys);
    if (s) std::fill(r.ones, r.ones + max_panel<A>, A(1));
    return c.used();
  }
};

/// One thread's backward scratch for accumulation type A, carved from one byte range.
/// "Key rows" are ld_keys() long, "dim rows" ld_dim(dim) long and "value rows" ld_dim(dim_v)
/// long (V, O, dO and dV have the value dim).
template <class A>
struct BackwardScratch {
  A* ks;     ///< [task keys] dim rows: keys (B of dQ = dS K)
  A* kt;     ///< [dim] key rows: keys transposed (B of S)
  A* vt;     ///< [dim_v] key rows: values transposed (B of dP)
  A* dks;    ///< [task keys] dim rows: dK of the task's keys
  A* dvs;    ///< [task keys] value rows: dV of the task's keys
  A* qs;     ///< [BQ] dim rows: queries
  A* dos;    ///< [BQ] value rows: output gradients
  A* dqs;    ///< [BQ] dim rows: this tile's dQ share
  A* pm;     ///< [BQ] key rows: S, then P
  A* ds;     ///< [BQ] key rows: dP, then dS
  A* lrow;   ///< [BQ] LSE of the tile's rows
  A* delta;  ///< [BQ] rowsum(dO * O)
  A* ones;   ///< one panel of 1 (the alpha of an accumulating micro-kernel call)
  std::uint16_t* dsr;    ///< [BQ] key rows of bf16: dS rounded (the bf16 products' A of dQ)
  std::uint16_t* qdt;    ///< [dim + dim_v] rows of bwd_tile_queries bf16: Q^T, then dO^T (AMX's A of dK^T, dV^T)
  std::int64_t* row_lo;  ///< [BQ] keys of the block the row sees: [row_lo, row_hi] (block indices)
  std::int64_t* row_hi;  ///< [BQ]
  std::int64_t* bad;     ///< [task keys] keys of the task whose K row holds a NaN or Inf
  std::int64_t* bad_rows;  ///< [BQ] rows of the tile whose Q or dO row holds a NaN or Inf

  /// Head dim rounded up to whole micro-kernel panels (the columns the products form).
  static constexpr std::int64_t padded(std::int64_t dim) {
    return (dim + max_panel<A> - 1) / max_panel<A> * max_panel<A>;
  }
  /// Stride of dim rows: one panel more than needed, so that rows are not a power of two apart.
  static constexpr std::int64_t ld_dim(std::int64_t dim) { return padded(dim) + max_panel<A>; }
  /// Most keys of one task: bwd_task_blocks key blocks.
  static constexpr std::int64_t task_keys = bwd_block_k * bwd_task_blocks;
  /// Stride of key rows (same reason).
  static constexpr std::int64_t ld_keys() { return task_keys + max_panel<A>; }

  /// Carves the scratch for head dim `dim` and value dim `dim_v` at `base`, or with a null
  /// base only measures it; returns the bytes used.
  static std::size_t carve(std::byte* base, std::int64_t dim, std::int64_t dim_v, BackwardScratch* s) {
    // (Query rows in whole AMX tiles: see bwd_tile_rows.)
    constexpr std::int64_t BQ = bwd_tile_rows, BK = task_keys;
    const std::int64_t ld = ld_dim(dim), ldv = ld_dim(dim_v), lk = ld_keys();
    BackwardScratch tmp;
    BackwardScratch& r = s ? *s : tmp;
    ScratchCarver c(base);
    c.take(r.ks, BK * ld);
    c.take(r.kt, dim * lk);
    c.take(r.vt, dim_v * lk);
    c.take(r.dks, BK * ld);
    c.take(r.dvs, BK * ldv);
    c.take(r.qs, BQ * ld);
    c.take(r.dos, BQ * ldv);
    c.take(r.dqs, BQ * ld);
    c.take(r.pm, BQ * lk);
    c.take(r.ds, BQ * lk);
    c.take(r.lrow, BQ);
    c.take(r.delta, BQ);
    c.take(r.ones, max_panel<A>);
    c.take(r.dsr, BQ * lk);
    c.take(r.qdt, (dim + dim_v) * bwd_tile_queries);
    c.take(r.row_lo, BQ);
    c.take(r.row_hi, BQ);
    c.take(r.bad, BK);
    c.take(r.bad_rows, BQ);
    if (s) std::fill(r.ones, r.ones + max_panel<A>, A(1));
    return c.used();
  }
};

/// Whether head dims (dim, dim_v) suit the AMX backward's tiles: both multiples of 32 (each is
/// summed over by a product: S = Q K^T and dP = dO V^T), and neither more than a task's keys
/// (dK^T and dV^T, head dims by keys, take the bytes of the key-major dK and dV rows).
constexpr bool amx_backward_fits(std::int64_t dim, std::int64_t dim_v) {
  constexpr std::int64_t task_keys = BackwardScratch<float>::task_keys;
  return dim % 32 == 0 && dim_v % 32 == 0 && dim <= task_keys && dim_v <= task_keys;
}

/// Bytes of one thread's scratch `S` (ForwardScratch or BackwardScratch) for head dims up to
/// `dim` and value dims up to `dim_v`, float or double (rounded to 256 so that slices stay
/// aligned; the sizes grow with both dims, so a slice serves every smaller call).
template <template <class> class S>
inline std::size_t flash_thread_bytes(std::int64_t dim, std::int64_t dim_v) {
  const std::size_t n =
      std::max(S<float>::carve(nullptr, dim, dim_v, nullptr), S<double>::carve(nullptr, dim, dim_v, nullptr));
  return (n + 255) / 256 * 256;
}

}  // namespace seqpar::detail
