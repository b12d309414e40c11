#pragma once
/// \file
/// One rank's --serve run of seqpar_demo: a simulated serving engine over PagedDecode. The
/// workload (requests, their lengths, arrivals, batches, speculative verifications and how
/// many of their tokens are accepted) is fixed in advance from the options, the same on every
/// rank (make_schedule), so ranks agree on every batch without communicating. Each rank owns a
/// page pool with a free list; the simulated model's Q/K/V rows are a hash of (seed, request,
/// position, the step that wrote them), so any rank can regenerate any row for the reference.

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.hpp"
#include "decode_handoff.hpp"
#include "decode_run.hpp"
#include "report.hpp"

namespace seqpar_demo {

/// splitmix64's finaliser: every input bit reaches every output bit.
inline std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// A row of the simulated model's output: Q, K or V of request `id` at position `pos`, as the
/// step `version` wrote it (a speculated token that was rejected is written again, differently).
inline std::uint64_t row_key(std::uint64_t seed, char tensor, std::int64_t id, std::int64_t pos, std::int64_t version) {
  std::uint64_t h = seed;
  for (const std::uint64_t x : {static_cast<std::uint64_t>(tensor), static_cast<std::uint64_t>(id),
                                static_cast<std::uint64_t>(pos), static_cast<std::uint64_t>(version)})
    h = splitmix(h ^ x);
  return h;
}

/// Fills `n` elements of the row of `key` with values uniform in [-1, 1), rounded to T first
/// so that the pool (T) and the reference (double) hold the same numbers.
template <class T, class Out>
void fill_row(Out* row, std::int64_t n, std::uint64_t key) {
  for (std::int64_t i = 0; i < n; ++i) {
    const double u = static_cast<double>(splitmix(key + static_cast<std::uint64_t>(i)) >> 11) * 0x1p-52 - 1.0;
    row[i] = static_cast<Out>(static_cast<T>(u));
  }
}

/// Appends the row of `key` (`n` elements, rounded to T) to a global input tensor.
template <class T>
void append_row(std::vector<double>& to, std::int64_t n, std::uint64_t key) {
  to.resize(to.size() + static_cast<std::size_t>(n));
  fill_row<T>(to.data() + to.size() - n, n, key);
}

/// A request of the workload: its engine id, prompt tokens and tokens to generate.
struct ServeRequest {
  std::int64_t id = 0;      ///< the id the batches give PagedDecode
  std::int64_t prompt = 0;  ///< prompt tokens (also the contiguous placement's split)
  std::int64_t gen = 0;     ///< tokens it generates before it leaves
};

/// A sequence of a decode step: request index, tokens cached before the step, new tokens T_b
/// (0: it sits out; 4: it verifies speculated tokens) and how many of them the engine keeps.
struct ServeEntry {
  std::int64_t req = 0;       ///< index into ServeSchedule::requests
  std::int64_t kv_len = 0;    ///< tokens cached before the step
  std::int64_t t = 0;         ///< new tokens T_b
  std::int64_t accepted = 0;  ///< of those, the tokens the sequence keeps
};

/// One engine step: the requests admitted (prefilled) before it, its batch, and the requests
/// that finish with it (their pages are freed after it).
struct ServeStep {
  std::vector<std::int64_t> admitted;  ///< requests prefilled before the step
  std::vector<std::int64_t> finished;  ///< requests that leave after it
  std::vector<ServeEntry> batch;       ///< the decode batch, oldest request first
  std::int64_t rows = 0;               ///< sum of T_b
};

/// The whole workload, the same on every rank, with the pages each rank's pool needs at its
/// peak (so the pool is sized before the run, and a too small --pool-pages fails on every
/// rank alike) and the counts the report shows.
struct ServeSchedule {
  std::vector<ServeRequest> requests;    ///< in arrival order
  std::vector<ServeStep> steps;          ///< until every request has left
  std::vector<std::int64_t> peak_pages;  ///< per rank: most pages held at once
  std::int64_t generated = 0;            ///< tokens accepted over the run
  std::int64_t verifies = 0;             ///< entries with T_b = 4
  std::int64_t sit_outs = 0;             ///< entries with T_b = 0
  std::int64_t waits = 0;                ///< running sequences left out of a step's batch, summed over steps
};

/// Plays the engine's scheduler over the whole workload: --arrive requests admitted per step,
/// the oldest --max-batch running ones in each step's batch (the rest wait), a sequence's
/// every --spec-every-th step a verification of 4 tokens of which 1-4 (a hash) are accepted.
inline ServeSchedule make_schedule(const Options& o, const TokenPlacement& place) {
  ServeSchedule sch;
  auto draw = [&](char what, std::int64_t i, const std::vector<std::int64_t>& range) {
    return range[0] + static_cast<std::int64_t>(row_key(o.seed, what, i, 0, 0) %
                                                static_cast<std::uint64_t>(range[1] - range[0] + 1));
  };
  for (std::int64_t i = 0; i < o.requests; ++i)
    sch.requests.push_back({i, draw('p', i, o.prompt_len), draw('g', i, o.gen_len)});
  const auto n = static_cast<std::size_t>(o.requests);
  std::vector<std::int64_t> done(n), decoded(n), high(n);  // generated, steps with tokens, positions written
  std::vector<std::int64_t> running;                                 // admission order
  sch.peak_pages.assign(static_cast<std::size_t>(place.ranks), 0);
  for (std::int64_t s = 0, next = 0; next < o.requests || !running.empty(); ++s) {
    ServeStep st;
    for (; next < o.requests && static_cast<std::int64_t>(st.admitted.size()) < o.arrive; ++next) {
      st.admitted.push_back(next);
      running.push_back(next);
      high[static_cast<std::size_t>(next)] = sch.requests[static_cast<std::size_t>(next)].prompt;
    }
    const std::size_t in_batch = std::min<std::size_t>(running.size(), static_cast<std::size_t>(o.max_batch));
    sch.waits += static_cast<std::int64_t>(running.size() - in_batch);
    for (std::size_t b = 0; b < in_batch; ++b) {
      const auto i = static_cast<std::size_t>(running[b]);
      const ServeRequest& r = sch.requests[i];
      ServeEntry e{running[b], r.prompt + done[i], 1, 1};
      if (std::find(st.admitted.begin(), st.admitted.end(), running[b]) != st.admitted.end()) {
        e.t = e.accepted = 0;  // prefilled this step: its first token comes in the next
        ++sch.sit_outs;
      } else if (o.spec_every > 0 && (decoded[i] + r.id) % o.spec_every == o.spec_every - 1) {
        // Offset by the id: sequences admitted together verify in different steps, so that
        // batches mix T_b = 1 and 4.
        e.t = 4;
        const auto kept = static_cast<std::int64_t>(row_key(o.seed, 'a', r.id, s, 0) % 4) + 1;
        e.accepted = std::min(kept, r.gen - done[i]);
        ++sch.verifies;
      }
      decoded[i] += e.t > 0;
      high[i] = std::max(high[i], e.kv_len + e.t);
      done[i] += e.accepted;
      sch.generated += e.accepted;
      st.rows += e.t;
      if (done[i] == r.gen) st.finished.push_back(e.req);
      st.batch.push_back(e);
    }
    for (int rank = 0; rank < place.ranks; ++rank) {  // pages held after this step's allocations
      std::int64_t pages = 0;
      for (const std::int64_t i : running) {
        const ServeRequest& r = sch.requests[static_cast<std::size_t>(i)];
        pages += (place.count(rank, high[static_cast<std::size_t>(i)], r.prompt) + o.page - 1) / o.page;
      }
      sch.peak_pages[static_cast<std::size_t>(rank)] = std::max(sch.peak_pages[static_cast<std::size_t>(rank)], pages);
    }
    for (const std::int64_t i : st.finished) running.erase(std::find(running.begin(), running.end(), i));
    sch.steps.push_back(std::move(st));
  }
  return sch;
}

/// One rank's page pools for K and V ([pages, page, K, D] each) with a free list. Free pages
/// hold NaN, so a step that read a row it may not see would produce NaN and fail --check;
/// freed pages are reused last-freed first, as engines' allocators do, so ids come in no order.
template <class T>
class PagePool {
 public:
  /// `pages` pages of `page` tokens of `row` elements (K x D), for `requests` requests.
  PagePool(std::int64_t pages, std::int64_t page, std::int64_t row, std::int64_t requests)
      : pages_(pages), page_(page), row_(row), k_(static_cast<std::size_t>(pages * page * row), nan),
        v_(k_.size(), nan), freed_(static_cast<std::size_t>(pages), false), owned_(static_cast<std::size_t>(requests)) {
    for (std::int64_t p = pages; p-- > 0;) free_.push_back(static_cast<std::int32_t>(p));
  }
  /// Takes pages off the free list until request `req`'s local slots [0, slots) have rows.
  void reserve(std::int64_t req, std::int64_t slots) {
    std::vector<std::int32_t>& mine = owned_[static_cast<std::size_t>(req)];
    while (static_cast<std::int64_t>(mine.size()) * page_ < slots) {
      if (free_.empty())  // make_schedule sized the pool for the workload's peak
        throw std::logic_error("serve: page pool exhausted: the schedule's page count is wrong");
      mine.push_back(free_.back());
      reused_ += freed_[static_cast<std::size_t>(free_.back())];
      free_.pop_back();
    }
    peak_ = std::max(peak_, pages_ - static_cast<std::int64_t>(free_.size()));
  }
  /// Frees request `req`'s pages (NaN written into them).
  void release(std::int64_t req) {
    for (const std::int32_t p : owned_[static_cast<std::size_t>(req)]) {
      std::fill_n(&k_[static_cast<std::size_t>(p * page_ * row_)], page_ * row_, nan);
      std::fill_n(&v_[static_cast<std::size_t>(p * page_ * row_)], page_ * row_, nan);
      free_.push_back(p);
      freed_[static_cast<std::size_t>(p)] = true;
    }
    owned_[static_cast<std::size_t>(req)].clear();
  }
  /// K row of request `req`'s local slot `slot` (its page reserved).
  T* k_slot(std::int64_t req, std::int64_t slot) { return &k_[offset(req, slot)]; }
  /// V row of the same slot.
  T* v_slot(std::int64_t req, std::int64_t slot) { return &v_[offset(req, slot)]; }
  /// The pools as PagedDecode::step reads them ([pages, page, K, D]).
  TensorView<const T> k_view(std::int64_t K, std::int64_t D) const {
    return TensorView<const T>::bshd(k_.data(), pages_, page_, K, D);
  }
  /// The V pool.
  TensorView<const T> v_view(std::int64_t K, std::int64_t D) const {
    return TensorView<const T>::bshd(v_.data(), pages_, page_, K, D);
  }
  /// Most pages in use at once so far.
  std::int64_t peak() const { return peak_; }
  /// Pages taken again after a request freed them.
  std::int64_t reused() const { return reused_; }

  /// The batch's block table on this rank: FlashInfer's CSR, or vLLM's dense rows padded with
  /// -1 (`dense`); `indptr` and `indices` hold it (reused from step to step).
  BlockTable table(const std::vector<ServeEntry>& batch, bool dense, std::vector<std::int32_t>& indptr,
                   std::vector<std::int32_t>& indices) const {
    std::size_t widest = 1;
    for (const ServeEntry& e : batch) widest = std::max(widest, owned_[static_cast<std::size_t>(e.req)].size());
    indptr.assign(1, 0);
    indices.clear();
    for (const ServeEntry& e : batch) {
      const std::vector<std::int32_t>& mine = owned_[static_cast<std::size_t>(e.req)];
      indices.insert(indices.end(), mine.begin(), mine.end());
      if (dense) indices.resize(indptr.size() * widest, -1);
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
    }
    return dense ? BlockTable::dense(indices, static_cast<std::int64_t>(widest)) : BlockTable::csr(indptr, indices);
  }

 private:
  static constexpr T nan = std::numeric_limits<T>::quiet_NaN();
  std::size_t offset(std::int64_t req, std::int64_t slot) const {
    const std::int64_t page = owned_[static_cast<std::size_t>(req)][static_cast<std::size_t>(slot / page_)];
    return static_cast<std::size_t>((page * page_ + slot % page_) * row_);
  }

  std::int64_t pages_, page_, row_, peak_ = 0, reused_ = 0;
  std::vector<T> k_, v_;
  std::vector<std::int32_t> free_;                // a stack
  std::vector<bool> freed_;                       // per page: freed at least once
  std::vector<std::vector<std::int32_t>> owned_;  // per request, in local-slot order
};

/// The error of one sequence's rows of a step (`out`, `q`: its T_b rows, all heads) against
/// attention in double over its K/V at positions [0, kv_len + T_b), regenerated from the
/// versions that wrote them.
template <class T>
ex::ErrorStats check_entry(const Options& o, const ServeRequest& r, const ServeEntry& e,
                           const std::vector<std::int64_t>& version, const T* q, const T* out) {
  const std::int64_t H = o.heads, K = o.kv_heads ? o.kv_heads : H, D = o.head_dim, n = e.kv_len + e.t;
  std::vector<double> k(static_cast<std::size_t>(n * K * D)), v(k.size()), qd(q, q + e.t * H * D),
      want(static_cast<std::size_t>(e.t * H * D));
  for (std::int64_t pos = 0; pos < n; ++pos) {
    const std::int64_t written = version[static_cast<std::size_t>(pos)];
    fill_row<T>(&k[static_cast<std::size_t>(pos * K * D)], K * D, row_key(o.seed, 'k', r.id, pos, written));
    fill_row<T>(&v[static_cast<std::size_t>(pos * K * D)], K * D, row_key(o.seed, 'v', r.id, pos, written));
  }
  const ex::GlobalShape shape = ex::make_case(e.t, H, K, D, true, o.seed);
  const MaskTables tables = shape.mask_tables();
  using CV = TensorView<const double>;
  ReferenceKernel{}.forward(CV::bshd(qd.data(), 1, e.t, H, D), CV::bshd(k.data(), 1, n, K, D), CV::bshd(v.data(), 1, n, K, D),
                            TensorView<double>::bshd(want.data(), 1, e.t, H, D), TensorView<double>{},
                            ex::reference_params(shape, tables, PositionMap::run(e.t, e.kv_len), PositionMap::run(n, 0)));
  ex::ErrorStats err;
  for (std::size_t i = 0; i < want.size(); ++i) err.add_out(static_cast<double>(out[i]), want[i]);
  return err;
}

/// The p-th percentile (nearest rank) of `x` (not empty).
inline double percentile(std::vector<double> x, double p) {
  std::sort(x.begin(), x.end());
  const auto rank = static_cast<std::size_t>(std::ceil(p / 100.0 * static_cast<double>(x.size())));
  return x[std::min(x.size() - 1, rank > 0 ? rank - 1 : 0)];
}

/// Rank 0's report of a --serve run; `rows`: every rank's figures as serve_rank gathers them
/// (peak and reused pages, prefill ms and bytes, hand-off bytes, decode bytes, whether every step sent the
/// plan's bytes, then each decode step's ms). Returns whether the checks and the bytes passed.
inline bool report_serve(const Options& o, const ServeSchedule& sch, const std::vector<std::vector<std::int64_t>>& rows,
                         const ex::ErrorStats& err, const ex::ErrorStats& pre_err, const PagedDecodePlan& plan,
                         std::int64_t pool_pages) {
  enum { peak, reused, pre_ms, pre_bytes, handoff, bytes, match, times };
  const int world = static_cast<int>(rows.size());
  const std::size_t steps = rows[0].size() - times;
  std::vector<double> ms(steps, 0.0);  // a step lasts as long as its slowest rank
  double prefill_ms = 0, pages_sum = 0;
  std::int64_t pages_max = 0, prompt_tokens = 0;
  std::uint64_t bytes_max = 0;
  bool bytes_ok = true;
  for (const auto& r : rows) {
    for (std::size_t i = 0; i < steps; ++i) ms[i] = std::max(ms[i], std::bit_cast<double>(r[times + i]));
    prefill_ms = std::max(prefill_ms, std::bit_cast<double>(r[pre_ms]));
    pages_max = std::max(pages_max, r[peak]);
    pages_sum += static_cast<double>(r[peak]);
    bytes_max = std::max(bytes_max, static_cast<std::uint64_t>(r[bytes]) / steps);
    bytes_ok = bytes_ok && r[match] != 0;
  }
  for (const ServeRequest& r : sch.requests) prompt_tokens += r.prompt;
  double decode_ms = 0;
  for (const double x : ms) decode_ms += x;
  const double tokens_per_s = static_cast<double>(sch.generated) / decode_ms * 1e3, p50 = percentile(ms, 50),
               p99 = percentile(ms, 99), balance = static_cast<double>(pages_max) / (pages_sum / world);
  std::printf("seqpar_demo  serve: continuous batching over a paged KV pool per rank (PagedDecode), prefill with %s  "
              "comm=%s  ranks=%d\n", policy_type_name(o).c_str(), o.comm.c_str(), world);
  std::printf("workload     %lld requests, prompts of %lld..%lld tokens (%lld in all), generating %lld..%lld (%lld in all); "
              "%lld admitted per step, batches of at most %lld\n", static_cast<long long>(o.requests),
              static_cast<long long>(o.prompt_len[0]), static_cast<long long>(o.prompt_len[1]),
              static_cast<long long>(prompt_tokens), static_cast<long long>(o.gen_len[0]),
              static_cast<long long>(o.gen_len[1]), static_cast<long long>(sch.generated),
              static_cast<long long>(o.arrive), static_cast<long long>(o.max_batch));
  std::printf("problem      heads=%lld kv_heads=%lld head_dim=%lld dtype=%s placement=%s pages of %lld tokens, %lld per "
              "rank's pool\n", static_cast<long long>(o.heads), static_cast<long long>(o.kv_heads ? o.kv_heads : o.heads),
              static_cast<long long>(o.head_dim), dtype_name(o.dtype),
              o.interleave > 0 ? ("runs of " + std::to_string(o.interleave) + " round-robin").c_str() : "contiguous",
              static_cast<long long>(o.page), static_cast<long long>(pool_pages));
  print_kernel(o);
  std::printf("schedule     %zu steps, %zu with decode rows: %lld verifications of 4 speculated tokens (--spec-every "
              "%lld), %lld sequences sitting out their admission step, %lld waits for a batch slot; block tables CSR "
              "and dense by turns\n", sch.steps.size(), steps, static_cast<long long>(sch.verifies),
              static_cast<long long>(o.spec_every), static_cast<long long>(sch.sit_outs), static_cast<long long>(sch.waits));
  std::printf("%6s %10s %12s %12s %14s %14s %12s\n", "rank", "peak_pages", "pages_reused", "prefill_ms", "prefill_bytes",
              "handoff_bytes", "bytes/step");
  for (int w = 0; w < world; ++w) {
    const auto& r = rows[static_cast<std::size_t>(w)];
    std::printf("%6d %10lld %12lld %12.3f %14lld %14lld %12lld\n", w, static_cast<long long>(r[peak]),
                static_cast<long long>(r[reused]),
                std::bit_cast<double>(r[pre_ms]), static_cast<long long>(r[pre_bytes]),
                static_cast<long long>(r[handoff]), static_cast<long long>(r[bytes] / static_cast<std::int64_t>(steps)));
  }
  std::printf("throughput   %lld tokens in %.3f ms of decode steps: %.1f tokens/s; step latency p50 %.3f ms, p99 %.3f ms "
              "(PagedDecode::step, the slowest rank); prefill %.3f ms in all\n", static_cast<long long>(sch.generated),
              decode_ms, tokens_per_s, p50, p99, prefill_ms);
  std::printf("balance      peak pages per rank max/mean = %.2f\n", balance);
  std::int64_t most_rows = 0;
  for (const ServeStep& st : sch.steps) most_rows = std::max(most_rows, st.rows);
  std::printf("traffic      bytes sent at every step %s plan.step_bytes(rows) on every rank (%zu for 1 row, %zu for "
              "the largest step's %lld)\n", bytes_ok ? "equal" : "DIFFER FROM", plan.step_bytes(1),
              plan.step_bytes(most_rows), static_cast<long long>(most_rows));
  const double tol = o.dtype == DType::f64 ? 1e-12 : 1e-4;
  bool ok = bytes_ok;
  if (o.check) {
    ok = print_check("prefill: ", pre_err, tol, "every admission, exact double reference") && ok;
    ok = print_check("decode steps: ", err, tol, "every 5th step and the last, double reference over each sequence") && ok;
  }
  char tail[512];
  std::snprintf(tail, sizeof tail,
                " cpu_isa=%s mode=serve requests=%lld generated=%lld steps=%zu tokens_per_s=%.1f p50_ms=%.3f p99_ms=%.3f "
                "prefill_ms=%.3f prefill_max_rel_err=%s page=%lld interleave=%lld spec_every=%lld max_batch=%lld "
                "pool_pages=%lld pages_peak=%lld pages_max_over_mean=%.2f dtype=%s",
                cpu_isa_name(default_cpu_isa()), static_cast<long long>(o.requests), static_cast<long long>(sch.generated),
                steps, tokens_per_s, p50, p99, prefill_ms, error_text(o.check, pre_err.rel()).c_str(),
                static_cast<long long>(o.page), static_cast<long long>(o.interleave), static_cast<long long>(o.spec_every),
                static_cast<long long>(o.max_batch), static_cast<long long>(pool_pages), static_cast<long long>(pages_max),
                balance, dtype_name(o.dtype));
  g_results.push_back(result_head(o, world, prompt_tokens, err, bytes_max, decode_ms / static_cast<double>(steps)) + tail);
  std::fflush(stdout);
  return ok;
}

/// One rank's --serve run with element type T: the schedule, the pools, then step by step the
/// admissions' prefill and hand-off, the decode step and the frees; rank 0 reports.
template <class T, class Comm>
int serve_rank(Comm& comm, const Options& o) {
  const int me = comm.rank(), world = comm.size();
  const std::int64_t H = o.heads, K = o.kv_heads ? o.kv_heads : H, D = o.head_dim;
  const ServeSchedule sch = make_schedule(o, {world, o.interleave});
  const std::int64_t peak = *std::max_element(sch.peak_pages.begin(), sch.peak_pages.end());
  if (o.pool_pages != 0 && o.pool_pages < peak)
    throw UsageError("--pool-pages: " + std::to_string(o.pool_pages) + " pages per rank are too few: the workload holds " +
                     std::to_string(peak) + " at its peak on one rank (leave --pool-pages out to size the pools so)");
  const std::int64_t pool_pages = o.pool_pages ? o.pool_pages : std::max<std::int64_t>(peak, 1);
  if (static_cast<double>(pool_pages) * static_cast<double>(o.page) * static_cast<double>(K) * static_cast<double>(D) > 1e10)
    throw UsageError("--page: pools of " + std::to_string(pool_pages) + " pages of " + std::to_string(o.page) +
                     " tokens x --kv-heads x --head-dim elements are too large for this demo (see also --pool-pages)");
  const std::int64_t max_t = o.spec_every > 0 ? 4 : 1;
  PagedDecode<Comm, CpuFlashKernel> dec(comm, make_kernel<CpuFlashKernel>(o, false));
  PagedDecodePlan plan = dec.plan({.max_batch = o.max_batch, .max_new_tokens = max_t, .heads = H, .kv_heads = K,
                                   .head_dim = D, .dtype = dtype_v<T>, .interleave = o.interleave});
  g_planned = true;
  PagePool<T> pool(pool_pages, o.page, K * D, o.requests);
  std::vector<std::vector<std::int64_t>> version(sch.requests.size());  // the step that wrote each position
  for (std::size_t i = 0; i < version.size(); ++i)  // a verify step may write 3 positions past the end
    version[i].resize(static_cast<std::size_t>(sch.requests[i].prompt + sch.requests[i].gen + 3));

  const std::int64_t max_rows = o.max_batch * max_t;
  std::vector<T> q(static_cast<std::size_t>(max_rows * H * D)), out(q.size());
  std::vector<std::byte> workspace(plan.workspace_bytes());
  std::vector<std::int64_t> ids, kv_len, new_tokens, split;
  std::vector<std::int32_t> indptr, indices;
  std::vector<double> step_ms;
  ex::ErrorStats err, pre_err;
  double pre_ms = 0;
  std::uint64_t pre_bytes = 0, handoff_bytes = 0, step_bytes = 0;
  bool bytes_match = true;
  for (std::int64_t s = 0; s < static_cast<std::int64_t>(sch.steps.size()); ++s) {
    const ServeStep& st = sch.steps[static_cast<std::size_t>(s)];
    if (!st.admitted.empty()) {  // the arrivals' prompts, packed as causal documents, in one prefill
      ex::GlobalInputs prompts;
      prompts.shape = ex::make_case(0, H, K, D, true, o.seed);
      prompts.shape.documents = {{}};
      for (const std::int64_t i : st.admitted) {
        const ServeRequest& r = sch.requests[static_cast<std::size_t>(i)];
        prompts.shape.documents.front().push_back(r.prompt);
        prompts.shape.seq_q += r.prompt;
        for (std::int64_t pos = 0; pos < r.prompt; ++pos) {
          append_row<T>(prompts.q, H * D, row_key(o.seed, 'q', r.id, pos, s));
          append_row<T>(prompts.k, K * D, row_key(o.seed, 'k', r.id, pos, s));
          append_row<T>(prompts.v, K * D, row_key(o.seed, 'v', r.id, pos, s));
        }
        std::fill_n(version[static_cast<std::size_t>(i)].begin(), r.prompt, s);
        pool.reserve(i, plan.local_tokens(r.prompt, r.prompt));
      }
      Prefilled<T> pre = prefill_rank<T>(comm, o, prompts);
      pre_ms += pre.ms;
      pre_bytes += pre.bytes;
      pre_err.merge(pre.err);
      handoff_bytes += ex::hand_off_kv<T>(comm, pre.tokens, pre.k.data(), pre.v.data(), static_cast<std::size_t>(K * D),
                                          static_cast<std::size_t>(K * D), [&](const ex::CacheToken& t) {
        const std::int64_t i = st.admitted[static_cast<std::size_t>(t.b)];
        const std::int64_t prompt = sch.requests[static_cast<std::size_t>(i)].prompt;
        const int rank = plan.owner(t.pos, prompt);
        if (rank != me) return ex::KvDestination<T>{rank};
        const std::int64_t slot = plan.slot(t.pos, prompt);
        return ex::KvDestination<T>{rank, pool.k_slot(i, slot), pool.v_slot(i, slot)};
      });
    }
    // The new tokens: Q on every rank, K/V written by their owner only, into pages it takes now.
    ids.clear();
    kv_len.clear();
    new_tokens.clear();
    split.clear();
    std::int64_t row = 0;
    for (const ServeEntry& e : st.batch) {
      const ServeRequest& r = sch.requests[static_cast<std::size_t>(e.req)];
      pool.reserve(e.req, plan.local_tokens(e.kv_len + e.t, r.prompt));
      for (std::int64_t pos = e.kv_len; pos < e.kv_len + e.t; ++pos, ++row) {
        version[static_cast<std::size_t>(e.req)][static_cast<std::size_t>(pos)] = s;
        fill_row<T>(&q[static_cast<std::size_t>(row * H * D)], H * D, row_key(o.seed, 'q', r.id, pos, s));
        if (plan.owner(pos, r.prompt) != me) continue;
        const std::int64_t slot = plan.slot(pos, r.prompt);
        fill_row<T>(pool.k_slot(e.req, slot), K * D, row_key(o.seed, 'k', r.id, pos, s));
        fill_row<T>(pool.v_slot(e.req, slot), K * D, row_key(o.seed, 'v', r.id, pos, s));
      }
      ids.push_back(r.id);
      kv_len.push_back(e.kv_len);
      new_tokens.push_back(e.t);
      split.push_back(r.prompt);
    }
    if (st.rows > 0) {  // an engine launches no step for a batch that only sits out
      const DecodeBatch batch{ids, kv_len, new_tokens, split, pool.table(st.batch, s % 2 == 1, indptr, indices)};
      comm.barrier();  // the time is the step's, not the wait for a rank's prefill or check
      const std::uint64_t before = comm.stats().bytes_sent;
      const auto t0 = std::chrono::steady_clock::now();
      dec.template step<T>(plan, batch, TensorView<const T>::bshd(q.data(), 1, max_rows, H, D), pool.k_view(K, D),
                           pool.v_view(K, D), TensorView<T>::bshd(out.data(), 1, max_rows, H, D), workspace);
      step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      const std::uint64_t sent = comm.stats().bytes_sent - before;
      step_bytes += sent;
      bytes_match = bytes_match && sent == plan.step_bytes(st.rows);
    }
    if (o.check && st.rows > 0 && (s % 5 == 0 || s + 1 == static_cast<std::int64_t>(sch.steps.size())))
      for (std::size_t b = 0, at = 0; b < st.batch.size(); at += static_cast<std::size_t>(st.batch[b].t * H * D), ++b)
        if (st.batch[b].t > 0 && static_cast<int>(b % static_cast<std::size_t>(world)) == me)  // spread over the ranks
          err.merge(check_entry<T>(o, sch.requests[static_cast<std::size_t>(st.batch[b].req)], st.batch[b],
                                   version[static_cast<std::size_t>(st.batch[b].req)], &q[at], &out[at]));
    for (const std::int64_t i : st.finished) pool.release(i);
  }
  err = ex::reduce_errors(comm, err);

  // Each step's time on every rank: a step takes as long as its slowest rank.
  std::vector<std::int64_t> mine{pool.peak(),
                                 pool.reused(),
                                 std::bit_cast<std::int64_t>(pre_ms),
                                 static_cast<std::int64_t>(pre_bytes),
                                 static_cast<std::int64_t>(handoff_bytes),
                                 static_cast<std::int64_t>(step_bytes),
                                 bytes_match};
  for (const double ms : step_ms) mine.push_back(std::bit_cast<std::int64_t>(ms));
  const auto rows = ex::gather_rows(comm, mine);
  if (me != 0) return 0;
  return report_serve(o, sch, rows, err, pre_err, plan, pool_pages) ? 0 : 1;
}

}  // namespace seqpar_demo
