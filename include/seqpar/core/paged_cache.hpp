#pragma once
/// \file
/// An engine-owned paged KV cache as seqpar reads it (never writes, allocates or frees it).
///
/// Serving engines keep one pool of pages per rank and a block table per sequence (FlashInfer,
/// vLLM, SGLang, TensorRT-LLM). On each rank a sequence's tokens are its local slots 0, 1, ...
/// (decode/decode_plan.hpp's TokenPlacement says which rank stores a position and at which
/// slot); slot s lives in row s % page_size of page pages(b)[s / page_size] of the pool. Page
/// ids are the engine's: any order, reused after the engine frees them; seqpar reads only the
/// rows of the slots a step's rows may see, so free pages and the unused tail of a sequence's
/// last page may hold anything (NaN included).

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

#include "seqpar/core/error.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/types.hpp"

namespace seqpar {

/// The pages of each sequence of a step on this rank, in local-slot order, in host memory.
/// Two forms, read alike without conversion: FlashInfer's CSR (`indptr` [B + 1] offsets into
/// `indices`) and vLLM's dense table ([num_seqs, max_blocks] row-major: row b holds sequence
/// b's pages, unused entries ignored). Page ids are int32 as both engines keep them.
/// (FlashInfer's last_page_len is not needed: the step knows each sequence's token count.)
struct BlockTable {
  const std::int32_t* indices = nullptr;  ///< page ids (CSR: all sequences'; dense: the table)
  const std::int32_t* indptr = nullptr;   ///< CSR offsets [sequences + 1]; null for a dense table
  std::int64_t row_length = 0;            ///< dense: entries per row (max_blocks); CSR: unused
  std::int64_t sequences = 0;             ///< rows of the table
  std::int64_t entries = 0;               ///< elements behind `indices` (bounds the CSR offsets)

  /// A CSR table: sequence b's pages are indices[indptr[b] .. indptr[b + 1]).
  static BlockTable csr(std::span<const std::int32_t> indptr, std::span<const std::int32_t> indices) {
    return {indices.data(), indptr.data(), 0, indptr.empty() ? 0 : static_cast<std::int64_t>(indptr.size()) - 1,
            static_cast<std::int64_t>(indices.size())};
  }
  /// A dense table of `max_blocks` entries per row (table.size() / max_blocks rows). With
  /// max_blocks 0 (a rank that holds no tokens of the step, [num_seqs, 0]) the size cannot
  /// say how many rows there are, and none has a page: every row reads as empty.
  static BlockTable dense(std::span<const std::int32_t> table, std::int64_t max_blocks) {
    const auto n = static_cast<std::int64_t>(table.size());
    const std::int64_t rows = max_blocks > 0 ? n / max_blocks : max_blocks == 0 ? std::numeric_limits<std::int64_t>::max() : 0;
    return {table.data(), nullptr, max_blocks, rows, n};
  }

  /// The pages of sequence b (call only after valid() said yes for b).
  std::span<const std::int32_t> pages(std::int64_t b) const {
    if (indptr == nullptr) return {indices + b * row_length, static_cast<std::size_t>(row_length)};
    return {indices + indptr[b], static_cast<std::size_t>(indptr[b + 1] - indptr[b])};
  }

  /// Why sequence b cannot give `needed` pages with ids in [0, num_pages) ("" when it can).
  /// Checks only what a step reads: the first `needed` entries.
  std::string reason(std::int64_t b, std::int64_t needed, std::int64_t num_pages) const {
    if (indptr == nullptr && row_length < 0)  // first: dense() gives such a table no rows
      return "block table: max_blocks " + std::to_string(row_length) + " is negative";
    if (b < 0 || b >= sequences)
      return "block table: it has " + std::to_string(sequences) + " rows, the batch needs row " + std::to_string(b);
    if (indptr != nullptr) {
      const std::int64_t lo = indptr[b], hi = indptr[b + 1];
      if (lo < 0 || hi < lo || hi > entries)
        return "block table: indptr[" + std::to_string(b) + "..+1] = " + std::to_string(lo) + ", " +
               std::to_string(hi) + " is not a range of the " + std::to_string(entries) + " indices";
    }
    const std::span<const std::int32_t> row = pages(b);
    if (static_cast<std::int64_t>(row.size()) < needed)
      return "block table: sequence " + std::to_string(b) + " has " + std::to_string(row.size()) +
             " pages on this rank, its tokens here need " + std::to_string(needed);
    for (std::int64_t i = 0; i < needed; ++i)
      if (row[static_cast<std::size_t>(i)] < 0 || row[static_cast<std::size_t>(i)] >= num_pages)
        return "block table: sequence " + std::to_string(b) + " page " + std::to_string(i) + " is id " +
               std::to_string(row[static_cast<std::size_t>(i)]) + ", outside the pool's 0.." +
               std::to_string(num_pages - 1);
    return {};
  }
};

/// A paged KV cache: the pools and the block table of one step, read only. The pools are
/// TensorViews with the page as the batch dimension: [num_pages, page_size, K, D] for NHD
/// (FlashInfer's and vLLM's default) or an HND pool [num_pages, K, page_size, D] given with
/// its strides (TensorView's seq stride = D, head stride = page_size x D). V may be a column
/// view of K's rows (MLA's latent cache: the same pointer and strides, D_v <= D).
template <class T, class Space = HostSpace>
struct PagedKV {
  TensorView<const T, Space> k_pool;  ///< [num_pages, page_size, K, D]
  TensorView<const T, Space> v_pool;  ///< [num_pages, page_size, K, D_v]
  BlockTable table;                   ///< this rank's pages of each sequence

  /// Tokens per page.
  std::int64_t page_size() const { return k_pool.seq(); }
  /// Pages in the pool.
  std::int64_t num_pages() const { return k_pool.batch(); }
  /// Pages that hold `slots` slots.
  std::int64_t pages_for(std::int64_t slots) const {
    return page_size() > 0 ? (slots + page_size() - 1) / page_size() : 0;
  }
  /// K row of local slot s of sequence b, head h.
  const T* k_row(std::int64_t b, std::int64_t s, std::int64_t h) const {
    return k_pool.row(page_of(b, s), s % page_size(), h);
  }
  /// V row of local slot s of sequence b, head h.
  const T* v_row(std::int64_t b, std::int64_t s, std::int64_t h) const {
    return v_pool.row(page_of(b, s), s % page_size(), h);
  }
  /// One past the last slot of the run that holds slot s: slots that follow each other in
  /// memory with the seq stride (the rest of s's page, and the pages after it whose ids follow
  /// when the pool's page stride is page_size rows, as a pool filled in order has). A kernel
  /// reads a run as one block of keys; `limit` caps the search.
  std::int64_t run_end(std::int64_t b, std::int64_t s, std::int64_t limit) const {
    const std::int64_t ps = page_size();
    std::int64_t end = (s / ps + 1) * ps;
    const bool joinable = k_pool.stride[0] == ps * k_pool.stride[1] && v_pool.stride[0] == ps * v_pool.stride[1];
    if (joinable) {
      const std::span<const std::int32_t> row = table.pages(b);
      for (std::int64_t i = s / ps; end < limit && row[static_cast<std::size_t>(i + 1)] == row[static_cast<std::size_t>(i)] + 1; ++i)
        end += ps;
    }
    return end < limit ? end : limit;
  }

 private:
  std::int64_t page_of(std::int64_t b, std::int64_t s) const {
    return table.pages(b)[static_cast<std::size_t>(s / page_size())];
  }
};

/// A decode step's query rows as a paged kernel call takes them: packed, sequence after
/// sequence (FlashInfer's qo_indptr), each row limited to its sequence's first local slots.
struct PagedRows {
  std::int64_t batch = 0;                ///< sequences B
  const std::int64_t* begin = nullptr;   ///< [B + 1]: sequence b's rows are [begin[b], begin[b + 1])
  const std::int64_t* key_end = nullptr; ///< per row: it sees its sequence's local slots [0, key_end[r])
};

}  // namespace seqpar
