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

/// The lanes of `first` and `second` rounded to bf16 and paired lane by lane: word w holds
/// (first[w], second[w]), first in the low half.
inline __m512i bf16_pairs(simd_t<float> first, simd_t<float> second) {
  // cvtne2ps puts its second operand in the low 16 bf16 and its first in the high 16; the
  // permutation takes lane w of each into lanes 2w and 2w + 1.
  static constexpr std::uint16_t interleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_loadu_si512(interleave), (__m512i)_mm512_cvtne2ps_pbh(second, first));
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
  /// The call's views and scratch, and the path of non-finite V (on this path's panels).
  ConvertedProducts<bf16, float, FlashTile<float>::nr> conv;
  std::int64_t dp = (conv.dim + 1) / 2;  ///< head-dim pairs of Q and K (an odd dim's last pair ends in 0)
  /// Stride of the K pair rows (ForwardScratch::ld_pairs).
  std::ptrdiff_t ldp = ForwardScratch<float>::ld_pairs(conv.dim);
  std::ptrdiff_t v_tile = 0;  ///< pairs of one packed V tile (MR x the block's key pairs)
  bool v_finite = true;       ///< the block's V holds no NaN or Inf

  /// Q^T as pairs (in the scratch's qt).
  std::uint32_t* qpairs() const { return reinterpret_cast<std::uint32_t*>(conv.s.qt); }
  /// The block's K pair rows (in the scratch's kbuf).
  std::uint32_t* kpairs() const { return reinterpret_cast<std::uint32_t*>(conv.s.kbuf); }

  /// Query columns pack in groups of this many (forward_query_block).
  static constexpr int query_group = Simd<float>::width;

  /// Query columns [i, i + query_group) as dim pairs x lanes (i a multiple of query_group),
  /// unscaled, from the rows at `src` (null: a padding lane, zero).
  void pack_queries(std::int64_t i, const bf16* const* src) const {
    using Pairs = Simd<float>::itype;  // 32-bit lanes: a pair each
    const std::int64_t dim = conv.dim;
    std::uint32_t* col = qpairs() + i / PW * (dp * PW) + i % PW;
    auto load = [&](int r, std::int64_t p) {
      Pairs x{};
      if (src[r]) std::memcpy(&x, src[r] + 2 * p, sizeof x);
      return x;
    };
    // Pair p of row r; an odd dim's last pair ends in 0.
    auto one = [&](int r, std::int64_t p) -> std::uint32_t {
      if (!src[r]) return 0;
      return bf16_pair(src[r][2 * p].bits, 2 * p + 1 < dim ? src[r][2 * p + 1].bits : std::uint16_t{0});
    };
    auto store = [&](int k, std::int64_t p, Pairs x) { std::memcpy(col + (p + k) * PW, &x, sizeof x); };
    for (std::int64_t p = transpose_blocks<Pairs>(dim / 2, load, store); p < dp; ++p)
      for (int r = 0; r < query_group; ++r) col[p * PW + r] = one(r, p);
  }

  /// K rows of the block copied as pair rows ldp apart, and V packed in key pairs: tile t
  /// holds, pair after pair of keys, the pairs of dims [t MR, t MR + MR) (a key past the block
  /// is 0). V's exponent bits are checked on the way; a V with NaN or Inf is also packed in
  /// float for ConvertedProducts.
  void pack_block(std::int64_t j0, std::int64_t nk) {
    pack_keys(j0, nk);
    pack_values(j0, nk);
  }

  /// The block's K rows as pair rows ldp apart (an odd dim's last pair ends in 0).
  void pack_keys(std::int64_t j0, std::int64_t nk) const {
    constexpr std::int64_t ahead = 8;
    const auto& k = conv.k;
    const std::int64_t dim = conv.dim, b = conv.b, kh = conv.kh;
    for (std::int64_t j = 0; j < nk; ++j) {
      if (j + ahead < nk) prefetch_row(k.row(b, j0 + j + ahead, kh), dim, 3);
      std::uint32_t* dst = kpairs() + j * ldp;
      std::memcpy(dst, k.row(b, j0 + j, kh), static_cast<std::size_t>(dim) * sizeof(bf16));
      if (dim % 2) std::memset(reinterpret_cast<std::byte*>(dst) + dim * sizeof(bf16), 0, sizeof(bf16));
    }
  }

  /// V in key pairs (see pack_block), its finiteness checked on the way.
  void pack_values(std::int64_t j0, std::int64_t nk) {
    constexpr std::int64_t ahead = 8;
    const auto& v = conv.v;
    const std::int64_t dim_v = conv.dim_v, b = conv.b, kh = conv.kh;
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
    const std::int64_t lead = off & 1, pairs = pack_p(off, nkp, st, 1);
    dot_tiles<true>(conv.dim_v, conv.s.vpairs + (off - lead) / 2 * MR, 1, MR, v_tile, conv.s.ppairs, PW, pairs,
                    conv.s.ot + panel * (conv.dim_v * PW), PW, alpha, 0.0f);
  }

  /// The panel's P^T (float, `nkp` keys from key `off` of the block, in `st`) rounded to bf16
  /// in key pairs into the scratch's ppairs: pair row jp holds keys off - lead + 2 jp and the
  /// next (lead = off & 1, so that pairs start at an even key of the block, as V's do), a key
  /// outside [0, nkp) at weight 0; rows zero up to a whole number of `rows_to` rows. Returns
  /// the pairs.
  std::int64_t pack_p(std::int64_t off, std::int64_t nkp, const float* st, std::int64_t rows_to) const {
    using V = simd_t<float>;
    constexpr int W = Simd<float>::width;
    const std::int64_t lead = off & 1, pairs = (nkp + lead + 1) / 2;
    std::uint32_t* pp = conv.s.ppairs;
    for (std::int64_t jp = 0; jp < pairs; ++jp) {
      const std::int64_t r0 = 2 * jp - lead, r1 = r0 + 1;
      for (int h = 0; h < PW; h += W) {
        const V lo = r0 >= 0 ? simd_load(st + r0 * PW + h) : V{};
        const V hi = r1 < nkp ? simd_load(st + r1 * PW + h) : V{};
        _mm512_storeu_si512(pp + jp * PW + h, bf16_pairs(lo, hi));
      }
    }
    const std::int64_t padded = (pairs + rows_to - 1) / rows_to * rows_to;
    std::fill(pp + pairs * PW, pp + padded * PW, 0u);
    return pairs;
  }
};

#if SEQPAR_CPU_ISA_AMX
/// Orders memory for the tile instructions. GCC 12 writes its tile intrinsics as volatile asm
/// that names no memory (tileloadd, tilestored, tdpbf16ps), and ldtilecfg and tilerelease as
/// builtins: volatile asm keeps its order among itself, but the optimiser may move ordinary
/// loads and stores across it, and builtins across it (a tile instruction moved before the
/// configuration raised SIGILL at -O2). A volatile asm that clobbers memory orders both, so
/// one goes between code that writes a buffer and the tiles that load it, and between the
/// tiles' stores and code that reads them.
inline void tile_memory_fence() { asm volatile("" ::: "memory"); }

/// This thread's AMX tile configuration for AmxProducts, loaded on construction and released
/// on destruction (the tile state is per thread; a released thread saves none of it on a
/// context switch). Eight tiles of 16 rows x 64 bytes, for both products: four accumulators
/// (0-3: two row blocks x two halves of a query panel), two A tiles (4, 5: the two row blocks'
/// K rows or V^T rows) and two B tiles (6, 7: the panel's halves of Q^T or P^T pairs). Two row
/// blocks at once give four independent accumulator chains (a tile product's latency is
/// several times its issue interval) and load each B tile once per two A tiles.
struct AmxTiles {
  AmxTiles() {
    alignas(64) std::uint8_t config[64] = {};
    config[0] = 1;  // palette 1
    for (int t = 0; t < 8; ++t) {
      config[16 + 2 * t] = 64;  // bytes per row (a little-endian 16-bit field)
      config[48 + t] = 16;      // rows
    }
    _tile_loadconfig(config);
    tile_memory_fence();
  }
  ~AmxTiles() {
    tile_memory_fence();
    _tile_release();
  }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};

/// The forward's products for bf16 inputs on AMX tiles (TDPBF16PS: C[16 x 16 float] += A[16 x
/// 32 bf16] B[16 pairs x 16], B in pairs along the summed index, as Bf16DotProducts packs
/// them). S^T = K Q^T takes K's pair rows as A and the Q^T pair panel as B, 16 keys by 32
/// head dims at a time, and the scale on the stored scores; O^T = alpha O^T + V^T P^T takes V
/// transposed (head dims by keys, in bf16) as A and the P^T pairs as B, 16 head dims by 32 keys
/// at a time, after O^T's rows are scaled by alpha. Head dims must be whole tiles (amx_fits): the
/// kernel takes another path otherwise. A key block whose V holds a NaN or Inf runs its P V
/// through ConvertedProducts' masked float path, as Bf16DotProducts does.
struct AmxProducts {
  static constexpr int PW = FlashTile<float>::panel;
  Bf16DotProducts dot;  ///< Q^T and K pairs, P^T pairs, and the float path of non-finite V
  bool v_finite = true;  ///< the block's V holds no NaN or Inf

  /// See Bf16DotProducts.
  static constexpr int query_group = Bf16DotProducts::query_group;
  /// See Bf16DotProducts::pack_queries.
  void pack_queries(std::int64_t i, const bf16* const* src) const { dot.pack_queries(i, src); }

  /// K's pair rows, and V^T: row d holds the block's keys' head dim d, then zeros to a whole
  /// tile past them; V's exponent bits checked on the way (and V packed in float for the
  /// masked path when it holds a NaN or Inf).
  void pack_block(std::int64_t j0, std::int64_t nk) {
    dot.pack_keys(j0, nk);
    const auto& v = dot.conv.v;
    const std::int64_t dim_v = dot.conv.dim_v, b = dot.conv.b, kh = dot.conv.kh;
    constexpr std::int64_t ld = ForwardScratch<float>::vt_keys;
    std::uint16_t* vt = dot.conv.s.vtrans;
    // 32 keys by 16 head dims at a time: the 16 key pairs' rows of pairs (row jp: dims d0..d0+15,
    // each the pair (V[2 jp][d], V[2 jp + 1][d]), a key past the block 0), then transposed by
    // gathers into V^T's rows (row d: its 16 pairs = 32 keys).
    alignas(64) std::uint32_t m[16 * 16];
    const __m512i exponent = _mm512_set1_epi32(0x7f807f80), column = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
    __mmask32 bad = 0;
    const std::int64_t whole = (nk + 31) / 32 * 32;
    for (std::int64_t k0 = 0; k0 < whole; k0 += 32)
      for (std::int64_t d0 = 0; d0 < dim_v; d0 += 16) {
        for (int jp = 0; jp < 16; ++jp) {
          const std::int64_t j = k0 + 2 * jp;
          const __m256i lo = j < nk ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v.row(b, j0 + j, kh) + d0))
                                    : _mm256_setzero_si256();
          const __m256i hi = j + 1 < nk
                                 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v.row(b, j0 + j + 1, kh) + d0))
                                 : _mm256_setzero_si256();
          // (maskz forms with every lane: GCC 12's plain ones warn of their own undefined source.)
          const __m512i pair = _mm512_or_si512(_mm512_maskz_cvtepu16_epi32(0xFFFF, lo),
                                               _mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, hi), 16));
          bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(pair, exponent), exponent);
          _mm512_store_si512(m + jp * 16, pair);
        }
        for (int d = 0; d < 16; ++d)
          _mm512_storeu_si512(vt + (d0 + d) * ld + k0,
                              _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), 0xFFFF,
                                                          _mm512_add_epi32(column, _mm512_set1_epi32(d)), m, 4));
      }
    for (std::int64_t d = 0; d < dim_v; ++d) std::fill(vt + d * ld + whole, vt + d * ld + std::min(ld, nk + 32), 0);
    v_finite = bad == 0;
    if (!v_finite) dot.conv.pack_values(j0, nk);
  }

  /// S^T = scale (K Q^T) of query panel `panel` over the `nkp` keys from key `off` (rows past
  /// nkp, up to a whole tile, are formed too and never read).
  void scores(std::int64_t panel, std::int64_t off, std::int64_t nkp, float* st) const {
    const std::ptrdiff_t ldp = dot.ldp;
    const std::uint32_t* kp = dot.kpairs() + off * ldp;
    const std::uint32_t* qp = dot.qpairs() + panel * (dot.dp * PW);
    tile_memory_fence();  // the pair rows are written
    // Rows in blocks of 32 keys (two tiles; past nkp they are formed and never read: nkp <=
    // fwd_block_k, a multiple of 32, so they stay inside st and kbuf's rows).
    for (std::int64_t r0 = 0; r0 < nkp; r0 += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (std::int64_t kc = 0; kc < dot.dp; kc += 16) {
        _tile_loadd(6, qp + kc * PW, PW * 4);
        _tile_loadd(7, qp + kc * PW + 16, PW * 4);
        _tile_loadd(4, kp + r0 * ldp + kc, ldp * 4);
        _tile_loadd(5, kp + (r0 + 16) * ldp + kc, ldp * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, st + r0 * PW, PW * 4);
      _tile_stored(1, st + r0 * PW + 16, PW * 4);
      _tile_stored(2, st + (r0 + 16) * PW, PW * 4);
      _tile_stored(3, st + (r0 + 16) * PW + 16, PW * 4);
    }
    tile_memory_fence();  // the scores are stored
    using V = simd_t<float>;
    const V sc = simd_splat(dot.conv.scale);
    for (std::int64_t i = 0; i < nkp * PW; i += Simd<float>::width) simd_store(st + i, simd_load(st + i) * sc);
  }

  /// O^T = alpha O^T + V^T P^T of query panel `panel` (see ConvertedProducts::add_values).
  void add_values(std::int64_t panel, std::int64_t off, std::int64_t nkp, std::int64_t f0, std::int64_t f1,
                  const float* st, const float* alpha, const std::int64_t* lane_lo, const std::int64_t* lane_hi) const {
    if (!v_finite) {
      dot.conv.add_values(panel, off, nkp, f0, f1, st, alpha, lane_lo, lane_hi);
      return;
    }
    using V = simd_t<float>;
    constexpr int W = Simd<float>::width;
    constexpr std::int64_t ld = ForwardScratch<float>::vt_keys;
    const std::int64_t dim_v = dot.conv.dim_v, lead = off & 1;
    const std::int64_t chunks = (dot.pack_p(off, nkp, st, 16) + 15) / 16;
    float* const ot = dot.conv.s.ot + panel * (dim_v * PW);
    const V a0 = simd_load(alpha), a1 = simd_load(alpha + W);
    for (std::int64_t d = 0; d < dim_v; ++d) {
      simd_store(ot + d * PW, simd_load(ot + d * PW) * a0);
      simd_store(ot + d * PW + W, simd_load(ot + d * PW + W) * a1);
    }
    const std::uint16_t* vt = dot.conv.s.vtrans + (off - lead);
    const std::uint32_t* pp = dot.conv.s.ppairs;
    tile_memory_fence();  // P^T's pairs and the rescaled O^T are written
    // Head dims in blocks of 32 (two tiles); a last block of 16 alone.
    std::int64_t m0 = 0;
    for (; m0 + 32 <= dim_v; m0 += 32) {
      _tile_loadd(0, ot + m0 * PW, PW * 4);
      _tile_loadd(1, ot + m0 * PW + 16, PW * 4);
      _tile_loadd(2, ot + (m0 + 16) * PW, PW * 4);
      _tile_loadd(3, ot + (m0 + 16) * PW + 16, PW * 4);
      for (std::int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(6, pp + c * 16 * PW, PW * 4);
        _tile_loadd(7, pp + c * 16 * PW + 16, PW * 4);
        _tile_loadd(4, vt + m0 * ld + c * 32, ld * 2);
        _tile_loadd(5, vt + (m0 + 16) * ld + c * 32, ld * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, ot + m0 * PW, PW * 4);
      _tile_stored(1, ot + m0 * PW + 16, PW * 4);
      _tile_stored(2, ot + (m0 + 16) * PW, PW * 4);
      _tile_stored(3, ot + (m0 + 16) * PW + 16, PW * 4);
    }
    if (m0 < dim_v) {
      _tile_loadd(0, ot + m0 * PW, PW * 4);
      _tile_loadd(1, ot + m0 * PW + 16, PW * 4);
      for (std::int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(6, pp + c * 16 * PW, PW * 4);
        _tile_loadd(7, pp + c * 16 * PW + 16, PW * 4);
        _tile_loadd(4, vt + m0 * ld + c * 32, ld * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      _tile_stored(0, ot + m0 * PW, PW * 4);
      _tile_stored(1, ot + m0 * PW + 16, PW * 4);
    }
    tile_memory_fence();  // O^T is stored
  }
};
#endif
