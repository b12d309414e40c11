#pragma once
// A host bfloat16 for tests: 16 bits, float's exponent, 8 bits of mantissa, round to nearest
// even. Registered as DType::bf16 with acc_t = float, so a kernel written for it that outputs
// only T genuinely cannot write the ring's float partials: the case the engine must convert.
#include <bit>
#include <cstdint>
#include <type_traits>

#include "seqpar/core/types.hpp"

namespace test {

/// bfloat16 stored on the host; converts to and from float.
struct bf16 {
  std::uint16_t bits = 0;
  bf16() = default;
  bf16(float f) {  // NOLINT: implicit, like the CUDA types
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu))
      bits = static_cast<std::uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
    else
      bits = static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  bf16(double d) : bf16(static_cast<float>(d)) {}  // NOLINT
  operator float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }  // NOLINT
};

}  // namespace test

template <>
struct seqpar::dtype_of<test::bf16> : std::integral_constant<seqpar::DType, seqpar::DType::bf16> {};
