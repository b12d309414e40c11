// Decode steps under MPI: today's models' features (a value head dim, soft-capping, sinks
// and MLA's latent cache, V the first D_v columns of K's rows) and the paged, continuously
// batched step over an engine's pool; every step against the exact
// double reference (tests/support/decode_check.hpp) and every step's bytes the plan's. Runs at
// any world size (the suite runs it at 3 and 4 ranks, the paged decode also at 2).

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <string>
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

// Last in this file: the ranks' exchanges end in errors, after which this communicator is not
// used again.
TEST_CASE("MPI: a paged step whose row count differs on one rank fails on every rank, even after an agreeing step") {
  // Two plans of one PagedDecode share a workspace, as an engine's layers do. Plan a's step:
  // every rank 4 rows. Plan b's step (the same step count): the last rank gives the same batch
  // again, the others one row fewer. The last rank's receives are then longer than its peers'
  // messages, which MPI does not report: the tag each message starts with must show it (a tag
  // at the end of the receive was plan a's, equal to what the last rank expects). A rank whose
  // MPI exchange aborted on a truncated message stops sending, so with 3 ranks and more a peer
  // waits for it: the time-out (off by default, as in MPI) ends that wait with a CommError.
  MpiCommunicator world(MPI_COMM_WORLD);
  world.set_timeout(std::chrono::milliseconds(5000));
  const int P = world.size();
  PagedDecode<MpiCommunicator, ReferenceKernel> dec(world);
  const PagedDecodeProblem pr{.max_batch = 4, .max_new_tokens = 4, .heads = 3, .head_dim = 4, .interleave = 2};
  PagedDecodePlan a = dec.plan(pr), b = dec.plan(pr);
  const std::int64_t pages = 16, page = 4;
  std::vector<float> pool(static_cast<std::size_t>(pages * page * 3 * 4)), q(16 * 3 * 4), out(q.size());
  for (std::size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(std::cos(0.21 * static_cast<double>(i)));
  std::vector<std::byte> ws(std::max(a.workspace_bytes(), b.workspace_bytes()));
  auto step = [&](PagedDecodePlan& plan, std::vector<std::int64_t> new_tokens) {
    const std::vector<std::int64_t> ids{7, 9}, kv_len{10, 5}, split{0, 0};
    std::vector<std::int32_t> indptr{0}, indices;
    for (std::size_t s = 0; s < 2; ++s) {
      const std::int64_t need = (plan.local_tokens(kv_len[s] + new_tokens[s]) + page - 1) / page;
      for (std::int64_t i = 0; i < need; ++i) indices.push_back(static_cast<std::int32_t>(indices.size()));
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
    }
    using In = TensorView<const float>;
    const In kv = In::bshd(pool.data(), pages, page, 3, 4);
    return dec.step<float>(plan, {ids, kv_len, new_tokens, split, BlockTable::csr(indptr, indices)},
                           In::bshd(q.data(), 1, 16, 3, 4), kv, kv, TensorView<float>::bshd(out.data(), 1, 16, 3, 4), ws);
  };
  CHECK(step(a, {2, 2}) == 4);
  bool threw = false;
  try {
    (void)step(b, world.rank() == P - 1 ? std::vector<std::int64_t>{2, 2} : std::vector<std::int64_t>{2, 1});
  } catch (const std::exception&) {
    threw = true;
  }
  CHECK(threw);
  MPI_Barrier(MPI_COMM_WORLD);
}
