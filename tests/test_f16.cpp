// fp16 on the host (core/float16.hpp): its conversions round once, to nearest even (every one
// of the 65,536 bit patterns round-trips, ties go to even among normals and subnormals, from
// 65520 on is infinity, NaN stays NaN, a double is not rounded through float first), and the
// host engines run it end to end with float accumulation, as bf16: CpuFlashKernel's forward,
// backward and decode path against the double reference on the same fp16 inputs, and a policy
// over thread ranks with fp16 on the wire.
//
// Tolerances: O is rounded to fp16 once (2^-11 = 4.9e-4 at most): 1e-3; the LSE and the
// gradients stay float, accumulated in float: 1e-6 and 1e-5; a decode step's float output 1e-5.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "support/attention_check.hpp"
#include "support/narrow_check.hpp"

using namespace seqpar;

TEST_CASE("f16: conversions round once, to nearest even, subnormals included") {
  test::check_round_trips<f16>();
  CHECK(static_cast<float>(f16::from_bits(0x3c00)) == 1.0f);
  CHECK(static_cast<float>(f16::from_bits(0x0001)) == 0x1p-24f);  // the smallest subnormal
  CHECK(static_cast<float>(f16::from_bits(0x7bff)) == 65504.0f);  // the largest finite
  CHECK(static_cast<float>(f16(1.0f + 0x1p-11f)) == 1.0f);                  // a tie goes to even: down
  CHECK(static_cast<float>(f16(1.0f + 3 * 0x1p-11f)) == 1.0f + 0x1p-9f);    // and up
  CHECK(static_cast<float>(f16(0x1p-25f)) == 0.0f);                         // half the smallest subnormal: to even, 0
  CHECK(static_cast<float>(f16(3 * 0x1p-25f)) == 0x1p-23f);                 // 1.5 subnormal steps: to 2
  CHECK(static_cast<float>(f16(0x1p-14f - 0x1p-26f)) == 0x1p-14f);          // rounds up into the normals
  CHECK(static_cast<float>(f16(65519.0f)) == 65504.0f);
  CHECK(std::isinf(static_cast<float>(f16(65520.0f))));
  CHECK(std::isinf(static_cast<float>(f16(1e300))));
  // Through float this double would become the tie 1 + 2^-11 and go down: rounded once, it goes up.
  CHECK(static_cast<float>(f16(1.0 + 0x1p-11 + 0x1p-40)) == 1.0f + 0x1p-10f);
  CHECK(std::signbit(static_cast<float>(f16(-0.0f))));
  CHECK(std::signbit(static_cast<float>(f16(-1e-30))));
  CHECK(std::isnan(static_cast<float>(f16(std::numeric_limits<double>::quiet_NaN()))));
  CHECK(dtype_v<f16> == DType::f16);
  static_assert(std::is_same_v<acc_t<f16>, float> && sizeof(f16) == 2);
}

TEST_CASE("f16: CpuFlashKernel's forward and backward accumulate in float, against the double reference") {
  test::check_kernel_narrow<f16>(1e-3);
}

TEST_CASE("f16: a policy runs fp16 end to end over thread ranks, fp16 on the wire") {
  const test::GlobalShape c = test::make_case(301, 6, 2, 32, true, 12);  // odd length, causal, GQA
  test::check_policy_narrow<f16>(1e-3, AnythingPolicy<RingPolicy<Zigzag>>{}, c, {1, 3}, {150, 0, 151});
}

TEST_CASE("f16: decode steps over an fp16 cache, against the double reference") {
  CpuFlashKernel kernel(2);
  const std::int64_t valid[] = {900};
  KernelParams p;
  p.scale = 0.088;
  p.causal = true;
  p.group_size = 4;
  p.mask.kv_valid = valid;
  p.q_positions = PositionMap::run(5, 1019);  // the newest tokens, bottom-right
  p.k_positions = PositionMap::run(1024, 0);
  const auto [o, l] = test::narrow_case<f16>(kernel, 5, 1024, 8, 2, 64, 64, p, {900, 1023}, 41);  // padded slots hold NaN
  CHECK(o < 1e-5);
  CHECK(l < 1e-6);
}
