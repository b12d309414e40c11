// The SIMD layer of the CPU kernels for ONE instruction set: vector types, the few operations
// the kernels need, a branch-free float exp, and the register-tiled micro-kernel. No include
// guard on purpose: kernel/cpu_isa_kernels.hpp includes this file once per instruction set,
// each time inside its own namespace and function-level target, with
//   SEQPAR_ISA_BYTES      bytes of one vector (16, 32 or 64),
//   SEQPAR_ISA_REGISTERS  architectural vector registers (16 or 32).
// Vectors are GCC/Clang vector extensions (plain C++ operators compile to the target's
// instructions); fused multiply-add goes through intrinsics, because whether `a * b + c` is
// contracted depends on the caller's flags (-std=c++20 turns contraction off in GCC).

/// Bytes of one SIMD register at this level.
inline constexpr int simd_bytes = SEQPAR_ISA_BYTES;

/// Architectural SIMD registers at this level (sizes the register tiles).
inline constexpr int simd_registers = SEQPAR_ISA_REGISTERS;

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

/// a * b + c, fused where the level has FMA.
inline Simd<float>::type simd_fma(Simd<float>::type a, Simd<float>::type b, Simd<float>::type c) {
#if SEQPAR_ISA_BYTES == 64
  return _mm512_fmadd_ps(a, b, c);
#elif SEQPAR_ISA_BYTES == 32
  return _mm256_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  return _mm_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

/// a * b + c, fused where the level has FMA.
inline Simd<double>::type simd_fma(Simd<double>::type a, Simd<double>::type b, Simd<double>::type c) {
#if SEQPAR_ISA_BYTES == 64
  return _mm512_fmadd_pd(a, b, c);
#elif SEQPAR_ISA_BYTES == 32
  return _mm256_fmadd_pd(a, b, c);
#elif defined(__FMA__)
  return _mm_fmadd_pd(a, b, c);
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

/// a * b + c for float (plain) or float vectors (fused).
template <class F>
inline F lanes_madd(F a, F b, F c) {
  if constexpr (std::is_same_v<F, float>) return a * b + c;
  else return simd_fma(a, b, c);
}

/// `c` in every lane of F (float, a float vector or an int32 vector). Vector constants are
/// built through this call, never as `F{} + literal`: nvcc's front end (cudafe++ 13) crashes
/// folding a 64-byte vector plus a literal.
template <class F, class C>
inline F lanes_const(C c) {
  if constexpr (std::is_arithmetic_v<F>) return static_cast<F>(c);
  else return c - F{};
}

/// exp(x) lane by lane for F = float or Simd<float>::type; returns 0 below -87 (softmax weights
/// that small do not matter), lets NaN through. Cody-Waite reduction r = x - n ln2 with ln2
/// split so that n * ln2_hi is exact, a degree-6 minimax polynomial on [-ln2/2, ln2/2], and
/// 2^n built in the exponent bits. n is rounded with the 1.5 * 2^23 trick, which needs no
/// float-to-int conversion and is exact for |n| < 2^22. Relative error below 2e-7 for x <= 0.
template <class F>
inline F fast_exp_lanes(F x) {
  constexpr bool scalar = std::is_same_v<F, float>;
  using I = std::conditional_t<scalar, std::int32_t, Simd<float>::itype>;
  const F lo = lanes_const<F>(-87.0f), hi = lanes_const<F>(88.0f);
  const F xc = x < lo ? lo : (x > hi ? hi : x);
  const F shifter = lanes_const<F>(12582912.0f);  // 1.5 * 2^23
  const F t = lanes_madd<F>(xc, lanes_const<F>(1.44269504088896341f), shifter);
  const F n = t - shifter;
  F r = lanes_madd<F>(n, lanes_const<F>(-0.693359375f), xc);
  r = lanes_madd<F>(n, lanes_const<F>(2.12194440e-4f), r);
  F p = lanes_const<F>(1.9875691500e-4f);
  p = lanes_madd<F>(p, r, lanes_const<F>(1.3981999507e-3f));
  p = lanes_madd<F>(p, r, lanes_const<F>(8.3334519073e-3f));
  p = lanes_madd<F>(p, r, lanes_const<F>(4.1665795894e-2f));
  p = lanes_madd<F>(p, r, lanes_const<F>(1.6666665459e-1f));
  p = lanes_madd<F>(p, r, lanes_const<F>(5.0000001201e-1f));
  p = lanes_madd<F>(p * r, r, r) + lanes_const<F>(1.0f);
  // bits(t) - bits(1.5 * 2^23) = n; adding the bias and shifting builds 2^n.
  const I e = (bits_as<I>(t) - lanes_const<I>(0x4B400000 - 127)) << 23;
  const F y = p * bits_as<F>(e);
  return x < lo ? F{} : y;
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

/// Register tile of the micro-kernel for accumulation type A: MR rows by NR vectors of
/// lanes. 2 x MR accumulators plus the two B vectors fill most of the register file (8 x 2
/// with 32 registers, 6 x 2 with 16).
template <class A>
struct FlashTile {
  static constexpr int nr = 2;                              ///< vectors of lanes per tile
  static constexpr int width = Simd<A>::width;              ///< lanes per vector
  static constexpr int panel = nr * width;                  ///< lanes per tile (columns of C)
  static constexpr int mr = simd_registers >= 32 ? 8 : 6;  ///< rows per tile
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

/// flash_tile over `rows` rows: full MR tiles, then one tail tile of rows % MR. Tile t's A
/// starts at a + t * a_tile: MR * a_row for A in plain rows, or the size of one packed tile.
template <bool Accumulate, class A>
inline void flash_tiles(std::int64_t rows, const A* a, std::ptrdiff_t a_row, std::ptrdiff_t a_k, std::ptrdiff_t a_tile,
                        const A* b, std::ptrdiff_t ldb, std::int64_t kdim, A* c, std::ptrdiff_t ldc, const A* alpha) {
  constexpr int MR = FlashTile<A>::mr;
  std::int64_t r0 = 0;
  for (; r0 + MR <= rows; r0 += MR, a += a_tile)
    flash_tile<MR, Accumulate>(a, a_row, a_k, b, ldb, kdim, c + r0 * ldc, ldc, alpha);
  const int tail = static_cast<int>(rows - r0);
  if (tail == 0) return;
  c += r0 * ldc;
  [&]<int... T>(std::integer_sequence<int, T...>) {
    ((tail == T + 1 ? flash_tile<T + 1, Accumulate>(a, a_row, a_k, b, ldb, kdim, c, ldc, alpha) : void()), ...);
  }(std::make_integer_sequence<int, MR - 1>{});
}
