// A simulated serving engine for the paged decode tests: a schedule of requests that join
// after their prefill, decode with per-sequence new tokens (0..16), and leave, fixed in
// advance from a seed so that every rank (thread or MPI process) sees the same batches; per
// rank a pool of pages with a free list (pages reused after free, NaN written into every free
// page), CSR or dense block tables; every step's rows against attention over each sequence's
// whole cache in double (attention_check.hpp's brute force), and its bytes against the plan's.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "seqpar/seqpar.hpp"
#include "support/attention_check.hpp"
#include "support/decode_check.hpp"
#include "support/rank_outcomes.hpp"

namespace seqpar::test {

/// One paged scenario: world, placement, pool page size, heads, exchange, steps, maxima,
/// table form and today's models' features.
struct PagedCase {
  int ranks;
  std::int64_t interleave;  ///< 0: contiguous (split = prompt length)
  std::int64_t page_size;   ///< tokens per page of each rank's pool
  std::int64_t heads, kv_heads;
  DecodeExchange exchange;
  int steps;
  std::int64_t max_batch = 4, max_new_tokens = 16;
  bool dense_table = false;  ///< vLLM's [num_seqs, max_blocks] instead of FlashInfer's CSR
  DecodeFeatures features{};
  std::uint64_t seed = 1;
  std::int64_t max_prompt = 120;  ///< prompts of 0..max_prompt tokens
};

/// A request of the schedule: its prompt, the tokens it will generate, and all its K/V.
struct Request {
  std::int64_t id, prompt, total;  ///< total = prompt + tokens it will add
  std::vector<float> k, v;         ///< [total, K, D], [total, K, D_v] (v_in_k: K's first D_v columns)
};

/// One step of the schedule: the batch (request indices, lengths before, new tokens) and
/// queries [rows, H, D].
struct ScheduledStep {
  std::vector<std::int64_t> req, kv_len, new_tokens;
  std::vector<float> q;
  std::int64_t rows = 0;
};

/// The whole schedule, the same on every rank.
struct Schedule {
  std::int64_t H, K, D, Dv;
  std::vector<Request> requests;
  std::vector<ScheduledStep> steps;
  std::vector<float> sinks;

  explicit Schedule(const PagedCase& c) : H(c.heads), K(c.kv_heads), D(c.features.head_dim), Dv(c.features.value_dim()) {
    std::mt19937_64 rng(c.seed * 7919 + static_cast<std::uint64_t>(c.ranks));
    std::normal_distribution<float> n(0.f, 1.f);
    std::uniform_int_distribution<std::int64_t> prompt(0, c.max_prompt), gen(1, 40), pct(0, 99);
    std::vector<std::int64_t> active, done;  // request indices; done: tokens added so far
    auto join = [&] {
      Request r{static_cast<std::int64_t>(requests.size()) * 3 + 11, prompt(rng), 0, {}, {}};
      r.total = r.prompt + gen(rng);
      r.k.resize(static_cast<std::size_t>(r.total * K * D));
      for (float& x : r.k) x = n(rng);
      r.v.resize(static_cast<std::size_t>(r.total * K * Dv));
      for (std::size_t i = 0; i < r.v.size(); ++i)
        r.v[i] = c.features.v_in_k ? r.k[i / static_cast<std::size_t>(Dv) * static_cast<std::size_t>(D) +
                                         i % static_cast<std::size_t>(Dv)]
                                   : n(rng);
      active.push_back(static_cast<std::int64_t>(requests.size()));
      done.push_back(r.prompt);
      requests.push_back(std::move(r));
    };
    std::uniform_real_distribution<float> u(0.f, 4.f);
    if (c.features.sinks)
      for (std::int64_t h = 0; h < H; ++h) sinks.push_back(u(rng));
    const std::int64_t max_rows = c.max_batch * c.max_new_tokens;
    for (int s = 0; s < c.steps; ++s) {
      // Finished requests leave; new ones join (at least one active).
      for (std::size_t i = active.size(); i-- > 0;)
        if (done[i] == requests[static_cast<std::size_t>(active[i])].total) {
          active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
          done.erase(done.begin() + static_cast<std::ptrdiff_t>(i));
        }
      while (static_cast<std::int64_t>(active.size()) < c.max_batch && (active.empty() || pct(rng) < 40)) join();
      if (pct(rng) < 30) {  // the batch's order changes too
        std::rotate(active.begin(), active.begin() + 1, active.end());
        std::rotate(done.begin(), done.begin() + 1, done.end());
      }
      ScheduledStep st;
      for (std::size_t i = 0; i < active.size(); ++i) {
        const Request& r = requests[static_cast<std::size_t>(active[i])];
        const std::int64_t left = r.total - done[i], roll = pct(rng);
        std::int64_t t = roll < 10 ? 0 : roll < 65 ? 1 : 2 + roll % (c.max_new_tokens - 1);
        t = std::min({t, left, c.max_new_tokens, max_rows - st.rows});
        st.req.push_back(active[i]);
        st.kv_len.push_back(done[i]);
        st.new_tokens.push_back(t);
        st.rows += t;
        done[i] += t;
      }
      st.q.resize(static_cast<std::size_t>(st.rows * H * D));
      for (float& x : st.q) x = n(rng);
      steps.push_back(std::move(st));
    }
  }

  /// The exact output of step s's sequence i (rows [T, H, D_v] in double).
  std::vector<double> reference(const PagedCase& c, int s, std::size_t i, std::int64_t row0) const {
    const ScheduledStep& st = steps[static_cast<std::size_t>(s)];
    const Request& r = requests[static_cast<std::size_t>(st.req[i])];
    const std::int64_t t = st.new_tokens[i], n = st.kv_len[i] + t;
    AttentionProblem pr;
    pr.batch = 1;
    pr.heads = H;
    pr.kv_heads = K;
    pr.head_dim = D;
    pr.head_dim_v = Dv;
    pr.causal = true;
    pr.causal_align = CausalAlign::bottom_right;
    pr.softcap = c.features.softcap;
    pr.sinks = sinks.empty() ? nullptr : sinks.data();
    const float* q = &st.q[static_cast<std::size_t>(row0 * H * D)];
    return brute_force_forward({pr, t, n, std::vector<double>(q, q + t * H * D),
                                std::vector<double>(r.k.begin(), r.k.begin() + n * K * D),
                                std::vector<double>(r.v.begin(), r.v.begin() + n * K * Dv)})
        .out;
  }
};

/// One rank's engine: its pool (NaN where free), free list and each request's pages here.
struct RankPool {
  std::int64_t pages, page_size, K, D, Dv;
  bool v_in_k;
  std::vector<float> k, v;                        // [pages, page_size, K, D], [.., D_v]
  std::vector<std::int32_t> free;                  // a stack: the page freed last is reused first
  std::vector<std::vector<std::int32_t>> owned;    // per request

  RankPool(const PagedCase& c, const Schedule& sch, std::int64_t n_pages)
      : pages(n_pages), page_size(c.page_size), K(sch.K), D(sch.D), Dv(sch.Dv), v_in_k(c.features.v_in_k),
        k(static_cast<std::size_t>(n_pages * c.page_size * K * D), std::numeric_limits<float>::quiet_NaN()),
        v(v_in_k ? 0 : static_cast<std::size_t>(n_pages * c.page_size * K * Dv), std::numeric_limits<float>::quiet_NaN()),
        owned(sch.requests.size()) {
    for (std::int64_t p = n_pages; p-- > 0;) free.push_back(static_cast<std::int32_t>(p));
    std::mt19937_64 rng(c.seed + 99);
    std::shuffle(free.begin(), free.end(), rng);  // pages in no particular order
  }
  TensorView<const float> k_view() const { return TensorView<const float>::bshd(k.data(), pages, page_size, K, D); }
  TensorView<const float> v_view() const {
    if (!v_in_k) return TensorView<const float>::bshd(v.data(), pages, page_size, K, Dv);
    TensorView<const float> view = k_view();  // MLA: V is the first D_v columns of K's rows
    view.extent[3] = Dv;
    return view;
  }
  /// Writes token `pos` of request r (slot `slot` here), taking a page when the slot needs one.
  void put(const Request& r, std::size_t ri, std::int64_t pos, std::int64_t slot) {
    std::vector<std::int32_t>& mine = owned[ri];
    while (static_cast<std::int64_t>(mine.size()) * page_size <= slot) {
      REQUIRE(!free.empty());
      mine.push_back(free.back());
      free.pop_back();
    }
    const std::int64_t page = mine[static_cast<std::size_t>(slot / page_size)], row = slot % page_size;
    float* kd = &k[static_cast<std::size_t>(((page * page_size + row) * K) * D)];
    std::copy_n(&r.k[static_cast<std::size_t>(pos * K * D)], K * D, kd);
    if (!v_in_k)
      std::copy_n(&r.v[static_cast<std::size_t>(pos * K * Dv)], K * Dv,
                  &v[static_cast<std::size_t>(((page * page_size + row) * K) * Dv)]);
  }
  /// Frees request r's pages here, writing NaN into them.
  void release(std::size_t ri) {
    for (std::int32_t p : owned[ri]) {
      std::fill_n(&k[static_cast<std::size_t>(p * page_size * K * D)], page_size * K * D,
                  std::numeric_limits<float>::quiet_NaN());
      if (!v_in_k)
        std::fill_n(&v[static_cast<std::size_t>(p * page_size * K * Dv)], page_size * K * Dv,
                    std::numeric_limits<float>::quiet_NaN());
      free.push_back(p);
    }
    owned[ri].clear();
  }
};

/// Runs a step on host memory: the views of the engine's buffers as they are.
struct HostStep {
  template <class Dec>
  std::int64_t operator()(Dec& dec, PagedDecodePlan& plan, const DecodeBatch& batch, const std::vector<float>& q,
                          const RankPool& pool, std::vector<float>& out, std::span<std::byte> ws) const {
    const std::int64_t rows = static_cast<std::int64_t>(q.size()) / (plan.q_heads().count * pool.D);
    return dec.template step<float>(plan, batch, TensorView<const float>::bshd(q.data(), 1, rows, plan.q_heads().count, pool.D),
                                    pool.k_view(), pool.v_view(),
                                    TensorView<float>::bshd(out.data(), 1, rows, plan.out_heads().count, pool.Dv), ws);
  }
};

/// Runs the schedule on this rank of `world` with `kernel`; returns the worst normwise error
/// of its rows. Every step's bytes must be the plan's count for its rows. `run_step` runs
/// one step on the engine's host buffers (HostStep; a device test uploads them first, an
/// allocation test counts around it).
template <class Kernel = ReferenceKernel, class Comm, class StepRunner = HostStep>
double paged_rank_error(Comm& world, const PagedCase& c, const Schedule& sch, StepRunner run_step = {},
                        DType dtype = DType::f32, Kernel kernel = {}) {
  PagedDecodeProblem pr{.max_batch = c.max_batch, .max_new_tokens = c.max_new_tokens, .heads = c.heads,
                        .kv_heads = c.kv_heads, .head_dim = sch.D, .head_dim_v = c.features.head_dim_v,
                        .softcap = c.features.softcap, .dtype = dtype, .interleave = c.interleave,
                        .exchange = c.exchange,
                        .sinks = sch.sinks.empty() ? nullptr : sch.sinks.data()};
  PagedDecode<Comm, Kernel> dec(world, std::move(kernel));
  PagedDecodePlan plan = dec.plan(pr);
  const int me = world.rank();
  std::int64_t most = 0;  // pages this rank could need at once: every request's tokens at their end
  for (const Request& r : sch.requests) most += plan.local_tokens(r.total, r.prompt) / c.page_size + 1;
  RankPool pool(c, sch, most + 3);
  std::vector<bool> joined(sch.requests.size(), false), gone(sch.requests.size(), false);
  std::vector<std::byte> ws(plan.workspace_bytes());
  const HeadRange qh = plan.q_heads(), oh = plan.out_heads();
  const std::int64_t H = sch.H, D = sch.D, Dv = sch.Dv, max_rows = c.max_batch * c.max_new_tokens;
  std::vector<float> q(static_cast<std::size_t>(max_rows * qh.count * D)), out(static_cast<std::size_t>(max_rows * oh.count * Dv));
  std::vector<std::int32_t> indptr, indices;
  std::vector<std::int64_t> ids, split;
  double err = 0;
  for (int s = 0; s < static_cast<int>(sch.steps.size()); ++s) {
    const ScheduledStep& st = sch.steps[static_cast<std::size_t>(s)];
    // Requests no longer in the batch have left: free their pages.
    for (std::size_t ri = 0; ri < sch.requests.size(); ++ri)
      if (joined[ri] && !gone[ri] && std::find(st.req.begin(), st.req.end(), static_cast<std::int64_t>(ri)) == st.req.end()) {
        pool.release(ri);
        gone[ri] = true;
      }
    ids.clear();
    split.clear();
    for (std::size_t i = 0; i < st.req.size(); ++i) {
      const auto ri = static_cast<std::size_t>(st.req[i]);
      const Request& r = sch.requests[ri];
      if (!joined[ri]) {  // its prefill leaves the prompt's K/V where the placement says
        joined[ri] = true;
        for (std::int64_t pos = 0; pos < r.prompt; ++pos)
          if (plan.owner(pos, r.prompt) == me) pool.put(r, ri, pos, plan.slot(pos, r.prompt));
      }
      for (std::int64_t pos = st.kv_len[i]; pos < st.kv_len[i] + st.new_tokens[i]; ++pos)
        if (plan.owner(pos, r.prompt) == me) pool.put(r, ri, pos, plan.slot(pos, r.prompt));
      ids.push_back(r.id);
      split.push_back(r.prompt);
    }
    // This rank's block table, CSR or dense.
    indptr.assign(1, 0);
    indices.clear();
    // A rank that holds none of the step's tokens passes a dense table of no columns.
    std::size_t widest = 0;
    for (std::int64_t ri : st.req) widest = std::max(widest, pool.owned[static_cast<std::size_t>(ri)].size());
    for (std::int64_t ri : st.req) {
      const std::vector<std::int32_t>& mine = pool.owned[static_cast<std::size_t>(ri)];
      indices.insert(indices.end(), mine.begin(), mine.end());
      if (c.dense_table) indices.resize(indptr.size() * widest, -1);  // padded rows, as vLLM's
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
    }
    const BlockTable table = c.dense_table ? BlockTable::dense(indices, static_cast<std::int64_t>(widest))
                                           : BlockTable::csr(indptr, indices);
    for (std::int64_t r = 0; r < st.rows; ++r)
      for (std::int64_t h = 0; h < qh.count; ++h)
        std::copy_n(&st.q[static_cast<std::size_t>((r * H + qh.begin + h) * D)], D,
                    &q[static_cast<std::size_t>((r * qh.count + h) * D)]);
    const DecodeBatch batch{ids, st.kv_len, st.new_tokens, split, table};
    const std::uint64_t before = world.stats().bytes_sent;
    const std::int64_t rows = run_step(dec, plan, batch, q, pool, out, ws);
    CHECK(rows == st.rows);
    CHECK(world.stats().bytes_sent - before == plan.step_bytes(rows));
    double num = 0, den = 0;
    for (std::size_t i = 0, row0 = 0; i < st.req.size(); row0 += static_cast<std::size_t>(st.new_tokens[i]), ++i) {
      if (st.new_tokens[i] == 0) continue;
      const std::vector<double> want = sch.reference(c, s, i, static_cast<std::int64_t>(row0));
      for (std::int64_t t = 0; t < st.new_tokens[i]; ++t)
        for (std::int64_t h = 0; h < oh.count; ++h)
          for (std::int64_t e = 0; e < Dv; ++e) {
            const double got = out[static_cast<std::size_t>(((static_cast<std::int64_t>(row0) + t) * oh.count + h) * Dv + e)];
            const double w = want[static_cast<std::size_t>((t * H + oh.begin + h) * Dv + e)];
            num = std::isnan(got) ? std::numeric_limits<double>::infinity() : std::max(num, std::abs(got - w));
            den = std::max(den, std::abs(w));
          }
    }
    err = std::max(err, den > 0 ? num / den : num);
  }
  return err;
}

/// Runs the case on thread ranks; the worst error over every rank and step.
template <class Kernel = ReferenceKernel>
double run_paged_case(const PagedCase& c) {
  const Schedule sch(c);
  std::vector<double> err(static_cast<std::size_t>(c.ranks), 0.0);
  run_ranks(c.ranks, [&](ThreadCommunicator& world) {
    err[static_cast<std::size_t>(world.rank())] = paged_rank_error<Kernel>(world, c, sch);
  });
  return *std::max_element(err.begin(), err.end());
}

/// The batch and views of small_paged_step, which a test may edit on one rank.
struct SmallStep {
  std::vector<std::int64_t> ids{7, 9}, kv_len{10, 5}, new_tokens{2, 1}, split{0, 0};
  std::vector<std::int32_t> indptr, indices;
  TensorView<const float> q, k_pool, v_pool;  ///< q [1, 16, q heads, 4]; the pools both the one NHD pool
  TensorView<float> out;                      ///< [1, 16, out heads, 4]
};

/// A small paged step on this rank of `world`: 2 sequences (ids 7 and 9) of 10 and 5 cached
/// tokens, T = 2 and 1, page size 4, interleave 2, 3 heads of D 4; `edit(rank, step)` may
/// change this rank's batch, table or views first. With `then_valid`, a ConfigError of that
/// step is swallowed and the unedited step follows (a refusal must leave the plan usable).
template <class Comm, class Edit>
void small_paged_step(Comm& world, Edit edit, bool then_valid, DecodeExchange ex) {
  PagedDecode<Comm, ReferenceKernel> dec(world);
  PagedDecodePlan plan =
      dec.plan({.max_batch = 4, .max_new_tokens = 4, .heads = 3, .head_dim = 4, .interleave = 2, .exchange = ex});
  const std::int64_t pages = 16, ps = 4;
  std::vector<float> pool(static_cast<std::size_t>(pages * ps * 3 * 4), 0.5f);
  std::vector<float> q(static_cast<std::size_t>(16 * 3 * 4), 0.25f), out(q.size());
  std::vector<std::byte> ws(plan.workspace_bytes());
  auto run = [&](bool edited) {
    SmallStep s;
    s.indptr = {0};
    std::int32_t next = 0;
    for (std::size_t b = 0; b < 2; ++b) {  // each sequence's pages here, in order
      const std::int64_t need = (plan.local_tokens(s.kv_len[b] + s.new_tokens[b]) + ps - 1) / ps;
      for (std::int64_t i = 0; i < need; ++i) s.indices.push_back(next++);
      s.indptr.push_back(static_cast<std::int32_t>(s.indices.size()));
    }
    s.q = TensorView<const float>::bshd(q.data(), 1, 16, plan.q_heads().count, 4);
    s.k_pool = s.v_pool = TensorView<const float>::bshd(pool.data(), pages, ps, 3, 4);
    s.out = TensorView<float>::bshd(out.data(), 1, 16, plan.out_heads().count, 4);
    if (edited) edit(world.rank(), s);
    dec.template step<float>(plan, {s.ids, s.kv_len, s.new_tokens, s.split, BlockTable::csr(s.indptr, s.indices)},
                             s.q, s.k_pool, s.v_pool, s.out, ws);
  };
  try {
    run(true);
  } catch (const ConfigError&) {
    if (!then_valid) throw;
  }
  if (then_valid) run(false);
}

}  // namespace seqpar::test
