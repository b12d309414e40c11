#pragma once
/// \file
/// fp16 on the host: IEEE-754 binary16 (sign, 5 exponent bits, 10 mantissa bits; largest
/// finite 65504, subnormals down to 2^-24), the other 2-byte type of inference engines. Host
/// engines accumulate it in float (acc_t<f16> = float), as bf16: statistics and partials stay
/// float, messages carry fp16.
///
/// Conversions are explicit, written with integer operations so that they do not depend on the
/// compiler's _Float16 or the CPU's F16C: to float is exact; from float rounds to nearest, ties
/// to even, subnormals included, keeps NaN a quiet NaN, and rounds from 65520 (halfway past the
/// largest finite value) to infinity; from double rounds once (through float rounded to odd,
/// which has more than twice fp16's precision).

#include <bit>
#include <cmath>
#include <concepts>
#include <cstdint>

#include "seqpar/core/bfloat16.hpp"
#include "seqpar/core/types.hpp"

namespace seqpar {

/// An IEEE binary16 value in host memory (2 bytes, trivially copyable, no arithmetic of its
/// own: compute in float).
struct f16 {
  std::uint16_t bits = 0;  ///< the raw bits

  /// +0.
  constexpr f16() = default;
  /// `f` rounded to nearest even.
  explicit f16(float f) : bits(round(f)) {}
  /// `d` rounded to nearest even (once: see the file comment).
  explicit f16(double d) : bits(round(bf16::odd_float(d))) {}
  /// `i` rounded to nearest even.
  template <std::integral I>
  explicit f16(I i) : f16(static_cast<double>(i)) {}
  /// The value with raw bits `b`.
  static constexpr f16 from_bits(std::uint16_t b) {
    f16 x;
    x.bits = b;
    return x;
  }

  /// The exact float.
  explicit operator float() const {
    const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
    const std::uint32_t exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
    if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24, exact in float
      const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
      return std::bit_cast<float>(std::bit_cast<std::uint32_t>(magnitude) | sign);
    }
    if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));  // Inf, NaN
    return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  }
  /// The exact double.
  explicit operator double() const { return static_cast<double>(static_cast<float>(*this)); }

  /// The bits of `f` rounded to fp16, nearest even.
  static std::uint16_t round(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    const std::uint32_t sign = (u >> 16) & 0x8000u, magnitude = u & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
    if (magnitude >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: Inf
    if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal fp16, |f| / 2^-24 rounded to even
      const float scaled = std::bit_cast<float>(magnitude) * 0x1p24f;  // exact: a power-of-two scaling
      return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(std::nearbyint(scaled)));
    }
    // Normal: the exponent rebiased (127 -> 15), the mantissa rounded from 23 to 10 bits; a carry
    // out of the mantissa steps the exponent, as rounding up should.
    const std::uint32_t rebiased = magnitude - (112u << 23);
    return static_cast<std::uint16_t>(sign | ((rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13));
  }
};

/// f16's DType.
template <>
struct dtype_of<f16> : std::integral_constant<DType, DType::f16> {};

}  // namespace seqpar
