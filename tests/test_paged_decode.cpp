// Decode over an engine-owned paged pool with continuous batching: requests join after their
// prefill and leave when done, each step's sequences bring 0..16 new tokens, pages come from a
// free list in no order and are reused after free with NaN written into them; every step's
// rows equal attention over each sequence's whole cache in double, on 1-6 thread ranks, every
// placement (interleaved runs of 1, 3 and 16 tokens, contiguous), pool page sizes 1, 4, 16,
// CSR and dense block tables, GQA/MQA, both exchanges, today's models' features; bytes per step
// equal the plan's count for the step's rows.
#include <doctest/doctest.h>

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
