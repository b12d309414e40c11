// CpuFlashKernel's decode path for ONE instruction set: one (batch element, slab of K/V
// heads, key chunk) task of kernel/cpu/flash_decode.hpp (which explains the layout; why this
// file has no include guard, in kernel/cpu/isa_kernels.hpp). Needs the SIMD layer
// (cpu_isa_simd.inl) and the forward's panel helpers (cpu_isa_forward.inl) of the same
// namespace.

/// Most rows of one K/V head that compute their scores as dot products (head dims in the
/// lanes, decode_scores); more rows fill the lanes of a query panel (S^T = K Q^T) instead,
/// which needs no horizontal sums. Measured with K/V in cache (8 heads of 128 dims, AVX-512):
/// 4 rows 52 against 70 ns per (key, head), 8 rows 79 against 67.
inline constexpr std::int64_t decode_dot_rows = 4;

/// One vector holding the lane sums of W vectors: lane i = sum of v[i]'s lanes. A transposing
/// tree of adds, log2(W) levels, so that W dot products cost W - 1 combines instead of W
/// separate horizontal sums; each input goes in at the slot (i with bits 0,1 and 2,3 swapped)
/// where the shuffles leave its sum at lane i.
template <class A>
[[gnu::always_inline]] inline simd_t<A> reduce_lanes(const simd_t<A>* v) {
  using V = simd_t<A>;
  constexpr int W = Simd<A>::width;
#if SEQPAR_ISA_BYTES == 64 || SEQPAR_ISA_BYTES == 32 || (SEQPAR_ISA_BYTES == 16 && defined(__SSE__))
  if constexpr (std::is_same_v<A, float>) {
    const auto slot = [](int i) { return ((i & 1) << 1) | ((i >> 1) & 1) | (W == 16 ? ((i & 4) << 1) | ((i >> 1) & 4) : i & 4); };
#if SEQPAR_ISA_BYTES == 64
    // (maskz with every lane: GCC 12's plain shuffle_f32x4 warns of its own undefined source.)
    V c[8], e[4];
    SEQPAR_UNROLL(8)
    for (int i = 0; i < 8; ++i) {
      const V a = v[slot(i)], b = v[slot(i + 8)];
      c[i] = _mm512_maskz_shuffle_f32x4(0xFFFF, a, b, 0x44) + _mm512_maskz_shuffle_f32x4(0xFFFF, a, b, 0xEE);
    }
    SEQPAR_UNROLL(4)
    for (int i = 0; i < 4; ++i) e[i] = _mm512_maskz_shuffle_f32x4(0xFFFF, c[i], c[i + 4], 0x88) + _mm512_maskz_shuffle_f32x4(0xFFFF, c[i], c[i + 4], 0xDD);
    const V g0 = _mm512_shuffle_ps(e[0], e[2], 0x44) + _mm512_shuffle_ps(e[0], e[2], 0xEE);
    const V g1 = _mm512_shuffle_ps(e[1], e[3], 0x44) + _mm512_shuffle_ps(e[1], e[3], 0xEE);
    return _mm512_shuffle_ps(g0, g1, 0x88) + _mm512_shuffle_ps(g0, g1, 0xDD);
#elif SEQPAR_ISA_BYTES == 32
    V c[4];
    for (int i = 0; i < 4; ++i) {
      const V a = v[slot(i)], b = v[slot(i + 4)];
      c[i] = _mm256_permute2f128_ps(a, b, 0x20) + _mm256_permute2f128_ps(a, b, 0x31);
    }
    const V g0 = _mm256_shuffle_ps(c[0], c[2], 0x44) + _mm256_shuffle_ps(c[0], c[2], 0xEE);
    const V g1 = _mm256_shuffle_ps(c[1], c[3], 0x44) + _mm256_shuffle_ps(c[1], c[3], 0xEE);
    return _mm256_shuffle_ps(g0, g1, 0x88) + _mm256_shuffle_ps(g0, g1, 0xDD);
#else
    const V a0 = v[slot(0)], b0 = v[slot(2)], a1 = v[slot(1)], b1 = v[slot(3)];
    const V g0 = _mm_shuffle_ps(a0, b0, 0x44) + _mm_shuffle_ps(a0, b0, 0xEE);
    const V g1 = _mm_shuffle_ps(a1, b1, 0x44) + _mm_shuffle_ps(a1, b1, 0xEE);
    return _mm_shuffle_ps(g0, g1, 0x88) + _mm_shuffle_ps(g0, g1, 0xDD);
#endif
  }
#endif
  V r{};
  for (int i = 0; i < W; ++i) {
    A t = 0;
    for (int w = 0; w < W; ++w) t += v[i][w];
    r[i] = t;
  }
  return r;
}

/// e^x of one value, as exp_lanes computes each lane (so that a row's vector part and its
/// tail agree).
template <class A>
inline A exp_one(A x) {
  if constexpr (std::is_same_v<A, float>) return fast_exp2_lanes(x * 1.44269504088896341f);
  else return std::exp(x);
}

/// S[r][j] = Q[r] . K[j] for `rows` rows of Q (row-major, `dim` apart, scaled) and `keys` K
/// rows `ldk` apart, into S rows `lds` apart: head dims in the lanes, so a few rows waste no
/// lane. Tiles of RB rows x KB keys (RB KB = W accumulators) read each K and Q vector once
/// per tile and end in one reduce_lanes; a head-dim tail (dim % W) is added one product at a
/// time, since loading a whole vector there would read past the row (the next head's K, or a
/// hidden NaN). A partial tile repeats its last row or key and stores only the real ones.
template <class A>
[[gnu::always_inline]] inline void decode_scores(const A* q, std::int64_t rows, const A* k, std::ptrdiff_t ldk,
                                                 std::int64_t keys, std::int64_t dim, A* s, std::ptrdiff_t lds) {
  using V = simd_t<A>;
  constexpr int W = Simd<A>::width, RB = W < 4 ? W : 4, KB = W / RB;
  const std::int64_t dw = dim / W * W;
  for (std::int64_t r0 = 0; r0 < rows; r0 += RB) {
    const A* qr[RB];
    SEQPAR_UNROLL(16)
    for (int rr = 0; rr < RB; ++rr) qr[rr] = q + std::min<std::int64_t>(r0 + rr, rows - 1) * dim;
    for (std::int64_t j0 = 0; j0 < keys; j0 += KB) {
      const A* kr[KB];
      SEQPAR_UNROLL(16)
      for (int kk = 0; kk < KB; ++kk) kr[kk] = k + std::min<std::int64_t>(j0 + kk, keys - 1) * ldk;
      V acc[W] = {};  // lane-sum i = row i / KB, key i % KB
      for (std::int64_t d = 0; d < dw; d += W) {
        V kv[KB];
        SEQPAR_UNROLL(16)
        for (int kk = 0; kk < KB; ++kk) kv[kk] = simd_load(kr[kk] + d);
        SEQPAR_UNROLL(16)
        for (int rr = 0; rr < RB; ++rr) {
          const V qv = simd_load(qr[rr] + d);
          SEQPAR_UNROLL(16)
          for (int kk = 0; kk < KB; ++kk) acc[rr * KB + kk] = simd_fma(kv[kk], qv, acc[rr * KB + kk]);
        }
      }
      const V sum = reduce_lanes<A>(acc);
      for (int rr = 0; rr < RB && r0 + rr < rows; ++rr)
        for (int kk = 0; kk < KB && j0 + kk < keys; ++kk) {
          A x = sum[rr * KB + kk];
          for (std::int64_t d = dw; d < dim; ++d) x += qr[rr][d] * kr[kk][d];
          s[(r0 + rr) * lds + j0 + kk] = x;
        }
    }
  }
}

/// The online-softmax step of one row whose scores lie in a row of S (keys along it): P =
/// exp(S - m') in place over the row's keys [a0, a1), its running max `m` and sum `l`
/// updated; returns alpha = exp(m - m'), the factor of its output. Keys outside [a0, a1) are
/// neither read nor written (the callers never read their P). The same conventions as
/// softmax_panel: a NaN score keeps the max and reaches the row; a row that has seen only
/// hidden keys shifts by 0.
template <class A>
[[gnu::always_inline]] inline A softmax_row(A* s, std::int64_t a0, std::int64_t a1, A& m, A& l) {
  using V = simd_t<A>;
  constexpr int W = Simd<A>::width;
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  V mv = simd_splat(m);
  std::int64_t j = a0;
  for (; j + W <= a1; j += W) mv = simd_max(simd_load(s + j), mv);
  A mx = m;
  for (int w = 0; w < W; ++w) mx = mv[w] > mx ? mv[w] : mx;
  for (; j < a1; ++j) mx = s[j] > mx ? s[j] : mx;
  const A shift = mx == neg_inf ? A(0) : mx;
  V sv{};
  for (j = a0; j + W <= a1; j += W) {
    const V e = exp_lanes(simd_load(s + j) - simd_splat(shift));
    simd_store(s + j, e);
    sv += e;
  }
  A sum = 0;
  for (; j < a1; ++j) sum += s[j] = exp_one(s[j] - shift);
  for (int w = 0; w < W; ++w) sum += sv[w];
  const A alpha = m == mx ? A(1) : exp_one(m - shift);  // as softmax_panel: a max that did not move
  l = alpha * l + sum;
  m = mx;
  return alpha;
}

/// O[r] += sum over `keys` keys of P[r][key] V[key] for `rows` rows: row r's weight of key j
/// at p[r * p_row + j * p_key] (P^T panels and P rows alike), V the caller's rows `ldv`
/// apart, O rows `ldo` apart. Head dims are the lanes: two vectors at a time, then one, then
/// one at a time.
template <class A>
[[gnu::always_inline]] inline void decode_add_pv(std::int64_t rows, const A* p, std::ptrdiff_t p_row,
                                                 std::ptrdiff_t p_key, const A* v, std::ptrdiff_t ldv,
                                                 std::int64_t keys, std::int64_t dim, A* o, std::ptrdiff_t ldo,
                                                 const A* ones) {
  constexpr int W = FlashTile<A>::width, MR = FlashTile<A>::mr;
  if (keys <= 0 || rows <= 0) return;
  std::int64_t d0 = 0;
  for (; d0 + 2 * W <= dim; d0 += 2 * W)
    flash_tiles<true, 2>(rows, p, p_row, p_key, MR * p_row, v + d0, ldv, keys, o + d0, ldo, ones);
  if (d0 + W <= dim) {
    flash_tiles<true, 1>(rows, p, p_row, p_key, MR * p_row, v + d0, ldv, keys, o + d0, ldo, ones);
    d0 += W;
  }
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t d = d0; d < dim; ++d) {
      A acc = o[r * ldo + d];
      for (std::int64_t j = 0; j < keys; ++j) acc += p[r * p_row + j * p_key] * v[j * ldv + d];
      o[r * ldo + d] = acc;
    }
}

/// O = alpha O + P V for the `np` rows of one block (keys [0, nkp) from V row `vr`): the keys
/// every row sees, [f0, f1), in one pass over all rows; a cut key only to the rows that see
/// it (row i's keys [first[i], last[i]] shifted by -ja), so that a NaN or Inf in a hidden V
/// row (P = 0 or never computed there) reaches no row. O's rows must be rescaled already.
template <class A>
[[gnu::always_inline]] inline void decode_block_pv(std::int64_t np, const A* p, std::ptrdiff_t p_row,
                                                   std::ptrdiff_t p_key, const A* vr, std::ptrdiff_t ldv,
                                                   std::int64_t ja, std::int64_t nkp, std::int64_t f0,
                                                   std::int64_t f1, const std::int64_t* first,
                                                   const std::int64_t* last, std::int64_t dim, A* o,
                                                   const A* ones) {
  decode_add_pv(np, p + f0 * p_key, p_row, p_key, vr + f0 * ldv, ldv, f1 - f0, dim, o, dim, ones);
  if (f0 == 0 && f1 == nkp) return;
  for (std::int64_t i = 0; i < np; ++i) {
    // The row's keys [a0, a1): the part before f0 and the part from f1.
    const std::int64_t a0 = std::clamp<std::int64_t>(first[i] - ja, 0, nkp);
    const std::int64_t a1 = std::clamp<std::int64_t>(last[i] + 1 - ja, a0, nkp);
    const std::int64_t b0 = std::max(a0, f1), e0 = std::min(a1, f0);
    const A* pi = p + i * p_row;
    decode_add_pv(1, pi + a0 * p_key, p_row, p_key, vr + a0 * ldv, ldv, e0 - a0, dim, o + i * dim, dim, ones);
    decode_add_pv(1, pi + b0 * p_key, p_row, p_key, vr + b0 * ldv, ldv, a1 - b0, dim, o + i * dim, dim, ones);
  }
}

/// One K/V head's rows of a decode task (see decode_task): where its state lies in the
/// scratch, and the part of the call it reads.
template <class A>
struct DecodeHead {
  std::int64_t kh, h0, gh, rows;  ///< K/V head, its first query head, query heads, rows (tokens x gh)
  std::int64_t base;              ///< its first row in the scratch's per-row arrays (Q: base x D, O: base x D_v)
  int nr;                         ///< 0: dot-product scores (Q row-major); 1, 2: query panels of nr vectors
};

/// Multiplies the `n` values at `row` by `alpha` (a row of O rescaled by the online softmax).
template <class A>
[[gnu::always_inline]] inline void scale_values(A* row, std::int64_t n, A alpha) {
  using V = simd_t<A>;
  constexpr int W = Simd<A>::width;
  const V a = simd_splat(alpha);
  std::int64_t d = 0;
  for (; d + W <= n; d += W) simd_store(row + d, simd_load(row + d) * a);
  for (; d < n; ++d) row[d] *= alpha;
}

/// Rows of K or V as decode_block reads them: `ld` elements of A apart from `at`.
template <class A>
struct BlockRows {
  const A* at;        ///< the block's first row
  std::ptrdiff_t ld;  ///< elements between rows
  /// Row `j` of the block.
  const A* row(std::int64_t j) const { return at + j * ld; }
};

/// The `n` rows of `dim` elements at `src` (`ld` apart) as A: in place when T is A, else
/// widened into `buf` (rows dim apart).
template <class A, class T>
[[gnu::always_inline]] inline BlockRows<A> block_rows(const T* src, std::ptrdiff_t ld, std::int64_t n,
                                                      std::int64_t dim, A* buf) {
  if constexpr (std::is_same_v<T, A>) {
    return {src, ld};
  } else {
    for (std::int64_t j = 0; j < n; ++j) convert_values(src + j * ld, buf + j * dim, dim);
    return {buf, dim};
  }
}

/// One key block [j0, j1] of one head: scores (soft-capped when the call caps them), softmax,
/// O = alpha O + P V, V and K read in place. NR = 0: scores as dot products into S rows
/// (decode_scores), a softmax per row; NR = 1, 2: S^T = K Q^T per query panel of NR vectors,
/// as the forward's panel step.
template <int NR, class T, class O, class A>
void decode_block(const FlashDecode<T, O, A>& job, std::int64_t b, const DecodeHead<A>& hd, std::int64_t j0,
                  std::int64_t j1, const ForwardScratch<A>& s) {
  constexpr int W = FlashTile<A>::width, PW = (NR == 0 ? 1 : NR) * W, MR = FlashTile<A>::mr;
  const std::int64_t dim = job.q.dim(), dim_v = job.v.dim(), R = hd.rows;
  // The block's K and V rows of this head: in place when T is A; a narrower T (a bf16 cache)
  // is read at its own width and widened once into the scratch (rows dim apart).
  const BlockRows<A> kb = block_rows<A>(job.k_row(b, j0, hd.kh), job.k.stride[1], j1 + 1 - j0, dim, s.kbuf);
  const BlockRows<A> vb = block_rows<A>(job.v_row(b, j0, hd.kh), job.v.stride[1], j1 + 1 - j0, dim_v, s.vbuf);
  const std::ptrdiff_t ldk = kb.ld, ldv = vb.ld;
  const std::int64_t* first = s.first + hd.base;
  const std::int64_t* last = s.last + hd.base;
  const A cap = static_cast<A>(job.p.softcap);
  A* const ot = s.ot + hd.base * dim_v;
  if constexpr (NR == 0) {
    const auto [ja, nkp, f0, f1] = s.panel[hd.base / max_panel<A>].in_block(j0, j1);
    if (nkp <= 0) return;
    const std::ptrdiff_t lds = fwd_block_k;
    decode_scores(s.qt + hd.base * dim, R, kb.row(ja - j0), ldk, nkp, dim, s.st, lds);
    // (Whole vectors: a row of S is fwd_block_k long, a whole number of them.)
    if (cap > 0)
      for (std::int64_t i = 0; i < R; ++i) softcap_scores(s.st + i * lds, (nkp + W - 1) / W * W, cap);
    for (std::int64_t i = 0; i < R; ++i) {
      const std::int64_t a0 = std::clamp<std::int64_t>(first[i] - ja, 0, nkp);
      const std::int64_t a1 = std::clamp<std::int64_t>(last[i] + 1 - ja, a0, nkp);
      if (a0 == a1) continue;  // no key of this block: the row's state stays as it is
      const A alpha = softmax_row(s.st + i * lds, a0, a1, s.m[hd.base + i], s.l[hd.base + i]);
      if (alpha != A(1)) scale_values(ot + i * dim_v, dim_v, alpha);
    }
    decode_block_pv(R, s.st, lds, 1, vb.row(ja - j0), ldv, ja, nkp, f0, f1, first, last, dim_v, ot, s.ones);
  } else {
    const std::int64_t panels = (R + PW - 1) / PW, qt_panel = dim * PW;
    for (std::int64_t panel = 0, c0 = 0; panel < panels; ++panel, c0 += PW) {
      // As the forward: the panel's keys [ja, ja + nkp) of this block, [f0, f1) seen by all.
      const auto [ja, nkp, f0, f1] = s.panel[hd.base / PW + panel].in_block(j0, j1);
      if (nkp <= 0) continue;
      const std::int64_t np = std::min<std::int64_t>(PW, R - c0);
      const A* const kr = kb.row(ja - j0);
      // S^T = K Q^T with K read in place, MR keys at a time.
      flash_tiles<false, NR, 1>(nkp, kr, ldk, 1, MR * ldk, s.qt + hd.base * dim + panel * qt_panel, PW, dim, s.st, PW,
                             static_cast<const A*>(nullptr));
      if (cap > 0) softcap_scores(s.st, nkp * PW, cap);
      if (f0 > 0 || f1 < nkp)
        cut_keys<PW>(s.st, ja, nkp, f0, f1, np, first + c0, last + c0, s.lane_lo, s.lane_hi);
      softmax_panel<PW>(s.st, nkp, s.m + hd.base + c0, s.l + hd.base + c0, s.alpha);
      A* const o = ot + c0 * dim_v;
      for (std::int64_t i = 0; i < np; ++i) scale_values(o + i * dim_v, dim_v, s.alpha[i]);
      decode_block_pv(np, s.st, 1, PW, vb.row(ja - j0), ldv, ja, nkp, f0, f1, first + c0, last + c0, dim_v, o,
                      s.ones);
    }
  }
}

/// A head's rows before the key loop: Q scaled (by score_scale: over the soft-cap when there is
/// one; row-major for dot-product scores, else Q^T panels of nr vectors, padding lanes 0),
/// running max and sum, O = 0, and the keys each panel reaches (one PanelKeys per max_panel
/// rows for dot-product scores).
template <class T, class O, class A>
void decode_head_init(const FlashDecode<T, O, A>& job, std::int64_t b, const DecodeHead<A>& hd, std::int64_t sk,
                      const ForwardScratch<A>& s) {
  constexpr int W = FlashTile<A>::width;
  const std::int64_t dim = job.q.dim(), R = hd.rows;
  const std::int64_t PW = (hd.nr == 0 ? max_panel<A> : hd.nr * W), panels = (R + PW - 1) / PW;
  const A scale = score_scale<A>(job.p);
  A* const qt = s.qt + hd.base * dim;
  for (std::int64_t r = 0; r < panels * PW; ++r) {
    const T* src = r < R ? job.q_row(b, r / hd.gh, hd.h0 + r % hd.gh) : nullptr;
    A* col = hd.nr == 0 ? qt + r * dim : qt + r / PW * dim * PW + r % PW;
    const std::int64_t step = hd.nr == 0 ? 1 : PW;
    for (std::int64_t d = 0; d < dim; ++d) col[d * step] = src ? static_cast<A>(src[d]) * scale : A(0);
    s.m[hd.base + r] = -std::numeric_limits<A>::infinity();
    s.l[hd.base + r] = 0;
  }
  std::fill(s.ot + hd.base * job.v.dim(), s.ot + (hd.base + R) * job.v.dim(), A(0));
  const std::int64_t pidx = hd.base / PW;  // (decode_block finds them there)
  for (std::int64_t panel = 0; panel < panels; ++panel)
    s.panel[pidx + panel] = PanelKeys::join(s.first + hd.base + panel * PW, s.last + hd.base + panel * PW,
                                            std::min(R - panel * PW, PW), sk);
}

/// A head's rows after the key loop: each row's output and LSE, or with `part` the chunk's
/// partial (O, LSE) of row r at part + r (D_v + 1).
template <class T, class O, class A>
void decode_head_end(const FlashDecode<T, O, A>& job, std::int64_t b, const DecodeHead<A>& hd, A* part,
                     const ForwardScratch<A>& s) {
  const std::int64_t dim = job.v.dim();
  for (std::int64_t r = 0; r < hd.rows; ++r) {
    const RowEnd<A> e = row_end(s.m[hd.base + r], s.l[hd.base + r]);
    const A* src = s.ot + (hd.base + r) * dim;
    if (part) {
      A* dst = part + r * (dim + 1);
      for (std::int64_t d = 0; d < dim; ++d) dst[d] = src[d] * e.inv;
      dst[dim] = e.lse;
    } else {
      O* dst = job.out_row(b, r / hd.gh, hd.h0 + r % hd.gh);
      for (std::int64_t d = 0; d < dim; ++d) dst[d] = static_cast<O>(src[d] * e.inv);
      job.store_lse(b, r / hd.gh, hd.h0 + r % hd.gh, e.lse);
    }
  }
}

/// Task `task` of a decode call (see FlashDecode): the rows' key ranges, this task's chunk of
/// them, then the chunk's key blocks in order, each for every head of the slab before the
/// next block, so that K and V stream (a token's heads are one contiguous run) and each block
/// is prefetched into L2 while the one before computes.
template <class T, class O, class A>
void decode_task(const FlashDecode<T, O, A>& job, std::int64_t task, const ForwardScratch<A>& s) {
  constexpr int W = FlashTile<A>::width;
  const std::int64_t g = task / job.chunks, chunk = task % job.chunks;
  const auto [b, kh0, kh1, part] = job.group(g);
  const std::int64_t nq = job.tokens(b), sk = job.keys(b), dim = job.q.dim(), dim_v = job.v.dim(), stride = job.head_rows();
  const std::ptrdiff_t ldk = job.k.stride[1], ldv = job.v.stride[1];
  // Each query's keys (the same for every head), and the keys some query sees.
  std::int64_t lo = sk, hi = -1;
  for (std::int64_t t = 0; t < nq; ++t) {
    const KeySpan r = job.span(b, t, sk);
    s.lane_lo[t] = r.first;
    s.lane_hi[t] = r.last;
    if (!r.empty()) {
      lo = std::min(lo, r.first);
      hi = std::max(hi, r.last);
    }
  }
  // This task's chunk [c_lo, c_hi] of them; each head's rows, their ranges inside it.
  const std::int64_t size = std::max<std::int64_t>(0, hi + 1 - lo + job.chunks - 1) / job.chunks;
  const std::int64_t c_lo = lo + chunk * size, c_hi = std::min(hi, c_lo + size - 1);
  DecodeHead<A> heads[fwd_block_q / max_panel<A>];
  std::int64_t nh = 0;
  for (std::int64_t kh = kh0; kh < kh1; ++kh) {
    const auto [h0, h1] = job.heads(kh, part);
    if (h1 <= h0) continue;
    DecodeHead<A> hd{kh, h0, h1 - h0, nq * (h1 - h0), (kh - kh0) * stride, 0};
    hd.nr = hd.rows <= decode_dot_rows ? 0 : hd.rows <= W ? 1 : 2;
    for (std::int64_t r = 0; r < hd.rows; ++r) {
      s.first[hd.base + r] = std::max(s.lane_lo[r / hd.gh], c_lo);
      s.last[hd.base + r] = std::min(s.lane_hi[r / hd.gh], c_hi);
    }
    decode_head_init(job, b, hd, sk, s);
    heads[nh++] = hd;
  }
  // Key blocks of 64 KB of K (and as much V) for the whole slab, 128 KB with query panels:
  // measured best for 1 and 16 tokens at 8 heads of 128 dims (16 and 32 keys). Each head
  // prefetches its rows of the next block into L2 as a burst before its compute (spread
  // through the compute, the same prefetches measured 30% slower).
  const std::int64_t run = (kh1 - kh0) * dim * static_cast<std::int64_t>(sizeof(A));
  const std::int64_t block_bytes = nh > 0 && heads[0].nr == 0 ? std::int64_t{64} << 10 : std::int64_t{128} << 10;
  const std::int64_t nb = std::clamp<std::int64_t>(block_bytes / run / 16 * 16, 16, fwd_block_k);
  // A paged cache's block also ends where its run of pages does (FlashDecode::block_last).
  for (std::int64_t j0 = c_lo, j1; j0 <= c_hi; j0 = j1 + 1) {
    j1 = job.block_last(b, j0, std::min(c_hi, j0 + nb - 1));
    for (std::int64_t i = 0; i < nh; ++i) {
      const DecodeHead<A>& hd = heads[i];
      // Run by run of pages (one run when dense): a row pointer per run, not per key.
      for (std::int64_t x = j1 + 1, xe = std::min(j1 + nb, c_hi) + 1; x < xe;) {
        const std::int64_t last = job.block_last(b, x, xe - 1);
        const T* kr = job.k_row(b, x, hd.kh);
        const T* vr = job.v_row(b, x, hd.kh);
        for (; x <= last; ++x, kr += ldk, vr += ldv) {
          prefetch_row(kr, dim, 2);
          prefetch_row(vr, dim_v, 2);
        }
      }
      if (hd.nr == 0) decode_block<0>(job, b, hd, j0, j1, s);
      else if (hd.nr == 1) decode_block<1>(job, b, hd, j0, j1, s);
      else decode_block<2>(job, b, hd, j0, j1, s);
    }
  }
  for (std::int64_t i = 0; i < nh; ++i)
    decode_head_end(job, b, heads[i], job.chunks > 1 ? job.part_row(g, chunk, (heads[i].kh - kh0) * stride) : nullptr, s);
}
