// CpuFlashKernel::backward on its thread pool: bit-identical dq, dk, dv for 1, 2, 3 and 5
// threads, and within tolerance of ReferenceKernel::backward (double), on odd lengths, causal
// and not, GQA, cross attention (Sq != Sk, shifted positions, rows that see no key), windows,
// documents and padding, soft-capped scores and a value head dim other than the head dim, and
// ranks with no keys or no queries. Gradients start from random values: backward adds to them.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <random>
#include <type_traits>
#include <vector>

#include "support/attention_check.hpp"

using namespace seqpar;

namespace {
/// Every operator new of this program, so that a test can see a call allocate.
std::atomic<long> allocations{0};
}  // namespace

void* operator new(std::size_t n) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
// GCC 12 pairs an inlined new-expression with the free() below and warns of a mismatch; both
// are this program's replacements (malloc and free), so there is none.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace {

struct Shape {
  std::int64_t b, sq, sk, h, kh, d;
  bool causal;
  PositionMap qpos, kpos;  // used when causal or masked
  MaskView mask{};         // window, documents, padding (causal is `causal`)
  std::int64_t dv = 0;     // head dim of V, O, dO, dV (0: d)
  double scale = 0;        // softmax scale (0: 1 / sqrt(d))
  double softcap = 0;      // soft-cap of the scores (0: none)

  std::int64_t value_dim() const { return dv > 0 ? dv : d; }
};

/// Gradients of one backward call, in the element type's accumulation type.
template <class A>
struct Grads {
  std::vector<A> dq, dk, dv;
};

/// Inputs rounded to T, the exact forward (out, LSE) on them, and the exact gradients added to
/// random starting values; then CpuFlashKernel::backward in T on 1, 2, 3, 5 threads (one kernel
/// object, re-threaded, so the scratch is regrown and reused). One thread takes two key blocks
/// per task; more threads take one where that leaves them fewer than 8 tasks each, so the
/// bit-for-bit checks also hold the two task sizes to the same sums.
template <class T>
void check_threads(const Shape& s, std::uint64_t seed) {
  // Under a sanitizer the float runs alone (turn counters and scratch slices are the same code
  // for both types).
  if constexpr (test::sanitized_skips<T>) return;
  using A = acc_t<T>;
  std::mt19937_64 rng(seed);
  const std::int64_t dv = s.value_dim();
  const std::int64_t nq = s.b * s.sq * s.h * s.d, nk = s.b * s.sk * s.kh * s.d;
  const std::int64_t no = s.b * s.sq * s.h * dv, nv = s.b * s.sk * s.kh * dv;
  const auto q = test::rounded<T>(test::random_tensor(nq, rng)), dout = test::rounded<T>(test::random_tensor(no, rng));
  const auto k = test::rounded<T>(test::random_tensor(nk, rng)), v = test::rounded<T>(test::random_tensor(nv, rng));
  const auto dq0 = test::rounded<A>(test::random_tensor(nq, rng)), dk0 = test::rounded<A>(test::random_tensor(nk, rng)),
             dv0 = test::rounded<A>(test::random_tensor(nv, rng));
  KernelParams p;
  p.scale = s.scale != 0 ? s.scale : 1.0 / std::sqrt(double(s.d));
  p.softcap = s.softcap;
  p.causal = s.causal;
  p.q_positions = s.qpos;
  p.k_positions = s.kpos;
  p.mask = s.mask;
  p.group_size = s.h / s.kh;

  using V = TensorView<const double>;
  using G = TensorView<double>;
  std::vector<double> out(static_cast<std::size_t>(no)), lse(static_cast<std::size_t>(s.b * s.sq * s.h));
  ReferenceKernel ref;
  ref.forward(V::bshd(q.data(), s.b, s.sq, s.h, s.d), V::bshd(k.data(), s.b, s.sk, s.kh, s.d),
              V::bshd(v.data(), s.b, s.sk, s.kh, dv), G::bshd(out.data(), s.b, s.sq, s.h, dv),
              G::bshd(lse.data(), s.b, s.sq, s.h, 1), p);
  std::vector<double> want_dq = dq0, want_dk = dk0, want_dv = dv0;
  ref.backward(V::bshd(dout.data(), s.b, s.sq, s.h, dv), V::bshd(q.data(), s.b, s.sq, s.h, s.d),
               V::bshd(k.data(), s.b, s.sk, s.kh, s.d), V::bshd(v.data(), s.b, s.sk, s.kh, dv),
               V::bshd(out.data(), s.b, s.sq, s.h, dv), V::bshd(lse.data(), s.b, s.sq, s.h, 1),
               G::bshd(want_dq.data(), s.b, s.sq, s.h, s.d), G::bshd(want_dk.data(), s.b, s.sk, s.kh, s.d),
               G::bshd(want_dv.data(), s.b, s.sk, s.kh, dv), p);

  const std::vector<T> qt(q.begin(), q.end()), kt(k.begin(), k.end()), vt(v.begin(), v.end()),
      dot(dout.begin(), dout.end()), ot(out.begin(), out.end());
  const std::vector<A> lt(lse.begin(), lse.end());
  using CV = TensorView<const T>;
  CpuFlashKernel kernel;
  auto run = [&](int threads) {
    kernel.set_threads(threads);
    Grads<A> g{{dq0.begin(), dq0.end()}, {dk0.begin(), dk0.end()}, {dv0.begin(), dv0.end()}};
    kernel.backward(CV::bshd(dot.data(), s.b, s.sq, s.h, dv), CV::bshd(qt.data(), s.b, s.sq, s.h, s.d),
                    CV::bshd(kt.data(), s.b, s.sk, s.kh, s.d), CV::bshd(vt.data(), s.b, s.sk, s.kh, dv),
                    CV::bshd(ot.data(), s.b, s.sq, s.h, dv), TensorView<const A>::bshd(lt.data(), s.b, s.sq, s.h, 1),
                    TensorView<A>::bshd(g.dq.data(), s.b, s.sq, s.h, s.d),
                    TensorView<A>::bshd(g.dk.data(), s.b, s.sk, s.kh, s.d),
                    TensorView<A>::bshd(g.dv.data(), s.b, s.sk, s.kh, dv), p);
    return g;
  };

  // Normwise error of the added gradient: max |got - want| / max |want - start|.
  auto rel = [](const std::vector<A>& got, const std::vector<double>& want, const std::vector<double>& start) {
    double err = 0, norm = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (std::isnan(static_cast<double>(got[i]))) return std::numeric_limits<double>::infinity();
      err = std::max(err, std::abs(static_cast<double>(got[i]) - want[i]));
      norm = std::max(norm, std::abs(want[i] - start[i]));
    }
    return norm > 0 ? err / norm : err;
  };
  constexpr double tol = std::is_same_v<T, double> ? 1e-11 : 1e-4;
  const Grads<A> one = run(1);
  CHECK(rel(one.dq, want_dq, dq0) <= tol);
  CHECK(rel(one.dk, want_dk, dk0) <= tol);
  CHECK(rel(one.dv, want_dv, dv0) <= tol);
  for (int threads : {2, 3, 5}) {
    CAPTURE(threads);
    const Grads<A> many = run(threads);
    CHECK(many.dq == one.dq);  // exact: the same sums in the same order
    CHECK(many.dk == one.dk);
    CHECK(many.dv == one.dv);
  }
  // The other instruction sets (the runs above used the widest): within tolerance, on 2 threads.
  for (CpuIsa isa : test::cpu_isas()) {
    if (isa == kernel.isa()) continue;
    CAPTURE(cpu_isa_name(isa));
    kernel = CpuFlashKernel(CpuFlashOptions{.isa = isa});
    const Grads<A> other = run(2);
    CHECK(rel(other.dq, want_dq, dq0) <= tol);
    CHECK(rel(other.dk, want_dk, dk0) <= tol);
    CHECK(rel(other.dv, want_dv, dv0) <= tol);
  }
}

Shape shape(std::int64_t sq, std::int64_t sk, bool causal, std::int64_t h = 6, std::int64_t kh = 2, std::int64_t d = 20) {
  return Shape{1, sq, sk, h, kh, d, causal, PositionMap::run(sq, 0), PositionMap::run(sk, 0)};
}

}  // namespace

TEST_CASE_TEMPLATE("threaded flash backward: odd lengths, causal and not, GQA 6 / 2", T, float, double) {
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    check_threads<T>(shape(333, 333, causal), 1 + causal);
    // Four 256-key blocks and a one-key tail (query blocks: 96 rows); two and the tail under a
    // sanitizer, where the double reference alone would take a minute.
    const std::int64_t n = test::sanitized_build ? 513 : 1025;
    check_threads<T>(shape(n, n, causal, 6, 2, 8), 3 + causal);
  }
}

TEST_CASE_TEMPLATE("threaded flash backward: cross attention, batch 2, shifted and two-run positions", T, float,
                   double) {
  // Sq != Sk, no mask.
  check_threads<T>(shape(333, 130, false), 11);
  // A ring step: the keys start later than the queries, so the first rows see no key
  // (LSE -inf) and whole query blocks are skipped for later key blocks.
  Shape s = shape(200, 333, true, 4, 4, 13);
  s.b = 2;
  s.qpos = PositionMap::run(s.sq, 150, 2);
  s.kpos = PositionMap::run(s.sk, 220);
  check_threads<T>(s, 12);
  // Zigzag-like queries (two runs with a gap) against contiguous keys, MQA.
  Shape z = shape(257, 190, true, 3, 1, 64);
  z.qpos = PositionMap::run(129, 0);
  z.qpos.seg[z.qpos.segments++] = {257 - 129, 700, 1};
  z.kpos = PositionMap::run(z.sk, 60, 3);
  check_threads<T>(z, 13);
}

TEST_CASE_TEMPLATE("threaded flash backward: tiny and odd tiles, head_dim 1..64, strided positions", T, float,
                   double) {
  struct Small {
    std::int64_t b, sq, sk, h, kh, d;
    bool causal;
  };
  for (const Small m : {Small{1, 1, 1, 1, 1, 1, false}, Small{2, 33, 70, 4, 2, 5, true}, Small{1, 130, 65, 3, 1, 16, true},
                        Small{1, 64, 64, 2, 2, 64, false}, Small{2, 97, 129, 6, 3, 7, true}}) {
    CAPTURE(m.sq);
    CAPTURE(m.sk);
    // Two increasing runs with gaps, like a zigzag block against a stripe block.
    Shape s{m.b, m.sq, m.sk, m.h, m.kh, m.d, m.causal, PositionMap::run(m.sq / 2, 10, 2), PositionMap::run(m.sk, 0, 5)};
    s.qpos.seg[s.qpos.segments++] = {m.sq - m.sq / 2, 400, 1};
    check_threads<T>(s, static_cast<std::uint64_t>(m.sq * 131 + m.sk));
  }
}

TEST_CASE_TEMPLATE("threaded flash backward: windows, documents and padding (key blocks skipped before a query block)",
                   T, float, double) {
  // Causal + a 300-key window: each query block skips the key blocks before its window as
  // well as those after its diagonal, so the dQ adds of a query block start at a later key
  // block (the turn passes over the skipped ones). Two key blocks and a tail under a sanitizer.
  const std::int64_t n = test::sanitized_build ? 513 : 1025;
  Shape w = shape(n, n, true, 6, 2, 8);
  w.mask.window_left = 300;
  check_threads<T>(w, 41);
  // Batch 2, bidirectional: documents shared by the batch (one shorter than a tile, one
  // longer than a key block) and per-element padding, one element with none valid.
  static const std::vector<std::int64_t> docs{0, 100, 613, 650, 777}, valid{777, 0};
  Shape d = shape(777, 777, false, 4, 4, 16);
  d.b = 2;
  d.mask.doc_starts = docs.data();
  d.mask.doc_count = 4;
  d.mask.kv_valid = valid.data();
  check_threads<T>(d, 42);
  // Batch 2 with 8 K/V heads: enough tasks that 2 and 3 threads take two key blocks per task,
  // as one thread does (5 threads take one): causal with a 300-key window, so some query
  // blocks see only the first block of a task and some only the second (under a sanitizer,
  // which looks for races, 513 tokens: tasks of two blocks and of one still).
  const std::int64_t m = test::sanitized_build ? 513 : 777;
  Shape two = shape(m, m, true, 8, 8, 4);
  two.b = 2;
  two.mask.window_left = 300;
  check_threads<T>(two, 43);
}

TEST_CASE_TEMPLATE("threaded flash backward: soft-capped scores and a value head dim, alone and together", T, float,
                   double) {
  // Cap 50 with scores spread to about +-50 (the slope 1 - tanh^2 far from 1), causal, GQA 6 / 2.
  Shape cap = shape(333, 333, true);
  cap.scale = 30;
  cap.softcap = 50;
  check_threads<T>(cap, 51);
  // MLA's prefill dims, D 192 / D_v 128, over three key blocks, the queries the last rows (two
  // query blocks under a sanitizer, where this shape was most of the program's time).
  Shape mla = shape(test::sanitized_build ? 100 : 300, 600, true, 4, 1, 192);
  mla.dv = 128;
  mla.kpos = PositionMap::run(mla.sk, 0);
  mla.qpos = PositionMap::run(mla.sq, mla.sk - mla.sq);
  check_threads<T>(mla, 52);
  Shape wide = shape(200, 257, false, 3, 3, 8);
  wide.dv = 40;
  check_threads<T>(wide, 53);
  // Both, with a window and documents: key blocks skipped before a query block.
  static const std::vector<std::int64_t> docs{0, 200, 590, 700};
  Shape both = shape(700, 700, true, 4, 2, 24);
  both.dv = 56;
  both.softcap = 1.5;
  both.scale = 1;
  both.mask.window_left = 260;
  both.mask.doc_starts = docs.data();
  both.mask.doc_count = 3;
  check_threads<T>(both, 54);
}

TEST_CASE_TEMPLATE("threaded flash backward: a rank with no keys or no queries adds nothing", T, float, double) {
  check_threads<T>(shape(333, 0, true), 21);
  check_threads<T>(shape(0, 333, false), 22);
}

TEST_CASE("threaded flash backward: a warmed-up call allocates nothing") {
  const Shape s = shape(333, 520, true);
  std::mt19937_64 rng(31);
  const auto q = test::random_tensor(s.b * s.sq * s.h * s.d, rng), k = test::random_tensor(s.b * s.sk * s.kh * s.d, rng);
  const auto lse = test::random_tensor(s.b * s.sq * s.h, rng);
  std::vector<double> dq(q.size()), dk(k.size()), dv(k.size());
  KernelParams p;
  p.causal = true;
  p.q_positions = s.qpos;
  p.k_positions = s.kpos;
  p.group_size = s.h / s.kh;
  using V = TensorView<const double>;
  using G = TensorView<double>;
  CpuFlashKernel kernel(3);
  auto call = [&] {
    kernel.backward(V::bshd(q.data(), s.b, s.sq, s.h, s.d), V::bshd(q.data(), s.b, s.sq, s.h, s.d),
                    V::bshd(k.data(), s.b, s.sk, s.kh, s.d), V::bshd(k.data(), s.b, s.sk, s.kh, s.d),
                    V::bshd(q.data(), s.b, s.sq, s.h, s.d), V::bshd(lse.data(), s.b, s.sq, s.h, 1),
                    G::bshd(dq.data(), s.b, s.sq, s.h, s.d), G::bshd(dk.data(), s.b, s.sk, s.kh, s.d),
                    G::bshd(dv.data(), s.b, s.sk, s.kh, s.d), p);
  };
  call();  // sizes the turn counters for this query shape
  const long before = allocations.load();
  call();
  const long after = allocations.load();
  CHECK(after == before);
  // Reserved for the shape first (as the engines do at plan), the very first call allocates
  // nothing either: backward's turn counters, and the decode path's partials of a short block.
  CpuFlashKernel fresh(3);
  fresh.reserve({s.b, s.sq, s.h, s.sk, s.kh, s.h / s.kh, s.d, true});
  const long reserved = allocations.load();
  kernel = std::move(fresh);
  const long moved = allocations.load();
  call();
  CHECK(allocations.load() == moved);
  CHECK(moved == reserved);
  const std::int64_t T = 4, keys = 4096;  // a decode step against a long shard: keys split over the threads
  const auto dq_short = test::random_tensor(s.b * T * s.h * s.d, rng), kv = test::random_tensor(s.b * keys * s.kh * s.d, rng);
  std::vector<double> o(dq_short.size()), l(static_cast<std::size_t>(s.b * T * s.h));
  KernelParams dp;
  dp.q_positions = PositionMap::run(T, keys - T);
  dp.k_positions = PositionMap::run(keys, 0);
  dp.group_size = s.h / s.kh;
  CpuFlashKernel decode(2);
  decode.reserve({s.b, T, s.h, keys, s.kh, s.h / s.kh, s.d, false});
  const long ready = allocations.load();
  decode.forward(V::bshd(dq_short.data(), s.b, T, s.h, s.d), V::bshd(kv.data(), s.b, keys, s.kh, s.d),
                 V::bshd(kv.data(), s.b, keys, s.kh, s.d), G::bshd(o.data(), s.b, T, s.h, s.d),
                 G::bshd(l.data(), s.b, T, s.h, 1), dp);
  CHECK(allocations.load() == ready);

  // A value dim of its own (larger than the head dim, so that sizing by the head dim would fall
  // short), reserved through KernelCallBounds::value_dim: a backward, and a decode step of MQA's
  // shape (16 tokens x 64 query heads of one K/V head: its rows split over two tasks, keys in
  // chunks whose partials hold D_v + 1 values a row).
  const std::int64_t wide_dv = 2 * s.d;
  const auto vw = test::random_tensor(s.b * s.sk * s.kh * wide_dv, rng);
  const auto dow = test::random_tensor(s.b * s.sq * s.h * wide_dv, rng);
  std::vector<double> dvw(vw.size());
  KernelCallBounds wide{s.b, s.sq, s.h, s.sk, s.kh, s.h / s.kh, s.d, true};
  wide.value_dim = wide_dv;
  CpuFlashKernel value_dim(3);
  value_dim.reserve(wide);
  const long wide_ready = allocations.load();
  value_dim.backward(V::bshd(dow.data(), s.b, s.sq, s.h, wide_dv), V::bshd(q.data(), s.b, s.sq, s.h, s.d),
                     V::bshd(k.data(), s.b, s.sk, s.kh, s.d), V::bshd(vw.data(), s.b, s.sk, s.kh, wide_dv),
                     V::bshd(dow.data(), s.b, s.sq, s.h, wide_dv), V::bshd(lse.data(), s.b, s.sq, s.h, 1),
                     G::bshd(dq.data(), s.b, s.sq, s.h, s.d), G::bshd(dk.data(), s.b, s.sk, s.kh, s.d),
                     G::bshd(dvw.data(), s.b, s.sk, s.kh, wide_dv), p);
  CHECK(allocations.load() == wide_ready);
  const std::int64_t mqa_heads = 64, tokens = 16, dk_ = 8, dv_ = 200;
  const auto qm = test::random_tensor(tokens * mqa_heads * dk_, rng), km = test::random_tensor(keys * dk_, rng),
             vm = test::random_tensor(keys * dv_, rng);
  std::vector<double> om(static_cast<std::size_t>(tokens * mqa_heads * dv_));
  std::vector<double> lm(static_cast<std::size_t>(tokens * mqa_heads));
  KernelParams mp;
  mp.q_positions = PositionMap::run(tokens, keys - tokens);
  mp.k_positions = PositionMap::run(keys, 0);
  mp.causal = true;
  mp.group_size = mqa_heads;
  KernelCallBounds mqa{1, tokens, mqa_heads, keys, 1, mqa_heads, dk_, false};
  mqa.value_dim = dv_;
  CpuFlashKernel mqa_kernel(2);
  mqa_kernel.reserve(mqa);
  const long mqa_ready = allocations.load();
  mqa_kernel.forward(V::bshd(qm.data(), 1, tokens, mqa_heads, dk_), V::bshd(km.data(), 1, keys, 1, dk_),
                     V::bshd(vm.data(), 1, keys, 1, dv_), G::bshd(om.data(), 1, tokens, mqa_heads, dv_),
                     G::bshd(lm.data(), 1, tokens, mqa_heads, 1), mp);
  CHECK(allocations.load() == mqa_ready);
}

TEST_CASE("threaded flash backward: a row that sees no key adds nothing to any gradient, NaN in its Q or dO included") {
  // Bottom-right, S_q 2 / S_kv 1: row 0 sees no key (its O = 0, LSE = -inf). NaN in that row's
  // Q and dO must not reach dK or dV through 0 x NaN.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (CpuIsa isa : test::cpu_isas())
    for (int threads : {1, 2}) {
      CAPTURE(cpu_isa_name(isa));
      CAPTURE(threads);
      const std::int64_t D = 8;
      std::vector<float> q(2 * D, 0.25f), k(D, 0.5f), v(D, -0.75f), out(2 * D), dout(2 * D, 1.0f);
      for (std::int64_t d = 0; d < D; ++d) q[d] = static_cast<float>(nan), dout[d] = static_cast<float>(nan);
      std::vector<float> lse(2);
      KernelParams p;
      p.scale = 0.5;
      p.causal = true;
      p.q_positions = PositionMap::run(2, -1);  // the diagonals: position + S_kv - S_q
      p.k_positions = PositionMap::run(1, 0);
      CpuFlashKernel kern(CpuFlashOptions{.threads = threads, .isa = isa});
      using CV = TensorView<const float>;
      kern.forward<float, float>(CV::bshd(q.data(), 1, 2, 1, D), CV::bshd(k.data(), 1, 1, 1, D), CV::bshd(v.data(), 1, 1, 1, D),
                                 TensorView<float>::bshd(out.data(), 1, 2, 1, D), TensorView<float>::bshd(lse.data(), 1, 2, 1, 1), p);
      CHECK(lse[0] == -std::numeric_limits<float>::infinity());
      CHECK(out[0] == 0.0f);
      std::vector<float> dq(2 * D, 0.f), dk(D, 0.f), dv(D, 0.f);
      kern.backward<float>(CV::bshd(dout.data(), 1, 2, 1, D), CV::bshd(q.data(), 1, 2, 1, D), CV::bshd(k.data(), 1, 1, 1, D),
                           CV::bshd(v.data(), 1, 1, 1, D), CV::bshd(out.data(), 1, 2, 1, D),
                           TensorView<const float>::bshd(lse.data(), 1, 2, 1, 1), TensorView<float>::bshd(dq.data(), 1, 2, 1, D),
                           TensorView<float>::bshd(dk.data(), 1, 1, 1, D), TensorView<float>::bshd(dv.data(), 1, 1, 1, D), p);
      // Row 1 alone sees key 0 with probability 1: dV = dO_1, dK = 0 (dS = P (dP - delta) = 0).
      for (std::int64_t d = 0; d < D; ++d) {
        CHECK(dv[d] == doctest::Approx(1.0));
        CHECK(dk[d] == doctest::Approx(0.0));
        CHECK(dq[d] == 0.0f);  // row 0's own gradient: it saw nothing
      }
    }
}

