// CpuFlashKernel against ReferenceKernel: odd lengths (not multiples of the 64-row blocks),
// head_dim 1..256, causal masks from arbitrary increasing positions (two segments, strides),
// GQA with head offsets, float and double, output and LSE.
#include <doctest/doctest.h>

#include <random>
#include <vector>

#include "support/attention_check.hpp"

using namespace seqpar;

namespace {

struct KernelCase {
  std::int64_t batch = 1, sq = 1, sk = 1, heads = 2, kv_heads = 1, dim = 8;
  bool causal = false;
  PositionMap qpos, kpos;
  std::int64_t q_head_begin = 0, kv_head_begin = 0, group_size = 2;
  double scale = 0.3;
  std::uint64_t seed = 1;
};

/// An increasing PositionMap of n positions: one or two runs with random strides and a gap.
PositionMap random_positions(std::int64_t n, std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int64_t> stride(1, 4), gap(0, 40), start(0, 30);
  if (n < 2 || rng() % 3 == 0) return PositionMap::run(n, start(rng), stride(rng));
  const std::int64_t n0 = 1 + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(n - 1));
  PositionMap m = PositionMap::run(n0, start(rng), stride(rng));
  m.seg[1] = {n - n0, m.last() + 1 + gap(rng), stride(rng)};
  m.segments = 2;
  return m;
}

/// Runs both kernels on random inputs of type T; returns the worst errors of the flash kernel
/// over every instruction set this CPU runs (the case fails naming the set that missed).
template <class T>
test::Errors compare(const KernelCase& c, int threads = 1) {
  std::mt19937_64 rng(c.seed);
  // The local tensors hold the heads of the slice; group_size refers to the global problem.
  const auto q = test::rounded<T>(test::random_tensor(c.batch * c.sq * c.heads * c.dim, rng));
  const auto k = test::rounded<T>(test::random_tensor(c.batch * c.sk * c.kv_heads * c.dim, rng));
  const auto v = test::rounded<T>(test::random_tensor(c.batch * c.sk * c.kv_heads * c.dim, rng));
  const std::vector<T> qt(q.begin(), q.end()), kt(k.begin(), k.end()), vt(v.begin(), v.end());
  KernelParams p;
  p.scale = c.scale;
  p.causal = c.causal;
  p.q_positions = c.qpos;
  p.k_positions = c.kpos;
  p.group_size = c.group_size;
  p.q_head_begin = c.q_head_begin;
  p.kv_head_begin = c.kv_head_begin;
  using CV = TensorView<const T>;
  const auto qv = CV::bshd(qt.data(), c.batch, c.sq, c.heads, c.dim);
  const auto kv = CV::bshd(kt.data(), c.batch, c.sk, c.kv_heads, c.dim);
  const auto vv = CV::bshd(vt.data(), c.batch, c.sk, c.kv_heads, c.dim);

  std::vector<double> want(q.size()), want_lse(static_cast<std::size_t>(c.batch * c.sq * c.heads));
  ReferenceKernel{}.forward(qv, kv, vv, TensorView<double>::bshd(want.data(), c.batch, c.sq, c.heads, c.dim),
                            TensorView<double>::lse_bhs(want_lse.data(), c.batch, c.sq, c.heads), p);
  test::Errors worst;
  for (CpuIsa isa : test::cpu_isas()) {
    CAPTURE(cpu_isa_name(isa));
    std::vector<T> got(q.size(), T(12345));
    std::vector<acc_t<T>> got_lse(want_lse.size(), acc_t<T>(12345));
    CpuFlashKernel(CpuFlashOptions{.threads = threads, .isa = isa})
        .forward(qv, kv, vv, TensorView<T>::bshd(got.data(), c.batch, c.sq, c.heads, c.dim),
                 TensorView<acc_t<T>>::lse_bhs(got_lse.data(), c.batch, c.sq, c.heads), p);
    test::Errors e;
    for (std::size_t i = 0; i < got.size(); ++i) e.add_out(got[i], want[i]);
    for (std::size_t i = 0; i < got_lse.size(); ++i) e.add_lse(got_lse[i], want_lse[i]);
    CHECK(e.within(test::tolerance<T>));
    worst.merge(e);
  }
  return worst;
}

template <class T>
void sweep_lengths_and_dims() {
  const std::int64_t lengths[] = {1, 3, 63, 64, 65, 127, 129, 200};
  const std::int64_t dims[] = {1, 3, 64, 100, 128, 256};
  std::mt19937_64 rng(42);
  int n = 0;
  for (std::int64_t sq : lengths)
    for (std::int64_t dim : dims)
      for (int causal = 0; causal < 2; ++causal) {
        KernelCase c;
        c.sq = sq;
        // Keys of another length: cycle through the list so every pair of odd sizes shows up.
        c.sk = lengths[(n * 3 + 1) % std::size(lengths)];
        c.dim = dim;
        c.causal = causal;
        c.scale = 1.0 / std::sqrt(double(dim));
        // Large shapes with few heads keep the reference cheap.
        c.heads = dim >= 100 && sq >= 100 ? 2 : 4;
        c.kv_heads = c.heads / 2;
        c.group_size = 2;
        c.qpos = random_positions(c.sq, rng);
        c.kpos = random_positions(c.sk, rng);
        c.seed = static_cast<std::uint64_t>(++n);
        CAPTURE(c.sq);
        CAPTURE(c.sk);
        CAPTURE(c.dim);
        CAPTURE(c.causal);
        const int threads = n % 5 == 0 ? 2 : 1;  // some on the kernel's thread pool
        CAPTURE(threads);
        const auto e = compare<T>(c, threads);
        CHECK(!e.nan);
        CHECK(e.rel() <= test::tolerance<T>);
        CHECK(e.lse_rel() <= test::tolerance<T>);
      }
}

}  // namespace

TEST_CASE("flash kernel (float): odd lengths x head_dim 1..256, causal and not, two-segment positions") {
  sweep_lengths_and_dims<float>();
}

TEST_CASE("flash kernel (double): odd lengths x head_dim 1..256, causal and not, two-segment positions") {
  sweep_lengths_and_dims<double>();
}

TEST_CASE_TEMPLATE("flash kernel: random shapes, GQA slices, zigzag- and stripe-like positions", T, float, double) {
  std::mt19937_64 rng(7);
  for (int n = 0; n < 60; ++n) {
    // Every fourth case runs on the kernel's thread pool (work split across 3 threads).
    const int threads = n % 4 == 1 ? 3 : 1;
    KernelCase c;
    const std::int64_t kvh = 1 + rng() % 3, group = 1 + rng() % 3;
    c.batch = 1 + rng() % 2;
    c.sq = 1 + rng() % 150;
    c.sk = 1 + rng() % 150;
    c.dim = 1 + rng() % 72;
    c.causal = rng() % 4 != 0;
    c.group_size = group;
    // A slice of the global heads, as a Ulysses rank holds: global K/V heads
    // [kv_head_begin, +kv_heads) and a range of query heads inside them.
    c.kv_head_begin = rng() % 2;
    c.kv_heads = kvh;
    const std::int64_t first = c.kv_head_begin * group, last = (c.kv_head_begin + kvh) * group;
    c.q_head_begin = first + rng() % group;
    c.heads = std::max<std::int64_t>(1, last - c.q_head_begin - static_cast<std::int64_t>(rng() % group));
    c.scale = 0.05 + 0.5 * double(rng() % 100) / 100.0;
    c.seed = 1000 + n;
    const int kind = n % 3;
    if (kind == 0) {
      // Zigzag-like: the rank's Q is chunks r and 2P-1-r; K is another rank's two chunks.
      const std::int64_t P = 4, chunk = 1 + rng() % 40, r = rng() % P, j = rng() % P;
      c.sq = 2 * chunk;
      c.sk = 2 * chunk;
      c.qpos = PositionMap::run(chunk, r * chunk);
      c.qpos.seg[1] = {chunk, (2 * P - 1 - r) * chunk, 1};
      c.qpos.segments = 2;
      c.kpos = PositionMap::run(chunk, j * chunk);
      c.kpos.seg[1] = {chunk, (2 * P - 1 - j) * chunk, 1};
      c.kpos.segments = 2;
    } else if (kind == 1) {
      // Stripe-like: token t on rank t mod P; Q of rank r against K of rank j.
      const std::int64_t P = 1 + rng() % 8, r = rng() % P, j = rng() % P;
      c.sk = c.sq;
      c.qpos = PositionMap::run(c.sq, r, P);
      c.kpos = PositionMap::run(c.sk, j, P);
    } else {
      c.qpos = random_positions(c.sq, rng);
      c.kpos = random_positions(c.sk, rng);
    }
    CAPTURE(n);
    CAPTURE(c.sq);
    CAPTURE(c.sk);
    CAPTURE(c.dim);
    CAPTURE(c.heads);
    CAPTURE(c.kv_heads);
    CAPTURE(c.causal);
    CAPTURE(threads);
    const auto e = compare<T>(c, threads);
    CHECK(!e.nan);
    CHECK(e.rel() <= test::tolerance<T>);
    CHECK(e.lse_rel() <= test::tolerance<T>);
  }
}

TEST_CASE_TEMPLATE("flash kernel: long key sequences (256- and 512-row query blocks, per-panel causal trimming)", T,
                   float, double) {
  // From 1024 keys the kernel takes 256-row query blocks, from 2048 512-row ones; causal
  // positions in two runs put the diagonal inside a block, at a different key for every query
  // panel.
  std::mt19937_64 rng(11);
  for (int n = 0; n < 5; ++n) {
    KernelCase c;
    c.sq = n == 4 ? 700 : n < 2 ? 600 : 333;
    c.sk = n == 4 ? 2100 : 1100 + 37 * n;
    c.dim = n % 2 ? 100 : 64;
    c.heads = 2;
    c.kv_heads = 1;
    c.causal = n != 1;
    c.qpos = n == 3 ? random_positions(c.sq, rng) : PositionMap::run(c.sq, 500);
    c.kpos = PositionMap::run(c.sk, 0);
    c.scale = 1.0 / std::sqrt(double(c.dim));
    c.seed = 500 + n;
    CAPTURE(n);
    const auto e = compare<T>(c, n == 2 ? 2 : 1);
    CHECK(e.within(test::tolerance<T>));
  }
}

TEST_CASE_TEMPLATE("flash kernel: a NaN in V or K reaches only the rows that see its key", T, float, double) {
  // Causal, queries and keys at the same positions: V of key 100 and K of key 150 are NaN (a
  // padding row, a stale cache slot). Rows before 100 see neither and must equal the
  // reference (the NaN replaced by 0 there: those rows do not see it); rows from 100 see the
  // NaN V and are NaN. Keys 100 and 150 sit inside query panels on the diagonal, where the
  // products would otherwise multiply P = 0 by NaN.
  const std::int64_t S = 300, H = 2, D = 24;
  std::mt19937_64 rng(9);
  auto q = test::rounded<T>(test::random_tensor(S * H * D, rng));
  auto k = test::rounded<T>(test::random_tensor(S * H * D, rng));
  auto v = test::rounded<T>(test::random_tensor(S * H * D, rng));
  KernelParams p;
  p.scale = 0.2;
  p.causal = true;
  p.q_positions = PositionMap::run(S, 0);
  p.k_positions = PositionMap::run(S, 0);
  using CV = TensorView<const T>;
  std::vector<double> want(q.size()), want_lse(static_cast<std::size_t>(S * H));
  const std::vector<T> qt(q.begin(), q.end()), kt(k.begin(), k.end()), vt(v.begin(), v.end());
  ReferenceKernel{}.forward(CV::bshd(qt.data(), 1, S, H, D), CV::bshd(kt.data(), 1, S, H, D),
                            CV::bshd(vt.data(), 1, S, H, D), TensorView<double>::bshd(want.data(), 1, S, H, D),
                            TensorView<double>::lse_bhs(want_lse.data(), 1, S, H), p);
  std::vector<T> kn = kt, vn = vt;
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t d = 0; d < D; ++d) {
      vn[(100 * H + h) * D + d] = std::numeric_limits<T>::quiet_NaN();
      kn[(150 * H + h) * D + d] = std::numeric_limits<T>::quiet_NaN();
    }
  for (CpuIsa isa : test::cpu_isas()) {
    CAPTURE(cpu_isa_name(isa));
    std::vector<T> got(q.size());
    CpuFlashKernel(CpuFlashOptions{.isa = isa})
        .forward(CV::bshd(qt.data(), 1, S, H, D), CV::bshd(kn.data(), 1, S, H, D), CV::bshd(vn.data(), 1, S, H, D),
                 TensorView<T>::bshd(got.data(), 1, S, H, D), TensorView<acc_t<T>>{}, p);
    test::Errors early;
    std::int64_t nan_rows = 0, first_nan = -1;
    for (std::int64_t i = 0; i < S; ++i)
      for (std::int64_t x = 0; x < H * D; ++x) {
        const double g = static_cast<double>(got[i * H * D + x]);
        if (std::isnan(g)) {
          if (first_nan < 0) first_nan = i;
          if (x == 0) ++nan_rows;
        } else if (i < 100) {
          early.add_out(g, want[i * H * D + x]);
        }
      }
    CHECK(first_nan == 100);
    CHECK(nan_rows == S - 100);
    CHECK(early.rel() <= test::tolerance<T>);
  }
}

TEST_CASE_TEMPLATE("flash kernel: rows that see no key give O = 0 and LSE = -inf, never NaN", T, float, double) {
  // Queries 0..69 at positions 0..69, keys at 50..179: rows before 50 see nothing, and the
  // first query block (rows 0..63) is partly masked and partly empty.
  KernelCase c;
  c.sq = 70;
  c.sk = 130;
  c.dim = 5;
  c.causal = true;
  c.qpos = PositionMap::run(c.sq, 0);
  c.kpos = PositionMap::run(c.sk, 50);
  const auto e = compare<T>(c);
  CHECK(!e.nan);
  CHECK(e.rel() <= test::tolerance<T>);
  CHECK(e.lse_rel() <= test::tolerance<T>);  // add_lse makes a wrong -inf an infinite error

  // Every row empty: all keys after all queries.
  c.kpos = PositionMap::run(c.sk, 1000);
  std::vector<T> q(c.sq * c.heads * c.dim, T(0.5)), k(c.sk * c.kv_heads * c.dim, T(0.25)), v = k;
  std::vector<T> out(q.size(), T(9));
  std::vector<acc_t<T>> lse(c.sq * c.heads, acc_t<T>(9));
  KernelParams p;
  p.causal = true;
  p.q_positions = c.qpos;
  p.k_positions = c.kpos;
  p.group_size = 2;
  using CV = TensorView<const T>;
  for (CpuIsa isa : test::cpu_isas()) {
    CAPTURE(cpu_isa_name(isa));
    CpuFlashKernel(CpuFlashOptions{.isa = isa})
        .forward(CV::bshd(q.data(), 1, c.sq, c.heads, c.dim), CV::bshd(k.data(), 1, c.sk, 1, c.dim),
                 CV::bshd(v.data(), 1, c.sk, 1, c.dim), TensorView<T>::bshd(out.data(), 1, c.sq, c.heads, c.dim),
                 TensorView<acc_t<T>>::lse_bhs(lse.data(), 1, c.sq, c.heads), p);
    for (T x : out) CHECK(x == T(0));
    for (auto x : lse) CHECK(x == -std::numeric_limits<acc_t<T>>::infinity());
  }
}

TEST_CASE("flash kernel: strided (SBHD) views and no LSE") {
  const std::int64_t B = 2, S = 77, K = 90, H = 3, D = 20;
  std::mt19937_64 rng(3);
  const auto q = test::random_tensor(B * S * H * D, rng), k = test::random_tensor(B * K * H * D, rng),
             v = test::random_tensor(B * K * H * D, rng);
  KernelParams p;
  p.scale = 0.2;
  p.causal = true;
  p.q_positions = PositionMap::run(S, 20);
  p.k_positions = PositionMap::run(K, 0);
  using CV = TensorView<const double>;
  std::vector<double> want(B * S * H * D), got(B * S * H * D, 12345);
  ReferenceKernel{}.forward(CV::bshd(q.data(), B, S, H, D), CV::bshd(k.data(), B, K, H, D), CV::bshd(v.data(), B, K, H, D),
                            TensorView<double>::bshd(want.data(), B, S, H, D), TensorView<double>{}, p);
  // The same numbers, stored [S, B, H, D].
  std::vector<double> qs(q.size()), ks(k.size()), vs(v.size());
  auto to_sbhd = [&](const std::vector<double>& x, std::vector<double>& y, std::int64_t s) {
    TensorOps<HostSpace>::copy(CV::bshd(x.data(), B, s, H, D), TensorView<double>::sbhd(y.data(), B, s, H, D));
  };
  to_sbhd(q, qs, S);
  to_sbhd(k, ks, K);
  to_sbhd(v, vs, K);
  CpuFlashKernel{}.forward(CV::sbhd(qs.data(), B, S, H, D), CV::sbhd(ks.data(), B, K, H, D),
                           CV::sbhd(vs.data(), B, K, H, D), TensorView<double>::sbhd(got.data(), B, S, H, D),
                           TensorView<double>{}, p);
  test::Errors e;
  const auto gv = TensorView<double>::sbhd(got.data(), B, S, H, D);
  const auto wv = TensorView<double>::bshd(want.data(), B, S, H, D);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t d = 0; d < D; ++d) e.add_out(gv(b, s, h, d), wv(b, s, h, d));
  CHECK(!e.nan);
  CHECK(e.rel() <= 1e-12);
}
