// Every policy under MPI against the exact reference, with the traffic held against the
// analytic count; uneven and empty slices with AnythingPolicy; and plan mismatches that must
// fail on every rank with the same message instead of hanging.
// Runs with any world size; the 2 x 2 mesh cases need 4 ranks and the disagreements 2 or
// more: their suites (mpi_suites.hpp) skip them elsewhere, visibly.

#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

#include "common.hpp"
#include "mpi_suites.hpp"
#include "support/scoped_env.hpp"
#include "seqpar/comm/mpi_communicator.hpp"

using namespace seqpar;
namespace ex = seqpar::examples;

namespace {

/// What one distributed forward produced, agreed over all ranks.
struct Outcome {
  ex::ErrorStats err;            ///< merged over the ranks
  bool bytes_match = false;      ///< every rank sent exactly plan.forward_bytes(rank)
  std::uint64_t bytes_rank0 = 0; ///< what rank 0 sent
  bool no_metadata = false;      ///< no rank did a host all-gather during forward
};

/// Plans and runs `policy` on this rank's slice of `shape`, with this rank's lengths from
/// `lengths(mesh, rank)` (default: as even as the mesh allows).
template <class T, class Policy>
Outcome run(MpiCommunicator& world, Policy policy, const ex::GlobalShape& shape,
            std::function<LocalLengths(const MeshConfig&, int)> lengths = {}) {
  SequenceParallelAttention<Policy, MpiCommunicator, CpuFlashKernel> attn(world, policy);
  const int me = world.rank();
  const LocalLengths mine = lengths ? lengths(attn.mesh(), me)
                                    : LocalLengths{split_sequence(shape.seq_q, attn.mesh())[static_cast<std::size_t>(me)],
                                                   split_sequence(shape.kv_len(), attn.mesh())[static_cast<std::size_t>(me)]};
  const Plan plan = attn.plan(shape.problem<T>(), mine);
  world.stats().reset();
  const ex::ErrorStats local = ex::forward_error<T>(attn, plan, ex::make_inputs(shape));
  const CommStats s = world.stats();
  Outcome o;
  o.err = ex::reduce_errors(world, local);
  const auto rows = ex::gather_rows(world, {static_cast<std::int64_t>(s.bytes_sent),
                                            static_cast<std::int64_t>(plan.forward_bytes(me)),
                                            static_cast<std::int64_t>(s.host_gathers)});
  o.bytes_match = o.no_metadata = true;
  for (const auto& r : rows) {
    o.bytes_match = o.bytes_match && r[0] == r[1];
    o.no_metadata = o.no_metadata && r[2] == 0;
  }
  o.bytes_rank0 = static_cast<std::uint64_t>(rows[0][0]);
  return o;
}

/// A self-attention problem with the examples' seed.
ex::GlobalShape shape_of(std::int64_t seq, std::int64_t heads, std::int64_t kv_heads, std::int64_t dim, bool causal) {
  return ex::make_case(seq, heads, kv_heads, dim, causal, ex::GlobalShape{}.seed);
}

/// What collective_error found: this rank's ConfigError message ("" if none), and whether all
/// ranks got the same one. (A struct, not a pair to unpack: doctest's INFO and CAPTURE take
/// their argument into a lambda, which Clang before 16 cannot do with a structured binding.)
struct CollectiveError {
  std::string message;  ///< this rank's ConfigError message, "" if none
  bool same = false;    ///< whether every rank got the same message
};

/// The ConfigError message each rank got from `body`, and whether all ranks got the same one:
/// a collective check must fail everywhere alike.
CollectiveError collective_error(MpiCommunicator& world, const std::function<void()>& body) {
  std::string what;
  try {
    body();
  } catch (const ConfigError& e) {
    what = e.what();
  }
  const auto rows = ex::gather_rows(world, {static_cast<std::int64_t>(std::hash<std::string>{}(what))});
  bool same = true;
  for (const auto& r : rows) same = same && r[0] == rows[0][0];
  world.barrier();  // nobody is left waiting in a collective the others abandoned
  return {what, same};
}

}  // namespace

TEST_CASE("MPI: Ulysses matches the reference and sends (P-1)/P of its Q, K, V and O slices") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size();
  const ex::GlobalShape s = shape_of(64 * P, 2 * P, P, 32, false);
  const Outcome f = run<float>(world, UlyssesPolicy{}, s);
  CHECK(f.err.rel() <= 1e-5);
  CHECK(f.bytes_match);
  CHECK(f.no_metadata);
  // B * (L/P) * D * (2H + 2K) * (P-1)/P elements of 4 bytes, with L/P = 64.
  CHECK(f.bytes_rank0 == static_cast<std::uint64_t>(4 * 64 * 32 * (2 * s.heads + 2 * s.kv_heads) * (P - 1) / P));
  CHECK(run<double>(world, UlyssesPolicy{}, s).err.rel() <= 1e-12);
}

TEST_CASE("MPI: causal zigzag Ring matches the reference and sends P-1 K/V blocks") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size();
  const ex::GlobalShape s = shape_of(2 * P * 40, 4, 2, 16, true);
  const Outcome f = run<float>(world, RingPolicy<Zigzag>{}, s);
  CHECK(f.err.rel() <= 1e-5);
  CHECK(f.bytes_match);
  CHECK(f.no_metadata);
  CHECK(f.bytes_rank0 == static_cast<std::uint64_t>(2 * 4 * 80 * 2 * 16 * (P - 1)));
  CHECK(run<double>(world, RingPolicy<Zigzag>{}, s).err.rel() <= 1e-12);
  CHECK(run<float>(world, RingPolicy<Stripe>{}, s).err.rel() <= 1e-5);
}

TEST_CASE("MPI: Unified 2 x 2 (zigzag, causal, GQA) matches the reference and the USP traffic" *
          doctest::test_suite(mpi_test::four_ranks)) {
  MpiCommunicator world(MPI_COMM_WORLD);
  REQUIRE(world.size() == 4);
  const ex::GlobalShape s = shape_of(4 * 96, 8, 4, 16, true);
  const UnifiedPolicy<Zigzag> policy{.ulysses_degree = 2, .ring_degree = 2};
  const Outcome f = run<float>(world, policy, s);
  CHECK(f.err.rel() <= 1e-5);
  CHECK(f.bytes_match);
  // s * B * (L/P) * D * [(2H + 2K)(U-1)/U + 2K(R-1)] with L/P = 96, H = 8, K = 4, U = R = 2.
  CHECK(f.bytes_rank0 == static_cast<std::uint64_t>(4 * 96 * 16 * ((2 * 8 + 2 * 4) / 2 + 2 * 4 * 1)));
  CHECK(run<double>(world, policy, s).err.rel() <= 1e-12);
  const UnifiedPolicy<Contiguous> ring_adjacent{.ulysses_degree = 2, .ring_degree = 2, .placement = MeshPlacement::ring_adjacent};
  CHECK(run<float>(world, ring_adjacent, s).err.rel() <= 1e-5);
}

TEST_CASE("MPI: sinks, soft-cap and D_v != D together under every policy, the traffic sized by D and D_v") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size();
  ex::GlobalShape s = shape_of(24 * P, 2 * P, P, 24, true);
  s.head_dim_v = 40;
  s.softcap = 2.5;
  s.scale = 0.6;  // scores spread past the cap
  for (std::int64_t h = 0; h < s.heads; ++h) s.sinks.push_back(static_cast<float>((h % 5) * 2 - 4));  // -4..4
  for (const Outcome& f : {run<float>(world, UlyssesPolicy{}, s), run<float>(world, RingPolicy<Zigzag>{}, s),
                           run<float>(world, AnythingPolicy<RingPolicy<Stripe>>{}, s)}) {
    CHECK(f.err.rel() <= 1e-5);
    CHECK(f.bytes_match);
  }
  CHECK(run<double>(world, RingPolicy<Zigzag>{}, s).err.rel() <= 1e-12);
  // A contiguous ring sends P - 1 K/V blocks of 24 rows x P K/V heads, each K (D 24) and V (D_v 40).
  const Outcome ring = run<float>(world, RingPolicy<Contiguous>{}, s);
  CHECK(ring.err.rel() <= 1e-5);
  CHECK(ring.bytes_rank0 == static_cast<std::uint64_t>(4 * 24 * P * (24 + 40) * (P - 1)));
}

TEST_CASE("MPI: AnythingPolicy at seq 4099 or 3969, heads that do not divide, exact traffic") {
  MpiCommunicator world(MPI_COMM_WORLD);
  // One length per world size (the double reference is most of this case's time): ctest's 4
  // ranks get 4099 (remainders 3 of 4 ranks and of zigzag's 8 chunks), its 3 ranks 3969
  // (remainder 3 of zigzag's 6 chunks); the 2 x 2 mesh case below takes 3969 on 4 ranks.
  {
    const std::int64_t seq = world.size() % 2 == 1 ? 3969 : 4099;
    CAPTURE(seq);
    const ex::GlobalShape s = shape_of(seq, 5, 5, 8, true);
    const Outcome u = run<float>(world, AnythingPolicy<UlyssesPolicy>{}, s);
    CHECK(u.err.rel() <= 1e-5);
    CHECK(u.bytes_match);
    CHECK(u.no_metadata);
    const Outcome r = run<float>(world, AnythingPolicy<RingPolicy<Zigzag>>{}, s);
    CHECK(r.err.rel() <= 1e-5);
    CHECK(r.bytes_match);
  }
}

TEST_CASE("MPI: AnythingPolicy over a 2 x 2 mesh at seq 3969, heads that do not divide, exact traffic" *
          doctest::test_suite(mpi_test::four_ranks)) {
  MpiCommunicator world(MPI_COMM_WORLD);
  REQUIRE(world.size() == 4);
  {
    const std::int64_t seq = 3969;
    CAPTURE(seq);
    const ex::GlobalShape g = shape_of(seq, 6, 3, 8, true);
    const Outcome m = run<float>(world, AnythingPolicy<UnifiedPolicy<Zigzag>>{{.ulysses_degree = 2, .ring_degree = 2}}, g);
    CHECK(m.err.rel() <= 1e-5);
    CHECK(m.bytes_match);
    CHECK(m.no_metadata);
  }
}

TEST_CASE("MPI: AnythingPolicy with a rank that holds no tokens, and joint Q/KV lengths") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size();
  // Rank 0 holds nothing; each next rank two thirds of what is left, the last the rest.
  auto lengths = [](std::int64_t total) {
    return [total](const MeshConfig& m, int w) -> LocalLengths {
      std::int64_t rest = total, mine = m.world() == 1 ? total : 0;
      for (int v = 1; v < m.world(); ++v) {
        const std::int64_t take = v + 1 == m.world() ? rest : rest * 2 / 3;
        if (v == w) mine = take;
        rest -= take;
      }
      return {mine, mine};
    };
  };
  const ex::GlobalShape s = shape_of(301, 6, 2, 16, true);
  for (int zigzag = 0; zigzag < 2; ++zigzag) {
    const Outcome r = zigzag ? run<float>(world, AnythingPolicy<RingPolicy<Zigzag>>{}, s, lengths(s.seq_q))
                             : run<float>(world, AnythingPolicy<RingPolicy<>>{}, s, lengths(s.seq_q));
    CHECK(r.err.rel() <= 1e-5);
    CHECK(r.bytes_match);
  }
  const Outcome u = run<double>(world, AnythingPolicy<UlyssesPolicy>{}, s, lengths(s.seq_q));
  CHECK(u.err.rel() <= 1e-12);
  CHECK(u.bytes_match);
  // Joint attention: 37 queries against 250 keys, split differently (the last rank holds no queries).
  ex::GlobalShape j = shape_of(37, 4, 4, 16, false);
  j.seq_kv = 250;
  const Outcome joint = run<float>(world, AnythingPolicy<UlyssesPolicy>{}, j, [&](const MeshConfig& m, int w) {
    const std::vector<std::int64_t> q = P == 1 ? std::vector<std::int64_t>{37} : split_evenly(37, P - 1);
    return LocalLengths{w < static_cast<int>(q.size()) ? q[static_cast<std::size_t>(w)] : 0, split_sequence(250, m)[static_cast<std::size_t>(w)]};
  });
  CHECK(joint.err.rel() <= 1e-5);
  CHECK(joint.bytes_match);
}

TEST_CASE("MPI: ranks that disagree on a plan all throw the same ConfigError, none hangs" *
          doctest::test_suite(mpi_test::two_or_more_ranks)) {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size(), me = world.rank();
  REQUIRE(P >= 2);
  SequenceParallelAttention<UlyssesPolicy, MpiCommunicator, CpuFlashKernel> attn(world);
  AttentionProblem p = shape_of(64 * P, 2 * P, 0, 16, false).problem<float>();
  const CollectiveError heads = collective_error(world, [&] {
    AttentionProblem mine = p;
    if (me == 1) mine.heads = 4 * P;  // one rank disagrees
    attn.plan(mine, {64});
  });
  INFO(heads.message);
  CHECK(heads.same);
  CHECK(heads.message.find("ranks disagree on heads") != std::string::npos);
  CHECK(heads.message.find("rank 1 has") != std::string::npos);

  const CollectiveError len = collective_error(world, [&] { attn.plan(p, {me == P - 1 ? 63 : 64}); });
  INFO(len.message);
  CHECK(len.same);
  CHECK(len.message.find("AnythingPolicy") != std::string::npos);

  // After all that the plan still works.
  CHECK(world.size() == P);
  const Plan ok = attn.plan(p, {64});
  CHECK(ok.global_q() == 64 * P);
}

TEST_CASE("MPI: under SEQPAR_CHECK_CALLS=1, ranks that pass different plans all refuse the call alike" *
          doctest::test_suite(mpi_test::two_or_more_ranks)) {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size(), me = world.rank();
  REQUIRE(P >= 2);
  const ex::GlobalShape shape = shape_of(16 * P + 3, 2 * P, P, 16, true);
  const test::ScopedEnv on(check_calls_env, "1");
  SequenceParallelAttention<AnythingPolicy<UlyssesPolicy>, MpiCommunicator, CpuFlashKernel> attn(world);
  CHECK(attn.checks_calls());
  const LocalLengths mine{split_evenly(shape.seq_q, P)[static_cast<std::size_t>(me)]};
  const Plan causal = attn.plan(shape.problem<float>(), mine);
  AttentionProblem other = shape.problem<float>();
  other.causal = false;  // the same message sizes: without the check, wrong rows and no error
  const Plan not_causal = attn.plan(other, mine);
  const auto g = ex::make_inputs(shape);
  const CollectiveError refusal = collective_error(world, [&] { ex::forward_error<float>(attn, me == 1 ? not_causal : causal, g); });
  INFO(refusal.message);
  CHECK(refusal.same);
  CHECK(refusal.message.find("forward: ranks pass different plans (SEQPAR_CHECK_CALLS): rank(s) 1 pass a plan other than rank(s) 0") ==
        0);
  // Nothing was latched: the matched call is exact.
  CHECK(ex::reduce_errors(world, ex::forward_error<float>(attn, causal, g)).rel() <= 1e-5);
}

TEST_CASE("MPI: ranks that disagree on the mesh's factorisation all throw the same ConfigError" *
          doctest::test_suite(mpi_test::four_ranks)) {
  MpiCommunicator world(MPI_COMM_WORLD);
  REQUIRE(world.size() == 4);
  const int me = world.rank();
  const CollectiveError mesh_error = collective_error(world, [&] {
    UnifiedPolicy<> mine{.ulysses_degree = me == 2 ? 4 : 2, .ring_degree = me == 2 ? 1 : 2};
    SequenceParallelAttention<UnifiedPolicy<>, MpiCommunicator, CpuFlashKernel> bad(world, mine);
  });
  INFO(mesh_error.message);
  CHECK(mesh_error.same);
  CHECK(mesh_error.message.find("ranks disagree on ulysses_degree") != std::string::npos);
  // After it a plan still works.
  SequenceParallelAttention<UlyssesPolicy, MpiCommunicator, CpuFlashKernel> attn(world);
  CHECK(attn.plan(shape_of(64 * 4, 8, 0, 16, false).problem<float>(), {64}).global_q() == 64 * 4);
}
