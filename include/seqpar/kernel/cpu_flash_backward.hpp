#pragma once
/// \file
/// Backward of CpuFlashKernel (FlashAttention-2 style): probabilities are recomputed from the
/// saved LSE, one key block at a time, so memory stays O(block). For each key block the
/// gradients dK, dV accumulate in scratch across every query block and query head of the K/V
/// group, and are added to the caller's dk, dv once; dQ is added to the caller's rows as it
/// is formed.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "seqpar/kernel/fast_exp.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"

namespace seqpar::detail {

/// Block sizes of the backward pass.
inline constexpr std::int64_t bwd_block_q = 32, bwd_block_k = 64;

/// Elements of accumulation type the backward scratch holds for head dim `dim`.
constexpr std::size_t flash_backward_scratch_elems(std::int64_t dim) {
  return static_cast<std::size_t>(5 * bwd_block_k * dim + 2 * bwd_block_q * dim + 2 * bwd_block_q * bwd_block_k +
                                  2 * bwd_block_q);
}

/// Adds the gradients of attention over keys k (one block of the ring, or all of them) to
/// dq, dk, dv; `scratch` holds flash_backward_scratch_elems(dim) elements of A.
template <class T, class A>
void flash_backward(TensorView<const T> dout, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                    TensorView<const T> out, TensorView<const A> lse, TensorView<A> dq, TensorView<A> dk,
                    TensorView<A> dv, const KernelParams& p, A* scratch) {
  constexpr std::int64_t BQ = bwd_block_q, BK = bwd_block_k;
  const std::int64_t dim = q.dim();
  const A scale = static_cast<A>(p.scale);
  A* const ks = scratch;            // [BK][dim] keys, row-major (for dQ)
  A* const kt = ks + BK * dim;      // [dim][BK] keys, transposed (for S)
  A* const vt = kt + BK * dim;      // [dim][BK] values, transposed (for dP)
  A* const dks = vt + BK * dim;     // [BK][dim]
  A* const dvs = dks + BK * dim;    // [BK][dim]
  A* const qs = dvs + BK * dim;     // [BQ][dim]
  A* const dos = qs + BQ * dim;     // [BQ][dim]
  A* const pm = dos + BQ * dim;     // [BQ][BK] probabilities
  A* const ds = pm + BQ * BK;       // [BQ][BK] dS
  A* const lrow = ds + BQ * BK;     // [BQ]
  A* const delta = lrow + BQ;       // [BQ]

  for (std::int64_t b = 0; b < q.batch(); ++b)
    for (std::int64_t kh = 0; kh < k.heads(); ++kh)
      for (std::int64_t j0 = 0; j0 < k.seq(); j0 += BK) {
        const std::int64_t nk = std::min(BK, k.seq() - j0);
        const std::int64_t k_lo = p.causal ? p.k_positions(j0) : 0, k_hi = p.causal ? p.k_positions(j0 + nk - 1) : 0;
        for (std::int64_t j = 0; j < nk; ++j) {
          const T* kr = k.row(b, j0 + j, kh);
          const T* vr = v.row(b, j0 + j, kh);
          for (std::int64_t d = 0; d < dim; ++d) {
            ks[j * dim + d] = static_cast<A>(kr[d]);
            kt[d * BK + j] = static_cast<A>(kr[d]);
            vt[d * BK + j] = static_cast<A>(vr[d]);
          }
        }
        std::fill(dks, dks + BK * dim, A(0));
        std::fill(dvs, dvs + BK * dim, A(0));
        bool touched = false;
        for (std::int64_t h = 0; h < q.heads(); ++h) {
          if (p.kv_head(h) != kh) continue;
          for (std::int64_t i0 = 0; i0 < q.seq(); i0 += BQ) {
            const std::int64_t nq = std::min(BQ, q.seq() - i0);
            bool masked = false;
            if (p.causal) {
              const std::int64_t q_lo = p.q_positions(i0), q_hi = p.q_positions(i0 + nq - 1);
              if (p.fully_masked(q_hi, k_lo)) continue;
              masked = !p.fully_visible(q_lo, k_hi);
            }
            touched = true;
            for (std::int64_t i = 0; i < nq; ++i) {
              const T* qr = q.row(b, i0 + i, h);
              const T* dor = dout.row(b, i0 + i, h);
              const T* orow = out.row(b, i0 + i, h);
              A dl = 0;
              for (std::int64_t d = 0; d < dim; ++d) {
                qs[i * dim + d] = static_cast<A>(qr[d]);
                dos[i * dim + d] = static_cast<A>(dor[d]);
                dl += static_cast<A>(dor[d]) * static_cast<A>(orow[d]);
              }
              delta[i] = dl;
              lrow[i] = lse(b, i0 + i, h);
            }
            // P = exp(scale q k^T - lse) and dP = dO v^T, one query row at a time.
            for (std::int64_t i = 0; i < nq; ++i) {
              A* __restrict prow = pm + i * BK;
              A* __restrict drow = ds + i * BK;
              const A* __restrict qrow = qs + i * dim;
              const A* __restrict dorow = dos + i * dim;
              for (std::int64_t j = 0; j < nk; ++j) prow[j] = drow[j] = 0;
              for (std::int64_t d = 0; d < dim; ++d) {
                const A a = qrow[d], g = dorow[d];
                const A* __restrict ktd = kt + d * BK;
                const A* __restrict vtd = vt + d * BK;
                for (std::int64_t j = 0; j < nk; ++j) {
                  prow[j] += a * ktd[j];
                  drow[j] += g * vtd[j];
                }
              }
              const A l = lrow[i];
              const bool dead = l == -std::numeric_limits<A>::infinity();
              const std::int64_t qp = masked ? p.q_positions(i0 + i) : 0;
              for (std::int64_t j = 0; j < nk; ++j) {
                const bool hidden = dead || (masked && p.k_positions(j0 + j) > qp);
                const A pr = hidden ? A(0) : fast_exp(prow[j] * scale - l);
                prow[j] = pr;
                drow[j] = pr * (drow[j] - delta[i]) * scale;
              }
            }
            // dV += P^T dO, dK += dS^T q, dQ += dS k.
            for (std::int64_t i = 0; i < nq; ++i) {
              const A* __restrict prow = pm + i * BK;
              const A* __restrict drow = ds + i * BK;
              const A* __restrict qrow = qs + i * dim;
              const A* __restrict dorow = dos + i * dim;
              A* __restrict dqr = dq.row(b, i0 + i, h);
              for (std::int64_t j = 0; j < nk; ++j) {
                const A pj = prow[j], sj = drow[j];
                A* __restrict dvr = dvs + j * dim;
                A* __restrict dkr = dks + j * dim;
                const A* __restrict kr = ks + j * dim;
                for (std::int64_t d = 0; d < dim; ++d) {
                  dvr[d] += pj * dorow[d];
                  dkr[d] += sj * qrow[d];
                  dqr[d] += sj * kr[d];
                }
              }
            }
          }
        }
        if (!touched) continue;
        for (std::int64_t j = 0; j < nk; ++j) {
          A* dkr = dk.row(b, j0 + j, kh);
          A* dvr = dv.row(b, j0 + j, kh);
          for (std::int64_t d = 0; d < dim; ++d) {
            dkr[d] += dks[j * dim + d];
            dvr[d] += dvs[j * dim + d];
          }
        }
      }
}

}  // namespace seqpar::detail
