#pragma once
// Test support: random global problems, the exact single-process answer (ReferenceKernel in
// double over the whole sequence), scattering a global tensor into a rank's slice by the
// plan's positions, and comparing a distributed run against the reference.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <random>
#include <vector>

#include "seqpar/seqpar.hpp"

namespace seqpar::test {

/// A global attention problem with its random inputs.
struct GlobalCase {
  std::int64_t batch = 1, heads = 4, kv_heads = 4, head_dim = 16, seq_q = 64, seq_kv = -1;
  bool causal = false;
  std::uint64_t seed = 1;
  std::int64_t kv_len() const { return seq_kv < 0 ? seq_q : seq_kv; }
};

/// Random values in [-1, 1] (never zeros), BSHD contiguous.
inline std::vector<double> random_tensor(std::int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> x(static_cast<std::size_t>(n));
  for (auto& e : x) e = dist(rng);
  return x;
}

/// Global inputs and the exact answer.
struct GlobalData {
  std::vector<double> q, k, v, out, lse;  // BSHD; lse [B, S, H]
};

inline GlobalData make_global(const GlobalCase& c) {
  std::mt19937_64 rng(c.seed);
  GlobalData g;
  g.q = random_tensor(c.batch * c.seq_q * c.heads * c.head_dim, rng);
  g.k = random_tensor(c.batch * c.kv_len() * c.kv_heads * c.head_dim, rng);
  g.v = random_tensor(c.batch * c.kv_len() * c.kv_heads * c.head_dim, rng);
  g.out.resize(g.q.size());
  g.lse.resize(static_cast<std::size_t>(c.batch * c.seq_q * c.heads));
  KernelParams p;
  p.scale = 1.0 / std::sqrt(double(c.head_dim));
  p.causal = c.causal;
  p.q_positions = PositionMap::run(c.seq_q, 0);
  p.k_positions = PositionMap::run(c.kv_len(), 0);
  p.group_size = c.heads / c.kv_heads;
  using V = TensorView<const double>;
  ReferenceKernel{}.forward(V::bshd(g.q.data(), c.batch, c.seq_q, c.heads, c.head_dim),
                            V::bshd(g.k.data(), c.batch, c.kv_len(), c.kv_heads, c.head_dim),
                            V::bshd(g.v.data(), c.batch, c.kv_len(), c.kv_heads, c.head_dim),
                            TensorView<double>::bshd(g.out.data(), c.batch, c.seq_q, c.heads, c.head_dim),
                            TensorView<double>::bshd(g.lse.data(), c.batch, c.seq_q, c.heads, 1), p);
  return g;
}

/// The rows of a global BSHD tensor at `pos`, converted to T.
template <class T>
std::vector<T> scatter_rows(const std::vector<double>& global, std::int64_t batch, std::int64_t seq, std::int64_t heads,
                            std::int64_t dim, const PositionMap& pos) {
  const std::int64_t n = pos.size();
  std::vector<T> local(static_cast<std::size_t>(batch * n * heads * dim));
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t x = 0; x < heads * dim; ++x)
        local[(b * n + i) * heads * dim + x] = static_cast<T>(global[(b * seq + pos(i)) * heads * dim + x]);
  return local;
}

/// Error of a run against the reference: max |got - want| / max |want| (normwise relative).
struct Errors {
  double max_abs = 0, max_ref = 0, lse_max_abs = 0, lse_max_ref = 0;
  bool nan = false;
  double rel() const { return max_ref > 0 ? max_abs / max_ref : max_abs; }
  double lse_rel() const { return lse_max_ref > 0 ? lse_max_abs / lse_max_ref : lse_max_abs; }
  void merge(const Errors& o) {
    max_abs = std::max(max_abs, o.max_abs);
    max_ref = std::max(max_ref, o.max_ref);
    lse_max_abs = std::max(lse_max_abs, o.lse_max_abs);
    lse_max_ref = std::max(lse_max_ref, o.lse_max_ref);
    nan = nan || o.nan;
  }
};

/// Result of a distributed run.
struct RunResult {
  Errors err;
  std::vector<std::uint64_t> bytes_sent, expected_bytes, host_gathers_in_forward;
  std::vector<std::int64_t> work;
};

/// Runs `Policy` with `ranks` threads on case `c`; `lengths_q`/`lengths_kv` give every world
/// rank's local lengths (empty: split as evenly as the mesh allows).
template <class T, class Policy, class Kernel = CpuFlashKernel>
RunResult run_distributed(int ranks, Policy policy, const GlobalCase& c, const GlobalData& g,
                          std::vector<std::int64_t> lengths_q = {}, std::vector<std::int64_t> lengths_kv = {},
                          bool with_lse = true) {
  const MeshConfig mesh = mesh_config(policy, ranks);
  auto by_world = [&](std::int64_t total) {
    const auto per_mesh = split_mesh(total, mesh.ring, mesh.ulysses);
    std::vector<std::int64_t> out(static_cast<std::size_t>(ranks));
    for (int w = 0; w < ranks; ++w) out[w] = per_mesh[mesh.ring_rank(w) * mesh.ulysses + mesh.ulysses_rank(w)];
    return out;
  };
  if (lengths_q.empty()) lengths_q = by_world(c.seq_q);
  if (lengths_kv.empty()) lengths_kv = by_world(c.kv_len());
  RunResult res;
  res.bytes_sent.resize(ranks);
  res.expected_bytes.resize(ranks);
  res.host_gathers_in_forward.resize(ranks);
  res.work.resize(ranks);
  std::mutex mu;
  run_ranks(ranks, [&](ThreadCommunicator& comm) {
    const int w = comm.rank();
    SequenceParallelAttention<Policy, ThreadCommunicator, Kernel> attn(comm, policy);
    AttentionProblem prob;
    prob.batch = c.batch;
    prob.heads = c.heads;
    prob.kv_heads = c.kv_heads;
    prob.head_dim = c.head_dim;
    prob.causal = c.causal;
    prob.dtype = dtype_v<T>;
    prob.with_lse = with_lse;
    const Plan plan = attn.plan(prob, {lengths_q[w], lengths_kv[w]});
    const PositionMap qp = plan.q_positions(w), kp = plan.kv_positions(w);
    auto q = scatter_rows<T>(g.q, c.batch, c.seq_q, c.heads, c.head_dim, qp);
    auto k = scatter_rows<T>(g.k, c.batch, c.kv_len(), c.kv_heads, c.head_dim, kp);
    auto v = scatter_rows<T>(g.v, c.batch, c.kv_len(), c.kv_heads, c.head_dim, kp);
    const std::int64_t lq = qp.size(), lk = kp.size();
    std::vector<T> out(q.size(), T(12345));
    std::vector<acc_t<T>> lse(static_cast<std::size_t>(c.batch * lq * c.heads), acc_t<T>(12345));
    std::vector<std::byte> ws(plan.workspace_bytes());
    using CV = TensorView<const T>;
    comm.stats().reset();
    attn.template forward<T>(plan, CV::bshd(q.data(), c.batch, lq, c.heads, c.head_dim),
                             CV::bshd(k.data(), c.batch, lk, c.kv_heads, c.head_dim),
                             CV::bshd(v.data(), c.batch, lk, c.kv_heads, c.head_dim),
                             TensorView<T>::bshd(out.data(), c.batch, lq, c.heads, c.head_dim),
                             with_lse ? TensorView<acc_t<T>>::lse_bhs(lse.data(), c.batch, lq, c.heads)
                                      : TensorView<acc_t<T>>{},
                             ws);
    Errors e;
    for (std::int64_t b = 0; b < c.batch; ++b)
      for (std::int64_t i = 0; i < lq; ++i)
        for (std::int64_t h = 0; h < c.heads; ++h) {
          for (std::int64_t d = 0; d < c.head_dim; ++d) {
            const double want = g.out[((b * c.seq_q + qp(i)) * c.heads + h) * c.head_dim + d];
            const double got = out[((b * lq + i) * c.heads + h) * c.head_dim + d];
            if (std::isnan(got)) e.nan = true;
            e.max_abs = std::max(e.max_abs, std::abs(got - want));
            e.max_ref = std::max(e.max_ref, std::abs(want));
          }
          if (with_lse) {
            const double want = g.lse[(b * c.seq_q + qp(i)) * c.heads + h];
            const double got = lse[(b * c.heads + h) * lq + i];
            if (std::isinf(want)) {
              if (got != want) e.lse_max_abs = std::numeric_limits<double>::infinity();
            } else {
              e.lse_max_abs = std::max(e.lse_max_abs, std::abs(got - want));
              e.lse_max_ref = std::max(e.lse_max_ref, std::abs(want));
            }
          }
        }
    std::lock_guard lock(mu);
    res.err.merge(e);
    res.bytes_sent[w] = comm.stats().bytes_sent;
    res.expected_bytes[w] = plan.forward_bytes(w);
    res.host_gathers_in_forward[w] = comm.stats().host_gathers;
    res.work[w] = plan.work(w);
  });
  return res;
}

}  // namespace seqpar::test
