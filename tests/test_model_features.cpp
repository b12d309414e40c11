// The features of today's models (attention sinks, logit soft-capping, a value head dim
// D_v != D): first the yardsticks themselves, the brute force of tests/support and the
// ReferenceKernel, against answers worked out by hand and their gradients against finite
// differences of the forward; every other test of these features is held against them.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "support/backward_check.hpp"

using namespace seqpar;
using namespace seqpar::test;

namespace {

/// A small random problem with every feature that `shape` turns on, inputs in double.
struct Case {
  GlobalShape shape;
  GlobalInputs in;
  explicit Case(GlobalShape s) : shape(std::move(s)), in(make_inputs(shape)) {}
  AttentionProblem problem() const { return in.shape.problem<double>(true); }
  GlobalOutput forward(const AttentionProblem& pr) const {
    return brute_force_forward({pr, shape.seq_q, shape.kv_len(), in.q, in.k, in.v});
  }
  /// The loss whose gradients backward computes: sum over every element of dO * O.
  double loss(const AttentionProblem& pr, const std::vector<double>& q, const std::vector<double>& k,
              const std::vector<double>& v) const {
    const GlobalOutput o = brute_force_forward({pr, shape.seq_q, shape.kv_len(), q, k, v});
    double l = 0;
    for (std::size_t e = 0; e < o.out.size(); ++e) l += in.dout[e] * o.out[e];
    return l;
  }
};

/// Central difference of the loss in x[e] (x one of the case's inputs, a copy).
double numeric_grad(const Case& c, const AttentionProblem& pr, int which, std::size_t e) {
  constexpr double h = 1e-6;
  std::vector<double> x[3] = {c.in.q, c.in.k, c.in.v};
  x[which][e] += h;
  const double up = c.loss(pr, x[0], x[1], x[2]);
  x[which][e] -= 2 * h;
  const double down = c.loss(pr, x[0], x[1], x[2]);
  return (up - down) / (2 * h);
}

GlobalShape small_shape(bool causal) {
  GlobalShape s = make_case(7, 2, 1, 3, causal, 31);
  s.head_dim_v = 5;
  return s;
}

}  // namespace

TEST_CASE("model features: a soft-capped score is cap tanh(s / cap), by hand") {
  // One query, two keys, D = 1, scale 1: scores 3 and 6 under a cap of 4 become 4 tanh(3/4)
  // and 4 tanh(6/4); the weights are their softmax.
  GlobalShape s = make_case(1, 1, 1, 1, false, 1);
  s.seq_kv = 2;
  s.scale = 1.0;
  s.softcap = 4.0;
  GlobalInputs in;
  in.shape = s;
  in.q = {3.0};
  in.k = {1.0, 2.0};
  in.v = {10.0, -2.0};
  const AttentionProblem pr = s.problem<double>();
  const GlobalOutput o = brute_force_forward({pr, 1, 2, in.q, in.k, in.v});
  const double a = 4 * std::tanh(0.75), b = 4 * std::tanh(1.5);
  const double wa = std::exp(a) / (std::exp(a) + std::exp(b));
  CHECK(o.out[0] == doctest::Approx(wa * 10 + (1 - wa) * -2).epsilon(1e-14));
  CHECK(o.lse[0] == doctest::Approx(std::log(std::exp(a) + std::exp(b))).epsilon(1e-14));
  // ReferenceKernel agrees.
  std::vector<double> out(1), lse(1);
  using CV = TensorView<const double>;
  ReferenceKernel{}.forward(CV::bshd(in.q.data(), 1, 1, 1, 1), CV::bshd(in.k.data(), 1, 2, 1, 1),
                            CV::bshd(in.v.data(), 1, 2, 1, 1), TensorView<double>::bshd(out.data(), 1, 1, 1, 1),
                            TensorView<double>::bshd(lse.data(), 1, 1, 1, 1),
                            examples::reference_params(s, s.mask_tables(), PositionMap::run(1, 0), PositionMap::run(2, 0)));
  CHECK(out[0] == doctest::Approx(o.out[0]).epsilon(1e-14));
  CHECK(lse[0] == doctest::Approx(o.lse[0]).epsilon(1e-14));
}

TEST_CASE("model features: a sink joins the denominator once and carries no value, by hand") {
  // One query, one key with score 0 (weight e^0 = 1) and a sink of ln 3 (weight 3): O = v / 4,
  // LSE = ln 4. A row that sees no key keeps O = 0 and gets LSE = its sink.
  GlobalShape s = make_case(2, 1, 1, 1, true, 1);
  s.sinks = {static_cast<float>(std::log(3.0))};
  GlobalInputs in;
  in.shape = s;
  in.q = {0.0, 0.0};
  in.k = {5.0, 7.0};
  in.v = {8.0, 4.0};
  AttentionProblem pr = s.problem<double>();
  pr.causal_align = CausalAlign::bottom_right;  // S_q = S_kv: the same diagonal as top-left
  const GlobalOutput o = brute_force_forward({pr, 2, 2, in.q, in.k, in.v});
  const double sink = static_cast<double>(s.sinks[0]);
  CHECK(o.out[0] == doctest::Approx(8.0 / (1 + std::exp(sink))).epsilon(1e-14));
  CHECK(o.lse[0] == doctest::Approx(std::log(1 + std::exp(sink))).epsilon(1e-14));
  CHECK(o.out[1] == doctest::Approx((8.0 + 4.0) / (2 + std::exp(sink))).epsilon(1e-14));
  // Hide every key from row 0: it keeps only its sink.
  pr.window = {0, -1};
  pr.kv_valid = {1};
  const GlobalOutput none = brute_force_forward({pr, 2, 2, in.q, in.k, in.v});
  CHECK(none.out[0] == doctest::Approx(8.0 / (1 + std::exp(sink))));
  CHECK(none.out[1] == 0.0);
  CHECK(none.lse[1] == doctest::Approx(sink).epsilon(1e-14));
  // The examples' reference (ReferenceKernel, then apply_sinks) agrees with the brute force.
  GlobalShape shape = small_shape(true);
  shape.sinks = {2.5f, -1.25f};
  const Case c(shape);
  const AttentionProblem p2 = c.problem();
  const GlobalOutput want = c.forward(p2);
  std::vector<double> lse;
  const std::vector<double> got = examples::reference_rows(c.in, PositionMap::run(shape.seq_q, 0), &lse);
  REQUIRE(got.size() == want.out.size());
  for (std::size_t e = 0; e < got.size(); ++e) CHECK(got[e] == doctest::Approx(want.out[e]).epsilon(1e-13));
  for (std::size_t e = 0; e < lse.size(); ++e) CHECK(lse[e] == doctest::Approx(want.lse[e]).epsilon(1e-13));
}

TEST_CASE("model features: the brute-force gradients equal finite differences (soft-cap, D_v, sinks)") {
  for (const bool causal : {false, true}) {
    GlobalShape shape = small_shape(causal);
    shape.softcap = 1.5;            // scores of ~0.5 are capped noticeably
    shape.sinks = {0.75f, -2.0f};   // large enough to change the output
    shape.scale = 2.0;
    const Case c(shape);
    const AttentionProblem pr = c.problem();
    const ReferenceGrads g = brute_force_grads({pr, shape.seq_q, shape.kv_len(), c.in.q, c.in.k, c.in.v}, c.in.dout);
    double worst = 0;
    for (std::size_t e = 0; e < c.in.q.size(); e += 3) worst = std::max(worst, std::abs(numeric_grad(c, pr, 0, e) - g.dq[e]));
    for (std::size_t e = 0; e < c.in.k.size(); e += 2) worst = std::max(worst, std::abs(numeric_grad(c, pr, 1, e) - g.dk[e]));
    for (std::size_t e = 0; e < c.in.v.size(); e += 2) worst = std::max(worst, std::abs(numeric_grad(c, pr, 2, e) - g.dv[e]));
    INFO("causal " << causal);
    CHECK(worst < 1e-7);
    // d sink_h by a central difference of the loss in the sink.
    for (std::size_t h = 0; h < shape.sinks.size(); ++h) {
      std::vector<float> moved = shape.sinks;
      const double step = 1.0 / 1024;  // exact in float
      AttentionProblem p = pr;
      p.sinks = moved.data();
      moved[h] = shape.sinks[h] + static_cast<float>(step);
      const double up = c.loss(p, c.in.q, c.in.k, c.in.v);
      moved[h] = shape.sinks[h] - static_cast<float>(step);
      const double down = c.loss(p, c.in.q, c.in.k, c.in.v);
      CHECK(g.dsinks[h] == doctest::Approx((up - down) / (2 * step)).epsilon(1e-5));
    }
  }
}

TEST_CASE("model features: ReferenceKernel with soft-cap and D_v != D equals the brute force, forward and backward") {
  GlobalShape shape = small_shape(true);
  shape.softcap = 1.5;
  shape.scale = 2.0;
  const Case c(shape);
  const AttentionProblem pr = c.problem();
  const GlobalOutput want = c.forward(pr);
  std::vector<double> lse;
  const std::vector<double> got = examples::reference_rows(c.in, PositionMap::run(shape.seq_q, 0), &lse);
  for (std::size_t e = 0; e < got.size(); ++e) CHECK(got[e] == doctest::Approx(want.out[e]).epsilon(1e-13));
  const PositionMap all_q = PositionMap::run(shape.seq_q, 0), all_k = PositionMap::run(shape.kv_len(), 0);
  const ReferenceGrads rg = examples::reference_grads(c.in, all_q, all_k);
  const ReferenceGrads bg = brute_force_grads({pr, shape.seq_q, shape.kv_len(), c.in.q, c.in.k, c.in.v}, c.in.dout);
  CHECK(compare(rg.dq, bg.dq).rel() < 1e-13);
  CHECK(compare(rg.dk, bg.dk).rel() < 1e-13);
  CHECK(compare(rg.dv, bg.dv).rel() < 1e-13);
}

namespace {

/// The features a case turns on.
struct Features {
  bool sinks = false, softcap = false, value_dim = false;
  const char* name() const {
    return sinks && softcap && value_dim ? "all three" : sinks ? "sinks" : softcap ? "soft-cap" : "D_v != D";
  }
};

/// `base` with the features of `f`: sinks large enough to move the output (+-8 would drown a
/// short row; +-2.5 keeps both terms), a cap the scores reach, D_v above or below D.
GlobalShape with_features(GlobalShape s, Features f, bool wide_v) {
  if (f.sinks) {
    s.sinks.clear();
    for (std::int64_t h = 0; h < s.heads; ++h) s.sinks.push_back(h % 2 ? -2.5f : 2.5f);
  }
  if (f.softcap) {
    s.softcap = 2.0;
    s.scale = 1.0;  // scores of ~1-3 at head dims 8-24: the cap bends them
  }
  if (f.value_dim) s.head_dim_v = wide_v ? s.head_dim + 16 : s.head_dim / 2;
  return s;
}

constexpr Features feature_sets[] = {{true, false, false}, {false, true, false}, {false, false, true}, {true, true, true}};

/// Forward (with LSE) and backward (with d_sinks) of `policy` on `ranks` threads against the
/// brute force, exactly (double, ReferenceKernel); the forward's bytes are the plan's.
template <class Kernel = ReferenceKernel, class T = double, class Policy>
void expect_exact_features(int ranks, Policy policy, const GlobalShape& shape, RunOptions opt = {}) {
  const GlobalData g = make_global_as<T>(shape);
  const auto r = run_policy<T, Policy, Kernel>(ranks, policy, g, opt);
  CHECK(!r.err.nan);
  CHECK(r.err.rel() <= tolerance<T>);
  CHECK(r.err.lse_rel() <= tolerance<T>);
  for (int w = 0; w < ranks; ++w) CHECK(r.bytes_sent[w] == r.expected_bytes[w]);
  const ReferenceGrads want = make_global_grads(g);
  const BackwardResult b = run_backward<T, Policy, Kernel>(ranks, policy, g, want, opt);
  CHECK(!b.err.nan());
  CHECK(b.err.worst() <= (std::is_same_v<T, double> ? 1e-10 : 1e-4));
  // d_sinks is float, the sinks' type, whatever T: a sum of float-rounded terms.
  if (!shape.sinks.empty()) CHECK(b.dsinks.rel() <= (std::is_same_v<T, double> ? 1e-6 : 1e-4));
  for (int w = 0; w < ranks; ++w) CHECK(b.bytes_sent[w] == b.expected_bytes[w]);
}

}  // namespace

TEST_CASE("model features under every policy and layout, 1..8 ranks, forward and backward, exact") {
  for (int P = 1; P <= 8; ++P)
    for (const Features f : feature_sets)
      for (const bool causal : {false, true}) {
        const bool wide_v = (P + causal) % 2 == 0;
        CAPTURE(P);
        const std::string feature = f.name();
        CAPTURE(feature);
        CAPTURE(causal);
        // Ulysses: heads divisible by P, GQA groups of two.
        expect_exact_features(P, UlyssesPolicy{}, with_features(make_case(3 * P, 2 * P, P, 8, causal, 40 + P), f, wide_v));
        // Ring, every layout: an even local length (zigzag's two chunks).
        const GlobalShape ring = with_features(make_case(4 * P, 4, 2, 8, causal, 50 + P), f, wide_v);
        expect_exact_features(P, RingPolicy<Contiguous>{}, ring);
        expect_exact_features(P, RingPolicy<Zigzag>{}, ring);
        expect_exact_features(P, RingPolicy<Stripe>{}, ring);
      }
}

TEST_CASE("model features under Unified meshes and Anything (odd lengths, heads that do not divide)") {
  for (const Features f : feature_sets)
    for (const bool causal : {false, true}) {
      const std::string feature = f.name();
      CAPTURE(feature);
      CAPTURE(causal);
      const GlobalShape even = with_features(make_case(16, 4, 2, 8, causal, 61), f, causal);
      expect_exact_features(4, UnifiedPolicy<Zigzag>{2, 2}, even);
      expect_exact_features(6, UnifiedPolicy<Stripe>{3, 2}, with_features(make_case(24, 6, 3, 8, causal, 62), f, !causal));
      // Anything: 3 heads over a Unified 2 x 3 mesh, 29 tokens, a rank with none.
      GlobalShape odd = with_features(make_case(29, 3, 1, 8, causal, 63), f, causal);
      RunOptions opt;
      opt.lengths_q = {9, 0, 5, 4, 6, 5};
      opt.lengths_kv = opt.lengths_q;
      expect_exact_features(6, AnythingPolicy<UnifiedPolicy<Contiguous>>{2, 3}, odd, opt);
    }
}

TEST_CASE("model features with masks: bottom-right causal, a window, packed documents, key padding") {
  for (const Features f : feature_sets) {
    const std::string feature = f.name();
    CAPTURE(feature);
    GlobalShape s = with_features(make_case(24, 4, 2, 8, true, 71, 2), f, true);
    s.window = {5, -1};
    s.documents = {{10, 14}, {7, 17}};
    expect_exact_features(4, RingPolicy<Stripe>{}, s);
    GlobalShape padded = with_features(make_case(20, 4, 4, 8, false, 72, 2), f, false);
    padded.kv_valid = {13, 0};  // a batch element with no key: O = 0, LSE = the sink (or -inf)
    expect_exact_features(2, UlyssesPolicy{}, padded);
    GlobalShape cross = with_features(make_case(12, 2, 1, 8, true, 73), f, false);
    cross.seq_kv = 20;
    cross.causal_align = CausalAlign::bottom_right;
    RunOptions opt;
    opt.lengths_q = {5, 7};
    opt.lengths_kv = {11, 9};
    expect_exact_features(2, AnythingPolicy<RingPolicy<Contiguous>>{}, cross, opt);
  }
}

TEST_CASE("a sink counts exactly once per row, whatever the ring degree (2..7)") {
  // Large sinks (+-8 on a short row) dominate the denominator: counting one twice, or on one
  // rank only, moves every output far past the tolerance.
  for (int R = 2; R <= 7; ++R) {
    CAPTURE(R);
    GlobalShape s = make_case(4 * R, 2, 1, 8, R % 2 == 0, 80 + R);
    s.sinks = {8.0f, -8.0f};
    const GlobalData g = make_global_as<double>(s);
    const auto r = run_policy<double, RingPolicy<Zigzag>, ReferenceKernel>(R, RingPolicy<Zigzag>{}, g);
    CHECK(r.err.rel() <= tolerance<double>);
    CHECK(r.err.lse_rel() <= tolerance<double>);
    const auto u = run_policy<double, UnifiedPolicy<Stripe>, ReferenceKernel>(2 * R, UnifiedPolicy<Stripe>{2, R}, g);
    CHECK(u.err.rel() <= tolerance<double>);
  }
}

namespace {
/// A kernel with masks but neither soft-capping nor a D_v of its own.
struct PlainKernel : ReferenceKernel {
  static constexpr bool supports_softcap = false;
  static constexpr bool supports_value_dim = false;
};
}  // namespace

TEST_CASE("a kernel that lacks a feature is refused by name; a sink needs nothing of it") {
  AttentionProblem p;
  p.heads = 2;
  p.head_dim = 8;
  const LocalLengths lengths[] = {{4}, {4}};
  run_ranks(2, [&](ThreadCommunicator& c) {
    SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, PlainKernel> a(c);
    AttentionProblem capped = p;
    capped.softcap = 30.0;
    CHECK_THROWS_WITH_AS(a.plan(capped, {4}), doctest::Contains("this kernel does not soft-cap logits"), ConfigError);
    CHECK(!a.can_implement(capped, lengths));
    AttentionProblem mla = p;
    mla.head_dim_v = 4;
    CHECK_THROWS_WITH_AS(a.plan(mla, {4}), doctest::Contains("head_dim_v 4"), ConfigError);
    const float sinks[2] = {1.0f, 2.0f};
    AttentionProblem sunk = p;
    sunk.sinks = sinks;
    CHECK_NOTHROW(a.plan(sunk, {4}));
  });
}

TEST_CASE("bad feature values are refused on every rank: a negative head_dim_v, a non-finite or negative soft-cap") {
  AttentionProblem p;
  p.heads = 2;
  p.head_dim = 8;
  const LocalLengths lengths[] = {{4}, {4}};
  AttentionProblem bad_dim = p;
  bad_dim.head_dim_v = -1;
  CHECK(can_implement(RingPolicy<>{}, bad_dim, lengths).reason == "plan: head_dim_v: expected >= 1, or 0 for head_dim, got -1");
  // Negative, not finite, or past 2^+-32 (where kernels that fold 1 / cap into the scale, or keep
  // the cap in bf16, would leave their range); the ends themselves are legal.
  for (const double cap : {-1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN(),
                           5e-324, 0x1p-33, 0x1p33, 1e300}) {
    AttentionProblem bad_cap = p;
    bad_cap.softcap = cap;
    CHECK(can_implement(RingPolicy<>{}, bad_cap, lengths).reason.find("plan: softcap: expected 0 (off)") == 0);
  }
  for (const double cap : {0x1p-32, 0x1p32}) {
    AttentionProblem cap_at_end = p;
    cap_at_end.softcap = cap;
    CHECK(can_implement(RingPolicy<>{}, cap_at_end, lengths));
  }
  // Ranks that disagree on a feature are told which.
  run_ranks(2, [&](ThreadCommunicator& c) {
    SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, ReferenceKernel> a(c);
    AttentionProblem mine = p;
    if (c.rank() == 1) mine.softcap = 50.0;
    CHECK_THROWS_WITH_AS(a.plan(mine, {4}), doctest::Contains("ranks disagree on softcap"), ConfigError);
    const float sinks[2] = {0.0f, 0.0f};
    AttentionProblem sunk = p;
    if (c.rank() == 0) sunk.sinks = sinks;
    CHECK_THROWS_WITH_AS(a.plan(sunk, {4}), doctest::Contains("ranks disagree on sinks"), ConfigError);
  });
}

TEST_CASE("layers with different masks share one token placement: two plans on one object") {
  // GPT-OSS alternates a 128-token window with full causal attention, Llama 4 chunked (packed
  // documents of 8192) with global layers: every layer's plan must place the tokens alike, so
  // that activations never move between layers. The placement is the layout's and the
  // lengths', never the mask's.
  for (int P : {2, 3, 4}) {
    run_ranks(P, [&](ThreadCommunicator& c) {
      SequenceParallelAttention<AnythingPolicy<UnifiedPolicy<Zigzag>>, ThreadCommunicator, ReferenceKernel> a(
          c, AnythingPolicy<UnifiedPolicy<Zigzag>>{1, P});
      const LocalLengths mine{10 + c.rank()};
      AttentionProblem global;
      global.heads = 2;
      global.head_dim = 8;
      global.causal = true;
      AttentionProblem local = global;
      local.window = {4, 0};
      AttentionProblem chunked = global;
      std::int64_t total = 0;
      for (int w = 0; w < P; ++w) total += 10 + w;
      chunked.documents = {{total / 2, total - total / 2}};
      const Plan a_plan = a.plan(global, mine), b_plan = a.plan(local, mine), c_plan = a.plan(chunked, mine);
      for (int w = 0; w < P; ++w) {
        for (const Plan* other : {&b_plan, &c_plan}) {
          const PositionMap x = a_plan.q_positions(w), y = other->q_positions(w);
          REQUIRE(x.size() == y.size());
          for (std::int64_t i = 0; i < x.size(); ++i) CHECK(x(i) == y(i));
        }
      }
    });
  }
}
