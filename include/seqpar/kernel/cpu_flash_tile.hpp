#pragma once
/// \file
/// The register-tiled micro-kernel CpuFlashKernel's forward and backward share: C[M rows x two
/// SIMD vectors] (+)= A B with A read by broadcast in any strides and B a contiguous panel,
/// and exp over SIMD lanes. The forward puts queries in the lanes; the backward keys (for S,
/// dP) or head dims (for dV, dK, dQ).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "seqpar/kernel/fast_exp.hpp"

namespace seqpar::detail {

/// Register tile of the CPU kernel's micro-kernel for accumulation type A: MR rows by NR
/// vectors of lanes. 2 x MR accumulators plus the two B vectors fill most of the register
/// file (8 x 2 with 32 registers, 6 x 2 with 16).
template <class A>
struct FlashTile {
  static constexpr int nr = 2;                                  ///< vectors of lanes per tile
  static constexpr int width = Simd<A>::width;                  ///< lanes per vector
  static constexpr int panel = nr * width;                      ///< lanes per tile (columns of C)
  static constexpr int mr = simd_registers >= 32 ? 8 : 6;      ///< rows per tile
};

/// C[M x NR vectors] = A B (Accumulate false), or C = C * alpha + A B (Accumulate true, alpha
/// one value per lane). A is read by broadcast at a[r * a_row + k * a_k] (so it can be K
/// rows, or V read column-wise, in the caller's strides); B row k is the contiguous panel at
/// b + k * ldb. The M x NR accumulators stay in registers for the whole k loop.
template <int M, bool Accumulate, class A>
inline void flash_tile(const A* a, std::ptrdiff_t a_row, std::ptrdiff_t a_k, const A* b, std::ptrdiff_t ldb,
                       std::int64_t kdim, A* c, std::ptrdiff_t ldc, const A* alpha) {
  using V = simd_t<A>;
  constexpr int W = FlashTile<A>::width;
  static_assert(FlashTile<A>::nr == 2, "flash_tile is written for two vectors of lanes");
  // Fold expressions over the row index keep every accumulator a named register value (a
  // loop over an array of them may go through the stack).
  [&]<int... R>(std::integer_sequence<int, R...>) {
    V acc0[M] = {((void)R, V{})...}, acc1[M] = {((void)R, V{})...};
    for (std::int64_t k = 0; k < kdim; ++k) {
      const A* ak = a + k * a_k;
      const V b0 = simd_load(b + k * ldb), b1 = simd_load(b + k * ldb + W);
      ((acc0[R] = simd_fma(simd_splat(ak[R * a_row]), b0, acc0[R]),
        acc1[R] = simd_fma(simd_splat(ak[R * a_row]), b1, acc1[R])),
       ...);
    }
    if constexpr (Accumulate) {
      const V al0 = simd_load(alpha), al1 = simd_load(alpha + W);
      ((simd_store(c + R * ldc, simd_fma(simd_load(c + R * ldc), al0, acc0[R])),
        simd_store(c + R * ldc + W, simd_fma(simd_load(c + R * ldc + W), al1, acc1[R]))),
       ...);
    } else {
      ((simd_store(c + R * ldc, acc0[R]), simd_store(c + R * ldc + W, acc1[R])), ...);
    }
  }(std::make_integer_sequence<int, M>{});
}

/// flash_tile over `rows` rows: full MR tiles, then one tail tile of rows % MR.
template <bool Accumulate, class A>
inline void flash_tiles(std::int64_t rows, const A* a, std::ptrdiff_t a_row, std::ptrdiff_t a_k, const A* b,
                        std::ptrdiff_t ldb, std::int64_t kdim, A* c, std::ptrdiff_t ldc, const A* alpha) {
  constexpr int MR = FlashTile<A>::mr;
  std::int64_t r0 = 0;
  for (; r0 + MR <= rows; r0 += MR)
    flash_tile<MR, Accumulate>(a + r0 * a_row, a_row, a_k, b, ldb, kdim, c + r0 * ldc, ldc, alpha);
  const int tail = static_cast<int>(rows - r0);
  if (tail == 0) return;
  a += r0 * a_row;
  c += r0 * ldc;
  [&]<int... T>(std::integer_sequence<int, T...>) {
    ((tail == T + 1 ? flash_tile<T + 1, Accumulate>(a, a_row, a_k, b, ldb, kdim, c, ldc, alpha) : void()), ...);
  }(std::make_integer_sequence<int, MR - 1>{});
}

/// exp of every lane: the vectorised fast_exp for float, the library exp for double (the
/// exact path).
template <class V>
inline V exp_lanes(V x) {
  if constexpr (std::is_same_v<V, simd_t<float>>) {
    return fast_exp_lanes(x);
  } else {
    for (int i = 0; i < Simd<double>::width; ++i) x[i] = std::exp(x[i]);
    return x;
  }
}

}  // namespace seqpar::detail
