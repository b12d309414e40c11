#pragma once
/// \file
/// Host tensor operations the policies need between kernel calls: strided copy with type
/// conversion (all-to-all packing), filling empty rows, the LSE merge of partial results and
/// the attention sinks (the rules themselves are merge_row, join_sink and sink_grad_row,
/// kernel/merge_state.hpp).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "seqpar/core/tensor_view.hpp"
#include "seqpar/kernel/merge_state.hpp"

namespace seqpar {

/// Operations on tensors in host memory.
template <class Space>
struct TensorOps;

/// Host implementation (plain loops; the CUDA header specialises TensorOps<CudaSpace>).
template <>
struct TensorOps<HostSpace> {
  /// dst = src, converting the element type; extents must match.
  ///
  /// Runs of one type are memcpy, a token's heads one run where both views keep them side by
  /// side: the all-to-alls' packing then moves at memory speed at any optimisation level (an
  /// element loop needs -O3's vectoriser: at GCC 12 -O2 it packed at half the speed).
  template <class S, class D>
  static void copy(TensorView<const S, HostSpace> src, TensorView<D, HostSpace> dst) {
    const std::int64_t dim = src.dim();
    if (src.batch() == 0 || src.seq() == 0 || src.heads() == 0 || dim == 0) return;
    const bool heads_in_one_run = src.heads() == 1 || (src.stride[2] == dim && dst.stride[2] == dim);
    const std::int64_t runs = heads_in_one_run ? 1 : src.heads();
    const std::int64_t run = heads_in_one_run ? src.heads() * dim : dim;
    for (std::int64_t b = 0; b < src.batch(); ++b)
      for (std::int64_t s = 0; s < src.seq(); ++s)
        for (std::int64_t h = 0; h < runs; ++h) {
          const S* in = src.row(b, s, h);
          D* out = dst.row(b, s, h);
          if constexpr (std::is_same_v<S, D>) {
            if (static_cast<const void*>(in) != static_cast<const void*>(out))
              std::memcpy(out, in, static_cast<std::size_t>(run) * sizeof(D));
          } else {
            for (std::int64_t d = 0; d < run; ++d) out[d] = static_cast<D>(in[d]);
          }
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
  /// Merges (o2, l2) into (o1, l1) row by row with merge_row; o2 may be of the element type.
  template <class A, class P>
  static void merge(TensorView<A, HostSpace> o1, TensorView<A, HostSpace> l1, TensorView<const P, HostSpace> o2,
                    TensorView<const A, HostSpace> l2) {
    for (std::int64_t b = 0; b < o1.batch(); ++b)
      for (std::int64_t s = 0; s < o1.seq(); ++s)
        for (std::int64_t h = 0; h < o1.heads(); ++h)
          merge_row(o1.row(b, s, h), l1(b, s, h), o2.row(b, s, h), l2(b, s, h), o1.dim());
  }
  /// Joins head h's sink, sinks[h] (h counted from the view's first head), to every row of
  /// (o, l) with join_sink. `sinks` is in host memory.
  template <class O, class A>
  static void join_sinks(TensorView<O, HostSpace> o, TensorView<A, HostSpace> l, const float* sinks) {
    for (std::int64_t b = 0; b < o.batch(); ++b)
      for (std::int64_t s = 0; s < o.seq(); ++s)
        for (std::int64_t h = 0; h < o.heads(); ++h) join_sink(o.row(b, s, h), l(b, s, h), static_cast<A>(sinks[h]), o.dim());
  }
  /// d_sinks[h] = the sum over every row of head h of sink_grad_row (overwrites; h counted
  /// from the views' first head). Host memory.
  template <class T, class A>
  static void sink_grads(TensorView<const T, HostSpace> dout, TensorView<const T, HostSpace> out,
                         TensorView<const A, HostSpace> l, const float* sinks, float* d_sinks) {
    for (std::int64_t h = 0; h < out.heads(); ++h) {
      A sum = 0;
      for (std::int64_t b = 0; b < out.batch(); ++b)
        for (std::int64_t s = 0; s < out.seq(); ++s)
          sum += sink_grad_row(dout.row(b, s, h), out.row(b, s, h), l(b, s, h), static_cast<A>(sinks[h]), out.dim());
      d_sinks[h] = static_cast<float>(sum);
    }
  }
};

}  // namespace seqpar
