#pragma once
/// \file
/// The mask on the device for CudaFlashKernel: every family of core/mask.hpp (causal of
/// either alignment, windows, packed documents, key padding, decode's per-row key ends).
///
/// Every family leaves a query row one contiguous range of visible key *positions*
/// (MaskView::keys); positions increase within a call, so it is one run of *local key indices*
/// too, a KeySpan. The kernels compute each row's span once per block (forward) or per query
/// tile (backward) and then:
/// - skip a tile outside the spans of its rows (a forward tile the block's first row's span
///   starts after or its last row's span ends before, or that no row's span reaches; a
///   backward query tile before the first row that sees the key tile, or after the last);
/// - take the unmasked path on a tile every row sees whole (the last row's span starts at or
///   before the tile and the first row's span ends at or after it: both ends are
///   non-decreasing down the rows);
/// - test `span.first <= j <= span.last` per element on the other tiles, with the NaN-safety
///   of the causal cut tiles (a hidden key adds exactly 0, whatever K and V hold there; in
///   the backward, a row that sees none of a cut tile's keys adds exactly 0 to their dK and
///   dV, whatever its Q and dO hold).
///
/// MaskView points into the plan, in host memory; DeviceMaskTables keeps the kernel object's
/// device copy of the tables it points to (documents, key padding, row key ends).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "seqpar/cuda/error.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/mask.hpp"
#include "seqpar/kernel/cuda/flash_args.cuh"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/kernel/tile_math.hpp"

namespace seqpar {
namespace cuda_detail {

/// A query row's visible keys as local key indices of the call, first .. last inclusive
/// (empty when first > last). Both ends are non-decreasing down the rows of a call.
struct KeySpan {
  int first;  ///< first visible local key
  int last;   ///< last visible local key
  /// True when local key j is visible to the row.
  SEQPAR_HOST_DEVICE constexpr bool sees(std::int64_t j) const { return first <= j && j <= last; }
  /// True when the row sees some key of the local keys j0 .. j1.
  SEQPAR_HOST_DEVICE constexpr bool reaches(std::int64_t j0, std::int64_t j1) const {
    return first <= last && first <= j1 && last >= j0;
  }
};

/// How many of the `count` positions start + t * stride (stride > 0) are below position x.
SEQPAR_HOST_DEVICE inline std::int64_t run_below(std::int64_t start, std::int64_t stride, std::int64_t count,
                                                 std::int64_t x) {
  if (count <= 0 || x <= start) return 0;
  const std::int64_t n = (x - start + stride - 1) / stride;
  return n < count ? n : count;
}

/// How many of the sk local keys with positions `k` have a position below x.
SEQPAR_HOST_DEVICE inline std::int64_t keys_below(const tile::Positions& k, std::int64_t sk, std::int64_t x) {
  const std::int64_t n0 = k.count0 < sk ? k.count0 : sk;
  return run_below(k.start0, k.stride0, n0, x) + run_below(k.start1, k.stride1, sk - n0, x);
}

/// The span of query row i of batch element b, for a call with `mask` (causal merged in; its
/// tables in device memory on the device), query diagonals `q` and sk keys at positions `k`.
/// Without a mask every row sees 0 .. sk - 1. The ends are mapped from positions with
/// keys_below, which keeps them non-decreasing down the rows even for empty spans.
SEQPAR_HOST_DEVICE inline KeySpan row_span(const MaskView& mask, const tile::Positions& q, const tile::Positions& k,
                                           std::int64_t sk, std::int64_t b, std::int64_t i) {
  if (!mask.any()) return {0, static_cast<int>(sk - 1)};
  const KeyRange r = mask.keys(b, q(i));
  return {static_cast<int>(keys_below(k, sk, r.lo)), static_cast<int>(keys_below(k, sk, r.hi + 1) - 1)};
}

/// row_span of query row i of batch element b for the call of `a` (FwdArgs or BwdArgs).
template <class Args>
SEQPAR_HOST_DEVICE KeySpan row_span(const Args& a, std::int64_t b, std::int64_t i) {
  return row_span(a.mask, a.qpos, a.kpos, a.sk, b, i);
}

/// Classifies local keys j0 .. j1 for a run of query rows whose first row has span `top` and
/// last row span `bottom` (spans are non-decreasing): hidden when every row's span lies
/// before or after the keys, visible when every row sees them all, partial otherwise (a
/// partial tile may still reach no row when the rows' spans leave a gap over it).
SEQPAR_HOST_DEVICE inline tile::TileMask classify_span_tile(KeySpan top, KeySpan bottom, std::int64_t j0,
                                                            std::int64_t j1) {
  if (j1 < top.first || j0 > bottom.last) return tile::TileMask::hidden;
  return bottom.first <= j0 && top.last >= j1 ? tile::TileMask::visible : tile::TileMask::partial;
}

/// The first query row of a call (`a`: FwdArgs or BwdArgs) whose span in batch element b ends
/// at or after local key j, or a.sq: the rows before it see no key from j on (binary search
/// over the non-decreasing span ends).
template <class Args>
SEQPAR_HOST_DEVICE std::int64_t first_row_reaching(const Args& a, std::int64_t b, std::int64_t j) {
  if (!a.mask.any()) return 0;
  std::int64_t lo = 0, hi = a.sq;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (row_span(a, b, mid).last >= j)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

/// classify_span_tile for query rows i0 .. i0 + nq - 1 of the call of `a` (its first and last
/// rows' spans).
template <class Args>
SEQPAR_HOST_DEVICE tile::TileMask classify_query_tile(const Args& a, std::int64_t b, std::int64_t i0, int nq,
                                                      std::int64_t j0, std::int64_t j1) {
  return classify_span_tile(row_span(a, b, i0), row_span(a, b, i0 + nq - 1), j0, j1);
}

/// The backward's walk over query tiles of `bq` rows for local keys j0 .. j1: the first tile
/// start at or after i0 whose rows may see one of the keys, or a.sq once a tile's first row's
/// span starts after them (so do all later rows'). Start it at first_row_reaching.
template <class Args>
SEQPAR_HOST_DEVICE std::int64_t next_query_tile(const Args& a, std::int64_t b, std::int64_t i0, int bq,
                                                std::int64_t j0, std::int64_t j1) {
  for (; i0 < a.sq; i0 += bq) {
    if (row_span(a, b, i0).first > j1) return a.sq;
    const int nq = static_cast<int>(a.sq - i0 < bq ? a.sq - i0 : bq);
    if (classify_query_tile(a, b, i0, nq, j0, j1) != tile::TileMask::hidden) return i0;
  }
  return a.sq;
}

/// Block-wide: spans[r] = row_span of query row i0 + r for r < n, an empty span for the other
/// rows up to ROWS (threads stride over the rows; publish with a barrier). `a`: FwdArgs or BwdArgs.
template <int ROWS, class Args>
__device__ __forceinline__ void fill_spans(KeySpan* spans, const Args& a, std::int64_t b, std::int64_t i0, int n) {
  for (int r = threadIdx.x; r < ROWS; r += blockDim.x)
    spans[r] = r < n ? row_span(a, b, i0 + r) : KeySpan{0, -1};
}

/// Whether some row of spans[0 .. n) reaches local keys j0 .. j1 (REACH) or some row misses
/// them all (!REACH); every lane gets it (a warp collective: call from the whole warp).
template <bool REACH = true>
__device__ __forceinline__ bool rows_reach(const KeySpan* spans, int n, std::int64_t j0, std::int64_t j1) {
  bool any = false;
  for (int r = threadIdx.x & 31; r < n; r += 32) any = any || spans[r].reaches(j0, j1) == REACH;
  return warp_any(any);
}

/// classify_span_tile for the rows spans[0 .. n) (n >= 1), exact on hidden tiles: a partial
/// one that no row reaches is hidden. A warp collective on data every thread shares, so the
/// answer is the same in the whole block.
__device__ __forceinline__ tile::TileMask classify_rows(const KeySpan* spans, int n, std::int64_t j0,
                                                        std::int64_t j1) {
  tile::TileMask m = classify_span_tile(spans[0], spans[n - 1], j0, j1);
  if (m == tile::TileMask::partial && !rows_reach(spans, n, j0, j1)) m = tile::TileMask::hidden;
  return m;
}

/// The device copy of the mask tables a MaskView points to (document starts, key padding,
/// decode's row key ends), owned by one CudaFlashKernel object.
///
/// The rule: view() compares the call's tables element by element with a host copy of what
/// the device buffer holds, and uploads (cudaMemcpyAsync on the call's stream) only when they
/// differ, so repeated calls with the same plan allocate nothing, copy nothing and wait for
/// nothing. A change on the stream of the last upload, whose tables fit the buffer, reuses it:
/// stream order puts the copy after every kernel that read the old tables; before the host copy
/// is rewritten, it waits for the last upload to have been read (an event recorded after it;
/// decode, whose row key ends change every step, has synchronised the stream by then, so the
/// wait is free). Otherwise (a larger table, another stream, or the tables were read on
/// another stream since the last upload) the old buffer is freed (cudaFree
/// waits for the device, so no kernel on any stream still reads it) and a new one allocated.
/// Not thread-safe: one kernel object per thread (the engine owns one per rank). A copy starts
/// empty and uploads on its first masked call.
class DeviceMaskTables {
 public:
  /// No tables on the device yet.
  DeviceMaskTables() = default;
  /// An empty set (device memory is not shared between copies).
  DeviceMaskTables(const DeviceMaskTables&) noexcept {}
  /// Takes `o`'s device buffer.
  DeviceMaskTables(DeviceMaskTables&& o) noexcept { swap(o); }
  /// Keeps this object's buffer (a copy does not share device memory).
  DeviceMaskTables& operator=(const DeviceMaskTables&) noexcept { return *this; }
  /// Swaps buffers with `o` (which frees this one's).
  DeviceMaskTables& operator=(DeviceMaskTables&& o) noexcept {
    swap(o);
    return *this;
  }
  /// Frees the device buffer.
  ~DeviceMaskTables() {
    release();
    if (uploaded_) cudaEventDestroy(uploaded_);
  }

  /// `p`'s mask for a kernel: p.causal merged in, and the tables for `batch` batch elements in
  /// device memory (uploaded on `stream` when they changed, see the class comment).
  MaskView view(const KernelParams& p, std::int64_t batch, cudaStream_t stream) {
    MaskView m = p.mask;
    m.causal = m.causal || p.causal;
    const std::size_t n_doc = m.doc_count > 0 ? static_cast<std::size_t>(
                                                    (m.doc_batch_stride > 0 ? (batch - 1) * m.doc_batch_stride : 0) +
                                                    m.doc_count + 1)
                                              : 0;
    const std::size_t n_kv = m.kv_valid ? static_cast<std::size_t>(batch) : 0;
    const std::size_t n_row = m.row_key_end ? static_cast<std::size_t>(batch * m.row_stride) : 0;
    if (n_doc + n_kv + n_row == 0) return m;
    const Part parts[3] = {{m.doc_starts, n_doc}, {m.kv_valid, n_kv}, {m.row_key_end, n_row}};
    if (!same(parts)) upload(parts, stream);
    else if (stream != stream_) mixed_ = true;  // read on another stream too: no reuse next time
    const std::int64_t* at = dev_;
    if (n_doc) m.doc_starts = at;
    if (n_kv) m.kv_valid = at + n_doc;
    if (n_row) m.row_key_end = at + n_doc + n_kv;
    return m;
  }

 private:
  struct Part {
    const std::int64_t* data;
    std::size_t size;
  };

  void swap(DeviceMaskTables& o) noexcept {
    std::swap(dev_, o.dev_);
    std::swap(capacity_, o.capacity_);
    std::swap(stream_, o.stream_);
    std::swap(mixed_, o.mixed_);
    std::swap(uploaded_, o.uploaded_);
    host_.swap(o.host_);
  }

  bool same(const Part (&parts)[3]) const {
    std::size_t at = 0;
    for (const Part& x : parts) at += x.size;
    if (!dev_ || at != host_.size()) return false;
    at = 0;
    for (const Part& x : parts) {
      if (x.size && std::memcmp(host_.data() + at, x.data, x.size * sizeof(std::int64_t)) != 0) return false;
      at += x.size;
    }
    return true;
  }

  void upload(const Part (&parts)[3], cudaStream_t stream) {
    std::size_t n = 0;
    for (const Part& x : parts) n += x.size;
    if (dev_ && stream == stream_ && !mixed_ && n <= capacity_) {
      SEQPAR_CUDA_CHECK(cudaEventSynchronize(uploaded_));  // the last copy has read host_
    } else {
      release();
      void* p = nullptr;
      SEQPAR_CUDA_CHECK(cudaMalloc(&p, n * sizeof(std::int64_t)));
      dev_ = static_cast<std::int64_t*>(p);
      capacity_ = n;
      if (!uploaded_) SEQPAR_CUDA_CHECK(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming));
    }
    host_.clear();
    for (const Part& x : parts) host_.insert(host_.end(), x.data, x.data + x.size);
    SEQPAR_CUDA_CHECK(cudaMemcpyAsync(dev_, host_.data(), n * sizeof(std::int64_t), cudaMemcpyHostToDevice, stream));
    SEQPAR_CUDA_CHECK(cudaEventRecord(uploaded_, stream));
    stream_ = stream;
    mixed_ = false;
  }

  /// Frees the device buffer (cudaFree waits for the kernels that may still read it).
  void release() noexcept {
    if (dev_) cudaFree(dev_);
    dev_ = nullptr;
    capacity_ = 0;
  }

  std::int64_t* dev_ = nullptr;      // device copy of host_
  std::size_t capacity_ = 0;         // entries dev_ has room for
  cudaStream_t stream_ = nullptr;    // the stream of the copy into dev_
  bool mixed_ = false;               // dev_ was read on another stream since that copy
  cudaEvent_t uploaded_ = nullptr;   // recorded after that copy
  std::vector<std::int64_t> host_;   // what dev_ holds: document starts, key padding, row key ends
};

}  // namespace cuda_detail
}  // namespace seqpar
