// ReferenceKernel against answers worked out by hand: the yardstick must itself be right.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "support/attention_check.hpp"

using namespace seqpar;

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

/// Contiguous BSHD tensors and an LSE stored [B, H, S], filled with a sentinel.
struct Io {
  std::vector<double> q, k, v, out, lse;
  std::int64_t b, sq, sk, h, kh, d;
  Io(std::int64_t b_, std::int64_t sq_, std::int64_t sk_, std::int64_t h_, std::int64_t kh_, std::int64_t d_)
      : b(b_), sq(sq_), sk(sk_), h(h_), kh(kh_), d(d_) {
    q.assign(b * sq * h * d, 0);
    k.assign(b * sk * kh * d, 0);
    v.assign(b * sk * kh * d, 0);
    out.assign(b * sq * h * d, -777);
    lse.assign(b * sq * h, -777);
  }
  void run(const KernelParams& p) {
    using CV = TensorView<const double>;
    ReferenceKernel{}.forward(CV::bshd(q.data(), b, sq, h, d), CV::bshd(k.data(), b, sk, kh, d),
                              CV::bshd(v.data(), b, sk, kh, d), TensorView<double>::bshd(out.data(), b, sq, h, d),
                              TensorView<double>::lse_bhs(lse.data(), b, sq, h), p);
  }
  double o(std::int64_t bb, std::int64_t i, std::int64_t hh, std::int64_t dd = 0) const {
    return out[((bb * sq + i) * h + hh) * d + dd];
  }
  double l(std::int64_t bb, std::int64_t i, std::int64_t hh) const { return lse[(bb * h + hh) * sq + i]; }
};

KernelParams params(double scale, std::int64_t sq, std::int64_t sk) {
  KernelParams p;
  p.scale = scale;
  p.q_positions = PositionMap::run(sq, 0);
  p.k_positions = PositionMap::run(sk, 0);
  return p;
}

}  // namespace

TEST_CASE("reference: one query, two keys, weights 1/4 and 3/4") {
  // Scores q.k = ln3 and 2 ln3: exp gives 3 and 9, so the weights are 1/4 and 3/4.
  Io io(1, 1, 2, 1, 1, 1);
  io.q = {std::log(3.0)};
  io.k = {1.0, 2.0};
  io.v = {2.0, 6.0};
  io.run(params(1.0, 1, 2));
  CHECK(io.o(0, 0, 0) == doctest::Approx(0.25 * 2 + 0.75 * 6).epsilon(1e-15));
  CHECK(io.l(0, 0, 0) == doctest::Approx(std::log(12.0)).epsilon(1e-15));
}

TEST_CASE("reference: the scale multiplies the scores, head_dim sums") {
  // q = (1, 2), keys (2, 0), (0, 1), (1, 1): dot products 2, 2, 3; scale 0.5 -> 1, 1, 1.5.
  Io io(1, 1, 3, 1, 1, 2);
  io.q = {1, 2};
  io.k = {2, 0, 0, 1, 1, 1};
  io.v = {1, -1, 3, 5, -2, 4};
  io.run(params(0.5, 1, 3));
  const double e1 = std::exp(1.0), e15 = std::exp(1.5), z = 2 * e1 + e15;
  CHECK(io.o(0, 0, 0, 0) == doctest::Approx((e1 * 1 + e1 * 3 + e15 * -2) / z).epsilon(1e-14));
  CHECK(io.o(0, 0, 0, 1) == doctest::Approx((e1 * -1 + e1 * 5 + e15 * 4) / z).epsilon(1e-14));
  CHECK(io.l(0, 0, 0) == doctest::Approx(std::log(z)).epsilon(1e-15));
}

TEST_CASE("reference: causal mask from global positions") {
  Io io(1, 2, 2, 1, 1, 1);
  io.q = {5.0, std::log(3.0)};
  io.k = {1.0, 2.0};
  io.v = {2.0, 6.0};
  KernelParams p = params(1.0, 2, 2);
  p.causal = true;
  io.run(p);
  // Query 0 sees key 0 only: O = v0, LSE = its score.
  CHECK(io.o(0, 0, 0) == 2.0);
  CHECK(io.l(0, 0, 0) == doctest::Approx(5.0).epsilon(1e-15));
  // Query 1 sees both.
  CHECK(io.o(0, 1, 0) == doctest::Approx(5.0).epsilon(1e-15));
  CHECK(io.l(0, 1, 0) == doctest::Approx(std::log(12.0)).epsilon(1e-15));

  SUBCASE("positions, not local indices, decide; a row that sees no key is O = 0, LSE = -inf") {
    p.q_positions = PositionMap::run(2, 10, 10);  // 10, 20
    p.k_positions = PositionMap::run(2, 15, 5);   // 15, 20
    io.run(p);
    CHECK(io.o(0, 0, 0) == 0.0);
    CHECK(io.l(0, 0, 0) == -inf);
    CHECK(io.o(0, 1, 0) == doctest::Approx(5.0).epsilon(1e-15));
    CHECK(io.l(0, 1, 0) == doctest::Approx(std::log(12.0)).epsilon(1e-15));
  }
  SUBCASE("a key at the query's own position is visible (<=, not <)") {
    p.q_positions = PositionMap::run(2, 3, 1);  // 3, 4
    p.k_positions = PositionMap::run(2, 4, 1);  // 4, 5
    io.run(p);
    CHECK(io.l(0, 0, 0) == -inf);
    CHECK(io.o(0, 1, 0) == 2.0);  // query at 4 sees the key at 4 only
    CHECK(io.l(0, 1, 0) == doctest::Approx(std::log(3.0)).epsilon(1e-15));
  }
}

TEST_CASE("reference: every row masked when there are no keys") {
  Io io(1, 3, 0, 2, 1, 2);
  for (auto& x : io.q) x = 0.5;
  io.run(params(1.0, 3, 0));
  for (double x : io.out) CHECK(x == 0.0);
  for (double x : io.lse) CHECK(x == -inf);
}

TEST_CASE("reference: GQA maps query head h to K/V head h / group_size, with head offsets") {
  // Two K/V heads, four query heads: heads 0,1 read K/V head 0 and heads 2,3 read head 1.
  Io io(1, 1, 2, 4, 2, 1);
  for (auto& x : io.q) x = std::log(3.0);
  io.k = {1.0, 2.0, 2.0, 1.0};    // [s][kv head]: head 0 keys (1, 2), head 1 keys (2, 1)
  io.v = {2.0, 10.0, 6.0, 20.0};  // head 0 values (2, 6), head 1 values (10, 20)
  KernelParams p = params(1.0, 1, 2);
  p.group_size = 2;
  io.run(p);
  const double head0 = 0.25 * 2 + 0.75 * 6, head1 = 0.75 * 10 + 0.25 * 20;
  CHECK(io.o(0, 0, 0) == doctest::Approx(head0).epsilon(1e-15));
  CHECK(io.o(0, 0, 1) == doctest::Approx(head0).epsilon(1e-15));
  CHECK(io.o(0, 0, 2) == doctest::Approx(head1).epsilon(1e-15));
  CHECK(io.o(0, 0, 3) == doctest::Approx(head1).epsilon(1e-15));

  SUBCASE("a slice of heads: local query heads are global 1, 2") {
    Io s(1, 1, 2, 2, 2, 1);
    s.q = {std::log(3.0), std::log(3.0)};
    s.k = io.k;
    s.v = io.v;
    p.q_head_begin = 1;
    s.run(p);
    CHECK(s.o(0, 0, 0) == doctest::Approx(head0).epsilon(1e-15));
    CHECK(s.o(0, 0, 1) == doctest::Approx(head1).epsilon(1e-15));
  }
  SUBCASE("a slice of K/V heads: global query heads 2, 3 against global K/V head 1 only") {
    Io s(1, 1, 2, 2, 1, 1);
    s.q = {std::log(3.0), std::log(3.0)};
    s.k = {2.0, 1.0};
    s.v = {10.0, 20.0};
    p.q_head_begin = 2;
    p.kv_head_begin = 1;
    s.run(p);
    CHECK(s.o(0, 0, 0) == doctest::Approx(head1).epsilon(1e-15));
    CHECK(s.o(0, 0, 1) == doctest::Approx(head1).epsilon(1e-15));
  }
}

TEST_CASE("reference: batches are independent and strided views are honoured") {
  // Batch 0 is the 1/4, 3/4 case; batch 1 has equal scores so its output is the mean.
  const std::int64_t B = 2, S = 1, K = 2;
  std::vector<double> q = {std::log(3.0), 0.7};
  std::vector<double> k = {1.0, 2.0, 3.0, 3.0};
  std::vector<double> v = {2.0, 6.0, 1.0, 4.0};
  std::vector<double> out(2, -1), lse(2, -1);
  using CV = TensorView<const double>;
  KernelParams p = params(1.0, S, K);
  // out stored [S, B, H, D] and lse as float, to cover non-BSHD strides and another LSE type.
  std::vector<float> lse_f(2, -1);
  ReferenceKernel{}.forward(CV::bshd(q.data(), B, S, 1, 1), CV::bshd(k.data(), B, K, 1, 1),
                            CV::bshd(v.data(), B, K, 1, 1), TensorView<double>::sbhd(out.data(), B, S, 1, 1),
                            TensorView<float>::lse_bhs(lse_f.data(), B, S, 1), p);
  CHECK(out[0] == doctest::Approx(5.0).epsilon(1e-15));
  CHECK(out[1] == doctest::Approx(2.5).epsilon(1e-15));
  CHECK(lse_f[0] == doctest::Approx(std::log(12.0)).epsilon(1e-7));
  CHECK(lse_f[1] == doctest::Approx(2.1 + std::log(2.0)).epsilon(1e-7));
}

TEST_CASE("reference: an absent LSE view is not written and the output is unchanged") {
  Io io(1, 1, 2, 1, 1, 1);
  io.q = {std::log(3.0)};
  io.k = {1.0, 2.0};
  io.v = {2.0, 6.0};
  using CV = TensorView<const double>;
  ReferenceKernel{}.forward(CV::bshd(io.q.data(), 1, 1, 1, 1), CV::bshd(io.k.data(), 1, 2, 1, 1),
                            CV::bshd(io.v.data(), 1, 2, 1, 1), TensorView<double>::bshd(io.out.data(), 1, 1, 1, 1),
                            TensorView<double>{}, params(1.0, 1, 2));
  CHECK(io.out[0] == doctest::Approx(5.0).epsilon(1e-15));
  CHECK(io.lse[0] == -777);
}
