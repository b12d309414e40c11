#pragma once
/// \file
/// A branch-free float exp that compilers vectorise (std::exp does not vectorise without
/// -ffast-math), in a scalar and a SIMD form, and the few SIMD operations the CPU kernels
/// need. Relative error below 2e-7 on the range softmax uses (x <= 0).
///
/// SIMD uses GCC/Clang vector extensions at the widest width the compile target has (64 bytes
/// with AVX-512, 32 with AVX, 16 otherwise), so the header is plain C++20 plus those
/// extensions: built without -march=native it still runs (on SSE2 or NEON registers). Fused
/// multiply-add goes through intrinsics where the target has FMA, because whether `a * b + c`
/// is contracted depends on the caller's flags (-std=c++20 turns contraction off in GCC).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace seqpar::detail {

/// Bytes of one SIMD register of the compile target.
inline constexpr int simd_bytes =
#if defined(__AVX512F__)
    64;
#elif defined(__AVX__)
    32;
#else
    16;
#endif

/// Architectural SIMD registers of the compile target (sizes the register tiles).
inline constexpr int simd_registers =
#if defined(__AVX512F__) || defined(__aarch64__)
    32;
#else
    16;
#endif

/// The SIMD vector of A (float or double) and its same-width integer vector.
template <class A>
struct Simd;

/// Float lanes.
template <>
struct Simd<float> {
  typedef float type __attribute__((vector_size(simd_bytes)));         ///< vector of float
  typedef std::int32_t itype __attribute__((vector_size(simd_bytes)));  ///< vector of int32
  static constexpr int width = simd_bytes / 4;                          ///< lanes
};

/// Double lanes.
template <>
struct Simd<double> {
  typedef double type __attribute__((vector_size(simd_bytes)));         ///< vector of double
  typedef std::int64_t itype __attribute__((vector_size(simd_bytes)));  ///< vector of int64
  static constexpr int width = simd_bytes / 8;                          ///< lanes
};

/// SIMD vector of A.
template <class A>
using simd_t = typename Simd<A>::type;

/// Loads a vector from `p` (no alignment required).
template <class A>
inline simd_t<A> simd_load(const A* p) {
  simd_t<A> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

/// Stores a vector to `p` (no alignment required).
template <class A>
inline void simd_store(A* p, simd_t<A> v) {
  std::memcpy(p, &v, sizeof v);
}

/// Every lane set to `a`. `a - 0` folds to `a` (it is exact for every a, -0 included), so
/// this is one broadcast, from memory when `a` is loaded; `0 + a` would cost an add, since
/// 0 + -0 is +0.
template <class A>
inline simd_t<A> simd_splat(A a) {
  return a - simd_t<A>{};
}

/// a * b + c, fused where the target has FMA.
inline Simd<float>::type simd_fma(Simd<float>::type a, Simd<float>::type b, Simd<float>::type c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

/// a * b + c, fused where the target has FMA.
inline Simd<double>::type simd_fma(Simd<double>::type a, Simd<double>::type b, Simd<double>::type c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_pd(a, b, c);
#elif defined(__FMA__)
  return _mm256_fmadd_pd(a, b, c);
#else
  return a * b + c;
#endif
}

/// Lane-wise max that keeps `m` where `x` is NaN (so NaN scores do not hide the running max).
template <class V>
inline V simd_max(V x, V m) {
  return x > m ? x : m;
}

/// Reinterprets the bits of `from` as To (same size).
template <class To, class From>
inline To bits_as(From from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

/// exp(x) lane by lane for F = float or Simd<float>::type; returns 0 below -87 (softmax weights
/// that small do not matter), lets NaN through. Cody-Waite reduction r = x - n ln2 with ln2
/// split so that n * ln2_hi is exact, a degree-6 minimax polynomial on [-ln2/2, ln2/2], and
/// 2^n built in the exponent bits. n is rounded with the 1.5 * 2^23 trick, which needs no
/// float-to-int conversion and is exact for |n| < 2^22.
template <class F>
inline F fast_exp_lanes(F x) {
  constexpr bool scalar = std::is_same_v<F, float>;
  using I = std::conditional_t<scalar, std::int32_t, Simd<float>::itype>;
  auto madd = [](F a, F b, F c) {
    if constexpr (scalar) return a * b + c;
    else return simd_fma(a, b, c);
  };
  const F lo = F{} + -87.0f, hi = F{} + 88.0f;
  const F xc = x < lo ? lo : (x > hi ? hi : x);
  const F shifter = F{} + 12582912.0f;  // 1.5 * 2^23
  const F t = madd(xc, F{} + 1.44269504088896341f, shifter);
  const F n = t - shifter;
  F r = madd(n, F{} + -0.693359375f, xc);
  r = madd(n, F{} + 2.12194440e-4f, r);
  F p = F{} + 1.9875691500e-4f;
  p = madd(p, r, F{} + 1.3981999507e-3f);
  p = madd(p, r, F{} + 8.3334519073e-3f);
  p = madd(p, r, F{} + 4.1665795894e-2f);
  p = madd(p, r, F{} + 1.6666665459e-1f);
  p = madd(p, r, F{} + 5.0000001201e-1f);
  p = madd(p * r, r, r) + 1.0f;
  // bits(t) - bits(1.5 * 2^23) = n; adding the bias and shifting builds 2^n.
  const I e = (bits_as<I>(t) - 0x4B400000 + 127) << 23;
  const F y = p * bits_as<F>(e);
  return x < lo ? F{} : y;
}

/// exp(x) for float; returns 0 below -87 (softmax weights that small do not matter).
inline float fast_exp(float x) { return fast_exp_lanes(x); }

/// exp for double keeps the library function: the double path is the exact one.
inline double fast_exp(double x) { return std::exp(x); }

}  // namespace seqpar::detail
