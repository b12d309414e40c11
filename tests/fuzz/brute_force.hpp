#pragma once
// The fuzzer's reference: which (query, key) pairs a mask leaves visible, decided pair by pair
// from the definitions in AttentionProblem with 128-bit arithmetic (no sum or difference of
// 64-bit fields can wrap), and attention forward and backward in double over the global
// tensors. It shares nothing with the library's MaskView or MaskTables: the point is that
// the two are written independently.
#include <cstdint>
#include <vector>

#include "seqpar/core/problem.hpp"

namespace seqpar::fuzz {

/// Visibility of every pair of one problem, [B, S_q, S_kv].
struct Visibility {
  std::int64_t batch = 0, sq = 0, skv = 0;
  std::vector<unsigned char> seen;  ///< 1 where key j is visible to query i of batch element b
  std::vector<std::int64_t> row_keys;  ///< [B, S_q]: visible keys per query row
  /// True when key j is visible to query i of batch element b.
  bool operator()(std::int64_t b, std::int64_t i, std::int64_t j) const {
    return seen[static_cast<std::size_t>((b * sq + i) * skv + j)] != 0;
  }
  /// Visible keys of query i of batch element b.
  std::int64_t keys(std::int64_t b, std::int64_t i) const { return row_keys[static_cast<std::size_t>(b * sq + i)]; }
  /// True when some query of batch element b sees key j.
  bool key_seen(std::int64_t b, std::int64_t j) const;
};

/// The visibility of `p` (its masks) for global lengths sq and skv, straight from the
/// definitions: d(i) = i (top-left) or i + S_kv - S_q (bottom-right); causal hides j > d;
/// a window side w >= 0 hides j < d - left or j > d + right; documents hide pairs in
/// different documents; key padding hides j >= kv_valid[b].
Visibility visibility(const AttentionProblem& p, std::int64_t sq, std::int64_t skv);

/// Global tensors in double: Q [B, S_q, H, D], K [B, S_kv, K, D], V [B, S_kv, K, D_v], dO
/// [B, S_q, H, D_v].
struct GlobalTensors {
  std::vector<double> q, k, v, dout;
};

/// The exact answer: O [B, S_q, H, D_v], LSE [B, S_q, H] (-inf for a row that sees nothing and
/// has no sink), the bounds of each output element (min and max of the visible V values: a
/// softmax is a convex combination; with a sink, a sub-convex one, so 0 is in the bounds too),
/// and with backward the gradients dQ [B, S_q, H, D], dK [B, S_kv, K, D], dV [B, S_kv, K, D_v]
/// and, with sinks, d_sinks [H] (the sum over every row).
///
/// A soft-cap c makes each scaled score s into c tanh(s / c) before the mask (its derivative
/// 1 - tanh^2 scales dS); a sink z_h joins each row's denominator: L = log(sum_j e^{s_j} + e^{z_h}),
/// O = sum_j e^{s_j - L} v_j, d z_h = -sum over rows e^{z_h - L} (dO . O). A sink of +inf is the
/// limit (O = 0, L = +inf, no gradient), -inf none at all, NaN makes its head's rows NaN.
struct ReferenceResult {
  std::vector<double> out, lse, lo, hi;
  std::vector<double> mag;  ///< per output element: sum_j p_j |v_j| (the size of the terms O sums)
  std::vector<double> dq, dk, dv;
  /// Per gradient element: the sum of its terms' sizes, each dS term taken as P (|dP| + |dO . O|)
  /// (dS = P (dP - dO . O) cancels to 0 where a row sees one key: its float error is relative
  /// to those terms, not to the difference).
  std::vector<double> dq_mag, dk_mag, dv_mag;
  std::vector<double> d_sinks, d_sinks_mag;  ///< [H] with sinks: the gradient and sum of its terms' sizes
};

/// Forward (and with `backward`, the gradients) in double of problem `p` on `x` under `vis`,
/// with one sink logit per query head in `sinks` (empty: none; p.sinks is not read).
ReferenceResult reference_attention(const AttentionProblem& p, const Visibility& vis, const GlobalTensors& x,
                                    bool backward, const std::vector<float>& sinks = {});

/// The soft-capped score: c tanh(s / c), or s when c is 0.
double softcapped(double s, double cap);

/// The normwise error max|got - want| / max(|want|, magnitude) of a set of values (absolute
/// when every wanted value and magnitude is 0); a NaN or infinity where a finite value is
/// wanted counts as infinite. An output element O = sum_j p_j v_j is a convex combination: in
/// floating point its error is bounded by a multiple of eps * sum_j p_j |v_j|, not of |O|,
/// which cancellation can make arbitrarily smaller (a long row of zero-mean V values). Its
/// magnitude is that sum, so a row whose terms cancel is held to the accuracy its terms allow.
struct NormError {
  double max_err = 0, max_ref = 0;
  /// Absolute error not counted: what the element type cannot avoid where the values are
  /// subnormal (set by the caller; 0: none).
  double floor = 0;
  bool bad = false;  ///< a non-finite value where a finite one was wanted, or a -inf mismatch
  std::int64_t worst = -1;               ///< the caller's index of the worst pair (the first bad one)
  double worst_got = 0, worst_want = 0;  ///< its values
  /// Adds one pair, `where` being the caller's index of it.
  void add(double got, double want, std::int64_t where, double magnitude = 0);
  /// The error.
  double value() const;
};

}  // namespace seqpar::fuzz
