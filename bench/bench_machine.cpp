/// \file
/// The machine's ceilings, measured with the same SIMD types and flags as the kernels so the
/// kernels' figures can be quoted as fractions of them: fp32 FMA peak of one core and of all
/// cores, and memory copy bandwidth.

#include <benchmark/benchmark.h>

#include <cstring>
#include <thread>
#include <vector>

#include "bench_common.hpp"

namespace {

using seqpar::detail::simd_fma;
using seqpar::detail::simd_t;
using V = simd_t<float>;
constexpr int lanes = seqpar::detail::Simd<float>::width;

/// Independent FMA chains: enough to cover latency x throughput on any current core (4-cycle
/// latency, 2 pipes) without spilling on 16-register targets.
constexpr int chains = seqpar::detail::simd_registers >= 32 ? 16 : 12;
constexpr std::int64_t fma_rounds = 1 << 20;

/// fma_rounds x chains vector FMAs; the result is kept so nothing is optimised away.
[[gnu::noinline]] float fma_burst(float seed) {
  V acc[chains];
  for (int c = 0; c < chains; ++c) acc[c] = V{} + seed * float(c + 1);
  const V mul = V{} + 0.999999f, add = V{} + 1e-7f;
  for (std::int64_t n = 0; n < fma_rounds; ++n) {
    [&]<int... C>(std::integer_sequence<int, C...>) {
      ((acc[C] = simd_fma(acc[C], mul, add)), ...);
    }(std::make_integer_sequence<int, chains>{});
  }
  float s = 0;
  for (int c = 0; c < chains; ++c)
    for (int l = 0; l < lanes; ++l) s += acc[c][l];
  return s;
}

constexpr double burst_flops = 2.0 * lanes * chains * fma_rounds;

/// One core's fp32 FMA peak: GFLOP/s per thread CPU second (robust to other processes).
void BM_peak_fma_one_core(benchmark::State& state) {
  float seed = 1e-3f;
  for (auto _ : state) {
    benchmark::DoNotOptimize(seed);  // an unknown input: the burst cannot be hoisted or folded
    benchmark::DoNotOptimize(fma_burst(seed));
  }
  state.counters["GFLOPs"] = benchmark::Counter(burst_flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["lanes"] = lanes;
}
BENCHMARK(BM_peak_fma_one_core)->MinTime(0.3);

/// All cores: one burst per hardware thread per iteration, timed on the wall clock.
void BM_peak_fma_all_cores(benchmark::State& state) {
  const int n = static_cast<int>(std::thread::hardware_concurrency());
  std::vector<float> sink(static_cast<std::size_t>(n));
  for (auto _ : state) {
    std::vector<std::thread> team;
    for (int t = 0; t < n; ++t)
      team.emplace_back([&, t] {
        float seed = 1e-3f * float(t + 1);
        benchmark::DoNotOptimize(seed);
        sink[t] = fma_burst(seed);
      });
    for (auto& t : team) t.join();
  }
  benchmark::DoNotOptimize(sink.data());
  state.counters["GFLOPs"] = benchmark::Counter(burst_flops * n * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = n;
}
BENCHMARK(BM_peak_fma_all_cores)->UseRealTime()->MinTime(0.3);

/// Memory copy bandwidth: memcpy of 256 MiB (8x the last-level cache), split over
/// state.range(0) threads (0 = every hardware thread), counted as bytes read plus bytes
/// written (the STREAM convention for copy).
void BM_memory_copy(benchmark::State& state) {
  const std::size_t bytes = std::size_t(256) << 20;
  const int n = state.range(0) > 0 ? static_cast<int>(state.range(0)) : static_cast<int>(std::thread::hardware_concurrency());
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  const std::size_t part = bytes / static_cast<std::size_t>(n);
  for (auto _ : state) {
    std::vector<std::thread> team;
    for (int t = 1; t < n; ++t) team.emplace_back([&, t] { std::memcpy(dst.data() + t * part, src.data() + t * part, part); });
    std::memcpy(dst.data(), src.data(), part);
    for (auto& t : team) t.join();
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] = benchmark::Counter(2.0 * double(part) * n * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = n;
}
BENCHMARK(BM_memory_copy)->Arg(1)->Arg(0)->UseRealTime()->MinTime(0.5);

}  // namespace
