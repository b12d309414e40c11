// The cost model and the advisor: the plan it builds without communicating is the plan every
// rank builds together (work and bytes per rank, for uneven lengths and meshes); each phase's
// estimate is the model's arithmetic, checked by hand on shapes small enough to count; ranks
// sharing cores, links crossing nodes and causal imbalance move the estimate the way they
// should; the advisor ranks what runs and gives plan's reason for what does not; calibrate and
// the estimates refuse what they cannot measure or model.
#include <algorithm>
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "seqpar/advise/advisor.hpp"
#include "seqpar/advise/calibrate.hpp"
#include "seqpar/advise/machines.hpp"
#include "seqpar/seqpar.hpp"

using namespace seqpar;

namespace {

AttentionProblem problem(std::int64_t heads, std::int64_t kv_heads, std::int64_t dim, bool causal) {
  AttentionProblem p;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = dim;
  p.causal = causal;
  p.dtype = DType::f32;
  return p;
}

/// A machine whose numbers make hand counts easy: 1 GFLOP/s, links of 1 MB/s, no latency.
Machine slow_machine(int ranks_per_node, int cores_per_node = 0) {
  Machine m;
  m.ranks_per_node = ranks_per_node;
  m.cores_per_node = cores_per_node;
  m.intra = {1e-3, 0};
  m.inter = {0.5e-3, 0};
  m.forward_gflops = 1;
  m.backward_gflops = 0.5;
  m.copy_gbytes_per_s = 1;
  return m;
}

std::vector<LocalLengths> even(std::int64_t total, const MeshConfig& mesh) {
  std::vector<LocalLengths> l;
  for (std::int64_t n : split_sequence(total, mesh)) l.push_back({n, -1});
  return l;
}

double ms(Estimate::PhaseMs t, Phase p) { return t[static_cast<int>(p)]; }

/// Every rank's collective plan against the offline one: work and bytes of every rank.
template <class Policy>
void check_offline_plan(int ranks, Policy policy, const AttentionProblem& pr, std::int64_t seq) {
  const std::vector<LocalLengths> lengths = even(seq, mesh_config(policy, ranks));
  const Plan offline = detail::offline_plan(policy, pr, std::span<const LocalLengths>(lengths));
  std::vector<int> mismatches(static_cast<std::size_t>(ranks), 0);
  run_ranks(ranks, [&](ThreadCommunicator& comm) {
    SequenceParallelAttention<Policy, ThreadCommunicator, ReferenceKernel> attn(comm, policy);
    const Plan p = attn.plan(pr, lengths[static_cast<std::size_t>(comm.rank())]);
    for (int w = 0; w < ranks; ++w)
      if (p.work(w) != offline.work(w) || p.forward_bytes(w) != offline.forward_bytes(w) ||
          p.backward_bytes(w) != offline.backward_bytes(w))
        ++mismatches[static_cast<std::size_t>(comm.rank())];
  });
  for (int n : mismatches) CHECK(n == 0);
}

}  // namespace

TEST_CASE("the offline plan is the plan the ranks build together") {
  check_offline_plan(4, AnythingPolicy<UnifiedPolicy<Zigzag>>{{2, 2}}, problem(6, 3, 32, true), 389);
  check_offline_plan(3, AnythingPolicy<RingPolicy<Stripe>>{}, problem(4, 1, 16, true), 101);
  check_offline_plan(5, AnythingPolicy<UlyssesPolicy>{}, problem(7, 7, 16, false), 97);
  check_offline_plan(6, UnifiedPolicy<Contiguous>{3, 2, MeshPlacement::ring_adjacent}, problem(6, 2, 16, false), 120);
}

TEST_CASE("ring forward and backward, counted by hand: the hop hides the compute it outlasts") {
  // 2 ranks, 1024 tokens, one head of D 64, f32, not causal: each step 512 x 512 pairs.
  const AttentionProblem pr = problem(1, 1, 64, false);
  const Machine m = slow_machine(8);
  const Estimate e = estimate(RingPolicy<Contiguous>{}, pr, 1024, -1, 2, m);
  const double pairs = 512.0 * 512.0, fwd_step = pairs * 256 / 1e6;  // ms at 1 GFLOP/s
  const double block = 512.0 * 128 * 4;                               // K and V of one block, bytes
  const double hop = block / (1e-3 * 1e6);                            // ms at 1 MB/s
  const double merge = 512.0 * 65 * 4 * 3 / 1e6;                     // output and LSE, read twice, written once
  CHECK(ms(e.forward, Phase::compute) == doctest::Approx(2 * fwd_step));
  CHECK(ms(e.forward, Phase::merge) == doctest::Approx(merge));
  CHECK(ms(e.forward, Phase::wait) == doctest::Approx(hop - fwd_step));  // step 0 waits for its hop
  CHECK(ms(e.forward, Phase::pack) == doctest::Approx(block / 1e6));
  CHECK(ms(e.forward, Phase::finish) == doctest::Approx(512.0 * 64 * 8 / 1e6));
  CHECK(ms(e.forward, Phase::all_to_all_in) == 0);
  CHECK(e.forward_bytes == static_cast<std::size_t>(block));
  CHECK(e.backward_bytes == static_cast<std::size_t>(block + 2 * block));  // K/V once, dK/dV twice (home)
  // Backward: 2.5x the FLOPs at half the rate; dK/dV travel every step, K/V all but the last.
  const double bwd_step = 2.5 * fwd_step * 2;
  CHECK(ms(e.backward, Phase::compute) == doctest::Approx(2 * bwd_step));
  CHECK(ms(e.backward, Phase::wait) == doctest::Approx(std::max(0.0, 2 * hop - bwd_step) + std::max(0.0, hop - bwd_step)));
  CHECK(e.forward_ms() == doctest::Approx(block / 1e6 + hop + fwd_step + merge + 512.0 * 64 * 8 / 1e6));
}

TEST_CASE("Ulysses all-to-all: bytes to the node's ranks and to other nodes' move at once") {
  // 4 ranks, 2 per node: each rank sends a third of its bytes inside its node, two thirds out.
  const AttentionProblem pr = problem(4, 4, 32, false);
  const Estimate one_node = estimate(UlyssesPolicy{}, pr, 400, -1, 4, slow_machine(4));
  const Estimate two_nodes = estimate(UlyssesPolicy{}, pr, 400, -1, 4, slow_machine(2));
  const double sent = 3.0 * 100 * 3 * 32 * 4;  // Q, K, V: 100 rows, 3 of 4 heads leave, D 32, f32
  CHECK(ms(one_node.forward, Phase::all_to_all_in) == doctest::Approx(sent / 1e3));
  CHECK(ms(two_nodes.forward, Phase::all_to_all_in) == doctest::Approx(sent * 2 / 3 / 0.5e3));
  CHECK(ms(one_node.forward, Phase::all_to_all_out) == doctest::Approx(sent / 3 / 1e3));
  CHECK(ms(one_node.forward, Phase::compute) == doctest::Approx(400.0 * 400 * 128 / 1e6));
  CHECK(one_node.forward_bytes == static_cast<std::size_t>(sent * 4 / 3));
}

TEST_CASE("ranks sharing cores share them step by step; causal contiguous rings are slow") {
  const AttentionProblem pr = problem(2, 2, 32, true);
  const Estimate own = estimate(RingPolicy<Zigzag>{}, pr, 512, -1, 4, slow_machine(4));
  const Estimate shared = estimate(RingPolicy<Zigzag>{}, pr, 512, -1, 4, slow_machine(4, 2));
  CHECK(ms(shared.forward, Phase::compute) == doctest::Approx(2 * ms(own.forward, Phase::compute)));
  CHECK(own.imbalance() == doctest::Approx(1.0));
  const Estimate contiguous = estimate(RingPolicy<Contiguous>{}, pr, 512, -1, 4, slow_machine(4));
  CHECK(contiguous.imbalance() > 1.5);
  CHECK(ms(contiguous.forward, Phase::compute) > 1.5 * ms(own.forward, Phase::compute));
  // Sharing 2 cores, a causal contiguous ring's idle ranks leave their cores to the busy ones:
  // per step max(longest, summed / 2) over a diagonal block d and full blocks f of 128 rows:
  // step 0 four d (2d), step 1 three f (1.5f), steps 2 and 3 two and one f (f each).
  const Estimate contiguous_shared = estimate(RingPolicy<Contiguous>{}, pr, 512, -1, 4, slow_machine(4, 2));
  const double d = 128.0 * 129 / 2, f = 128.0 * 128;
  CHECK(ms(contiguous_shared.forward, Phase::compute) ==
        doctest::Approx(ms(contiguous.forward, Phase::compute) * (2 * d + 3.5 * f) / (d + 3 * f)));
}

TEST_CASE("the advisor ranks what runs and says why the rest does not") {
  const AttentionProblem pr = problem(8, 8, 128, true);
  const Machine h100 = machines::h100_sxm_nvlink_ib();
  const std::vector<Choice> cs = advise(pr, 1 << 18, -1, 16, h100, true);
  REQUIRE(!cs.empty());
  REQUIRE(cs.front().runs);
  bool sorted = true, refused_ulysses = false, anything_ulysses = false;
  double fastest = cs.front().ms;
  for (std::size_t i = 2; i < cs.size(); ++i)
    if (cs[i].runs && cs[i].ms < cs[i - 1].ms) sorted = false;
  for (const Choice& c : cs)
    if (c.runs) fastest = std::min(fastest, c.ms);
  CHECK(cs.front().ms <= fastest * 1.03);  // the first: the simplest within 3% of the fastest
  for (const Choice& c : cs) {
    if (c.name == "ulysses") refused_ulysses = !c.runs && c.reason.find("divisible") != std::string::npos;
    if (c.name == "anything ulysses") anything_ulysses = c.runs;
  }
  CHECK(sorted);
  CHECK(refused_ulysses);   // 8 heads on 16 ranks
  CHECK(anything_ulysses);  // ... runs as AnythingPolicy
  // Causal: the first choice balances its ring; across nodes it keeps the all-to-all inside one.
  CHECK(cs.front().estimate.imbalance() < 1.01);
  CHECK(cs.front().mesh.placement == MeshPlacement::ulysses_adjacent);
  CHECK(cs.front().mesh.ulysses == 8);
  CHECK_THROWS_AS(machines::by_name("no-such-machine"), ConfigError);
}

TEST_CASE("ranks sharing a core share it evenly while they compute") {
  Machine m = slow_machine(2, 1);
  const detail::RankSeat seat{m, 2};
  std::vector<double> works{1.0, 3.0};
  seat.share_cores(works);
  // Both at half a core until the first is done at 2; the second's last 2 at a whole core.
  CHECK(works[0] == doctest::Approx(2.0));
  CHECK(works[1] == doctest::Approx(4.0));
  std::vector<double> idle{0.0, 3.0};
  seat.share_cores(idle);
  CHECK(idle[0] == 0.0);
  CHECK(idle[1] == doctest::Approx(3.0));  // an idle rank leaves its core
}

TEST_CASE("the advisor's first choice is the simplest within its margin") {
  const AttentionProblem pr = problem(8, 8, 64, true);
  const Machine h100 = machines::h100_sxm_nvlink_ib();
  const std::vector<Choice> exact = advise(pr, 1 << 15, -1, 8, h100, false, 0.0);
  const std::vector<Choice> lenient = advise(pr, 1 << 15, -1, 8, h100, false, 10.0);
  REQUIRE(exact.front().runs);
  for (const Choice& c : exact)
    if (c.runs) CHECK(exact.front().ms <= c.ms);
  CHECK(lenient.front().mesh.ring == 1);  // every choice is within 1000%: Ulysses has no ring step
}

TEST_CASE("calibrate refuses options it cannot measure with, on every rank; the estimates refuse a K/V length below -1") {
  // The latency probe sends 8 bytes out of the exchange buffers (fewer bytes: it wrote past
  // them), and no tokens give no rate (advise then ranked a choice at NaN ms first).
  auto refuse = [](CalibrationOptions opt, int bad_rank, const char* needle) {
    std::vector<std::string> what(2);
    run_ranks(2, [&](ThreadCommunicator& c) {
      CalibrationOptions mine = c.rank() == bad_rank ? opt : CalibrationOptions{.tokens = 16, .rounds = 1};
      try {
        (void)calibrate<float>(c, ReferenceKernel{}, problem(2, 0, 8, false), Machine{}, mine);
      } catch (const ConfigError& e) {
        what[static_cast<std::size_t>(c.rank())] = e.what();
      }
    }, ThreadRunOptions{.timeout = std::chrono::milliseconds(10000)});
    INFO(what[0] << " | " << what[1]);
    CHECK(what[static_cast<std::size_t>(bad_rank)].find(needle) != std::string::npos);
    CHECK(what[static_cast<std::size_t>(1 - bad_rank)].find("calibrate: rank " + std::to_string(bad_rank)) == 0);
  };
  refuse({.tokens = 16, .rounds = 1, .exchange_bytes = 4}, 0, "exchange_bytes: expected at least 8");
  refuse({.tokens = 0, .rounds = 1}, 1, "tokens: expected at least 1, got 0");
  CHECK_THROWS_WITH_AS(advise(problem(2, 0, 8, false), 64, -2, 2, Machine{}, false),
                       doctest::Contains("seq_kv: expected a length, or -1"), ConfigError);
  // A problem with nothing to time (batch 0, which plans take) is refused too: its rates came
  // out 0, and every estimate on that machine NaN.
  std::vector<std::string> empty(2);
  run_ranks(2, [&](ThreadCommunicator& c) {
    AttentionProblem none = problem(2, 0, 8, false);
    none.batch = 0;
    try {
      (void)calibrate<float>(c, ReferenceKernel{}, none, Machine{}, {.tokens = 16, .rounds = 1});
    } catch (const ConfigError& e) {
      empty[static_cast<std::size_t>(c.rank())] = e.what();
    }
  }, ThreadRunOptions{.timeout = std::chrono::milliseconds(10000)});
  for (const std::string& what : empty) CHECK(what.find("expected batch, heads and head_dim >= 1, got 0, 2 and 8") != std::string::npos);
}

TEST_CASE("estimates refuse a machine without positive finite rates and finite fixed costs") {
  const AttentionProblem pr = problem(4, 0, 8, true);
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  struct Bad {
    void (*edit)(Machine&, double);
    double value;
    const char* needle;
  };
  const Bad cases[] = {
      {[](Machine& m, double v) { m.forward_gflops = v; }, 0.0, "forward_gflops: expected a positive finite rate, got 0"},
      {[](Machine& m, double v) { m.backward_gflops = v; }, -1.0, "backward_gflops: expected a positive finite rate, got -1"},
      {[](Machine& m, double v) { m.copy_gbytes_per_s = v; }, inf, "copy_gbytes_per_s: expected a positive finite rate"},
      {[](Machine& m, double v) { m.intra.gbytes_per_s = v; }, nan, "intra.gbytes_per_s: expected a positive finite rate"},
      {[](Machine& m, double v) { m.inter.gbytes_per_s = v; }, -2.0, "inter.gbytes_per_s: expected a positive finite rate"},
      {[](Machine& m, double v) { m.inter.latency_us = v; }, nan, "inter.latency_us: expected a finite time >= 0"},
      {[](Machine& m, double v) { m.ring_step_us = v; }, -1.0, "ring_step_us: expected a finite time >= 0, got -1"},
      {[](Machine& m, double v) { m.ranks_per_node = static_cast<int>(v); }, 0.0, "expected ranks_per_node >= 1"},
  };
  for (const Bad& c : cases) {
    CAPTURE(c.needle);
    Machine m = slow_machine(2);
    c.edit(m, c.value);
    CHECK_THROWS_WITH_AS((void)estimate(RingPolicy<Zigzag>{}, pr, 64, -1, 2, m), doctest::Contains(c.needle), ConfigError);
    CHECK_THROWS_WITH_AS((void)advise(pr, 64, -1, 2, m, true), doctest::Contains(c.needle), ConfigError);
  }
  // The machine as given is costed, to a finite time.
  CHECK(std::isfinite(estimate(RingPolicy<Zigzag>{}, pr, 64, -1, 2, slow_machine(2)).ms(true)));
}
