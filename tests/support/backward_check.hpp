#pragma once
// Test support for backward: the exact global gradients (ReferenceKernel::backward in double
// over the whole sequence) and a distributed forward + backward on threads compared with them.

#include <algorithm>
#include <cmath>
#include <mutex>
#include <random>
#include <vector>

#include "support/attention_check.hpp"

namespace seqpar::test {

/// Global upstream gradient and the exact dq, dk, dv.
struct GlobalGrads {
  std::vector<double> dout, dq, dk, dv;
};

/// The exact output of attention on inputs q, k, v of case `c` (for finite differences).
inline std::vector<double> reference_out(const GlobalCase& c, const std::vector<double>& q, const std::vector<double>& k,
                                         const std::vector<double>& v) {
  std::vector<double> out(q.size());
  const KernelParams p = whole_sequence_params(c);
  using V = TensorView<const double>;
  ReferenceKernel{}.forward(V::bshd(q.data(), c.batch, c.seq_q, c.heads, c.head_dim),
                            V::bshd(k.data(), c.batch, c.kv_len(), c.kv_heads, c.head_dim),
                            V::bshd(v.data(), c.batch, c.kv_len(), c.kv_heads, c.head_dim),
                            TensorView<double>::bshd(out.data(), c.batch, c.seq_q, c.heads, c.head_dim),
                            TensorView<double>{}, p);
  return out;
}

/// A random upstream gradient (rounded to T) and the exact gradients on g's inputs.
template <class T = double>
GlobalGrads make_global_grads(const GlobalCase& c, const GlobalData& g) {
  std::mt19937_64 rng(c.seed * 7919 + 17);
  GlobalGrads gr;
  gr.dout = rounded<T>(random_tensor(static_cast<std::int64_t>(g.q.size()), rng));
  gr.dq.assign(g.q.size(), 0.0);
  gr.dk.assign(g.k.size(), 0.0);
  gr.dv.assign(g.v.size(), 0.0);
  const KernelParams p = whole_sequence_params(c);
  using V = TensorView<const double>;
  using G = TensorView<double>;
  const auto B = c.batch, Sq = c.seq_q, Sk = c.kv_len(), H = c.heads, K = c.kv_heads, D = c.head_dim;
  ReferenceKernel{}.backward(V::bshd(gr.dout.data(), B, Sq, H, D), V::bshd(g.q.data(), B, Sq, H, D),
                             V::bshd(g.k.data(), B, Sk, K, D), V::bshd(g.v.data(), B, Sk, K, D),
                             V::bshd(g.out.data(), B, Sq, H, D), V::bshd(g.lse.data(), B, Sq, H, 1),
                             G::bshd(gr.dq.data(), B, Sq, H, D), G::bshd(gr.dk.data(), B, Sk, K, D),
                             G::bshd(gr.dv.data(), B, Sk, K, D), p);
  return gr;
}

/// Normwise relative errors of dq, dk, dv (max |got - want| / max |want| over all ranks).
struct GradErrors {
  Errors dq, dk, dv;
  double worst() const { return std::max({dq.rel(), dk.rel(), dv.rel()}); }
  bool nan() const { return dq.nan || dk.nan || dv.nan; }
};

/// Compares a local [B, n, heads, D] gradient with the global one at positions `pos`.
template <class T>
Errors compare_rows(const std::vector<T>& local, const std::vector<double>& global, std::int64_t batch,
                    std::int64_t seq, std::int64_t heads, std::int64_t dim, const PositionMap& pos) {
  Errors e;
  const std::int64_t n = pos.size();
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t x = 0; x < heads * dim; ++x) {
        const double want = global[(b * seq + pos(i)) * heads * dim + x];
        const double got = static_cast<double>(local[(b * n + i) * heads * dim + x]);
        if (std::isnan(got)) e.nan = true;
        e.max_abs = std::max(e.max_abs, std::abs(got - want));
        e.max_ref = std::max(e.max_ref, std::abs(want));
      }
  return e;
}

/// Result of a distributed backward run.
struct BackwardResult {
  GradErrors err;
  std::vector<std::uint64_t> bytes_sent, expected_bytes;
};

/// Runs forward then backward of `Policy` on `ranks` threads; every rank's gradients are
/// compared with the global reference. Lengths as in run_distributed.
template <class T, class Policy, class Kernel = CpuFlashKernel>
BackwardResult run_backward(int ranks, Policy policy, const GlobalCase& c, const GlobalData& g, const GlobalGrads& gr,
                            std::vector<std::int64_t> lengths_q = {}, std::vector<std::int64_t> lengths_kv = {}) {
  const MeshConfig mesh = mesh_config(policy, ranks);
  auto by_world = [&](std::int64_t total) {
    const auto per_mesh = split_mesh(total, mesh.ring, mesh.ulysses);
    std::vector<std::int64_t> out(static_cast<std::size_t>(ranks));
    for (int w = 0; w < ranks; ++w) out[w] = per_mesh[mesh.ring_rank(w) * mesh.ulysses + mesh.ulysses_rank(w)];
    return out;
  };
  if (lengths_q.empty()) lengths_q = by_world(c.seq_q);
  if (lengths_kv.empty()) lengths_kv = by_world(c.kv_len());
  BackwardResult res;
  res.bytes_sent.resize(ranks);
  res.expected_bytes.resize(ranks);
  std::mutex mu;
  run_ranks(ranks, [&](ThreadCommunicator& comm) {
    const int w = comm.rank();
    SequenceParallelAttention<Policy, ThreadCommunicator, Kernel> attn(comm, policy);
    const Plan plan = attn.plan(problem_of<T>(c, true), {lengths_q[w], lengths_kv[w]});
    const PositionMap qp = plan.q_positions(w), kp = plan.kv_positions(w);
    const auto B = c.batch, H = c.heads, K = c.kv_heads, D = c.head_dim, lq = qp.size(), lk = kp.size();
    auto q = scatter_rows<T>(g.q, B, c.seq_q, H, D, qp);
    auto k = scatter_rows<T>(g.k, B, c.kv_len(), K, D, kp);
    auto v = scatter_rows<T>(g.v, B, c.kv_len(), K, D, kp);
    auto dout = scatter_rows<T>(gr.dout, B, c.seq_q, H, D, qp);
    std::vector<T> out(q.size()), dq(q.size(), T(777)), dk(k.size(), T(777)), dv(v.size(), T(777));
    std::vector<acc_t<T>> lse(static_cast<std::size_t>(B * lq * H));
    std::vector<std::byte> ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
    using CV = TensorView<const T>;
    using MV = TensorView<T>;
    const auto lse_view = TensorView<acc_t<T>>::lse_bhs(lse.data(), B, lq, H);
    attn.template forward<T>(plan, CV::bshd(q.data(), B, lq, H, D), CV::bshd(k.data(), B, lk, K, D),
                             CV::bshd(v.data(), B, lk, K, D), MV::bshd(out.data(), B, lq, H, D), lse_view, ws);
    comm.stats().reset();
    attn.template backward<T>(plan, CV::bshd(dout.data(), B, lq, H, D), CV::bshd(q.data(), B, lq, H, D),
                              CV::bshd(k.data(), B, lk, K, D), CV::bshd(v.data(), B, lk, K, D),
                              CV::bshd(out.data(), B, lq, H, D), lse_view, MV::bshd(dq.data(), B, lq, H, D),
                              MV::bshd(dk.data(), B, lk, K, D), MV::bshd(dv.data(), B, lk, K, D), ws);
    GradErrors e;
    e.dq = compare_rows(dq, gr.dq, B, c.seq_q, H, D, qp);
    e.dk = compare_rows(dk, gr.dk, B, c.kv_len(), K, D, kp);
    e.dv = compare_rows(dv, gr.dv, B, c.kv_len(), K, D, kp);
    std::lock_guard lock(mu);
    res.err.dq.merge(e.dq);
    res.err.dk.merge(e.dk);
    res.err.dv.merge(e.dv);
    res.bytes_sent[w] = comm.stats().bytes_sent;
    res.expected_bytes[w] = plan.backward_bytes(w);
  });
  return res;
}

}  // namespace seqpar::test
