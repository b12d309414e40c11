#pragma once
/// \file
/// The mask on the device for CudaFlashKernel: every family of core/mask.hpp (causal of
/// either alignment, windows, packed documents, key padding, decode's per-row key ends).
///
/// Which keys a row sees and what that makes of a tile is core/key_span.hpp (row_span,
/// classify_tile), the same code the CPU kernel and the plan run. The kernels compute each
/// row's span (KeySpan32) once per block (forward) or per query tile (backward) and then skip
/// a tile the spans leave out (forward: exact, a cut tile no row reaches is skipped too;
/// backward: query tiles before the first row that reaches the key tile, and from the first
/// whose first row starts after it), take the unmasked path on a visible tile, and on a cut
/// one test `span.sees(j)` per element, with the NaN-safety of cut tiles (a hidden key adds
/// exactly 0, whatever K and V hold there; in the backward, a row that sees none of a cut
/// tile's keys adds exactly 0 to their dK and dV, whatever its Q and dO hold). This header
/// keeps the device side of that: the kernels' walks over rows and tiles, and
/// DeviceMaskTables, the kernel object's device copy of the tables a MaskView points to
/// (documents, key padding, row key ends; MaskView points into the plan, in host memory).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "seqpar/cuda/error.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/key_span.hpp"
#include "seqpar/core/mask.hpp"
#include "seqpar/kernel/cuda/flash_args.cuh"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/kernel/tile_math.hpp"

namespace seqpar {
namespace cuda_detail {

/// row_span of query row i of batch element b for the call of `a` (FwdArgs or BwdArgs).
template <class Args>
SEQPAR_HOST_DEVICE KeySpan32 row_span(const Args& a, std::int64_t b, std::int64_t i) {
  return seqpar::row_span<KeySpan32>(a.mask, a.qpos, a.kpos, a.sk, b, i);
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

/// classify_tile for query rows i0 .. i0 + nq - 1 of the call of `a` (its first and last
/// rows' spans).
template <class Args>
SEQPAR_HOST_DEVICE TileClass classify_query_tile(const Args& a, std::int64_t b, std::int64_t i0, int nq,
                                                 std::int64_t j0, std::int64_t j1) {
  return classify_tile(row_span(a, b, i0), row_span(a, b, i0 + nq - 1), j0, j1);
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
    if (classify_query_tile(a, b, i0, nq, j0, j1) != TileClass::skip) return i0;
  }
  return a.sq;
}

/// Block-wide: spans[r] = row_span of query row i0 + r for r < n, an empty span for the other
/// rows up to ROWS (threads stride over the rows; publish with a barrier). `a`: FwdArgs or BwdArgs.
template <int ROWS, class Args>
__device__ __forceinline__ void fill_spans(KeySpan32* spans, const Args& a, std::int64_t b, std::int64_t i0, int n) {
  for (int r = threadIdx.x; r < ROWS; r += blockDim.x)
    spans[r] = r < n ? row_span(a, b, i0 + r) : KeySpan32{0, -1};
}

/// Whether some row of spans[0 .. n) reaches local keys j0 .. j1 (REACH) or some row misses
/// them all (!REACH); every lane gets it (a warp collective: call from the whole warp).
template <bool REACH = true>
__device__ __forceinline__ bool rows_reach(const KeySpan32* spans, int n, std::int64_t j0, std::int64_t j1) {
  bool any = false;
  for (int r = threadIdx.x & 31; r < n; r += 32) any = any || spans[r].reaches(j0, j1) == REACH;
  return warp_any(any);
}

/// classify_tile for the rows spans[0 .. n) (n >= 1), exact on skips: a cut tile that no row
/// reaches is skipped. A warp collective on data every thread shares, so the answer is the
/// same in the whole block.
__device__ __forceinline__ TileClass classify_rows(const KeySpan32* spans, int n, std::int64_t j0, std::int64_t j1) {
  TileClass m = classify_tile(spans[0], spans[n - 1], j0, j1);
  if (m == TileClass::cut && !rows_reach(spans, n, j0, j1)) m = TileClass::skip;
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
    MaskView m = p.full_mask();
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
