#pragma once
/// \file
/// The merge state: combining partial attention results over disjoint key sets by their LSE.
///
/// A partial result (O_i, L_i) is attention over one key set: O_i = softmax-weighted values,
/// L_i = log sum exp of the visible scores (natural log). Over the union of two disjoint key
/// sets the exact result is
///   O = O1 - sigmoid(L2 - L1) (O1 - O2),   L = max(L1, L2) + log1p(exp(-|L1 - L2|)),
/// computed in the accumulation type whatever the element type. A side with L = -inf saw no
/// key and contributes nothing, so a row no block saw stays O = 0, L = -inf, never NaN.
/// The ring merges every step's partial into its running output with this rule, and decode
/// merges the ranks' partials the same way. Host loops (TensorOps<HostSpace>::merge) and the
/// device kernel (TensorOps<CudaSpace>::merge) both call merge_row, so they agree bit for bit
/// on the formula.

#include <cmath>
#include <cstdint>
#include <limits>

#include "seqpar/core/host_device.hpp"

namespace seqpar {

/// Merges one row's partial (o2, l2) into (o1, l1) in place. `o2` may be of the element type
/// P (a kernel that writes only T) or of A; it is converted to A first. `dim` = 0 updates
/// only the LSE.
template <class A, class P = A>
SEQPAR_HOST_DEVICE constexpr void merge_row(A* o1, A& l1, const P* o2, A l2, std::int64_t dim) {
  if (l2 == -std::numeric_limits<A>::infinity()) return;
  if (l1 == -std::numeric_limits<A>::infinity()) {
    for (std::int64_t d = 0; d < dim; ++d) o1[d] = static_cast<A>(o2[d]);
    l1 = l2;
    return;
  }
  const A w = A(1) / (A(1) + std::exp(l1 - l2));  // sigmoid(l2 - l1)
  for (std::int64_t d = 0; d < dim; ++d) o1[d] -= w * (o1[d] - static_cast<A>(o2[d]));
  const A hi = l1 > l2 ? l1 : l2, lo = l1 > l2 ? l2 : l1;
  l1 = hi + std::log1p(std::exp(lo - hi));
}

/// Joins an attention sink to one row's merged result: the sink is one more term of the
/// softmax's denominator, exp(sink), with no value, so L' = log(exp(L) + exp(sink)) and
/// O' = O exp(L - L'). It runs once per row, after every partial over the keys has been merged
/// (joined to each partial, a ring of R steps would count it R times). A row that saw no key
/// (L = -inf) keeps O = 0 and gets L' = sink; a NaN row stays NaN. `o` may be of the element
/// type O; the arithmetic is in A.
template <class A, class O>
SEQPAR_HOST_DEVICE constexpr void join_sink(O* o, A& l, A sink, std::int64_t dim) {
  const A hi = l > sink ? l : sink, lo = l > sink ? sink : l;
  if (hi == -std::numeric_limits<A>::infinity()) return;  // no key and a -inf sink: nothing to join, O = 0 stays
  const A joined = l != l ? l : hi + std::log1p(std::exp(lo - hi));
  const A factor = std::exp(l - joined);  // exp(-inf) = 0 for a row that saw no key
  for (std::int64_t d = 0; d < dim; ++d) o[d] = static_cast<O>(static_cast<A>(o[d]) * factor);
  l = joined;
}

/// One row's share of a sink's gradient: d sink = -exp(sink - L) (dO . O), with L the row's
/// final LSE (sink included) and dO . O over its D_v elements, in A.
template <class A, class T>
SEQPAR_HOST_DEVICE constexpr A sink_grad_row(const T* dout, const T* out, A l, A sink, std::int64_t dim) {
  A dot = 0;
  for (std::int64_t d = 0; d < dim; ++d) dot += static_cast<A>(dout[d]) * static_cast<A>(out[d]);
  return l == -std::numeric_limits<A>::infinity() ? A(0) : -std::exp(sink - l) * dot;
}

}  // namespace seqpar
