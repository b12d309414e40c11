/// \file
/// Local kernels: CpuFlashKernel against ReferenceKernel, float, one (batch, heads) shape over
/// head dims 64 and 128, sequence 512..16K, causal and not; CpuFlashKernel's thread scaling;
/// and its masks beyond causal (packed documents, a sliding window) against the causal calls
/// that do the same visible work. GFLOPs counts 4 B H Sq Sk D (halved for causal) per
/// forward, or 4 B H D per visible pair for the masked ones.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <utility>

#include "bench_common.hpp"

namespace {

using namespace seqpar;
using namespace seqpar::bench;

constexpr std::int64_t batch = 1, heads = 2;

/// Inputs of one self-attention forward with contiguous positions.
struct KernelCase {
  std::int64_t seq, dim;
  bool causal;
  std::vector<float> q, k, v, out, lse;
  KernelParams params;

  KernelCase(std::int64_t s, std::int64_t d, bool c)
      : seq(s), dim(d), causal(c), q(random_values<float>(std::size_t(batch * s * heads * d), 1)),
        k(random_values<float>(q.size(), 2)), v(random_values<float>(q.size(), 3)), out(q.size()),
        lse(std::size_t(batch * s * heads)) {
    params.scale = 1.0 / std::sqrt(double(d));
    params.causal = c;
    params.q_positions = PositionMap::run(s, 0);
    params.k_positions = PositionMap::run(s, 0);
  }

  template <class Kernel>
  void run(Kernel& kernel) {
    using CV = TensorView<const float>;
    kernel.forward(CV::bshd(q.data(), batch, seq, heads, dim), CV::bshd(k.data(), batch, seq, heads, dim),
                   CV::bshd(v.data(), batch, seq, heads, dim), TensorView<float>::bshd(out.data(), batch, seq, heads, dim),
                   TensorView<float>::bshd(lse.data(), batch, seq, heads, 1), params);
  }

  double flops() const { return attention_flops(batch, heads, seq, seq, dim, causal); }
};

/// The calling thread's CPU time in seconds.
inline double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

/// Runs the benchmark loop. GFLOPs is the fastest call per thread-CPU second, GFLOPs_wall per
/// wall second: on a shared host (here two vCPUs whose neighbours come and go) a mean over a
/// few calls moves by 20-40% with the neighbours, while the fastest call is what the kernel
/// does when it has the core, and repeats within a few percent. GFLOPs_mean is the mean per
/// CPU second. (Kernels with threads of their own should time wall clock: see the scaling
/// benchmark.)
template <class Kernel>
void time_kernel(benchmark::State& state, Kernel& kernel, KernelCase& c) {
  c.run(kernel);  // warm-up: first touch of the pages and the scratch
  const auto t0 = std::chrono::steady_clock::now();
  double best_cpu = 1e30, best_wall = 1e30;
  for (auto _ : state) {
    const double c0 = thread_cpu_seconds();
    const auto w0 = std::chrono::steady_clock::now();
    c.run(kernel);
    benchmark::ClobberMemory();
    best_wall = std::min(best_wall, std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count());
    best_cpu = std::min(best_cpu, thread_cpu_seconds() - c0);
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  state.counters["GFLOPs"] = c.flops() * 1e-9 / best_cpu;
  state.counters["GFLOPs_wall"] = c.flops() * 1e-9 / best_wall;
  state.counters["GFLOPs_mean"] = c.flops() * double(state.iterations()) * 1e-9 / wall;
  state.counters["seq"] = double(c.seq);
  state.counters["dim"] = double(c.dim);
  state.counters["causal"] = c.causal;
}

/// Args: head_dim, seq, causal.
void BM_cpu_flash(benchmark::State& state) {
  KernelCase c(state.range(1), state.range(0), state.range(2) != 0);
  CpuFlashKernel kernel;
  kernel.prepare(c.dim);
  time_kernel(state, kernel, c);
  state.counters["threads"] = 1;
  state.SetLabel(cpu_isa_name(kernel.isa()));
}

/// Args: head_dim, seq, causal. The exact kernel is quadratic in memory traffic per row and
/// accumulates in double: only run up to 2K.
void BM_reference(benchmark::State& state) {
  KernelCase c(state.range(1), state.range(0), state.range(2) != 0);
  ReferenceKernel kernel;
  time_kernel(state, kernel, c);
}

/// Args: head_dim, seq, causal, threads N. Each iteration times one forward on 1 thread and
/// one on N threads, back to back, so that a change of load on the shared machine hits both.
/// speedup is the ratio of the fastest calls (the ones least disturbed by other processes;
/// a call on N threads is only that fast when N cores were free), speedup_median the ratio
/// of the medians. The benchmark's own time is the pair's.
void BM_cpu_flash_scaling(benchmark::State& state) {
  KernelCase c(state.range(1), state.range(0), state.range(2) != 0);
  const int n = static_cast<int>(state.range(3));
  CpuFlashKernel one, many(CpuFlashOptions{.threads = n});
  one.prepare(c.dim);
  many.prepare(c.dim);
  c.run(one);
  c.run(many);
  std::vector<double> t1, tn;
  auto timed = [&](CpuFlashKernel& k) {
    const auto t0 = std::chrono::steady_clock::now();
    c.run(k);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (auto _ : state) {
    t1.push_back(timed(one));
    tn.push_back(timed(many));
  }
  const double b1 = *std::min_element(t1.begin(), t1.end()), bn = *std::min_element(tn.begin(), tn.end());
  state.counters["GFLOPs_1"] = c.flops() * 1e-9 / b1;
  state.counters["GFLOPs_N"] = c.flops() * 1e-9 / bn;
  state.counters["speedup"] = b1 / bn;
  state.counters["speedup_median"] = median(t1) / median(tn);
  state.counters["samples"] = double(t1.size());
  state.counters["threads"] = n;
  state.counters["seq"] = double(c.seq);
  state.counters["dim"] = double(c.dim);
  state.counters["causal"] = c.causal;
}

/// Args: head_dim, seq, causal. Backward against forward on one thread: each iteration times
/// one forward and one backward call back to back (same inputs, the forward's LSE), so that a
/// change of load hits both; ratio is the fastest backward over the fastest forward.
void BM_cpu_flash_backward(benchmark::State& state) {
  KernelCase c(state.range(1), state.range(0), state.range(2) != 0);
  CpuFlashKernel kernel;
  kernel.prepare(c.dim);
  std::vector<float> dq(c.q.size()), dk(c.k.size()), dv(c.v.size());
  using CV = TensorView<const float>;
  auto backward = [&] {
    auto view = [&](const std::vector<float>& x) { return CV::bshd(x.data(), batch, c.seq, heads, c.dim); };
    auto grad = [&](std::vector<float>& x) { return TensorView<float>::bshd(x.data(), batch, c.seq, heads, c.dim); };
    kernel.backward(view(c.v), view(c.q), view(c.k), view(c.v), view(c.out),
                    TensorView<const float>::bshd(c.lse.data(), batch, c.seq, heads, 1), grad(dq), grad(dk), grad(dv),
                    c.params);
  };
  c.run(kernel);
  backward();
  std::vector<double> tf, tb;
  auto timed = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (auto _ : state) {
    tf.push_back(timed([&] { c.run(kernel); }));
    tb.push_back(timed(backward));
  }
  const double bf = *std::min_element(tf.begin(), tf.end()), bb = *std::min_element(tb.begin(), tb.end());
  state.counters["forward_ms"] = bf * 1e3;
  state.counters["backward_ms"] = bb * 1e3;
  state.counters["ratio"] = bb / bf;
  state.counters["seq"] = double(c.seq);
  state.counters["dim"] = double(c.dim);
  state.counters["causal"] = c.causal;
  state.SetLabel(cpu_isa_name(kernel.isa()));
}

/// Flops of one forward of `c` over the (query, key) pairs its mask leaves visible.
double visible_flops(const KernelCase& c) {
  MaskView m = c.params.mask;
  m.causal = c.params.causal;
  return 4.0 * double(batch * heads * c.dim) *
         double(visible_pairs(m, 0, c.params.q_positions, c.params.k_positions));
}

/// One forward of `a` and one of `b` per iteration, back to back on one kernel (so that a
/// change of load hits both); returns the fastest call of each in thread-CPU seconds.
std::pair<double, double> fastest_alternated(benchmark::State& state, KernelCase& a, KernelCase& b) {
  CpuFlashKernel kernel;
  kernel.prepare(std::max(a.dim, b.dim));
  a.run(kernel);  // warm-up: first touch of the pages and the scratch
  b.run(kernel);
  auto timed = [&](KernelCase& c) {
    const double t0 = thread_cpu_seconds();
    c.run(kernel);
    return thread_cpu_seconds() - t0;
  };
  double best_a = 1e30, best_b = 1e30;
  for (auto _ : state) {
    best_a = std::min(best_a, timed(a));
    best_b = std::min(best_b, timed(b));
  }
  state.counters["dim"] = double(a.dim);
  state.SetLabel(cpu_isa_name(kernel.isa()));
  return {best_a, best_b};
}

/// Args: head_dim. Packed documents against the same documents one at a time: 8 causal
/// documents of 1024 tokens packed into one 8192-token sequence (one call), and 8 calls on
/// one 1024-token causal document. ratio is the fastest packed call over 8 fastest single
/// calls (target <= 1.3); GFLOPs counts the visible pairs.
void BM_cpu_flash_documents(benchmark::State& state) {
  constexpr std::int64_t docs = 8, doc_len = 1024;
  KernelCase packed(docs * doc_len, state.range(0), true), one(doc_len, state.range(0), true);
  std::vector<std::int64_t> starts;
  for (std::int64_t d = 0; d <= docs; ++d) starts.push_back(d * doc_len);
  packed.params.mask.doc_starts = starts.data();
  packed.params.mask.doc_count = docs;
  const auto [t_packed, t_one] = fastest_alternated(state, packed, one);
  state.counters["packed_ms"] = t_packed * 1e3;
  state.counters["one_by_one_ms"] = docs * t_one * 1e3;
  state.counters["ratio"] = t_packed / (docs * t_one);
  state.counters["GFLOPs"] = visible_flops(packed) * 1e-9 / t_packed;
  state.counters["GFLOPs_one"] = visible_flops(one) * 1e-9 / t_one;
}

/// Args: head_dim, window. A causal sliding window of `window` keys back at 16K tokens
/// against the full causal forward. share is the window's visible pairs over the causal
/// mask's; ratio the fastest window call over share x the fastest causal call (target
/// <= 1.3); GFLOPs counts the visible pairs.
void BM_cpu_flash_window(benchmark::State& state) {
  constexpr std::int64_t seq = 16384;
  KernelCase window(seq, state.range(0), true), full(seq, state.range(0), true);
  window.params.mask.window_left = state.range(1);
  const auto [t_window, t_full] = fastest_alternated(state, window, full);
  const double share = visible_flops(window) / visible_flops(full);
  state.counters["window_ms"] = t_window * 1e3;
  state.counters["causal_ms"] = t_full * 1e3;
  state.counters["share"] = share;
  state.counters["ratio"] = t_window / (share * t_full);
  state.counters["GFLOPs"] = visible_flops(window) * 1e-9 / t_window;
  state.counters["GFLOPs_causal"] = visible_flops(full) * 1e-9 / t_full;
}

void kernel_args(benchmark::internal::Benchmark* b, std::int64_t max_seq) {
  b->ArgNames({"D", "seq", "causal"});
  for (std::int64_t d : {64, 128})
    for (std::int64_t causal : {0, 1})
      for (std::int64_t s = 512; s <= max_seq; s *= 2) b->Args({d, s, causal});
}

BENCHMARK(BM_cpu_flash)->Apply([](auto* b) { kernel_args(b, 16384); })->MinTime(0.4)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_reference)->Apply([](auto* b) { kernel_args(b, 2048); })->MinTime(0.1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cpu_flash_backward)
    ->ArgNames({"D", "seq", "causal"})
    ->ArgsProduct({{64, 128}, {2048}, {0, 1}})
    ->UseRealTime()
    ->MinTime(1.0)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cpu_flash_documents)->ArgName("D")->Arg(64)->Arg(128)->MinTime(1.0)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cpu_flash_window)
    ->ArgNames({"D", "window"})
    ->ArgsProduct({{64, 128}, {512}})
    ->MinTime(3.0)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cpu_flash_scaling)
    ->ArgNames({"D", "seq", "causal", "threads"})
    ->ArgsProduct({{128}, {4096, 8192}, {0, 1}, {2}})
    ->UseRealTime()
    ->MinTime(2.0)
    ->Unit(benchmark::kMillisecond);

}  // namespace
