// The backward's products for bf16 inputs on AVX512-BF16: included into the AVX-512 copy of
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

  /// Whether `n` bf16 values at `x` are all finite (an exponent of all ones is Inf or NaN).
  static bool finite(const bf16* x, std::int64_t n) {
    std::uint16_t bad = 0;
    for (std::int64_t d = 0; d < n; ++d) bad |= static_cast<std::uint16_t>((x[d].bits & 0x7f80) == 0x7f80);
    return bad == 0;
  }

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
      if (real && !finite(kr, dim)) {
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
    for (std::int64_t n = 0; n < nbad; ++n) {
      const std::int64_t j = s.bad[n];
      if (j < kmin || j > kmax) continue;
      const bf16* kr = job.k.row(b, j0 + j, kh);
      backward_add_bad_key(s, j, nq, dim, ld, [&](std::int64_t i) { return static_cast<float>(bf16::from_bits(s.dsr[i * lk + j])); },
                           [&](std::int64_t d) { return static_cast<float>(kr[d]); });
    }
  }
};
