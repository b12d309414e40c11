/// \file
/// Every policy at P = 1, 2, 4 ranks on ThreadCommunicator (ranks are threads of this process,
/// so P = 4 shares the machine's cores), and AnythingPolicy against the plain policy on shapes
/// that divide evenly. Counters: time per forward, bytes sent per rank, their ratio to the
/// analytic minimum (the USP paper's formula), and the causal load imbalance max/mean of plan.work(w).

#include <benchmark/benchmark.h>

#include <memory>
#include <span>
#include <string>
#include <tuple>

#include "bench_common.hpp"

namespace {

using namespace seqpar;
using seqpar::bench::RankTeam;

/// The global problem of the policy benchmarks.
AttentionProblem bench_problem(bool causal) {
  AttentionProblem pr;
  pr.batch = 1;
  pr.heads = 8;
  pr.kv_heads = 8;
  pr.head_dim = 64;
  pr.causal = causal;
  pr.dtype = DType::f32;
  pr.with_lse = false;
  return pr;
}
constexpr std::int64_t global_seq = 4096;
/// Shorter for Anything vs plain, so that a few seconds hold enough calls for a 1% comparison.
constexpr std::int64_t pair_seq = 2048;

/// The policy of each family for P ranks. Unified runs a 2 x 2 mesh at P = 4 (1 x P below).
template <class Pol>
Pol make_policy(int ranks) {
  if constexpr (requires { Pol{}.ring_degree; })
    return Pol{.ulysses_degree = ranks >= 4 ? 2 : 1, .ring_degree = 0};
  else if constexpr (requires { Pol{}.inner; })
    return Pol{make_policy<std::remove_cvref_t<decltype(Pol{}.inner)>>(ranks)};
  else
    return Pol{};
}

/// One rank's tensors and workspace. Engines compared with each other share one set, so that
/// no difference of memory placement can show up as a difference between them.
struct RankBuffers {
  std::int64_t len = 0;
  std::vector<float> q, k, v, out;
  std::vector<std::byte> workspace;

  RankBuffers(int rank, std::int64_t local_len, const AttentionProblem& pr)
      : len(local_len),
        q(bench::random_values<float>(std::size_t(pr.batch * len * pr.heads * pr.head_dim), 11 + rank)),
        k(bench::random_values<float>(std::size_t(pr.batch * len * pr.kv_head_count() * pr.head_dim), 23 + rank)),
        v(bench::random_values<float>(k.size(), 37 + rank)), out(q.size()) {}
};

/// A policy's engine with attention sinks (one logit per query head) in its problem.
template <class Pol>
struct WithSinks {};

/// The policy of an engine list entry, and whether its problem has sinks.
template <class P>
struct EngineKind {
  using policy = P;
  static constexpr bool sinks = false;
};
template <class P>
struct EngineKind<WithSinks<P>> {
  using policy = P;
  static constexpr bool sinks = true;
};

/// One rank's engine and plan for `Entry` (a policy, or WithSinks<policy>).
template <class Entry>
struct RankEngine {
  using Pol = typename EngineKind<Entry>::policy;
  std::vector<float> sinks;  // moves keep its buffer, so the plan's pointer stays valid
  SequenceParallelAttention<Pol, ThreadCommunicator, CpuFlashKernel> attn;
  Plan plan;

  RankEngine(ThreadCommunicator& comm, int ranks, AttentionProblem pr, std::int64_t seq)
      : attn(comm, make_policy<Pol>(ranks)) {
    if constexpr (EngineKind<Entry>::sinks) {
      sinks = bench::random_values<float>(std::size_t(pr.heads), 53);
      pr.sinks = sinks.data();
    }
    plan = attn.plan(pr, {split_sequence(seq, attn.mesh())[std::size_t(comm.rank())]});
  }

  void forward(RankBuffers& x) {
    const auto& pr = plan.problem();
    using CV = TensorView<const float>;
    attn.template forward<float>(plan, CV::bshd(x.q.data(), pr.batch, x.len, pr.heads, pr.head_dim),
                                 CV::bshd(x.k.data(), pr.batch, x.len, pr.kv_heads, pr.head_dim),
                                 CV::bshd(x.v.data(), pr.batch, x.len, pr.kv_heads, pr.head_dim),
                                 TensorView<float>::bshd(x.out.data(), pr.batch, x.len, pr.heads, pr.head_dim),
                                 std::span<std::byte>(x.workspace));
  }
};

/// What the ranks report back: bytes of their last forward, and rank 0's plan.
struct TeamReport {
  std::vector<std::uint64_t> bytes;
  Plan plan;
  std::int64_t seq = 0;  ///< global sequence length
  explicit TeamReport(int ranks) : bytes(std::size_t(ranks)) {}

  double max_bytes() const { return double(*std::max_element(bytes.begin(), bytes.end())); }
  double imbalance() const {
    double mx = 0, sum = 0;
    const int world = plan.mesh().world();
    for (int w = 0; w < world; ++w) {
      const double x = double(plan.work(w));
      mx = std::max(mx, x);
      sum += x;
    }
    return sum > 0 ? mx / (sum / world) : 1.0;
  }
};

/// A rank setup running engines of the listed policies; step(i) runs a forward of the i-th.
template <class... Pols>
RankTeam::Setup engines_setup(int ranks, bool causal, std::int64_t seq, TeamReport& report) {
  report.seq = seq;
  return [ranks, causal, seq, &report](ThreadCommunicator& comm) -> RankTeam::Step {
    const AttentionProblem pr = bench_problem(causal);
    // Braces: the engines (collective constructions) are built in the same order on every rank.
    using Engines = std::tuple<RankEngine<Pols>...>;
    std::shared_ptr<Engines> engines(new Engines{RankEngine<Pols>(comm, ranks, pr, seq)...});
    const Plan& first = std::get<0>(*engines).plan;
    if (comm.rank() == 0) report.plan = first;
    auto buffers = std::make_shared<RankBuffers>(comm.rank(), first.local_q(), pr);
    std::apply([&](auto&... e) { buffers->workspace.resize(std::max({e.plan.workspace_bytes()...})); }, *engines);
    return [engines, buffers, &report, &comm](int which) {
      const std::uint64_t before = comm.stats().bytes_sent;
      int i = 0;
      std::apply([&](auto&... e) { ((i++ == which ? e.forward(*buffers) : void()), ...); }, *engines);
      report.bytes[std::size_t(comm.rank())] = comm.stats().bytes_sent - before;
    };
  };
}

void common_counters(benchmark::State& state, const TeamReport& r, double seconds) {
  const auto& pr = r.plan.problem();
  const double min_bytes = bench::min_forward_bytes(pr, r.seq, r.plan.mesh().ulysses, r.plan.mesh().ring);
  state.counters["ms_per_fwd"] = seconds * 1e3;
  state.counters["bytes_per_rank"] = r.max_bytes();
  state.counters["bytes_min"] = min_bytes;
  state.counters["bytes_ratio"] = min_bytes > 0 ? r.max_bytes() / min_bytes : (r.max_bytes() == 0 ? 1.0 : 0.0);
  state.counters["imbalance"] = r.imbalance();
  state.counters["U"] = r.plan.mesh().ulysses;
  state.counters["R"] = r.plan.mesh().ring;
  state.counters["GFLOPs"] =
      bench::attention_flops(pr.batch, pr.heads, r.seq, r.seq, pr.head_dim, pr.causal) * 1e-9 / seconds;
  state.counters["seq"] = double(r.seq);
}

/// Args: P, causal. Time per forward is the median over iterations (manual time per forward).
template <class Pol>
void BM_policy(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  TeamReport report(ranks);
  RankTeam team(ranks, engines_setup<Pol>(ranks, state.range(1) != 0, global_seq, report));
  team.time_step(0);  // warm-up
  std::vector<double> times;
  for (auto _ : state) {
    times.push_back(team.time_step(0));
    state.SetIterationTime(times.back());
  }
  common_counters(state, report, bench::median(times));
}

/// Engine `B` against engine `A` on the same shape (causal, dividing evenly), alternated ABBA
/// within each iteration so drifting load hits both alike. ratio compares the means of the
/// faster half of each side's calls (fast_half_mean); ratio_best and ratio_median compare
/// minimums and medians. bytes_equal is 1 when both sent exactly the same bytes.
template <class A, class B>
void pair_benchmark(benchmark::State& state, const char* a_name, const char* b_name) {
  const int ranks = static_cast<int>(state.range(0));
  TeamReport report(ranks);
  RankTeam team(ranks, engines_setup<A, B>(ranks, true, pair_seq, report));
  team.time_step(0);
  team.time_step(1);
  std::vector<double> plain, any;
  std::uint64_t plain_bytes = 0, any_bytes = 0;
  for (auto _ : state) {
    const double a = team.time_step(0);
    plain_bytes = std::uint64_t(report.max_bytes());
    const double b = team.time_step(1);
    any_bytes = std::uint64_t(report.max_bytes());
    const double c = team.time_step(1), d = team.time_step(0);
    plain.push_back(a);
    plain.push_back(d);
    any.push_back(b);
    any.push_back(c);
    state.SetIterationTime(a + b + c + d);
  }
  common_counters(state, report, bench::median(plain));
  const double best_plain = *std::min_element(plain.begin(), plain.end()), best_any = *std::min_element(any.begin(), any.end());
  state.counters[a_name] = bench::fast_half_mean(plain) * 1e3;
  state.counters[b_name] = bench::fast_half_mean(any) * 1e3;
  state.counters["ratio"] = bench::fast_half_mean(any) / bench::fast_half_mean(plain);
  state.counters["ratio_best"] = best_any / best_plain;
  state.counters["ratio_median"] = bench::median(any) / bench::median(plain);
  state.counters["samples"] = double(plain.size());
  state.counters["bytes_equal"] = plain_bytes == any_bytes;
}

/// Args: P. Plain `Pol` and AnythingPolicy<Pol> (pair_benchmark).
template <class Pol>
void BM_anything_vs_plain(benchmark::State& state) {
  pair_benchmark<Pol, AnythingPolicy<Pol>>(state, "ms_plain", "ms_anything");
}

/// Args: P. `Pol` with attention sinks against `Pol` without (pair_benchmark): the sinks join
/// each row once after the merge, a pass over the output (target: ratio <= 1.02).
template <class Pol>
void BM_sinks_vs_plain(benchmark::State& state) {
  pair_benchmark<Pol, WithSinks<Pol>>(state, "ms_plain", "ms_sinks");
}

void policy_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"P", "causal"})->ArgsProduct({{1, 2, 4}, {0, 1}});
  b->UseManualTime()->MinTime(0.5)->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_policy<UlyssesPolicy>)->Apply(policy_args);
BENCHMARK(BM_policy<RingPolicy<Contiguous>>)->Apply(policy_args);
BENCHMARK(BM_policy<RingPolicy<Zigzag>>)->Apply(policy_args);
BENCHMARK(BM_policy<RingPolicy<Stripe>>)->Apply(policy_args);
BENCHMARK(BM_policy<UnifiedPolicy<Zigzag>>)->Apply(policy_args);
BENCHMARK(BM_policy<AnythingPolicy<UnifiedPolicy<Zigzag>>>)->Apply(policy_args);

// P = 4 puts two rank threads on each core: how the scheduler interleaves them varies from
// call to call by a percent or two, so that case gets more calls.
void pair_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"P"})->Arg(2)->UseManualTime()->MinTime(8.0)->Unit(benchmark::kMillisecond);
}
void pair_args_shared_cores(benchmark::internal::Benchmark* b) {
  b->ArgNames({"P"})->Arg(4)->UseManualTime()->MinTime(16.0)->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_anything_vs_plain<UlyssesPolicy>)->Apply(pair_args);
BENCHMARK(BM_anything_vs_plain<UlyssesPolicy>)->Apply(pair_args_shared_cores);
BENCHMARK(BM_anything_vs_plain<RingPolicy<Zigzag>>)->Apply(pair_args);
BENCHMARK(BM_anything_vs_plain<RingPolicy<Zigzag>>)->Apply(pair_args_shared_cores);
BENCHMARK(BM_anything_vs_plain<UnifiedPolicy<Zigzag>>)->Apply(pair_args);
BENCHMARK(BM_anything_vs_plain<UnifiedPolicy<Zigzag>>)->Apply(pair_args_shared_cores);
BENCHMARK(BM_sinks_vs_plain<UlyssesPolicy>)->Apply(pair_args);
BENCHMARK(BM_sinks_vs_plain<RingPolicy<Zigzag>>)->Apply(pair_args);

}  // namespace
