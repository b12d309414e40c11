// CpuFlashKernel's backward tile loop for ONE instruction set (see kernel/cpu_flash_backward.hpp
// for the work split, and kernel/cpu_isa_kernels.hpp for why this file has no include guard).
// Needs the SIMD layer (cpu_isa_simd.inl) of the same namespace.

/// Packs a tile's Q and dO rows (zero-padded to whole panels), their LSE and delta, and how
/// many of the block's nk keys each row sees (none for a row that saw no key at all).
template <class T, class A>
inline void backward_pack_rows(const FlashBackward<T, A>& job, std::int64_t b, std::int64_t h, std::int64_t i0,
                               std::int64_t nq, std::int64_t nk, const BackwardScratch<A>& s) {
  using V = simd_t<A>;
  constexpr std::int64_t W = FlashTile<A>::width;
  const KernelParams& p = job.p;
  const std::int64_t dim = job.q.dim(), dp = BackwardScratch<A>::padded(dim), ld = BackwardScratch<A>::ld_dim(dim);
  std::int64_t seen = 0;  // keys at or before the row's position: non-decreasing down the rows
  for (std::int64_t i = 0; i < nq; ++i) {
    const T* qr = job.q.row(b, i0 + i, h);
    const T* dor = job.dout.row(b, i0 + i, h);
    const T* orow = job.out.row(b, i0 + i, h);
    A* qd = s.qs + i * ld;
    A* dod = s.dos + i * ld;
    for (std::int64_t d = 0; d < dim; ++d) {
      qd[d] = static_cast<A>(qr[d]);
      dod[d] = static_cast<A>(dor[d]);
    }
    std::fill(qd + dim, qd + dp, A(0));
    std::fill(dod + dim, dod + dp, A(0));
    // delta = dO . O, in lanes where it can: a scalar sum is one long chain of dependent adds.
    V acc{};
    std::int64_t d = 0;
    if constexpr (std::is_same_v<T, A>)
      for (; d + W <= dim; d += W) acc = simd_fma(simd_load(dor + d), simd_load(orow + d), acc);
    A dl = 0;
    for (; d < dim; ++d) dl += static_cast<A>(dor[d]) * static_cast<A>(orow[d]);
    for (std::int64_t w = 0; w < W; ++w) dl += acc[w];
    s.delta[i] = dl;
    s.lrow[i] = job.lse(b, i0 + i, h);
    if (p.causal)
      for (const std::int64_t qp = p.q_positions(i0 + i); seen < nk && s.kpos[seen] <= qp;) ++seen;
    s.limit[i] = s.lrow[i] == -std::numeric_limits<A>::infinity() ? 0 : p.causal ? seen : nk;
  }
}

/// Runs task t of `job` (key block t / (batch x K/V heads) of pair t % (batch x K/V heads)).
template <class T, class A>
void backward_task(const FlashBackward<T, A>& job, std::int64_t t, const BackwardScratch<A>& s, std::int32_t* turns) {
  using V = simd_t<A>;
  using S = BackwardScratch<A>;
  constexpr std::int64_t W = FlashTile<A>::width, PW = FlashTile<A>::panel, MR = FlashTile<A>::mr;
  constexpr std::int64_t BQ = FlashBackward<T, A>::BQ, BK = FlashBackward<T, A>::BK;
  static_assert(BK % PW == 0 && max_panel<A> % PW == 0, "key blocks and scratch rows must be whole panels");
  const auto &q = job.q, &k = job.k, &v = job.v;
  const KernelParams& p = job.p;
  const std::int64_t pairs = q.batch() * k.heads(), b = t % pairs / k.heads(), kh = t % pairs % k.heads();
  const std::int64_t jb = t / pairs, j0 = jb * BK, nk = std::min(BK, k.seq() - j0);
  const std::int64_t dim = q.dim(), dp = S::padded(dim), ld = S::ld_dim(dim), lk = S::ld_keys();
  const std::int64_t nqb = job.query_blocks(), kcols = (nk + PW - 1) / PW * PW;
  const A scale = static_cast<A>(p.scale);

  // K (dim rows), K^T and V^T (key rows, zero past the block's keys up to a whole panel).
  for (std::int64_t j = 0; j < kcols; ++j) {
    const bool real = j < nk;
    const T* kr = real ? k.row(b, j0 + j, kh) : nullptr;
    const T* vr = real ? v.row(b, j0 + j, kh) : nullptr;
    for (std::int64_t d = 0; d < dim; ++d) {
      const A kx = real ? static_cast<A>(kr[d]) : A(0), vx = real ? static_cast<A>(vr[d]) : A(0);
      s.kt[d * lk + j] = kx;
      s.vt[d * lk + j] = vx;
      if (real) s.ks[j * ld + d] = kx;
    }
    if (real) {
      std::fill(s.ks + j * ld + dim, s.ks + j * ld + dp, A(0));
      s.kpos[j] = p.causal ? p.k_positions(j0 + j) : 0;
    }
  }
  for (std::int64_t j = 0; j < nk; ++j) {
    std::fill(s.dks + j * ld, s.dks + j * ld + dp, A(0));
    std::fill(s.dvs + j * ld, s.dvs + j * ld + dp, A(0));
  }
  V lane{};
  for (std::int64_t w = 0; w < W; ++w) lane[w] = static_cast<A>(w);

  bool touched = false;
  for (std::int64_t h = 0; h < q.heads(); ++h) {
    if (p.kv_head(h) != kh) continue;
    for (std::int64_t ib = 0; ib < nqb; ++ib) {
      const std::int64_t i0 = ib * BQ, nq = std::min(BQ, q.seq() - i0);
      // Earlier query blocks see fewer keys: skip those that see none of this block.
      if (p.causal && p.fully_masked(p.q_positions(i0 + nq - 1), s.kpos[0])) continue;
      touched = true;
      backward_pack_rows(job, b, h, i0, nq, nk, s);
      // The next query block's rows (Q, dO, O, and the dQ rows its share is added to) on
      // their way to L2 while this one computes: every task streams the whole sequence's
      // rows of its heads, from L3 or memory once the sequence is long.
      for (std::int64_t i = i0 + BQ, ie = std::min(q.seq(), i0 + 2 * BQ); i < ie; ++i)
        for (const void* row : {static_cast<const void*>(q.row(b, i, h)), static_cast<const void*>(job.dout.row(b, i, h)),
                                static_cast<const void*>(job.out.row(b, i, h)), static_cast<const void*>(job.dq.row(b, i, h))})
          for (std::int64_t off = 0; off < dim * std::int64_t(sizeof(T)); off += 64)
            __builtin_prefetch(static_cast<const char*>(row) + off, 0, 2);
      // Keys after the last one any row sees add nothing: leave them out of every product.
      const std::int64_t nv = *std::max_element(s.limit, s.limit + nq), vcols = (nv + PW - 1) / PW * PW;

      // S = Q K^T, dP = dO V^T: keys in lanes, one key panel at a time.
      for (std::int64_t c0 = 0; c0 < vcols; c0 += PW) {
        flash_tiles<false>(nq, s.qs, ld, 1, MR * ld, s.kt + c0, lk, dim, s.pm + c0, lk, static_cast<const A*>(nullptr));
        flash_tiles<false>(nq, s.dos, ld, 1, MR * ld, s.vt + c0, lk, dim, s.ds + c0, lk, static_cast<const A*>(nullptr));
      }
      // P = exp(S scale - LSE) on the keys the row sees, else 0; dS = P (dP - delta) scale.
      const V sc = simd_splat(scale);
      for (std::int64_t i = 0; i < nq; ++i) {
        const V l = simd_splat(-s.lrow[i]), dl = simd_splat(s.delta[i]);
        const A limit = static_cast<A>(s.limit[i]);
        for (std::int64_t c = 0; c < vcols; c += W) {
          A* pr = s.pm + i * lk + c;
          A* dr = s.ds + i * lk + c;
          const V e = exp_lanes(simd_fma(simd_load(pr), sc, l));
          const V pv = lane + static_cast<A>(c) < limit ? e : V{};
          simd_store(pr, pv);
          simd_store(dr, pv * (simd_load(dr) - dl) * sc);
        }
      }
      // dV += P^T dO, dK += dS^T Q (over the tile's queries), dQ share = dS K (over its
      // keys): head dims in lanes.
      for (std::int64_t c0 = 0; c0 < dp; c0 += PW) {
        flash_tiles<true>(nv, s.pm, 1, lk, MR, s.dos + c0, ld, nq, s.dvs + c0, ld, s.ones);
        flash_tiles<true>(nv, s.ds, 1, lk, MR, s.qs + c0, ld, nq, s.dks + c0, ld, s.ones);
        flash_tiles<false>(nq, s.ds, lk, 1, MR * lk, s.ks + c0, ld, nv, s.dqs + c0, ld, static_cast<const A*>(nullptr));
      }
      std::int32_t* turn = turns ? turns + (b * q.heads() + h) * nqb + ib : nullptr;
      if (turn) wait_turn(*turn, static_cast<std::int32_t>(jb));
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
    for (std::int64_t d = 0; d < dim; ++d) {
      dkr[d] += s.dks[j * ld + d];
      dvr[d] += s.dvs[j * ld + d];
    }
  }
}
