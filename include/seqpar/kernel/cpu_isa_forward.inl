// CpuFlashKernel's forward for ONE instruction set: one (batch, head, query block) streamed
// over the key blocks (the layout is explained in kernel/cpu_flash_kernel.hpp; why this file
// has no include guard, in kernel/cpu_isa_kernels.hpp). Needs the SIMD layer
// (cpu_isa_simd.inl) of the same namespace.

/// Output rows [i0, i0 + bq) of head h of batch element b (fewer at the end of the sequence),
/// and their LSE when `lse` is present.
///
/// Per key block, V is packed once (MR head dims interleaved per key: its rows are a power
/// of two apart in the caller's tensor and would fall into a few L1 sets), then each panel of
/// PW queries runs the whole step, S^T = K Q^T, the online softmax and O^T += V^T P^T, on the
/// keys it sees (a causal diagonal is trimmed per panel, not per block). The block's Q^T and
/// O^T are stored panel by panel, each panel contiguous, and the panel's S^T fits in L1. Large
/// query blocks make K and V stream from L3 once per many queries; the next key block's rows
/// are prefetched into L2 a slice per panel.
template <class T, class O, class A>
void forward_query_block(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
                         TensorView<A> lse, const KernelParams& p, std::int64_t b, std::int64_t h,
                         std::int64_t i0, std::int64_t bq, const ForwardScratch<A>& s) {
  using V = simd_t<A>;
  constexpr int W = FlashTile<A>::width, PW = FlashTile<A>::panel, MR = FlashTile<A>::mr;
  static_assert(fwd_block_q % PW == 0 && 64 % PW == 0, "query blocks must be whole query panels");
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  const std::int64_t dim = q.dim(), nq = std::min(bq, q.seq() - i0), kh = p.kv_head(h);
  const std::int64_t ncols = (nq + PW - 1) / PW * PW, panels = ncols / PW;  // queries padded to whole panels
  const std::int64_t qt_panel = dim * PW;  // elements of one Q^T or O^T panel
  const A scale = static_cast<A>(p.scale);

  // Q^T, scaled; padding lanes are zero (finite scores, never written out). Rows a few ahead
  // are prefetched: a head's rows are H D elements apart, a stride the hardware prefetchers
  // miss, and each is read once.
  constexpr std::int64_t ahead = 8;
  for (std::int64_t i = 0; i < ncols; ++i) {
    if (i + ahead < nq) prefetch_row(q.row(b, i0 + i + ahead, h), dim, 3);
    const T* src = i < nq ? q.row(b, i0 + i, h) : nullptr;
    A* col = s.qt + i / PW * qt_panel + i % PW;
    for (std::int64_t d = 0; d < dim; ++d) col[d * PW] = src ? static_cast<A>(src[d]) * scale : A(0);
    if (p.causal && src) s.qpos[i] = p.q_positions(i0 + i);
    s.m[i] = neg_inf;
    s.l[i] = 0;
  }
  std::fill(s.ot, s.ot + ncols * dim, A(0));

  const std::int64_t q_hi = p.causal ? s.qpos[nq - 1] : 0;
  for (std::int64_t j0 = 0; j0 < k.seq(); j0 += fwd_block_k) {
    std::int64_t nk = std::min(fwd_block_k, k.seq() - j0);
    if (p.causal) {
      if (p.fully_masked(q_hi, p.k_positions(j0))) break;  // positions increase: every later block is hidden too
      // Keys after the block's last query are hidden from all of it: leave them out.
      std::int64_t seen = 0;
      for (; seen < nk; ++seen) {
        s.kpos[seen] = p.k_positions(j0 + seen);
        if (s.kpos[seen] > q_hi) break;
      }
      nk = seen;
    }
    // K rows copied (and converted to A) into rows ldk apart: in the caller's tensor a head's
    // rows are a power of two apart (H D elements), and the MR rows a micro-kernel reads at
    // once would share a few L1 sets.
    const std::ptrdiff_t ldk = ForwardScratch<A>::ld_keys(dim);
    for (std::int64_t j = 0; j < nk; ++j) {
      if (j + ahead < nk) prefetch_row(k.row(b, j0 + j + ahead, kh), dim, 3);
      const T* ksrc = k.row(b, j0 + j, kh);
      A* dst = s.kbuf + j * ldk;
      for (std::int64_t d = 0; d < dim; ++d) dst[d] = static_cast<A>(ksrc[d]);
    }
    // V packed as tiles of MR head dims: tile t holds, key after key, dims [t MR, t MR + MR).
    // (Whole tiles copy MR contiguous values at a time: one or two vector moves.)
    const std::ptrdiff_t v_tile = MR * nk;
    const std::int64_t whole = dim / MR * MR;
    for (std::int64_t j = 0; j < nk; ++j) {
      if (j + ahead < nk) prefetch_row(v.row(b, j0 + j + ahead, kh), dim, 3);
      const T* vsrc = v.row(b, j0 + j, kh);
      A* dst = s.vbuf + j * MR;
      for (std::int64_t d0 = 0; d0 < whole; d0 += MR, dst += v_tile)
        for (int r = 0; r < MR; ++r) dst[r] = static_cast<A>(vsrc[d0 + r]);
      for (std::int64_t d = whole; d < dim; ++d) dst[d - whole] = static_cast<A>(vsrc[d]);
    }

    const std::int64_t jn = j0 + fwd_block_k, next = std::max<std::int64_t>(0, std::min(fwd_block_k, k.seq() - jn));
    const std::int64_t slice = (next + panels - 1) / panels;  // next block's rows prefetched per panel
    for (std::int64_t c0 = 0, panel = 0; c0 < ncols; c0 += PW, ++panel) {
      // A slice of the next key block's K and V rows on their way to L2 while this block
      // computes: at long sequences they come from L3 or memory, and the hardware prefetcher
      // does not run far enough ahead on MR interleaved row streams.
      for (std::int64_t j = jn + panel * slice, je = std::min(jn + next, j + slice); j < je; ++j) {
        prefetch_row(k.row(b, j, kh), dim, 2);
        prefetch_row(v.row(b, j, kh), dim, 2);
      }
      // The keys this panel sees, and whether any of them needs the mask.
      const std::int64_t np = std::min<std::int64_t>(PW, nq - c0);
      std::int64_t nkp = nk;
      bool masked = false;
      if (p.causal) {
        const std::int64_t last = s.qpos[c0 + np - 1];
        while (nkp > 0 && s.kpos[nkp - 1] > last) --nkp;
        if (nkp == 0) continue;  // nothing to add: the panel's state stays as it is
        masked = !p.fully_visible(s.qpos[c0], s.kpos[nkp - 1]);
      }
      A* const qt = s.qt + panel * qt_panel;
      A* const ot = s.ot + panel * qt_panel;
      A* const st = s.st;

      // S^T = K Q^T (the Q^T panel stays in L1).
      flash_tiles<false>(nkp, s.kbuf, ldk, 1, MR * ldk, qt, PW, dim, st, PW, static_cast<const A*>(nullptr));
      // Keys [0, full) are seen by every query of the panel; later ones by a suffix of it.
      std::int64_t full = nkp;
      if (masked) {
        // Positions increase along the panel, so the lanes that do not see key j are a prefix,
        // which grows with j.
        std::int64_t hidden = 0;
        full = 0;
        for (std::int64_t j = 0; j < nkp; ++j) {
          while (hidden < np && s.qpos[c0 + hidden] < s.kpos[j]) ++hidden;
          std::fill(st + j * PW, st + j * PW + hidden, neg_inf);
          s.hidden[j] = hidden;
          if (hidden == 0) full = j + 1;
        }
      }

      // Online softmax, W queries at a time: P^T = exp(S^T - m') in place.
      for (std::int64_t c = 0; c < PW; c += W) {
        A* col = st + c;
        A *m = s.m + c0 + c, *l = s.l + c0 + c;
        const V m_old = simd_load(m);
        // The column's max in four independent chains (one chain waits on each max's latency).
        V mx0 = m_old, mx1 = m_old, mx2 = m_old, mx3 = m_old;
        std::int64_t j = 0;
        for (; j + 4 <= nkp; j += 4) {
          mx0 = simd_max(simd_load(col + j * PW), mx0);
          mx1 = simd_max(simd_load(col + (j + 1) * PW), mx1);
          mx2 = simd_max(simd_load(col + (j + 2) * PW), mx2);
          mx3 = simd_max(simd_load(col + (j + 3) * PW), mx3);
        }
        for (; j < nkp; ++j) mx0 = simd_max(simd_load(col + j * PW), mx0);
        const V mx = simd_max(simd_max(mx0, mx1), simd_max(mx2, mx3));
        // A column that saw only hidden keys keeps m = -inf; shifting it by 0 makes its
        // weights exp(-inf) = 0 instead of NaN. NaN scores pass through to the output.
        const V shift = mx == neg_inf ? V{} : mx;
        V sum{};
        for (j = 0; j < nkp; ++j) {
          const V e = exp_lanes(simd_load(col + j * PW) - shift);
          simd_store(col + j * PW, e);
          sum += e;
        }
        const V alpha = exp_lanes(m_old - shift);
        simd_store(s.alpha + c, alpha);
        simd_store(l, simd_fma(alpha, simd_load(l), sum));
        simd_store(m, mx);
      }

      // O^T = alpha O^T + V^T P^T: A is the packed V, B the P^T panel. A key hidden from some
      // lanes has P = 0 there, but 0 x V is NaN when V is (padding, a stale cache slot): those
      // keys are added with the hidden lanes masked out, so a hidden key never reaches a row.
      flash_tiles<true>(dim, s.vbuf, 1, MR, v_tile, st, PW, full, ot, PW, s.alpha);
      if (full < nkp)
        flash_tiles_masked(dim, s.vbuf + full * MR, MR, v_tile, st + full * PW, PW, nkp - full, ot, PW, s.hidden + full);
    }
  }

  for (std::int64_t i = 0; i < nq; ++i) {
    O* dst = out.row(b, i0 + i, h);
    const A l = s.l[i];
    const A inv = l != 0 ? A(1) / l : A(0);
    const A* col = s.ot + i / PW * qt_panel + i % PW;
    for (std::int64_t d = 0; d < dim; ++d) dst[d] = static_cast<O>(col[d * PW] * inv);
    if (!lse.absent()) lse(b, i0 + i, h) = l != 0 ? s.m[i] + std::log(l) : neg_inf;
  }
}
