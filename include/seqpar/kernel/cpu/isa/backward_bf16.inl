// The backward's products for bf16 inputs on AVX512-BF16 (and, at the file's end, on AMX
// tiles, AmxBackward): included into the AVX-512 copy of
// kernels.inl only, under the same function-level target as forward_bf16.inl (whose
// dot_tiles and pairs it uses; why there is no include guard: kernel/cpu/isa_kernels.hpp).
// Needs backward.inl of the same namespace.
//
// vdpbf16ps sums a PAIR of bf16 products per float lane (forward_bf16.inl), so each of the
// five products takes its operands in pairs along its summed index:
//  - S = Q K^T and dP = dO V^T sum over head dims: Q and dO rows are pairs as they are, K^T
//    and V^T are packed as head-dim pairs x key lanes;
//  - dV += P^T dO and dK += dS^T Q sum over the tile's queries: P and dS are packed as query
//    pairs x key lanes, dO and Q as query pairs x head-dim lanes (an odd tile's last pair ends
//    in a zero row);
//  - dQ = dS K sums over keys: dS as rows of bf16 (pairs of keys), K as key pairs x head-dim
//    lanes.
// P and dS are rounded to bf16 on their way into the last three products, as FlashAttention-2
// rounds them to the input type on GPUs; S, dP, the probabilities and every gradient stay
// float. Against the converting path (exact products of the bf16 inputs), each gradient gains
// an error of about bf16's half ulp (2^-9) of its terms' size, which is more of its own size
// where the terms cancel (dS sums to about zero over a row): 1.3-3.3e-3 normwise on random
// inputs, where the converting path has about 1e-7.

/// The backward's operands and products for bf16 inputs by vdpbf16ps (see the file comment).
/// The pair layouts take the float path's scratch bytes (whose float operands this path does
/// not form): Q's bf16 rows, then its query pairs, in s.qs; dO's in s.dos; K^T's head-dim
/// pairs in s.kt, V^T's in s.vt; K's key pairs in s.ks; P's and dS's query pairs in place of S
/// and dP (s.pm, s.ds); dS's bf16 rows in s.dsr. Non-finite K rows and the dK / dV / dQ
/// accumulators are as ConvertedBackward's.
struct Bf16DotBackward {
  using S = BackwardScratch<float>;
  using Job = FlashBackward<bf16, float>;
  static constexpr std::int64_t PW = FlashTile<float>::panel, MR = FlashTile<float>::mr, lk = S::ld_keys();
  static constexpr std::int64_t W = Simd<float>::width;
  static_assert(PW == 2 * W && MR == 8 && lk % 2 == 0, "written for 512-bit vectors and 32 registers");
  const Job& job;  ///< the call
  const S& s;      ///< the thread's scratch
  std::int64_t b, kh;  ///< the task's batch element and K/V head
  std::int64_t dim = job.q.dim(), dim_v = job.v.dim();
  std::int64_t dp = S::padded(dim), ld = S::ld_dim(dim), dpv = S::padded(dim_v), ldv = S::ld_dim(dim_v);
  std::int64_t nbad = 0;  ///< keys of the block on s.bad
  std::int64_t j0 = 0;    ///< the block's first key

  /// Row `i` of bf16 rows `ld` elements apart in `base` (Q's or dO's), as pairs.
  static std::uint32_t* bf16_row(float* base, std::int64_t ld, std::int64_t i) {
    return reinterpret_cast<std::uint32_t*>(base) + i * (ld / 2);
  }
  /// Query pair row `qp` after the bf16 rows in `base` (Q's or dO's): word d holds head dim d of
  /// queries 2 qp and 2 qp + 1.
  static std::uint32_t* query_pairs(float* base, std::int64_t ld, std::int64_t qp) {
    return reinterpret_cast<std::uint32_t*>(base) + bwd_block_q * (ld / 2) + qp * ld;
  }
  /// `base` as pair words (K^T's, V^T's, K's, P's and dS's layouts).
  static std::uint32_t* words(float* base) { return reinterpret_cast<std::uint32_t*>(base); }

  /// Words [0, n) of `dst` as the pairs (r0[d], r1[d]) (a null row: zeros), zeros from n to
  /// `padded`.
  static void interleave(const bf16* r0, const bf16* r1, std::int64_t n, std::int64_t padded, std::uint32_t* dst) {
    std::int64_t d = 0;
    if (r0 && r1)
      for (; d + W <= n; d += W) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + d));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + d));
        // (maskz forms with every lane: GCC 12's plain ones warn of their own undefined source.)
        const __m512i pair = _mm512_or_si512(_mm512_maskz_cvtepu16_epi32(0xFFFF, lo),
                                             _mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, hi), 16));
        _mm512_storeu_si512(dst + d, pair);
      }
    for (; d < n; ++d) dst[d] = bf16_pair(r0 ? r0[d].bits : 0, r1 ? r1[d].bits : 0);
    std::fill(dst + n, dst + padded, 0u);
  }

  /// K^T and V^T as head-dim pairs x keys, and K as key pairs x head dims, of the `nk` keys
  /// from j0 (zero past them up to a whole panel). A K row holding a NaN or Inf goes into K's
  /// key pairs as zeros and onto the `bad` list (see ConvertedBackward::pack_block).
  void pack_block(std::int64_t first, std::int64_t nk) {
    j0 = first;
    const auto &k = job.k, &v = job.v;
    const std::int64_t kcols = (nk + PW - 1) / PW * PW;
    std::uint32_t *kt = words(s.kt), *vt = words(s.vt), *ks = words(s.ks);
    auto transpose = [&](const bf16* row, std::int64_t n, std::uint32_t* dst, std::int64_t j) {
      for (std::int64_t d = 0; d + 1 < n; d += 2) dst[d / 2 * lk + j] = row ? bf16_pair(row[d].bits, row[d + 1].bits) : 0;
      if (n % 2) dst[n / 2 * lk + j] = row ? bf16_pair(row[n - 1].bits, 0) : 0;
    };
    const bf16* rows[2] = {};
    for (std::int64_t j = 0; j < kcols; ++j) {
      const bool real = j < nk;
      const bf16* kr = real ? k.row(b, j0 + j, kh) : nullptr;
      transpose(kr, dim, kt, j);
      transpose(real ? v.row(b, j0 + j, kh) : nullptr, dim_v, vt, j);
      if (real && !finite_values(kr, dim)) {
        s.bad[nbad++] = j;
        kr = nullptr;
      }
      rows[j % 2] = kr;
      if (j % 2) interleave(rows[0], rows[1], dim, dp, ks + j / 2 * ld);
    }
  }

  /// Query row `i` of the tile from `q` and `dout` (null: zeros) as bf16 rows, zero to whole
  /// pairs.
  void pack_row(std::int64_t i, const bf16* q, const bf16* dout) const {
    // 32 values at a time, the last vector's lanes past n loaded as zeros, so that one store
    // also writes the zero padding (the rows have room for whole vectors: a panel of floats is
    // 64 bf16).
    auto copy = [](const bf16* src, std::int64_t n, std::uint32_t* dst) {
      for (std::int64_t d = 0; d < n; d += 32) {
        const __mmask32 lanes = n - d >= 32 ? ~__mmask32(0) : (__mmask32(1) << (n - d)) - 1;
        _mm512_storeu_si512(dst + d / 2, src ? _mm512_maskz_loadu_epi16(lanes, src + d) : _mm512_setzero_si512());
      }
    };
    copy(q, dim, bf16_row(s.qs, ld, i));
    copy(dout, dim_v, bf16_row(s.dos, ldv, i));
  }

  /// Q's and dO's query pairs from the tile's `nq` packed rows (an odd tile's last pair with
  /// a zero row).
  void rows_packed(std::int64_t nq) const {
    auto row = [](float* base, std::int64_t ld, std::int64_t i, std::int64_t nq) {
      return i < nq ? reinterpret_cast<const bf16*>(bf16_row(base, ld, i)) : nullptr;
    };
    for (std::int64_t qp = 0; qp < (nq + 1) / 2; ++qp) {
      interleave(row(s.qs, ld, 2 * qp, nq), row(s.qs, ld, 2 * qp + 1, nq), dim, dp, query_pairs(s.qs, ld, qp));
      interleave(row(s.dos, ldv, 2 * qp, nq), row(s.dos, ldv, 2 * qp + 1, nq), dim_v, dpv, query_pairs(s.dos, ldv, qp));
    }
  }

  /// P and dS of the tile's `nq` rows over key columns [c_lo, c_hi) from S (s.pm) and dP
  /// (s.ds), float (ProbabilityLanes::at: exactly 0 where the row does not see the key), rounded to
  /// bf16 into the query pairs of P and dS (in place: pair row qp overwrites float row qp,
  /// whose values went into pair row qp / 2 before, and whose lanes at these keys are loaded
  /// first when qp is 0) and dS's bf16 rows.
  template <bool Capped>
  [[gnu::always_inline]] void probabilities(std::int64_t nq, std::int64_t c_lo, std::int64_t c_hi) const {
    using V = simd_t<float>;
    const auto lanes = ProbabilityLanes<Capped, V>::make(static_cast<float>(job.p.scale), static_cast<float>(job.p.softcap));
    std::uint32_t *pp = words(s.pm), *dsp = words(s.ds);
    // One row's P and dS at keys c..c + W (zero for a row past the tile).
    auto row = [&](std::int64_t i, std::int64_t c, V& p, V& ds) {
      if (i >= nq) {
        p = ds = V{};
        return;
      }
      lanes.at(s.pm + i * lk + c, s.ds + i * lk + c, simd_splat(-s.lrow[i]), simd_splat(s.delta[i]), s.row_lo[i],
               s.row_hi[i], c, p, ds);
    };
    for (std::int64_t qp = 0; qp < (nq + 1) / 2; ++qp) {
      const std::int64_t i0 = 2 * qp, i1 = i0 + 1;
      for (std::int64_t c = c_lo; c < c_hi; c += W) {
        V p0, ds0, p1, ds1;
        row(i0, c, p0, ds0);
        row(i1, c, p1, ds1);
        _mm512_storeu_si512(pp + qp * lk + c, bf16_pairs(p0, p1));
        _mm512_storeu_si512(dsp + qp * lk + c, bf16_pairs(ds0, ds1));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.dsr + i0 * lk + c), (__m256i)_mm512_cvtneps_pbh(ds0));
        if (i1 < nq) _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.dsr + i1 * lk + c), (__m256i)_mm512_cvtneps_pbh(ds1));
      }
    }
  }

  /// The tile's products over the keys [kmin, kmax] some row sees but dQ's (as
  /// ConvertedBackward::products), on pairs.
  void products(std::int64_t nq, std::int64_t kmin, std::int64_t kmax) const {
    const std::int64_t nv = kmax + 1 - kmin, c_lo = kmin / PW * PW, c_hi = (kmax + PW) / PW * PW;
    const std::int64_t qpairs = (nq + 1) / 2;
    for (std::int64_t c0 = c_lo; c0 < c_hi; c0 += PW) {
      const std::int64_t r0 = first_row_reaching(s, nq, c0);
      dot_tiles<false>(nq - r0, bf16_row(s.qs, ld, r0), ld / 2, 1, MR * (ld / 2), words(s.kt) + c0, lk, (dim + 1) / 2,
                       s.pm + r0 * lk + c0, lk, nullptr, 1.0f);
      dot_tiles<false>(nq - r0, bf16_row(s.dos, ldv, r0), ldv / 2, 1, MR * (ldv / 2), words(s.vt) + c0, lk,
                       (dim_v + 1) / 2, s.ds + r0 * lk + c0, lk, nullptr, 1.0f);
    }
    if (job.p.softcap > 0)
      probabilities<true>(nq, c_lo, c_hi);
    else
      probabilities<false>(nq, c_lo, c_hi);
    for (std::int64_t c0 = 0; c0 < std::max(dp, dpv); c0 += PW) {
      if (c0 < dpv)
        dot_tiles<true>(nv, words(s.pm) + kmin, 1, lk, MR, query_pairs(s.dos, ldv, 0) + c0, ldv, qpairs,
                        s.dvs + kmin * ldv + c0, ldv, s.ones, 0.0f);
      if (c0 < dp)
        dot_tiles<true>(nv, words(s.ds) + kmin, 1, lk, MR, query_pairs(s.qs, ld, 0) + c0, ld, qpairs,
                        s.dks + kmin * ld + c0, ld, s.ones, 0.0f);
    }
  }

  /// The tile's dQ share of keys [kmin, kmax] (as ConvertedBackward::dq_share), on pairs of
  /// keys from the even key at or before kmin (dS is 0 at a key no row sees; a key block
  /// starts at an even key, so no pair straddles two).
  void dq_share(std::int64_t nq, std::int64_t kmin, std::int64_t kmax) const {
    const std::int64_t ke = kmin / 2 * 2, kpairs = (kmax + 2 - ke) / 2;
    const std::uint32_t* dsr = reinterpret_cast<const std::uint32_t*>(s.dsr) + ke / 2;
    for (std::int64_t c0 = 0; c0 < dp; c0 += PW)
      dot_tiles<false>(nq, dsr, lk / 2, 1, MR * (lk / 2), words(s.ks) + ke / 2 * ld + c0, ld, kpairs, s.dqs + c0, ld,
                       nullptr, 1.0f);
    add_bad_keys(nq, kmin, kmax);
  }

  /// The dQ terms of keys [kmin, kmax] whose K row is non-finite (left out of the pairs), from
  /// dS's bf16 rows.
  void add_bad_keys(std::int64_t nq, std::int64_t kmin, std::int64_t kmax) const {
    for (std::int64_t n = 0; n < nbad; ++n) {
      const std::int64_t j = s.bad[n];
      if (j < kmin || j > kmax) continue;
      const bf16* kr = job.k.row(b, j0 + j, kh);
      backward_add_bad_key(s, j, nq, dim, ld, [&](std::int64_t i) { return static_cast<float>(bf16::from_bits(s.dsr[i * lk + j])); },
                           [&](std::int64_t d) { return static_cast<float>(kr[d]); });
    }
  }
};

#if SEQPAR_CPU_ISA_AMX
/// Transposes the 16 x 16 matrix of 32-bit lanes whose row i is r[i], in place: 32-bit, then
/// 64-bit interleaves within 128-bit lanes, then two rounds of 128-bit lane shuffles.
inline void transpose_16x16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

/// C = A B (Accumulate false) or C += A B on AMX tiles, in AmxTiles' configuration: C is `rows`
/// x `cols` floats `ldc` apart (both multiples of 16), formed 32 x 32 at a time on the four
/// accumulator tiles; A is rows of bf16 `lda` bytes apart, B rows of pairs `ldb` bytes apart,
/// and the sum runs over `chunks` x 32 values (a chunk: A's next 64 bytes, B's next 16 pair
/// rows). Fenced on both sides (tile_memory_fence): its operands are written, and its results
/// read, by ordinary code.
template <bool Accumulate>
inline void amx_product(std::int64_t rows, std::int64_t cols, std::int64_t chunks, const void* a, std::ptrdiff_t lda,
                        const void* b, std::ptrdiff_t ldb, float* c, std::ptrdiff_t ldc) {
  const auto* ab = static_cast<const std::byte*>(a);
  const auto* bb = static_cast<const std::byte*>(b);
  const std::ptrdiff_t cb = ldc * static_cast<std::ptrdiff_t>(sizeof(float));
  tile_memory_fence();
  for (std::int64_t i0 = 0; i0 < rows; i0 += 32) {
    const bool two_rows = i0 + 16 < rows;
    for (std::int64_t j0 = 0; j0 < cols; j0 += 32) {
      const bool two_cols = j0 + 16 < cols;
      float* c0 = c + i0 * ldc + j0;
      float* c1 = c0 + 16 * ldc;
      if constexpr (Accumulate) {
        _tile_loadd(0, c0, cb);
        if (two_cols) _tile_loadd(1, c0 + 16, cb);
        if (two_rows) _tile_loadd(2, c1, cb);
        if (two_rows && two_cols) _tile_loadd(3, c1 + 16, cb);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (std::int64_t k = 0; k < chunks; ++k) {
        const std::byte* ak = ab + i0 * lda + k * 64;
        const std::byte* bk = bb + k * 16 * ldb + j0 * 4;
        _tile_loadd(4, ak, lda);
        _tile_loadd(6, bk, ldb);
        if (two_cols) _tile_loadd(7, bk + 64, ldb);
        if (two_rows) _tile_loadd(5, ak + 16 * lda, lda);
        _tile_dpbf16ps(0, 4, 6);
        if (two_cols) _tile_dpbf16ps(1, 4, 7);
        if (two_rows) _tile_dpbf16ps(2, 5, 6);
        if (two_rows && two_cols) _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c0, cb);
      if (two_cols) _tile_stored(1, c0 + 16, cb);
      if (two_rows) _tile_stored(2, c1, cb);
      if (two_rows && two_cols) _tile_stored(3, c1 + 16, cb);
    }
  }
  tile_memory_fence();
}

/// The backward's products for bf16 inputs on AMX tiles (TDPBF16PS: C[16 x 16 float] += A[16 x
/// 32 bf16] B[16 pairs x 16], A contiguous along the summed index, B in pairs along it), on
/// Bf16DotBackward's operands where their layout is one of the two:
///  - S = Q K^T and dP = dO V^T: Q's and dO's bf16 rows as A, K^T's and V^T's head-dim pairs
///    as B (one key panel at a time, from the first row that reaches it, in whole tiles);
///  - dV^T += dO^T P and dK^T += Q^T dS, head dims by keys: Q and dO transposed into s.qdt
///    (zero past the tile's queries) as A, P's and dS's query pairs as B (their pair rows zero
///    past the tile's). The transposed sums keep the tile's queries along the summed index,
///    where AMX wants them, instead of transposing P and dS (keys x queries, the larger);
///    dK^T and dV^T take the bytes of s.dks and s.dvs, and are added to dK and dV transposed
///    at the task's end;
///  - dQ = dS K: dS's bf16 rows as A, K's key pairs as B, 32 keys at a time from the panel
///    of the first key (dS is 0 at the keys no row sees).
/// P and dS are rounded to bf16 as on the AVX512-BF16 path, so the same tolerances hold. Head
/// dims must suit the tiles (amx_backward_fits); the tile configuration is the caller's
/// (CpuFlashKernel's backward_amx).
struct AmxBackward {
  using S = BackwardScratch<float>;
  using Job = FlashBackward<bf16, float>;
  static constexpr std::int64_t lk = S::ld_keys(), PW = FlashTile<float>::panel, TQ = bwd_tile_queries;
  Bf16DotBackward dot;  ///< the operands both paths share (bf16 rows, pairs, P and dS, bad keys)

  /// The products of task `kh` of batch element `b` of `job` on scratch `s`.
  AmxBackward(const Job& job, const S& s, std::int64_t b, std::int64_t kh) : dot{job, s, b, kh} {}

  /// See Bf16DotBackward::pack_block.
  void pack_block(std::int64_t j0, std::int64_t nk) { dot.pack_block(j0, nk); }
  /// See Bf16DotBackward::pack_row.
  void pack_row(std::int64_t i, const bf16* q, const bf16* dout) const { dot.pack_row(i, q, dout); }

  /// Q^T and dO^T of the tile's `nq` rows into s.qdt (row d: the queries' head dim d, as
  /// pairs of queries; zero past them), from the query pairs Bf16DotBackward forms.
  void rows_packed(std::int64_t nq) const {
    dot.rows_packed(nq);
    const S& s = dot.s;
    const std::int64_t qpairs = (nq + 1) / 2;
    auto* qdt = reinterpret_cast<std::uint32_t*>(s.qdt);
    auto transpose = [&](float* base, std::int64_t ld, std::int64_t dims, std::uint32_t* dst) {
      for (std::int64_t p0 = 0; p0 < TQ / 2; p0 += 16)
        for (std::int64_t d0 = 0; d0 < dims; d0 += 16) {
          __m512i r[16];
          for (int i = 0; i < 16; ++i)
            r[i] = p0 + i < qpairs ? _mm512_loadu_si512(Bf16DotBackward::query_pairs(base, ld, p0 + i) + d0)
                                   : _mm512_setzero_si512();
          transpose_16x16(r);
          for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (d0 + i) * (TQ / 2) + p0, r[i]);
        }
    };
    transpose(s.qs, dot.ld, dot.dim, qdt);
    transpose(s.dos, dot.ldv, dot.dim_v, qdt + dot.dim * (TQ / 2));
  }

  /// The tile's products over the keys [kmin, kmax] some row sees but dQ's (as
  /// ConvertedBackward::products; see the struct).
  void products(std::int64_t nq, std::int64_t kmin, std::int64_t kmax) const {
    const S& s = dot.s;
    const std::int64_t c_lo = kmin / PW * PW, c_hi = (kmax + PW) / PW * PW, rows = (nq + 15) / 16 * 16;
    for (std::int64_t c0 = c_lo; c0 < c_hi; c0 += PW) {
      const std::int64_t r0 = first_row_reaching(s, nq, c0) / 16 * 16;
      amx_product<false>(rows - r0, PW, dot.dim / 32, Bf16DotBackward::bf16_row(s.qs, dot.ld, r0), dot.ld * 2,
                         Bf16DotBackward::words(s.kt) + c0, lk * 4, s.pm + r0 * lk + c0, lk);
      amx_product<false>(rows - r0, PW, dot.dim_v / 32, Bf16DotBackward::bf16_row(s.dos, dot.ldv, r0), dot.ldv * 2,
                         Bf16DotBackward::words(s.vt) + c0, lk * 4, s.ds + r0 * lk + c0, lk);
    }
    if (dot.job.p.softcap > 0)
      dot.probabilities<true>(nq, c_lo, c_hi);
    else
      dot.probabilities<false>(nq, c_lo, c_hi);
    // P's and dS's pair rows past the tile's, up to whole tile products of queries: zero.
    for (std::int64_t qp = (nq + 1) / 2; qp < (nq + 31) / 32 * 16; ++qp) {
      std::fill(Bf16DotBackward::words(s.pm) + qp * lk + c_lo, Bf16DotBackward::words(s.pm) + qp * lk + c_hi, 0u);
      std::fill(Bf16DotBackward::words(s.ds) + qp * lk + c_lo, Bf16DotBackward::words(s.ds) + qp * lk + c_hi, 0u);
    }
    const std::int64_t k0 = kmin / 16 * 16, k1 = (kmax + 16) / 16 * 16, chunks = (nq + 31) / 32;
    const auto* qdt = reinterpret_cast<const std::uint32_t*>(s.qdt);
    amx_product<true>(dot.dim_v, k1 - k0, chunks, qdt + dot.dim * (TQ / 2), TQ * 2, Bf16DotBackward::words(s.pm) + k0,
                      lk * 4, s.dvs + k0, lk);
    amx_product<true>(dot.dim, k1 - k0, chunks, qdt, TQ * 2, Bf16DotBackward::words(s.ds) + k0, lk * 4, s.dks + k0, lk);
  }

  /// The tile's dQ share of keys [kmin, kmax] (as ConvertedBackward::dq_share), 32 keys at a
  /// time from the panel of kmin (within the keys `products` formed dS at).
  void dq_share(std::int64_t nq, std::int64_t kmin, std::int64_t kmax) const {
    const S& s = dot.s;
    const std::int64_t ke = kmin / PW * PW, kend = (kmax + PW) / PW * PW;
    amx_product<false>((nq + 15) / 16 * 16, dot.dim, (kend - ke) / 32, s.dsr + ke, lk * 2,
                       Bf16DotBackward::words(s.ks) + ke / 2 * dot.ld, dot.ld * 4, s.dqs, dot.ld);
    dot.add_bad_keys(nq, kmin, kmax);
  }

  /// dK^T and dV^T of the task's `nk` keys (in s.dks, s.dvs: head dims by key lanes, lk
  /// apart) zeroed over the key panels the products write.
  void clear_key_gradients(std::int64_t nk) const {
    const S& s = dot.s;
    const std::int64_t cols = (nk + PW - 1) / PW * PW;
    for (std::int64_t d = 0; d < dot.dim; ++d) std::fill(s.dks + d * lk, s.dks + d * lk + cols, 0.0f);
    for (std::int64_t d = 0; d < dot.dim_v; ++d) std::fill(s.dvs + d * lk, s.dvs + d * lk + cols, 0.0f);
  }

  /// Adds dK^T and dV^T of the task's `nk` keys to the call's dK and dV rows, 16 x 16 at a
  /// time transposed.
  void add_key_gradients(std::int64_t nk) const {
    const S& s = dot.s;
    auto add = [&](const float* src, std::int64_t dims, const TensorView<float>& dst) {
      for (std::int64_t j0 = 0; j0 < nk; j0 += 16)
        for (std::int64_t d0 = 0; d0 < dims; d0 += 16) {
          __m512i r[16];
          for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (d0 + i) * lk + j0);
          transpose_16x16(r);
          for (std::int64_t i = 0; i < 16 && j0 + i < nk; ++i) {
            float* row = dst.row(dot.b, dot.j0 + j0 + i, dot.kh) + d0;
            _mm512_storeu_ps(row, _mm512_add_ps(_mm512_loadu_ps(row), _mm512_castsi512_ps(r[i])));
          }
        }
    };
    add(s.dks, dot.dim, dot.job.dk);
    add(s.dvs, dot.dim_v, dot.job.dv);
  }
};
#endif
