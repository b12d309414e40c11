#pragma once
// Test support for backward: the exact gradients of every row (by brute force from the mask's
// definitions, as attention_check.hpp's answer), a rank's gradients against them, and a
// distributed forward + backward on threads.

#include <algorithm>
#include <mutex>
#include <vector>

#include "support/attention_check.hpp"

namespace seqpar::test {

using examples::ReferenceGrads;

/// The exact dQ, dK, dV (and with sinks d sinks) of problem `x` for upstream gradient `dout`
/// by brute force: the visible pairs from the mask's definitions (DefinitionMask), the
/// forward's O and LSE (sinks included) from brute_force_forward, every term in double: with s
/// the scaled (soft-capped) score, P = exp(s - lse), dS = P (dO.v - dO.o) (times
/// 1 - (s / cap)^2 with a cap), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO, and
/// d sink_h = -sum over rows of exp(sink_h - lse) (dO.o).
inline ReferenceGrads brute_force_grads(const BruteProblem& x, const std::vector<double>& dout) {
  const AttentionProblem& pr = x.pr;
  const std::int64_t B = pr.batch, H = pr.heads, K = pr.kv_head_count(), D = pr.head_dim, Dv = pr.value_dim();
  const double scale = pr.softmax_scale();
  const GlobalOutput fwd = brute_force_forward(x);
  const DefinitionMask mask(pr, x.sq, x.skv);
  ReferenceGrads g{std::vector<double>(x.q.size(), 0.0), std::vector<double>(x.k.size(), 0.0),
                   std::vector<double>(x.v.size(), 0.0)};
  if (pr.sinks) g.dsinks.assign(static_cast<std::size_t>(H), 0.0);
  auto mut_row = [](std::vector<double>& t, std::int64_t seq, std::int64_t heads, std::int64_t dim, std::int64_t b,
                    std::int64_t s, std::int64_t h) { return t.data() + ((b * seq + s) * heads + h) * dim; };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < x.sq; ++i)
      for (std::int64_t h = 0; h < H; ++h) {
        const double lse = fwd.lse[static_cast<std::size_t>((b * x.sq + i) * H + h)];
        if (lse == -std::numeric_limits<double>::infinity()) continue;  // sees no key: no gradient
        const std::int64_t kh = h / (H / K);
        const double *q = BruteProblem::row(x.q, x.sq, H, D, b, i, h), *d_o = BruteProblem::row(dout, x.sq, H, Dv, b, i, h);
        const double delta = detail::dot_in_double(d_o, BruteProblem::row(fwd.out, x.sq, H, Dv, b, i, h), Dv);
        if (pr.sinks) g.dsinks[static_cast<std::size_t>(h)] -= std::exp(double(pr.sinks[h]) - lse) * delta;
        double* dq = mut_row(g.dq, x.sq, H, D, b, i, h);
        for (std::int64_t j = 0; j < x.skv; ++j) {
          if (!mask.visible(b, i, j)) continue;
          const double *k = BruteProblem::row(x.k, x.skv, K, D, b, j, kh), *v = BruteProblem::row(x.v, x.skv, K, Dv, b, j, kh);
          const double s = brute_score(pr, q, k), p = std::exp(s - lse);
          const double cap = pr.softcap > 0 ? 1 - (s / pr.softcap) * (s / pr.softcap) : 1.0;
          const double ds = p * (detail::dot_in_double(d_o, v, Dv) - delta) * cap * scale;
          double *dk = mut_row(g.dk, x.skv, K, D, b, j, kh), *dv = mut_row(g.dv, x.skv, K, Dv, b, j, kh);
          for (std::int64_t e = 0; e < D; ++e) {
            dq[e] += ds * k[e];
            dk[e] += ds * q[e];
          }
          for (std::int64_t e = 0; e < Dv; ++e) dv[e] += p * d_o[e];
        }
      }
  return g;
}

/// The exact dq, dk and dv of every row for g's inputs and upstream gradient g.dout.
inline ReferenceGrads make_global_grads(const GlobalInputs& g) {
  const AttentionProblem pr = g.shape.problem<double>();
  return brute_force_grads({pr, g.shape.seq_q, g.shape.kv_len(), g.q, g.k, g.v}, g.dout);
}

/// Normwise relative errors of dq, dk, dv (max |got - want| / max |want| over all ranks).
struct GradErrors {
  ErrorStats dq, dk, dv;
  double worst() const { return std::max({dq.rel(), dk.rel(), dv.rel()}); }
  bool nan() const { return dq.nan || dk.nan || dv.nan; }
  void merge(const GradErrors& o) {
    dq.merge(o.dq);
    dk.merge(o.dk);
    dv.merge(o.dv);
  }
};

/// One rank's gradients, dq at query positions `qpos` ([B, Lq, H, D]) and dk, dv at K/V
/// positions `kvpos` ([B, Lkv, K, D] and [B, Lkv, K, D_v]), against the exact ones of every row.
template <class G>
GradErrors compare_grads(const std::vector<G>& dq, const std::vector<G>& dk, const std::vector<G>& dv,
                         const ReferenceGrads& want, const GlobalShape& s, const PositionMap& qpos,
                         const PositionMap& kvpos) {
  const std::int64_t B = s.batch, H = s.heads, K = s.kv_head_count(), D = s.head_dim;
  return {compare(dq, take_rows<double>(want.dq, B, s.seq_q, H, D, qpos)),
          compare(dk, take_rows<double>(want.dk, B, s.kv_len(), K, D, kvpos)),
          compare(dv, take_rows<double>(want.dv, B, s.kv_len(), K, s.value_dim(), kvpos))};
}

/// Result of a distributed backward run; traffic per world rank.
struct BackwardResult {
  GradErrors err;
  std::vector<std::uint64_t> bytes_sent, expected_bytes;
  ErrorStats dsinks;  ///< with sinks: the sum of every rank's d_sinks against the exact one
};

/// Runs forward then backward of `Policy` on `ranks` threads with g's inputs and g.dout (as
/// T); every rank's gradients are compared with `want`. Lengths from opt, as in run_policy.
/// With sinks, backward also gives d_sinks, summed over the ranks as a user would (an
/// all-reduce) and compared with want.dsinks.
template <class T, class Policy, class Kernel = CpuFlashKernel>
BackwardResult run_backward(int ranks, Policy policy, const GlobalInputs& g, const ReferenceGrads& want,
                            RunOptions opt = {}) {
  const GlobalShape& s = g.shape;
  opt = with_lengths(std::move(opt), policy, ranks, s);
  BackwardResult res;
  res.bytes_sent.resize(ranks);
  res.expected_bytes.resize(ranks);
  std::mutex mu;
  std::vector<double> dsinks(s.sinks.size(), 0.0);
  run_ranks(ranks, [&](ThreadCommunicator& comm) {
    const int w = comm.rank();
    SequenceParallelAttention<Policy, ThreadCommunicator, Kernel> attn(comm, policy);
    const Plan plan = attn.plan(s.problem<T>(true), {opt.lengths_q[w], opt.lengths_kv[w]});
    const PositionMap qp = plan.q_positions(w), kp = plan.kv_positions(w);
    const auto B = s.batch, H = s.heads, K = s.kv_head_count(), D = s.head_dim, Dv = s.value_dim(), lq = qp.size(),
               lk = kp.size();
    LocalSlices<T> x = local_slices<T>(g, qp, kp);
    const auto dout = take_rows<T>(g.dout, B, s.seq_q, H, Dv, qp);
    std::vector<T> dq(x.q.size(), T(777)), dk(x.k.size(), T(777)), dv(x.v.size(), T(777));
    std::vector<acc_t<T>> lse(static_cast<std::size_t>(B * lq * H));
    std::vector<std::byte> ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
    using CV = TensorView<const T>;
    using MV = TensorView<T>;
    const auto lse_view = TensorView<acc_t<T>>::lse_bhs(lse.data(), B, lq, H);
    const auto q = CV::bshd(x.q.data(), B, lq, H, D), k = CV::bshd(x.k.data(), B, lk, K, D),
               v = CV::bshd(x.v.data(), B, lk, K, Dv);
    attn.template forward<T>(plan, q, k, v, MV::bshd(x.out.data(), B, lq, H, Dv), lse_view, ws);
    comm.stats().reset();
    std::vector<float> my_dsinks(s.sinks.size(), 12345.0f);  // a sentinel: backward must overwrite it
    if (s.sinks.empty())
      attn.template backward<T>(plan, CV::bshd(dout.data(), B, lq, H, Dv), q, k, v, CV::bshd(x.out.data(), B, lq, H, Dv),
                                lse_view, MV::bshd(dq.data(), B, lq, H, D), MV::bshd(dk.data(), B, lk, K, D),
                                MV::bshd(dv.data(), B, lk, K, Dv), ws);
    else
      attn.template backward<T>(plan, CV::bshd(dout.data(), B, lq, H, Dv), q, k, v, CV::bshd(x.out.data(), B, lq, H, Dv),
                                lse_view, MV::bshd(dq.data(), B, lq, H, D), MV::bshd(dk.data(), B, lk, K, D),
                                MV::bshd(dv.data(), B, lk, K, Dv), my_dsinks.data(), ws);
    const GradErrors e = compare_grads(dq, dk, dv, want, s, qp, kp);
    std::lock_guard lock(mu);
    for (std::size_t h = 0; h < dsinks.size(); ++h) dsinks[h] += my_dsinks[h];
    res.err.merge(e);
    res.bytes_sent[w] = comm.stats().bytes_sent;
    res.expected_bytes[w] = plan.backward_bytes(w);
  });
  if (!dsinks.empty()) res.dsinks = compare(dsinks, want.dsinks);
  return res;
}

}  // namespace seqpar::test
