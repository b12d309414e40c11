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
  for (int threads : {1, 2}) {
    CAPTURE(threads);
    CpuFlashKernel kernel(CpuFlashOptions{.threads = threads});
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
