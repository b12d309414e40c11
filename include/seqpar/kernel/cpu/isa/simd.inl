// The SIMD layer of the CPU kernels for ONE instruction set: vector types, the few operations
// the kernels need, a branch-free float exp, and the register-tiled micro-kernel. No include
// guard on purpose: kernel/cpu/isa_kernels.hpp includes this file once per instruction set,
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

#if SEQPAR_CPU_ISA_X86 && (SEQPAR_ISA_BYTES == 64 || (SEQPAR_ISA_BYTES == 32 && (SEQPAR_CPU_ISA_DISPATCH || defined(__F16C__))))
/// Whether this level converts fp16 by F16C (vcvtph2ps, vcvtps2ph): AVX-512 has it; the AVX2
/// copy is compiled with it (cpu_isa_supported checks it), a one-copy AVX2 build when its flags
/// name it.
inline constexpr bool simd_f16c = true;
#else
/// Whether this level converts fp16 by F16C: not the 128-bit level, nor a one-copy AVX2 build
/// whose flags leave it out.
inline constexpr bool simd_f16c = false;
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

/// The bits of a float vector's lanes as unsigned 32-bit words, and as many 16-bit words (the
/// 2-byte types' bits): the conversions to and from bf16 and fp16 work on these.
typedef std::uint32_t WordLanes __attribute__((vector_size(simd_bytes)));
/// See WordLanes.
typedef std::uint16_t HalfLanes __attribute__((vector_size(simd_bytes / 2)));

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

/// Prefetches the `n` elements at `row` (a row of a caller's tensor), line by line, with
/// temporal locality `locality` (3: into L1, 2: into L2).
template <class T>
inline void prefetch_row(const T* row, std::int64_t n, int locality) {
  const char* p = reinterpret_cast<const char*>(row);
  const std::int64_t bytes = n * static_cast<std::int64_t>(sizeof(T));
  if (locality == 3)
    for (std::int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
  else
    for (std::int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/// Lane-wise max that keeps `m` where `x` is NaN (so NaN scores do not hide the running max).
template <class V>
inline V simd_max(V x, V m) {
  return x > m ? x : m;
}

/// True when the `n` values at `x`, and the first `tail` values of each of the `rows` rows
/// `ld` apart at `tail_at`, are all finite (x - x is 0 for finite x, NaN for NaN and Inf).
/// Two vector chains: the forward checks every key block's packed V.
template <class A>
inline bool all_finite(const A* x, std::int64_t n, const A* tail_at, std::int64_t rows, std::int64_t tail,
                       std::ptrdiff_t ld) {
  using V = simd_t<A>;
  constexpr int W = Simd<A>::width;
  V p0{}, p1{};
  std::int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const V a = simd_load(x + i), b = simd_load(x + i + W);
    p0 += a - a;
    p1 += b - b;
  }
  A probe = 0;
  for (; i < n; ++i) probe += x[i] - x[i];
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t d = 0; d < tail; ++d) probe += tail_at[r * ld + d] - tail_at[r * ld + d];
  p0 += p1;
  for (int w = 0; w < W; ++w) probe += p0[w];
  return probe == 0;  // NaN compares unequal
}

/// Reinterprets the bits of `from` as To (same size).
template <class To, class From>
inline To bits_as(From from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

/// Whether simd_load_as<A> reads T: A itself, or bf16 / fp16 as float.
template <class A, class T>
inline constexpr bool simd_loads_as =
    std::is_same_v<T, A> || ((std::is_same_v<T, bf16> || std::is_same_v<T, f16>) && std::is_same_v<A, float>);

/// A vector of the values of T at `p` as A (simd_loads_as<A, T>), each the float its scalar
/// conversion gives: a plain load when T is A; a bf16 zero-extended and shifted into a float's
/// upper half (a bf16 is one); an fp16 by F16C's vcvtph2ps on the AVX2 and AVX-512 levels
/// (which quiets a signalling NaN; every other value bit for bit), and rebuilt from its fields
/// in integer lanes on the 128-bit level. Written out because GCC 12 at -O2 leaves the scalar
/// conversion loops unvectorised.
template <class A, class T>
inline simd_t<A> simd_load_as(const T* p) {
  static_assert(simd_loads_as<A, T>);
#if SEQPAR_CPU_ISA_X86
  if constexpr (std::is_same_v<T, f16> && simd_f16c) {
    // (maskz: the unmasked form's header leaves a register "uninitialised" to GCC 12's -Wall.)
    if constexpr (simd_bytes == 64)
      return _mm512_maskz_cvtph_ps(__mmask16(0xffff), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    else
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
#endif
  if constexpr (std::is_same_v<T, A>) {
    return simd_load(p);
  } else {
    using F = simd_t<float>;
    using Word = WordLanes;
    HalfLanes h;
    std::memcpy(&h, p, sizeof h);
    const Word x = __builtin_convertvector(h, Word);
    if constexpr (std::is_same_v<T, bf16>) {
      return bits_as<F>(x << 16);
    } else {
      // As f16's operator float: sign | exponent rebiased (15 -> 127) | mantissa; exponent 0
      // is mantissa x 2^-24 (exact, whatever the FPU's denormal modes: the product is normal);
      // exponent 31 is Inf or NaN, the mantissa kept.
      const Word sign = (x & 0x8000u) << 16, exponent = (x >> 10) & 0x1fu, mantissa = x & 0x3ffu;
      const Word normal = ((exponent + 112u) << 23) | (mantissa << 13);
      const Word special = 0x7f800000u | (mantissa << 13);
      const F small = __builtin_convertvector(bits_as<Simd<float>::itype>(mantissa), F) * 0x1p-24f;
      return bits_as<F>(sign | (exponent == 0u ? bits_as<Word>(small) : exponent == 31u ? special : normal));
    }
  }
}

/// Whether simd_store_as<T> writes A: as itself, or float as bf16 (every level) or fp16 (the
/// AVX2 and AVX-512 levels, F16C).
template <class T, class A>
inline constexpr bool simd_stores_as =
    std::is_same_v<T, A> || (std::is_same_v<T, bf16> && std::is_same_v<A, float>) ||
    (std::is_same_v<T, f16> && std::is_same_v<A, float> && simd_f16c);

/// Stores `x` at `p` as T (simd_stores_as<T, A>), each lane rounded as T's constructor rounds
/// it, bit for bit: bf16 to nearest even in integer lanes (a NaN kept quiet), fp16 by F16C's
/// vcvtps2ph to nearest even (which writes NaN, Inf and subnormals as f16's constructor does).
/// The forward's output rows go through here.
template <class T, class A>
[[gnu::always_inline]] inline void simd_store_as(T* p, simd_t<A> x) {
  static_assert(simd_stores_as<T, A>);
  if constexpr (std::is_same_v<T, A>) {
    simd_store(p, x);
  } else if constexpr (std::is_same_v<T, bf16>) {
    const WordLanes u = bits_as<WordLanes>(x);
    const WordLanes rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    const HalfLanes h = __builtin_convertvector((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded, HalfLanes);
    std::memcpy(static_cast<void*>(p), &h, sizeof h);
  } else {
#if SEQPAR_CPU_ISA_X86
    if constexpr (simd_bytes == 64)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_maskz_cvtps_ph(__mmask16(0xffff), x, _MM_FROUND_TO_NEAREST_INT));
    else
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
#endif
  }
}

/// The `n` values at `src` as To at `dst`, each as static_cast<To> gives it: a vector at a time
/// where simd_load_as widens From to To or simd_store_as narrows it, the tail (and other pairs
/// of types) one by one. The packs' conversions go through here, so that they run at the speed
/// of a copy (a scalar loop made a bf16 decode step 2.4x slower); always inlined, as the loops
/// it replaced were (a call per packed K row cost a float forward 1-2%).
template <class From, class To>
[[gnu::always_inline]] inline void convert_values(const From* src, To* dst, std::int64_t n) {
  std::int64_t d = 0;
  if constexpr (simd_loads_as<To, From>) {
    for (; d + Simd<To>::width <= n; d += Simd<To>::width) simd_store(dst + d, simd_load_as<To>(src + d));
  } else if constexpr (simd_stores_as<To, From>) {
    for (; d + Simd<From>::width <= n; d += Simd<From>::width) simd_store_as<To, From>(dst + d, simd_load(src + d));
  }
  for (; d < n; ++d) dst[d] = static_cast<To>(src[d]);
}

/// Transposes the square block held in `r` (lane c of r[i] is element (i, c)) in place, so that
/// lane c of r[i] becomes element (c, i): one round of two-vector shuffles per bit of the lane
/// index, each round exchanging, for the rows and lanes that differ in that bit, the two
/// off-diagonal sub-blocks (W log2 W shuffles for W lanes: 64 on AVX-512 for 256 elements,
/// against 256 single-element moves).
/// V: Simd<A>::type or Simd<A>::itype (float, double, or their same-width integer lanes).
template <class V>
[[gnu::always_inline]] inline void transpose_lanes(V* r) {
  constexpr int W = simd_bytes / sizeof(r[0][0]);
  using M = std::conditional_t<sizeof(r[0][0]) == 4, Simd<float>::itype, Simd<double>::itype>;
  using Index = std::conditional_t<sizeof(r[0][0]) == 4, std::int32_t, std::int64_t>;
  // For rows i (bit h clear) and i + h: the low row keeps its lanes without bit h and takes
  // the high row's lanes without bit h into its lanes with it; the high row the other way.
  // Lane L of either comes from lane lane(L, h, high) of a (below W) or of b (W and up).
  // GCC (and nvcc's front end, which reads this host code as GCC) shuffles by a mask vector,
  // const, not constexpr: nvcc cannot evaluate a vector constant (GCC folds them). Clang has
  // only __builtin_shufflevector, whose lanes are constants (nvcc mistypes its result).
  constexpr auto lane = [](int L, int h, bool high) { return high ? ((L & h) ? L + W : L + h) : ((L & h) ? L - h + W : L); };
  const auto mask = [&]<int... L>(std::integer_sequence<int, L...>, int h, bool high) {
    return M{static_cast<Index>(lane(L, h, high))...};
  };
  [&]<int... H>(std::integer_sequence<int, H...>) {
    (([&] {
       constexpr int h = 1 << H;
       const M lo = mask(std::make_integer_sequence<int, W>{}, h, false);
       const M hi = mask(std::make_integer_sequence<int, W>{}, h, true);
       for (int i = 0; i < W; ++i) {
         if (i & h) continue;
         const V a = r[i], b = r[i + h];
#if defined(__clang__)
         (void)lo, (void)hi;
         [&]<int... L>(std::integer_sequence<int, L...>) {
           r[i] = __builtin_shufflevector(a, b, lane(L, h, false)...);
           r[i + h] = __builtin_shufflevector(a, b, lane(L, h, true)...);
         }(std::make_integer_sequence<int, W>{});
#else
         r[i] = __builtin_shuffle(a, b, lo);
         r[i + h] = __builtin_shuffle(a, b, hi);
#endif
       }
     }()),
     ...);
  }(std::make_integer_sequence<int, std::countr_zero(static_cast<unsigned>(W))>{});
}

/// Turns rows into lanes W x W elements at a time, W the lanes of V: for c = 0, W, 2W, ...
/// while c + W <= n, the vectors load(i, c) for i < W (row i's elements [c, c + W)) are
/// transposed and vector i (element c + i of every row) goes to store(i, c). Returns the
/// first c left (the caller does elements [c, n) one at a time). The forward packs Q^T and
/// writes its output rows so: one element at a time, those two were about a quarter of its
/// samples outside the products (perf, head dim 128, causal, 2048 queries).
template <class V, class Load, class Store>
[[gnu::always_inline]] inline std::int64_t transpose_blocks(std::int64_t n, Load load, Store store) {
  constexpr int W = simd_bytes / sizeof(V{}[0]);
  std::int64_t c = 0;
  for (; c + W <= n; c += W) {
    V r[W];
    for (int i = 0; i < W; ++i) r[i] = load(i, c);
    transpose_lanes(r);
    for (int i = 0; i < W; ++i) store(i, c, r[i]);
  }
  return c;
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

/// 2^r for r in [-1/2, 1/2]: degree-5 polynomial 1 + r q(r), q fitted for the least largest
/// relative error (F = float or a float vector). The constant term is exactly 1, so 2^0 = 1:
/// a row whose only visible key is its maximum gets l = 1 and an LSE equal to its score, not
/// one float ulp of 1 above it (a free constant term, 1.00000012, put 1.2e-7 into every such
/// LSE). Relative error 9.2e-8 in exact arithmetic, 1.7e-7 evaluated in float with FMA (the
/// free fit: 2.1e-7).
template <class F>
inline F exp2_poly(F r) {
  F p = lanes_const<F>(1.32646982e-3f);
  p = lanes_madd<F>(p, r, lanes_const<F>(9.67150927e-3f));
  p = lanes_madd<F>(p, r, lanes_const<F>(5.55073395e-2f));
  p = lanes_madd<F>(p, r, lanes_const<F>(2.40222424e-1f));
  p = lanes_madd<F>(p, r, lanes_const<F>(6.93147004e-1f));
  return lanes_madd<F>(p, r, lanes_const<F>(1.0f));
}

/// 2^x lane by lane for F = float or Simd<float>::type, for softmax arguments in log2 units
/// (x <= 0, a little above 0 from rounding): exactly 0 at and below -127 (so that a hidden
/// key's weight is 0, never a denormal that would multiply a NaN into the row), NaN passes.
/// x = n + r with n = round(x), 2^r by a degree-5 minimax polynomial on [-1/2, 1/2]
/// (exp2_poly: exactly 1 at 0, relative error 1.7e-7), 2^n put into the exponent: by vscalefps on
/// AVX-512 (9 vector operations in all), else with the 1.5 * 2^23 rounding trick, whose sum t
/// holds n in its low mantissa bits (11 operations).
template <class F>
inline F fast_exp2_lanes(F x) {
#if SEQPAR_ISA_BYTES == 64
  if constexpr (!std::is_same_v<F, float>) {
    // Lanes at or below -127 (and -inf) become 0 through the zeroing mask; NaN is unordered,
    // so NLE keeps it.
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lanes_const<F>(-127.0f), _CMP_NLE_UQ);
    // (maskz with every lane: GCC 12's plain roundscale warns of its own undefined source.)
    const F n = _mm512_maskz_roundscale_ps(0xFFFF, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_scalef_ps(keep, exp2_poly(x - n), n);
  }
#endif
  using I = std::conditional_t<std::is_same_v<F, float>, std::int32_t, Simd<float>::itype>;
  const F lo = lanes_const<F>(-127.0f);
  const F xc = x < lo ? lo : x;                       // NaN compares false: kept
  const F shifter = lanes_const<F>(12582912.0f);      // 1.5 * 2^23
  const F t = xc + shifter;                           // n = round(xc) in t's low mantissa bits
  const F n = t - shifter;
  // bits(t) - bits(1.5 * 2^23) = n; adding the bias and shifting builds 2^n (0 for n = -127).
  const I e = (bits_as<I>(t) - lanes_const<I>(0x4B400000 - 127)) << 23;
  return exp2_poly(xc - n) * bits_as<F>(e);
}

/// e^x of every lane: 2^(x log2 e) by fast_exp2_lanes for float, the library exp for double
/// (the exact path). The caller subtracts the running max (or the LSE) in natural units first,
/// so that x is exact even for huge logits and only x's product with log2(e) is rounded:
/// scaling the scores into log2 units up front would round them, at +-1e4 by 1e-3.
template <class V>
inline V exp_lanes(V x) {
  if constexpr (std::is_same_v<V, simd_t<float>>) {
    return fast_exp2_lanes(x * lanes_const<V>(1.44269504088896341f));
  } else {
    for (int i = 0; i < Simd<double>::width; ++i) x[i] = std::exp(x[i]);
    return x;
  }
}

/// e^y for y in [0, 20] (F = float or a float vector), to about one float ulp: n = round(y /
/// ln 2) and r = y - n ln 2 in two steps (ln 2's high part has trailing zero bits, so n ln2_hi
/// is exact and r carries no rounding of y's scale), e^r on [-ln2/2, ln2/2] by a degree-6
/// minimax polynomial (relative error 1.9e-9), 2^n put into the exponent. tanh_lanes' large
/// arguments need this much: fast_exp2_lanes rounds y log2(e) first and has 2.2e-7.
template <class F>
inline F exp_tanh_arg(F y) {
  using I = std::conditional_t<std::is_same_v<F, float>, std::int32_t, Simd<float>::itype>;
  const F shifter = lanes_const<F>(12582912.0f);  // 1.5 * 2^23: n = round(y / ln 2) in t's low bits
  const F t = lanes_madd<F>(y, lanes_const<F>(1.44269504088896341f), shifter);
  const F n = t - shifter;
  F r = lanes_madd<F>(n, lanes_const<F>(-0.693145751953125f), y);  // ln2_hi: 16 significant bits
  r = lanes_madd<F>(n, lanes_const<F>(-1.42860682030941723e-6f), r);
  F p = lanes_const<F>(1.38368300e-3f);
  p = lanes_madd<F>(p, r, lanes_const<F>(8.37481571e-3f));
  p = lanes_madd<F>(p, r, lanes_const<F>(4.16682259e-2f));
  p = lanes_madd<F>(p, r, lanes_const<F>(1.66664202e-1f));
  p = lanes_madd<F>(p, r, lanes_const<F>(4.99999921e-1f));
  p = lanes_madd<F>(p, r, lanes_const<F>(1.00000004f));
  p = lanes_madd<F>(p, r, lanes_const<F>(1.0f));
  return p * bits_as<F>((bits_as<I>(t) - lanes_const<I>(0x4B400000 - 127)) << 23);
}

/// tanh of every lane (F = float or a float vector), within about one float ulp of the
/// result in absolute terms over the whole range, and with the relative accuracy of the
/// result below |x| = 0.625 (where tanh(x) = x + x^3 P(x^2), P of degree 4, relative error
/// 4.4e-9: a soft-capped score near 0 keeps its digits). Above, 1 - 2 / (e^{2|x|} + 1) with
/// the sign of x, |x| clamped at 10 (tanh is 1 in float from 9.1). NaN stays NaN (every
/// comparison keeps it), +-inf gives +-1. The division is rcp14 and one Newton step on
/// AVX-512 (a quarter of a vdivps's port time), a plain division elsewhere.
template <class F>
inline F tanh_lanes(F x) {
  using I = std::conditional_t<std::is_same_v<F, float>, std::int32_t, Simd<float>::itype>;
  const I sign = lanes_const<I>(std::int32_t(0x80000000u));
  const F ax = bits_as<F>(bits_as<I>(x) & ~sign);
  const F z = x * x;
  F p = lanes_const<F>(-5.70495282e-3f);
  p = lanes_madd<F>(p, z, lanes_const<F>(2.06390536e-2f));
  p = lanes_madd<F>(p, z, lanes_const<F>(-5.37397035e-2f));
  p = lanes_madd<F>(p, z, lanes_const<F>(1.33314420e-1f));
  p = lanes_madd<F>(p, z, lanes_const<F>(-3.33332819e-1f));
  const F small = lanes_madd<F>(ax * z, p, ax);
  const F y = ax > lanes_const<F>(10.0f) ? lanes_const<F>(10.0f) : ax;  // NaN compares false: kept
  const F d = exp_tanh_arg<F>(y + y) + lanes_const<F>(1.0f);
  F q;  // 2 / d
#if SEQPAR_ISA_BYTES == 64
  if constexpr (!std::is_same_v<F, float>) {
    const F r = _mm512_maskz_rcp14_ps(0xFFFF, d);  // (maskz: GCC 12 warns of the plain one's undefined source)
    const F h = _mm512_fnmadd_ps(d, r, lanes_const<F>(2.0f));  // 2 - d r: r (2 - d r) is 1/d to 2^-28
    q = (r + r) * h;
  } else
#endif
  {
    q = lanes_const<F>(2.0f) / d;
  }
  const F mag = ax < lanes_const<F>(0.625f) ? small : lanes_const<F>(1.0f) - q;
  return bits_as<F>(bits_as<I>(mag) | (bits_as<I>(x) & sign));  // tanh is odd: -0 stays -0
}

/// cap * tanh(x) of every lane: the soft-capped score of x = s / cap. Float lanes by
/// tanh_lanes; double lanes by the library tanh (the double kernels are the exact path, as
/// exp_lanes' double lanes are).
template <class V>
inline V softcap_lanes(V x, V cap) {
  if constexpr (std::is_same_v<V, simd_t<float>>) {
    return cap * tanh_lanes(x);
  } else {
    for (int i = 0; i < Simd<double>::width; ++i) x[i] = std::tanh(x[i]);
    return cap * x;
  }
}

/// Soft-caps the `n` scores at `s` in place (n a whole number of vectors): s = cap * tanh(s),
/// the scores having been formed as s / cap (Q scaled by scale / cap, see score_scale).
template <class A>
inline void softcap_scores(A* s, std::int64_t n, A cap) {
  using V = simd_t<A>;
  constexpr int W = Simd<A>::width;
  const V c = simd_splat(cap);
  for (std::int64_t i = 0; i < n; i += W) simd_store(s + i, softcap_lanes(simd_load(s + i), c));
}

/// The factor the kernels scale Q by: the softmax scale, over the soft-cap when there is one
/// (the scores come out as s / cap, what tanh takes).
template <class A>
inline A score_scale(const KernelParams& p) {
  return static_cast<A>(p.softcap > 0 ? p.scale / p.softcap : p.scale);
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

#undef SEQPAR_ISA_TILE_ASM
#if SEQPAR_ISA_BYTES == 64 && defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
/// 1 where flash_tile has the assembly k loop (AVX-512 on x86-64, GCC or Clang, not nvcc).
#define SEQPAR_ISA_TILE_ASM 1
// The 8-row float tile of NR = 2 or 3 vectors in assembly text. Row r accumulates in zmm r
// (first vector), zmm r+8 and zmm r+16 (third, NR 3 only); a k step's B vectors go to
// zmm24-26 and each A broadcast to zmm27. Rows 0-3 are read from %[pa] and rows 4-7 from
// %[pa4], at 0, 1, 2 and 3 row strides (%[s1] bytes, %[s3] = 3 %[s1]), plus the step's offset
// u %[ak] bytes, a constant the assembler folds. The _2 and _3 macros differ only in the
// third vector.
#define SEQPAR_TILE_FMA(bv, r) "vfmadd231ps %%zmm" #bv ", %%zmm27, %%zmm" #r "\n\t"
#define SEQPAR_TILE_ROW_2(u, addr, r0, r1, r2) \
  "vbroadcastss " #u "*%c[ak]" addr ", %%zmm27\n\t" SEQPAR_TILE_FMA(24, r0) SEQPAR_TILE_FMA(25, r1)
#define SEQPAR_TILE_ROW_3(u, addr, r0, r1, r2) SEQPAR_TILE_ROW_2(u, addr, r0, r1, r2) SEQPAR_TILE_FMA(26, r2)
#define SEQPAR_TILE_LOADB_2(baddr) "vmovups " baddr ", %%zmm24\n\t vmovups 64" baddr ", %%zmm25\n\t"
#define SEQPAR_TILE_LOADB_3(baddr) SEQPAR_TILE_LOADB_2(baddr) "vmovups 128" baddr ", %%zmm26\n\t"
#define SEQPAR_TILE_STEP(N, u, baddr)                            \
  SEQPAR_TILE_LOADB_##N(baddr)                                   \
  SEQPAR_TILE_ROW_##N(u, "(%[pa])", 0, 8, 16)                    \
  SEQPAR_TILE_ROW_##N(u, "(%[pa],%[s1])", 1, 9, 17)              \
  SEQPAR_TILE_ROW_##N(u, "(%[pa],%[s1],2)", 2, 10, 18)           \
  SEQPAR_TILE_ROW_##N(u, "(%[pa],%[s3])", 3, 11, 19)             \
  SEQPAR_TILE_ROW_##N(u, "(%[pa4])", 4, 12, 20)                  \
  SEQPAR_TILE_ROW_##N(u, "(%[pa4],%[s1])", 5, 13, 21)            \
  SEQPAR_TILE_ROW_##N(u, "(%[pa4],%[s1],2)", 6, 14, 22)          \
  SEQPAR_TILE_ROW_##N(u, "(%[pa4],%[s3])", 7, 15, 23)
#define SEQPAR_TILE_ZERO(r) "vpxord %%zmm" #r ", %%zmm" #r ", %%zmm" #r "\n\t"
#define SEQPAR_TILE_ZERO_2                                                                    \
  SEQPAR_TILE_ZERO(0) SEQPAR_TILE_ZERO(1) SEQPAR_TILE_ZERO(2) SEQPAR_TILE_ZERO(3) SEQPAR_TILE_ZERO(4)    \
  SEQPAR_TILE_ZERO(5) SEQPAR_TILE_ZERO(6) SEQPAR_TILE_ZERO(7) SEQPAR_TILE_ZERO(8) SEQPAR_TILE_ZERO(9)    \
  SEQPAR_TILE_ZERO(10) SEQPAR_TILE_ZERO(11) SEQPAR_TILE_ZERO(12) SEQPAR_TILE_ZERO(13) SEQPAR_TILE_ZERO(14) \
  SEQPAR_TILE_ZERO(15)
#define SEQPAR_TILE_ZERO_3                                                                     \
  SEQPAR_TILE_ZERO_2 SEQPAR_TILE_ZERO(16) SEQPAR_TILE_ZERO(17) SEQPAR_TILE_ZERO(18) SEQPAR_TILE_ZERO(19) \
  SEQPAR_TILE_ZERO(20) SEQPAR_TILE_ZERO(21) SEQPAR_TILE_ZERO(22) SEQPAR_TILE_ZERO(23)
/// The tile's k loop: accumulators zeroed, %[n4] turns of four steps (B's steps at index
/// registers %[lb] and %[lb3] = 3 %[lb]), then %[n1] single steps.
#define SEQPAR_TILE_LOOP(N)                                                                        \
  "lea (%[pa],%[s1],4), %[pa4]\n\t"                                                                \
  SEQPAR_TILE_ZERO_##N                                                                             \
  "test %[n4], %[n4]\n\t"                                                                          \
  "jz 2f\n"                                                                                        \
  "1:\n\t"                                                                                         \
  SEQPAR_TILE_STEP(N, 0, "(%[pb])") SEQPAR_TILE_STEP(N, 1, "(%[pb],%[lb])")                        \
  SEQPAR_TILE_STEP(N, 2, "(%[pb],%[lb],2)") SEQPAR_TILE_STEP(N, 3, "(%[pb],%[lb3])")               \
  "add $4*%c[ak], %[pa]\n\t"                                                                       \
  "add $4*%c[ak], %[pa4]\n\t"                                                                      \
  "lea (%[pb],%[lb],4), %[pb]\n\t"                                                                 \
  "dec %[n4]\n\t"                                                                                  \
  "jnz 1b\n"                                                                                       \
  "2:\n\t"                                                                                         \
  "test %[n1], %[n1]\n\t"                                                                          \
  "jz 4f\n"                                                                                        \
  "3:\n\t"                                                                                         \
  SEQPAR_TILE_STEP(N, 0, "(%[pb])")                                                                \
  "add $%c[ak], %[pa]\n\t"                                                                         \
  "add $%c[ak], %[pa4]\n\t"                                                                        \
  "add %[lb], %[pb]\n\t"                                                                           \
  "dec %[n1]\n\t"                                                                                  \
  "jnz 3b\n"                                                                                       \
  "4:\n\t"
/// Row r's result to C row r (%[pc], then %[lc] bytes on), either stored or (Accumulate) added
/// to C times alpha (alpha's vectors in zmm24-26, C's through zmm27).
#define SEQPAR_TILE_STORE_2(r0, r1, r2) "vmovups %%zmm" #r0 ", (%[pc])\n\t vmovups %%zmm" #r1 ", 64(%[pc])\n\t"
#define SEQPAR_TILE_STORE_3(r0, r1, r2) SEQPAR_TILE_STORE_2(r0, r1, r2) "vmovups %%zmm" #r2 ", 128(%[pc])\n\t"
#define SEQPAR_TILE_ADD1(off, av, r) "vmovups " #off "(%[pc]), %%zmm27\n\t" SEQPAR_TILE_FMA(av, r)
#define SEQPAR_TILE_ADD_2(r0, r1, r2) \
  SEQPAR_TILE_ADD1(0, 24, r0) SEQPAR_TILE_ADD1(64, 25, r1) SEQPAR_TILE_STORE_2(r0, r1, r2)
#define SEQPAR_TILE_ADD_3(r0, r1, r2)                                                      \
  SEQPAR_TILE_ADD1(0, 24, r0) SEQPAR_TILE_ADD1(64, 25, r1) SEQPAR_TILE_ADD1(128, 26, r2) \
  SEQPAR_TILE_STORE_3(r0, r1, r2)
#define SEQPAR_TILE_ROWS_OUT(N, OP)                                                                          \
  OP##_##N(0, 8, 16) "add %[lc], %[pc]\n\t" OP##_##N(1, 9, 17) "add %[lc], %[pc]\n\t" OP##_##N(2, 10, 18)   \
  "add %[lc], %[pc]\n\t" OP##_##N(3, 11, 19) "add %[lc], %[pc]\n\t" OP##_##N(4, 12, 20) "add %[lc], %[pc]\n\t" \
  OP##_##N(5, 13, 21) "add %[lc], %[pc]\n\t" OP##_##N(6, 14, 22) "add %[lc], %[pc]\n\t" OP##_##N(7, 15, 23)
#define SEQPAR_TILE_ADD_OUT(N) SEQPAR_TILE_ROWS_OUT(N, SEQPAR_TILE_ADD)
#define SEQPAR_TILE_STORE_OUT(N) SEQPAR_TILE_ROWS_OUT(N, SEQPAR_TILE_STORE)
#define SEQPAR_TILE_ALPHA_2 "vmovups (%[al]), %%zmm24\n\t vmovups 64(%[al]), %%zmm25\n\t"
#define SEQPAR_TILE_ALPHA_3 SEQPAR_TILE_ALPHA_2 "vmovups 128(%[al]), %%zmm26\n\t"

/// The operands every tile statement takes (the accumulate ones add alpha's address), and
/// what they clobber: the accumulators, B's vectors and the broadcast (zmm16-23 and zmm26
/// only with three vectors, so that the two-vector tile leaves them to the caller).
#define SEQPAR_TILE_OUTPUTS \
  [pa] "+r"(a), [pb] "+r"(b), [n4] "+r"(n4), [n1] "+r"(n1), [pc] "+r"(c), [pa4] "=&r"(a4)
#define SEQPAR_TILE_INPUTS \
  [s1] "r"(s1), [s3] "r"(s3), [lb] "r"(lb), [lb3] "r"(lb3), [lc] "r"(lc), [ak] "n"(AK * bytes)
#define SEQPAR_TILE_CLOBBERS_2                                                                              \
  "cc", "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
      "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm24", "xmm25", "xmm27"
#define SEQPAR_TILE_CLOBBERS_3                                                                         \
  SEQPAR_TILE_CLOBBERS_2, "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm26"
/// One tile statement: the loop, then the rows stored (or added, after alpha's vectors).
#define SEQPAR_TILE_ASM_STORE(N) \
  asm volatile(SEQPAR_TILE_LOOP(N) SEQPAR_TILE_STORE_OUT(N) : SEQPAR_TILE_OUTPUTS : SEQPAR_TILE_INPUTS : SEQPAR_TILE_CLOBBERS_##N)
#define SEQPAR_TILE_ASM_ADD(N)                                                                  \
  asm volatile(SEQPAR_TILE_LOOP(N) SEQPAR_TILE_ALPHA_##N SEQPAR_TILE_ADD_OUT(N)                 \
               : SEQPAR_TILE_OUTPUTS : SEQPAR_TILE_INPUTS, [al] "r"(alpha) : SEQPAR_TILE_CLOBBERS_##N)

/// flash_tile's full float tile (8 rows, NR = 2 or 3 vectors) with a_k = AK, in assembly: the
/// k loop four steps a turn, A's steps folded into constant offsets and B's into index
/// registers, so that a turn of 64 (96) FMAs carries five scalar uops. Inside the forward and
/// the backward, GCC 12 compiles the C++ loop with up to seven row-index registers and a
/// pointer bump per operand each step, and where the caller holds many values it reloads
/// strides from the stack; this loop made both 2-3% faster (alternated A/B, D 64 and 128, S
/// 2048-8192). Alone, on L1 operands, the two loops run alike (75-85% of the FMA peak). The
/// accumulators live in zmm0-23 for the whole tile, so they are not operands (an asm takes at
/// most 30, an in-out one counting twice). `volatile`, because its effect is the stores to C:
/// its register outputs are dropped, and GCC deletes an asm whose outputs nobody reads.
template <bool Accumulate, int NR, std::ptrdiff_t AK>
[[gnu::always_inline]] inline void tile_8xn_asm(const float* a, std::ptrdiff_t a_row, const float* b,
                                                std::ptrdiff_t ldb, std::int64_t kdim, float* c,
                                                std::ptrdiff_t ldc, const float* alpha) {
  static_assert(NR == 2 || NR == 3, "the assembly tile is written for two or three vectors");
  constexpr std::ptrdiff_t bytes = sizeof(float);
  const std::ptrdiff_t s1 = a_row * bytes, s3 = 3 * s1, lb = ldb * bytes, lb3 = 3 * lb, lc = ldc * bytes;
  std::int64_t n4 = kdim / 4, n1 = kdim % 4;
  const float* a4;
  if constexpr (Accumulate && NR == 2) {
    SEQPAR_TILE_ASM_ADD(2);
  } else if constexpr (Accumulate) {
    SEQPAR_TILE_ASM_ADD(3);
  } else if constexpr (NR == 2) {
    SEQPAR_TILE_ASM_STORE(2);
  } else {
    SEQPAR_TILE_ASM_STORE(3);
  }
}
#undef SEQPAR_TILE_ASM_ADD
#undef SEQPAR_TILE_ASM_STORE
#undef SEQPAR_TILE_CLOBBERS_3
#undef SEQPAR_TILE_CLOBBERS_2
#undef SEQPAR_TILE_INPUTS
#undef SEQPAR_TILE_OUTPUTS
#undef SEQPAR_TILE_ALPHA_3
#undef SEQPAR_TILE_ALPHA_2
#undef SEQPAR_TILE_STORE_OUT
#undef SEQPAR_TILE_ADD_OUT
#undef SEQPAR_TILE_ROWS_OUT
#undef SEQPAR_TILE_ADD_3
#undef SEQPAR_TILE_ADD_2
#undef SEQPAR_TILE_ADD1
#undef SEQPAR_TILE_STORE_3
#undef SEQPAR_TILE_STORE_2
#undef SEQPAR_TILE_LOOP
#undef SEQPAR_TILE_ZERO_3
#undef SEQPAR_TILE_ZERO_2
#undef SEQPAR_TILE_ZERO
#undef SEQPAR_TILE_STEP
#undef SEQPAR_TILE_LOADB_3
#undef SEQPAR_TILE_LOADB_2
#undef SEQPAR_TILE_ROW_3
#undef SEQPAR_TILE_ROW_2
#undef SEQPAR_TILE_FMA
#else
/// 0: flash_tile's k loop is C++ only at this level.
#define SEQPAR_ISA_TILE_ASM 0
#endif

/// Vectors of lanes in a query panel of the forward (ConvertedProducts): three for float where
/// the assembly tile runs (8 rows x 3 vectors: 24 accumulators, B's three vectors and the
/// broadcast in 28 of the 32 registers), else FlashTile's two. A wider panel loads each
/// broadcast K or V element once for 48 queries instead of 32 (11 loads per 24 FMAs instead
/// of 10 per 16): the float forward took 3.7% less time on a Xeon whose 8 x 2 forward ran at
/// 64-69% of its FMA peak, the same time on one where it ran at 80-83% (hand-runs.md).
template <class A>
inline constexpr int forward_vectors = SEQPAR_ISA_TILE_ASM && std::is_same_v<A, float> ? 3 : FlashTile<A>::nr;

/// C[M x NR vectors] = A B (Accumulate false), or C = C * alpha + A B (Accumulate true, alpha
/// one value per lane). A is read by broadcast at a[r * a_row + k * a_k] (so it can be K
/// rows, or V read column-wise, in the caller's strides); B row k is the contiguous panel at
/// b + k * ldb. The M x NR accumulators stay in registers for the whole k loop. NR is 2 (a
/// whole FlashTile panel), 3 (the float forward's panel on AVX-512, forward_vectors) or 1
/// (half of a FlashTile panel: the decode path's narrow query panels). AK, when not 0, is a_k
/// known at compile time (the caller passes the same value): the full float tile then runs
/// its k loop in assembly where the level has it (SEQPAR_ISA_TILE_ASM).
template <int M, bool Accumulate, int NR = FlashTile<float>::nr, std::ptrdiff_t AK = 0, class A>
inline void flash_tile(const A* a, std::ptrdiff_t a_row, std::ptrdiff_t a_k, const A* b, std::ptrdiff_t ldb,
                       std::int64_t kdim, A* c, std::ptrdiff_t ldc, const A* alpha) {
  using V = simd_t<A>;
  constexpr int W = FlashTile<A>::width;
  static_assert(NR >= 1 && NR <= 3, "flash_tile is written for one to three vectors of lanes");
#if SEQPAR_ISA_TILE_ASM
  if constexpr (std::is_same_v<A, float> && M == 8 && NR >= 2 && AK != 0) {
    tile_8xn_asm<Accumulate, NR, AK>(a, a_row, b, ldb, kdim, c, ldc, alpha);
    return;
  }
#endif
  // A known k stride is the one every tile reads, full or tail, assembly or not.
  if constexpr (AK != 0) a_k = AK;
  // Fold expressions over the row index keep every accumulator a named register value (a
  // loop over an array of them may go through the stack). The sets past NR are dead code.
  [&]<int... R>(std::integer_sequence<int, R...>) {
    V acc0[M] = {((void)R, V{})...}, acc1[M] = {((void)R, V{})...}, acc2[M] = {((void)R, V{})...};
    for (std::int64_t k = 0; k < kdim; ++k) {
      const A* ak = a + k * a_k;
      const A* bk = b + k * ldb;
      const V b0 = simd_load(bk);
      ((acc0[R] = simd_fma(simd_splat(ak[R * a_row]), b0, acc0[R])), ...);
      if constexpr (NR >= 2) {
        const V b1 = simd_load(bk + W);
        ((acc1[R] = simd_fma(simd_splat(ak[R * a_row]), b1, acc1[R])), ...);
      }
      if constexpr (NR == 3) {
        const V b2 = simd_load(bk + 2 * W);
        ((acc2[R] = simd_fma(simd_splat(ak[R * a_row]), b2, acc2[R])), ...);
      }
    }
    // Vector n of every row: stored, or added to C times alpha's vector n.
    auto out = [&](int n, const V* acc) {
      if constexpr (Accumulate) {
        const V al = simd_load(alpha + n * W);
        ((simd_store(c + R * ldc + n * W, simd_fma(simd_load(c + R * ldc + n * W), al, acc[R]))), ...);
      } else {
        ((simd_store(c + R * ldc + n * W, acc[R])), ...);
      }
    };
    out(0, acc0);
    if constexpr (NR >= 2) out(1, acc1);
    if constexpr (NR == 3) out(2, acc2);
  }(std::make_integer_sequence<int, M>{});
}

/// flash_tile over `rows` rows (NR vectors of lanes): full MR tiles, then one tail tile of rows % MR. Tile t's A
/// starts at a + t * a_tile: MR * a_row for A in plain rows, or the size of one packed tile.
/// Always inlined, so that each call's constant strides (a query panel's width, the scratch
/// rows') fold into the micro-kernel: left to itself, GCC 12 stops inlining it once the
/// forward or the backward passes its size limits, which costs them 2-4%.
template <bool Accumulate, int NR = FlashTile<float>::nr, std::ptrdiff_t AK = 0, class A>
[[gnu::always_inline]] inline void flash_tiles(std::int64_t rows, const A* a, std::ptrdiff_t a_row,
                                               std::ptrdiff_t a_k, std::ptrdiff_t a_tile, const A* b,
                                               std::ptrdiff_t ldb, std::int64_t kdim, A* c, std::ptrdiff_t ldc,
                                               const A* alpha) {
  constexpr int MR = FlashTile<A>::mr;
  std::int64_t r0 = 0;
  for (; r0 + MR <= rows; r0 += MR, a += a_tile)
    flash_tile<MR, Accumulate, NR, AK>(a, a_row, a_k, b, ldb, kdim, c + r0 * ldc, ldc, alpha);
  const int tail = static_cast<int>(rows - r0);
  if (tail == 0) return;
  c += r0 * ldc;
  [&]<int... T>(std::integer_sequence<int, T...>) {
    ((tail == T + 1 ? flash_tile<T + 1, Accumulate, NR>(a, a_row, a_k, b, ldb, kdim, c, ldc, alpha) : void()), ...);
  }(std::make_integer_sequence<int, MR - 1>{});
}

/// C[M x NR vectors] += A B over k in [0, kdim), adding at k only the lanes in [lo[k], hi[k])
/// (the others are left as they are, even where A is NaN: 0 x NaN would be NaN). A is packed
/// as flash_tile's with a_row = 1 (a[r + k * a_k]); B and C as flash_tile's.
template <int M, int NR, class A>
inline void flash_tile_masked(const A* a, std::ptrdiff_t a_k, const A* b, std::ptrdiff_t ldb, std::int64_t kdim,
                              A* c, std::ptrdiff_t ldc, const std::int64_t* lo, const std::int64_t* hi) {
  using V = simd_t<A>;
  constexpr int W = FlashTile<A>::width;
  V lane0{};
  for (int w = 0; w < W; ++w) lane0[w] = static_cast<A>(w);
  // Vector n of C one at a time: its accumulators stay in registers over the whole k loop.
  [&]<int... R>(std::integer_sequence<int, R...>) {
    for (int n = 0; n < NR; ++n) {
      const V lane = lane0 + simd_splat(static_cast<A>(n * W));
      V acc[M] = {simd_load(c + R * ldc + n * W)...};
      for (std::int64_t k = 0; k < kdim; ++k) {
        const A* ak = a + k * a_k;
        const V f = simd_splat(static_cast<A>(lo[k])), e = simd_splat(static_cast<A>(hi[k]));
        const auto m = (lane >= f) & (lane < e);
        const V bn = simd_load(b + k * ldb + n * W);
        ((acc[R] = m ? simd_fma(simd_splat(ak[R]), bn, acc[R]) : acc[R]), ...);
      }
      ((simd_store(c + R * ldc + n * W, acc[R])), ...);
    }
  }(std::make_integer_sequence<int, M>{});
}

/// flash_tile_masked over `rows` rows of A packed in tiles of MR (tile t at a + t * a_tile).
template <int NR, class A>
inline void flash_tiles_masked(std::int64_t rows, const A* a, std::ptrdiff_t a_k, std::ptrdiff_t a_tile, const A* b,
                               std::ptrdiff_t ldb, std::int64_t kdim, A* c, std::ptrdiff_t ldc, const std::int64_t* lo,
                               const std::int64_t* hi) {
  constexpr int MR = FlashTile<A>::mr;
  if (kdim == 0) return;
  std::int64_t r0 = 0;
  for (; r0 + MR <= rows; r0 += MR, a += a_tile)
    flash_tile_masked<MR, NR>(a, a_k, b, ldb, kdim, c + r0 * ldc, ldc, lo, hi);
  const int tail = static_cast<int>(rows - r0);
  c += r0 * ldc;
  [&]<int... T>(std::integer_sequence<int, T...>) {
    ((tail == T + 1 ? flash_tile_masked<T + 1, NR>(a, a_k, b, ldb, kdim, c, ldc, lo, hi) : void()), ...);
  }(std::make_integer_sequence<int, MR - 1>{});
}
