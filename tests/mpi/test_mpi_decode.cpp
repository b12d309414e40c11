// Decode steps under MPI with today's models' features: a value head dim, soft-capping, sinks
// and MLA's latent cache (V the first D_v columns of K's rows), every step against the exact
// double reference (tests/support/decode_check.hpp) and every step's bytes the plan's. Runs at
// any world size (the suite runs it at 3 and 4 ranks).

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <vector>

#include "common.hpp"
#include "seqpar/comm/mpi_communicator.hpp"
#include "support/decode_check.hpp"

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
