// SequenceLayout, split_mesh, PositionMap and visible_pairs: which global positions each rank
// holds, for every layout, even and uneven.
#include <doctest/doctest.h>

#include <random>
#include <vector>

#include "support/attention_check.hpp"

using namespace seqpar;

namespace {

std::vector<std::int64_t> positions_of(const PositionMap& m) {
  std::vector<std::int64_t> out;
  for (std::int64_t i = 0; i < m.size(); ++i) out.push_back(m(i));
  return out;
}

using Pos = std::vector<std::int64_t>;

/// Every position of [0, total) appears exactly once over all mesh ranks, each rank's
/// positions strictly increase, and each rank's positions are its ring block's positions
/// [offset, offset + length) in Ulysses order.
void check_partition(const SequenceLayout& l) {
  std::vector<int> seen(static_cast<std::size_t>(l.total()), 0);
  for (int r = 0; r < l.ring_degree(); ++r) {
    const Pos block = positions_of(l.block(r));
    Pos joined;
    for (int u = 0; u < l.ulysses_degree(); ++u) {
      const Pos mine = positions_of(l.positions(r, u));
      REQUIRE(static_cast<std::int64_t>(mine.size()) == l.length(r, u));
      for (std::size_t i = 0; i < mine.size(); ++i) {
        REQUIRE(mine[i] >= 0);
        REQUIRE(mine[i] < l.total());
        if (i > 0) CHECK(mine[i] > mine[i - 1]);
        ++seen[static_cast<std::size_t>(mine[i])];
      }
      joined.insert(joined.end(), mine.begin(), mine.end());
    }
    CHECK(joined == block);
  }
  for (std::int64_t t = 0; t < l.total(); ++t) {
    CAPTURE(t);
    CHECK(seen[static_cast<std::size_t>(t)] == 1);
  }
}

}  // namespace

TEST_CASE("layout: contiguous, even and uneven") {
  SequenceLayout l(LayoutKind::contiguous, 3, 1, {4, 4, 4});
  CHECK(l.total() == 12);
  CHECK(positions_of(l.block(0)) == Pos{0, 1, 2, 3});
  CHECK(positions_of(l.block(1)) == Pos{4, 5, 6, 7});
  CHECK(positions_of(l.block(2)) == Pos{8, 9, 10, 11});
  SequenceLayout u(LayoutKind::contiguous, 3, 1, {2, 0, 5});
  CHECK(positions_of(u.block(0)) == Pos{0, 1});
  CHECK(positions_of(u.block(1)).empty());
  CHECK(positions_of(u.block(2)) == Pos{2, 3, 4, 5, 6});
  check_partition(u);
}

TEST_CASE("layout: zigzag P = 4 is r0 = {C0, C7}, r1 = {C1, C6}, r2 = {C2, C5}, r3 = {C3, C4}") {
  // 16 tokens, 8 chunks of 2.
  SequenceLayout l(LayoutKind::zigzag, 4, 1, {4, 4, 4, 4});
  CHECK(positions_of(l.block(0)) == Pos{0, 1, 14, 15});
  CHECK(positions_of(l.block(1)) == Pos{2, 3, 12, 13});
  CHECK(positions_of(l.block(2)) == Pos{4, 5, 10, 11});
  CHECK(positions_of(l.block(3)) == Pos{6, 7, 8, 9});
  check_partition(l);
}

TEST_CASE("layout: zigzag with odd blocks puts the extra token in the first chunk") {
  // Blocks 3, 3, 2, 2 (10 tokens): chunks C0..C7 have 2, 2, 1, 1 | 1, 1, 1, 1.
  SequenceLayout l(LayoutKind::zigzag, 4, 1, {3, 3, 2, 2});
  CHECK(positions_of(l.block(0)) == Pos{0, 1, 9});
  CHECK(positions_of(l.block(1)) == Pos{2, 3, 8});
  CHECK(positions_of(l.block(2)) == Pos{4, 7});
  CHECK(positions_of(l.block(3)) == Pos{5, 6});
  check_partition(l);
  // A block of one token has an empty second chunk.
  SequenceLayout one(LayoutKind::zigzag, 2, 1, {1, 0});
  CHECK(positions_of(one.block(0)) == Pos{0});
  CHECK(positions_of(one.block(1)).empty());
}

TEST_CASE("layout: zigzag ring blocks are split across the Ulysses group in order") {
  // USP: ring rank r's pair of chunks split over U = 2 members; 24 tokens, R = 2: chunks of 6.
  SequenceLayout l(LayoutKind::zigzag, 2, 2, {6, 6, 6, 6});
  CHECK(positions_of(l.block(0)) == Pos{0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 23});
  CHECK(positions_of(l.positions(0, 0)) == Pos{0, 1, 2, 3, 4, 5});
  CHECK(positions_of(l.positions(0, 1)) == Pos{18, 19, 20, 21, 22, 23});
  CHECK(positions_of(l.positions(1, 0)) == Pos{6, 7, 8, 9, 10, 11});
  CHECK(positions_of(l.positions(1, 1)) == Pos{12, 13, 14, 15, 16, 17});
  // Uneven members: one holds 4, the other 8 of the block; a member straddles both chunks.
  SequenceLayout u(LayoutKind::zigzag, 2, 2, {4, 8, 6, 6});
  CHECK(positions_of(u.positions(0, 0)) == Pos{0, 1, 2, 3});
  CHECK(positions_of(u.positions(0, 1)) == Pos{4, 5, 18, 19, 20, 21, 22, 23});
  CHECK(u.offset_in_block(0, 1) == 4);
  check_partition(u);
}

TEST_CASE("layout: stripe puts token t on ring rank t mod R") {
  SequenceLayout l(LayoutKind::stripe, 3, 1, {4, 3, 3});
  CHECK(positions_of(l.block(0)) == Pos{0, 3, 6, 9});
  CHECK(positions_of(l.block(1)) == Pos{1, 4, 7});
  CHECK(positions_of(l.block(2)) == Pos{2, 5, 8});
  check_partition(l);
  SequenceLayout even(LayoutKind::stripe, 4, 1, {3, 3, 3, 3});
  CHECK(positions_of(even.block(3)) == Pos{3, 7, 11});
  // Fewer tokens than ranks.
  SequenceLayout few(LayoutKind::stripe, 3, 1, {1, 1, 0});
  CHECK(positions_of(few.block(1)) == Pos{1});
  CHECK(positions_of(few.block(2)).empty());
  // Split across a Ulysses group: the block's positions in order, cut by length.
  SequenceLayout mesh(LayoutKind::stripe, 2, 3, {1, 0, 4, 2, 2, 1});
  CHECK(positions_of(mesh.positions(0, 2)) == Pos{2, 4, 6, 8});
  CHECK(positions_of(mesh.positions(1, 1)) == Pos{5, 7});
  check_partition(mesh);
}

TEST_CASE("layout: stripe lengths that do not follow from the total throw ConfigError") {
  CHECK_THROWS_AS(SequenceLayout(LayoutKind::stripe, 3, 1, {3, 3, 4}), ConfigError);
  CHECK_THROWS_AS(SequenceLayout(LayoutKind::stripe, 2, 1, {0, 1}), ConfigError);
  CHECK_THROWS_AS(SequenceLayout(LayoutKind::stripe, 2, 2, {1, 1, 2, 1}), ConfigError);  // blocks 2 and 3
  CHECK_THROWS_WITH_AS(SequenceLayout(LayoutKind::stripe, 3, 1, {3, 3, 4}),
                       doctest::Contains("ring rank 0 must hold 4"), ConfigError);
  // Other misuse.
  CHECK_THROWS_AS(SequenceLayout(LayoutKind::contiguous, 2, 1, {1, -1}), ConfigError);
  CHECK_THROWS_AS(SequenceLayout(LayoutKind::contiguous, 2, 2, {1, 1, 1}), ConfigError);
  CHECK_THROWS_AS(SequenceLayout(LayoutKind::zigzag, 0, 1, {}), ConfigError);
}

TEST_CASE("layout: every position appears exactly once, for every layout, degree and length") {
  std::mt19937_64 rng(11);
  for (auto kind : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::stripe})
    for (int R = 1; R <= 8; ++R)
      for (int U = 1; U * R <= 8; ++U)
        for (std::int64_t total : {0, 1, 2, 7, 16, 63, 64, 100, 257}) {
          CAPTURE(layout_name(kind));
          CAPTURE(R);
          CAPTURE(U);
          CAPTURE(total);
          // Even split, then (not for stripe's block sizes) random uneven lengths with zeros.
          check_partition(SequenceLayout(kind, R, U, split_mesh(total, R, U)));
          std::vector<std::int64_t> lengths(static_cast<std::size_t>(R * U));
          if (kind == LayoutKind::stripe) {
            // Stripe fixes the block sizes; the pieces inside a block are free.
            const auto blocks = split_evenly(total, R);
            for (int r = 0; r < R; ++r) {
              std::int64_t left = blocks[r];
              for (int u = 0; u < U; ++u) {
                const std::int64_t take = u + 1 == U ? left : static_cast<std::int64_t>(rng() % (left + 1));
                lengths[r * U + u] = take;
                left -= take;
              }
            }
          } else {
            for (auto& x : lengths) x = rng() % 3 == 0 ? 0 : static_cast<std::int64_t>(rng() % (total + 1));
          }
          check_partition(SequenceLayout(kind, R, U, lengths));
        }
}

TEST_CASE("split_mesh: ring blocks differ by at most one, then pieces of a block") {
  CHECK(split_evenly(10, 4) == std::vector<std::int64_t>{3, 3, 2, 2});
  CHECK(split_evenly(2, 4) == std::vector<std::int64_t>{1, 1, 0, 0});
  CHECK(split_mesh(10, 3, 2) == std::vector<std::int64_t>{2, 2, 2, 1, 2, 1});
  CHECK(split_mesh(24, 2, 2) == std::vector<std::int64_t>{6, 6, 6, 6});
  CHECK(split_mesh(0, 2, 2) == std::vector<std::int64_t>{0, 0, 0, 0});
  CHECK(split_mesh(3969, 1, 4) == std::vector<std::int64_t>{993, 992, 992, 992});
  // The stripe layout accepts what split_mesh gives (its blocks follow from the total).
  for (std::int64_t total = 0; total < 40; ++total)
    for (int R = 1; R <= 5; ++R) CHECK_NOTHROW(SequenceLayout(LayoutKind::stripe, R, 2, split_mesh(total, R, 2)));
}

TEST_CASE("PositionMap: run, sub across segments, first and last") {
  PositionMap m = PositionMap::run(3, 2, 5);  // 2, 7, 12
  m.seg[1] = {4, 20, 1};                      // 20, 21, 22, 23
  m.segments = 2;
  CHECK(m.size() == 7);
  CHECK(positions_of(m) == Pos{2, 7, 12, 20, 21, 22, 23});
  CHECK(m.first() == 2);
  CHECK(m.last() == 23);
  CHECK(positions_of(m.sub(0, 7)) == positions_of(m));
  CHECK(positions_of(m.sub(1, 4)) == Pos{7, 12, 20, 21});
  CHECK(m.sub(1, 4).segments == 2);
  CHECK(positions_of(m.sub(3, 2)) == Pos{20, 21});
  CHECK(m.sub(3, 2).segments == 1);
  CHECK(positions_of(m.sub(0, 2)) == Pos{2, 7});
  CHECK(m.sub(2, 0).size() == 0);
  CHECK(m.sub(7, 0).size() == 0);
  CHECK(PositionMap::run(0, 5).size() == 0);
  CHECK(PositionMap::run(0, 5).segments == 0);
  // Every sub of a random map is the matching slice of its positions.
  std::mt19937_64 rng(5);
  for (int n = 0; n < 200; ++n) {
    PositionMap r = PositionMap::run(rng() % 6, rng() % 9, 1 + rng() % 3);
    if (r.segments == 1 && rng() % 2) {
      r.seg[1] = {static_cast<std::int64_t>(1 + rng() % 6), r.last() + 1 + static_cast<std::int64_t>(rng() % 4),
                  static_cast<std::int64_t>(1 + rng() % 3)};
      r.segments = 2;
    }
    const Pos all = positions_of(r);
    const std::int64_t begin = rng() % (all.size() + 1);
    const std::int64_t count = rng() % (all.size() - begin + 1);
    CHECK(positions_of(r.sub(begin, count)) == Pos(all.begin() + begin, all.begin() + begin + count));
  }
}

TEST_CASE("visible_pairs equals a brute-force count") {
  std::mt19937_64 rng(9);
  auto random_map = [&] {
    PositionMap m = PositionMap::run(rng() % 30, rng() % 20, 1 + rng() % 4);
    if (m.segments == 1 && rng() % 2) {
      m.seg[1] = {static_cast<std::int64_t>(1 + rng() % 30), m.last() + 1 + static_cast<std::int64_t>(rng() % 30),
                  static_cast<std::int64_t>(1 + rng() % 4)};
      m.segments = 2;
    }
    return m;
  };
  for (int n = 0; n < 500; ++n) {
    const PositionMap q = random_map(), k = random_map();
    std::int64_t brute = 0;
    for (std::int64_t i = 0; i < q.size(); ++i)
      for (std::int64_t j = 0; j < k.size(); ++j) brute += k(j) <= q(i);
    MaskView causal;
    causal.causal = true;
    CHECK(visible_pairs(causal, 0, q, k) == brute);
    CHECK(visible_pairs(MaskView{}, 0, q, k) == q.size() * k.size());
  }
}
