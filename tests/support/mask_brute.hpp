// Which keys a mask hides, straight from the definitions in AttentionProblem (not from
// MaskView, which the library's kernels use): the brute-force side of every mask test, host
// and GPU.
#pragma once

#include <cstdint>
#include <vector>

#include "seqpar/core/problem.hpp"

namespace seqpar::test {

/// Key j visible to query i (global positions) of batch element b, for S_q = sq and S_kv = skv.
inline bool visible_by_definition(const AttentionProblem& pr, std::int64_t sq, std::int64_t skv, std::int64_t b,
                                  std::int64_t i, std::int64_t j) {
  const std::int64_t d = i + (pr.causal_align == CausalAlign::bottom_right ? skv - sq : 0);
  if (pr.causal && j > d) return false;
  if (pr.window.left >= 0 && j < d - pr.window.left) return false;
  if (pr.window.right >= 0 && j > d + pr.window.right) return false;
  if (!pr.kv_valid.empty() && j >= pr.kv_valid[static_cast<std::size_t>(b)]) return false;
  if (!pr.documents.empty()) {
    const auto& docs = pr.documents[pr.documents.size() == 1 ? 0 : static_cast<std::size_t>(b)];
    auto doc_of = [&](std::int64_t pos) {
      std::int64_t end = 0;
      for (std::size_t n = 0; n < docs.size(); ++n)
        if (pos < (end += docs[n])) return static_cast<std::int64_t>(n);
      return std::int64_t{-1};
    };
    if (doc_of(i) != doc_of(j)) return false;
  }
  return true;
}

}  // namespace seqpar::test
