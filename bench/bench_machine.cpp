/// \file
/// The machine's ceilings, measured at the vector width the kernels run at (chosen at run
/// time, kernel/cpu/isa.hpp) so that the kernels' figures can be quoted as fractions of them:
/// fp32 FMA peak of one core and of all cores, the AVX512-BF16 dot product's rate, and memory
/// copy bandwidth.

#include <benchmark/benchmark.h>

#include <cstring>
#include <thread>
#include <vector>

#include "bench_common.hpp"

namespace {

/// A compile-check build ends before Google Benchmark's main runs (bench_common.hpp).
[[maybe_unused]] const bool refused = (seqpar::bench::refuse_if_compile_only("seqpar_bench"), true);

/// The vector width the kernels run at (CpuFlashKernel's default: the widest this CPU has,
/// capped by SEQPAR_CPU_ISA), so that the peak and the kernels are measured alike.
const seqpar::CpuIsa isa = seqpar::default_cpu_isa();
const int lanes = seqpar::cpu_isa_vector_bits(isa) / 32;
constexpr std::int64_t fma_rounds = 1 << 20;

/// fma_rounds vector FMAs per chain at the kernels' width; returns the flops done.
double fma_burst(float seed, float* sink) {
  return seqpar::detail::dispatch_cpu_isa<seqpar::detail::FmaBurst>(isa, fma_rounds, seed, sink);
}

/// One core's fp32 FMA peak: GFLOP/s per thread CPU second (robust to other processes).
void BM_peak_fma_one_core(benchmark::State& state) {
  float seed = 1e-3f, sink = 0;
  double flops = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(seed);  // an unknown input: the burst cannot be hoisted or folded
    flops = fma_burst(seed, &sink);
    benchmark::DoNotOptimize(sink);
  }
  state.counters["GFLOPs"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["lanes"] = lanes;
}
BENCHMARK(BM_peak_fma_one_core)->MinTime(0.3);

#if SEQPAR_CPU_ISA_BF16_DOT
/// One core's 512-bit AVX512-BF16 dot-product rate (vdpbf16ps: 64 float flops per
/// instruction) next to the 512-bit FMA's (32), both by the same 16-chain assembly loop the
/// kernel's level choice uses (bf16_dot_pays). Skipped where the CPU has no AVX512-BF16.
void BM_peak_bf16_dot_one_core(benchmark::State& state) {
  if (!seqpar::cpu_isa_supported(seqpar::CpuIsa::avx512_bf16)) {
    state.SkipWithError("no AVX512-BF16 on this CPU");
    return;
  }
  constexpr std::int64_t rounds = 1 << 18;
  double dot = 0, fma = 0;
  for (auto _ : state) {
    dot += seqpar::detail::time_vector_chains(rounds, true);
    fma += seqpar::detail::time_vector_chains(rounds, false);
  }
  const double n = 16.0 * rounds * double(state.iterations());
  state.counters["GFLOPs_dot"] = 64 * n / dot * 1e-9;
  state.counters["GFLOPs_fma"] = 32 * n / fma * 1e-9;
  state.counters["dot_over_fma"] = (64 / dot) / (32 / fma);
}
BENCHMARK(BM_peak_bf16_dot_one_core)->MinTime(0.3);
#endif

/// All cores: one burst per hardware thread per iteration, timed on the wall clock.
void BM_peak_fma_all_cores(benchmark::State& state) {
  const int n = static_cast<int>(std::thread::hardware_concurrency());
  std::vector<float> sink(static_cast<std::size_t>(n));
  double flops = 0;
  for (auto _ : state) {
    std::vector<std::thread> team;
    for (int t = 0; t < n; ++t)
      team.emplace_back([&, t] {
        float seed = 1e-3f * float(t + 1);
        benchmark::DoNotOptimize(seed);
        const double f = fma_burst(seed, &sink[t]);
        if (t == 0) flops = f;
      });
    for (auto& t : team) t.join();
  }
  benchmark::DoNotOptimize(sink.data());
  state.counters["GFLOPs"] = benchmark::Counter(flops * n * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
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
