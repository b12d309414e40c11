#pragma once
/// \file
/// CpuFlashKernel's decode path: few query rows (a decode step's 1-16 new tokens per sequence)
/// against a long run of keys (a KV cache shard), each row with its own visible keys
/// (MaskView::row_key_end, or any other mask family).
///
/// The prefill loop is the wrong shape for it: it packs K and V once per query head and fills
/// a 32-lane query panel with one row, so one query against 32K keys ran at ~0.7 GFLOP/s. Here
/// one task takes every query row that reads a slab of K/V heads (all of them when the rows
/// fit one forward scratch), all query heads of each GQA group at once (a head's rows = new
/// tokens x group heads, token-major; a group too large for one scratch, MQA's, is split by
/// query heads, DecodeSplit), against one chunk of those heads' keys:
///  - the chunk goes by key blocks of 64-128 KB of K (as much V), each block for every head of
///    the slab before the next: a token's heads are one contiguous run in [B, S, Hkv, D], so
///    the reads stream (per head, one 512-byte run per token 4 KB apart would touch a page
///    per row), and the next block is prefetched into L2 while this one computes;
///  - scores of a head with few rows (decode_dot_rows) are dot products, head dims in the
///    lanes, summed across lanes for many keys at once; more rows fill the lanes of query
///    panels instead (S^T = K Q^T, K broadcast from the caller's rows, as the forward);
///  - O += P V reads V in place (contiguous vectors of the caller's rows), head dims in the
///    lanes, so a single query row wastes no lane;
///  - K and V are read once per step for all heads of the group, which is what bounds decode
///    (memory bandwidth), and nothing is packed: only a cache narrower than the accumulation
///    type (bf16) is widened, block by block and head by head, into the scratch (it is read at
///    half the bytes of a float cache, and the block is then in L1/L2 for both products).
/// With several threads and too few (batch x slab) groups to keep them busy, each group's
/// keys are split into chunks (flash-decoding): every chunk gives each row a partial (O, LSE),
/// and a second pass merges the chunks in order with merge_row, exactly. The partials live in
/// one buffer of the kernel, sized on the first call of a shape and reused after.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "seqpar/core/key_span.hpp"
#include "seqpar/core/paged_cache.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/types.hpp"
#include "seqpar/kernel/cpu/flash_scratch.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/kernel/merge_state.hpp"

namespace seqpar::detail {

/// Most query rows per sequence that take the decode path (DecodeProblem's new_tokens bound).
inline constexpr std::int64_t decode_max_queries = 16;

/// Fewest keys per chunk when a group's keys are split over threads: below, the chunk's fixed
/// costs (packing its queries, writing and merging a partial) stop being small.
inline constexpr std::int64_t decode_min_chunk = 512;

/// How a decode call's query rows divide into tasks (before the key chunks): a task takes
/// `slab` K/V heads with every query head of each, or, when one K/V head's rows (tokens x its
/// query heads) exceed one forward scratch, `part_heads` of its query heads, the group split
/// evenly into `parts` (MQA with many heads: 128 heads x 16 tokens are four tasks of 512
/// rows, each reading the K/V head's keys, which that many rows per key make cheap).
struct DecodeSplit {
  std::int64_t part_heads;  ///< query heads of one K/V head per task
  std::int64_t parts;       ///< tasks that share one K/V head's query heads
  std::int64_t slab;        ///< K/V heads per task (1 when parts > 1)

  /// The split for `tokens` query rows per head, `group` query heads per K/V head and
  /// `kheads` K/V heads; rows of a task are rounded up to whole panels of `panel` lanes.
  static DecodeSplit of(std::int64_t tokens, std::int64_t group, std::int64_t kheads, std::int64_t panel) {
    const std::int64_t most = fwd_block_q / std::max<std::int64_t>(1, tokens);  // >= 32 query heads
    const std::int64_t parts = std::max<std::int64_t>(1, (group + most - 1) / most);
    const std::int64_t part_heads = (group + parts - 1) / parts;
    const std::int64_t rows = (std::max<std::int64_t>(1, tokens * part_heads) + panel - 1) / panel * panel;
    if (parts > 1) return {part_heads, parts, 1};
    return {part_heads, 1, std::clamp<std::int64_t>(fwd_block_q / rows, 1, std::max<std::int64_t>(1, kheads))};
  }
};

/// One decode-shaped forward call: the tensors, the parameters and the split into tasks
/// (batch element x slab of K/V heads or part of one's query heads x key chunk). The same job
/// reads a paged cache in place (CpuFlashKernel::forward_paged): then a "batch element" is a
/// sequence of the step, its query rows a run of the packed q, its keys its local slots read
/// through the block table, and its key blocks end where a run of pages ends.
template <class T, class O, class A>
struct FlashDecode {
  TensorView<const T> q;  ///< [B, Sq, H, D], Sq <= decode_max_queries; paged: [1, R, H, D] packed
  TensorView<const T> k;  ///< [B, Sk, Hkv, D]; paged: the K pool [pages, page_size, Hkv, D]
  TensorView<const T> v;  ///< [B, Sk, Hkv, D_v] (may view K's rows: MLA's latent cache); paged: the V pool
  TensorView<O> out;      ///< [B, Sq, H, D_v]; paged: [1, R, H, D_v]
  TensorView<A> lse;      ///< [B, Sq, H, 1], or absent; paged: [1, R, H, 1]
  const KernelParams& p;  ///< scale, mask, head map
  const PagedKV<T>* cache = nullptr;  ///< paged: the pools and the block table (null: dense k, v)
  const PagedRows* rows = nullptr;    ///< paged: each sequence's rows and each row's visible slots
  std::int64_t most_tokens = q.seq();  ///< most query rows of one batch element (paged: of one sequence)
  std::int64_t chunks = 1;  ///< key chunks per group (1: each task writes its rows' output)
  A* part = nullptr;        ///< chunks > 1: per (group, chunk, row) the chunk's O (D_v) then its LSE
  DecodeSplit split = DecodeSplit::of(most_tokens, group_heads(q, p), k.heads(), max_panel<A>);  ///< rows per task

  /// Whether a forward call of this shape takes the decode path: few query rows.
  static bool applies(TensorView<const T> q, TensorView<const T> k, const KernelParams&) {
    return q.seq() >= 1 && q.seq() <= decode_max_queries && k.heads() >= 1;
  }
  /// Most local query heads that read one K/V head.
  static std::int64_t group_heads(TensorView<const T> q, const KernelParams& p) {
    return std::min(p.group_size, q.heads());
  }
  /// Scratch rows of one K/V head's query rows in a task (tokens x its heads), rounded up to
  /// whole panels of the widest level, so that every head's rows start on a panel.
  static std::int64_t head_rows(std::int64_t tokens, std::int64_t heads) {
    return (std::max<std::int64_t>(1, tokens * heads) + max_panel<A> - 1) / max_panel<A> * max_panel<A>;
  }
  /// Key chunks per group for `threads` threads and `groups` groups of at most `keys` keys:
  /// enough tasks for about four per thread, no chunk under decode_min_chunk keys.
  static std::int64_t chunks_for(int threads, std::int64_t groups, std::int64_t keys) {
    if (threads <= 1 || groups == 0) return 1;  // one thread, or an empty batch: no task at all
    const std::int64_t want = (4 * threads + groups - 1) / groups;
    return std::clamp<std::int64_t>(want, 1, std::max<std::int64_t>(1, keys / decode_min_chunk));
  }
  /// Batch elements (paged: sequences).
  std::int64_t batch() const { return rows ? rows->batch : q.batch(); }
  /// Query rows of batch element b.
  std::int64_t tokens(std::int64_t b) const { return rows ? rows->begin[b + 1] - rows->begin[b] : q.seq(); }
  /// Keys of batch element b (paged: the slots its last row sees, the most of its rows).
  std::int64_t keys(std::int64_t b) const {
    return rows ? (tokens(b) > 0 ? rows->key_end[rows->begin[b + 1] - 1] : 0) : k.seq();
  }
  /// Query row t of batch element b sees its keys `span` (of `sk`).
  KeySpan span(std::int64_t b, std::int64_t t, std::int64_t sk) const {
    return rows ? KeySpan{0, rows->key_end[rows->begin[b] + t] - 1} : p.row_span(b, t, sk);
  }
  /// Q row of token t, query head h of batch element b.
  const T* q_row(std::int64_t b, std::int64_t t, std::int64_t h) const {
    return rows ? q.row(0, rows->begin[b] + t, h) : q.row(b, t, h);
  }
  /// O row of token t, query head h of batch element b.
  O* out_row(std::int64_t b, std::int64_t t, std::int64_t h) const {
    return rows ? out.row(0, rows->begin[b] + t, h) : out.row(b, t, h);
  }
  /// Stores the LSE of token t, query head h of batch element b (when the call asks for it).
  void store_lse(std::int64_t b, std::int64_t t, std::int64_t h, A value) const {
    if (!lse.absent()) (rows ? lse(0, rows->begin[b] + t, h) : lse(b, t, h)) = value;
  }
  /// K row of key j, K/V head kh of batch element b; the keys of one block follow it k.stride[1] apart.
  const T* k_row(std::int64_t b, std::int64_t j, std::int64_t kh) const {
    return cache ? cache->k_row(b, j, kh) : k.row(b, j, kh);
  }
  /// V row of key j, K/V head kh of batch element b (as k_row).
  const T* v_row(std::int64_t b, std::int64_t j, std::int64_t kh) const {
    return cache ? cache->v_row(b, j, kh) : v.row(b, j, kh);
  }
  /// The last key of a block that starts at j0 and would end at j1: j1, or paged the end of
  /// j0's run of pages (whose rows follow each other one seq stride apart) when that comes first.
  std::int64_t block_last(std::int64_t b, std::int64_t j0, std::int64_t j1) const {
    return cache ? cache->run_end(b, j0, j1 + 1) - 1 : j1;
  }

  /// Slabs of K/V heads per batch element.
  std::int64_t slabs() const { return (k.heads() + split.slab - 1) / split.slab; }
  /// Groups: (batch element, slab, part), part fastest.
  std::int64_t groups() const { return batch() * slabs() * split.parts; }
  /// Tasks of the first pass: groups x chunks.
  std::int64_t tasks() const { return groups() * chunks; }
  /// Scratch and partial rows of one K/V head in a task (see head_rows).
  std::int64_t head_rows() const { return head_rows(most_tokens, split.part_heads); }
  /// Partial rows of a group: its heads' rows, head_rows() apart.
  std::int64_t max_rows() const { return split.slab * head_rows(); }

  /// What group `g` takes: batch element b, K/V heads [kh0, kh1), part `part` of each one's
  /// query heads.
  struct Group {
    std::int64_t b, kh0, kh1, part;
  };
  /// See Group.
  Group group(std::int64_t g) const {
    const std::int64_t per_batch = slabs() * split.parts, u = g % per_batch, kh0 = u / split.parts * split.slab;
    return {g / per_batch, kh0, std::min(k.heads(), kh0 + split.slab), u % split.parts};
  }
  /// The local query heads [first, second) of part `part` of those that read local K/V head
  /// `kh` (empty when the part is past them).
  std::pair<std::int64_t, std::int64_t> heads(std::int64_t kh, std::int64_t part) const {
    const std::int64_t g = kh + p.kv_head_begin;
    const std::int64_t h0 = std::max<std::int64_t>(0, g * p.group_size - p.q_head_begin);
    const std::int64_t h1 = std::min(q.heads(), (g + 1) * p.group_size - p.q_head_begin);
    const std::int64_t a = std::min(h1, h0 + part * split.part_heads);
    return {a, split.parts > 1 ? std::min(h1, a + split.part_heads) : h1};
  }
  /// Bytes of the partials for `chunks` chunks (0 when there is one).
  std::size_t part_bytes() const {
    return chunks > 1 ? static_cast<std::size_t>(tasks() * max_rows() * (v.dim() + 1)) * sizeof(A) : 0;
  }
  /// Row `r` of chunk `c` of group `g` in the partials: D_v values of O, then the LSE.
  A* part_row(std::int64_t g, std::int64_t c, std::int64_t r) const {
    return part + ((g * chunks + c) * max_rows() + r) * (v.dim() + 1);
  }

  /// Second pass, for group `g`: merges each row's chunks in order (merge_row) into out, lse.
  void merge(std::int64_t g) const {
    const std::int64_t dim_v = v.dim();
    const Group at = group(g);
    for (std::int64_t kh = at.kh0; kh < at.kh1; ++kh) {
      const auto [h0, h1] = heads(kh, at.part);
      const std::int64_t gh = h1 - h0, r0 = (kh - at.kh0) * head_rows();
      for (std::int64_t r = 0; r < tokens(at.b) * gh; ++r) {
        A* o = part_row(g, 0, r0 + r);
        A l = o[dim_v];
        for (std::int64_t c = 1; c < chunks; ++c) {
          const A* oc = part_row(g, c, r0 + r);
          merge_row<A>(o, l, oc, oc[dim_v], dim_v);
        }
        O* dst = out_row(at.b, r / gh, h0 + r % gh);
        for (std::int64_t d = 0; d < dim_v; ++d) dst[d] = static_cast<O>(o[d]);
        store_lse(at.b, r / gh, h0 + r % gh, l);
      }
    }
  }
};

/// An upper bound on FlashDecode<..., A>::part_bytes() over every decode-path call within `c`
/// with `threads` threads (0 when no such call splits keys), the smaller of two:
///  - by shape: chunks at most 4 x threads and Sk / decode_min_chunk, slabs x slab below
///    2 x K/V heads, rows per K/V head below twice those of the whole group (a split group's
///    parts add at most a panel and a token row each), D_v + 1 values per row;
///  - by tasks: keys are split only when groups < 4 x threads (chunks_for), so tasks = groups x
///    chunks < 8 x threads, each with at most fwd_block_q + a panel rows (DecodeSplit keeps a
///    task's rows within one forward scratch). This one keeps a paged plan's bound (a large
///    max_batch) from growing with the batch.
/// Calls with fewer heads (the ring's polled chunks) stay below both.
template <class A>
std::size_t decode_part_bytes_bound(int threads, const KernelCallBounds& c) {
  if (threads <= 1 || c.q_rows < 1 || c.q_rows > decode_max_queries) return 0;
  const std::int64_t chunks = std::min<std::int64_t>(4 * std::int64_t{threads}, c.kv_rows / decode_min_chunk);
  if (chunks <= 1) return 0;
  const std::int64_t group = std::max<std::int64_t>(1, std::min(c.group_size, c.heads));
  const std::int64_t rows = (std::max<std::int64_t>(1, c.q_rows * group) + max_panel<A> - 1) / max_panel<A> * max_panel<A>;
  const std::int64_t dim_v = c.value_dim > 0 ? c.value_dim : c.head_dim;
  const std::int64_t by_shape = c.batch * 2 * std::max<std::int64_t>(1, c.kv_heads) * chunks * rows;
  const std::int64_t by_tasks = 8 * std::int64_t{threads} * (fwd_block_q + max_panel<A>);
  return static_cast<std::size_t>(std::min(by_shape, by_tasks) * (dim_v + 1)) * sizeof(A);
}

}  // namespace seqpar::detail
