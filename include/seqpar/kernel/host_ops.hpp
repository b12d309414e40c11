#pragma once
/// \file
/// Host tensor operations the policies need between kernel calls: strided copy with type
/// conversion (all-to-all packing), filling empty rows, and the LSE merge of partial results.

#include <cmath>
#include <cstdint>
#include <limits>

#include "seqpar/core/host_device.hpp"
#include "seqpar/core/tensor_view.hpp"

namespace seqpar {

/// Merges a partial result (o2, l2) over a disjoint key set into (o1, l1), in place:
/// O = O1 - sigmoid(L2 - L1) (O1 - O2), L = max + log1p(exp(min - max)). A side with
/// L = -inf contributes nothing, so a row no block saw stays O = 0, L = -inf (never NaN).
/// Works per row so that a device kernel can share it (SEQPAR_HOST_DEVICE).
template <class A>
SEQPAR_HOST_DEVICE constexpr void merge_row(A* o1, A& l1, const A* o2, A l2, std::int64_t dim) {
  if (l2 == -std::numeric_limits<A>::infinity()) return;
  if (l1 == -std::numeric_limits<A>::infinity()) {
    for (std::int64_t d = 0; d < dim; ++d) o1[d] = o2[d];
    l1 = l2;
    return;
  }
  const A w = A(1) / (A(1) + std::exp(l1 - l2));  // sigmoid(l2 - l1)
  for (std::int64_t d = 0; d < dim; ++d) o1[d] -= w * (o1[d] - o2[d]);
  const A hi = l1 > l2 ? l1 : l2, lo = l1 > l2 ? l2 : l1;
  l1 = hi + std::log1p(std::exp(lo - hi));
}

/// Operations on tensors in host memory.
template <class Space>
struct TensorOps;

/// Host implementation (plain loops; the CUDA header specialises TensorOps<CudaSpace>).
template <>
struct TensorOps<HostSpace> {
  /// dst = src, converting the element type; extents must match.
  template <class S, class D>
  static void copy(TensorView<const S, HostSpace> src, TensorView<D, HostSpace> dst) {
    for (std::int64_t b = 0; b < src.batch(); ++b)
      for (std::int64_t s = 0; s < src.seq(); ++s)
        for (std::int64_t h = 0; h < src.heads(); ++h) {
          const S* in = src.row(b, s, h);
          D* out = dst.row(b, s, h);
          for (std::int64_t d = 0; d < src.dim(); ++d) out[d] = static_cast<D>(in[d]);
        }
  }
  /// dst += src, converting the element type; extents must match.
  template <class S, class D>
  static void accumulate(TensorView<const S, HostSpace> src, TensorView<D, HostSpace> dst) {
    for (std::int64_t b = 0; b < src.batch(); ++b)
      for (std::int64_t s = 0; s < src.seq(); ++s)
        for (std::int64_t h = 0; h < src.heads(); ++h) {
          const S* in = src.row(b, s, h);
          D* out = dst.row(b, s, h);
          for (std::int64_t d = 0; d < src.dim(); ++d) out[d] += static_cast<D>(in[d]);
        }
  }
  /// Sets every element of `dst` to `value`.
  template <class D>
  static void fill(TensorView<D, HostSpace> dst, D value) {
    for (std::int64_t b = 0; b < dst.batch(); ++b)
      for (std::int64_t s = 0; s < dst.seq(); ++s)
        for (std::int64_t h = 0; h < dst.heads(); ++h) {
          D* out = dst.row(b, s, h);
          for (std::int64_t d = 0; d < dst.dim(); ++d) out[d] = value;
        }
  }
  /// Merges (o2, l2) into (o1, l1) row by row with merge_row.
  template <class A>
  static void merge(TensorView<A, HostSpace> o1, TensorView<A, HostSpace> l1, TensorView<const A, HostSpace> o2,
                    TensorView<const A, HostSpace> l2) {
    for (std::int64_t b = 0; b < o1.batch(); ++b)
      for (std::int64_t s = 0; s < o1.seq(); ++s)
        for (std::int64_t h = 0; h < o1.heads(); ++h)
          merge_row(o1.row(b, s, h), l1(b, s, h), o2.row(b, s, h), l2(b, s, h), o1.dim());
  }
};

}  // namespace seqpar
