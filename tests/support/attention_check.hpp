#pragma once
// Test support: random global problems, the exact single-process answer (ReferenceKernel in
// double over the whole sequence), scattering a global tensor into a rank's slice by the
// plan's positions, running a policy on threads and comparing it against the reference, and
// a watchdog so that a regression that hangs fails instead.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "seqpar/seqpar.hpp"

namespace seqpar::test {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SEQPAR_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define SEQPAR_TEST_SANITIZED 1
#endif
#endif
#ifdef SEQPAR_TEST_SANITIZED
/// Built with ASan or TSan (tests/sanitizers.sh): code runs 5-20x slower, so the longest cases
/// shorten their sequences there. The plain build runs them at full length.
inline constexpr bool sanitized_build = true;
#else
inline constexpr bool sanitized_build = false;
#endif

/// A global attention problem with its random inputs.
struct GlobalCase {
  std::int64_t batch = 1, heads = 4, kv_heads = 4, head_dim = 16, seq_q = 64, seq_kv = -1;
  bool causal = false;
  double scale = 0.0;  ///< 0: 1/sqrt(head_dim), as AttentionProblem
  std::uint64_t seed = 1;
  std::int64_t kv_len() const { return seq_kv < 0 ? seq_q : seq_kv; }
  double softmax_scale() const { return scale != 0.0 ? scale : 1.0 / std::sqrt(double(head_dim)); }
};

/// A self-attention case in one line.
inline GlobalCase make_case(std::int64_t seq, std::int64_t heads, std::int64_t kv_heads, std::int64_t dim, bool causal,
                            std::uint64_t seed, std::int64_t batch = 1) {
  GlobalCase c;
  c.batch = batch;
  c.seq_q = seq;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.head_dim = dim;
  c.causal = causal;
  c.seed = seed;
  return c;
}

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

/// Rounds every element to T and back: the reference of a float run must see the float inputs.
template <class T>
std::vector<double> rounded(std::vector<double> x) {
  for (auto& e : x) e = static_cast<double>(static_cast<T>(e));
  return x;
}

/// The library's problem of case `c` for element type T.
template <class T>
AttentionProblem problem_of(const GlobalCase& c, bool with_lse) {
  AttentionProblem prob;
  prob.batch = c.batch;
  prob.heads = c.heads;
  prob.kv_heads = c.kv_heads;
  prob.head_dim = c.head_dim;
  prob.causal = c.causal;
  prob.scale = c.scale;
  prob.dtype = dtype_v<T>;
  prob.with_lse = with_lse;
  return prob;
}

/// Kernel parameters of case `c` computed on one rank over the whole sequence.
inline KernelParams whole_sequence_params(const GlobalCase& c) {
  KernelParams p;
  p.scale = c.softmax_scale();
  p.causal = c.causal;
  p.q_positions = PositionMap::run(c.seq_q, 0);
  p.k_positions = PositionMap::run(c.kv_len(), 0);
  p.group_size = c.heads / c.kv_heads;
  return p;
}

/// Random inputs of case `c`, rounded to T, and the exact double answer on them.
template <class T = double>
GlobalData make_global_as(const GlobalCase& c) {
  std::mt19937_64 rng(c.seed);
  GlobalData g;
  g.q = rounded<T>(random_tensor(c.batch * c.seq_q * c.heads * c.head_dim, rng));
  g.k = rounded<T>(random_tensor(c.batch * c.kv_len() * c.kv_heads * c.head_dim, rng));
  g.v = rounded<T>(random_tensor(c.batch * c.kv_len() * c.kv_heads * c.head_dim, rng));
  g.out.resize(g.q.size());
  g.lse.resize(static_cast<std::size_t>(c.batch * c.seq_q * c.heads));
  const KernelParams p = whole_sequence_params(c);
  using V = TensorView<const double>;
  ReferenceKernel{}.forward(V::bshd(g.q.data(), c.batch, c.seq_q, c.heads, c.head_dim),
                            V::bshd(g.k.data(), c.batch, c.kv_len(), c.kv_heads, c.head_dim),
                            V::bshd(g.v.data(), c.batch, c.kv_len(), c.kv_heads, c.head_dim),
                            TensorView<double>::bshd(g.out.data(), c.batch, c.seq_q, c.heads, c.head_dim),
                            TensorView<double>::bshd(g.lse.data(), c.batch, c.seq_q, c.heads, 1), p);
  return g;
}

/// Inputs and answer in double. A float run converts the inputs when it scatters them, so
/// its reference is off by the rounding of the inputs (~1e-7); make_global_as<float> removes it.
inline GlobalData make_global(const GlobalCase& c) { return make_global_as<double>(c); }

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
/// An LSE of -inf must be matched exactly; anything else there counts as an infinite error.
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
  void add_out(double got, double want) {
    if (std::isnan(got)) nan = true;
    max_abs = std::max(max_abs, std::abs(got - want));
    max_ref = std::max(max_ref, std::abs(want));
  }
  void add_lse(double got, double want) {
    if (std::isnan(got)) nan = true;
    if (std::isinf(want)) {
      if (got != want) lse_max_abs = std::numeric_limits<double>::infinity();
    } else {
      lse_max_abs = std::max(lse_max_abs, std::abs(got - want));
      lse_max_ref = std::max(lse_max_ref, std::abs(want));
    }
  }
  /// True when output and LSE are within `tol` and nothing is NaN.
  bool within(double tol) const { return !nan && rel() <= tol && lse_rel() <= tol; }
};

/// Every CPU instruction set of the kernels (kernel/cpu_isa.hpp) that this machine runs,
/// narrowest first. The first call prints them (so the test log says which paths ran) and
/// which were left out because the CPU lacks them.
inline const std::vector<CpuIsa>& cpu_isas() {
  static const std::vector<CpuIsa> isas = [] {
    std::vector<CpuIsa> run;
    std::string ran, skipped;
    for (CpuIsa isa : {CpuIsa::vec128, CpuIsa::avx2, CpuIsa::avx512}) {
      (cpu_isa_supported(isa) ? ran : skipped) += std::string(" ") + cpu_isa_name(isa);
      if (cpu_isa_supported(isa)) run.push_back(isa);
    }
    std::printf("CPU kernel paths tested:%s%s%s\n", ran.c_str(), skipped.empty() ? "" : "; not on this CPU:",
                skipped.c_str());
    return run;
  }();
  return isas;
}

/// Tolerance of the library against the exact reference: float 1e-5, double 1e-12.
template <class T>
inline constexpr double tolerance = std::is_same_v<T, double> ? 1e-12 : 1e-5;

/// How run_policy runs.
struct RunOptions {
  /// Every world rank's local lengths; empty: split as evenly as the mesh allows.
  std::vector<std::int64_t> lengths_q, lengths_kv;
  bool with_lse = true;           ///< ask for the LSE (changes the traffic)
  bool gather = false;            ///< assemble every rank's O and LSE into RunResult::out/lse
  int forward_calls = 1;          ///< forward calls on one plan and workspace (the last is checked)
  std::chrono::milliseconds timeout{120000};  ///< ThreadRunOptions::timeout: a hang fails
};

/// Result of a distributed run. Per-rank vectors are indexed by world rank.
struct RunResult {
  Errors err;
  std::vector<std::uint64_t> bytes_sent;   ///< forward traffic (the last call)
  std::vector<std::uint64_t> messages_sent;
  std::vector<std::uint64_t> expected_bytes;  ///< plan.forward_bytes
  std::vector<std::uint64_t> host_gathers_in_forward;  ///< over every forward call
  std::vector<std::int64_t> work;  ///< plan.work
  std::vector<std::int64_t> lengths_q, lengths_kv;  ///< the lengths the ranks gave
  std::vector<Plan> plans;
  std::vector<double> out, lse;  ///< gathered global O (BSHD) and LSE ([B, S, H]) when asked
};

/// No per-rank hook.
struct NoHook {
  template <class... Args>
  void operator()(Args&&...) const {}
};

/// Every world rank's share of `total` tokens, as even as `mesh` allows (split_mesh, mapped
/// from mesh coordinates to world ranks).
inline std::vector<std::int64_t> even_lengths(const MeshConfig& mesh, std::int64_t total) {
  const auto per_mesh = split_mesh(total, mesh.ring, mesh.ulysses);
  std::vector<std::int64_t> out(static_cast<std::size_t>(mesh.world()));
  for (int w = 0; w < mesh.world(); ++w) out[w] = per_mesh[mesh.ring_rank(w) * mesh.ulysses + mesh.ulysses_rank(w)];
  return out;
}

/// Runs `Policy` with `ranks` threads on case `c` (inputs `g`, rounded to T), checks every
/// rank's output rows against the reference, and records traffic. `hook(w, attn, plan)` runs
/// on each rank after its forward calls (serialised).
template <class T, class Policy, class Kernel = CpuFlashKernel, class Hook = NoHook>
RunResult run_policy(int ranks, Policy policy, const GlobalCase& c, const GlobalData& g, RunOptions opt = {},
                     Hook hook = {}) {
  const MeshConfig mesh = mesh_config(policy, ranks);
  if (opt.lengths_q.empty()) opt.lengths_q = even_lengths(mesh, c.seq_q);
  if (opt.lengths_kv.empty()) opt.lengths_kv = even_lengths(mesh, c.kv_len());
  RunResult res;
  res.bytes_sent.resize(ranks);
  res.messages_sent.resize(ranks);
  res.expected_bytes.resize(ranks);
  res.host_gathers_in_forward.resize(ranks);
  res.work.resize(ranks);
  res.plans.resize(ranks);
  res.lengths_q = opt.lengths_q;
  res.lengths_kv = opt.lengths_kv;
  if (opt.gather) {
    res.out.assign(g.out.size(), std::numeric_limits<double>::quiet_NaN());
    res.lse.assign(g.lse.size(), std::numeric_limits<double>::quiet_NaN());
  }
  std::mutex mu;
  const std::int64_t H = c.heads, D = c.head_dim, B = c.batch;
  run_ranks(
      ranks,
      [&](ThreadCommunicator& comm) {
        const int w = comm.rank();
        SequenceParallelAttention<Policy, ThreadCommunicator, Kernel> attn(comm, policy);
        const Plan plan = attn.plan(problem_of<T>(c, opt.with_lse), {opt.lengths_q[w], opt.lengths_kv[w]});
        const PositionMap qp = plan.q_positions(w), kp = plan.kv_positions(w);
        auto q = scatter_rows<T>(g.q, B, c.seq_q, H, D, qp);
        auto k = scatter_rows<T>(g.k, B, c.kv_len(), c.kv_heads, D, kp);
        auto v = scatter_rows<T>(g.v, B, c.kv_len(), c.kv_heads, D, kp);
        const std::int64_t lq = qp.size(), lk = kp.size();
        std::vector<T> out(q.size());
        std::vector<acc_t<T>> lse(static_cast<std::size_t>(B * lq * H));
        std::vector<std::byte> ws(plan.workspace_bytes());
        using CV = TensorView<const T>;
        std::uint64_t gathers = 0;
        for (int call = 0; call < opt.forward_calls; ++call) {
          // A sentinel, so that a row the library forgets to write cannot pass.
          std::fill(out.begin(), out.end(), T(12345));
          std::fill(lse.begin(), lse.end(), acc_t<T>(12345));
          comm.stats().reset();
          attn.template forward<T>(plan, CV::bshd(q.data(), B, lq, H, D), CV::bshd(k.data(), B, lk, c.kv_heads, D),
                                   CV::bshd(v.data(), B, lk, c.kv_heads, D),
                                   TensorView<T>::bshd(out.data(), B, lq, H, D),
                                   opt.with_lse ? TensorView<acc_t<T>>::lse_bhs(lse.data(), B, lq, H)
                                                : TensorView<acc_t<T>>{},
                                   ws);
          gathers += comm.stats().host_gathers;
        }
        Errors e;
        for (std::int64_t b = 0; b < B; ++b)
          for (std::int64_t i = 0; i < lq; ++i)
            for (std::int64_t h = 0; h < H; ++h) {
              const std::int64_t row = (b * c.seq_q + qp(i)) * H + h;
              for (std::int64_t d = 0; d < D; ++d)
                e.add_out(out[((b * lq + i) * H + h) * D + d], g.out[row * D + d]);
              if (opt.with_lse) e.add_lse(lse[(b * H + h) * lq + i], g.lse[row]);
            }
        std::lock_guard lock(mu);
        if (opt.gather)
          for (std::int64_t b = 0; b < B; ++b)
            for (std::int64_t i = 0; i < lq; ++i)
              for (std::int64_t h = 0; h < H; ++h) {
                const std::int64_t row = (b * c.seq_q + qp(i)) * H + h;
                for (std::int64_t d = 0; d < D; ++d) res.out[row * D + d] = out[((b * lq + i) * H + h) * D + d];
                if (opt.with_lse) res.lse[row] = lse[(b * H + h) * lq + i];
              }
        res.err.merge(e);
        res.bytes_sent[w] = comm.stats().bytes_sent;
        res.messages_sent[w] = comm.stats().messages_sent;
        res.expected_bytes[w] = plan.forward_bytes(w);
        res.host_gathers_in_forward[w] = gathers;
        res.work[w] = plan.work(w);
        res.plans[w] = plan;
        hook(w, attn, plan);
      },
      ThreadRunOptions{opt.timeout});
  return res;
}

/// The original entry point, kept for callers that pass lengths positionally.
template <class T, class Policy, class Kernel = CpuFlashKernel>
RunResult run_distributed(int ranks, Policy policy, const GlobalCase& c, const GlobalData& g,
                          std::vector<std::int64_t> lengths_q = {}, std::vector<std::int64_t> lengths_kv = {},
                          bool with_lse = true) {
  RunOptions opt;
  opt.lengths_q = std::move(lengths_q);
  opt.lengths_kv = std::move(lengths_kv);
  opt.with_lse = with_lse;
  return run_policy<T, Policy, Kernel>(ranks, policy, c, g, opt);
}

/// How a world of ulysses * ring ranks is arranged, written out for the traffic formula
/// (independent of MeshConfig, so that the test does not trust the code it checks).
struct MeshShape {
  int ulysses = 1, ring = 1;
  bool ring_adjacent = false;  ///< MeshPlacement::ring_adjacent
  int ring_rank(int w) const { return ring_adjacent ? w % ring : w / ulysses; }
  int ulysses_rank(int w) const { return ring_adjacent ? w / ring : w % ulysses; }
};

/// Bytes every world rank sends in one forward, from first principles: the real tokens and
/// heads, nothing padded. Query heads are split over the Ulysses group with the first
/// H mod U members taking one more; a member needs the K/V heads its query heads read
/// (h / (H / K)). Ulysses (U > 1): my tokens of the other members' query heads and of the
/// K/V heads they need go out; the other members' tokens of my heads come back as O (and
/// the LSE). Ring (R > 1): R - 1 steps forward every K/V block but the one of ring rank
/// r + 1, with the K/V heads this member needs.
inline std::vector<std::uint64_t> analytic_forward_bytes(const GlobalCase& c, const MeshShape& m,
                                                         const std::vector<std::int64_t>& lengths_q,
                                                         const std::vector<std::int64_t>& lengths_kv,
                                                         std::uint64_t elem, std::uint64_t acc, bool with_lse) {
  const int U = m.ulysses, R = m.ring, P = U * R;
  const std::int64_t H = c.heads, G = c.heads / c.kv_heads;
  std::vector<std::int64_t> hq(U), kv_need(U);
  for (int v = 0, begin = 0; v < U; ++v) {
    hq[v] = H / U + (v < H % U ? 1 : 0);
    std::vector<bool> used(static_cast<std::size_t>(c.kv_heads), false);
    for (std::int64_t h = begin; h < begin + hq[v]; ++h) used[static_cast<std::size_t>(h / G)] = true;
    kv_need[v] = std::count(used.begin(), used.end(), true);
    begin += static_cast<int>(hq[v]);
  }
  std::vector<std::int64_t> block_q(R, 0), block_kv(R, 0);
  std::int64_t total_kv = 0;
  for (int w = 0; w < P; ++w) {
    block_q[m.ring_rank(w)] += lengths_q[w];
    block_kv[m.ring_rank(w)] += lengths_kv[w];
    total_kv += lengths_kv[w];
  }
  const auto B = static_cast<std::uint64_t>(c.batch), D = static_cast<std::uint64_t>(c.head_dim);
  std::vector<std::uint64_t> out(static_cast<std::size_t>(P), 0);
  for (int w = 0; w < P; ++w) {
    const int r = m.ring_rank(w), u = m.ulysses_rank(w);
    std::uint64_t bytes = 0;
    if (U > 1) {
      std::int64_t kv_others = 0;
      for (int v = 0; v < U; ++v) kv_others += v == u ? 0 : kv_need[v];
      const auto others_q = static_cast<std::uint64_t>(block_q[r] - lengths_q[w]);  // O and LSE back
      bytes += static_cast<std::uint64_t>(lengths_q[w] * (H - hq[u])) * B * D * elem;
      bytes += 2 * static_cast<std::uint64_t>(lengths_kv[w] * kv_others) * B * D * elem;
      bytes += others_q * static_cast<std::uint64_t>(hq[u]) * B * D * elem;
      if (with_lse) bytes += others_q * static_cast<std::uint64_t>(hq[u]) * B * acc;
    }
    if (R > 1)
      bytes += 2 * static_cast<std::uint64_t>((total_kv - block_kv[(r + 1) % R]) * kv_need[u]) * B * D * elem;
    out[w] = bytes;
  }
  return out;
}

/// The MeshShape of a policy's resolved mesh.
inline MeshShape mesh_shape(const MeshConfig& m) {
  return {m.ulysses, m.ring, m.placement == MeshPlacement::ring_adjacent};
}

/// Runs `fn` on its own thread and waits at most `limit`. If it has not returned by then the
/// process exits with a message (the blocked threads cannot be unwound safely): a hang
/// becomes a failure. Otherwise rethrows what `fn` threw.
template <class Fn>
void within(std::chrono::milliseconds limit, Fn&& fn, const char* what = "a test step") {
  std::promise<void> done;
  auto fut = done.get_future();
  std::thread t([&] {
    try {
      fn();
      done.set_value();
    } catch (...) {
      done.set_exception(std::current_exception());
    }
  });
  if (fut.wait_for(limit) != std::future_status::ready) {
    std::fprintf(stderr, "FATAL: %s did not finish within %lld ms (a hang)\n", what,
                 static_cast<long long>(limit.count()));
    std::fflush(stderr);
    std::_Exit(3);
  }
  t.join();
  fut.get();
}

}  // namespace seqpar::test
