// Bad input gets a clear seqpar::Error naming what was wrong. Checks made on gathered data
// (construction, plan) must fail on every rank with the same message; checks of one rank's
// own arguments (forward) fail on that rank and wake its peers with CommAborted. Every run has
// a time-out (rank_outcomes), so a check that regresses into a hang fails instead.

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "support/attention_check.hpp"
#include "support/rank_outcomes.hpp"

using namespace seqpar;
using test::all_config_error;
using test::all_same_config_error;
using test::describe;
using test::rank_outcomes;

namespace {

using Comm = ThreadCommunicator;

template <class Policy>
using Attn = SequenceParallelAttention<Policy, Comm, CpuFlashKernel>;

/// The problem every rank agrees on, unless a test changes it.
AttentionProblem base_problem() {
  AttentionProblem p;
  p.batch = 2;
  p.heads = 4;
  p.kv_heads = 2;
  p.head_dim = 8;
  p.causal = true;
  p.with_lse = true;
  return p;
}

/// Builds the attention on every rank (policy chosen per rank) and plans; `edit` changes this
/// rank's problem or lengths first.
template <class Policy>
std::vector<test::RankOutcome> plan_outcomes(int ranks, Policy policy,
                                             std::function<void(int, AttentionProblem&, LocalLengths&)> edit) {
  return rank_outcomes(ranks, [&](Comm& c) {
    Attn<Policy> attn(c, policy);
    AttentionProblem prob = base_problem();
    LocalLengths len{8, -1};
    edit(c.rank(), prob, len);
    (void)attn.plan(prob, len);
  });
}

/// One rank's ready-to-run forward call on random data, which a test then breaks.
template <class Policy, class T = float>
struct Rig {
  Attn<Policy> attn;
  Plan plan;
  std::vector<T> q, k, v, out;
  std::vector<acc_t<T>> lse;
  std::vector<std::byte> ws;
  TensorView<const T> qv, kv, vv;
  TensorView<T> ov;
  TensorView<acc_t<T>> lv;
  std::span<std::byte> wsv;

  Rig(Comm& c, Policy policy, AttentionProblem prob = base_problem()) : attn(c, policy) {
    prob.dtype = dtype_v<T>;
    plan = attn.plan(prob, {8, -1});
    const std::int64_t B = prob.batch, L = plan.local_q(), H = prob.heads, K = prob.kv_head_count(), D = prob.head_dim;
    std::mt19937_64 rng(static_cast<std::uint64_t>(c.rank()) + 7);
    auto fill = [&](std::vector<T>& x, std::int64_t n) {
      const auto src = test::random_tensor(n, rng);
      x.assign(src.begin(), src.end());
    };
    fill(q, B * L * H * D);
    fill(k, B * L * K * D);
    fill(v, B * L * K * D);
    out.assign(q.size(), T(0));
    lse.assign(static_cast<std::size_t>(B * L * H), acc_t<T>(0));
    ws.resize(plan.workspace_bytes());
    qv = TensorView<const T>::bshd(q.data(), B, L, H, D);
    kv = TensorView<const T>::bshd(k.data(), B, L, K, D);
    vv = TensorView<const T>::bshd(v.data(), B, L, K, D);
    ov = TensorView<T>::bshd(out.data(), B, L, H, D);
    lv = prob.with_lse ? TensorView<acc_t<T>>::lse_bhs(lse.data(), B, L, H) : TensorView<acc_t<T>>{};
    wsv = ws;
  }
  void forward() { attn.template forward<T>(plan, qv, kv, vv, ov, lv, wsv); }
};

/// Every rank breaks its forward call the same way with `edit`.
template <class Policy>
std::vector<test::RankOutcome> forward_outcomes(int ranks, Policy policy,
                                                std::type_identity_t<std::function<void(int, Rig<Policy>&)>> edit) {
  return rank_outcomes(ranks, [&](Comm& c) {
    Rig<Policy> rig(c, policy);
    edit(c.rank(), rig);
    rig.forward();
  });
}

bool all_none(const std::vector<test::RankOutcome>& out) {
  for (const auto& o : out)
    if (o.kind != "none") return false;
  return true;
}

}  // namespace

TEST_CASE("errors: the rigs run cleanly when nothing is broken") {
  // Without this, every test below could pass by failing for some other reason.
  const auto a = plan_outcomes(4, UnifiedPolicy<>{2, 2}, [](int, AttentionProblem&, LocalLengths&) {});
  INFO(describe(a));
  CHECK(all_none(a));
  const auto b = forward_outcomes(2, UlyssesPolicy{}, [](int, Rig<UlyssesPolicy>&) {});
  INFO(describe(b));
  CHECK(all_none(b));
  const auto c = forward_outcomes(2, RingPolicy<>{}, [](int, Rig<RingPolicy<>>&) {});
  INFO(describe(c));
  CHECK(all_none(c));
}

TEST_CASE("errors: ranks that disagree on the problem all throw the same ConfigError from plan") {
  struct Case {
    const char* needle;
    std::function<void(AttentionProblem&)> edit;
  };
  const std::vector<Case> cases = {
      {"ranks disagree on heads: rank 0 has 4, rank 2 has 8", [](AttentionProblem& p) { p.heads = 8; }},
      {"ranks disagree on kv_heads: rank 0 has 2, rank 2 has 4", [](AttentionProblem& p) { p.kv_heads = 4; }},
      {"ranks disagree on head_dim: rank 0 has 8, rank 2 has 16", [](AttentionProblem& p) { p.head_dim = 16; }},
      {"ranks disagree on batch: rank 0 has 2, rank 2 has 3", [](AttentionProblem& p) { p.batch = 3; }},
      {"ranks disagree on causal: rank 0 has true, rank 2 has false", [](AttentionProblem& p) { p.causal = false; }},
      {"ranks disagree on dtype: rank 0 has f32, rank 2 has f64", [](AttentionProblem& p) { p.dtype = DType::f64; }},
      {"ranks disagree on scale: rank 0 has 0.353553, rank 2 has 0.5", [](AttentionProblem& p) { p.scale = 0.5; }},
      {"ranks disagree on with_lse: rank 0 has true, rank 2 has false", [](AttentionProblem& p) { p.with_lse = false; }},
  };
  for (const auto& c : cases) {
    CAPTURE(c.needle);
    const auto out = plan_outcomes(4, UnifiedPolicy<>{2, 2}, [&](int rank, AttentionProblem& p, LocalLengths&) {
      if (rank == 2) c.edit(p);
    });
    INFO(describe(out));
    CHECK(all_same_config_error(out, c.needle));
    CHECK(all_same_config_error(out, "(at "));  // the file:line of the check
  }
}

TEST_CASE("errors: ranks that disagree on degrees, layout, placement or Anything all throw at construction") {
  // Each rank may build a different policy type: the agreement check is on gathered values.
  auto build = [](Comm& c, auto policy) { Attn<decltype(policy)> attn(c, policy); };

  auto a = rank_outcomes(4, [&](Comm& c) {
    if (c.rank() == 3) build(c, UnifiedPolicy<>{4, 1});
    else build(c, UnifiedPolicy<>{2, 2});
  });
  INFO(describe(a));
  CHECK(all_same_config_error(a, "ranks disagree on ulysses_degree: rank 0 has 2, rank 3 has 4"));

  auto b = rank_outcomes(2, [&](Comm& c) {
    if (c.rank() == 1) build(c, RingPolicy<Zigzag>{});
    else build(c, RingPolicy<Contiguous>{});
  });
  INFO(describe(b));
  CHECK(all_same_config_error(b, "ranks disagree on layout"));

  auto p = rank_outcomes(4, [&](Comm& c) {
    if (c.rank() == 1) build(c, UnifiedPolicy<>{2, 2, MeshPlacement::ring_adjacent});
    else build(c, UnifiedPolicy<>{2, 2});
  });
  INFO(describe(p));
  CHECK(all_same_config_error(p, "ranks disagree on placement"));

  auto any = rank_outcomes(2, [&](Comm& c) {
    if (c.rank() == 0) build(c, AnythingPolicy<RingPolicy<>>{});
    else build(c, RingPolicy<>{});
  });
  INFO(describe(any));
  CHECK(all_same_config_error(any, "ranks disagree on anything"));

  auto kind = rank_outcomes(2, [&](Comm& c) {
    if (c.rank() == 0) build(c, UlyssesPolicy{});
    else build(c, RingPolicy<>{});
  });
  INFO(describe(kind));
  CHECK(all_same_config_error(kind, "ranks disagree on ulysses_degree"));
}

TEST_CASE("errors: degrees whose product is not the world size") {
  auto build = [](Comm& c, auto policy) { Attn<decltype(policy)> attn(c, policy); };
  auto a = rank_outcomes(4, [&](Comm& c) { build(c, UnifiedPolicy<>{2, 3}); });
  INFO(describe(a));
  CHECK(all_same_config_error(a, "ulysses_degree x ring_degree = 2 x 3 must equal the world size 4"));
  auto b = rank_outcomes(4, [&](Comm& c) { build(c, UnifiedPolicy<>{3, 0}); });
  INFO(describe(b));
  // The derived degree is never printed as 0: the message names the degree that was given.
  CHECK(all_same_config_error(b, "ulysses_degree 3 does not divide the world size 4"));
  CHECK(!all_same_config_error(b, "x 0"));
  auto z = rank_outcomes(2, [&](Comm& c) { build(c, UnifiedPolicy<>{0, 0}); });
  INFO(describe(z));
  CHECK(all_same_config_error(z, "set ulysses_degree or ring_degree"));
  auto neg = rank_outcomes(2, [&](Comm& c) { build(c, UnifiedPolicy<>{-1, 2}); });
  INFO(describe(neg));
  CHECK(all_same_config_error(neg, "degrees must be >= 0"));

  // Only rank 0's degrees are impossible: the request is gathered before it is resolved, so
  // every rank sees the disagreement and throws the same ConfigError (none is left waiting).
  auto one = rank_outcomes(4, [&](Comm& c) { build(c, UnifiedPolicy<>{c.rank() == 0 ? 3 : 2, 0}); });
  INFO(describe(one));
  CHECK(all_same_config_error(one, "ranks disagree on ulysses_degree: rank 0 has 3, rank 1 has 2"));
  CHECK_THROWS_WITH_AS(
      run_ranks(4, [&](Comm& c) { build(c, UnifiedPolicy<>{c.rank() == 0 ? 3 : 2, 0}); },
                ThreadRunOptions{test::outcome_timeout}),
      doctest::Contains("ranks disagree on ulysses_degree"), ConfigError);
}

TEST_CASE("errors: an impossible shape without AnythingPolicy names the rule and the fix") {
  // U > heads: 4 Ulysses ranks, 2 heads.
  auto u = plan_outcomes(4, UlyssesPolicy{}, [](int, AttentionProblem& p, LocalLengths&) {
    p.heads = 2;
    p.kv_heads = 0;
  });
  INFO(describe(u));
  CHECK(all_same_config_error(u, "heads divisible by the Ulysses degree: heads 2, ulysses_degree 4"));
  CHECK(all_same_config_error(u, "use AnythingPolicy<UlyssesPolicy"));

  auto uneven = plan_outcomes(2, RingPolicy<>{}, [](int rank, AttentionProblem&, LocalLengths& l) {
    l.q = rank == 0 ? 8 : 7;
  });
  INFO(describe(uneven));
  CHECK(all_same_config_error(uneven, "needs the same local length on every rank"));
  CHECK(all_same_config_error(uneven, "rank 1 holds 7"));

  auto cross = plan_outcomes(2, UlyssesPolicy{}, [](int, AttentionProblem&, LocalLengths& l) { l.kv = 4; });
  INFO(describe(cross));
  CHECK(all_same_config_error(cross, "needs kv_len == q_len"));

  auto odd = plan_outcomes(2, RingPolicy<Zigzag>{}, [](int, AttentionProblem&, LocalLengths& l) { l.q = 7; });
  INFO(describe(odd));
  CHECK(all_same_config_error(odd, "zigzag layout needs an even ring block length, got 7"));

  // The same shapes are fine with AnythingPolicy, and the answer is right.
  const auto g = test::make_global(test::make_case(15, 2, 2, 16, true, 1));
  CHECK(test::run_policy<float>(4, AnythingPolicy<UlyssesPolicy>{}, g).err.rel() < 1e-5);
}

TEST_CASE("errors: invalid problem fields and lengths, even when ranks agree") {
  struct Case {
    const char* needle;
    std::function<void(int, AttentionProblem&, LocalLengths&)> edit;
  };
  const std::vector<Case> cases = {
      {"plan: kv_heads: expected a divisor of heads 4, got 3", [](int, AttentionProblem& p, LocalLengths&) { p.kv_heads = 3; }},
      {"plan: heads: expected >= 1, got 0", [](int, AttentionProblem& p, LocalLengths&) { p.heads = 0; p.kv_heads = 1; }},
      {"plan: head_dim: expected >= 1, got 0", [](int, AttentionProblem& p, LocalLengths&) { p.head_dim = 0; }},
      {"plan: batch: expected >= 0, got -1", [](int, AttentionProblem& p, LocalLengths&) { p.batch = -1; }},
      {"plan: rank 1 gives negative local lengths (q -3, kv -3)",
       [](int r, AttentionProblem&, LocalLengths& l) { if (r == 1) l.q = -3; }},
  };
  for (const auto& c : cases) {
    CAPTURE(c.needle);
    const auto out = plan_outcomes(2, AnythingPolicy<RingPolicy<>>{}, c.edit);
    INFO(describe(out));
    CHECK(all_same_config_error(out, c.needle));
  }
  // Stripe positions follow from the total, so lengths that do not are refused on every rank.
  const auto stripe = plan_outcomes(2, AnythingPolicy<RingPolicy<Stripe>>{},
                                    [](int r, AttentionProblem&, LocalLengths& l) { l.q = r == 0 ? 4 : 2; });
  INFO(describe(stripe));
  CHECK(all_same_config_error(stripe, "stripe layout: ring rank 0 must hold 3 of the 6 tokens"));
}

TEST_CASE("errors: wrong sizes, strides and pointers in a forward view") {
  using R = Rig<UlyssesPolicy>;
  struct Case {
    const char* needle;
    std::function<void(int, R&)> edit;
  };
  const std::vector<Case> cases = {
      {"forward: q.seq: expected 8, got 7", [](int, R& r) { r.qv.extent[1] = 7; }},
      {"forward: k.heads: expected 2, got 4", [](int, R& r) { r.kv.extent[2] = 4; }},
      {"forward: v.head_dim: expected 8, got 4", [](int, R& r) { r.vv.extent[3] = 4; }},
      {"forward: out.seq: expected 8, got 9", [](int, R& r) { r.ov.extent[1] = 9; }},
      // Q/K/V of mismatched batch.
      {"forward: k.batch: expected 2, got 1", [](int, R& r) { r.kv.extent[0] = 1; }},
      {"forward: v.batch: expected 2, got 3", [](int, R& r) { r.vv.extent[0] = 3; }},
      {"forward: q.stride[3] (head_dim): expected 1, got 2", [](int, R& r) { r.qv.stride[3] = 2; }},
      {"forward: v.stride[1]: expected >= 0, got -16", [](int, R& r) { r.vv.stride[1] = -16; }},
      {"forward: out: strides overlap (dimension seq", [](int, R& r) { r.ov.stride[1] = 0; }},
      {"forward: out: strides overlap (dimension heads", [](int, R& r) { r.ov.stride[2] = 4; }},
      {"forward: q: null data pointer for a non-empty tensor", [](int, R& r) { r.qv.data = nullptr; }},
      {"forward: out: null data pointer", [](int, R& r) { r.ov.data = nullptr; }},
      {"forward: lse.seq: expected 8, got 4", [](int, R& r) { r.lv.extent[1] = 4; }},
      {"forward: lse: this plan needs an LSE view (with_lse = true), got none", [](int, R& r) { r.lv = {}; }},
      {"workspace: expected at least", [](int, R& r) { r.wsv = r.wsv.first(r.wsv.size() / 4); }},
      {"workspace: expected at least", [](int, R& r) { r.wsv = {}; }},
      {"workspace: null data pointer with a size of 64 bytes",
       [](int, R& r) { r.wsv = std::span<std::byte>(static_cast<std::byte*>(nullptr), 64); }},
  };
  for (const auto& c : cases) {
    CAPTURE(c.needle);
    const auto out = forward_outcomes(2, UlyssesPolicy{}, c.edit);
    INFO(describe(out));
    CHECK(all_config_error(out, c.needle));
  }
}

TEST_CASE("errors: a too small workspace is refused by the ring and Unified paths too") {
  auto small = [](int, auto& r) { r.wsv = r.wsv.first(300); };
  const auto ring = forward_outcomes<RingPolicy<>>(2, RingPolicy<>{}, small);
  INFO(describe(ring));
  CHECK(all_config_error(ring, "workspace: expected at least"));
  const auto usp = forward_outcomes<UnifiedPolicy<>>(4, UnifiedPolicy<>{2, 2}, small);
  INFO(describe(usp));
  CHECK(all_config_error(usp, "workspace: expected at least"));
}

TEST_CASE("errors: a forward call that does not match its plan") {
  // Element type.
  auto dtype = rank_outcomes(2, [](Comm& c) {
    Rig<UlyssesPolicy> rig(c, UlyssesPolicy{});  // planned for f32
    std::vector<double> q(rig.q.begin(), rig.q.end()), k(rig.k.begin(), rig.k.end()), v(rig.v.begin(), rig.v.end());
    std::vector<double> out(q.size()), lse(rig.lse.size());
    using CV = TensorView<const double>;
    rig.attn.forward<double>(rig.plan, CV{q.data(), rig.qv.extent, rig.qv.stride}, CV{k.data(), rig.kv.extent, rig.kv.stride},
                             CV{v.data(), rig.vv.extent, rig.vv.stride}, TensorView<double>{out.data(), rig.ov.extent, rig.ov.stride},
                             TensorView<double>{lse.data(), rig.lv.extent, rig.lv.stride}, rig.wsv);
  });
  INFO(describe(dtype));
  CHECK(all_same_config_error(dtype, "forward: element type: the plan was made for f32, got f64"));

  // An LSE for a plan that does not return one.
  auto lse = rank_outcomes(2, [](Comm& c) {
    AttentionProblem p = base_problem();
    p.with_lse = false;
    Rig<UlyssesPolicy> rig(c, UlyssesPolicy{}, p);
    rig.lv = TensorView<float>::lse_bhs(rig.lse.data(), 2, 8, 4);
    rig.forward();
  });
  INFO(describe(lse));
  CHECK(all_same_config_error(lse, "forward: lse given, but the plan's problem has with_lse = false"));

  // A plan made by another attention object (another mesh).
  auto other = rank_outcomes(2, [](Comm& c) {
    Rig<UlyssesPolicy> rig(c, UlyssesPolicy{});
    Attn<RingPolicy<>> ring(c, RingPolicy<>{});
    ring.forward<float>(rig.plan, rig.qv, rig.kv, rig.vv, rig.ov, rig.lv, rig.wsv);
  });
  INFO(describe(other));
  CHECK(all_same_config_error(other, "the plan was made by another SequenceParallelAttention"));
}

TEST_CASE("errors: one rank's bad view fails that rank and wakes the others") {
  // forward does no metadata exchange, so its checks are local: the faulty rank throws the
  // ConfigError, its peers (blocked in the first all-to-all) get CommAborted naming it.
  using P = AnythingPolicy<UlyssesPolicy>;
  auto out = forward_outcomes<P>(3, P{}, [](int rank, Rig<P>& r) {
    if (rank == 1) r.ov.data = nullptr;
  });
  INFO(describe(out));
  CHECK(out[1].kind == "ConfigError");
  CHECK(out[1].what.find("forward: out: null data pointer") != std::string::npos);
  for (int w : {0, 2}) {
    CHECK(out[w].kind == "CommAborted");
    CHECK(out[w].what.find("rank 1 failed") != std::string::npos);
  }
}
