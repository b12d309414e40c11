// CpuFlashKernel's backward tile loop for ONE instruction set (see kernel/cpu/flash_backward.hpp
// for the work split, and kernel/cpu/isa_kernels.hpp for why this file has no include guard).
// Needs the SIMD layer (cpu_isa_simd.inl) of the same namespace.

/// The keys of block [j0, j0 + nk) that each row of query block [i0, i0 + nq) sees by the mask
/// alone: s.row_lo, s.row_hi (block indices; none when row_lo > row_hi). Returns false when no
/// row sees any (the tile is skipped; then nothing else is written). `prev` gets the last key
/// block before this one that some row of the query block sees, -1 when none: the task whose
/// dQ add to these rows comes right before this one's (it does not skip the tile, by this same
/// test).
template <class T, class A>
inline bool backward_tile_keys(const FlashBackward<T, A>& job, std::int64_t b, std::int64_t i0, std::int64_t nq,
                               std::int64_t j0, std::int64_t nk, const BackwardScratch<A>& s, std::int64_t& prev) {
  const KernelParams& p = job.p;
  const std::int64_t sk = job.k.seq(), j1 = j0 + nk - 1;
  // The query block's first and last rows decide a skip (most tiles of a window or of
  // documents are rejected here, on two rows).
  if (classify_tile(p.row_span(b, i0, sk), p.row_span(b, i0 + nq - 1, sk), j0, j1) == TileClass::skip) return false;
  bool any = false;
  prev = -1;
  for (std::int64_t i = 0; i < nq; ++i) {
    const KeySpan r = p.row_span(b, i0 + i, sk);
    s.row_lo[i] = std::max<std::int64_t>(r.first - j0, 0);
    s.row_hi[i] = std::min(r.last, j1) - j0;
    any = any || s.row_lo[i] <= s.row_hi[i];
    const std::int64_t before = std::min(r.last, j0 - 1);  // the row's last key before this block
    if (r.first <= before) prev = std::max(prev, before / FlashBackward<T, A>::BK);
  }
  return any;
}

/// Packs a tile's Q and dO rows (zero-padded to whole panels), their LSE and delta; a row that
/// saw no key at all (LSE -inf) sees none of the block either, and a row that sees none of the
/// block is packed as zeros.
template <class T, class A>
inline void backward_pack_rows(const FlashBackward<T, A>& job, std::int64_t b, std::int64_t h, std::int64_t i0,
                               std::int64_t nq, const BackwardScratch<A>& s) {
  using V = simd_t<A>;
  using S = BackwardScratch<A>;
  constexpr std::int64_t W = FlashTile<A>::width;
  const std::int64_t dim = job.q.dim(), dp = S::padded(dim), ld = S::ld_dim(dim);
  const std::int64_t dim_v = job.v.dim(), dpv = S::padded(dim_v), ldv = S::ld_dim(dim_v);
  for (std::int64_t i = 0; i < nq; ++i) {
    const T* qr = job.q.row(b, i0 + i, h);
    const T* dor = job.dout.row(b, i0 + i, h);
    const T* orow = job.out.row(b, i0 + i, h);
    A* qd = s.qs + i * ld;
    A* dod = s.dos + i * ldv;
    for (std::int64_t d = 0; d < dim; ++d) qd[d] = static_cast<A>(qr[d]);
    for (std::int64_t d = 0; d < dim_v; ++d) dod[d] = static_cast<A>(dor[d]);
    std::fill(qd + dim, qd + dp, A(0));
    std::fill(dod + dim_v, dod + dpv, A(0));
    // delta = dO . O, in lanes where it can: a scalar sum is one long chain of dependent adds.
    V acc{};
    std::int64_t d = 0;
    if constexpr (std::is_same_v<T, A>)
      for (; d + W <= dim_v; d += W) acc = simd_fma(simd_load(dor + d), simd_load(orow + d), acc);
    A dl = 0;
    for (; d < dim_v; ++d) dl += static_cast<A>(dor[d]) * static_cast<A>(orow[d]);
    for (std::int64_t w = 0; w < W; ++w) dl += acc[w];
    s.delta[i] = dl;
    s.lrow[i] = job.lse(b, i0 + i, h);
    if (s.lrow[i] == -std::numeric_limits<A>::infinity()) s.row_hi[i] = s.row_lo[i] - 1;
    // A row that sees none of the block adds nothing: its P and dS are 0, but dK += dS^T Q
    // and dV += P^T dO still multiply them by its Q and dO rows, and 0 x NaN is NaN (a row
    // that sees no key may hold anything, NaN included, and its O is 0 whatever it holds).
    if (s.row_lo[i] > s.row_hi[i]) {
      std::fill(qd, qd + dp, A(0));
      std::fill(dod, dod + dpv, A(0));
      s.delta[i] = 0;
    }
  }
}

/// P and dS of a tile's `nq` rows over key columns [c_lo, c_hi), in place of S (s.pm: Q K^T)
/// and dP (s.ds): P = exp(S scale - LSE) and dS = P (dP - delta) scale where the row sees the
/// key, exactly 0 elsewhere. Capped (Q K^T scale = cap x, the score cap tanh(x)): P = exp(cap
/// tanh(x) - LSE) and dS also times tanh's slope, 1 - tanh(x)^2.
template <bool Capped, class A>
[[gnu::always_inline]] inline void backward_probabilities(const BackwardScratch<A>& s, std::int64_t nq,
                                                          std::int64_t c_lo, std::int64_t c_hi, A scale, A cap) {
  using V = simd_t<A>;
  constexpr std::int64_t W = FlashTile<A>::width;
  const std::int64_t lk = BackwardScratch<A>::ld_keys();
  V lane{};
  for (std::int64_t w = 0; w < W; ++w) lane[w] = static_cast<A>(w);
  const V sc = simd_splat(scale), to_x = simd_splat(Capped ? scale / cap : A(0)), cv = simd_splat(cap);
  for (std::int64_t i = 0; i < nq; ++i) {
    const V l = simd_splat(-s.lrow[i]), dl = simd_splat(s.delta[i]);
    const A lo = static_cast<A>(s.row_lo[i]), hi = static_cast<A>(s.row_hi[i]);
    for (std::int64_t c = c_lo; c < c_hi; c += W) {
      A* pr = s.pm + i * lk + c;
      A* dr = s.ds + i * lk + c;
      const V key = lane + static_cast<A>(c);
      const auto seen = (key >= lo) & (key <= hi);
      if constexpr (Capped) {
        const V t = softcap_lanes(simd_load(pr) * to_x, simd_splat(A(1)));
        const V e = exp_lanes(simd_fma(t, cv, l));
        simd_store(pr, seen ? e : V{});
        simd_store(dr, seen ? e * (simd_load(dr) - dl) * (sc * simd_fma(-t, t, simd_splat(A(1)))) : V{});
      } else {
        const V e = exp_lanes(simd_fma(simd_load(pr), sc, l));
        simd_store(pr, seen ? e : V{});
        simd_store(dr, seen ? e * (simd_load(dr) - dl) * sc : V{});
      }
    }
  }
}

/// Runs task t of `job` (key block t / (batch x K/V heads) of pair t % (batch x K/V heads)).
template <class T, class A>
void backward_task(const FlashBackward<T, A>& job, std::int64_t t, const BackwardScratch<A>& s, std::int32_t* turns) {
  using S = BackwardScratch<A>;
  constexpr std::int64_t PW = FlashTile<A>::panel, MR = FlashTile<A>::mr;
  constexpr std::int64_t BQ = FlashBackward<T, A>::BQ, BK = FlashBackward<T, A>::BK;
  static_assert(BK % PW == 0 && max_panel<A> % PW == 0, "key blocks and scratch rows must be whole panels");
  const auto &q = job.q, &k = job.k, &v = job.v;
  const KernelParams& p = job.p;
  const std::int64_t pairs = q.batch() * k.heads(), b = t % pairs / k.heads(), kh = t % pairs % k.heads();
  const std::int64_t jb = t / pairs, j0 = jb * BK, nk = std::min(BK, k.seq() - j0);
  const std::int64_t dim = q.dim(), dp = S::padded(dim), ld = S::ld_dim(dim), lk = S::ld_keys();
  const std::int64_t dim_v = v.dim(), dpv = S::padded(dim_v), ldv = S::ld_dim(dim_v);
  const std::int64_t nqb = job.query_blocks(), kcols = (nk + PW - 1) / PW * PW;
  const A scale = static_cast<A>(p.scale), cap = static_cast<A>(p.softcap);

  // K (dim rows), K^T and V^T (key rows, zero past the block's keys up to a whole panel). A K
  // row holding a NaN or Inf goes into K (the B of dQ = dS K) as zeros and onto the `bad`
  // list: a row that does not see the key has dS = 0 there, but 0 x NaN would still reach
  // its dQ; the rows that see it get its term added apart.
  std::int64_t nbad = 0;
  for (std::int64_t j = 0; j < kcols; ++j) {
    const bool real = j < nk;
    const T* kr = real ? k.row(b, j0 + j, kh) : nullptr;
    const T* vr = real ? v.row(b, j0 + j, kh) : nullptr;
    for (std::int64_t d = 0; d < dim; ++d) {
      const A kx = real ? static_cast<A>(kr[d]) : A(0);
      s.kt[d * lk + j] = kx;
      if (real) s.ks[j * ld + d] = kx;
    }
    for (std::int64_t d = 0; d < dim_v; ++d) s.vt[d * lk + j] = real ? static_cast<A>(vr[d]) : A(0);
    if (!real) continue;
    if (!all_finite(s.ks + j * ld, dim, s.ks, 0, 0, 0)) {
      std::fill(s.ks + j * ld, s.ks + j * ld + dim, A(0));
      s.bad[nbad++] = j;
    }
    std::fill(s.ks + j * ld + dim, s.ks + j * ld + dp, A(0));
  }
  for (std::int64_t j = 0; j < nk; ++j) {
    std::fill(s.dks + j * ld, s.dks + j * ld + dp, A(0));
    std::fill(s.dvs + j * ldv, s.dvs + j * ldv + dpv, A(0));
  }
  bool touched = false;
  for (std::int64_t h = 0; h < q.heads(); ++h) {
    if (p.kv_head(h) != kh) continue;
    for (std::int64_t ib = 0; ib < nqb; ++ib) {
      const std::int64_t i0 = ib * BQ, nq = std::min(BQ, q.seq() - i0);
      // Skip the query blocks that see none of this key block.
      std::int64_t prev = -1;
      if (!backward_tile_keys(job, b, i0, nq, j0, nk, s, prev)) continue;
      touched = true;
      backward_pack_rows(job, b, h, i0, nq, s);
      // (No software prefetch of the next query block's rows: a burst of them before the
      // tile's products measured 2-6% slower at S 2048-8192, D 64 and 128, than the hardware
      // prefetchers alone; the rows are read in order, which those follow.)
      // Keys [kmin, kmax] are those some row sees: the others add nothing and are left out
      // of every product (whole key panels from kmin's for S and dP).
      std::int64_t kmin = nk, kmax = -1;
      for (std::int64_t i = 0; i < nq; ++i)
        if (s.row_lo[i] <= s.row_hi[i]) {
          kmin = std::min(kmin, s.row_lo[i]);
          kmax = std::max(kmax, s.row_hi[i]);
        }
      const std::int64_t nv = kmax + 1 - kmin, c_lo = kmin / PW * PW, c_hi = (kmax + PW) / PW * PW;
      if (nv > 0) {
        // S = Q K^T, dP = dO V^T: keys in lanes, one key panel at a time.
        for (std::int64_t c0 = c_lo; c0 < c_hi; c0 += PW) {
          flash_tiles<false, 2, 1>(nq, s.qs, ld, 1, MR * ld, s.kt + c0, lk, dim, s.pm + c0, lk, static_cast<const A*>(nullptr));
          flash_tiles<false, 2, 1>(nq, s.dos, ldv, 1, MR * ldv, s.vt + c0, lk, dim_v, s.ds + c0, lk,
                             static_cast<const A*>(nullptr));
        }
        // P = exp(S scale - LSE) on the keys the row sees, dS = P (dP - delta) scale (with a
        // soft-cap, see backward_probabilities); both exactly 0 (selected, not multiplied: S
        // or dP is NaN at a key whose K or V is) elsewhere.
        if (cap > 0)
          backward_probabilities<true>(s, nq, c_lo, c_hi, scale, cap);
        else
          backward_probabilities<false>(s, nq, c_lo, c_hi, scale, cap);
        // dV += P^T dO, dK += dS^T Q (over the tile's queries), dQ share = dS K (over its
        // keys): head dims in lanes (dV's D_v of them, dK's and dQ's D).
        for (std::int64_t c0 = 0; c0 < std::max(dp, dpv); c0 += PW) {
          if (c0 < dpv)
            flash_tiles<true, 2, S::ld_keys()>(nv, s.pm + kmin, 1, lk, MR, s.dos + c0, ldv, nq, s.dvs + kmin * ldv + c0, ldv, s.ones);
          if (c0 >= dp) continue;
          flash_tiles<true, 2, S::ld_keys()>(nv, s.ds + kmin, 1, lk, MR, s.qs + c0, ld, nq, s.dks + kmin * ld + c0, ld, s.ones);
          flash_tiles<false, 2, 1>(nq, s.ds + kmin, lk, 1, MR * lk, s.ks + kmin * ld + c0, ld, nv, s.dqs + c0, ld,
                             static_cast<const A*>(nullptr));
        }
        // The dQ terms of non-finite K rows, for the rows that see them.
        for (std::int64_t n = 0; n < nbad; ++n) {
          const std::int64_t j = s.bad[n];
          for (std::int64_t i = 0; i < nq; ++i) {
            if (j < s.row_lo[i] || j > s.row_hi[i]) continue;
            const A g = s.ds[i * lk + j];
            for (std::int64_t d = 0; d < dim; ++d) s.dqs[i * ld + d] += g * s.kt[d * lk + j];
          }
        }
      }
      // This key block's dQ share goes after that of `prev`, the last earlier block that
      // these rows see (so in key block order whatever the threads).
      std::int32_t* turn = turns ? turns + (b * q.heads() + h) * nqb + ib : nullptr;
      if (turn) wait_turn(*turn, static_cast<std::int32_t>(prev + 1));
      if (nv > 0)
        for (std::int64_t i = 0; i < nq; ++i) {
          A* dst = job.dq.row(b, i0 + i, h);
          const A* src = s.dqs + i * ld;
          for (std::int64_t d = 0; d < dim; ++d) dst[d] += src[d];
        }
      if (turn) pass_turn(*turn, static_cast<std::int32_t>(jb + 1));
    }
  }
  if (!touched) return;
  for (std::int64_t j = 0; j < nk; ++j) {
    A* dkr = job.dk.row(b, j0 + j, kh);
    A* dvr = job.dv.row(b, j0 + j, kh);
    for (std::int64_t d = 0; d < dim; ++d) dkr[d] += s.dks[j * ld + d];
    for (std::int64_t d = 0; d < dim_v; ++d) dvr[d] += s.dvs[j * ldv + d];
  }
}
