// Bytes each rank sends in one forward, asserted exactly: against the closed forms of the
// papers on even shapes, against the real-token count (test::analytic_forward_bytes) on any
// shape, and against the plan's own count. AnythingPolicy<X> sends what X sends.
#include <doctest/doctest.h>

#include <random>
#include <vector>

#include "support/attention_check.hpp"

using namespace seqpar;
using test::GlobalShape;

namespace {

/// Traffic does not depend on the mask (skipped steps still forward K/V): alternate it.
GlobalShape make_case(std::int64_t seq, std::int64_t heads, std::int64_t kv_heads, std::int64_t dim, std::int64_t batch,
                     std::uint64_t seed) {
  return test::make_case(seq, heads, kv_heads, dim, seed % 2 == 1, seed, batch);
}

/// Runs the policy and checks the output (a traffic test on a wrong answer proves nothing);
/// returns the bytes each rank sent, after checking them against the plan's own count and
/// the real-token formula.
template <class T, class Policy>
std::vector<std::uint64_t> bytes_of(int ranks, Policy policy, const GlobalShape& c, test::RunOptions opt = {}) {
  const auto g = test::make_global_as<T>(c);
  const auto r = test::run_policy<T>(ranks, policy, g, opt);
  CHECK(r.err.within(test::tolerance<T>));
  const auto formula = test::analytic_forward_bytes(c, test::mesh_shape(mesh_config(policy, ranks)), r.lengths_q,
                                                    r.lengths_kv, sizeof(T), sizeof(acc_t<T>), opt.with_lse);
  for (int w = 0; w < ranks; ++w) {
    CAPTURE(w);
    CHECK(r.bytes_sent[w] == formula[w]);
    CHECK(r.bytes_sent[w] == r.expected_bytes[w]);
  }
  return r.bytes_sent;
}

}  // namespace

TEST_CASE("traffic: Ulysses sends (P-1)/P of its Q, K, V and O slices") {
  test::RunOptions no_lse;
  no_lse.with_lse = false;
  for (int P = 1; P <= 8; ++P) {
    CAPTURE(P);
    // heads and kv_heads divisible by P, L tokens per rank.
    const std::int64_t L = 5, H = 2 * P, K = P, D = 8, B = 2;
    const GlobalShape c = make_case(P * L, H, K, D, B, 10 + P);
    const std::uint64_t slice = sizeof(float) * B * L * D * (H + K + K + H);  // Q, K, V, O
    for (auto bytes : bytes_of<float>(P, UlyssesPolicy{}, c, no_lse)) CHECK(bytes * P == slice * (P - 1));
    // With the LSE, its (P-1)/P comes back too (float32 for a float problem).
    const std::uint64_t lse_slice = sizeof(float) * B * L * H;
    for (auto bytes : bytes_of<float>(P, UlyssesPolicy{}, c)) CHECK(bytes * P == (slice + lse_slice) * (P - 1));
    // Double: 8-byte elements and an 8-byte LSE.
    for (auto bytes : bytes_of<double>(P, UlyssesPolicy{}, c)) CHECK(bytes * P == 2 * (slice + lse_slice) * (P - 1));
  }
}

TEST_CASE("traffic: Ring sends P-1 blocks of K and V per rank, whatever the layout") {
  for (int P = 1; P <= 8; ++P) {
    CAPTURE(P);
    const std::int64_t L = 6, H = 4, K = 2, D = 8, B = 1;
    const GlobalShape c = make_case(P * L, H, K, D, B, 20 + P);
    const std::uint64_t kv_block = sizeof(float) * B * L * K * D;
    for (auto bytes : bytes_of<float>(P, RingPolicy<Contiguous>{}, c)) CHECK(bytes == 2 * kv_block * (P - 1));
    for (auto bytes : bytes_of<float>(P, RingPolicy<Zigzag>{}, c)) CHECK(bytes == 2 * kv_block * (P - 1));
    for (auto bytes : bytes_of<float>(P, RingPolicy<Stripe>{}, c)) CHECK(bytes == 2 * kv_block * (P - 1));
  }
}

TEST_CASE("traffic: Unified sends Ulysses traffic in its group plus R-1 gathered K/V blocks") {
  for (int P = 1; P <= 8; ++P)
    for (int U = 1; U <= P; ++U) {
      if (P % U) continue;
      const int R = P / U;
      CAPTURE(P);
      CAPTURE(U);
      const std::int64_t L = 4, H = 2 * U, K = U, D = 8, B = 1;
      const GlobalShape c = make_case(P * L, H, K, D, B, 30 + P * 8 + U);
      test::RunOptions no_lse;
      no_lse.with_lse = false;
      // Ulysses inside the group: (U-1)/U of Q, K, V, O. The ring: R-1 blocks of the gathered
      // ring block (U*L tokens) with this member's K/U heads, K and V.
      const std::uint64_t slice = sizeof(float) * B * L * D * (2 * H + 2 * K);
      const std::uint64_t ring = 2 * sizeof(float) * B * (U * L) * (K / U) * D * (R - 1);
      for (auto placement : {MeshPlacement::ulysses_adjacent, MeshPlacement::ring_adjacent}) {
        for (auto bytes : bytes_of<float>(P, UnifiedPolicy<Zigzag>{U, R, placement}, c, no_lse))
          CHECK(bytes * U == slice * (U - 1) + ring * U);
        for (auto bytes : bytes_of<float>(P, UnifiedPolicy<Stripe>{U, R, placement}, c, no_lse))
          CHECK(bytes * U == slice * (U - 1) + ring * U);
      }
      // USP's closed form (Fang and Zhao 2024): s*B*(L)*D*[(2H + 2K)(U-1)/U + 2*K*(R-1)].
      for (auto bytes : bytes_of<float>(P, UnifiedPolicy<Contiguous>{U, R}, c, no_lse))
        CHECK(bytes * U == sizeof(float) * B * L * D * ((2 * H + 2 * K) * (U - 1) + 2 * K * (R - 1) * U));
    }
}

TEST_CASE("traffic: GQA with kv_heads < ulysses_degree sends each K/V head only where it is read") {
  // 8 query heads, 2 K/V heads, U = 4: member v reads K/V head v / 2 only. Replicating both
  // K/V heads to everyone would send 2 heads to each of 3 peers; the exact count is 1 head to
  // each of 3 peers.
  const std::int64_t L = 6, H = 8, K = 2, D = 8, B = 1;
  const GlobalShape c = make_case(4 * L, H, K, D, B, 41);
  test::RunOptions no_lse;
  no_lse.with_lse = false;
  const std::uint64_t q_out = sizeof(float) * B * L * D * (H - H / 4);
  const std::uint64_t kv_out = 2 * sizeof(float) * B * L * D * 3 * 1;
  const std::uint64_t o_back = sizeof(float) * B * (3 * L) * (H / 4) * D;
  for (auto bytes : bytes_of<float>(4, UlyssesPolicy{}, c, no_lse)) CHECK(bytes == q_out + kv_out + o_back);
  // MQA on a 4 x 2 mesh: one K/V head, every member needs it.
  const GlobalShape m = make_case(8 * L, H, 1, D, B, 42);
  bytes_of<float>(8, UnifiedPolicy<Zigzag>{4, 2}, m);
  bytes_of<float>(8, AnythingPolicy<UnifiedPolicy<Zigzag>>{{4, 2}}, m);
}

TEST_CASE("traffic: AnythingPolicy<X> sends exactly the bytes of X on even shapes") {
  for (int P = 1; P <= 8; ++P) {
    CAPTURE(P);
    const GlobalShape c = make_case(P * 6, 2 * P, P, 8, 1, 50 + P);
    CHECK(bytes_of<float>(P, AnythingPolicy<UlyssesPolicy>{}, c) == bytes_of<float>(P, UlyssesPolicy{}, c));
    CHECK(bytes_of<float>(P, AnythingPolicy<RingPolicy<Zigzag>>{}, c) == bytes_of<float>(P, RingPolicy<Zigzag>{}, c));
    CHECK(bytes_of<float>(P, AnythingPolicy<RingPolicy<Stripe>>{}, c) == bytes_of<float>(P, RingPolicy<Stripe>{}, c));
    CHECK(bytes_of<double>(P, AnythingPolicy<RingPolicy<Contiguous>>{}, c) ==
          bytes_of<double>(P, RingPolicy<Contiguous>{}, c));
    for (int U = 1; U <= P; ++U) {
      if (P % U) continue;
      CAPTURE(U);
      const UnifiedPolicy<Zigzag> plain{U, P / U, MeshPlacement::ring_adjacent};
      CHECK(bytes_of<float>(P, AnythingPolicy<UnifiedPolicy<Zigzag>>{plain}, c) == bytes_of<float>(P, plain, c));
    }
  }
}

TEST_CASE("traffic: uneven shapes send the bytes of the real tokens and heads") {
  // Hand-picked uneven cases; the seeded sweep (test_anything_sweep) covers many more.
  struct Case {
    int ranks, U;
    std::int64_t heads, kv_heads;
    std::vector<std::int64_t> lq, lk;
  };
  const std::vector<Case> cases = {
      {3, 3, 5, 5, {4, 0, 7}, {4, 0, 7}},            // Ulysses, heads 5 over 3 ranks, an empty rank
      {4, 4, 6, 2, {3, 3, 3, 1}, {2, 9, 0, 5}},      // Ulysses, GQA, cross attention
      {3, 1, 4, 1, {5, 0, 2}, {1, 6, 6}},            // Ring, MQA, cross attention
      {6, 2, 7, 7, {1, 2, 3, 4, 5, 6}, {6, 5, 4, 3, 2, 1}},  // 2 x 3, odd heads
      {8, 4, 3, 1, {0, 0, 9, 1, 2, 2, 2, 2}, {3, 3, 3, 3, 0, 0, 0, 1}},  // U > heads: a member has no head
  };
  for (const Case& k : cases) {
    CAPTURE(k.ranks);
    CAPTURE(k.U);
    std::int64_t sq = 0, sk = 0;
    for (auto x : k.lq) sq += x;
    for (auto x : k.lk) sk += x;
    GlobalShape c = make_case(sq, k.heads, k.kv_heads, 5, 2, 60 + k.ranks);
    c.seq_kv = sk;
    test::RunOptions opt;
    opt.lengths_q = k.lq;
    opt.lengths_kv = k.lk;
    const int R = k.ranks / k.U;
    for (auto placement : {MeshPlacement::ulysses_adjacent, MeshPlacement::ring_adjacent}) {
      bytes_of<float>(k.ranks, AnythingPolicy<UnifiedPolicy<Contiguous>>{{k.U, R, placement}}, c, opt);
      bytes_of<double>(k.ranks, AnythingPolicy<UnifiedPolicy<Zigzag>>{{k.U, R, placement}}, c, opt);
    }
    if (R == 1) bytes_of<float>(k.ranks, AnythingPolicy<UlyssesPolicy>{}, c, opt);
    if (k.U == 1) bytes_of<float>(k.ranks, AnythingPolicy<RingPolicy<Zigzag>>{}, c, opt);
  }
  // One concrete number, worked by hand: Ulysses on 3 ranks, heads 5 -> 2, 2, 1; rank 0
  // holds 4 tokens, B = 2, D = 5, float, no LSE. Q out: 4 tokens x 3 heads; K, V out: 4
  // tokens x 3 heads each; O back: (0 + 7) tokens x 2 heads. (4*3*3 + 7*2) * 2 * 5 * 4 = 2000.
  GlobalShape c = make_case(11, 5, 5, 5, 2, 70);
  test::RunOptions opt;
  opt.lengths_q = opt.lengths_kv = {4, 0, 7};
  opt.with_lse = false;
  CHECK(bytes_of<float>(3, AnythingPolicy<UlyssesPolicy>{}, c, opt)[0] == 2000);
}
