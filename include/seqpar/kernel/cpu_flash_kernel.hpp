#pragma once
/// \file
/// CpuFlashKernel: blocked online-softmax attention on the CPU (FlashAttention-2's loop
/// structure), for float and double, with the causal mask taken from global positions.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "seqpar/kernel/fast_exp.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"

namespace seqpar {

/// Fast local attention on the CPU. Each (batch, head, block of queries) streams over blocks
/// of keys, keeping a running max, sum and output (online softmax), so memory stays
/// O(block) and the working set stays in cache. Key blocks that a causal mask hides entirely
/// are skipped; blocks it shows entirely skip the mask. Scratch is sized by prepare() (called
/// when a plan is made), so forward allocates nothing.
class CpuFlashKernel {
 public:
  static constexpr bool is_seqpar_kernel = true;  ///< opts in to LocalAttentionKernel
  using memory_space = HostSpace;                 ///< host tensors
  static constexpr std::int64_t block_q = 64;     ///< query rows per block
  static constexpr std::int64_t block_k = 64;     ///< key rows per block

  /// Sizes the scratch for head dims up to `max_head_dim` (both float and double).
  void prepare(std::int64_t max_head_dim) {
    const std::size_t need = scratch_elems(max_head_dim) * sizeof(double);
    if (scratch_.size() < need) scratch_.resize(need);
  }

  /// See LocalAttentionKernel. `out` may be T or the accumulation type.
  template <class T, class O>
  void forward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
               TensorView<acc_t<T>> lse, const KernelParams& p) {
    using A = acc_t<T>;
    const std::int64_t dim = q.dim();
    prepare(dim);  // no-op once prepared
    Scratch<A> s(reinterpret_cast<A*>(scratch_.data()), dim);
    for (std::int64_t b = 0; b < q.batch(); ++b)
      for (std::int64_t h = 0; h < q.heads(); ++h)
        for (std::int64_t i0 = 0; i0 < q.seq(); i0 += block_q)
          query_block<T, O, A>(q, k, v, out, lse, p, b, h, i0, s);
  }

 private:
  template <class A>
  struct Scratch {
    Scratch(A* base, std::int64_t dim)
        : q(base), kt(q + block_q * dim), v(kt + block_k * dim), s(v + block_k * dim),
          o(s + block_q * block_k), m(o + block_q * dim), l(m + block_q) {}
    A *q, *kt, *v, *s, *o, *m, *l;
    std::int64_t qpos[block_q], kpos[block_k];
  };

  static std::size_t scratch_elems(std::int64_t dim) {
    return static_cast<std::size_t>(2 * block_q * dim + 2 * block_k * dim + block_q * block_k + 2 * block_q);
  }

  template <class T, class O, class A>
  static void query_block(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
                          TensorView<A> lse, const KernelParams& p, std::int64_t b, std::int64_t h,
                          std::int64_t i0, Scratch<A>& s) {
    constexpr A neg_inf = -std::numeric_limits<A>::infinity();
    const std::int64_t dim = q.dim(), nq = std::min(block_q, q.seq() - i0), kh = p.kv_head(h);
    const A scale = static_cast<A>(p.scale);
    for (std::int64_t i = 0; i < nq; ++i) {
      const T* src = q.row(b, i0 + i, h);
      A* dst = s.q + i * dim;
      for (std::int64_t d = 0; d < dim; ++d) dst[d] = static_cast<A>(src[d]) * scale;
      std::fill(s.o + i * dim, s.o + (i + 1) * dim, A(0));
      s.m[i] = neg_inf;
      s.l[i] = 0;
      if (p.causal) s.qpos[i] = p.q_positions(i0 + i);
    }
    const std::int64_t q_lo = p.causal ? s.qpos[0] : 0, q_hi = p.causal ? s.qpos[nq - 1] : 0;
    for (std::int64_t j0 = 0; j0 < k.seq(); j0 += block_k) {
      const std::int64_t nk = std::min(block_k, k.seq() - j0);
      bool masked = false;
      if (p.causal) {
        const std::int64_t k_lo = p.k_positions(j0), k_hi = p.k_positions(j0 + nk - 1);
        if (p.fully_masked(q_hi, k_lo)) break;  // positions increase: every later block is hidden too
        masked = !p.fully_visible(q_lo, k_hi);
        if (masked)
          for (std::int64_t j = 0; j < nk; ++j) s.kpos[j] = p.k_positions(j0 + j);
      }
      for (std::int64_t j = 0; j < nk; ++j) {
        const T* kr = k.row(b, j0 + j, kh);
        const T* vr = v.row(b, j0 + j, kh);
        for (std::int64_t d = 0; d < dim; ++d) s.kt[d * block_k + j] = static_cast<A>(kr[d]);
        A* vd = s.v + j * dim;
        for (std::int64_t d = 0; d < dim; ++d) vd[d] = static_cast<A>(vr[d]);
      }
      for (std::int64_t i = 0; i < nq; ++i) {
        A* __restrict srow = s.s + i * block_k;
        const A* __restrict qrow = s.q + i * dim;
        for (std::int64_t j = 0; j < nk; ++j) srow[j] = 0;
        for (std::int64_t d = 0; d < dim; ++d) {
          const A a = qrow[d];
          const A* __restrict ktd = s.kt + d * block_k;
          for (std::int64_t j = 0; j < nk; ++j) srow[j] += a * ktd[j];
        }
        if (masked)
          for (std::int64_t j = 0; j < nk; ++j)
            if (s.kpos[j] > s.qpos[i]) srow[j] = neg_inf;
        online_softmax_row(srow, nk, s.v, s.o + i * dim, s.m[i], s.l[i], dim);
      }
    }
    for (std::int64_t i = 0; i < nq; ++i) {
      O* dst = out.row(b, i0 + i, h);
      const A* acc = s.o + i * dim;
      const A l = s.l[i];
      const A inv = l != 0 ? A(1) / l : A(0);
      for (std::int64_t d = 0; d < dim; ++d) dst[d] = static_cast<O>(acc[d] * inv);
      if (!lse.absent()) lse(b, i0 + i, h) = l != 0 ? s.m[i] + std::log(l) : neg_inf;
    }
  }

  /// One row of the FlashAttention-2 update: rescale the running output by exp(m - m'), add
  /// exp(s - m') V. A row whose scores are all hidden leaves the state untouched.
  template <class A>
  static void online_softmax_row(A* __restrict srow, std::int64_t nk, const A* __restrict vblock, A* __restrict orow,
                                 A& m, A& l, std::int64_t dim) {
    A mx = m;
    for (std::int64_t j = 0; j < nk; ++j) mx = srow[j] > mx ? srow[j] : mx;
    if (mx == -std::numeric_limits<A>::infinity()) {
      // Either all hidden, or a NaN that the comparisons skipped: let the NaN through.
      bool nan = false;
      for (std::int64_t j = 0; j < nk; ++j) nan |= std::isnan(srow[j]);
      if (!nan) return;
    }
    const A alpha = detail::fast_exp(m - mx);
    A sum = 0;
    for (std::int64_t j = 0; j < nk; ++j) {
      srow[j] = detail::fast_exp(srow[j] - mx);
      sum += srow[j];
    }
    l = alpha * l + sum;
    m = mx;
    for (std::int64_t d = 0; d < dim; ++d) orow[d] *= alpha;
    for (std::int64_t j = 0; j < nk; ++j) {
      const A w = srow[j];
      const A* __restrict vr = vblock + j * dim;
      for (std::int64_t d = 0; d < dim; ++d) orow[d] += w * vr[d];
    }
  }

  std::vector<std::byte> scratch_;
};

}  // namespace seqpar
