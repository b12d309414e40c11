// bf16 on the host (core/bfloat16.hpp): its conversions round once, to nearest even (every one
// of the 65,536 bit patterns round-trips, ties go to even, past the largest finite value is
// infinity, NaN stays NaN, a double is not rounded through float first), and the host engines
// run it end to end with float accumulation: CpuFlashKernel's forward and backward against the
// double reference on the same bf16 inputs, and every policy over thread ranks (odd lengths,
// causal, GQA, ring degree 3), bf16 on the wire (the bytes are the analytic count at 2 bytes).
//
// Tolerances: O is rounded to bf16 once at the end, so its normwise error is at most about one
// bf16 rounding (2^-8 = 3.9e-3; measured 2.0-2.2e-3): 5e-3. The LSE and the gradients stay
// float, accumulated in float from exact bf16 inputs (measured 1.0-1.2e-7 and 2.4-3.3e-7):
// 1e-6 and 1e-5.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "support/attention_check.hpp"
#include "support/paged_check.hpp"

using namespace seqpar;

TEST_CASE("bf16: conversions round once, to nearest even") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const bf16 x = bf16::from_bits(static_cast<std::uint16_t>(b));
    const float f = static_cast<float>(x);
    if (std::isnan(f)) {
      CHECK(std::isnan(static_cast<float>(bf16(f))));
      CHECK(std::isnan(static_cast<float>(bf16(static_cast<double>(x)))));
    } else {
      CHECK(bf16(f).bits == b);
      CHECK(bf16(static_cast<double>(x)).bits == b);
    }
  }
  CHECK(static_cast<float>(bf16(1.0f + 0x1p-8f)) == 1.0f);             // a tie goes to even: down
  CHECK(static_cast<float>(bf16(1.0f + 3 * 0x1p-8f)) == 1.0f + 0x1p-6f);  // and up
  CHECK(static_cast<float>(bf16(1.0f + 0x1p-8f + 0x1p-20f)) == 1.0f + 0x1p-7f);  // above the tie: up
  // Through float this double would become the tie 1 + 2^-8 and go down: rounded once, it goes up.
  CHECK(static_cast<float>(bf16(1.0 + 0x1p-8 + 0x1p-40)) == 1.0f + 0x1p-7f);
  CHECK(static_cast<float>(bf16(-1.0 - 0x1p-8 - 0x1p-40)) == -1.0f - 0x1p-7f);
  CHECK(bf16(-1.0f).bits == 0xbf80);
  CHECK(std::isinf(static_cast<float>(bf16(3.4e38f))));   // past the largest finite bf16 (3.3895e38)
  CHECK(std::isinf(static_cast<float>(bf16(1e300))));     // a double past float's range too
  CHECK(static_cast<float>(bf16(3.39e38f)) == static_cast<float>(bf16::from_bits(0x7f7f)));
  CHECK(static_cast<float>(bf16(1e-45f)) == 0.0f);         // below half the smallest subnormal
  CHECK(static_cast<float>(bf16(1e-300)) == 0.0f);
  CHECK(std::signbit(static_cast<float>(bf16(-1e-300))));
  CHECK(std::isnan(static_cast<float>(bf16(std::numeric_limits<double>::quiet_NaN()))));
  CHECK(dtype_v<bf16> == DType::bf16);
  static_assert(std::is_same_v<acc_t<bf16>, float> && sizeof(bf16) == 2);
}

namespace {

/// The inputs of one kernel call, as bf16 and exactly as double.
struct KernelInputs {
  std::int64_t S, H, K, D;
  std::vector<bf16> q, k, v, dout;
  std::vector<double> qd, kd, vd, doutd;
  KernelInputs(std::int64_t s, std::int64_t h, std::int64_t kh, std::int64_t d) : S(s), H(h), K(kh), D(d) {
    std::mt19937_64 rng(5);
    std::normal_distribution<double> n(0, 1);
    auto fill = [&](std::vector<bf16>& x, std::vector<double>& xd, std::int64_t count) {
      for (std::int64_t i = 0; i < count; ++i) {
        x.push_back(bf16(n(rng)));
        xd.push_back(static_cast<double>(x.back()));
      }
    };
    fill(q, qd, S * H * D);
    fill(k, kd, S * K * D);
    fill(v, vd, S * K * D);
    fill(dout, doutd, S * H * D);
  }
  template <class T>
  TensorView<const T> view(const std::vector<T>& x, std::int64_t heads) const {
    return TensorView<const T>::bshd(x.data(), 1, S, heads, D);
  }
};

/// Normwise error of `got` against `want`: max |got - want| / max |want|.
template <class G>
double rel_error(const std::vector<G>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]);
    num = std::isnan(g) ? std::numeric_limits<double>::infinity() : std::max(num, std::abs(g - want[i]));
    den = std::max(den, std::abs(want[i]));
  }
  return num / den;
}

}  // namespace

TEST_CASE("bf16: CpuFlashKernel's forward and backward accumulate in float, against the double reference") {
  const KernelInputs in(333, 4, 2, 64);  // causal, GQA 4/2, an odd length
  KernelParams p;
  p.scale = 0.125;
  p.causal = true;
  p.group_size = 2;
  p.q_positions = PositionMap::run(in.S, 0);
  p.k_positions = PositionMap::run(in.S, 0);
  const auto n = static_cast<std::size_t>(in.S * in.H * in.D), l = static_cast<std::size_t>(in.S * in.H);
  std::vector<double> want_o(n), want_l(l);
  ReferenceKernel{}.forward(in.view(in.qd, in.H), in.view(in.kd, in.K), in.view(in.vd, in.K),
                            TensorView<double>::bshd(want_o.data(), 1, in.S, in.H, in.D),
                            TensorView<double>::bshd(want_l.data(), 1, in.S, in.H, 1), p);
  // The automatic level, with both thread counts; the AVX512-BF16 products where the CPU has
  // them (automatic takes them only where they are faster, see bf16_dot_pays).
  std::vector<CpuFlashOptions> runs{{.threads = 1}, {.threads = 2}};
  if (cpu_isa_supported(CpuIsa::avx512_bf16)) runs.push_back({.threads = 2, .isa = CpuIsa::avx512_bf16});
  for (const CpuFlashOptions& options : runs) {
    CAPTURE(options.threads);
    CAPTURE(cpu_isa_name(options.isa));
    CpuFlashKernel kernel(options);
    std::vector<bf16> out(n);
    std::vector<float> lse(l);
    kernel.forward(in.view(in.q, in.H), in.view(in.k, in.K), in.view(in.v, in.K),
                   TensorView<bf16>::bshd(out.data(), 1, in.S, in.H, in.D),
                   TensorView<float>::bshd(lse.data(), 1, in.S, in.H, 1), p);
    CHECK(rel_error(out, want_o) < 5e-3);
    CHECK(rel_error(lse, want_l) < 1e-6);

    // Backward from this output (as bf16, what a training engine keeps), both kernels alike.
    std::vector<double> outd(out.size());
    for (std::size_t i = 0; i < out.size(); ++i) outd[i] = static_cast<double>(out[i]);
    const auto kv = static_cast<std::size_t>(in.S * in.K * in.D);
    std::vector<double> wq(n), wk(kv), wv(kv);
    std::vector<float> gq(n), gk(kv), gv(kv);
    std::vector<double> lsed(lse.begin(), lse.end());
    ReferenceKernel{}.backward(in.view(in.doutd, in.H), in.view(in.qd, in.H), in.view(in.kd, in.K),
                               in.view(in.vd, in.K), in.view(outd, in.H),
                               TensorView<const double>::bshd(lsed.data(), 1, in.S, in.H, 1),
                               TensorView<double>::bshd(wq.data(), 1, in.S, in.H, in.D),
                               TensorView<double>::bshd(wk.data(), 1, in.S, in.K, in.D),
                               TensorView<double>::bshd(wv.data(), 1, in.S, in.K, in.D), p);
    kernel.backward(in.view(in.dout, in.H), in.view(in.q, in.H), in.view(in.k, in.K), in.view(in.v, in.K),
                    in.view(out, in.H), TensorView<const float>::bshd(lse.data(), 1, in.S, in.H, 1),
                    TensorView<float>::bshd(gq.data(), 1, in.S, in.H, in.D),
                    TensorView<float>::bshd(gk.data(), 1, in.S, in.K, in.D),
                    TensorView<float>::bshd(gv.data(), 1, in.S, in.K, in.D), p);
    CHECK(rel_error(gq, wq) < 1e-5);
    CHECK(rel_error(gk, wk) < 1e-5);
    CHECK(rel_error(gv, wv) < 1e-5);
  }
}

namespace {

/// `Policy` over thread ranks holding `lengths` tokens each, in bf16 with CpuFlashKernel: O to
/// 5e-3, the LSE to 1e-6, and every rank's bytes the analytic count with 2-byte elements.
template <class Policy>
void check_policy_bf16(Policy policy, const test::GlobalShape& c, test::MeshShape mesh,
                       const std::vector<std::int64_t>& lengths) {
  const auto g = test::make_global_as<bf16>(c);
  test::RunOptions opt;
  opt.lengths_q = opt.lengths_kv = lengths;
  const int ranks = static_cast<int>(lengths.size());
  const auto r = test::run_policy<bf16>(ranks, policy, g, opt);
  CHECK(!r.err.nan);
  CHECK(r.err.rel() < 5e-3);
  CHECK(r.err.lse_rel() < 1e-6);
  const auto want = test::analytic_forward_bytes(c, mesh, lengths, lengths, sizeof(bf16), sizeof(float), true);
  for (int w = 0; w < ranks; ++w) CHECK(r.bytes_sent[w] == want[w]);
}

}  // namespace

TEST_CASE("bf16: every policy runs bf16 end to end over thread ranks, bf16 on the wire") {
  const test::GlobalShape c = test::make_case(301, 6, 2, 32, true, 11);  // odd length, causal, GQA
  check_policy_bf16(AnythingPolicy<RingPolicy<Zigzag>>{}, c, {1, 3}, {150, 0, 151});  // ring degree 3, a rank with none
  check_policy_bf16(AnythingPolicy<UlyssesPolicy>{}, c, {3, 1}, {100, 101, 100});
  check_policy_bf16(AnythingPolicy<UnifiedPolicy<Zigzag>>{{2, 2}}, c, {2, 2}, {80, 75, 0, 146});
}

namespace {

/// A forward of bf16 Q [S_q, H, D], K [S_k, KH, D], V [S_k, KH, D_v] with `p`, on `kernel`,
/// against the double reference on the same inputs: {normwise error of O, of the LSE}. The keys
/// `nan_keys` hold NaN in V: the rows that see one must come out NaN, as the reference's do, and
/// every other row exact.
std::pair<double, double> bf16_case(CpuFlashKernel& kernel, std::int64_t sq, std::int64_t sk, std::int64_t h,
                                   std::int64_t kh, std::int64_t d, std::int64_t dv, const KernelParams& p,
                                   const std::vector<std::int64_t>& nan_keys, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0, 1.5);
  auto draw = [&](std::int64_t count, std::vector<bf16>& x, std::vector<double>& xd) {
    for (std::int64_t i = 0; i < count; ++i) {
      x.push_back(bf16(n(rng)));
      xd.push_back(static_cast<double>(x.back()));
    }
  };
  std::vector<bf16> q, k, v;
  std::vector<double> qd, kd, vd;
  draw(sq * h * d, q, qd);
  draw(sk * kh * d, k, kd);
  draw(sk * kh * dv, v, vd);
  for (std::int64_t j : nan_keys)
    for (std::int64_t i = 0; i < kh * dv; ++i) {
      v[j * kh * dv + i] = bf16(std::numeric_limits<float>::quiet_NaN());
      vd[j * kh * dv + i] = std::numeric_limits<double>::quiet_NaN();
    }
  std::vector<double> want_o(sq * h * dv), want_l(sq * h);
  ReferenceKernel{}.forward(TensorView<const double>::bshd(qd.data(), 1, sq, h, d),
                            TensorView<const double>::bshd(kd.data(), 1, sk, kh, d),
                            TensorView<const double>::bshd(vd.data(), 1, sk, kh, dv),
                            TensorView<double>::bshd(want_o.data(), 1, sq, h, dv),
                            TensorView<double>::bshd(want_l.data(), 1, sq, h, 1), p);
  std::vector<float> out(want_o.size()), lse(want_l.size());
  kernel.forward(TensorView<const bf16>::bshd(q.data(), 1, sq, h, d), TensorView<const bf16>::bshd(k.data(), 1, sk, kh, d),
                 TensorView<const bf16>::bshd(v.data(), 1, sk, kh, dv), TensorView<float>::bshd(out.data(), 1, sq, h, dv),
                 TensorView<float>::bshd(lse.data(), 1, sq, h, 1), p);
  double lse_err = 0;  // rows that see nothing: -inf on both sides
  for (std::size_t i = 0; i < lse.size(); ++i)
    if (!(std::isinf(want_l[i]) && lse[i] == static_cast<float>(want_l[i])))
      lse_err = std::max(lse_err, std::abs(lse[i] - want_l[i]) / std::max(1.0, std::abs(want_l[i])));
  double num = 0, den = 0;  // rel_error, where a NaN wanted must be NaN
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (std::isnan(want_o[i])) {
      if (!std::isnan(out[i])) num = std::numeric_limits<double>::infinity();
      continue;
    }
    num = std::isnan(out[i]) ? std::numeric_limits<double>::infinity() : std::max(num, std::abs(out[i] - want_o[i]));
    den = std::max(den, std::abs(want_o[i]));
  }
  return {num / den, lse_err};
}

}  // namespace

// The AVX512-BF16 and AMX paths form both products from pairs of bf16 (head dims for S = K
// Q^T, keys for O = P V, with P rounded to bf16): odd head dims end in a zero pair, a value dim
// that is not whole register tiles has a tail tile (AMX takes whole tiles only: other dims run
// the converting path), a panel whose keys start at an odd key leads with a zero weight, and a
// key block whose V holds NaN (seen by some rows of a panel only) takes the float path.
// O (float here) carries P's rounding: about bf16's half ulp over the square root of the keys
// averaged (measured 1.1-1.5e-3 on random inputs): 4e-3; the LSE stays float: 1e-6.
TEST_CASE("bf16: the AVX512-BF16 and AMX products against the double reference, on every shape they pack") {
  std::vector<CpuIsa> levels;
  for (CpuIsa isa : {CpuIsa::avx512_bf16, CpuIsa::amx_bf16})
    if (cpu_isa_supported(isa)) levels.push_back(isa);
  if (levels.empty()) MESSAGE("this CPU has no AVX512-BF16: the bf16 product paths are not tested here");
  // Self-attention over n tokens with scale `scale` and a window [left, right] (-1: none).
  auto self_params = [](std::int64_t n, double scale, std::int64_t left, std::int64_t right) {
    KernelParams p;
    p.scale = scale;
    p.mask.window_left = left;
    p.mask.window_right = right;
    p.q_positions = PositionMap::run(n, 0);
    p.k_positions = PositionMap::run(n, 0);
    return p;
  };
  for (CpuIsa isa : levels) {
    CAPTURE(cpu_isa_name(isa));
    CpuFlashKernel kernel(CpuFlashOptions{.isa = isa});
    SUBCASE("odd head dim, a value dim of 5 tiles and a tail, GQA, an odd window, soft-cap, a NaN in V") {
      KernelParams p = self_params(300, 0.12, 37, 5);
      p.softcap = 20;
      p.group_size = 2;
      // Key 100's V is NaN: rows 95-137 see it; rows 64-94 share a panel with row 95 and do not.
      const auto [o, l] = bf16_case(kernel, 300, 300, 4, 2, 67, 43, p, {100}, 21);
      CHECK(o < 4e-3);
      CHECK(l < 1e-6);
    }
    SUBCASE("causal, packed documents (a panel starting at an odd key), padded keys holding NaN") {
      // Rows 32-63 all lie in the document from key 21: their panel's keys start at an odd key.
      const std::int64_t starts[] = {0, 21, 150, 261};
      const std::int64_t valid[] = {250};
      KernelParams p = self_params(261, 0.125, -1, -1);
      p.causal = true;
      p.mask.doc_starts = starts;
      p.mask.doc_count = 3;
      p.mask.kv_valid = valid;
      const auto [o, l] = bf16_case(kernel, 261, 261, 2, 2, 64, 64, p, {250, 255, 260}, 22);
      CHECK(o < 4e-3);
      CHECK(l < 1e-6);
    }
    SUBCASE("bottom-right causal, 1000 keys for 200 queries") {
      KernelParams p = self_params(200, 0.09, -1, -1);
      p.causal = true;
      p.group_size = 3;
      p.q_positions = PositionMap::run(200, 800);
      p.k_positions = PositionMap::run(1000, 0);
      const auto [o, l] = bf16_case(kernel, 200, 1000, 3, 1, 128, 128, p, {}, 23);
      CHECK(o < 4e-3);
      CHECK(l < 1e-6);
    }
    SUBCASE("whole tiles (D 64, D_v 48: a last block of 16 dims), a window, a NaN in V") {
      // Key 100's V is NaN: rows 100-120 see it, rows 96-99 and 121-127 of their panel do not.
      const auto [o, l] = bf16_case(kernel, 257, 257, 2, 2, 64, 48, self_params(257, 0.125, 20, 0), {100}, 24);
      CHECK(o < 4e-3);
      CHECK(l < 1e-6);
    }
  }
}

// Up to 16 query rows take the decode path: the bf16 cache is read at its own width, widened
// block by block, and everything after is the float decode path (exact products of bf16
// values accumulated in float), so the float tolerances hold. Two threads split the keys
// into chunks whose partials merge.
TEST_CASE("bf16: decode steps over a bf16 cache, against the double reference") {
  for (int threads : {1, 2}) {
    CAPTURE(threads);
    CpuFlashKernel kernel(threads);
    for (std::int64_t rows : {1, 5, 16}) {
      CAPTURE(rows);
      const std::int64_t valid[] = {1500};
      KernelParams p;
      p.scale = 0.088;
      p.causal = true;
      p.group_size = 4;
      p.mask.kv_valid = valid;
      p.q_positions = PositionMap::run(rows, 1537 - rows);  // the newest tokens, bottom-right
      p.k_positions = PositionMap::run(1537, 0);
      const auto [o, l] = bf16_case(kernel, rows, 1537, 8, 2, 128, 128, p, {1500, 1536}, 31);  // padded slots hold NaN
      CHECK(o < 1e-5);
      CHECK(l < 1e-6);
    }
  }
}

namespace {

/// Runs a paged step in bf16 on the host: the engine's pool and queries as bf16 (the schedule's
/// values are bf16 already), the output bf16, widened back for the check.
struct Bf16HostStep {
  template <class Dec>
  std::int64_t operator()(Dec& dec, PagedDecodePlan& plan, const DecodeBatch& batch, const std::vector<float>& q,
                          const test::RankPool& pool, std::vector<float>& out, std::span<std::byte> ws) const {
    auto narrow = [](const std::vector<float>& x) {
      std::vector<bf16> y(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) y[i] = bf16(x[i]);
      return y;
    };
    const std::vector<bf16> kb = narrow(pool.k), vb = narrow(pool.v), qb = narrow(q);
    std::vector<bf16> ob(out.size());
    using CV = TensorView<const bf16>;
    const std::int64_t rows = static_cast<std::int64_t>(q.size()) / (plan.q_heads().count * pool.D);
    const CV k = CV::bshd(kb.data(), pool.pages, pool.page_size, pool.K, pool.D);
    CV v = pool.v_in_k ? k : CV::bshd(vb.data(), pool.pages, pool.page_size, pool.K, pool.Dv);
    v.extent[3] = pool.Dv;  // MLA: the first D_v columns of K's rows
    const std::int64_t n = dec.template step<bf16>(plan, batch, CV::bshd(qb.data(), 1, rows, plan.q_heads().count, pool.D),
                                                   k, v, TensorView<bf16>::bshd(ob.data(), 1, rows, plan.out_heads().count, pool.Dv),
                                                   ws);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(ob[i]);
    return n;
  }
};

}  // namespace

// A serving engine's bf16 pool: PagedDecode over thread ranks with CpuFlashKernel reading the
// bf16 pages in place, continuous batching, pages reused after free holding NaN. The truth is
// attention over the bf16 values in double; O comes out in bf16 (one rounding): 5e-3.
TEST_CASE("bf16: paged decode over an engine's bf16 pool on thread ranks, continuously batched") {
  const test::DecodeFeatures mla{.head_dim = 12, .head_dim_v = 8, .softcap = 2.0, .v_in_k = true};
  const std::vector<test::PagedCase> cases = {
      {.ranks = 3, .interleave = 1, .page_size = 4, .heads = 4, .kv_heads = 2, .steps = 5},
      {.ranks = 2, .interleave = 0, .page_size = 4, .heads = 4, .kv_heads = 2, .steps = 4, .features = mla,
       .max_prompt = 40},
  };
  for (const test::PagedCase& c : cases) {
    CAPTURE(c.ranks);
    test::Schedule sch(c);
    auto round = [](std::vector<float>& xs) {
      for (float& x : xs) x = static_cast<float>(bf16(x));
    };
    for (test::Request& r : sch.requests) {
      round(r.k);
      round(r.v);
    }
    for (test::ScheduledStep& st : sch.steps) round(st.q);
    std::vector<double> err(static_cast<std::size_t>(c.ranks), 0.0);
    run_ranks(c.ranks, [&](ThreadCommunicator& world) {
      err[static_cast<std::size_t>(world.rank())] =
          test::paged_rank_error<CpuFlashKernel>(world, c, sch, Bf16HostStep{}, DType::bf16);
    });
    CHECK(*std::max_element(err.begin(), err.end()) < 5e-3);
  }
}
