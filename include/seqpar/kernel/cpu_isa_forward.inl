// CpuFlashKernel's forward for ONE instruction set: one (batch, head, query block) streamed
// over the key blocks (the layout is explained in kernel/cpu_flash_kernel.hpp; why this file
// has no include guard, in kernel/cpu_isa_kernels.hpp). Needs the SIMD layer
// (cpu_isa_simd.inl) of the same namespace.

/// Output rows [i0, i0 + bq) of head h of batch element b (fewer at the end of the sequence),
/// and their LSE when `lse` is present. The query block's Q^T, S^T and O^T are stored panel
/// by panel (PW queries wide, each panel contiguous), so a micro-kernel's B and C panels are
/// contiguous: with rows a power of two apart they would fall into a few L1 sets and evict
/// each other. V is packed per key block, MR head dims interleaved per key, for the same
/// reason (its rows are a power of two apart in the caller's tensor, and PV reads MR values
/// of each of them per pass).
template <class T, class O, class A>
void forward_query_block(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
                         TensorView<A> lse, const KernelParams& p, std::int64_t b, std::int64_t h,
                         std::int64_t i0, std::int64_t bq, const ForwardScratch<A>& s) {
  using V = simd_t<A>;
  constexpr int W = FlashTile<A>::width, PW = FlashTile<A>::panel, MR = FlashTile<A>::mr;
  static_assert(fwd_block_q % PW == 0 && 64 % PW == 0, "query blocks must be whole query panels");
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  const std::int64_t dim = q.dim(), nq = std::min(bq, q.seq() - i0), kh = p.kv_head(h);
  const std::int64_t ncols = (nq + PW - 1) / PW * PW;  // queries padded to whole panels
  const std::int64_t qt_panel = dim * PW, st_panel = fwd_block_k * PW;  // elements per panel
  const A scale = static_cast<A>(p.scale);
  // Element (row r, query column i) of a panel-major block whose panels hold `per_panel`.
  auto at = [](A* base, std::int64_t per_panel, std::int64_t r, std::int64_t i) {
    return base + i / PW * per_panel + r * PW + i % PW;
  };

  // Q^T, scaled; padding lanes are zero (finite scores, never written out).
  for (std::int64_t i = 0; i < ncols; ++i) {
    const T* src = i < nq ? q.row(b, i0 + i, h) : nullptr;
    for (std::int64_t d = 0; d < dim; ++d) *at(s.qt, qt_panel, d, i) = src ? static_cast<A>(src[d]) * scale : A(0);
    if (p.causal && src) s.qpos[i] = p.q_positions(i0 + i);
    s.m[i] = neg_inf;
    s.l[i] = 0;
  }
  std::fill(s.ot, s.ot + ncols * dim, A(0));

  const std::int64_t q_lo = p.causal ? s.qpos[0] : 0, q_hi = p.causal ? s.qpos[nq - 1] : 0;
  for (std::int64_t j0 = 0; j0 < k.seq(); j0 += fwd_block_k) {
    std::int64_t nk = std::min(fwd_block_k, k.seq() - j0);
    bool masked = false;
    if (p.causal) {
      const std::int64_t k_lo = p.k_positions(j0), k_hi = p.k_positions(j0 + nk - 1);
      if (p.fully_masked(q_hi, k_lo)) break;  // positions increase: every later block is hidden too
      masked = !p.fully_visible(q_lo, k_hi);
      if (masked) {
        // Keys after the block's last query are hidden from all of it: leave them out.
        std::int64_t seen = 0;
        for (; seen < nk; ++seen) {
          s.kpos[seen] = p.k_positions(j0 + seen);
          if (s.kpos[seen] > q_hi) break;
        }
        nk = seen;
      }
    }
    // K rows: the caller's memory when already in A, else converted once here.
    const A* kr;
    std::ptrdiff_t ks;
    if constexpr (std::is_same_v<T, A>) {
      kr = k.row(b, j0, kh);
      ks = k.stride[1];
    } else {
      for (std::int64_t j = 0; j < nk; ++j) {
        const T* ksrc = k.row(b, j0 + j, kh);
        for (std::int64_t d = 0; d < dim; ++d) s.kbuf[j * dim + d] = static_cast<A>(ksrc[d]);
      }
      kr = s.kbuf;
      ks = dim;
    }
    // V packed as tiles of MR head dims: tile t holds, key after key, dims [t MR, t MR + MR).
    const std::ptrdiff_t v_tile = MR * nk;
    for (std::int64_t j = 0; j < nk; ++j) {
      const T* vsrc = v.row(b, j0 + j, kh);
      for (std::int64_t d = 0; d < dim; ++d) s.vbuf[d / MR * v_tile + j * MR + d % MR] = static_cast<A>(vsrc[d]);
    }

    // Start the next key block's K rows on their way to L2 while this one computes: at long
    // sequences they come from L3 or memory, and the hardware prefetcher does not run far
    // enough ahead on MR interleaved row streams. (V is read once per block, in order.)
    if (const std::int64_t jn = j0 + fwd_block_k; jn < k.seq())
      for (std::int64_t j = jn, je = std::min(k.seq(), jn + fwd_block_k); j < je; ++j) {
        const char* kp = reinterpret_cast<const char*>(k.row(b, j, kh));
        for (std::int64_t off = 0; off < dim * std::int64_t(sizeof(T)); off += 64) __builtin_prefetch(kp + off, 0, 2);
      }
    // S^T = K Q^T, one query panel at a time (its Q^T panel stays in L1).
    for (std::int64_t c0 = 0; c0 < ncols; c0 += PW)
      flash_tiles<false>(nk, kr, ks, 1, MR * ks, s.qt + c0 / PW * qt_panel, PW, dim, s.st + c0 / PW * st_panel, PW,
                         static_cast<const A*>(nullptr));
    if (masked)
      for (std::int64_t j = 0; j < nk; ++j)
        for (std::int64_t i = 0; i < nq; ++i)
          if (s.kpos[j] > s.qpos[i]) *at(s.st, st_panel, j, i) = neg_inf;

    // Online softmax, W queries at a time: P^T = exp(S^T - m') in place.
    for (std::int64_t c = 0; c < ncols; c += W) {
      A* col = at(s.st, st_panel, 0, c);
      V mx = simd_load(s.m + c);
      const V m_old = mx;
      for (std::int64_t j = 0; j < nk; ++j) mx = simd_max(simd_load(col + j * PW), mx);
      // A column that saw only hidden keys keeps m = -inf; shifting it by 0 makes its
      // weights exp(-inf) = 0 instead of NaN. NaN scores pass through to the output.
      const V shift = mx == neg_inf ? V{} : mx;
      V sum{};
      for (std::int64_t j = 0; j < nk; ++j) {
        const V e = exp_lanes(simd_load(col + j * PW) - shift);
        simd_store(col + j * PW, e);
        sum += e;
      }
      const V alpha = exp_lanes(m_old - shift);
      simd_store(s.alpha + c, alpha);
      simd_store(s.l + c, simd_fma(alpha, simd_load(s.l + c), sum));
      simd_store(s.m + c, mx);
    }

    // O^T = alpha O^T + V^T P^T: A is the packed V, B a P^T panel.
    for (std::int64_t c0 = 0; c0 < ncols; c0 += PW)
      flash_tiles<true>(dim, s.vbuf, 1, MR, v_tile, s.st + c0 / PW * st_panel, PW, nk, s.ot + c0 / PW * qt_panel, PW,
                        s.alpha + c0);
  }

  for (std::int64_t i = 0; i < nq; ++i) {
    O* dst = out.row(b, i0 + i, h);
    const A l = s.l[i];
    const A inv = l != 0 ? A(1) / l : A(0);
    for (std::int64_t d = 0; d < dim; ++d) dst[d] = static_cast<O>(*at(s.ot, qt_panel, d, i) * inv);
    if (!lse.absent()) lse(b, i0 + i, h) = l != 0 ? s.m[i] + std::log(l) : neg_inf;
  }
}
