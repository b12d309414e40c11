// Backward for every policy against the exact double reference; the reference backward itself
// against central finite differences. The kernel alone: test_cpu_flash_backward_threads.cpp.
#include <doctest/doctest.h>

#include "support/backward_check.hpp"

using namespace seqpar;

#ifndef TEST_KERNEL
#define TEST_KERNEL CpuFlashKernel
#endif

namespace {

// Tolerances (normwise relative, against the double reference): float 1e-4 (the recomputed
// probabilities and the fp32 accumulators of dK/dV across ranks), double 1e-11.
template <class T>
constexpr double grad_tol = std::is_same_v<T, double> ? 1e-11 : 1e-4;

template <class T, class Policy>
void check_backward(int ranks, Policy policy, const test::GlobalShape& c, std::vector<std::int64_t> lq = {},
                    std::vector<std::int64_t> lk = {}) {
  const auto g = test::make_inputs<T>(c);
  test::RunOptions opt;
  opt.lengths_q = std::move(lq);
  opt.lengths_kv = std::move(lk);
  const auto r = test::run_backward<T, Policy, TEST_KERNEL>(ranks, policy, g, test::make_global_grads(g), opt);
  CAPTURE(ranks);
  CAPTURE(c.seq_q);
  CAPTURE(c.causal);
  CHECK_FALSE(r.err.nan());
  CHECK(r.err.dq.rel() <= grad_tol<T>);
  CHECK(r.err.dk.rel() <= grad_tol<T>);
  CHECK(r.err.dv.rel() <= grad_tol<T>);
  for (int w = 0; w < ranks; ++w) CHECK(r.bytes_sent[w] == r.expected_bytes[w]);
}

test::GlobalShape small_case(std::int64_t seq, bool causal, std::int64_t heads = 4, std::int64_t kv_heads = 2) {
  return test::make_case(seq, heads, kv_heads, 8, causal, static_cast<std::uint64_t>(seq * 31 + causal), 2);
}

}  // namespace

TEST_CASE("reference backward matches central finite differences (double)") {
  test::GlobalShape c = small_case(7, true, 2, 1);
  c.batch = 1;
  c.head_dim = 3;
  const auto g = test::make_inputs(c);
  const auto gr = test::make_global_grads(g);
  // loss = sum(dout * out); d loss / d x by central differences for a sample of elements.
  auto loss = [&](const test::GlobalInputs& d) {
    const auto out = test::reference_rows(d, PositionMap::run(c.seq_q, 0));
    double sum = 0;
    for (std::size_t i = 0; i < out.size(); ++i) sum += g.dout[i] * out[i];
    return sum;
  };
  const double h = 1e-6;
  auto fd = [&](std::vector<double> test::GlobalInputs::*field, std::size_t i) {
    test::GlobalInputs plus = g, minus = g;
    (plus.*field)[i] += h;
    (minus.*field)[i] -= h;
    return (loss(plus) - loss(minus)) / (2 * h);
  };
  for (std::size_t i = 0; i < g.q.size(); i += 2) CHECK(fd(&test::GlobalInputs::q, i) == doctest::Approx(gr.dq[i]).epsilon(1e-6));
  for (std::size_t i = 0; i < g.k.size(); ++i) CHECK(fd(&test::GlobalInputs::k, i) == doctest::Approx(gr.dk[i]).epsilon(1e-6));
  for (std::size_t i = 0; i < g.v.size(); ++i) CHECK(fd(&test::GlobalInputs::v, i) == doctest::Approx(gr.dv[i]).epsilon(1e-6));
}

TEST_CASE("CpuFlashKernel backward matches the reference on one rank") {
  for (bool causal : {false, true})
    for (std::int64_t seq : {1, 5, 33, 130}) {
      check_backward<float>(1, UlyssesPolicy{}, small_case(seq, causal));
      check_backward<double>(1, UlyssesPolicy{}, small_case(seq, causal));
    }
}

TEST_CASE("Ring backward: every layout, ring degree 2..7 (3, 5, 7 included), causal, GQA") {
  for (int p = 2; p <= 7; ++p)
    for (bool causal : {false, true}) {
      const auto c = small_case(4 * p * 5, causal);
      check_backward<double>(p, RingPolicy<Contiguous>{}, c);
      check_backward<double>(p, RingPolicy<Zigzag>{}, c);
      check_backward<float>(p, RingPolicy<Stripe>{}, c);
    }
}

TEST_CASE("Ulysses backward, GQA with kv_heads < ulysses degree (shared K/V heads sum their gradients)") {
  for (int p : {2, 4, 8}) {
    check_backward<double>(p, UlyssesPolicy{}, small_case(8 * p, true, 8, 8));
    check_backward<double>(p, UlyssesPolicy{}, small_case(8 * p, false, 8, 2));
    check_backward<float>(p, UlyssesPolicy{}, small_case(8 * p, true, 8, 1));
  }
}

TEST_CASE("Unified backward for every factorisation of 1..8 ranks") {
  for (int p = 1; p <= 8; ++p)
    for (int u = 1; u <= p; ++u) {
      if (p % u) continue;
      CAPTURE(u);
      auto c = small_case(4 * p * 3, true, 4 * u, 2);
      check_backward<double>(p, UnifiedPolicy<Zigzag>{u, p / u}, c);
      check_backward<double>(p, UnifiedPolicy<Contiguous>{u, p / u, MeshPlacement::ring_adjacent}, c);
    }
}

TEST_CASE("Anything backward: uneven lengths, zero-token ranks, odd heads, cross attention") {
  auto c = small_case(0, true, 6, 3);
  c.seq_q = 3 + 0 + 11 + 7 + 1;
  check_backward<double>(5, AnythingPolicy<RingPolicy<Zigzag>>{}, c, {3, 0, 11, 7, 1}, {3, 0, 11, 7, 1});
  check_backward<double>(5, AnythingPolicy<UlyssesPolicy>{}, c, {3, 0, 11, 7, 1}, {3, 0, 11, 7, 1});
  check_backward<float>(4, AnythingPolicy<UnifiedPolicy<Contiguous>>{{2, 2}}, c, {9, 0, 5, 8}, {2, 12, 0, 8});
  auto cross = small_case(19, false, 5, 5);
  cross.seq_kv = 26;
  check_backward<double>(3, AnythingPolicy<UnifiedPolicy<Zigzag>>{{3, 1}}, cross);
  check_backward<double>(6, AnythingPolicy<UnifiedPolicy<Contiguous>>{{2, 3}}, cross);
}
