#pragma once
// A host bfloat16 for tests: 16 bits, float's exponent, 8 bits of mantissa, round to nearest
// even. Registered as DType::bf16 with acc_t = float, so a kernel written for it that outputs
// only T genuinely cannot write the ring's float partials: the case the engine must convert.
#include <cstdint>
#include <type_traits>

#include "seqpar/core/bfloat16.hpp"
#include "seqpar/core/types.hpp"

namespace test {

/// bfloat16 stored on the host; converts to and from float implicitly (seqpar::bf16's
/// rounding, without its explicit conversions).
struct bf16 {
  std::uint16_t bits = 0;
  bf16() = default;
  bf16(float f) : bits(seqpar::bf16::round(f)) {}  // NOLINT: implicit, like the CUDA types
  bf16(double d) : bf16(static_cast<float>(d)) {}  // NOLINT
  operator float() const { return static_cast<float>(seqpar::bf16::from_bits(bits)); }  // NOLINT
};

}  // namespace test

template <>
struct seqpar::dtype_of<test::bf16> : std::integral_constant<seqpar::DType, seqpar::DType::bf16> {};
