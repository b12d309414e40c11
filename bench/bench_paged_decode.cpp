// Decode over an engine-owned paged pool (PagedDecode) against the dense shard, one thread,
// f32, 32K cached tokens per rank, T = 1, GQA 32/8, D 128, pages of 16 tokens:
//  - P = 1: per round, alternating which goes first, one call each of the kernel on the dense
//    shard, the kernel on the pool with its pages shuffled and in pool order, the whole paged
//    step (PagedDecode::step: batch checks, exchange and merge around the kernel) and a
//    one-thread memcpy of the same K/V bytes (the machine's copy bandwidth in the same run,
//    as bytes copied per second and as STREAM's read plus written);
//    counters are medians over the rounds of each time and of the per-round ratios;
//  - P = 2, 4 (thread ranks, 32K tokens each): the step's bytes against the plan's and the
//    analytic count (each rank sends every other rank its rows' partial O and LSE plus a tag).
// Memory (`huge`): 2 MiB pages (madvise, as an engine would ask for a pool of this size) for
// the pool and the dense shard alike, or the allocator's 4 KiB pages. With 4 KiB pages a
// shuffled pool pays more page walks than a shard read in order (each 64 KiB page of the pool
// lands somewhere else), which is the memory's cost, not the kernel's.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <vector>

#if __has_include(<sys/mman.h>)
#include <sys/mman.h>
#endif

#include "bench_common.hpp"
#include "seqpar/seqpar.hpp"

using namespace seqpar;
using seqpar::bench::RankTeam;

namespace {

constexpr std::int64_t tokens_per_rank = 32768, H = 32, K = 8, D = 128, page = 16;

/// Floats in memory aligned to 2 MiB, asking the kernel for transparent huge pages when
/// `huge` (the same allocation either way, so both sides differ only in the page size).
class Buffer {
 public:
  Buffer() = default;
  Buffer(std::size_t n, bool huge) : n_(n) {
    constexpr std::size_t align = std::size_t{2} << 20;
    const std::size_t bytes = (n * sizeof(float) + align - 1) / align * align;
    data_.reset(static_cast<float*>(std::aligned_alloc(align, bytes)));
    if (!data_) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    (void)madvise(data_.get(), bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
#endif
  }
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  std::size_t size() const { return n_; }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
  std::size_t n_ = 0;
};

/// A Buffer of n random values.
Buffer random_buffer(std::size_t n, bool huge, std::uint64_t seed) {
  Buffer b(n, huge);
  const std::vector<float> v = bench::random_values<float>(n, seed);
  std::copy(v.begin(), v.end(), b.data());
  return b;
}

/// What a round times, by RankTeam's `which`.
enum Variant { dense_kernel, paged_kernel, in_order_kernel, paged_step, kv_copy, variants };

/// Rank 0's figures.
struct PagedReport {
  std::uint64_t bytes = 0, plan_bytes = 0;
};

/// One rank: its pool (2048 pages), the block tables of its one sequence (shuffled and in
/// order), a dense shard of the same size, the paged decoder and the step's buffers.
struct PagedRank {
  PagedDecode<ThreadCommunicator, CpuFlashKernel> dec;
  PagedDecodePlan plan;
  Buffer pool_k, pool_v, dense_k, dense_v, copy_to;
  std::vector<float> q, out, lse;
  std::vector<std::int32_t> shuffled, in_order, indptr{0, static_cast<std::int32_t>(tokens_per_rank / page)};
  std::vector<std::int64_t> ids{1}, kv_len, new_tokens{1}, begin{0, 1}, key_end{tokens_per_rank};
  std::vector<std::byte> ws;
  KernelParams params;

  PagedRank(ThreadCommunicator& c, bool huge) : dec(c, CpuFlashKernel(CpuFlashOptions{.threads = 1})) {
    const int P = c.size();
    // Pages round-robin over the ranks (vLLM's interleave = page size): each rank holds 32K
    // of the sequence's P x 32K tokens, the last one (the step's new token) on the last rank.
    plan = dec.plan({.max_batch = 1, .heads = H, .kv_heads = K, .head_dim = D, .interleave = page});
    kv_len = {tokens_per_rank * P - 1};
    const auto n = static_cast<std::size_t>(tokens_per_rank * K * D);
    pool_k = random_buffer(n, huge, 1 + 4 * static_cast<std::uint64_t>(c.rank()));
    pool_v = random_buffer(n, huge, 2 + 4 * static_cast<std::uint64_t>(c.rank()));
    if (P == 1) {
      dense_k = random_buffer(n, huge, 1);
      dense_v = random_buffer(n, huge, 2);
      copy_to = Buffer(2 * n, huge);
    }
    in_order.resize(static_cast<std::size_t>(tokens_per_rank / page));
    std::iota(in_order.begin(), in_order.end(), 0);
    shuffled = in_order;
    std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937_64(7));
    q = bench::random_values<float>(static_cast<std::size_t>(H * D), 3);
    out.resize(q.size());
    lse.resize(static_cast<std::size_t>(H));
    ws.resize(plan.workspace_bytes());
    params.scale = 1.0 / std::sqrt(double(D));
    params.group_size = H / K;
    params.q_positions = PositionMap::run(1, 0);
    params.k_positions = PositionMap::run(tokens_per_rank, 0);
    params.mask.row_key_end = key_end.data();
    params.mask.row_stride = 1;
  }

  PagedKV<float> cache(const std::vector<std::int32_t>& table) const {
    using CV = TensorView<const float>;
    return {CV::bshd(pool_k.data(), tokens_per_rank / page, page, K, D),
            CV::bshd(pool_v.data(), tokens_per_rank / page, page, K, D), BlockTable::csr(indptr, table)};
  }

  void run(int which) {
    using CV = TensorView<const float>;
    const auto qv = CV::bshd(q.data(), 1, 1, H, D);
    const auto ov = TensorView<float>::bshd(out.data(), 1, 1, H, D);
    const auto lv = TensorView<float>::bshd(lse.data(), 1, 1, H, 1);
    switch (which) {
      case dense_kernel:
        dec.kernel().forward(qv, CV::bshd(dense_k.data(), 1, tokens_per_rank, K, D),
                             CV::bshd(dense_v.data(), 1, tokens_per_rank, K, D), ov, lv, params);
        break;
      case paged_kernel:
      case in_order_kernel:
        dec.kernel().forward_paged(qv, cache(which == paged_kernel ? shuffled : in_order),
                                   PagedRows{1, begin.data(), key_end.data()}, ov, lv, params);
        break;
      case paged_step: {
        const PagedKV<float> c = cache(shuffled);
        dec.step<float>(plan, {ids, kv_len, new_tokens, {}, c.table}, qv, c.k_pool, c.v_pool, ov, ws);
        break;
      }
      case kv_copy:
        std::memcpy(copy_to.data(), dense_k.data(), dense_k.size() * sizeof(float));
        std::memcpy(copy_to.data() + dense_k.size(), dense_v.data(), dense_v.size() * sizeof(float));
        break;
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(copy_to.data());
  }
};

/// Args: ranks P, huge pages. See the file comment.
void BM_paged_decode(benchmark::State& state) {
  const int P = static_cast<int>(state.range(0));
  const bool huge = state.range(1) != 0;
  PagedReport report;
  RankTeam team(P, [&report, huge](ThreadCommunicator& c) -> RankTeam::Step {
    auto rank = std::make_shared<PagedRank>(c, huge);
    if (c.rank() == 0) report.plan_bytes = rank->plan.step_bytes(1);
    return [rank, &c, &report](int which) {
      const std::uint64_t before = c.stats().bytes_sent;
      rank->run(which);
      if (which == paged_step && c.rank() == 0) report.bytes = c.stats().bytes_sent - before;
    };
  });
  const std::vector<int> order = P == 1 ? std::vector<int>{dense_kernel, paged_kernel, in_order_kernel, paged_step, kv_copy}
                                        : std::vector<int>{paged_step};
  for (int w : order) team.time_step(w);  // warm-up: scratch, pages of memory
  const int rounds = P == 1 ? 15 : 5;
  std::vector<std::vector<double>> t(variants);
  std::vector<double> paged_ratio, in_order_ratio, outside;
  for (auto _ : state) {
    double total = 0;
    for (int r = 0; r < rounds; ++r) {
      double s[variants] = {};
      for (std::size_t i = 0; i < order.size(); ++i) {  // each round starts one later: no side always first
        const int w = order[(i + static_cast<std::size_t>(r)) % order.size()];
        total += s[w] = team.time_step(w);
        t[static_cast<std::size_t>(w)].push_back(s[w]);
      }
      if (P == 1) {
        paged_ratio.push_back(s[paged_kernel] / s[dense_kernel]);
        in_order_ratio.push_back(s[in_order_kernel] / s[dense_kernel]);
        outside.push_back((s[paged_step] - s[paged_kernel]) / s[paged_step]);
      }
    }
    state.SetIterationTime(total);
  }
  const double kv_bytes = 2.0 * double(tokens_per_rank * K * D) * sizeof(float);
  const double analytic = double(P - 1) * (double(H * (D + 1)) * sizeof(float) + 8);  // one row, f32 partials
  state.counters["ms_step"] = bench::median(t[paged_step]) * 1e3;
  state.counters["bytes_per_step"] = double(report.bytes);
  state.counters["bytes_plan"] = double(report.plan_bytes);
  state.counters["bytes_analytic"] = analytic;
  if (P == 1) {
    const double paged = bench::median(t[paged_kernel]), copy = bench::median(t[kv_copy]);
    state.counters["ms_dense"] = bench::median(t[dense_kernel]) * 1e3;
    state.counters["ms_paged"] = paged * 1e3;
    state.counters["ms_in_order"] = bench::median(t[in_order_kernel]) * 1e3;
    state.counters["paged_over_dense"] = bench::median(paged_ratio);
    state.counters["in_order_over_dense"] = bench::median(in_order_ratio);
    state.counters["outside_kernel_pct"] = 100 * bench::median(outside);
    state.counters["kv_GBs"] = kv_bytes * 1e-9 / paged;
    // The copy's bandwidth both ways: bytes copied (= read) per second, which compares like
    // with like, and read plus written (STREAM's convention for copy, BM_memory_copy's GBps).
    state.counters["copy_GBs"] = kv_bytes * 1e-9 / copy;
    state.counters["copy_GBs_stream"] = 2 * kv_bytes * 1e-9 / copy;
    state.counters["kv_over_copy"] = copy / paged;
    state.counters["kv_over_copy_stream"] = copy / paged / 2;
  }
}

}  // namespace

BENCHMARK(BM_paged_decode)->ArgNames({"P", "huge"})->Args({1, 1})->Args({1, 0})->Args({2, 1})->Args({4, 1})->UseManualTime()
    ->Iterations(1)->Unit(benchmark::kMillisecond);
