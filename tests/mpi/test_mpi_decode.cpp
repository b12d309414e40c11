// Decode steps under MPI: today's models' features (a value head dim, soft-capping, sinks
// and MLA's latent cache, V the first D_v columns of K's rows) and the paged, continuously
// batched step over an engine's pool; every step against the exact
// double reference (tests/support/decode_check.hpp) and every step's bytes the plan's. Runs at
// any world size (the suite runs it at 3 and 4 ranks, the paged decode also at 2).

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <vector>

#include "common.hpp"
#include "seqpar/comm/mpi_communicator.hpp"
#include "support/decode_check.hpp"
#include "support/paged_check.hpp"

using namespace seqpar;

TEST_CASE("MPI: decode steps with D_v, soft-cap, sinks and MLA's latent cache equal the exact reference") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size();
  using E = DecodeExchange;
  const test::DecodeFeatures latent{.head_dim = 24, .head_dim_v = 16, .softcap = 1.5, .sinks = true, .v_in_k = true};
  const test::DecodeFeatures mla{.head_dim = 576, .head_dim_v = 512, .softcap = 2.0, .sinks = true, .v_in_k = true};
  const std::vector<test::DecodeCase> cases = {
      {P, {40, 3}, 1, 3, 6, 2, E::heads, 2, latent},         // stripes, GQA, heads split over the ranks
      {P, {17, 50}, 16, 1, 16, 1, E::all_gather, 2, mla},    // MLA's decode: one latent head, 16 query heads
  };
  for (const test::DecodeCase& c : cases) {
    CAPTURE(c.page);
    const test::Truth tr(c, test::decode_problem(c).capacity);
    const double mine = test::decode_rank_error<CpuFlashKernel>(world, c, tr);
    double worst = 0;
    for (const auto& row : examples::gather_rows(world, {std::bit_cast<std::int64_t>(mine)}))
      worst = std::max(worst, std::bit_cast<double>(row[0]));
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("MPI: paged decode with continuous batching equals the exact reference; a bad batch is named everywhere") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size();
  using E = DecodeExchange;
  // Requests join and leave, T_b 0..16, pages reused after free with NaN in them, GQA and MQA,
  // interleaved and contiguous placements, CSR and dense tables; one case with every feature.
  const test::DecodeFeatures all{.head_dim = 12, .head_dim_v = 8, .softcap = 2.0, .sinks = true, .v_in_k = true};
  const std::vector<test::PagedCase> cases = {
      {.ranks = P, .interleave = 16, .page_size = 16, .heads = 4, .kv_heads = 2, .exchange = E::all_gather, .steps = 10},
      {.ranks = P, .interleave = 1, .page_size = 4, .heads = 6, .kv_heads = 1, .exchange = E::heads, .steps = 8,
       .dense_table = true},
      {.ranks = P, .interleave = 0, .page_size = 4, .heads = 4, .kv_heads = 4, .exchange = E::all_gather, .steps = 8,
       .features = all},
  };
  for (const test::PagedCase& c : cases) {
    CAPTURE(c.interleave);
    const test::Schedule sch(c);
    const double mine = test::paged_rank_error<CpuFlashKernel>(world, c, sch);
    double worst = 0;
    for (const auto& row : examples::gather_rows(world, {std::bit_cast<std::int64_t>(mine)}))
      worst = std::max(worst, std::bit_cast<double>(row[0]));
    CHECK(worst < 1e-5);
  }
  // The last rank's block table lacks a page: every rank throws the same refusal naming it,
  // and the next step runs.
  for (E ex : {E::all_gather, E::heads}) {
    std::string what;
    try {
      test::small_paged_step(
          world, [&](int r, test::SmallStep& s) {
            if (r == P - 1) {
              s.indices.pop_back();
              --s.indptr.back();
            }
          },
          false, ex);
    } catch (const ConfigError& e) {
      what = e.what();
    }
    CHECK(what.find("rank " + std::to_string(P - 1) + " refused the step") != std::string::npos);
    CHECK_NOTHROW(test::small_paged_step(world, [](int, test::SmallStep&) {}, false, ex));
  }
}
