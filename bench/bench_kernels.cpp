/// \file
/// Local kernels: CpuFlashKernel against ReferenceKernel, float, one (batch, heads) shape over
/// head dims 64 and 128, sequence 512..16K, causal and not; CpuFlashKernel's thread scaling;
/// its masks beyond causal (packed documents, a sliding window) against the causal calls
/// that do the same visible work; and today's models' features (soft-capping against none,
/// MLA's D 192 / D_v 128 against D 128, MLA's decode step); bf16 against float. GFLOPs counts 2 B H Sq Sk (D +
/// D_v) (halved for causal) per forward, or 4 B H D per visible pair for the masked ones.

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

/// `x` rounded to H, bf16 or f16 (the narrow benchmarks' inputs: the float draws, rounded once).
template <class H>
std::vector<H> rounded_to(const std::vector<float>& x) {
  std::vector<H> out;
  out.reserve(x.size());
  for (float v : x) out.push_back(H(v));
  return out;
}

/// Inputs of one self-attention forward with contiguous positions: `h` heads (K/V heads alike),
/// head dim `d` of Q and K, `dv` of V and O (0: d).
struct KernelCase {
  std::int64_t seq, dim, h, dim_v;
  bool causal;
  std::vector<float> q, k, v, out, lse;
  KernelParams params;

  KernelCase(std::int64_t s, std::int64_t d, bool c, std::int64_t h_ = heads, std::int64_t dv = 0)
      : seq(s), dim(d), h(h_), dim_v(dv > 0 ? dv : d), causal(c),
        q(random_values<float>(std::size_t(batch * s * h_ * d), 1)), k(random_values<float>(q.size(), 2)),
        v(random_values<float>(std::size_t(batch * s * h_ * dim_v), 3)), out(v.size()),
        lse(std::size_t(batch * s * h_)) {
    params.scale = 1.0 / std::sqrt(double(d));
    params.causal = c;
    params.q_positions = PositionMap::run(s, 0);
    params.k_positions = PositionMap::run(s, 0);
  }

  template <class Kernel>
  void run(Kernel& kernel) {
    using CV = TensorView<const float>;
    kernel.forward(CV::bshd(q.data(), batch, seq, h, dim), CV::bshd(k.data(), batch, seq, h, dim),
                   CV::bshd(v.data(), batch, seq, h, dim_v), TensorView<float>::bshd(out.data(), batch, seq, h, dim_v),
                   TensorView<float>::bshd(lse.data(), batch, seq, h, 1), params);
  }

  /// 2 S^2 (D + D_v) per head (S = Q K^T and O = P V), halved for causal.
  double flops() const { return attention_flops(batch, h, seq, seq, dim + dim_v, causal) / 2; }
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

/// Args: head_dim, seq, causal, bf16. Backward against forward on one thread: each iteration
/// times one forward and one backward call back to back (same inputs, the forward's LSE), so
/// that a change of load hits both; ratio is the fastest backward over the fastest forward.
/// bf16: Q, K, V, O and dO in bf16 (the float draws rounded), LSE and gradients in float.
void BM_cpu_flash_backward(benchmark::State& state) {
  KernelCase c(state.range(1), state.range(0), state.range(2) != 0);
  const bool narrow = state.range(3) != 0;
  CpuFlashKernel kernel;
  kernel.prepare(c.dim);
  std::vector<float> dq(c.q.size()), dk(c.k.size()), dv(c.v.size());
  auto narrowed = [&](const std::vector<float>& x) { return narrow ? rounded_to<bf16>(x) : std::vector<bf16>{}; };
  const std::vector<bf16> qb = narrowed(c.q), kb = narrowed(c.k), vb = narrowed(c.v);
  std::vector<bf16> ob = narrowed(c.out);  // the bf16 forward's output
  auto view = [&]<class E>(E* x) { return TensorView<E>::bshd(x, batch, c.seq, heads, c.dim); };
  const auto lse = TensorView<float>::bshd(c.lse.data(), batch, c.seq, heads, 1);
  // One call of each on Q, K, V and O of either element type (dO: V's values, as any random
  // rows would do).
  auto forward_on = [&](const auto& q, const auto& k, const auto& v, auto& o) {
    kernel.forward(view(q.data()), view(k.data()), view(v.data()), view(o.data()), lse, c.params);
  };
  auto backward_on = [&](const auto& q, const auto& k, const auto& v, const auto& o) {
    kernel.backward(view(v.data()), view(q.data()), view(k.data()), view(v.data()), view(o.data()),
                    TensorView<const float>(lse), view(dq.data()), view(dk.data()), view(dv.data()), c.params);
  };
  auto forward = [&] { narrow ? forward_on(qb, kb, vb, ob) : forward_on(c.q, c.k, c.v, c.out); };
  auto backward = [&] { narrow ? backward_on(qb, kb, vb, ob) : backward_on(c.q, c.k, c.v, c.out); };
  forward();
  backward();
  std::vector<double> tf, tb;
  auto timed = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (auto _ : state) {
    tf.push_back(timed(forward));
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

/// Median of `x` (a copy is sorted).
double median_of(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x.size() % 2 ? x[x.size() / 2] : 0.5 * (x[x.size() / 2 - 1] + x[x.size() / 2]);
}

/// Args: head_dim, seq, causal. The same forward (4 heads, 1 thread) in float and in bf16 (the
/// same values rounded to bf16): bf16 by the automatic level (its converting packs, or the
/// AVX512-BF16 products where they pay, see bf16_dot_pays) and, where the CPU has them, by the
/// AVX512-BF16 products explicitly; and in fp16 (its converting packs). One call of each per
/// iteration, alternated; counters are medians over the iterations of the per-round ratios
/// (float time / bf16 or fp16 time: > 1 means the narrow type is faster) and of the calls' GFLOP/s.
void BM_cpu_flash_bf16(benchmark::State& state) {
  KernelCase c(state.range(1), state.range(0), state.range(2) != 0, 4);
  const std::vector<bf16> qb = rounded_to<bf16>(c.q), kb = rounded_to<bf16>(c.k), vb = rounded_to<bf16>(c.v);
  std::vector<bf16> ob(c.out.size());
  const std::vector<f16> qh = rounded_to<f16>(c.q), kh = rounded_to<f16>(c.k), vh = rounded_to<f16>(c.v);
  std::vector<f16> oh(c.out.size());
  CpuFlashKernel f32, automatic;
  const bool has_dot = cpu_isa_supported(CpuIsa::avx512_bf16);
  CpuFlashKernel dot(CpuFlashOptions{.isa = has_dot ? CpuIsa::avx512_bf16 : CpuIsa::automatic});
  // One forward of `k` on the 2-byte inputs q, kk, v into o.
  auto run_narrow = [&]<class H>(CpuFlashKernel& k, const std::vector<H>& q, const std::vector<H>& kk,
                                 const std::vector<H>& v, std::vector<H>& o) {
    auto in = [&](const std::vector<H>& x) { return TensorView<const H>::bshd(x.data(), batch, c.seq, c.h, c.dim); };
    k.forward(in(q), in(kk), in(v), TensorView<H>::bshd(o.data(), batch, c.seq, c.h, c.dim),
              TensorView<float>::bshd(c.lse.data(), batch, c.seq, c.h, 1), c.params);
  };
  auto run_bf16 = [&](CpuFlashKernel& k) { run_narrow(k, qb, kb, vb, ob); };
  auto run_f16 = [&] { run_narrow(automatic, qh, kh, vh, oh); };
  auto timed = [](auto&& f) {
    const double t0 = thread_cpu_seconds();
    f();
    return thread_cpu_seconds() - t0;
  };
  c.run(f32);  // warm-up: first touch of the pages and the scratch
  run_bf16(automatic);
  run_f16();
  if (has_dot) run_bf16(dot);
  std::vector<double> tf, ta, td, th, ra, rd, rh;
  for (auto _ : state) {
    tf.push_back(timed([&] { c.run(f32); }));
    ta.push_back(timed([&] { run_bf16(automatic); }));
    ra.push_back(tf.back() / ta.back());
    th.push_back(timed(run_f16));
    rh.push_back(tf.back() / th.back());
    if (has_dot) {
      td.push_back(timed([&] { run_bf16(dot); }));
      rd.push_back(tf.back() / td.back());
    }
  }
  const double flops = c.flops() * 1e-9;
  state.counters["GFLOPs_f32"] = flops / median_of(tf);
  state.counters["GFLOPs_bf16"] = flops / median_of(ta);
  state.counters["f32_over_bf16"] = median_of(ra);
  state.counters["GFLOPs_f16"] = flops / median_of(th);
  state.counters["f32_over_f16"] = median_of(rh);
  if (has_dot) {
    state.counters["GFLOPs_bf16_dot"] = flops / median_of(td);
    state.counters["f32_over_bf16_dot"] = median_of(rd);
  }
  state.counters["seq"] = double(c.seq);
  state.counters["dim"] = double(c.dim);
  state.counters["causal"] = c.causal;
  state.SetLabel(cpu_isa_name(automatic.isa()));
}

/// Flops of one forward of `c` over the (query, key) pairs its mask leaves visible.
double visible_flops(const KernelCase& c) {
  MaskView m = c.params.mask;
  m.causal = c.params.causal;
  return 4.0 * double(batch * heads * c.dim) *
         double(visible_pairs(m, 0, c.params.q_positions, c.params.k_positions));
}

/// Thread-CPU seconds of every call of `a` and of `b`: one forward of each per iteration, back
/// to back on one kernel (so that a change of load hits both).
struct AlternatedTimes {
  std::vector<double> a, b;  ///< seconds per call
};

/// See AlternatedTimes.
AlternatedTimes alternated(benchmark::State& state, KernelCase& a, KernelCase& b) {
  CpuFlashKernel kernel;
  kernel.prepare(std::max(a.dim, b.dim), std::max(a.dim_v, b.dim_v));
  a.run(kernel);  // warm-up: first touch of the pages and the scratch
  b.run(kernel);
  auto timed = [&](KernelCase& c) {
    const double t0 = thread_cpu_seconds();
    c.run(kernel);
    return thread_cpu_seconds() - t0;
  };
  AlternatedTimes t;
  for (auto _ : state) {
    t.a.push_back(timed(a));
    t.b.push_back(timed(b));
  }
  state.counters["dim"] = double(a.dim);
  state.SetLabel(cpu_isa_name(kernel.isa()));
  return t;
}

/// The fastest call of each side of alternated(), in thread-CPU seconds.
std::pair<double, double> fastest_alternated(benchmark::State& state, KernelCase& a, KernelCase& b) {
  const AlternatedTimes t = alternated(state, a, b);
  return {*std::min_element(t.a.begin(), t.a.end()), *std::min_element(t.b.begin(), t.b.end())};
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

/// Args: causal. Soft-capped scores (cap 50) against the same forward without a cap: D 128, 4096
/// tokens, 4 heads, one thread. ratio is the fastest capped call over the fastest plain one,
/// ratio_median the medians' (target <= 1.25: the cap is one vector tanh per score).
void BM_cpu_flash_softcap(benchmark::State& state) {
  const bool causal = state.range(0) != 0;
  KernelCase capped(4096, 128, causal, 4), plain(4096, 128, causal, 4);
  capped.params.softcap = 50;
  const AlternatedTimes t = alternated(state, capped, plain);
  const double best_c = *std::min_element(t.a.begin(), t.a.end()), best_p = *std::min_element(t.b.begin(), t.b.end());
  state.counters["capped_ms"] = best_c * 1e3;
  state.counters["plain_ms"] = best_p * 1e3;
  state.counters["ratio"] = best_c / best_p;
  state.counters["ratio_median"] = median(t.a) / median(t.b);
  state.counters["GFLOPs"] = capped.flops() * 1e-9 / best_c;
}

/// Args: causal. MLA's prefill dims, D 192 / D_v 128, against D 128 / D_v 128: 4096 tokens, 4
/// heads, one thread, FLOPs 2 S^2 (D + D_v) per head (halved for causal). ratio is the GFLOP/s
/// of the first over the second (fastest calls), ratio_median the same of the medians (target
/// >= 0.95: the wider Q and K cost what their FLOPs say).
void BM_cpu_flash_value_dim(benchmark::State& state) {
  const bool causal = state.range(0) != 0;
  KernelCase mla(4096, 192, causal, 4, 128), square(4096, 128, causal, 4);
  const AlternatedTimes t = alternated(state, mla, square);
  const double best_m = *std::min_element(t.a.begin(), t.a.end()), best_s = *std::min_element(t.b.begin(), t.b.end());
  state.counters["GFLOPs"] = mla.flops() * 1e-9 / best_m;
  state.counters["GFLOPs_128"] = square.flops() * 1e-9 / best_s;
  state.counters["ratio"] = (mla.flops() / best_m) / (square.flops() / best_s);
  state.counters["ratio_median"] = (mla.flops() / median(t.a)) / (square.flops() / median(t.b));
}

/// Args: new tokens T, query heads H. One decode step of MLA's shape on one thread: T x H
/// queries of D 576 against an 8192-token latent cache of one K/V head (MQA), V its rows' first
/// 512 columns (D_v), each row limited to its own keys (row_key_end), through the decode path
/// (H x T rows above 512 are split over tasks by query heads). GFLOPs = 2 (D + D_v) per visible
/// (row, key) pair per second.
void BM_cpu_flash_mla_decode(benchmark::State& state) {
  constexpr std::int64_t keys = 8192, D = 576, Dv = 512;
  const std::int64_t T = state.range(0), H = state.range(1);
  const auto q = random_values<float>(std::size_t(T * H * D), 1);
  const auto cache = random_values<float>(std::size_t(keys * D), 2);
  std::vector<float> out(std::size_t(T * H * Dv)), lse(std::size_t(T * H));
  std::vector<std::int64_t> ends(static_cast<std::size_t>(T));
  double pairs = 0;
  for (std::int64_t t = 0; t < T; ++t) pairs += double(H * (ends[static_cast<std::size_t>(t)] = keys - T + t + 1));
  KernelParams p;
  p.scale = 1.0 / std::sqrt(double(D));
  p.q_positions = PositionMap::run(T, 0);
  p.k_positions = PositionMap::run(keys, 0);
  p.group_size = H;
  p.mask.row_key_end = ends.data();
  p.mask.row_stride = T;
  using CV = TensorView<const float>;
  CV v = CV::bshd(cache.data(), 1, keys, 1, D);
  v.extent[3] = Dv;
  CpuFlashKernel kernel;
  auto call = [&] {
    kernel.forward(CV::bshd(q.data(), 1, T, H, D), CV::bshd(cache.data(), 1, keys, 1, D), v,
                   TensorView<float>::bshd(out.data(), 1, T, H, Dv),
                   TensorView<float>::bshd(lse.data(), 1, T, H, 1), p);
  };
  call();  // warm-up: scratch, pages
  double best = 1e30;
  for (auto _ : state) {
    const double t0 = thread_cpu_seconds();
    call();
    benchmark::ClobberMemory();
    best = std::min(best, thread_cpu_seconds() - t0);
  }
  state.counters["ms_per_call"] = best * 1e3;
  state.counters["GFLOPs"] = 2.0 * double(D + Dv) * pairs * 1e-9 / best;
  state.SetLabel(cpu_isa_name(kernel.isa()));
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
    ->ArgNames({"D", "seq", "causal", "bf16"})
    ->ArgsProduct({{64, 128}, {2048}, {0, 1}, {0, 1}})
    ->UseRealTime()
    ->MinTime(1.0)
    ->Unit(benchmark::kMillisecond);
// S 8192: a call of each takes 0.1-2.5 s, so a fixed two (the faster is reported).
BENCHMARK(BM_cpu_flash_backward)
    ->ArgNames({"D", "seq", "causal", "bf16"})
    ->ArgsProduct({{64, 128}, {8192}, {0, 1}, {0, 1}})
    ->UseRealTime()
    ->Iterations(2)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cpu_flash_bf16)
    ->ArgNames({"D", "seq", "causal"})
    ->ArgsProduct({{64, 128}, {4096}, {0, 1}})
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cpu_flash_documents)->ArgName("D")->Arg(64)->Arg(128)->MinTime(1.0)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cpu_flash_window)
    ->ArgNames({"D", "window"})
    ->ArgsProduct({{64, 128}, {512}})
    ->MinTime(3.0)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cpu_flash_softcap)->ArgName("causal")->Arg(0)->Arg(1)->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cpu_flash_value_dim)->ArgName("causal")->Arg(0)->Arg(1)->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cpu_flash_mla_decode)
    ->ArgNames({"T", "H"})
    ->ArgsProduct({{1, 16}, {16, 128}})
    ->MinTime(0.5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cpu_flash_scaling)
    ->ArgNames({"D", "seq", "causal", "threads"})
    ->ArgsProduct({{128}, {4096, 8192}, {0, 1}, {2}})
    ->UseRealTime()
    ->MinTime(2.0)
    ->Unit(benchmark::kMillisecond);

}  // namespace
