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
#include <cstring>
#include <limits>

#include "seqpar/kernel/fast_exp.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"

namespace seqpar::detail {

/// Block sizes of the backward pass.
inline constexpr std::int64_t bwd_block_q = 32, bwd_block_k = 64;

/// C[m][n] += sum_k a(k, m) * B[k][n] for an MR x NR block of C held in registers while k
/// streams: a(k, m) = a[k * ak + m * am], B row-major (ldb), C row-major (ldc). Every product
/// of the backward (S, dP, dV, dK, dQ) is this shape, with a's strides choosing the transpose.
/// An MR x (NV vectors) block of C += sum_k a(k, m) * B[k][n], held in registers while k
/// streams (GCC/Clang vector extension, one SIMD register wide: simd_bytes from
/// fast_exp.hpp). a(k, m) = a[k * ak + m * am]; B and C row-major.
template <int MR, int NV, class A>
inline void gemm_block(std::int64_t K, const A* a, std::int64_t ak, std::int64_t am, const A* b, std::int64_t ldb,
                       A* c, std::int64_t ldc) {
  typedef A Vec __attribute__((vector_size(simd_bytes)));
  constexpr int W = simd_bytes / sizeof(A);
  Vec acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) std::memcpy(&acc[m][v], c + m * ldc + v * W, sizeof(Vec));
  for (std::int64_t k = 0; k < K; ++k) {
    Vec bv[NV];
    for (int v = 0; v < NV; ++v) std::memcpy(&bv[v], b + k * ldb + v * W, sizeof(Vec));
    for (int m = 0; m < MR; ++m) {
      const Vec x = Vec{} + a[k * ak + m * am];
      for (int v = 0; v < NV; ++v) acc[m][v] += x * bv[v];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) std::memcpy(c + m * ldc + v * W, &acc[m][v], sizeof(Vec));
}

/// C (M x N) += sum_k a(k, m) B[k][n]: every product of the backward (S, dP, dV, dK, dQ) has
/// this shape, a's strides choosing the transpose. 4 x 2-vector register blocks, then the
/// edges: rows one at a time, columns past the last whole vector in plain loops.
template <class A>
void gemm_acc(std::int64_t M, std::int64_t N, std::int64_t K, const A* a, std::int64_t ak, std::int64_t am,
              const A* b, std::int64_t ldb, A* c, std::int64_t ldc) {
  constexpr std::int64_t MR = 4, W = simd_bytes / sizeof(A), NR = 2 * W;
  const std::int64_t n_blocks = N / NR * NR, n_vectors = N / W * W;
  for (std::int64_t m = 0; m < M; m += MR) {
    const bool full = m + MR <= M;
    for (std::int64_t i = m; i < (full ? m + 1 : M); ++i) {  // one pass for a full block, else per row
      const std::int64_t rows = full ? MR : 1;
      const A* ai = a + i * am;
      A* ci = c + i * ldc;
      std::int64_t n = 0;
      for (; n < n_blocks; n += NR)
        rows == MR ? gemm_block<MR, 2>(K, ai, ak, am, b + n, ldb, ci + n, ldc)
                   : gemm_block<1, 2>(K, ai, ak, am, b + n, ldb, ci + n, ldc);
      for (; n < n_vectors; n += W)
        rows == MR ? gemm_block<MR, 1>(K, ai, ak, am, b + n, ldb, ci + n, ldc)
                   : gemm_block<1, 1>(K, ai, ak, am, b + n, ldb, ci + n, ldc);
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t col = n; col < N; ++col) {
          A sum = ci[r * ldc + col];
          for (std::int64_t k = 0; k < K; ++k) sum += ai[k * ak + r * am] * b[k * ldb + col];
          ci[r * ldc + col] = sum;
        }
    }
  }
}

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
            // S = q k^T and dP = dO v^T, then P = exp(scale S - lse) and dS = P (dP - delta) scale.
            std::fill(pm, pm + BQ * BK, A(0));
            std::fill(ds, ds + BQ * BK, A(0));
            gemm_acc<A>(nq, nk, dim, qs, 1, dim, kt, BK, pm, BK);
            gemm_acc<A>(nq, nk, dim, dos, 1, dim, vt, BK, ds, BK);
            for (std::int64_t i = 0; i < nq; ++i) {
              A* __restrict prow = pm + i * BK;
              A* __restrict drow = ds + i * BK;
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
            // dV += P^T dO, dK += dS^T q (reduce over the query rows), dQ += dS k (over keys).
            gemm_acc<A>(nk, dim, nq, pm, BK, 1, dos, dim, dvs, dim);
            gemm_acc<A>(nk, dim, nq, ds, BK, 1, qs, dim, dks, dim);
            gemm_acc<A>(nq, dim, nk, ds, 1, BK, ks, dim, dq.row(b, i0, h), dq.stride[1]);
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
