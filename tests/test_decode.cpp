// Decode over a sharded KV cache: every step against attention over the whole cache in double,
// for world sizes 1-8, ragged caches (some empty on some ranks), contiguous and paged layouts
// (page 1, 16, larger than a shard), 1 and 16 new tokens, GQA, both exchanges, growth over many
// steps with appends on the owner rank; bytes per step equal the plan's count; a rank that
// advanced differently is named on every rank.
#include <doctest/doctest.h>

#include <vector>

#include "support/decode_check.hpp"
#include "support/rank_outcomes.hpp"

using namespace seqpar;
using test::D;
using test::DecodeCase;
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
