#pragma once
/// \file
/// ReferenceKernel: naive attention accumulated in double. Slow and exact; every other path
/// is tested against it.

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "seqpar/kernel/local_attention_kernel.hpp"

namespace seqpar {
namespace detail {

/// sum over d of a[d] * b[d] in double, as four interleaved partial sums. Its error bound is no
/// worse than one running sum's (each chain is a quarter as long), and without one long chain
/// of dependent adds the compiler can vectorise it: checks of large problems against the
/// reference run several times faster.
template <class A, class B>
double dot_in_double(const A* a, const B* b, std::int64_t n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  std::int64_t d = 0;
  for (; d + 4 <= n; d += 4) {
    s0 += double(a[d]) * double(b[d]);
    s1 += double(a[d + 1]) * double(b[d + 1]);
    s2 += double(a[d + 2]) * double(b[d + 2]);
    s3 += double(a[d + 3]) * double(b[d + 3]);
  }
  for (; d < n; ++d) s0 += double(a[d]) * double(b[d]);
  return (s0 + s1) + (s2 + s3);
}

/// A scaled score `s` soft-capped by `cap` (0: unchanged): cap * tanh(s / cap).
inline double softcapped(double s, double cap) { return cap > 0 ? cap * std::tanh(s / cap) : s; }

}  // namespace detail

/// Exact local attention: scores, softmax and output in double, one query row at a time.
/// It allocates a row of scores per call; it is the yardstick, not a fast path.
struct ReferenceKernel {
  static constexpr bool is_seqpar_kernel = true;    ///< opts in to LocalAttentionKernel
  static constexpr bool supports_masks = true;      ///< windows, documents, key padding
  static constexpr bool supports_softcap = true;    ///< logit soft-capping
  static constexpr bool supports_value_dim = true;  ///< D_v != D
  using memory_space = HostSpace;                   ///< host tensors

  /// See LocalAttentionKernel. Accepts any output and LSE element types.
  template <class T, class O, class L>
  void forward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
               TensorView<L> lse, const KernelParams& p) const {
    p.check_positions(q.seq(), k.seq(), "ReferenceKernel::forward");
    const std::int64_t sk = k.seq(), dim = q.dim(), dim_v = v.dim();
    std::vector<double> score(static_cast<std::size_t>(sk));
    std::vector<double> acc(static_cast<std::size_t>(dim_v));
    for (std::int64_t b = 0; b < q.batch(); ++b)
      for (std::int64_t h = 0; h < q.heads(); ++h) {
        const std::int64_t kh = p.kv_head(h);
        for (std::int64_t i = 0; i < q.seq(); ++i) {
          double mx = -std::numeric_limits<double>::infinity();
          const KeySpan seen = p.row_span(b, i, sk);
          for (std::int64_t j = 0; j < sk; ++j) {
            if (!seen.sees(j)) {
              score[j] = -std::numeric_limits<double>::infinity();
              continue;
            }
            score[j] = detail::softcapped(detail::dot_in_double(q.row(b, i, h), k.row(b, j, kh), dim) * p.scale, p.softcap);
            // A NaN score must make the row NaN, not vanish in max (the row is not masked).
            mx = std::isnan(mx) || score[j] <= mx ? mx : score[j];
          }
          std::fill(acc.begin(), acc.end(), 0.0);
          double sum = 0;
          if (mx > -std::numeric_limits<double>::infinity() || std::isnan(mx)) {
            for (std::int64_t j = 0; j < sk; ++j) {
              if (score[j] == -std::numeric_limits<double>::infinity()) continue;
              const double w = std::exp(score[j] - mx);
              sum += w;
              const T* vr = v.row(b, j, kh);
              for (std::int64_t d = 0; d < dim_v; ++d) acc[d] += w * double(vr[d]);
            }
          }
          O* o = out.row(b, i, h);
          for (std::int64_t d = 0; d < dim_v; ++d) o[d] = static_cast<O>(sum != 0 ? acc[d] / sum : 0.0);
          if (!lse.absent())
            lse(b, i, h) = static_cast<L>(sum != 0 ? mx + std::log(sum) : -std::numeric_limits<double>::infinity());
        }
      }
  }

  /// See LocalAttentionKernel: adds this key block's gradients to dq, dk, dv. Each term is
  /// formed in double: with s the scaled (and soft-capped) score, P = exp(s - lse),
  /// dS = P (dO.v - dO.o) (times 1 - (s / softcap)^2 with a soft-cap), dQ += scale dS k,
  /// dK += scale dS q, dV += P dO.
  template <class T, class L, class G>
  void backward(TensorView<const T> dout, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                TensorView<const T> out, TensorView<const L> lse, TensorView<G> dq, TensorView<G> dk,
                TensorView<G> dv, const KernelParams& p) const {
    p.check_positions(q.seq(), k.seq(), "ReferenceKernel::backward");
    const std::int64_t dim = q.dim(), dim_v = v.dim();
    std::vector<double> dq_row(static_cast<std::size_t>(dim));
    for (std::int64_t b = 0; b < q.batch(); ++b)
      for (std::int64_t h = 0; h < q.heads(); ++h) {
        const std::int64_t kh = p.kv_head(h);
        for (std::int64_t i = 0; i < q.seq(); ++i) {
          const double l = double(lse(b, i, h));
          if (l == -std::numeric_limits<double>::infinity()) continue;
          const T* qr = q.row(b, i, h);
          const T* dor = dout.row(b, i, h);
          const T* orow = out.row(b, i, h);
          const double delta = detail::dot_in_double(dor, orow, dim_v);
          std::fill(dq_row.begin(), dq_row.end(), 0.0);
          const KeySpan seen = p.row_span(b, i, k.seq());
          for (std::int64_t j = 0; j < k.seq(); ++j) {
            if (!seen.sees(j)) continue;
            const T* kr = k.row(b, j, kh);
            const T* vr = v.row(b, j, kh);
            const double s = detail::softcapped(detail::dot_in_double(qr, kr, dim) * p.scale, p.softcap);
            const double dp = detail::dot_in_double(dor, vr, dim_v);
            const double pr = std::exp(s - l);
            const double cap = p.softcap > 0 ? 1 - (s / p.softcap) * (s / p.softcap) : 1.0;
            const double ds = pr * (dp - delta) * cap * p.scale;
            G* dkr = dk.row(b, j, kh);
            G* dvr = dv.row(b, j, kh);
            for (std::int64_t d = 0; d < dim; ++d) {
              dq_row[d] += ds * double(kr[d]);
              dkr[d] = static_cast<G>(double(dkr[d]) + ds * double(qr[d]));
            }
            for (std::int64_t d = 0; d < dim_v; ++d) dvr[d] = static_cast<G>(double(dvr[d]) + pr * double(dor[d]));
          }
          G* dqr = dq.row(b, i, h);
          for (std::int64_t d = 0; d < dim; ++d) dqr[d] = static_cast<G>(double(dqr[d]) + dq_row[d]);
        }
      }
  }
};

}  // namespace seqpar
