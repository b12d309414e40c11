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
