// Decode over an engine-owned paged pool with continuous batching: requests join after their
// prefill and leave when done, each step's sequences bring 0..16 new tokens, pages come from a
// free list in no order and are reused after free with NaN written into them; every step's
// rows equal attention over each sequence's whole cache in double, on 1-6 thread ranks, every
// placement (interleaved runs of 1, 3 and 16 tokens, contiguous), pool page sizes 1, 4, 16,
// CSR and dense block tables, GQA/MQA, both exchanges, today's models' features; bytes per step
// equal the plan's count for the step's rows. Bad views throw before the exchange, and the
// plan's placement queries refuse positions outside any sequence.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "support/paged_check.hpp"

using namespace seqpar;
using test::PagedCase;
using test::run_paged_case;

TEST_CASE("paged decode: continuously batched steps equal attention over each whole cache") {
  using E = DecodeExchange;
  const std::vector<PagedCase> cases = {
      {.ranks = 1, .interleave = 1, .page_size = 4, .heads = 4, .kv_heads = 2, .exchange = E::all_gather, .steps = 12},
      {.ranks = 2, .interleave = 16, .page_size = 16, .heads = 4, .kv_heads = 2, .exchange = E::all_gather, .steps = 16},
      {.ranks = 3, .interleave = 1, .page_size = 1, .heads = 6, .kv_heads = 3, .exchange = E::heads, .steps = 12,
       .dense_table = true},
      {.ranks = 4, .interleave = 3, .page_size = 4, .heads = 8, .kv_heads = 1, .exchange = E::all_gather, .steps = 14},
      {.ranks = 5, .interleave = 0, .page_size = 4, .heads = 5, .kv_heads = 5, .exchange = E::heads, .steps = 12},
      {.ranks = 6, .interleave = 16, .page_size = 4, .heads = 6, .kv_heads = 2, .exchange = E::all_gather, .steps = 10,
       .dense_table = true},
  };
  for (const PagedCase& c : cases) {
    CAPTURE(c.ranks);
    CAPTURE(c.interleave);
    CAPTURE(c.page_size);
    CHECK(run_paged_case(c) < 1e-5);
  }
}

TEST_CASE("paged decode: today's models' features, alone and combined") {
  using E = DecodeExchange;
  using test::DecodeFeatures;
  const DecodeFeatures sinks{.sinks = true}, softcap{.softcap = 2.5}, mla{.head_dim = 12, .head_dim_v = 8, .v_in_k = true},
      all{.head_dim = 12, .head_dim_v = 8, .softcap = 3.0, .sinks = true, .v_in_k = true};
  const std::vector<PagedCase> cases = {
      {.ranks = 3, .interleave = 1, .page_size = 4, .heads = 4, .kv_heads = 2, .exchange = E::all_gather, .steps = 8,
       .features = sinks},
      {.ranks = 7, .interleave = 2, .page_size = 2, .heads = 7, .kv_heads = 7, .exchange = E::heads, .steps = 6,
       .features = sinks},
      {.ranks = 2, .interleave = 4, .page_size = 4, .heads = 4, .kv_heads = 2, .exchange = E::heads, .steps = 8,
       .features = softcap},
      {.ranks = 4, .interleave = 16, .page_size = 8, .heads = 4, .kv_heads = 1, .exchange = E::all_gather, .steps = 8,
       .features = mla},
      {.ranks = 3, .interleave = 0, .page_size = 4, .heads = 6, .kv_heads = 1, .exchange = E::heads, .steps = 8,
       .dense_table = true, .features = all},
  };
  for (const PagedCase& c : cases) {
    CAPTURE(c.ranks);
    CHECK(run_paged_case(c) < 1e-5);
    CHECK(run_paged_case<CpuFlashKernel>(c) < 1e-5);
  }
}

namespace {

using test::SmallStep;

/// test::small_paged_step on `ranks` thread ranks; returns how each rank ended.
template <class Edit>
std::vector<test::RankOutcome> small_step(int ranks, Edit edit, bool then_valid = false,
                                          DecodeExchange ex = DecodeExchange::all_gather) {
  return test::rank_outcomes(ranks, [&](ThreadCommunicator& world) { test::small_paged_step(world, edit, then_valid, ex); });
}

bool names_on_every_rank(const std::vector<test::RankOutcome>& out, const std::string& needle) {
  for (const auto& o : out)
    if (o.kind != "ConfigError" || o.what.find(needle) == std::string::npos) return false;
  return true;
}

}  // namespace

TEST_CASE("paged decode: a bad or differing batch is refused on every rank, never merged or hung") {
  for (DecodeExchange ex : {DecodeExchange::all_gather, DecodeExchange::heads}) {
    CAPTURE(static_cast<int>(ex));
    // The untouched step runs everywhere.
    auto ok = small_step(3, [](int, SmallStep&) {}, false, ex);
    for (const auto& o : ok) CHECK(o.kind == "none");

    // Rank 1 lists the sequences under other ids (same rows): every rank names it, and rank 1
    // names rank 0.
    auto ids = small_step(3, [](int r, SmallStep& s) { if (r == 1) s.ids[1] = 8; }, false, ex);
    INFO(test::describe(ids));
    CHECK(ids[0].what.find("rank 1's batch differs from rank 0's") != std::string::npos);
    CHECK(ids[2].what.find("rank 1's batch differs from rank 2's") != std::string::npos);
    CHECK(ids[1].what.find("rank 0's batch differs from rank 1's") != std::string::npos);
    CHECK(names_on_every_rank(ids, "batch differs"));

    // Rank 2's block table lacks a page its tokens need: it refuses, every rank names it, and
    // it alone says why.
    auto pages = small_step(3, [](int r, SmallStep& s) { if (r == 2) { s.indices.pop_back(); --s.indptr.back(); } },
                            false, ex);
    INFO(test::describe(pages));
    CHECK(names_on_every_rank(pages, "rank 2 refused the step"));
    CHECK(pages[2].what.find("block table: sequence 1 has") != std::string::npos);
    CHECK(pages[0].what.find("its own error says why") != std::string::npos);

    // A page id outside the pool on rank 0.
    auto id = small_step(2, [](int r, SmallStep& s) { if (r == 0) s.indices[0] = 16; }, false, ex);
    CHECK(names_on_every_rank(id, "rank 0 refused the step"));
    CHECK(id[0].what.find("is id 16, outside the pool's 0..15") != std::string::npos);

    // Every rank gives T = 5 > max_new_tokens 4 (the rows still fit the plan): all refuse.
    auto many = small_step(2, [](int, SmallStep& s) { s.new_tokens[0] = 5; }, false, ex);
    CHECK(names_on_every_rank(many, "refused the step"));
    CHECK(many[0].what.find("new_tokens[0]: expected 0..4 (max_new_tokens), got 5") != std::string::npos);

    // After a refused step the plan and the communicator still work: the next step runs.
    auto after = small_step(3, [](int r, SmallStep& s) { if (r == 1) s.indptr[1] = 99; }, true, ex);
    INFO(test::describe(after));
    for (const auto& o : after) CHECK(o.kind == "none");
  }
  // Rank 1 counts another row (T 3 instead of 2): message sizes differ, so the exchange itself
  // fails (the communicator's size check) on every rank, within the time-out, none merges.
  auto rows = small_step(3, [](int r, SmallStep& s) { if (r == 1) s.new_tokens[0] = 3; });
  INFO(test::describe(rows));
  for (const auto& o : rows) CHECK((o.kind == "CommError" || o.kind == "CommAborted" || o.kind == "ConfigError"));

  // The plan's agreement: ranks that disagree on the placement are refused alike.
  auto plan = test::rank_outcomes(2, [](ThreadCommunicator& world) {
    PagedDecode<ThreadCommunicator, ReferenceKernel> dec(world);
    (void)dec.plan({.heads = 2, .head_dim = 4, .interleave = world.rank() == 0 ? 16 : 1});
  });
  CHECK(test::all_same_config_error(plan, "paged decode plan: ranks disagree on interleave: rank 0 has 16, rank 1 has 1"));
  auto maxima = test::rank_outcomes(1, [](ThreadCommunicator& world) {
    PagedDecode<ThreadCommunicator, ReferenceKernel> dec(world);
    (void)dec.plan({.max_new_tokens = 17, .heads = 2, .head_dim = 4});
  });
  CHECK(test::all_same_config_error(maxima, "paged decode plan: max_new_tokens: expected 1..16, got 17"));
}

TEST_CASE("paged decode refuses null, strided, overlapping and misshapen views on every rank before any exchange") {
  struct Bad {
    void (*edit)(int, SmallStep&);
    const char* message;
  };
  const Bad bad[] = {
      {[](int, SmallStep& s) { s.q.data = nullptr; }, "paged decode step: q: null data pointer"},
      {[](int, SmallStep& s) { s.k_pool.data = nullptr; }, "paged decode step: k_pool: null data pointer"},
      {[](int, SmallStep& s) { s.q.extent[0] = 2; }, "paged decode step: q.batch: expected 1, got 2"},
      {[](int, SmallStep& s) { s.out.extent[0] = 0; }, "paged decode step: out.batch: expected 1, got 0"},
      {[](int, SmallStep& s) { s.out.stride[1] = 0; }, "paged decode step: out: strides overlap (dimension seq"},
      {[](int, SmallStep& s) { s.k_pool.stride[3] = 2; }, "paged decode step: k_pool.stride[3] (head_dim): expected 1"},
      {[](int, SmallStep& s) { s.v_pool.stride[0] = -s.v_pool.stride[0]; },
       "paged decode step: v_pool.stride[0]: expected >= 0"},
  };
  for (DecodeExchange ex : {DecodeExchange::all_gather, DecodeExchange::heads})
    for (const Bad& b : bad) {
      CAPTURE(static_cast<int>(ex));
      CAPTURE(b.message);
      // Every rank refuses its own view; the unedited step then runs on the same plan and
      // communicator, so nothing of the refused step was sent (a throw after the exchange
      // began would have failed the communicator).
      run_ranks(2, [&](ThreadCommunicator& world) {
        CHECK_THROWS_WITH_AS(test::small_paged_step(world, b.edit, false, ex), doctest::Contains(b.message),
                             ConfigError);
        CHECK_NOTHROW(test::small_paged_step(world, b.edit, true, ex));
      }, ThreadRunOptions{test::outcome_timeout});
    }
  // Valid layouts still pass: HND pages ([pages, page_size 4, heads 3, D 4] stored [pages,
  // heads, rows, D]), V a view of K's pool, q and out with more rows than the step's (the
  // feature cases run MLA's V, K's first D_v columns).
  auto hnd = small_step(2, [](int, SmallStep& s) { s.k_pool.stride = s.v_pool.stride = {3 * 4 * 4, 4, 4 * 4, 1}; });
  INFO(test::describe(hnd));
  for (const auto& o : hnd) CHECK(o.kind == "none");
}

TEST_CASE("paged decode plan: step_bytes takes 0..max_rows rows; a negative dense max_blocks is named as such") {
  run_ranks(2, [](ThreadCommunicator& world) {
    PagedDecode<ThreadCommunicator, ReferenceKernel> dec(world);
    const PagedDecodePlan plan = dec.plan({.max_batch = 2, .max_new_tokens = 3, .heads = 2, .head_dim = 4});
    CHECK(plan.step_bytes(6) > plan.step_bytes(1));  // 2 x 3 rows: the plan's limit
    CHECK(plan.step_bytes(0) > 0);                   // the tags still travel
    for (std::int64_t rows : {std::int64_t{-1}, std::int64_t{7}, std::int64_t{1} << 40}) {
      const std::string want = "PagedDecodePlan::step_bytes: rows: expected 0..6 (the plan's max_rows), got " +
                               std::to_string(rows);
      CHECK_THROWS_WITH_AS((void)plan.step_bytes(rows), doctest::Contains(want.c_str()), ConfigError);
    }
  }, ThreadRunOptions{test::outcome_timeout});
  const std::int32_t pages[4] = {0, 1, 2, 3};
  CHECK(BlockTable::dense(pages, -1).reason(0, 1, 4) == "block table: max_blocks -1 is negative");
  CHECK(BlockTable::dense(pages, 2).reason(1, 2, 4).empty());
}

TEST_CASE("paged decode plan: owner, slot and local_tokens refuse negative or huge positions, lengths and splits") {
  constexpr std::int64_t big = std::numeric_limits<std::int64_t>::max();
  run_ranks(2, [](ThreadCommunicator& world) {
    PagedDecode<ThreadCommunicator, ReferenceKernel> dec(world);
    for (std::int64_t interleave : {0, 1, 3}) {
      CAPTURE(interleave);
      const PagedDecodePlan plan = dec.plan({.heads = 2, .head_dim = 4, .interleave = interleave});
      for (std::int64_t pos : {std::int64_t{-1}, std::int64_t{-5}, big, -big - 1}) {
        CAPTURE(pos);
        CHECK_THROWS_AS((void)plan.owner(pos, 8), ConfigError);
        CHECK_THROWS_AS((void)plan.slot(pos, 8), ConfigError);
        CHECK_THROWS_AS((void)plan.local_tokens(pos, 8), ConfigError);
      }
      CHECK_THROWS_WITH_AS((void)plan.owner(-5),
                           doctest::Contains("PagedDecodePlan::owner: pos: expected 0..2^61, got -5"), ConfigError);
      // A split counts only with the contiguous placement (interleave 0), as in a step.
      if (interleave == 0) CHECK_THROWS_AS((void)plan.owner(3, -1), ConfigError);
      else CHECK(plan.owner(3, -1) == static_cast<int>((3 / interleave) % 2));
      // Every legal position has the placement's owner and slot.
      for (std::int64_t pos = 0; pos < 40; ++pos) {
        CHECK(plan.owner(pos, 8) == plan.placement().owner(pos, 8));
        CHECK(plan.slot(pos, 8) == plan.placement().slot(pos, 8));
        CHECK(plan.local_tokens(pos, 8) == plan.placement().count(world.rank(), pos, 8));
      }
    }
  }, ThreadRunOptions{test::outcome_timeout});
}

TEST_CASE("paged decode: the placement puts every token on one rank, in increasing slots, queryable by the engine") {
  for (int P : {1, 3, 4})
    for (std::int64_t interleave : {0, 1, 3, 16}) {
      const TokenPlacement place{P, interleave};
      for (std::int64_t split : {0, 7, 40}) {
        std::vector<std::int64_t> next(static_cast<std::size_t>(P), 0);
        for (std::int64_t pos = 0; pos < 120; ++pos) {
          const int r = place.owner(pos, split);
          CHECK(place.slot(pos, split) == next[static_cast<std::size_t>(r)]++);
          if (interleave > 0) CHECK(r == (pos / interleave) % P);  // vLLM's interleave rule
        }
        for (int r = 0; r < P; ++r) CHECK(place.count(r, 120, split) == next[static_cast<std::size_t>(r)]);
      }
    }
}

namespace {

/// One native paged call of CpuFlashKernel: pools (NHD or HND, V its own pool or K's first
/// D_v columns), sequences whose pages come in shuffled or pool order, NaN in every row no
/// row may see.
struct NativeCase {
  std::int64_t page_size;
  bool hnd = false, in_order = false, v_in_k = false;
  int threads = 1;
  std::int64_t heads = 8, kv_heads = 2, dim = 32, dim_v = 32;
  double softcap = 0;
  std::vector<std::int64_t> slots{0, 37, 1300};  ///< each sequence's local slots
  std::vector<std::int64_t> tokens{1, 16, 3};    ///< each sequence's query rows
};

/// Worst error of forward_paged against the same attention in double: O normwise, the LSE
/// absolute (a row that sees nothing must give O = 0 and LSE = -inf). Pools and queries of T
/// (float, or bf16: the same attention of the bf16 values, accumulated in float).
template <class T = float>
double native_paged_error(const NativeCase& c) {
  const std::int64_t H = c.heads, K = c.kv_heads, D = c.dim, Dv = c.dim_v, ps = c.page_size;
  const auto B = static_cast<std::int64_t>(c.slots.size());
  std::mt19937_64 rng(static_cast<std::uint64_t>(ps * 131 + c.threads));
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<std::int32_t> indptr{0}, indices;
  std::int64_t pages = 2;  // two spare pages no sequence owns
  for (std::int64_t s : c.slots) pages += (s + ps - 1) / ps;
  std::vector<std::int32_t> order(static_cast<std::size_t>(pages));
  std::iota(order.begin(), order.end(), 0);
  if (!c.in_order) std::shuffle(order.begin(), order.end(), rng);
  std::size_t next = 1;  // page order[0] stays free
  for (std::int64_t s : c.slots) {
    for (std::int64_t i = 0; i < (s + ps - 1) / ps; ++i) indices.push_back(order[next++]);
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
  }
  const T nan = T(std::numeric_limits<float>::quiet_NaN());
  std::vector<T> kp(static_cast<std::size_t>(pages * ps * K * D), nan),
      vp(c.v_in_k ? 0 : static_cast<std::size_t>(pages * ps * K * Dv), nan);
  // Element (page, row, head, d) of a pool with `dim` columns, NHD or HND.
  auto at = [&](std::int64_t page, std::int64_t row, std::int64_t h, std::int64_t d, std::int64_t dim) {
    return static_cast<std::size_t>(c.hnd ? ((page * K + h) * ps + row) * dim + d : ((page * ps + row) * K + h) * dim + d);
  };
  auto view = [&](const std::vector<T>& pool, std::int64_t dim) {
    auto v = TensorView<const T>::bshd(pool.data(), pages, ps, K, dim);
    if (c.hnd) v.stride = {K * ps * dim, dim, ps * dim, 1};
    return v;
  };
  const BlockTable table = BlockTable::csr(indptr, indices);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < c.slots[static_cast<std::size_t>(b)]; ++s)
      for (std::int64_t h = 0; h < K; ++h) {
        const std::int64_t page = table.pages(b)[static_cast<std::size_t>(s / ps)];
        for (std::int64_t d = 0; d < D; ++d) kp[at(page, s % ps, h, d, D)] = T(n(rng));
        if (!c.v_in_k)
          for (std::int64_t d = 0; d < Dv; ++d) vp[at(page, s % ps, h, d, Dv)] = T(n(rng));
      }
  TensorView<const T> kv = view(kp, D), vv = c.v_in_k ? kv : view(vp, Dv);
  if (c.v_in_k) vv.extent[3] = Dv;
  // Rows: each sequence's last rows see its last slots (a decode step's new tokens), one
  // fewer each row up; a sequence without slots has rows that see nothing.
  std::vector<std::int64_t> begin{0}, key_end;
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t t = c.tokens[static_cast<std::size_t>(b)], s = c.slots[static_cast<std::size_t>(b)];
    for (std::int64_t r = 0; r < t; ++r) key_end.push_back(std::max<std::int64_t>(0, s - (t - 1 - r)));
    begin.push_back(begin.back() + t);
  }
  const std::int64_t R = begin.back();
  const float fnan = std::numeric_limits<float>::quiet_NaN();
  std::vector<T> q(static_cast<std::size_t>(R * H * D));
  std::vector<float> out(static_cast<std::size_t>(R * H * Dv), fnan), lse(static_cast<std::size_t>(R * H), fnan);
  for (T& x : q) x = T(n(rng));
  KernelParams p;
  p.scale = 1.0 / std::sqrt(static_cast<double>(D));
  p.softcap = c.softcap;
  p.group_size = H / K;
  CpuFlashKernel kernel(CpuFlashOptions{.threads = c.threads});
  const PagedKV<T> cache{kv, vv, table};
  kernel.forward_paged(TensorView<const T>::bshd(q.data(), 1, R, H, D), cache, PagedRows{B, begin.data(), key_end.data()},
                       TensorView<float>::bshd(out.data(), 1, R, H, Dv), TensorView<float>::bshd(lse.data(), 1, R, H, 1), p);
  double num = 0, den = 0, lse_err = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t r = begin[static_cast<std::size_t>(b)]; r < begin[static_cast<std::size_t>(b) + 1]; ++r)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t kh = h / (H / K), n_keys = key_end[static_cast<std::size_t>(r)];
        std::vector<double> w(static_cast<std::size_t>(n_keys));
        double m = -std::numeric_limits<double>::infinity(), sum = 0;
        for (std::int64_t s = 0; s < n_keys; ++s) {
          const std::int64_t page = table.pages(b)[static_cast<std::size_t>(s / ps)];
          double x = 0;
          for (std::int64_t d = 0; d < D; ++d) x += static_cast<double>(q[static_cast<std::size_t>((r * H + h) * D + d)]) *
                 static_cast<double>(kp[at(page, s % ps, kh, d, D)]);
          x *= p.scale;
          if (c.softcap > 0) x = c.softcap * std::tanh(x / c.softcap);
          w[static_cast<std::size_t>(s)] = x;
          m = std::max(m, x);
        }
        for (double& x : w) sum += x = std::exp(x - m);
        const double want_lse = n_keys == 0 ? -std::numeric_limits<double>::infinity() : m + std::log(sum);
        const double got_lse = lse[static_cast<std::size_t>(r * H + h)];
        if (n_keys == 0) CHECK(got_lse == want_lse);
        else lse_err = std::isnan(got_lse) ? std::numeric_limits<double>::infinity() : std::max(lse_err, std::abs(got_lse - want_lse));
        for (std::int64_t d = 0; d < Dv; ++d) {
          double o = 0;
          for (std::int64_t s = 0; s < n_keys; ++s) {
            const std::int64_t page = table.pages(b)[static_cast<std::size_t>(s / ps)];
            o += w[static_cast<std::size_t>(s)] / sum *
                 static_cast<double>(c.v_in_k ? kp[at(page, s % ps, kh, d, D)] : vp[at(page, s % ps, kh, d, Dv)]);
          }
          const double got = out[static_cast<std::size_t>((r * H + h) * Dv + d)];
          num = std::isnan(got) ? std::numeric_limits<double>::infinity() : std::max(num, std::abs(got - o));
          den = std::max(den, std::abs(o));
        }
      }
  return std::max(num / den, lse_err);
}

}  // namespace

TEST_CASE("paged decode: CpuFlashKernel reads the pages in place, any page size, NHD or HND, equal to attention in double") {
  const std::vector<NativeCase> cases = {
      {.page_size = 1},
      {.page_size = 3, .threads = 2},
      {.page_size = 16, .in_order = true},                                   // runs of pages read as one block
      {.page_size = 16, .hnd = true, .threads = 2},                          // HND: no run joins
      {.page_size = 64, .heads = 8, .kv_heads = 1, .softcap = 2.0},          // MQA, soft-capped
      {.page_size = 5, .in_order = true, .v_in_k = true, .threads = 2, .heads = 4, .kv_heads = 1, .dim = 24,
       .dim_v = 16},                                                        // MLA: V a column view of K
      {.page_size = 7, .heads = 6, .kv_heads = 3, .dim = 20, .dim_v = 12, .tokens = {16, 0, 9}},
  };
  for (const NativeCase& c : cases) {
    CAPTURE(c.page_size);
    CAPTURE(c.hnd);
    CAPTURE(c.threads);
    CHECK(native_paged_error(c) < 5e-6);
  }
}

// A bf16 pool is read at its own width and widened block by block: the same attention of the
// bf16 values, accumulated in float, so the float tolerance holds.
TEST_CASE("paged decode: CpuFlashKernel reads bf16 pages in place, equal to attention of the bf16 values in double") {
  const std::vector<NativeCase> cases = {
      {.page_size = 3, .threads = 2},
      {.page_size = 16, .in_order = true, .heads = 8, .kv_heads = 1, .softcap = 2.0},  // one run, MQA, soft-cap
      {.page_size = 5, .in_order = true, .v_in_k = true, .heads = 4, .kv_heads = 1, .dim = 24, .dim_v = 16},  // MLA
      {.page_size = 7, .hnd = true, .heads = 6, .kv_heads = 3, .dim = 20, .dim_v = 12, .tokens = {16, 0, 9}},
  };
  for (const NativeCase& c : cases) {
    CAPTURE(c.page_size);
    CHECK(native_paged_error<bf16>(c) < 5e-6);
  }
}
