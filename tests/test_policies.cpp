// Every plain policy on ThreadCommunicator against the exact reference: Ulysses, Ring with
// every layout, Unified for every factorisation U x R of 1..8 ranks with both placements;
// causal and not, float and double, GQA (also kv_heads < ulysses_degree); and the identities
// Unified(U = 1) == Ring, Unified(R = 1) == Ulysses.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "support/attention_check.hpp"

using namespace seqpar;
using test::GlobalShape;
using test::GlobalData;
using test::make_case;

namespace {

/// Runs and checks against the reference; also that forward exchanged no metadata and sent
/// what the plan says it sends.
template <class T, class Policy>
test::RunResult expect_exact(int ranks, Policy policy, const GlobalData& g, test::RunOptions opt = {}) {
  const auto r = test::run_policy<T>(ranks, policy, g, opt);
  CHECK(!r.err.nan);
  CHECK(r.err.rel() <= test::tolerance<T>);
  if (opt.with_lse) CHECK(r.err.lse_rel() <= test::tolerance<T>);
  for (int w = 0; w < ranks; ++w) {
    CHECK(r.host_gathers_in_forward[w] == 0);
    CHECK(r.bytes_sent[w] == r.expected_bytes[w]);
  }
  return r;
}

/// Calls f.template operator()<Layout>() for every layout.
template <class F>
void for_each_layout(F&& f) {
  f.template operator()<Contiguous>();
  f.template operator()<Zigzag>();
  f.template operator()<Stripe>();
}

template <class T>
void ulysses_all_worlds() {
  for (int P = 1; P <= 8; ++P)
    for (bool causal : {false, true}) {
      // Tokens and heads divisible by P; a few tokens per rank so every rank's slice is odd.
      const std::int64_t seq = P * (P % 2 ? 7 : 6);
      CAPTURE(P);
      CAPTURE(causal);
      const GlobalShape mha = make_case(seq, 2 * P, 2 * P, 16, causal, 100 + P, P % 3 == 0 ? 2 : 1);
      expect_exact<T>(P, UlyssesPolicy{}, test::make_global_as<T>(mha));
      // GQA with fewer K/V heads than ranks (P > 2): each rank needs one shared K/V head.
      const GlobalShape gqa = make_case(seq, 2 * P, 2, 8, causal, 200 + P);
      expect_exact<T>(P, UlyssesPolicy{}, test::make_global_as<T>(gqa));
    }
}

template <class T>
void ring_all_worlds() {
  if constexpr (test::sanitized_skips<T>) return;  // float alone under a sanitizer
  for (int P = 1; P <= 8; ++P)
    for (bool causal : {false, true}) {
      // An even local length (zigzag's two chunks); seq between 32 and 96.
      const std::int64_t local = 2 * ((24 + P - 1) / P + 1);
      const GlobalShape c = make_case(P * local, 4, 2, 16, causal, 300 + P, P == 3 ? 2 : 1);
      const GlobalData g = test::make_global_as<T>(c);
      for_each_layout([&]<class L>() {
        CAPTURE(P);
        CAPTURE(causal);
        CAPTURE(L::name);
        expect_exact<T>(P, RingPolicy<L>{}, g);
      });
    }
}

template <class T>
void unified_all_factorisations() {
  if constexpr (test::sanitized_skips<T>) return;  // float alone under a sanitizer
  for (int P = 1; P <= 8; ++P)
    for (int U = 1; U <= P; ++U) {
      if (P % U != 0) continue;
      const int R = P / U;
      for (bool causal : {false, true}) {
        // Heads divisible by U; K/V heads fewer than U when U >= 4.
        const std::int64_t heads = 2 * U, kv_heads = U >= 4 ? 2 : U;
        const std::int64_t local = 2 * ((12 + P - 1) / P + 1);
        const GlobalShape c = make_case(P * local, heads, kv_heads, 8 + 4 * (P % 3), causal, 400 + 10 * P + U);
        const GlobalData g = test::make_global_as<T>(c);
        for (auto placement : {MeshPlacement::ulysses_adjacent, MeshPlacement::ring_adjacent})
          for_each_layout([&]<class L>() {
            CAPTURE(P);
            CAPTURE(U);
            CAPTURE(R);
            CAPTURE(causal);
            CAPTURE(L::name);
            CAPTURE(static_cast<int>(placement));
            expect_exact<T>(P, UnifiedPolicy<L>{U, R, placement}, g);
          });
      }
    }
}

}  // namespace

TEST_CASE_TEMPLATE("Ulysses: world sizes 1..8, causal and not, MHA and GQA with kv_heads < ranks", T, float, double) {
  ulysses_all_worlds<T>();
}

TEST_CASE_TEMPLATE("Ring: world sizes 1..8, every layout, causal and not", T, float, double) {
  ring_all_worlds<T>();
}

TEST_CASE_TEMPLATE("Unified: every factorisation U x R of 1..8, both placements, every layout", T, float, double) {
  unified_all_factorisations<T>();
}

TEST_CASE("Unified with ulysses_degree 1 is Ring and with ring_degree 1 is Ulysses, bit for bit") {
  test::RunOptions opt;
  opt.gather = true;
  for (int P : {2, 3, 4, 6}) {
    for (bool causal : {false, true}) {
      CAPTURE(P);
      CAPTURE(causal);
      const GlobalShape c = make_case(P * 10, 2 * P, P, 12, causal, 500 + P);
      const GlobalData g = test::make_global_as<double>(c);
      for_each_layout([&]<class L>() {
        CAPTURE(L::name);
        const auto ring = expect_exact<double>(P, RingPolicy<L>{}, g, opt);
        for (auto placement : {MeshPlacement::ulysses_adjacent, MeshPlacement::ring_adjacent}) {
          const auto u1 = expect_exact<double>(P, UnifiedPolicy<L>{1, P, placement}, g, opt);
          CHECK(u1.out == ring.out);
          CHECK(u1.lse == ring.lse);
          CHECK(u1.bytes_sent == ring.bytes_sent);
        }
        // Derived degree: only ring_degree given.
        const auto derived = expect_exact<double>(P, UnifiedPolicy<L>{0, P}, g, opt);
        CHECK(derived.out == ring.out);
      });
      const auto ulysses = expect_exact<double>(P, UlyssesPolicy{}, g, opt);
      for (auto placement : {MeshPlacement::ulysses_adjacent, MeshPlacement::ring_adjacent}) {
        const auto r1 = expect_exact<double>(P, UnifiedPolicy<>{P, 1, placement}, g, opt);
        CHECK(r1.out == ulysses.out);
        CHECK(r1.lse == ulysses.lse);
        CHECK(r1.bytes_sent == ulysses.bytes_sent);
      }
      // The float path agrees too (same code, same order of operations).
      const GlobalData gf = test::make_global_as<float>(c);
      const auto uf = expect_exact<float>(P, UlyssesPolicy{}, gf, opt);
      const auto rf = expect_exact<float>(P, UnifiedPolicy<>{P, 1}, gf, opt);
      CHECK(uf.out == rf.out);
    }
  }
  // The gathered output is the whole answer: every row was written by some rank.
  const GlobalShape c = make_case(24, 4, 4, 8, true, 77);
  const GlobalData g = test::make_global_as<double>(c);
  const auto r = expect_exact<double>(4, UnifiedPolicy<Zigzag>{2, 2}, g, opt);
  double worst = 0;
  for (std::size_t i = 0; i < r.out.size(); ++i) worst = std::max(worst, std::abs(r.out[i] - g.out[i]));
  CHECK(worst <= 1e-12);
}

TEST_CASE("policies: GQA and MQA with kv_heads below the Ulysses degree, batch > 1, custom scale") {
  // 8 query heads on a 4 x 2 mesh with 1 or 2 K/V heads: Ulysses ranks share K/V heads.
  for (std::int64_t kv : {1, 2}) {
    for (bool causal : {false, true}) {
      CAPTURE(kv);
      CAPTURE(causal);
      GlobalShape c = make_case(48, 8, kv, 16, causal, 600 + kv, 2);
      c.scale = 0.37;
      const GlobalData g = test::make_global_as<float>(c);
      expect_exact<float>(8, UlyssesPolicy{}, g);
      expect_exact<float>(8, UnifiedPolicy<Zigzag>{4, 2}, g);
      expect_exact<float>(8, UnifiedPolicy<Stripe>{4, 2, MeshPlacement::ring_adjacent}, g);
      expect_exact<float>(8, UnifiedPolicy<Contiguous>{2, 4}, g);
      expect_exact<float>(6, UnifiedPolicy<Zigzag>{2, 3}, g);
    }
  }
}

TEST_CASE("policies: one plan and workspace serve many forward calls") {
  const GlobalShape c = make_case(60, 6, 3, 8, true, 700);
  const GlobalData g = test::make_global_as<float>(c);
  test::RunOptions opt;
  opt.forward_calls = 3;
  expect_exact<float>(3, RingPolicy<Zigzag>{}, g, opt);
  expect_exact<float>(6, UnifiedPolicy<Stripe>{3, 2}, g, opt);
  expect_exact<float>(6, UnifiedPolicy<Zigzag>{2, 3, MeshPlacement::ring_adjacent}, g, opt);
  opt.with_lse = false;
  expect_exact<float>(3, UlyssesPolicy{}, g, opt);
  expect_exact<float>(6, UnifiedPolicy<Contiguous>{3, 2}, g, opt);
}

TEST_CASE("policies: the reference kernel can stand in as the local kernel") {
  // Kernel is a template parameter: the exact kernel gives the exact answer in double.
  const GlobalShape c = make_case(40, 4, 2, 8, true, 800);
  const GlobalData g = test::make_global_as<double>(c);
  const auto r = test::run_policy<double, UnifiedPolicy<Zigzag>, ReferenceKernel>(4, UnifiedPolicy<Zigzag>{2, 2}, g);
  CHECK(!r.err.nan);
  CHECK(r.err.rel() <= 1e-12);
  CHECK(r.err.lse_rel() <= 1e-12);
}
