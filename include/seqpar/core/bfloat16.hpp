#pragma once
/// \file
/// bf16 on the host: bfloat16, the upper half of an IEEE-754 float (sign, the 8 exponent bits,
/// 7 mantissa bits), the element type serving and training engines keep activations and KV
/// caches in. Host engines accumulate it in float (acc_t<bf16> = float): softmax statistics,
/// partial outputs and ring partials stay float, messages carry bf16 (half the bytes of f32).
///
/// Conversions are explicit, so that no float expression silently rounds to 7 mantissa bits:
/// to float is exact (a shift); from float rounds to nearest, ties to even, keeps NaN a quiet
/// NaN and infinities infinite, and rounds past the largest finite bf16 to infinity; from
/// double rounds once (through float rounded to odd, which has more than twice bf16's
/// precision, so the second rounding is correct).

#include <bit>
#include <cmath>
#include <concepts>
#include <cstdint>

#include "seqpar/core/types.hpp"

namespace seqpar {

/// A bfloat16 value in host memory (2 bytes, trivially copyable, no arithmetic of its own:
/// compute in float).
struct bf16 {
  std::uint16_t bits = 0;  ///< the raw bits: the upper 16 bits of the float it stands for

  /// +0.
  constexpr bf16() = default;
  /// `f` rounded to nearest even.
  explicit bf16(float f) : bits(round(f)) {}
  /// `d` rounded to nearest even (once: see the file comment).
  explicit bf16(double d) : bits(round(odd_float(d))) {}
  /// `i` rounded to nearest even.
  template <std::integral I>
  explicit bf16(I i) : bf16(static_cast<double>(i)) {}
  /// The value with raw bits `b`.
  static constexpr bf16 from_bits(std::uint16_t b) {
    bf16 x;
    x.bits = b;
    return x;
  }

  /// The exact float.
  explicit operator float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }
  /// The exact double.
  explicit operator double() const { return static_cast<double>(static_cast<float>(*this)); }

  /// The bits of `f` rounded to bf16, nearest even.
  static std::uint16_t round(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  /// `d` as a float rounded to odd: truncated toward zero, the last bit set when inexact.
  static float odd_float(double d) {
    float f = static_cast<float>(d);
    if (std::isnan(d) || static_cast<double>(f) == d) return f;
    std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if (std::fabs(static_cast<double>(f)) > std::fabs(d)) --u;  // rounded away from zero: step back
    return std::bit_cast<float>(u | 1u);
  }
};

/// bf16's DType.
template <>
struct dtype_of<bf16> : std::integral_constant<DType, DType::bf16> {};

}  // namespace seqpar
