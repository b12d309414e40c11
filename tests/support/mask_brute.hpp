// Which keys a mask hides, straight from the definitions in AttentionProblem (not from
// MaskView, which the library's kernels use): the brute-force side of every mask test, host
// and GPU, and of the exact answer the distributed tests are held against
// (attention_check.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "seqpar/core/problem.hpp"

namespace seqpar::test {

/// Wide enough for a diagonal plus or minus any int64 window side (INT64_MAX: unbounded) and
/// any S_kv - S_q shift without overflow.
__extension__ typedef __int128 wide_int;

/// Index of the document holding `pos` in `docs` (lengths in order), or -1 past their end.
inline std::int64_t document_of(const std::vector<std::int64_t>& docs, std::int64_t pos) {
  std::int64_t end = 0;
  for (std::size_t n = 0; n < docs.size(); ++n)
    if (pos < (end += docs[n])) return static_cast<std::int64_t>(n);
  return -1;
}

/// The documents of batch element b (one list shared by all, or one per element).
inline const std::vector<std::int64_t>& documents_of(const AttentionProblem& pr, std::int64_t b) {
  return pr.documents[pr.documents.size() == 1 ? 0 : static_cast<std::size_t>(b)];
}

/// Causal, window and key padding of the definition (documents aside): key j visible to
/// query i (global positions) of batch element b, for S_q = sq and S_kv = skv.
inline bool visible_apart_from_documents(const AttentionProblem& pr, std::int64_t sq, std::int64_t skv,
                                         std::int64_t b, std::int64_t i, std::int64_t j) {
  const wide_int d = wide_int{i} + (pr.causal_align == CausalAlign::bottom_right ? wide_int{skv} - sq : 0);
  if (pr.causal && j > d) return false;
  if (pr.window.left >= 0 && j < d - pr.window.left) return false;
  if (pr.window.right >= 0 && j > d + pr.window.right) return false;
  if (!pr.kv_valid.empty() && j >= pr.kv_valid[static_cast<std::size_t>(b)]) return false;
  return true;
}

/// Key j visible to query i (global positions) of batch element b, for S_q = sq and S_kv = skv.
inline bool visible_by_definition(const AttentionProblem& pr, std::int64_t sq, std::int64_t skv, std::int64_t b,
                                  std::int64_t i, std::int64_t j) {
  if (!visible_apart_from_documents(pr, sq, skv, b, i, j)) return false;
  return pr.documents.empty() || document_of(documents_of(pr, b), i) == document_of(documents_of(pr, b), j);
}

/// visible_by_definition with every position's document looked up once, for loops over all
/// (query, key) pairs of a problem.
class DefinitionMask {
 public:
  /// The mask of `pr` for S_q = sq and S_kv = skv (kept by reference: `pr` must outlive it).
  DefinitionMask(const AttentionProblem& pr, std::int64_t sq, std::int64_t skv) : pr_(pr), sq_(sq), skv_(skv) {
    if (pr.documents.empty()) return;
    for (std::int64_t b = 0; b < pr.batch; ++b) {
      doc_.emplace_back();
      for (std::int64_t pos = 0; pos < std::max(sq, skv); ++pos) doc_.back().push_back(document_of(documents_of(pr, b), pos));
    }
  }
  /// Key j visible to query i of batch element b.
  bool visible(std::int64_t b, std::int64_t i, std::int64_t j) const {
    if (!visible_apart_from_documents(pr_, sq_, skv_, b, i, j)) return false;
    return doc_.empty() || doc_[static_cast<std::size_t>(b)][static_cast<std::size_t>(i)] ==
                               doc_[static_cast<std::size_t>(b)][static_cast<std::size_t>(j)];
  }

 private:
  const AttentionProblem& pr_;
  std::int64_t sq_, skv_;
  std::vector<std::vector<std::int64_t>> doc_;  // per batch element, per position: its document
};

}  // namespace seqpar::test
