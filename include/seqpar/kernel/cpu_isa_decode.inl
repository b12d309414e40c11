// CpuFlashKernel's decode path for ONE instruction set: one (batch element, K/V head, key
// chunk) task of kernel/cpu_flash_decode.hpp (which explains the layout; why this file has no
// include guard, in kernel/cpu_isa_kernels.hpp). Needs the SIMD layer (cpu_isa_simd.inl) and
// the forward's panel helpers (cpu_isa_forward.inl) of the same namespace.

/// O[r] += sum over `keys` keys of P[r][key] V[key] for `rows` rows: P^T is a panel (row r's
/// weight of key j at p[r + j * ldp]), V the caller's rows `ldv` apart, O rows `ldo` apart.
/// Head dims are the lanes: two vectors at a time, then one, then one at a time.
template <class A>
[[gnu::always_inline]] inline void decode_add_pv(std::int64_t rows, const A* p, std::ptrdiff_t ldp, const A* v,
                                                 std::ptrdiff_t ldv, std::int64_t keys, std::int64_t dim, A* o,
                                                 std::ptrdiff_t ldo, const A* ones) {
  constexpr int W = FlashTile<A>::width, MR = FlashTile<A>::mr;
  if (keys <= 0 || rows <= 0) return;
  std::int64_t d0 = 0;
  for (; d0 + 2 * W <= dim; d0 += 2 * W) flash_tiles<true, 2>(rows, p, 1, ldp, MR, v + d0, ldv, keys, o + d0, ldo, ones);
  if (d0 + W <= dim) {
    flash_tiles<true, 1>(rows, p, 1, ldp, MR, v + d0, ldv, keys, o + d0, ldo, ones);
    d0 += W;
  }
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t d = d0; d < dim; ++d) {
      A acc = o[r * ldo + d];
      for (std::int64_t j = 0; j < keys; ++j) acc += p[r + j * ldp] * v[j * ldv + d];
      o[r * ldo + d] = acc;
    }
}

/// Rows [0, R) of a decode task (row r: query r / gh, head h0 + r % gh of batch element b),
/// query panels of NR vectors, against keys [lo, hi] of K/V head kh; s.first, s.last hold
/// the rows' ranges within [lo, hi]. Writes each row's output and LSE, or with
/// `part` its chunk's partial (O, LSE) at part + r (dim + 1).
template <int NR, class T, class O, class A>
void decode_rows(const FlashDecode<T, O, A>& job, std::int64_t b, std::int64_t kh, std::int64_t h0, std::int64_t gh,
                 std::int64_t lo, std::int64_t hi, A* part, const ForwardScratch<A>& s) {
  using V = simd_t<A>;
  constexpr int W = FlashTile<A>::width, PW = NR * W, MR = FlashTile<A>::mr;
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  const std::int64_t dim = job.q.dim(), R = job.q.seq() * gh, sk = job.k.seq();
  const std::int64_t panels = (R + PW - 1) / PW, qt_panel = dim * PW;
  const A scale = static_cast<A>(job.p.scale);
  const std::ptrdiff_t ldk = job.k.stride[1], ldv = job.v.stride[1];

  // Q^T of every row, scaled, panel after panel; padding lanes are zero. O (rows x dim) at 0.
  for (std::int64_t r = 0; r < panels * PW; ++r) {
    A* col = s.qt + r / PW * qt_panel + r % PW;
    const T* src = r < R ? job.q.row(b, r / gh, h0 + r % gh) : nullptr;
    for (std::int64_t d = 0; d < dim; ++d) col[d * PW] = src ? static_cast<A>(src[d]) * scale : A(0);
    s.m[r] = neg_inf;
    s.l[r] = 0;
  }
  std::fill(s.ot, s.ot + R * dim, A(0));
  for (std::int64_t panel = 0; panel < panels; ++panel)
    s.panel[panel] = join_row_keys(s.first + panel * PW, s.last + panel * PW, std::min(R - panel * PW, std::int64_t{PW}), sk);

  for (std::int64_t j0 = lo; j0 <= hi; j0 += fwd_block_k) {
    const std::int64_t j1 = std::min(hi, j0 + fwd_block_k - 1);
    for (std::int64_t panel = 0, c0 = 0; panel < panels; ++panel, c0 += PW) {
      // As the forward: the panel's keys [ja, ja + nkp) of this block, [f0, f1) seen by all.
      const PanelKeys& pk = s.panel[panel];
      const std::int64_t ja = std::max(j0, pk.lo), nkp = std::min(j1, pk.hi) + 1 - ja;
      if (nkp <= 0) continue;
      const std::int64_t f0 = std::clamp<std::int64_t>(pk.all_lo - ja, 0, nkp);
      const std::int64_t f1 = std::clamp<std::int64_t>(pk.all_hi + 1 - ja, f0, nkp);
      const std::int64_t np = std::min<std::int64_t>(PW, R - c0);
      const A* const kr = job.k.row(b, ja, kh);
      const A* const vr = job.v.row(b, ja, kh);

      // S^T = K Q^T with K read in place, a slice of keys at a time. Each slice first
      // prefetches the K and V rows a block ahead into L2: a head's rows are H_kv D elements
      // apart, often one page each, which the hardware prefetchers do not cross.
      constexpr std::int64_t slice = 16;
      for (std::int64_t j = 0; j < nkp; j += slice) {
        const std::int64_t n = std::min(slice, nkp - j);
        if (panel == 0)
          for (std::int64_t x = ja + j + fwd_block_k, xe = std::min(x + n, hi + 1); x < xe; ++x) {
            prefetch_row(job.k.row(b, x, kh), dim, 2);
            prefetch_row(job.v.row(b, x, kh), dim, 2);
          }
        flash_tiles<false, NR>(n, kr + j * ldk, ldk, 1, MR * ldk, s.qt + panel * qt_panel, PW, dim, s.st + j * PW, PW,
                               static_cast<const A*>(nullptr));
      }
      if (f0 > 0 || f1 < nkp) cut_keys<PW>(s.st, ja, nkp, f0, f1, np, s.first + c0, s.last + c0, s.lane_lo, s.lane_hi);
      softmax_panel<PW>(s.st, nkp, s.m + c0, s.l + c0, s.alpha);

      // O = alpha O + P V, V read in place. The keys every row sees go in one pass over all
      // rows; a cut key is added only to the rows that see it, so that a NaN or Inf in a
      // hidden V row (P = 0 there) reaches no row.
      A* const o = s.ot + c0 * dim;
      for (std::int64_t i = 0; i < np; ++i) {
        const V a = simd_splat(s.alpha[i]);
        A* row = o + i * dim;
        std::int64_t d = 0;
        for (; d + W <= dim; d += W) simd_store(row + d, simd_load(row + d) * a);
        for (; d < dim; ++d) row[d] *= s.alpha[i];
      }
      decode_add_pv(np, s.st + f0 * PW, PW, vr + f0 * ldv, ldv, f1 - f0, dim, o, dim, s.ones);
      if (f0 > 0 || f1 < nkp)
        for (std::int64_t i = 0; i < np; ++i) {
          // The row's keys [a0, a1): the part before f0 and the part from f1.
          const std::int64_t a0 = std::clamp<std::int64_t>(s.first[c0 + i] - ja, 0, nkp);
          const std::int64_t a1 = std::clamp<std::int64_t>(s.last[c0 + i] + 1 - ja, a0, nkp);
          const std::int64_t b0 = std::max(a0, f1), e0 = std::min(a1, f0);
          decode_add_pv(1, s.st + a0 * PW + i, PW, vr + a0 * ldv, ldv, e0 - a0, dim, o + i * dim, dim, s.ones);
          decode_add_pv(1, s.st + b0 * PW + i, PW, vr + b0 * ldv, ldv, a1 - b0, dim, o + i * dim, dim, s.ones);
        }
    }
  }

  for (std::int64_t r = 0; r < R; ++r) {
    const RowEnd<A> e = row_end(s.m[r], s.l[r]);
    const A* src = s.ot + r * dim;
    if (part) {
      A* dst = part + r * (dim + 1);
      for (std::int64_t d = 0; d < dim; ++d) dst[d] = src[d] * e.inv;
      dst[dim] = e.lse;
    } else {
      O* dst = job.out.row(b, r / gh, h0 + r % gh);
      for (std::int64_t d = 0; d < dim; ++d) dst[d] = static_cast<O>(src[d] * e.inv);
      if (!job.lse.absent()) job.lse(b, r / gh, h0 + r % gh) = e.lse;
    }
  }
}

/// Task `task` of a decode call (see FlashDecode): the group's rows' key ranges, this task's
/// chunk of them, then decode_rows on the narrowest query panels that hold the rows.
template <class T, class O, class A>
void decode_task(const FlashDecode<T, O, A>& job, std::int64_t task, const ForwardScratch<A>& s) {
  const std::int64_t g = task / job.chunks, chunk = task % job.chunks, kheads = job.k.heads();
  const std::int64_t b = g / kheads, kh = g % kheads, nq = job.q.seq(), sk = job.k.seq();
  const auto [h0, h1] = job.heads(kh);
  const std::int64_t gh = h1 - h0;
  if (gh <= 0) return;
  // Each query's keys (the same for every head), and the keys some query sees.
  std::int64_t lo = sk, hi = -1;
  for (std::int64_t t = 0; t < nq; ++t) {
    const RowKeys r = row_keys(job.p, b, t, sk);
    s.lane_lo[t] = r.first;
    s.lane_hi[t] = r.last;
    if (r.first <= r.last) {
      lo = std::min(lo, r.first);
      hi = std::max(hi, r.last);
    }
  }
  // This task's chunk [c_lo, c_hi] of them; the rows' ranges inside it.
  const std::int64_t size = std::max<std::int64_t>(0, hi + 1 - lo + job.chunks - 1) / job.chunks;
  const std::int64_t c_lo = lo + chunk * size, c_hi = std::min(hi, c_lo + size - 1);
  for (std::int64_t r = 0; r < nq * gh; ++r) {
    s.first[r] = std::max(s.lane_lo[r / gh], c_lo);
    s.last[r] = std::min(s.lane_hi[r / gh], c_hi);
  }
  A* part = job.chunks > 1 ? job.part_row(g, chunk, 0) : nullptr;
  if (nq * gh <= FlashTile<A>::width)
    decode_rows<1>(job, b, kh, h0, gh, c_lo, c_hi, part, s);
  else
    decode_rows<2>(job, b, kh, h0, gh, c_lo, c_hi, part, s);
}
