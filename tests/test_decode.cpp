// Decode over a sharded KV cache: every step against attention over the whole cache in double,
// for world sizes 1-8, ragged caches (some empty on some ranks), contiguous and paged layouts
// (page 1, 16, larger than a shard), 1 and 16 new tokens, GQA, both exchanges, growth over many
// steps with appends on the owner rank; bytes per step equal the plan's count; a rank that
// advanced differently is named on every rank. Today's models' features, alone and combined:
// a value head dim D_v, logit soft-capping, sinks (counted once per row at 1-7 ranks) and MLA's
// latent cache (V the first D_v columns of K's rows); bad values, wrong views, a kernel that
// lacks a feature and ranks that disagree on one are refused by name.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "support/decode_check.hpp"
#include "support/rank_outcomes.hpp"

using namespace seqpar;
using test::D;
using test::DecodeCase;
using test::DecodeFeatures;
using test::run_decode_case;

TEST_CASE("decode: every step equals attention over the whole cache") {
  using E = DecodeExchange;
  const std::vector<DecodeCase> cases = {
      {1, {37, 5}, 0, 1, 4, 2, E::all_gather, 3},
      {2, {100, 0, 33}, 0, 1, 4, 2, E::all_gather, 4},      // contiguous, an empty sequence
      {3, {50, 7}, 1, 4, 6, 3, E::all_gather, 5},           // stripe (page 1), T = 4
      {4, {3000, 517}, 16, 4, 4, 2, E::all_gather, 3},      // the demo's shape
      {4, {3000, 517}, 16, 4, 4, 2, E::heads, 3},           // queries sharded by heads
      {5, {9, 0, 130}, 64, 16, 5, 1, E::heads, 3},          // page larger than a shard, T = 16, MQA, 5 ranks
      {6, {2, 3}, 4, 1, 12, 4, E::all_gather, 20},          // caches empty on most ranks, growth over 20 steps
      {7, {61, 300, 1}, 0, 16, 7, 7, E::heads, 4},          // contiguous appends on the last rank, 7 ranks
      {8, {1000}, 1, 2, 8, 2, E::all_gather, 6},            // 8 ranks striped
  };
  for (const DecodeCase& c : cases) {
    CAPTURE(c.ranks);
    CAPTURE(c.page);
    CAPTURE(c.new_tokens);
    CAPTURE(static_cast<int>(c.exchange));
    CHECK(run_decode_case(c) < 1e-5);
  }
}

TEST_CASE("decode: CpuFlashKernel steps equal attention over the whole cache") {
  // The engines' fast kernel as the local kernel: float accumulation over up to ~1000 keys.
  using E = DecodeExchange;
  const std::vector<DecodeCase> cases = {
      {3, {50, 7}, 1, 4, 6, 3, E::all_gather, 5},
      {4, {3000, 517}, 16, 1, 4, 2, E::heads, 3},
      {5, {9, 0, 130}, 64, 16, 5, 1, E::heads, 3},
  };
  for (const DecodeCase& c : cases) {
    CAPTURE(c.ranks);
    CHECK(run_decode_case<CpuFlashKernel>(c) < 1e-5);
  }
}

TEST_CASE("decode: the layout puts every token on exactly one rank, in increasing slots") {
  for (int P : {1, 3, 4})
    for (std::int64_t page : {0, 1, 16, 1000}) {
      const CacheLayout l(P, page, {40, 0});
      for (std::int64_t b = 0; b < 2; ++b) {
        std::vector<std::int64_t> next(static_cast<std::size_t>(P), 0);
        for (std::int64_t pos = 0; pos < 200; ++pos) {
          const int r = l.owner(b, pos);
          CHECK(l.slot(b, pos) == next[static_cast<std::size_t>(r)]++);  // slots fill in position order
        }
        for (int r = 0; r < P; ++r) CHECK(l.count(r, b, 200) == next[static_cast<std::size_t>(r)]);
      }
    }
}

TEST_CASE("decode: a rank whose plan advanced differently is named on every rank, no hang") {
  // Each of 3 ranks in turn is the odd one, under both exchanges: every rank throws, the
  // others naming the odd rank, the odd rank naming the first rank it disagrees with.
  for (DecodeExchange ex : {DecodeExchange::all_gather, DecodeExchange::heads})
    for (int odd = 0; odd < 3; ++odd) {
      CAPTURE(static_cast<int>(ex));
      CAPTURE(odd);
      const auto out = test::step_with_odd_rank(3, odd, ex);
      INFO(test::describe(out));
      for (int w = 0; w < 3; ++w) {
        const int named = w == odd ? (odd == 0 ? 1 : 0) : odd;
        CHECK(out[static_cast<std::size_t>(w)].kind == "ConfigError");
        CHECK(out[static_cast<std::size_t>(w)].what.find("decode step: rank " + std::to_string(named) +
                                                         " is at another step than rank " + std::to_string(w)) !=
              std::string::npos);
      }
    }
  auto bad = test::rank_outcomes(2, [](ThreadCommunicator& world) {
    SequenceParallelDecode<ThreadCommunicator, ReferenceKernel> dec(world);
    (void)dec.plan({.batch = 2, .heads = 2, .head_dim = D, .new_tokens = 17, .kv_len = {1, 2}, .capacity = 40});
  });
  CHECK(test::all_same_config_error(bad, "decode plan: new_tokens: expected 1..16, got 17"));
}

namespace {

/// MLA's decode: one latent K/V head (MQA) of D 576 whose first 512 columns are V.
constexpr DecodeFeatures mla{.head_dim = 576, .head_dim_v = 512, .v_in_k = true};

/// The feature cases: each feature alone, then combined; contiguous and paged (page 1, 16);
/// T = 1, 3, 16; both exchanges; 1..5 ranks, with ranks holding no token of a sequence
/// (contiguous appends, short sequences under page 16, an empty cache); GQA and MQA.
std::vector<DecodeCase> feature_cases() {
  using E = DecodeExchange;
  const DecodeFeatures cap{.softcap = 1.0}, wide_v{.head_dim_v = 12}, narrow_v{.head_dim = 12, .head_dim_v = 6},
      sinks{.sinks = true}, latent{.head_dim = 12, .head_dim_v = 8, .v_in_k = true},
      all{.head_dim = 16, .head_dim_v = 12, .softcap = 1.5, .sinks = true, .v_in_k = true},
      all_wide{.head_dim = 8, .head_dim_v = 16, .softcap = 2.0, .sinks = true};
  DecodeFeatures mla_all = mla;
  mla_all.softcap = 2.0;
  mla_all.sinks = true;
  return {
      {1, {9, 4}, 0, 3, 4, 2, E::all_gather, 2, cap},         // soft-cap alone, one rank
      {2, {30, 0}, 16, 1, 6, 3, E::heads, 3, cap},            // an empty cache
      {3, {20, 5}, 1, 16, 4, 2, E::all_gather, 2, wide_v},    // D_v > D, stripes, T = 16
      {4, {13, 2}, 0, 3, 8, 2, E::heads, 2, narrow_v},        // D_v < D, contiguous: ranks 2, 3 start empty
      {5, {7, 40}, 16, 1, 5, 1, E::heads, 2, sinks},          // sinks alone, MQA, 5 heads over 5 ranks
      {3, {25, 1}, 1, 3, 6, 2, E::heads, 2, latent},          // V in K's rows alone
      {4, {17, 30}, 16, 16, 4, 4, E::all_gather, 2, all},     // all four
      {5, {11, 0, 3}, 0, 1, 6, 3, E::heads, 3, all},          // all four, contiguous, 5 ranks
      {2, {6, 21}, 1, 3, 4, 2, E::all_gather, 2, all_wide},   // D_v > D with soft-cap and sinks
      {3, {12, 5}, 1, 1, 16, 1, E::all_gather, 2, mla},       // MLA: 16 query heads, one latent head
      {2, {9, 20}, 16, 16, 16, 1, E::heads, 1, mla_all},      // MLA, T = 16, capped, with sinks
  };
}

/// Describes a case's features for a failure message.
std::string features_of(const DecodeCase& c) {
  const DecodeFeatures& f = c.features;
  return "D " + std::to_string(f.head_dim) + " / D_v " + std::to_string(f.value_dim()) + ", cap " +
         std::to_string(f.softcap) + (f.sinks ? ", sinks" : "") + (f.v_in_k ? ", V in K's rows" : "");
}

}  // namespace

TEST_CASE_TEMPLATE("decode with D_v, soft-cap, sinks and MLA's latent cache equals the exact reference", Kernel,
                   ReferenceKernel, CpuFlashKernel) {
  for (const DecodeCase& c : feature_cases()) {
    CAPTURE(c.ranks);
    CAPTURE(c.page);
    CAPTURE(c.new_tokens);
    CAPTURE(static_cast<int>(c.exchange));
    INFO(features_of(c));
    CHECK(run_decode_case<Kernel>(c) < 1e-5);
  }
}

TEST_CASE("decode: a sink counts once per row at 1..7 ranks, on the rank that merges the row") {
  // Stripes (page 1) spread the cache over every rank, so a sink joined to each rank's partial
  // would count P times; 7 heads split unevenly by the heads exchange put each rank's sinks
  // at its heads' global offset. The reference adds exp(sink) to each row's denominator once;
  // counted twice, the answer would move by far more than the tolerance (checked too).
  for (int P = 1; P <= 7; ++P)
    for (DecodeExchange ex : {DecodeExchange::all_gather, DecodeExchange::heads}) {
      CAPTURE(P);
      CAPTURE(static_cast<int>(ex));
      const DecodeCase c{P, {12, 3}, 1, 3, 7, 7, ex, 1, {.sinks = true}};
      CHECK(run_decode_case(c) < 1e-5);
      CHECK(test::double_sink_shift(c) > 1e-2);
    }
}

TEST_CASE("decode: bytes per step follow D_v (partials) and D (gathered queries), exactly") {
  // MLA's shapes on 3 ranks, B 2, T 1, 16 heads (6, 5, 5 by heads): partials of D_v + 1 floats
  // a row to every other rank that merges them, the queries of D elements of this rank's heads
  // to every other rank, each message with an 8-byte tag.
  const std::int64_t B = 2, H = 16, Dq = 576, Dv = 512;
  const std::int64_t owned[] = {6, 5, 5};
  for (DecodeExchange ex : {DecodeExchange::all_gather, DecodeExchange::heads})
    run_ranks(3, [&](ThreadCommunicator& world) {
      SequenceParallelDecode<ThreadCommunicator, ReferenceKernel> dec(world);
      const DecodePlan plan = dec.plan({.batch = B, .heads = H, .kv_heads = 1, .head_dim = Dq, .head_dim_v = Dv,
                                        .kv_len = {40, 7}, .capacity = 64, .page = 16, .exchange = ex});
      std::size_t want = 0;
      for (int v = 0; v < 3; ++v) {
        if (v == world.rank()) continue;
        const std::int64_t merged_heads = ex == DecodeExchange::heads ? owned[v] : H;
        want += static_cast<std::size_t>(B * merged_heads * (Dv + 1) * 4 + 8);
        if (ex == DecodeExchange::heads) want += static_cast<std::size_t>(B * owned[world.rank()] * Dq * 4 + 8);
      }
      CHECK(plan.step_bytes() == want);
    });
}

namespace {
/// A kernel with masks but neither soft-capping nor a D_v of its own.
struct PlainKernel : ReferenceKernel {
  static constexpr bool supports_softcap = false;
  static constexpr bool supports_value_dim = false;
};

/// How each of `ranks` ranks ends a decode plan of `problem(rank)` with `Kernel`.
template <class Kernel = ReferenceKernel, class Problem>
std::vector<test::RankOutcome> plan_outcomes(int ranks, Problem problem) {
  return test::rank_outcomes(ranks, [&](ThreadCommunicator& world) {
    SequenceParallelDecode<ThreadCommunicator, Kernel> dec(world);
    (void)dec.plan(problem(world.rank()));
  });
}
}  // namespace

TEST_CASE("decode: bad feature values, a kernel that lacks a feature and ranks that disagree on one are refused "
          "by name on every rank") {
  const DecodeProblem base{.batch = 1, .heads = 2, .head_dim = D, .kv_len = {3}, .capacity = 8};
  auto with = [&](auto change) {
    return [=](int rank) {
      DecodeProblem p = base;
      change(p, rank);
      return p;
    };
  };
  for (const double cap : {-1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    CAPTURE(cap);
    CHECK(test::all_same_config_error(plan_outcomes(2, with([cap](DecodeProblem& p, int) { p.softcap = cap; })),
                                      "decode plan: softcap: expected 0 (off) or a number from 2^-32 to 2^32, got "));
  }
  CHECK(test::all_same_config_error(plan_outcomes(2, with([](DecodeProblem& p, int) { p.head_dim_v = -3; })),
                                    "decode plan: head_dim_v: expected >= 1, or 0 for head_dim, got -3"));

  // The kernel's traits, in the attention plan's words; sinks need nothing of a kernel.
  CHECK(test::all_same_config_error(
      plan_outcomes<PlainKernel>(2, with([](DecodeProblem& p, int) { p.softcap = 30.0; })),
      "decode plan: this kernel does not soft-cap logits (softcap 30.000000): a kernel declares supports_softcap"));
  CHECK(test::all_same_config_error(
      plan_outcomes<PlainKernel>(2, with([](DecodeProblem& p, int) { p.head_dim_v = 4; })),
      "decode plan: this kernel needs V's head dim equal to Q's and K's (head_dim 8, head_dim_v 4)"));
  const float sinks[2] = {1.0f, 2.0f};
  for (const test::RankOutcome& o :
       plan_outcomes<PlainKernel>(2, with([&](DecodeProblem& p, int) { p.sinks = sinks; })))
    CHECK(o.kind == "none");

  // One rank of three differs: every rank names it, none hangs.
  CHECK(test::all_same_config_error(
      plan_outcomes(3, with([](DecodeProblem& p, int r) { p.softcap = r == 2 ? 30.0 : 0.0; })),
      "decode plan: ranks disagree on softcap: rank 0 has 0, rank 2 has 30"));
  CHECK(test::all_same_config_error(
      plan_outcomes(3, with([](DecodeProblem& p, int r) { p.head_dim_v = r == 1 ? 4 : 0; })),
      "decode plan: ranks disagree on head_dim_v: rank 0 has 8, rank 1 has 4"));
  CHECK(test::all_same_config_error(
      plan_outcomes(3, with([&](DecodeProblem& p, int r) { p.sinks = r == 1 ? sinks : nullptr; })),
      "decode plan: ranks disagree on sinks (given or not): rank 0 has false, rank 1 has true"));
}

TEST_CASE("decode: a V or output view without D_v columns is refused before any message") {
  // D 8, D_v 6: V may be K's rows (K's strides) but must show 6 columns; out has 6.
  run_ranks(2, [](ThreadCommunicator& world) {
    SequenceParallelDecode<ThreadCommunicator, ReferenceKernel> dec(world);
    DecodePlan plan = dec.plan({.batch = 1, .heads = 2, .head_dim = D, .head_dim_v = 6, .kv_len = {3}, .capacity = 8});
    const std::int64_t C = plan.shard_capacity();
    std::vector<float> q(2 * D), kc(static_cast<std::size_t>(C * 2 * D)), o(2 * D);
    std::vector<std::byte> ws(plan.workspace_bytes());
    using CV = TensorView<const float>;
    const CV qv = CV::bshd(q.data(), 1, 1, 2, D), kv = CV::bshd(kc.data(), 1, C, 2, D);
    CV latent = kv;
    latent.extent[3] = 6;
    const auto out6 = TensorView<float>::bshd(o.data(), 1, 1, 2, 6);
    const auto out8 = TensorView<float>::bshd(o.data(), 1, 1, 2, D);
    CHECK_THROWS_WITH_AS(dec.step<float>(plan, qv, kv, kv, out6, ws),
                         doctest::Contains("decode step: v_cache.head_dim: expected 6, got 8"), ConfigError);
    CHECK_THROWS_WITH_AS(dec.step<float>(plan, qv, kv, latent, out8, ws),
                         doctest::Contains("decode step: out.head_dim: expected 6, got 8"), ConfigError);
    CHECK_NOTHROW(dec.step<float>(plan, qv, kv, latent, out6, ws));  // refused calls left it usable
  });
}
