// The forward's products for bf16 inputs on AVX512-BF16: included into the AVX-512 copy of
// kernels.inl only, under a function-level target that adds avx512bf16 (why there is no
// include guard: kernel/cpu/isa_kernels.hpp). Needs the SIMD layer and forward.inl of the
// same namespace.
//
// vdpbf16ps adds, per float lane, the products of a PAIR of bf16 values: acc += a0 b0 + a1 b1
// (each product is exact in float: two 8-bit significands). Both products therefore take
// their operands in pairs along the summed index, one 32-bit word per pair:
//  - S^T = K Q^T sums over head dims: K rows are pairs already (dims 2p, 2p+1 side by side),
//    Q^T is packed as dim pairs x query lanes; the softmax scale is applied to the float
//    scores in the micro-kernel's epilogue (scaling bf16 Q first would round it a second time);
//  - O^T += V^T P^T sums over keys: V is packed as key pairs x head dims, and the panel's P
//    (float, after the softmax) is rounded to bf16 in key pairs, as FlashAttention-2 rounds P
//    to the input type on GPUs: O's relative error grows by about bf16's half ulp (2^-9)
//    divided by the square root of the keys averaged, well below the output's own rounding.
// The scores, the online softmax, the statistics and O^T stay float. A key block whose V holds
// a NaN or Inf runs its P V through ConvertedProducts' masked float path instead, so that a
// key a row does not see never reaches it (0 x NaN would be NaN).

/// One 32-bit word holding the bf16 bits `lo` (low half) and `hi`: a vdpbf16ps pair.
inline std::uint32_t bf16_pair(std::uint16_t lo, std::uint16_t hi) {
  return static_cast<std::uint32_t>(lo) | static_cast<std::uint32_t>(hi) << 16;
}

/// The pair at `p` in every lane.
inline __m512bh pair_splat(const std::uint32_t* p) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(*p)); }

/// The 16 pairs at `p`.
inline __m512bh pair_load(const std::uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

/// flash_tile over pairs: C[M x 2 vectors] = scale (A B) (Accumulate false) or C = C * alpha +
/// A B (Accumulate true, alpha one value per lane), the k loop over `kpairs` pairs. A's pair
/// (r, k) is read by broadcast at a[r * a_row + k * a_k]; B's pair row k is the 32 pairs at
/// b + k * ldb (two vectors of 16 lanes).
template <int M, bool Accumulate>
inline void dot_tile(const std::uint32_t* a, std::ptrdiff_t a_row, std::ptrdiff_t a_k, const std::uint32_t* b,
                     std::ptrdiff_t ldb, std::int64_t kpairs, float* c, std::ptrdiff_t ldc, const float* alpha,
                     float scale) {
  using V = simd_t<float>;
  constexpr int W = Simd<float>::width;
  [&]<int... R>(std::integer_sequence<int, R...>) {
    V acc0[M] = {((void)R, V{})...}, acc1[M] = {((void)R, V{})...};
    for (std::int64_t k = 0; k < kpairs; ++k) {
      const std::uint32_t* ak = a + k * a_k;
      const __m512bh b0 = pair_load(b + k * ldb), b1 = pair_load(b + k * ldb + W);
      ((acc0[R] = _mm512_dpbf16_ps(acc0[R], pair_splat(ak + R * a_row), b0),
        acc1[R] = _mm512_dpbf16_ps(acc1[R], pair_splat(ak + R * a_row), b1)),
       ...);
    }
    if constexpr (Accumulate) {
      const V al0 = simd_load(alpha), al1 = simd_load(alpha + W);
      ((simd_store(c + R * ldc, simd_fma(simd_load(c + R * ldc), al0, acc0[R])),
        simd_store(c + R * ldc + W, simd_fma(simd_load(c + R * ldc + W), al1, acc1[R]))),
       ...);
    } else {
      const V sc = simd_splat(scale);
      ((simd_store(c + R * ldc, acc0[R] * sc), simd_store(c + R * ldc + W, acc1[R] * sc)), ...);
    }
  }(std::make_integer_sequence<int, M>{});
}

/// dot_tile over `rows` rows: full MR tiles, then one tail tile (as flash_tiles).
template <bool Accumulate>
[[gnu::always_inline]] inline void dot_tiles(std::int64_t rows, const std::uint32_t* a, std::ptrdiff_t a_row,
                                             std::ptrdiff_t a_k, std::ptrdiff_t a_tile, const std::uint32_t* b,
                                             std::ptrdiff_t ldb, std::int64_t kpairs, float* c, std::ptrdiff_t ldc,
                                             const float* alpha, float scale) {
  constexpr int MR = FlashTile<float>::mr;
  std::int64_t r0 = 0;
  for (; r0 + MR <= rows; r0 += MR, a += a_tile)
    dot_tile<MR, Accumulate>(a, a_row, a_k, b, ldb, kpairs, c + r0 * ldc, ldc, alpha, scale);
  const int tail = static_cast<int>(rows - r0);
  if (tail == 0) return;
  c += r0 * ldc;
  [&]<int... T>(std::integer_sequence<int, T...>) {
    ((tail == T + 1 ? dot_tile<T + 1, Accumulate>(a, a_row, a_k, b, ldb, kpairs, c, ldc, alpha, scale) : void()), ...);
  }(std::make_integer_sequence<int, MR - 1>{});
}

/// The forward's products for bf16 inputs by vdpbf16ps (see the file comment), for
/// forward_query_block. Q^T pairs take the scratch's qt bytes, K pairs kbuf's.
struct Bf16DotProducts {
  static constexpr int PW = FlashTile<float>::panel, MR = FlashTile<float>::mr;
  static_assert(PW == 2 * Simd<float>::width && MR == 8, "written for 512-bit vectors and 32 registers");
  ConvertedProducts<bf16, float> conv;  ///< the call's views and scratch; the path of non-finite V
  std::int64_t dp = (conv.dim + 1) / 2;  ///< head-dim pairs of Q and K (an odd dim's last pair ends in 0)
  /// Stride of the K pair rows: an odd number of 64-byte lines (see ForwardScratch::ld_keys).
  std::ptrdiff_t ldp = ((dp + 15) / 16 | 1) * 16;
  std::ptrdiff_t v_tile = 0;  ///< pairs of one packed V tile (MR x the block's key pairs)
  bool v_finite = true;       ///< the block's V holds no NaN or Inf

  /// Q^T as pairs (in the scratch's qt).
  std::uint32_t* qpairs() const { return reinterpret_cast<std::uint32_t*>(conv.s.qt); }
  /// The block's K pair rows (in the scratch's kbuf).
  std::uint32_t* kpairs() const { return reinterpret_cast<std::uint32_t*>(conv.s.kbuf); }

  /// Query column `i` as dim pairs x lanes (null `src`: a padding lane, zero), unscaled.
  void pack_query(std::int64_t i, const bf16* src) const {
    std::uint32_t* col = qpairs() + i / PW * (dp * PW) + i % PW;
    const std::int64_t dim = conv.dim;
    for (std::int64_t d = 0; d + 1 < dim; d += 2) col[d / 2 * PW] = src ? bf16_pair(src[d].bits, src[d + 1].bits) : 0;
    if (dim % 2) col[(dp - 1) * PW] = src ? bf16_pair(src[dim - 1].bits, 0) : 0;
  }

  /// K rows of the block copied as pair rows ldp apart, and V packed in key pairs: tile t
  /// holds, pair after pair of keys, the pairs of dims [t MR, t MR + MR) (a key past the block
  /// is 0). V's exponent bits are checked on the way; a V with NaN or Inf is also packed in
  /// float for ConvertedProducts.
  void pack_block(std::int64_t j0, std::int64_t nk) {
    constexpr std::int64_t ahead = 8;
    const auto& k = conv.k;
    const auto& v = conv.v;
    const std::int64_t dim = conv.dim, dim_v = conv.dim_v, b = conv.b, kh = conv.kh;
    for (std::int64_t j = 0; j < nk; ++j) {
      if (j + ahead < nk) prefetch_row(k.row(b, j0 + j + ahead, kh), dim, 3);
      std::uint32_t* dst = kpairs() + j * ldp;
      std::memcpy(dst, k.row(b, j0 + j, kh), static_cast<std::size_t>(dim) * sizeof(bf16));
      if (dim % 2) std::memset(reinterpret_cast<std::byte*>(dst) + dim * sizeof(bf16), 0, sizeof(bf16));
    }
    const std::int64_t pairs = (nk + 1) / 2, whole = dim_v / MR * MR;
    v_tile = MR * pairs;
    const __m128i exponent = _mm_set1_epi16(0x7f80);
    __m128i bad = _mm_setzero_si128();
    std::uint32_t bad_tail = 0;
    for (std::int64_t jp = 0; jp < pairs; ++jp) {
      const std::int64_t j = 2 * jp;
      if (j + ahead < nk) {
        prefetch_row(v.row(b, j0 + j + ahead, kh), dim_v, 3);
        if (j + ahead + 1 < nk) prefetch_row(v.row(b, j0 + j + ahead + 1, kh), dim_v, 3);
      }
      const bf16* r0 = v.row(b, j0 + j, kh);
      const bf16* r1 = j + 1 < nk ? v.row(b, j0 + j + 1, kh) : nullptr;
      std::uint32_t* dst = conv.s.vpairs + jp * MR;
      for (std::int64_t d0 = 0; d0 < whole; d0 += MR, dst += v_tile) {
        const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + d0));
        const __m128i x1 = r1 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(r1 + d0)) : _mm_setzero_si128();
        bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(x0, exponent), exponent));
        bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(x1, exponent), exponent));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_unpacklo_epi16(x0, x1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 4), _mm_unpackhi_epi16(x0, x1));
      }
      for (std::int64_t d = whole; d < dim_v; ++d) {
        const std::uint16_t lo = r0[d].bits, hi = r1 ? r1[d].bits : 0;
        bad_tail |= static_cast<std::uint32_t>((lo & 0x7f80) == 0x7f80) | static_cast<std::uint32_t>((hi & 0x7f80) == 0x7f80);
        dst[d - whole] = bf16_pair(lo, hi);
      }
    }
    v_finite = _mm_movemask_epi8(bad) == 0 && bad_tail == 0;
    if (!v_finite) conv.pack_values(j0, nk);
  }

  /// S^T = scale (K Q^T) of query panel `panel` over the `nkp` keys from key `off` of the block.
  void scores(std::int64_t panel, std::int64_t off, std::int64_t nkp, float* st) const {
    dot_tiles<false>(nkp, kpairs() + off * ldp, ldp, 1, MR * ldp, qpairs() + panel * (dp * PW), PW, dp, st, PW,
                     nullptr, conv.scale);
  }

  /// O^T = alpha O^T + V^T P^T of query panel `panel` over the `nkp` keys from key `off`, P^T
  /// (float) in `st` (see ConvertedProducts::add_values for the arguments). The pairs of P
  /// follow V's, which pair the block's keys from its first: a panel starting at an odd key
  /// leads with the previous key at weight 0 (its V is finite here), and a key past the panel
  /// weighs 0 too.
  void add_values(std::int64_t panel, std::int64_t off, std::int64_t nkp, std::int64_t f0, std::int64_t f1,
                  const float* st, const float* alpha, const std::int64_t* lane_lo, const std::int64_t* lane_hi) const {
    if (!v_finite) {
      conv.add_values(panel, off, nkp, f0, f1, st, alpha, lane_lo, lane_hi);
      return;
    }
    using V = simd_t<float>;
    constexpr int W = Simd<float>::width;
    // Lane 2i of the pair vector takes key r0's lane i, lane 2i + 1 key r1's (cvtne2ps puts r0
    // in the low 16 bf16, r1 in the high 16).
    static constexpr std::uint16_t interleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i idx = _mm512_loadu_si512(interleave);
    const std::int64_t lead = off & 1, pairs = (nkp + lead + 1) / 2;
    std::uint32_t* pp = conv.s.ppairs;
    for (std::int64_t jp = 0; jp < pairs; ++jp) {
      const std::int64_t r0 = 2 * jp - lead, r1 = r0 + 1;
      for (int h = 0; h < PW; h += W) {
        const V lo = r0 >= 0 ? simd_load(st + r0 * PW + h) : V{};
        const V hi = r1 < nkp ? simd_load(st + r1 * PW + h) : V{};
        const __m512i x = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        _mm512_storeu_si512(pp + jp * PW + h, _mm512_permutexvar_epi16(idx, x));
      }
    }
    dot_tiles<true>(conv.dim_v, conv.s.vpairs + (off - lead) / 2 * MR, 1, MR, v_tile, pp, PW, pairs,
                    conv.s.ot + panel * (conv.dim_v * PW), PW, alpha, 0.0f);
  }
};
