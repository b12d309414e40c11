// bf16 on the host (core/bfloat16.hpp): its conversions round once, to nearest even (every one
// of the 65,536 bit patterns round-trips, ties go to even, past the largest finite value is
// infinity, NaN stays NaN, a double is not rounded through float first), and the host engines
// run it end to end with float accumulation: CpuFlashKernel's forward and backward against the
// double reference on the same bf16 inputs, and every policy over thread ranks (odd lengths,
// causal, GQA, ring degree 3), bf16 on the wire (the bytes are the analytic count at 2 bytes).
// This program compiles the kernels once per instruction-set level, so the vector conversions
// of both 2-byte types (bf16 and fp16) are checked here too, level by level.
//
// Tolerances: O is rounded to bf16 once at the end, so its normwise error is at most about one
// bf16 rounding (2^-8 = 3.9e-3; measured 2.0-2.2e-3): 5e-3. The LSE and the gradients stay
// float, accumulated in float from exact bf16 inputs (measured 1.0-1.2e-7 and 2.4-3.3e-7):
// 1e-6 and 1e-5.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "support/attention_check.hpp"
#include "support/narrow_check.hpp"
#include "seqpar/kernel/cpu/isa_kernels.hpp"
#include "support/paged_check.hpp"

using namespace seqpar;

TEST_CASE("bf16: conversions round once, to nearest even") {
  test::check_round_trips<bf16>();
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


TEST_CASE("bf16: CpuFlashKernel's forward and backward accumulate in float, against the double reference") {
  test::check_kernel_narrow<bf16>(5e-3);
}


TEST_CASE("bf16: every policy runs bf16 end to end over thread ranks, bf16 on the wire") {
  const test::GlobalShape c = test::make_case(301, 6, 2, 32, true, 11);  // odd length, causal, GQA
  test::check_policy_narrow<bf16>(5e-3, AnythingPolicy<RingPolicy<Zigzag>>{}, c, {1, 3}, {150, 0, 151});  // ring degree 3, a rank with none
  test::check_policy_narrow<bf16>(5e-3, AnythingPolicy<UlyssesPolicy>{}, c, {3, 1}, {100, 101, 100});
  test::check_policy_narrow<bf16>(5e-3, AnythingPolicy<UnifiedPolicy<Zigzag>>{{2, 2}}, c, {2, 2}, {80, 75, 0, 146});
}


namespace {

/// The levels with bf16 products of their own this CPU runs (avx512_bf16, amx_bf16); a message
/// where there are none.
std::vector<CpuIsa> bf16_product_levels() {
  std::vector<CpuIsa> levels;
  for (CpuIsa isa : {CpuIsa::avx512_bf16, CpuIsa::amx_bf16})
    if (cpu_isa_supported(isa)) levels.push_back(isa);
  if (levels.empty()) MESSAGE("this CPU has no AVX512-BF16: the bf16 product paths are not tested here");
  return levels;
}

/// Self-attention over n tokens with scale `scale` and a window [left, right] (-1: none).
KernelParams self_params(std::int64_t n, double scale, std::int64_t left, std::int64_t right) {
  KernelParams p;
  p.scale = scale;
  p.mask.window_left = left;
  p.mask.window_right = right;
  p.q_positions = PositionMap::run(n, 0);
  p.k_positions = PositionMap::run(n, 0);
  return p;
}

/// Causal self-attention (scale 1/8) over the documents starting at `starts` (the last entry:
/// the tokens), the keys from valid[0] on padding. Both arrays must outlive the parameters.
template <std::size_t N>
KernelParams causal_documents(const std::int64_t (&starts)[N], const std::int64_t (&valid)[1]) {
  KernelParams p = self_params(starts[N - 1], 0.125, -1, -1);
  p.causal = true;
  p.mask.doc_starts = starts;
  p.mask.doc_count = N - 1;
  p.mask.kv_valid = valid;
  return p;
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
  for (CpuIsa isa : bf16_product_levels()) {
    CAPTURE(cpu_isa_name(isa));
    CpuFlashKernel kernel(CpuFlashOptions{.isa = isa});
    SUBCASE("odd head dim, a value dim of 5 tiles and a tail, GQA, an odd window, soft-cap, a NaN in V") {
      KernelParams p = self_params(300, 0.12, 37, 5);
      p.softcap = 20;
      p.group_size = 2;
      // Key 100's V is NaN: rows 95-137 see it; rows 64-94 share a panel with row 95 and do not.
      const auto [o, l] = test::narrow_case<bf16>(kernel, 300, 300, 4, 2, 67, 43, p, {100}, 21);
      CHECK(o < 4e-3);
      CHECK(l < 1e-6);
    }
    SUBCASE("causal, packed documents (a panel starting at an odd key), padded keys holding NaN") {
      // Rows 32-63 all lie in the document from key 21: their panel's keys start at an odd key.
      const std::int64_t starts[] = {0, 21, 150, 261};
      const std::int64_t valid[] = {250};
      const KernelParams p = causal_documents(starts, valid);
      const auto [o, l] = test::narrow_case<bf16>(kernel, 261, 261, 2, 2, 64, 64, p, {250, 255, 260}, 22);
      CHECK(o < 4e-3);
      CHECK(l < 1e-6);
    }
    SUBCASE("bottom-right causal, 1000 keys for 200 queries") {
      KernelParams p = self_params(200, 0.09, -1, -1);
      p.causal = true;
      p.group_size = 3;
      p.q_positions = PositionMap::run(200, 800);
      p.k_positions = PositionMap::run(1000, 0);
      const auto [o, l] = test::narrow_case<bf16>(kernel, 200, 1000, 3, 1, 128, 128, p, {}, 23);
      CHECK(o < 4e-3);
      CHECK(l < 1e-6);
    }
    SUBCASE("whole tiles (D 64, D_v 48: a last block of 16 dims), a window, a NaN in V") {
      // Key 100's V is NaN: rows 100-120 see it, rows 96-99 and 121-127 of their panel do not.
      const auto [o, l] = test::narrow_case<bf16>(kernel, 257, 257, 2, 2, 64, 48, self_params(257, 0.125, 20, 0), {100}, 24);
      CHECK(o < 4e-3);
      CHECK(l < 1e-6);
    }
  }
}

// A kernel reads a view's elements and nothing past them: here Q is head 0 of a [S, 2, 67]
// buffer whose head 1 is NaN, so element 67 of each row (where an odd head dim's last pair
// would take its upper half from) is NaN. The output must match the same Q copied out
// contiguously, bit for bit, on every level this CPU runs (the bf16 products pad that pair
// with 0, the converting paths read 67 elements).
TEST_CASE("bf16: the forward reads nothing of Q past a head view's odd head dim") {
  constexpr std::int64_t S = 100, D = 67;
  std::mt19937 rng(31);
  std::normal_distribution<float> normal;
  std::vector<bf16> q2(S * 2 * D), q1(S * D), k(S * D), v(S * D);
  for (std::int64_t i = 0; i < S; ++i)
    for (std::int64_t d = 0; d < D; ++d) {
      q1[i * D + d] = q2[(i * 2) * D + d] = bf16(normal(rng));
      q2[(i * 2 + 1) * D + d] = bf16(std::numeric_limits<float>::quiet_NaN());
    }
  for (auto* x : {&k, &v})
    for (bf16& e : *x) e = bf16(normal(rng));
  const KernelParams p = self_params(S, 0.12, -1, -1);
  const auto kv = [&](const std::vector<bf16>& x) { return TensorView<const bf16>::bshd(x.data(), 1, S, 1, D); };
  for (CpuIsa isa : {CpuIsa::amx_bf16, CpuIsa::avx512_bf16, CpuIsa::avx512, CpuIsa::avx2, CpuIsa::vec128}) {
    if (!cpu_isa_supported(isa)) continue;
    CAPTURE(cpu_isa_name(isa));
    CpuFlashKernel kernel(CpuFlashOptions{.isa = isa});
    std::vector<float> o_view(S * D), o_copy(S * D);
    kernel.forward<bf16, float>(TensorView<const bf16>::bshd(q2.data(), 1, S, 2, D).slice_heads(0, 1), kv(k), kv(v),
                                TensorView<float>::bshd(o_view.data(), 1, S, 1, D), {}, p);
    kernel.forward<bf16, float>(kv(q1), kv(k), kv(v), TensorView<float>::bshd(o_copy.data(), 1, S, 1, D), {}, p);
    bool finite = true;
    for (float x : o_view) finite = finite && std::isfinite(x);
    CHECK(finite);
    CHECK(o_view == o_copy);
  }
}

namespace {

/// One level's own conversions between float and the 2-byte types (convert_values, its vector
/// loads and stores where it has them), compiled for that level's target.
struct LevelConversions {
  CpuIsa isa;
  void (*widen_f16)(const f16*, float*, std::int64_t);
  void (*narrow_f16)(const float*, f16*, std::int64_t);
  void (*widen_bf16)(const bf16*, float*, std::int64_t);
  void (*narrow_bf16)(const float*, bf16*, std::int64_t);
};

/// The levels this test program compiled, each with its conversions.
std::vector<LevelConversions> level_conversions() {
  std::vector<LevelConversions> levels;
#define SEQPAR_TEST_LEVEL(isa, ns)                                                                  \
  levels.push_back({isa, &detail::ns::convert_values<f16, float>, &detail::ns::convert_values<float, f16>, \
                    &detail::ns::convert_values<bf16, float>, &detail::ns::convert_values<float, bf16>})
#ifdef SEQPAR_HAS_ISA_AVX512
  SEQPAR_TEST_LEVEL(CpuIsa::avx512, isa_avx512);
#endif
#ifdef SEQPAR_HAS_ISA_AVX2
  SEQPAR_TEST_LEVEL(CpuIsa::avx2, isa_avx2);
#endif
#ifdef SEQPAR_HAS_ISA_VEC128
  SEQPAR_TEST_LEVEL(CpuIsa::vec128, isa_vec128);
#endif
#undef SEQPAR_TEST_LEVEL
  return levels;
}

/// Bits of a float.
std::uint32_t float_bits(float f) { return std::bit_cast<std::uint32_t>(f); }

}  // namespace

// The kernels' packs and output rows convert whole vectors (F16C's vcvtph2ps / vcvtps2ph for
// fp16 on the AVX2 and AVX-512 levels, integer lanes elsewhere); each must give the scalar
// conversion's bits on every value: all 65,536 fp16 and bf16 patterns widened, and narrowed
// from floats around every rounding point of both types (each pattern of a float's upper half
// with lower halves at, beside and between the ties of both types' last kept bits, which covers
// ties to even, the fp16 subnormals, overflow to infinity, float subnormals, and NaN payloads).
// One exception, the hardware's: an fp16 signalling NaN widens quiet (the same NaN otherwise).
TEST_CASE("f16 and bf16: every level's vector conversions give the scalar conversions' bits") {
  std::vector<f16> halves(65536);
  std::vector<bf16> brains(65536);
  for (std::uint32_t b = 0; b < 65536; ++b) {
    halves[b] = f16::from_bits(static_cast<std::uint16_t>(b));
    brains[b] = bf16::from_bits(static_cast<std::uint16_t>(b));
  }
  std::vector<float> floats;
  for (std::uint32_t hi = 0; hi < 65536; ++hi)
    for (std::uint32_t lo : {0x0u, 0x1u, 0xfffu, 0x1000u, 0x1001u, 0x1fffu, 0x2000u, 0x3000u, 0x3001u, 0x4000u,
                             0x6000u, 0x7fffu, 0x8000u, 0x8001u, 0xc000u, 0xffffu})
      floats.push_back(std::bit_cast<float>(hi << 16 | lo));
  const auto n = static_cast<std::int64_t>(floats.size());
  for (const LevelConversions& level : level_conversions()) {
    if (!cpu_isa_supported(level.isa)) continue;
    CAPTURE(cpu_isa_name(level.isa));
    std::vector<float> wide(65536);
    level.widen_f16(halves.data(), wide.data(), 65536);
    int wrong = 0;
    for (std::uint32_t b = 0; b < 65536; ++b) {
      const std::uint32_t want = float_bits(static_cast<float>(halves[b])), got = float_bits(wide[b]);
      const bool signalling = std::isnan(wide[b]) && !(want & 0x00400000u);
      wrong += signalling ? (got | 0x00400000u) != (want | 0x00400000u) : got != want;
    }
    CHECK(wrong == 0);
    level.widen_bf16(brains.data(), wide.data(), 65536);
    wrong = 0;
    for (std::uint32_t b = 0; b < 65536; ++b) wrong += float_bits(wide[b]) != float_bits(static_cast<float>(brains[b]));
    CHECK(wrong == 0);
    std::vector<f16> narrow(floats.size());
    std::vector<bf16> narrow_b(floats.size());
    level.narrow_f16(floats.data(), narrow.data(), n);
    level.narrow_bf16(floats.data(), narrow_b.data(), n);
    int wrong_f16 = 0, wrong_bf16 = 0;
    for (std::size_t i = 0; i < floats.size(); ++i) {
      wrong_f16 += narrow[i].bits != f16(floats[i]).bits;
      wrong_bf16 += narrow_b[i].bits != bf16(floats[i]).bits;
    }
    CHECK(wrong_f16 == 0);
    CHECK(wrong_bf16 == 0);
  }
}

// An fp16 forward converts its inputs to float and its output back, so on every level it must
// give, bit for bit, the float forward of the same values with its output rounded to fp16
// (the packs' vector and tail conversions, the output rows' vector and tail stores): an odd head
// dim, a value dim of whole and part vectors, causal, and inputs spanning fp16's range
// (subnormals to 2^12).
TEST_CASE("f16: the forward on every level is the float forward of the same values, rounded once") {
  constexpr std::int64_t S = 77, D = 67, DV = 40;
  std::mt19937 rng(41);
  std::uniform_int_distribution<int> exponent(-26, 12);
  std::normal_distribution<float> normal;
  auto draw = [&](std::int64_t count, std::vector<f16>& h, std::vector<float>& f) {
    for (std::int64_t i = 0; i < count; ++i) {
      h.push_back(f16(std::ldexp(normal(rng), i % 7 == 0 ? exponent(rng) : 0)));
      f.push_back(static_cast<float>(h.back()));
    }
  };
  std::vector<f16> qh, kh, vh;
  std::vector<float> qf, kf, vf;
  draw(S * D, qh, qf);
  draw(S * D, kh, kf);
  draw(S * DV, vh, vf);
  KernelParams p = self_params(S, 0.01, -1, -1);
  p.causal = true;
  for (CpuIsa isa : {CpuIsa::avx512, CpuIsa::avx2, CpuIsa::vec128}) {
    if (!cpu_isa_supported(isa)) continue;
    CAPTURE(cpu_isa_name(isa));
    CpuFlashKernel kernel(CpuFlashOptions{.isa = isa});
    std::vector<f16> oh(S * DV);
    std::vector<float> of(S * DV), lh(S), lf(S);
    kernel.forward<f16, f16>(TensorView<const f16>::bshd(qh.data(), 1, S, 1, D), TensorView<const f16>::bshd(kh.data(), 1, S, 1, D),
                             TensorView<const f16>::bshd(vh.data(), 1, S, 1, DV), TensorView<f16>::bshd(oh.data(), 1, S, 1, DV),
                             TensorView<float>::bshd(lh.data(), 1, S, 1, 1), p);
    kernel.forward<float, float>(TensorView<const float>::bshd(qf.data(), 1, S, 1, D),
                                 TensorView<const float>::bshd(kf.data(), 1, S, 1, D),
                                 TensorView<const float>::bshd(vf.data(), 1, S, 1, DV),
                                 TensorView<float>::bshd(of.data(), 1, S, 1, DV), TensorView<float>::bshd(lf.data(), 1, S, 1, 1), p);
    int wrong = 0, finite = 0;
    for (std::int64_t i = 0; i < S * DV; ++i) {
      wrong += oh[i].bits != f16(of[i]).bits;
      finite += std::isfinite(of[i]);
    }
    CHECK(finite == S * DV);
    CHECK(wrong == 0);
    CHECK(lh == lf);
  }
}

// The AVX512-BF16 backward forms its five products from pairs of bf16 (head dims for S and
// dP, queries for dV and dK, keys for dQ), with P and dS rounded to bf16 as FlashAttention-2
// rounds them on GPUs: odd head dims end in a zero pair, an odd tile's last query pair in a
// zero row, dQ's key pairs start at an even key, keys holding NaN in K and V that no row sees
// stay out of every gradient (K's on the list of non-finite rows that dQ adds apart), one that
// rows see makes exactly the reference's gradients NaN (through their pairs too), and rows
// holding NaN that see no key add nothing. Each gradient's error is then about bf16's half ulp
// (2^-9 = 2.0e-3) times the cancellation in dS's sums (measured 1.3-3.3e-3 normwise, against
// 1e-7 for the converting path): 8e-3; head dims that AMX's tiles do not take run the
// converting path on the AMX level: 1e-5 (test::backward_rounds_to_bf16). On AMX tiles the
// tile's queries are summed in whole tile products (an odd last tile's pairs end in zeros), S
// and dP are formed from the first whole tile of rows that reaches a key panel, and dK and dV
// are kept transposed until the task ends. Two threads give the same bits as one.
TEST_CASE("bf16: the AVX512-BF16 and AMX backward against the double reference, on every shape they pack") {
  for (CpuIsa isa : bf16_product_levels()) {
    CAPTURE(cpu_isa_name(isa));
    const auto tolerance_for = [&](std::int64_t d, std::int64_t dv) {
      return test::backward_rounds_to_bf16<bf16>(isa, d, dv) ? 8e-3 : 1e-5;
    };
    SUBCASE("odd head dim, value dim 43, GQA, an odd window, soft-cap, an odd last tile") {
      KernelParams p = self_params(301, 0.12, 37, 5);
      p.softcap = 20;
      p.group_size = 2;
      const double e = test::narrow_backward_case<bf16>(isa, 301, 301, 4, 2, 67, 43, p, {}, {}, 31);
      CHECK(e < tolerance_for(67, 43));
    }
    SUBCASE("causal, packed documents, padded keys holding NaN, two key blocks") {
      const std::int64_t starts[] = {0, 21, 150, 261, 400};
      const std::int64_t valid[] = {380};
      const KernelParams p = causal_documents(starts, valid);
      const double e = test::narrow_backward_case<bf16>(isa, 400, 400, 2, 2, 64, 64, p, {380, 385, 399}, {}, 32);
      CHECK(e < tolerance_for(64, 64));
    }
    SUBCASE("bottom-right causal, 700 queries over 600 keys: rows holding NaN that see no key") {
      KernelParams p = self_params(700, 0.09, -1, -1);
      p.causal = true;
      p.group_size = 3;
      p.q_positions = PositionMap::run(700, -100);
      p.k_positions = PositionMap::run(600, 0);
      const double e = test::narrow_backward_case<bf16>(isa, 700, 600, 3, 1, 128, 128, p, {}, {0, 51, 99}, 33);
      CHECK(e < tolerance_for(128, 128));
    }
    SUBCASE("a K and V row holding NaN that some rows see: NaN exactly where the reference has it") {
      KernelParams p = self_params(301, 0.125, 20, 0);
      p.group_size = 2;
      const double e = test::narrow_backward_case<bf16>(isa, 301, 301, 2, 1, 64, 64, p, {150}, {}, 35);
      CHECK(e < tolerance_for(64, 64));
    }
    SUBCASE("D 64, value dim 48, a window, odd sizes") {
      const double e = test::narrow_backward_case<bf16>(isa, 257, 257, 2, 2, 64, 48, self_params(257, 0.125, 20, 0), {}, {}, 34);
      CHECK(e < tolerance_for(64, 48));
    }
    SUBCASE("MLA's prefill head dims (D 192, value dim 128), causal, soft-cap, a last tile of 9 rows") {
      KernelParams p = self_params(585, 0.07, -1, -1);
      p.causal = true;
      p.softcap = 30;
      const double e = test::narrow_backward_case<bf16>(isa, 585, 585, 2, 2, 192, 128, p, {}, {}, 36);
      CHECK(e < tolerance_for(192, 128));
    }
    SUBCASE("D 32, value dim 96 (a last block of 16 of each), cross attention over 1100 keys, a window") {
      KernelParams p = self_params(130, 0.2, 300, 200);
      p.q_positions = PositionMap::run(130, 500);
      p.k_positions = PositionMap::run(1100, 0);
      const double e = test::narrow_backward_case<bf16>(isa, 130, 1100, 3, 3, 32, 96, p, {}, {}, 37);
      CHECK(e < tolerance_for(32, 96));
    }
  }
}

// A query row holding NaN in Q and dO that sees keys makes NaN the gradients of the keys it
// sees and its own dQ, and nothing else: every product would carry its NaN to the keys of its
// tiles it does not see (0 x NaN), so the kernel packs such a row as zeros and adds its terms
// apart. Rows 200 (causal: sees keys 0-200, within a tile of keys past it) and 301 (sees
// keys 0-301 of a window of 40: 262-301) on every level, in float, bf16 and fp16; NaN exactly
// where the double reference has it, the rest within each level's tolerance, two threads the
// same bits as one.
TEST_CASE("flash backward: a row holding NaN reaches only the gradients of the keys it sees") {
  KernelParams causal = self_params(400, 0.125, -1, -1);
  causal.causal = true;
  causal.group_size = 2;
  KernelParams window = self_params(400, 0.125, 39, 0);
  window.softcap = 30;
  window.group_size = 2;
  for (CpuIsa isa : {CpuIsa::amx_bf16, CpuIsa::avx512_bf16, CpuIsa::avx512, CpuIsa::avx2, CpuIsa::vec128}) {
    if (!cpu_isa_supported(isa)) continue;
    CAPTURE(cpu_isa_name(isa));
    for (const KernelParams* p : {&causal, &window}) {
      CHECK(test::narrow_backward_case<float>(isa, 400, 400, 2, 1, 64, 32, *p, {}, {200, 301}, 41) < 1e-5);
      CHECK(test::narrow_backward_case<f16>(isa, 400, 400, 2, 1, 64, 32, *p, {}, {200, 301}, 42) < 1e-5);
      const double bf16_tolerance = test::backward_rounds_to_bf16<bf16>(isa, 64, 64) ? 8e-3 : 1e-5;
      CHECK(test::narrow_backward_case<bf16>(isa, 400, 400, 2, 1, 64, 64, *p, {}, {200, 301}, 43) < bf16_tolerance);
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
      const auto [o, l] = test::narrow_case<bf16>(kernel, rows, 1537, 8, 2, 128, 128, p, {1500, 1536}, 31);  // padded slots hold NaN
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
      {.ranks = 3, .interleave = 1, .page_size = 4, .heads = 4, .kv_heads = 2, .exchange = DecodeExchange::all_gather,
       .steps = 5},
      {.ranks = 2, .interleave = 0, .page_size = 4, .heads = 4, .kv_heads = 2, .exchange = DecodeExchange::heads,
       .steps = 4, .features = mla, .max_prompt = 40},
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
