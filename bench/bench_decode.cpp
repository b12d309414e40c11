// Decode over a sharded KV cache: per-step time and bytes for a 32K-token cache at
// P = 1, 2, 4 ranks (threads), against gathering the cache to every rank each step and decoding
// there (what an engine without sharded decode does). Counters: ms per step (rank 0, median of
// the timed steps), bytes rank 0 sent per step and the plan's count, cache bytes held per rank.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <vector>

#include "bench_common.hpp"
#include "seqpar/seqpar.hpp"

using namespace seqpar;
using seqpar::bench::RankTeam;

namespace {

constexpr std::int64_t cache_len = 32768, H = 32, K = 8, D = 128;

/// Rank 0's figures of the last step.
struct DecodeReport {
  std::uint64_t bytes = 0, plan_bytes = 0, cache_bytes = 0;
};

/// mode 0: SequenceParallelDecode over the sharded cache (pages of 16); mode 1: all-to-all the
/// shards so every rank holds the whole cache, then decode it locally.
RankTeam::Setup decode_setup(int mode, DecodeReport& report) {
  return [mode, &report](ThreadCommunicator& comm) -> RankTeam::Step {
    struct State {
      SequenceParallelDecode<ThreadCommunicator, CpuFlashKernel> dec;
      DecodePlan plan;
      std::vector<float> q, k, v, out, k_all, v_all;
      std::vector<std::byte> ws;
      explicit State(ThreadCommunicator& c) : dec(c, CpuFlashKernel(CpuFlashOptions{.threads = 1})) {}
    };
    auto st = std::make_shared<State>(comm);
    const int P = comm.size();
    st->plan = st->dec.plan({.batch = 1, .heads = H, .kv_heads = K, .head_dim = D, .new_tokens = 1,
                             .kv_len = {cache_len - 1}, .capacity = cache_len, .page = 16});
    const std::int64_t C = st->plan.shard_capacity();
    st->k.assign(static_cast<std::size_t>(C * K * D), 0.01f);
    st->v.assign(st->k.size(), 0.02f);
    st->q.assign(static_cast<std::size_t>(H * D), 0.1f);
    st->out.resize(st->q.size());
    st->ws.resize(st->plan.workspace_bytes());
    if (mode == 1) {
      st->k_all.resize(static_cast<std::size_t>(C * P * K * D));
      st->v_all.resize(st->k_all.size());
    }
    if (comm.rank() == 0) {
      report.plan_bytes = st->plan.step_bytes();
      report.cache_bytes = 2 * (mode == 1 ? st->k_all.size() : st->k.size()) * sizeof(float);
    }
    return [st, mode, P, C, &comm, &report](int) {
      const std::uint64_t before = comm.stats().bytes_sent;
      using CV = TensorView<const float>;
      if (mode == 0) {
        st->dec.step<float>(st->plan, CV::bshd(st->q.data(), 1, 1, H, D), CV::bshd(st->k.data(), 1, C, K, D),
                            CV::bshd(st->v.data(), 1, C, K, D), TensorView<float>::bshd(st->out.data(), 1, 1, H, D),
                            st->ws);
      } else {
        // Every rank gathers every shard, then attends over the whole cache on its own.
        const std::size_t shard = st->k.size() * sizeof(float);
        std::vector<std::size_t> counts(static_cast<std::size_t>(P), shard), zero(static_cast<std::size_t>(P), 0),
            displs(static_cast<std::size_t>(P));
        for (int r = 0; r < P; ++r) displs[static_cast<std::size_t>(r)] = r * shard;
        for (auto [from, to] : {std::pair{&st->k, &st->k_all}, std::pair{&st->v, &st->v_all}})
          comm.all_to_all_v(reinterpret_cast<const std::byte*>(from->data()), counts, zero,
                            reinterpret_cast<std::byte*>(to->data()), counts, displs);
        KernelParams p;
        p.scale = 1.0 / std::sqrt(double(D));
        p.q_positions = PositionMap::run(1, cache_len - 1);
        p.k_positions = PositionMap::run(C * P, 0);
        p.group_size = H / K;
        st->dec.kernel().forward(CV::bshd(st->q.data(), 1, 1, H, D), CV::bshd(st->k_all.data(), 1, C * P, K, D),
                                 CV::bshd(st->v_all.data(), 1, C * P, K, D),
                                 TensorView<float>::bshd(st->out.data(), 1, 1, H, D), TensorView<float>{}, p);
      }
      if (comm.rank() == 0) report.bytes = comm.stats().bytes_sent - before;
    };
  };
}

void BM_decode(benchmark::State& state) {
  const int P = static_cast<int>(state.range(0)), mode = static_cast<int>(state.range(1));
  DecodeReport report;
  RankTeam team(P, decode_setup(mode, report));
  team.time_step(0);  // warm up
  std::vector<double> times;
  for (auto _ : state) {
    const double s = team.time_step(0);
    state.SetIterationTime(s);
    times.push_back(s);
  }
  state.counters["ms_per_step"] = bench::median(times) * 1e3;
  state.counters["bytes_per_step"] = double(report.bytes);
  state.counters["bytes_plan"] = mode == 0 ? double(report.plan_bytes) : double(report.bytes);
  state.counters["cache_MiB_per_rank"] = double(report.cache_bytes) / (1 << 20);
  state.SetLabel(mode == 0 ? "sharded" : "gather cache");
}

/// Args: new tokens T, threads. CpuFlashKernel alone on one decode step's shape: T queries of
/// H heads against a cache_len-token shard (K heads, D, element type E: float, or a bf16
/// or fp16 cache, half the bytes, widened block by block), each row limited to its own
/// keys by row_key_end (the cache and the step's earlier tokens), as SequenceParallelDecode
/// calls it. Fastest call in wall time; GFLOPs = 4 T H D x visible keys per second, GBs = K
/// and V bytes read once (2 x keys x K x D x sizeof(E)) per second: decode is bound by the latter.
template <class E>
void BM_decode_kernel(benchmark::State& state) {
  const std::int64_t T = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  const auto q = bench::random_values<E>(static_cast<std::size_t>(T * H * D), 1);
  const auto k = bench::random_values<E>(static_cast<std::size_t>(cache_len * K * D), 2);
  const auto v = bench::random_values<E>(k.size(), 3);
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(T * H));
  std::vector<std::int64_t> ends(static_cast<std::size_t>(T));
  double pairs = 0;
  for (std::int64_t t = 0; t < T; ++t) pairs += double(ends[static_cast<std::size_t>(t)] = cache_len - T + t + 1);
  KernelParams p;
  p.scale = 1.0 / std::sqrt(double(D));
  p.q_positions = PositionMap::run(T, 0);
  p.k_positions = PositionMap::run(cache_len, 0);
  p.group_size = H / K;
  p.mask.row_key_end = ends.data();
  p.mask.row_stride = T;
  CpuFlashKernel kernel(CpuFlashOptions{.threads = threads});
  using CV = TensorView<const E>;
  auto call = [&] {
    kernel.forward(CV::bshd(q.data(), 1, T, H, D), CV::bshd(k.data(), 1, cache_len, K, D),
                   CV::bshd(v.data(), 1, cache_len, K, D), TensorView<float>::bshd(out.data(), 1, T, H, D),
                   TensorView<float>::bshd(lse.data(), 1, T, H, 1), p);
  };
  call();  // warm-up: scratch, pages
  double best = 1e30;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    benchmark::ClobberMemory();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
    best = std::min(best, s);
  }
  state.counters["ms_per_call"] = best * 1e3;
  state.counters["GFLOPs"] = 4.0 * double(H * D) * pairs * 1e-9 / best;
  state.counters["GBs"] = 2.0 * double(cache_len * K * D) * sizeof(E) * 1e-9 / best;
}

}  // namespace

BENCHMARK_TEMPLATE(BM_decode_kernel, float)->ArgNames({"T", "threads"})->ArgsProduct({{1, 16}, {1, 2}})->UseManualTime()->MinTime(0.5)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_decode_kernel, bf16)->ArgNames({"T", "threads"})->ArgsProduct({{1, 16}, {1, 2}})->UseManualTime()->MinTime(0.5)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_decode_kernel, f16)->ArgNames({"T", "threads"})->ArgsProduct({{1, 16}, {1, 2}})->UseManualTime()->MinTime(0.5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_decode)->ArgNames({"P", "gather"})->ArgsProduct({{1, 2, 4}, {0, 1}})->UseManualTime()->Iterations(8)->Unit(benchmark::kMillisecond);
