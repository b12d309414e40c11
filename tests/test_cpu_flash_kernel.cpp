// CpuFlashKernel against ReferenceKernel: odd lengths (not multiples of the 64-row blocks),
// head_dim 1..256, causal masks from arbitrary increasing positions (two segments, strides),
// GQA with head offsets, float and double, output and LSE; every other mask family (windows,
// documents, key padding), forward and backward, NaN and Inf at hidden keys; and soft-capped
// scores and a value head dim other than the head dim, alone, together and on the decode path.
#include <doctest/doctest.h>

#include <cstring>
#include <iterator>
#include <random>
#include <vector>

#include "support/attention_check.hpp"
#include "support/mask_brute.hpp"

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

TEST_CASE("flash kernel (float): a row whose one visible key is its maximum has the LSE of its score alone") {
  // e^0 must be exactly 1: l = 1 then, and LSE = m + log(1) = m. An exp polynomial with a
  // constant term of 1 + 2^-23 put 1.2e-7 into every such LSE, which is most of a small one.
  // One key, head_dim 1: the score is one product, rounded once, so the LSE is its rounding
  // of the exact score (small scores, where an absolute error shows). The decode path (3
  // rows) and the tile path (40 rows), every instruction set.
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> dist(-0.1f, 0.1f);
  for (std::int64_t sq : {3, 40}) {
    std::vector<float> q(static_cast<std::size_t>(sq)), k{dist(gen)}, v{dist(gen)}, out(q.size());
    for (float& x : q) x = dist(gen);
    std::vector<float> lse(q.size());
    KernelParams p;
    p.scale = 0.5;
    p.q_positions = PositionMap::run(sq, 0);
    p.k_positions = PositionMap::run(1, 0);
    using CV = TensorView<const float>;
    for (CpuIsa isa : test::cpu_isas()) {
      CAPTURE(cpu_isa_name(isa));
      CAPTURE(sq);
      CpuFlashKernel(CpuFlashOptions{.isa = isa})
          .forward(CV::bshd(q.data(), 1, sq, 1, 1), CV::bshd(k.data(), 1, 1, 1, 1), CV::bshd(v.data(), 1, 1, 1, 1),
                   TensorView<float>::bshd(out.data(), 1, sq, 1, 1), TensorView<float>::lse_bhs(lse.data(), 1, sq, 1), p);
      for (std::size_t i = 0; i < q.size(); ++i) {
        const double score = static_cast<double>(q[i]) * k[0] * p.scale;
        CHECK(std::abs(lse[i] - score) <= 0x1p-22 * std::abs(score));
        CHECK(out[i] == v[0]);
      }
    }
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

// Masks beyond causal (core/mask.hpp): sliding windows, packed documents (shared by the batch
// or per batch element), key padding, and their combinations with causal of either alignment.
// Forward (O, LSE) and backward (dQ, dK, dV, added to random starting values) against
// ReferenceKernel on the same inputs, NaN and Inf at hidden keys included: wherever the
// reference is finite the kernel must be finite and within tolerance, and the dK, dV rows of
// keys that no query sees must come back exactly as they went in.

namespace {

/// A case with a mask. KernelParams' mask points into `docs` and `kv_valid`, held here.
struct MaskCase {
  std::int64_t batch = 1, sq = 1, sk = 1, heads = 2, kv_heads = 1, dim = 24;
  std::int64_t dim_v = 0;  ///< head dim of V, O, dO and dV (0: dim)
  double scale = 0;        ///< softmax scale (0: 1 / sqrt(dim))
  double softcap = 0;      ///< soft-cap of the scores (0: none)
  /// V is the first dim_v columns of K's rows (same data pointer, K's strides), as MLA's latent
  /// cache: NaN planted in a V row lands in its K row too.
  bool v_in_k = false;
  bool causal = false;
  PositionMap qpos, kpos;  ///< diagonals of the queries (bottom-right: shifted), positions of the keys
  std::int64_t window_left = -1, window_right = -1;
  std::vector<std::int64_t> docs;  ///< document starts then the total; per batch element when per_batch
  bool per_batch = false;
  std::vector<std::int64_t> kv_valid;  ///< valid keys per batch element (empty: no padding)
  /// Per (batch element, query diagonal 0..sq-1): keys before this index are the row's (a
  /// decode step's row_key_end; empty: not used).
  std::vector<std::int64_t> row_end;
  /// (batch element, key) whose V row is NaN, and whose K row is NaN (even entries) or +Inf.
  std::vector<std::pair<std::int64_t, std::int64_t>> nan_v, bad_k;
  int threads = 1;
  std::uint64_t seed = 1;
  bool backward = true;  ///< also check the backward

  /// D_v.
  std::int64_t value_dim() const { return dim_v > 0 ? dim_v : dim; }

  KernelParams params() const {
    KernelParams p;
    p.scale = scale != 0 ? scale : 1.0 / std::sqrt(double(dim));
    p.softcap = softcap;
    p.causal = causal;
    p.q_positions = qpos;
    p.k_positions = kpos;
    p.group_size = heads / kv_heads;
    p.mask.window_left = window_left;
    p.mask.window_right = window_right;
    if (!docs.empty()) {
      const std::int64_t rows = per_batch ? batch : 1;
      p.mask.doc_count = static_cast<std::int64_t>(docs.size()) / rows - 1;
      p.mask.doc_batch_stride = per_batch ? p.mask.doc_count + 1 : 0;
      p.mask.doc_starts = docs.data();
    }
    if (!kv_valid.empty()) p.mask.kv_valid = kv_valid.data();
    if (!row_end.empty()) {
      p.mask.row_key_end = row_end.data();
      p.mask.row_stride = sq;
    }
    return p;
  }
};

/// Document starts and the total, from the documents' lengths; for per-batch documents, one
/// list of lengths per batch element, their starts one after the other.
std::vector<std::int64_t> documents(std::initializer_list<std::initializer_list<std::int64_t>> per_element) {
  std::vector<std::int64_t> starts;
  for (const auto& lengths : per_element) {
    starts.push_back(0);
    for (std::int64_t n : lengths) starts.push_back(starts.back() + n);
  }
  return starts;
}

/// Counts one output element into `e` (the fields every version of test::Errors has).
void note(test::Errors& e, double got, double want) {
  if (std::isnan(got)) e.nan = true;
  e.max_abs = std::max(e.max_abs, std::abs(got - want));
  e.max_ref = std::max(e.max_ref, std::abs(want));
}

/// Normwise error of an added gradient over the entries where the reference is finite:
/// max |got - want| / max |want - start|; infinite when the kernel is not finite there.
template <class A>
double grad_error(const std::vector<A>& got, const std::vector<double>& want, const std::vector<double>& start) {
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(want[i])) continue;
    const double g = static_cast<double>(got[i]);
    if (!std::isfinite(g)) return std::numeric_limits<double>::infinity();
    err = std::max(err, std::abs(g - want[i]));
    norm = std::max(norm, std::abs(want[i] - start[i]));
  }
  return norm > 0 ? err / norm : err;
}

/// Per (batch element, key): true when some query row sees the key.
std::vector<char> keys_seen(const MaskCase& c, const KernelParams& p) {
  std::vector<std::int64_t> kp(static_cast<std::size_t>(c.sk));
  for (std::int64_t j = 0; j < c.sk; ++j) kp[j] = c.kpos(j);
  std::vector<char> seen(static_cast<std::size_t>(c.batch * c.sk), 0);
  for (std::int64_t b = 0; b < c.batch; ++b) {
    std::vector<int> cover(static_cast<std::size_t>(c.sk + 1), 0);  // difference array over key indices
    for (std::int64_t i = 0; i < c.sq; ++i) {
      const KeyRange r = p.keys(b, c.qpos(i));
      const auto lo = std::lower_bound(kp.begin(), kp.end(), r.lo) - kp.begin();
      const auto hi = std::upper_bound(kp.begin(), kp.end(), r.hi) - kp.begin();
      if (lo < hi) {
        ++cover[lo];
        --cover[hi];
      }
    }
    for (std::int64_t j = 0, n = 0; j < c.sk; ++j) seen[b * c.sk + j] = (n += cover[j]) > 0;
  }
  return seen;
}

/// The case's mask as AttentionProblem states it (lengths of documents, window sides, key
/// padding), for the definition in support/mask_brute.hpp. Query rows come as diagonals, so
/// the alignment is top-left.
AttentionProblem problem_of(const MaskCase& c) {
  AttentionProblem pr;
  pr.batch = c.batch;
  pr.causal = c.causal;
  pr.window = {c.window_left, c.window_right};
  pr.kv_valid = c.kv_valid;
  const std::size_t lists = c.per_batch ? static_cast<std::size_t>(c.batch) : 1, per = c.docs.size() / lists;
  for (std::size_t l = 0; !c.docs.empty() && l < lists; ++l) {
    pr.documents.emplace_back();
    for (std::size_t n = l * per + 1; n < (l + 1) * per; ++n) pr.documents.back().push_back(c.docs[n] - c.docs[n - 1]);
  }
  return pr;
}

/// (batch element, query, key) triples where the mask the kernels get (KernelParams::keys,
/// MaskView) and the definition disagree. ReferenceKernel reads the same MaskView as the
/// kernel under test, so a fault there would hide in both; this holds it to the definition.
std::int64_t mask_disagreements(const MaskCase& c, const KernelParams& p) {
  if (c.sq == 0 || c.sk == 0) return 0;
  const AttentionProblem pr = problem_of(c);
  const std::int64_t n = std::max(c.qpos.last(), c.kpos.last()) + 1;  // every position is below n
  const test::DefinitionMask def(pr, n, n);
  std::int64_t bad = 0;
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t i = 0; i < c.sq; ++i) {
      const std::int64_t d = c.qpos(i);
      const KeyRange r = p.keys(b, d);
      for (std::int64_t j = 0; j < c.sk; ++j) {
        const std::int64_t k = c.kpos(j);
        bad += (r.lo <= k && k <= r.hi) != def.visible(b, d, k);
      }
    }
  return bad;
}

/// Forward and backward of case `c` in T, every instruction set, against ReferenceKernel.
template <class T>
void check_masked(const MaskCase& c) {
  using A = acc_t<T>;
  constexpr double grad_tol = std::is_same_v<T, double> ? 1e-11 : 1e-4;  // as the threaded backward test
  std::mt19937_64 rng(c.seed);
  const std::int64_t dv = c.value_dim();
  const std::int64_t nq = c.batch * c.sq * c.heads * c.dim, nk = c.batch * c.sk * c.kv_heads * c.dim;
  const std::int64_t no = nq / c.dim * dv, nv = nk / c.dim * dv;  // O, dO; V, dV
  const auto q = test::rounded<T>(test::random_tensor(nq, rng)), dout = test::rounded<T>(test::random_tensor(no, rng));
  auto k = test::rounded<T>(test::random_tensor(nk, rng));
  auto v = test::rounded<T>(test::random_tensor(c.v_in_k ? 0 : nv, rng));
  const auto dq0 = test::rounded<A>(test::random_tensor(nq, rng)), dk0 = test::rounded<A>(test::random_tensor(nk, rng)),
             dv0 = test::rounded<A>(test::random_tensor(nv, rng));
  // Row (b, j, h) of a key tensor with `dim` values per row (V in K: K's rows).
  auto key_row = [&](std::vector<double>& x, std::int64_t dim, std::int64_t b, std::int64_t j, std::int64_t h) {
    return x.data() + ((b * c.sk + j) * c.kv_heads + h) * dim;
  };
  for (std::size_t n = 0; n < c.bad_k.size(); ++n)
    for (std::int64_t h = 0; h < c.kv_heads; ++h)
      std::fill_n(key_row(k, c.dim, c.bad_k[n].first, c.bad_k[n].second, h), c.dim,
                  n % 2 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN());
  for (const auto& [b, j] : c.nan_v)
    for (std::int64_t h = 0; h < c.kv_heads; ++h)
      std::fill_n(c.v_in_k ? key_row(k, c.dim, b, j, h) : key_row(v, dv, b, j, h), dv,
                  std::numeric_limits<double>::quiet_NaN());
  const KernelParams p = c.params();
  if (c.row_end.empty()) CHECK(mask_disagreements(c, p) == 0);  // a decode step's row ends are not in the definition

  // Views of query rows [B, Sq, H, D], key rows [B, Sk, Hkv, D] and LSE [B, Sq, H, 1] (const
  // for a pointer to const).
  auto view = [&](auto* x, std::int64_t rows, std::int64_t heads, std::int64_t dim) {
    return TensorView<std::remove_pointer_t<decltype(x)>>::bshd(x, c.batch, rows, heads, dim);
  };
  auto rows_q = [&](auto* x) { return view(x, c.sq, c.heads, c.dim); };
  auto rows_o = [&](auto* x) { return view(x, c.sq, c.heads, dv); };  // O, dO
  auto rows_k = [&](auto* x) { return view(x, c.sk, c.kv_heads, c.dim); };
  auto rows_v = [&](auto* x) { return view(x, c.sk, c.kv_heads, dv); };  // dV
  // V: its own rows, or the first dv columns of K's (`kx`).
  auto v_of = [&](const auto* x, const auto* kx) {
    auto r = c.v_in_k ? rows_k(kx) : rows_v(x);
    r.extent[3] = dv;
    return r;
  };
  auto lse_of = [&](auto* x) { return view(x, c.sq, c.heads, 1); };

  // The reference on the same values, NaN and Inf included (it never reads a hidden key).
  std::vector<double> out(no), lse(static_cast<std::size_t>(c.batch * c.sq * c.heads));
  std::vector<double> want_dq = dq0, want_dk = dk0, want_dv = dv0;
  const double *kd = k.data(), *vd = v.data(), *od = out.data(), *ld = lse.data();
  ReferenceKernel ref;
  ref.forward(rows_q(q.data()), rows_k(kd), v_of(vd, kd), rows_o(out.data()), lse_of(lse.data()), p);
  ref.backward(rows_o(dout.data()), rows_q(q.data()), rows_k(kd), v_of(vd, kd), rows_o(od), lse_of(ld),
               rows_q(want_dq.data()), rows_k(want_dk.data()), rows_v(want_dv.data()), p);
  const std::vector<char> seen = keys_seen(c, p);

  const std::vector<T> qt(q.begin(), q.end()), kt(k.begin(), k.end()), vt(v.begin(), v.end()),
      dot(dout.begin(), dout.end()), ot(out.begin(), out.end());
  const std::vector<A> lt(lse.begin(), lse.end());
  const auto qv = rows_q(qt.data()), kv = rows_k(kt.data()), vv = v_of(vt.data(), kt.data());
  for (CpuIsa isa : test::cpu_isas()) {
    CAPTURE(cpu_isa_name(isa));
    CpuFlashKernel kernel(CpuFlashOptions{.threads = c.threads, .isa = isa});
    std::vector<T> got(out.size(), T(12345));
    std::vector<A> got_lse(lse.size(), A(12345));
    kernel.forward(qv, kv, vv, rows_o(got.data()), lse_of(got_lse.data()), p);
    test::Errors e;
    std::int64_t finite_mismatch = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double g = static_cast<double>(got[i]);
      if (std::isfinite(out[i]))
        note(e, g, out[i]);
      else
        finite_mismatch += std::isfinite(g);
    }
    for (std::size_t i = 0; i < got_lse.size(); ++i) {
      if (std::isnan(lse[i]))
        finite_mismatch += !std::isnan(static_cast<double>(got_lse[i]));
      else
        e.add_lse(static_cast<double>(got_lse[i]), lse[i]);
    }
    CHECK(finite_mismatch == 0);
    CHECK(!e.nan);
    CHECK(e.rel() <= test::tolerance<T>);
    CHECK(e.lse_rel() <= test::tolerance<T>);

    if (!c.backward) continue;
    std::vector<A> dq(dq0.begin(), dq0.end()), dk(dk0.begin(), dk0.end()), dvg(dv0.begin(), dv0.end());
    kernel.backward(rows_o(dot.data()), qv, kv, vv, rows_o(ot.data()), lse_of(lt.data()), rows_q(dq.data()),
                    rows_k(dk.data()), rows_v(dvg.data()), p);
    CHECK(grad_error(dq, want_dq, dq0) <= grad_tol);
    CHECK(grad_error(dk, want_dk, dk0) <= grad_tol);
    CHECK(grad_error(dvg, want_dv, dv0) <= grad_tol);
    // Keys no query sees: nothing added, not even 0 x NaN.
    std::int64_t changed = 0;
    for (std::int64_t b = 0; b < c.batch; ++b)
      for (std::int64_t j = 0; j < c.sk; ++j) {
        if (seen[b * c.sk + j]) continue;
        const std::int64_t row = (b * c.sk + j) * c.kv_heads;
        for (std::int64_t x = row * c.dim; x < (row + c.kv_heads) * c.dim; ++x)
          changed += dk[x] != static_cast<A>(dk0[x]);
        for (std::int64_t x = row * dv; x < (row + c.kv_heads) * dv; ++x) changed += dvg[x] != static_cast<A>(dv0[x]);
      }
    CHECK(changed == 0);
  }
}

/// Case `c` without and with a causal mask, the causal run on `causal_threads` threads.
template <class T>
void check_causal_and_not(MaskCase c, int causal_threads) {
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    c.causal = causal;
    c.threads = causal ? causal_threads : 1;
    c.seed += causal;
    check_masked<T>(c);
  }
}

/// Queries at diagonals `qpos` against keys at `kpos`.
MaskCase cross_case(const PositionMap& qpos, const PositionMap& kpos, std::uint64_t seed) {
  MaskCase c;
  c.sq = qpos.size();
  c.sk = kpos.size();
  c.qpos = qpos;
  c.kpos = kpos;
  c.seed = seed;
  return c;
}

/// Self attention over contiguous positions [0, s).
MaskCase self_case(std::int64_t s, std::uint64_t seed) {
  return cross_case(PositionMap::run(s, 0), PositionMap::run(s, 0), seed);
}

/// Bottom-right alignment of `sq` queries against `sk` keys at [0, sk): the engine shifts the
/// diagonals by sk - sq.
MaskCase bottom_right_case(std::int64_t sq, std::int64_t sk, std::uint64_t seed) {
  return cross_case(PositionMap::run(sq, sk - sq), PositionMap::run(sk, 0), seed);
}

/// A decode step's ragged row ends in batch element 0 (the cache, `back` slots short of the
/// call's keys, then the step's earlier tokens): row t sees keys [0, sk - sq - back + t + 1);
/// the slots after the last row's end hold NaN V and NaN or Inf K (stale slots no row sees).
void ragged_step(MaskCase& c, std::int64_t back) {
  for (std::int64_t t = 0; t < c.sq; ++t)
    c.row_end.push_back(std::clamp<std::int64_t>(c.sk - c.sq - back + t + 1, 0, c.sk));
  for (std::int64_t j = c.row_end.back(); j < c.sk; ++j) {
    c.nan_v.push_back({0, j});
    c.bad_k.push_back({0, j});
  }
}

}  // namespace

TEST_CASE_TEMPLATE("flash kernel masks: sliding windows (both sides, causal, bottom-right, strided positions)", T,
                   float, double) {
  // Both sides, 4099 keys: 512-row query blocks whose keys start and end inside 128-key blocks.
  MaskCase both = self_case(4099, 101);
  both.window_left = 300;
  both.window_right = 77;
  both.dim = 16;
  check_masked<T>(both);
  // Causal + window, 1100 keys (256-row query blocks), GQA 4 / 2, on 3 threads.
  MaskCase cw = self_case(1100, 102);
  cw.causal = true;
  cw.window_left = 129;
  cw.heads = 4;
  cw.kv_heads = 2;
  cw.threads = 3;
  check_masked<T>(cw);
  // Bottom-right causal, S_q != S_kv, with and without a window.
  MaskCase br = bottom_right_case(333, 2100, 103);
  br.causal = true;
  check_masked<T>(br);
  br.window_left = 200;
  br.threads = 2;
  check_masked<T>(br);
  // A stripe rank's queries against another rank's keys (stride 3), window of one side,
  // 64-row query blocks; and a width-0 window (each query its own key at most).
  MaskCase st = cross_case(PositionMap::run(601, 1, 3), PositionMap::run(599, 2, 3), 104);
  st.window_right = 40;
  check_masked<T>(st);
  st.window_left = st.window_right = 0;
  st.kpos = PositionMap::run(st.sk, 1, 3);
  check_masked<T>(st);
}

TEST_CASE_TEMPLATE("flash kernel masks: packed documents, shared and per batch element", T, float, double) {
  // Shared by a batch of 2: documents shorter than a panel, than a 64-row block, and longer
  // than a 512-row block; causal and not.
  MaskCase d = self_case(2100, 201);
  d.batch = 2;
  d.docs = documents({{1, 5, 30, 700, 3, 1300, 61}});
  check_causal_and_not<T>(d, 3);
  // Per batch element (same number of documents each), 4099 tokens, causal.
  MaskCase pb = self_case(4099, 203);
  pb.batch = 2;
  pb.dim = 8;
  pb.causal = true;
  pb.per_batch = true;
  pb.docs = documents({{2000, 7, 1, 2091}, {129, 3000, 900, 70}});
  check_masked<T>(pb);
  // Documents + causal + window, zigzag-like positions: queries are chunks 1 and 6 of 8,
  // keys chunks 2 and 5 (a ring step), 2 threads.
  const std::int64_t chunk = 150;
  PositionMap qz = PositionMap::run(chunk, chunk), kz = PositionMap::run(chunk, 2 * chunk);
  qz.seg[qz.segments++] = {chunk, 6 * chunk, 1};
  kz.seg[kz.segments++] = {chunk, 5 * chunk, 1};
  MaskCase z = cross_case(qz, kz, 204);
  z.causal = true;
  z.window_left = 180;
  z.docs = documents({{100, 250, 411, 389, 50}});
  z.threads = 2;
  check_masked<T>(z);
  // Documents + causal + window over contiguous positions, 1500 tokens.
  MaskCase dw = self_case(1500, 205);
  dw.causal = true;
  dw.window_left = 100;
  dw.docs = documents({{400, 9, 1091}});
  check_masked<T>(dw);
}

TEST_CASE_TEMPLATE("flash kernel masks: key padding, a batch element with no valid key, padding with documents", T,
                   float, double) {
  MaskCase pad = self_case(601, 301);
  pad.batch = 3;
  pad.kv_valid = {600, 0, 137};
  check_causal_and_not<T>(pad, 2);
  // Cross attention with padding: 700 queries against 1100 keys, bottom-right causal.
  MaskCase x = bottom_right_case(700, 1100, 303);
  x.batch = 2;
  x.causal = true;
  x.kv_valid = {1100, 513};
  check_masked<T>(x);
  // Padding + documents + window, per batch element.
  MaskCase m = self_case(900, 304);
  m.batch = 2;
  m.per_batch = true;
  m.docs = documents({{300, 600}, {899, 1}});
  m.kv_valid = {800, 650};
  m.window_left = 90;
  m.window_right = 33;
  check_masked<T>(m);
}

TEST_CASE_TEMPLATE("flash kernel masks: NaN and Inf at hidden keys reach no row that does not see them", T, float,
                   double) {
  // A window: V of key 350 is NaN, K of keys 500 (NaN) and 100 (+Inf). Rows whose window
  // holds one of them are NaN in the reference too; every other row, and every gradient the
  // reference has finite, must match. Keys 100, 350 and 500 sit inside query panels and
  // backward tiles whose other rows do not see them.
  MaskCase w = self_case(700, 401);
  w.window_left = 40;
  w.window_right = 10;
  w.nan_v = {{0, 350}};
  w.bad_k = {{0, 500}, {0, 100}};
  check_masked<T>(w);
  w.causal = true;
  w.threads = 3;
  check_masked<T>(w);
  // Padding: every key past kv_valid holds NaN V and NaN or Inf K; no row sees them, so
  // everything is finite and their dK, dV stay as they were.
  MaskCase pad = self_case(700, 402);
  pad.batch = 2;
  pad.kv_valid = {520, 699};
  for (std::int64_t b = 0; b < pad.batch; ++b)
    for (std::int64_t j = pad.kv_valid[b]; j < pad.sk; ++j) {
      pad.nan_v.push_back({b, j});
      pad.bad_k.push_back({b, j});
    }
  check_masked<T>(pad);
  pad.causal = true;
  pad.window_left = 64;
  pad.threads = 2;
  check_masked<T>(pad);
}

TEST_CASE_TEMPLATE("flash kernel decode shapes: 1 and 16 queries, 1..40000 keys, GQA, ragged row_key_end, NaN in "
                   "hidden slots",
                   T, float, double) {
  // The decode path (<= 16 query rows): each row its own key count, as SequenceParallelDecode
  // passes them (q positions 0..T-1). Keys past every row's end hold NaN and Inf (stale cache
  // slots): nothing may change. Two threads split a group's keys into chunks merged by LSE.
  struct Shape {
    std::int64_t batch, sq, sk, heads, kv_heads;
    int threads;
  };
  const Shape shapes[] = {{1, 1, 1, 4, 1, 1},      {2, 1, 129, 8, 2, 2},   {1, 16, 40000, 4, 1, 2},
                          {1, 1, 40000, 8, 2, 1},  {2, 16, 700, 8, 2, 2},  {1, 5, 3000, 2, 2, 2},
                          {1, 16, 97, 16, 1, 1}};
  std::uint64_t seed = 600;
  for (const Shape& sh : shapes) {
    CAPTURE(sh.sq);
    CAPTURE(sh.sk);
    CAPTURE(sh.heads);
    CAPTURE(sh.threads);
    MaskCase c = cross_case(PositionMap::run(sh.sq, 0), PositionMap::run(sh.sk, 0), ++seed);
    c.batch = sh.batch;
    c.heads = sh.heads;
    c.kv_heads = sh.kv_heads;
    c.threads = sh.threads;
    c.dim = sh.sk > 10000 ? 16 : 40;
    // The backward (not the decode path) sums 40000 keys' float products: beyond the 1e-4
    // its check allows. The forward is checked at every length.
    c.backward = std::is_same_v<T, double> || sh.sk <= 10000;
    // Ragged ends: the cache (some of it) and the step's earlier tokens; the second batch
    // element sees fewer keys, its first row none when the cache is tiny.
    for (std::int64_t b = 0; b < c.batch; ++b) {
      const std::int64_t cache = b == 0 ? sh.sk - sh.sq : (sh.sk - sh.sq) / 3;
      for (std::int64_t t = 0; t < sh.sq; ++t) c.row_end.push_back(std::clamp<std::int64_t>(cache + t + 1, 0, sh.sk));
      for (std::int64_t j = c.row_end.back(); j < sh.sk && j < c.row_end.back() + 40; ++j) {
        c.nan_v.push_back({b, j});
        c.bad_k.push_back({b, j});
      }
    }
    check_masked<T>(c);
    // A NaN V and an Inf K inside the ragged part: the rows that see them are NaN (as the
    // reference), the others exact.
    if (sh.sq > 1 && sh.sk > sh.sq) {
      c.nan_v = {{0, c.row_end[sh.sq / 2] - 1}};
      c.bad_k = {{0, c.row_end[1] - 1}, {0, c.row_end[sh.sq - 1] - 1}};
      check_masked<T>(c);
    }
  }
}

TEST_CASE_TEMPLATE("flash kernel decode: dot-product scores and slabs of K/V heads, head dims off the vector width, "
                   "blocks shorter than a key block",
                   T, float, double) {
  // Heads with at most 4 rows (tokens x group heads) take dot-product scores (head dims in the
  // lanes, a scalar tail for dim % W); the others query panels. Every task takes a slab of
  // K/V heads key block by key block. Head dims 8..256, groups 1, 2, 4, 8, 1..5 tokens,
  // fewer keys than one block and several blocks, NaN and Inf at the keys no row sees.
  // {tokens, keys, heads, K/V heads, head dim, threads}
  const std::int64_t shapes[][6] = {{1, 5, 4, 1, 8, 1},     {1, 700, 8, 2, 72, 2},   {2, 300, 4, 2, 100, 1},
                                    {4, 90, 3, 3, 96, 2},   {1, 1100, 4, 1, 128, 2}, {1, 40, 16, 2, 256, 1},
                                    {2, 600, 6, 3, 40, 2},  {5, 75, 2, 2, 100, 1},   {1, 33, 12, 12, 24, 2}};
  std::uint64_t seed = 700;
  for (const auto& shape : shapes) {
    // (Named copies, not a structured binding: Clang 14 cannot capture one in INFO's lambda.)
    const std::int64_t sq = shape[0], sk = shape[1], heads = shape[2], kv_heads = shape[3], dim = shape[4],
                       threads = shape[5];
    MaskCase c = cross_case(PositionMap::run(sq, 0), PositionMap::run(sk, 0), ++seed);
    INFO("tokens ", sq, ", keys ", sk, ", heads ", heads, "/", kv_heads, ", dim ", dim, ", threads ", threads);
    c.heads = heads;
    c.kv_heads = kv_heads;
    c.threads = static_cast<int>(threads);
    c.dim = dim;
    c.backward = false;
    ragged_step(c, 3);
    check_masked<T>(c);
  }
}

// Today's models: logit soft-capping (every visible score s becomes cap tanh(s / cap) before the
// mask and the softmax; backward multiplies dS by tanh's slope) and a value head dim D_v other
// than the head dim D of Q and K (V, O, dO, dV have D_v; MLA: D 192 / D_v 128 in prefill, D 576
// / D_v 512 with V the first 512 columns of the latent cache's K rows in decode). Forward and
// backward against ReferenceKernel, every instruction set, with the masks and NaN of the cases
// above.

namespace {

/// dispatch_cpu_isa functor: the kernels' soft-cap of `n` values in place, at one level.
struct SoftcapAt {
  template <class Kernels, class A>
  static void run(A* x, std::int64_t n, A cap) {
    Kernels::softcap(x, n, cap);
  }
};

}  // namespace

TEST_CASE("flash kernel soft-cap: the vector tanh is within 2^-23 absolute of tanh, relative near 0, NaN and "
          "+-inf kept") {
  // Every 509th float in [0, 12] and its negative (tanh is 1 in float from 9.1), and the floats
  // next to 0.625, where the polynomial hands over to 1 - 2 / (e^2|x| + 1).
  std::vector<float> x;
  for (std::uint32_t bits = 0; bits <= 0x41400000u; bits += 509) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    x.push_back(f);
    x.push_back(-f);
  }
  for (float f = 0.62f; f < 0.63f; f = std::nextafter(f, 1.0f)) x.push_back(f);
  for (CpuIsa isa : test::cpu_isas()) {
    CAPTURE(cpu_isa_name(isa));
    std::vector<float> y = x;
    detail::dispatch_cpu_isa<SoftcapAt>(isa, y.data(), static_cast<std::int64_t>(y.size()), 1.0f);
    double worst_abs = 0, worst_rel = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double want = std::tanh(double(x[i])), err = std::abs(double(y[i]) - want);
      worst_abs = std::max(worst_abs, err);
      if (std::abs(x[i]) < 1.0f && want != 0) worst_rel = std::max(worst_rel, err / std::abs(want));
    }
    CHECK(worst_abs <= std::ldexp(1.0, -23));  // 1.4 x 2^-24 measured
    CHECK(worst_rel <= std::ldexp(1.0, -22));  // 1.3 x 2^-23 measured
    // Special values, and a cap of 50: cap x tanh of every one.
    const float inf = std::numeric_limits<float>::infinity();
    float special[] = {inf, -inf, std::numeric_limits<float>::quiet_NaN(), -0.0f, 1e-40f, 3e38f, -3e38f};
    detail::dispatch_cpu_isa<SoftcapAt>(isa, special, std::int64_t{7}, 50.0f);
    CHECK(special[0] == 50.0f);
    CHECK(special[1] == -50.0f);
    CHECK(std::isnan(special[2]));
    CHECK((special[3] == 0.0f && std::signbit(special[3])));
    CHECK(special[4] == doctest::Approx(50 * 1e-40).epsilon(1e-6));
    CHECK(special[5] == 50.0f);
    CHECK(special[6] == -50.0f);
    // Double lanes: the library tanh.
    const double dx[] = {-3.5, -0.1, 0.0, 1e-300, 0.7, 20.0};
    double d[std::size(dx)];
    std::copy(std::begin(dx), std::end(dx), d);
    detail::dispatch_cpu_isa<SoftcapAt>(isa, d, std::int64_t{std::size(dx)}, 1.5);
    for (std::size_t i = 0; i < std::size(dx); ++i) CHECK(d[i] == 1.5 * std::tanh(dx[i]));
  }
}

TEST_CASE_TEMPLATE("flash kernel soft-cap: caps 50 (scores past it) and 1.5, causal and not, windows, GQA, NaN "
                   "at hidden keys",
                   T, float, double) {
  // Scale 30 at head dim 24 spreads the scores to about +-50 before the cap: the cap bends
  // most of them, and the backward's slope 1 - tanh^2 is far from 1.
  MaskCase big = self_case(300, 801);
  big.scale = 30;
  big.softcap = 50;
  check_causal_and_not<T>(big, 2);
  // A small cap at the usual scale (scores a few times the cap), a window, GQA 4 / 2, and NaN
  // V and Inf K at keys only some rows see.
  MaskCase small = self_case(333, 802);
  small.scale = 2;
  small.softcap = 1.5;
  small.heads = 4;
  small.kv_heads = 2;
  small.window_left = 40;
  small.window_right = 7;
  small.nan_v = {{0, 150}};
  small.bad_k = {{0, 200}, {0, 90}};
  check_masked<T>(small);
  // Bottom-right causal, 1100 keys (256-row query blocks) on 3 threads.
  MaskCase br = bottom_right_case(140, 1100, 803);
  br.causal = true;
  br.softcap = 1.5;
  br.scale = 1;
  br.threads = 3;
  check_masked<T>(br);
}

TEST_CASE_TEMPLATE("flash kernel value dim: D 192 / D_v 128, 64 / 32, 24 / 8, 16 / 40, odd dims; masks, GQA",
                   T, float, double) {
  // {D, D_v}: MLA's prefill shape, halves, a D_v below one vector, D_v > D, odd both.
  const std::int64_t dims[][2] = {{192, 128}, {64, 32}, {24, 8}, {16, 40}, {7, 13}};
  std::uint64_t seed = 900;
  for (const auto& dims_of : dims) {
    const std::int64_t d = dims_of[0], dv = dims_of[1];
    INFO("D ", d, ", D_v ", dv);
    MaskCase c = self_case(d >= 64 ? 150 : 260, ++seed);
    c.dim = d;
    c.dim_v = dv;
    c.heads = 4;
    c.kv_heads = 2;
    check_causal_and_not<T>(c, 2);
  }
  // Documents and padding, batch 2 (D 40 / D_v 24); a bottom-right causal window (D 24 / D_v 56)
  // over 1100 keys on 2 threads.
  MaskCase docs = self_case(301, 910);
  docs.batch = 2;
  docs.dim = 40;
  docs.dim_v = 24;
  docs.causal = true;
  docs.docs = documents({{100, 1, 150, 50}});
  docs.kv_valid = {301, 222};
  check_masked<T>(docs);
  MaskCase br = bottom_right_case(200, 1100, 911);
  br.dim = 24;
  br.dim_v = 56;
  br.causal = true;
  br.window_left = 300;
  br.threads = 2;
  check_masked<T>(br);
}

TEST_CASE_TEMPLATE("flash kernel soft-cap with value dim: D 192 / D_v 128 capped at 30, documents, NaN and Inf at "
                   "hidden keys",
                   T, float, double) {
  MaskCase c = self_case(200, 950);
  c.dim = 192;
  c.dim_v = 128;
  c.scale = 0.6;
  c.softcap = 30;
  c.heads = 3;
  c.kv_heads = 1;
  c.causal = true;
  c.docs = documents({{70, 130}});
  c.nan_v = {{0, 60}};
  c.bad_k = {{0, 65}, {0, 140}};
  check_masked<T>(c);
  c.causal = false;
  c.window_left = c.window_right = 30;
  c.threads = 2;
  check_masked<T>(c);
}

TEST_CASE_TEMPLATE("flash kernel decode path with soft-cap and value dim: MLA's latent cache (D 576, V its first 512 "
                   "columns, MQA), 1..16 rows, ragged ends, NaN in hidden slots",
                   T, float, double) {
  // Dot-product scores (<= 4 rows), one query panel, several, a K/V head's rows split over
  // tasks (16 tokens x 64 and x 128 query heads), keys split into chunks on 2 threads (partials
  // of D_v + 1 values a row); V in K's rows wherever D_v <= D.
  std::uint64_t seed = 1000;
  auto step = [&](std::int64_t sq, std::int64_t sk, std::int64_t heads, std::int64_t kv_heads, std::int64_t dim,
                  std::int64_t dim_v) {
    MaskCase c = cross_case(PositionMap::run(sq, 0), PositionMap::run(sk, 0), ++seed);
    c.heads = heads;
    c.kv_heads = kv_heads;
    c.dim = dim;
    c.dim_v = dim_v;
    c.v_in_k = dim_v <= dim;
    ragged_step(c, 5);
    return c;
  };
  // Checks step `c` with cap `cap` (scores spread to about 4/3 of it), on `threads` threads.
  auto check = [](MaskCase c, double cap, int threads, bool backward) {
    INFO("tokens ", c.sq, ", keys ", c.sk, ", heads ", c.heads, "/", c.kv_heads, ", D ", c.dim, " / D_v ", c.dim_v,
         ", cap ", cap, ", threads ", threads);
    c.softcap = cap;
    c.scale = cap > 0 ? 4 * cap / std::sqrt(double(c.dim)) : 0;
    c.threads = threads;
    c.backward = backward;
    check_masked<T>(c);
  };
  check(step(1, 300, 4, 1, 576, 512), 0, 1, true);
  check(step(1, 700, 16, 1, 576, 512), 20, 1, true);
  check(step(4, 500, 16, 1, 576, 512), 0, 2, true);
  check(step(16, 200, 128, 1, 576, 512), 20, 1, false);
  check(step(2, 1100, 16, 1, 576, 512), 20, 2, false);
  check(step(16, 1100, 64, 1, 40, 24), 3, 2, false);
  check(step(3, 90, 6, 2, 24, 40), 1.5, 1, true);
  check(step(1, 2100, 8, 2, 64, 32), 10, 2, true);
}

#if defined(SEQPAR_HAS_ISA_AVX512)
TEST_CASE("flash kernel micro-kernel: the AVX-512 tile's assembly k loop gives the C++ loop's floats bit for bit") {
  // flash_tile with a_k known at compile time runs its full float tile in assembly where the
  // level has it; the same tile without (AK 0) is the C++ loop. Same products in the same
  // order, so every float must match: tiles of 2 and 3 vectors, k steps 0-9 (whole turns of
  // four and the single steps after them) and longer, A as rows (the score product's K) or as
  // packed columns (V), stored or accumulated into C times alpha; C's lanes past the tile keep
  // their values.
  if (!cpu_isa_supported(CpuIsa::avx512)) {
    MESSAGE("no AVX-512 on this CPU: the assembly tile is not run");
    return;
  }
  namespace isa = detail::isa_avx512;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  const auto fill = [&](std::vector<float>& x) {
    for (float& e : x) e = u(rng);
  };
  constexpr std::ptrdiff_t ldb = 52, ldc = 56, row_stride = 71;
  const auto same = [&](const std::vector<float>& x, const std::vector<float>& y) {
    return std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  const auto check = [&]<int NR>(std::integral_constant<int, NR>) {
    CAPTURE(NR);
    for (std::int64_t kdim : {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 63, 64, 130}) {
      CAPTURE(kdim);
      std::vector<float> a(8 * row_stride + 8 * kdim + 8), b(kdim * ldb + 48), alpha(48), c0(8 * ldc);
      fill(a);
      fill(b);
      fill(alpha);
      fill(c0);
      std::vector<float> want = c0, got = c0;
      isa::flash_tile<8, true, NR, 0>(a.data(), row_stride, 1, b.data(), ldb, kdim, want.data(), ldc, alpha.data());
      isa::flash_tile<8, true, NR, 1>(a.data(), row_stride, 1, b.data(), ldb, kdim, got.data(), ldc, alpha.data());
      CHECK_MESSAGE(same(want, got), "A as rows, accumulated");
      want = c0, got = c0;
      isa::flash_tile<8, false, NR, 0>(a.data(), 1, 8, b.data(), ldb, kdim, want.data(), ldc, alpha.data());
      isa::flash_tile<8, false, NR, 8>(a.data(), 1, 8, b.data(), ldb, kdim, got.data(), ldc, alpha.data());
      CHECK_MESSAGE(same(want, got), "A as packed columns, stored");
      bool untouched = true;
      for (int r = 0; r < 8; ++r)
        for (std::ptrdiff_t l = NR * 16; l < ldc; ++l) untouched = untouched && got[r * ldc + l] == c0[r * ldc + l];
      CHECK_MESSAGE(untouched, "lanes past the tile written");
    }
  };
  check(std::integral_constant<int, 2>{});
  check(std::integral_constant<int, 3>{});
}
#endif
