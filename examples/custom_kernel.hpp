#pragma once
// A user's own local attention kernel, plugged into seqpar through the LocalAttentionKernel
// concept (include/seqpar/kernel/local_attention_kernel.hpp). It is deliberately plain (one
// query row at a time, double accumulation) so that every rule of the contract is visible;
// examples/custom_kernel.cpp runs it under every policy, and tests/test_composition.cpp checks
// it against the exact reference with float and with a 2-byte type.
//
// Wrapping an engine's existing kernel (FlashAttention, cuDNN, FlashInfer) is the same shape:
//  - `memory_space` = seqpar::CudaSpace, and forward/backward launch on the engine's stream;
//  - TensorView gives a data pointer, extents [B, S, H, D] and element strides with head_dim
//    contiguous: pass stride[0], stride[1], stride[2] as the batch, sequence and head strides
//    (FlashAttention's q_batch_stride, q_row_stride, q_head_stride). seqpar passes packed
//    [S, B, H, D] blocks, so do not assume BSHD-contiguous input;
//  - the mask comes as global positions (params.q_positions, params.k_positions), not as
//    "causal over this block": a ring step's keys may all be before, all after, or straddle the
//    queries. With contiguous positions, FlashAttention's bottom-right causal is right only when
//    the last query and the last key share a position; otherwise pass a window or a mask
//    built from the positions (or compute the offset: key j is visible iff k_pos(j) <= q_pos(i));
//  - the LSE convention must match: natural log, float32 (double for double), per query row,
//    laid out [B, S, H] (seqpar's lse view is [B, S, H, 1]). FlashAttention returns
//    softmax_lse as [B, H, S] in natural log: transpose it, or give seqpar a strided view.
//    cuDNN's "stats" output is log-sum-exp too, but check whether it includes the max term;
//  - a row that sees no key must give O = 0 and LSE = -inf (FlashAttention gives +inf or NaN
//    for such rows in some versions: fix them up after the call), and a NaN in a hidden key
//    must not reach any row;
//  - backward ADDS into float (or double) dq, dk, dv: a kernel that overwrites its gradients
//    needs scratch and an add, since ring steps and GQA heads accumulate into the same buffer.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "seqpar/core/tensor_view.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"

namespace examples {

/// Attention one query row at a time in double. Writes its output only as T: under ring
/// policies seqpar converts the partial outputs to the accumulation type itself.
struct PlainKernel {
  static constexpr bool is_seqpar_kernel = true;  // the explicit opt-in
  static constexpr bool supports_masks = true;    // handles windows, documents, key padding
  using memory_space = seqpar::HostSpace;         // where its tensors live

  /// out = softmax(q k^T * scale + mask) v and lse = log-sum-exp of the visible scores.
  template <class T>
  void forward(seqpar::TensorView<const T> q, seqpar::TensorView<const T> k, seqpar::TensorView<const T> v,
               seqpar::TensorView<T> out, seqpar::TensorView<seqpar::acc_t<T>> lse,
               const seqpar::KernelParams& p) const {
    const std::int64_t dim = q.dim();
    std::vector<double> acc(static_cast<std::size_t>(dim));
    for (std::int64_t b = 0; b < q.batch(); ++b)
      for (std::int64_t h = 0; h < q.heads(); ++h)
        for (std::int64_t i = 0; i < q.seq(); ++i) {
          const std::int64_t kh = p.kv_head(h);  // GQA: the K/V head this query head reads
          const seqpar::KeyRange seen = p.keys(b, p.q_positions(i));  // visible keys: one range
          double mx = -std::numeric_limits<double>::infinity(), sum = 0;
          std::fill(acc.begin(), acc.end(), 0.0);
          // Online softmax over the visible keys only: a hidden key (its value may be NaN or
          // garbage: padding, a stale cache slot) is never read.
          for (std::int64_t j = 0; j < k.seq(); ++j) {
            if (!in(seen, p.k_positions(j))) continue;
            const double s = dot(q.row(b, i, h), k.row(b, j, kh), dim) * p.scale;
            const double m = std::max(mx, s), c = std::exp(mx - m), w = std::exp(s - m);
            const T* vj = v.row(b, j, kh);
            for (std::int64_t d = 0; d < dim; ++d) acc[d] = acc[d] * c + w * static_cast<double>(vj[d]);
            sum = sum * c + w;
            mx = s != s ? s : m;  // a NaN score makes the row NaN (it is not masked)
          }
          T* o = out.row(b, i, h);
          const bool none = sum == 0;  // no visible key: O = 0, LSE = -inf
          for (std::int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(none ? 0.0 : acc[d] / sum);
          if (!lse.absent())
            lse(b, i, h) = static_cast<seqpar::acc_t<T>>(none ? -std::numeric_limits<double>::infinity()
                                                              : mx + std::log(sum));
        }
  }

  /// Adds this key block's share of dq, dk, dv, recomputing P = exp(s - lse) from the LSE of
  /// the whole attention (not of this block).
  template <class T>
  void backward(seqpar::TensorView<const T> dout, seqpar::TensorView<const T> q, seqpar::TensorView<const T> k,
                seqpar::TensorView<const T> v, seqpar::TensorView<const T> out,
                seqpar::TensorView<const seqpar::acc_t<T>> lse, seqpar::TensorView<seqpar::acc_t<T>> dq,
                seqpar::TensorView<seqpar::acc_t<T>> dk, seqpar::TensorView<seqpar::acc_t<T>> dv,
                const seqpar::KernelParams& p) const {
    using A = seqpar::acc_t<T>;
    const std::int64_t dim = q.dim();
    for (std::int64_t b = 0; b < q.batch(); ++b)
      for (std::int64_t h = 0; h < q.heads(); ++h)
        for (std::int64_t i = 0; i < q.seq(); ++i) {
          const double l = lse(b, i, h);
          if (l == -std::numeric_limits<double>::infinity()) continue;  // the row saw no key
          const std::int64_t kh = p.kv_head(h);
          const seqpar::KeyRange seen = p.keys(b, p.q_positions(i));
          const double delta = dot(dout.row(b, i, h), out.row(b, i, h), dim);  // rowsum(dO * O)
          for (std::int64_t j = 0; j < k.seq(); ++j) {
            if (!in(seen, p.k_positions(j))) continue;
            const double pij = std::exp(dot(q.row(b, i, h), k.row(b, j, kh), dim) * p.scale - l);
            const double ds = pij * (dot(dout.row(b, i, h), v.row(b, j, kh), dim) - delta) * p.scale;
            for (std::int64_t d = 0; d < dim; ++d) {
              dv.row(b, j, kh)[d] += static_cast<A>(pij * static_cast<double>(dout.row(b, i, h)[d]));
              dq.row(b, i, h)[d] += static_cast<A>(ds * static_cast<double>(k.row(b, j, kh)[d]));
              dk.row(b, j, kh)[d] += static_cast<A>(ds * static_cast<double>(q.row(b, i, h)[d]));
            }
          }
        }
  }

 private:
  /// True when key position `k` is inside a row's visible range (every mask family leaves
  /// one contiguous range; causal, windows, documents and padding all come through it).
  static bool in(seqpar::KeyRange r, std::int64_t k) { return r.lo <= k && k <= r.hi; }
  template <class X, class Y>
  static double dot(const X* x, const Y* y, std::int64_t n) {
    double s = 0;
    for (std::int64_t d = 0; d < n; ++d) s += static_cast<double>(x[d]) * static_cast<double>(y[d]);
    return s;
  }
};

}  // namespace examples
