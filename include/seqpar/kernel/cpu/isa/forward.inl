// CpuFlashKernel's forward for ONE instruction set: one (batch, head, query block) streamed
// over the key blocks (the layout is explained in kernel/cpu/flash_kernel.hpp; why this file
// has no include guard, in kernel/cpu/isa_kernels.hpp). Needs the SIMD layer
// (cpu_isa_simd.inl) of the same namespace.

/// What a finished row writes: its output times `inv`, and its LSE.
template <class A>
struct RowEnd {
  A inv;  ///< 1 / l, or 0 for a row that saw no key (its output is then 0)
  A lse;  ///< m + log l, or -inf for a row that saw no key; NaN stays NaN
};

/// Closes a row with running max `m` and sum `l`.
template <class A>
inline RowEnd<A> row_end(A m, A l) {
  if (l == 0) return {A(0), -std::numeric_limits<A>::infinity()};
  return {A(1) / l, m + std::log(l)};
}

/// Keys a range boundary cuts, in a panel's S^T (`nkp` keys from key index `ja`, PW lanes, of
/// which the first `np` are rows with ranges [first, last]): keys [0, f0) and [f1, nkp) are
/// not seen by every lane. Both ends of the rows' ranges grow down the panel, so the lanes
/// that see key j are one interval [lane_lo[j], lane_hi[j]), whose ends grow with j; the
/// other lanes' scores become -inf.
template <int PW, class A>
[[gnu::always_inline]] inline void cut_keys(A* st, std::int64_t ja, std::int64_t nkp, std::int64_t f0, std::int64_t f1,
                                            std::int64_t np, const std::int64_t* first, const std::int64_t* last,
                                            std::int64_t* lane_lo, std::int64_t* lane_hi) {
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  std::int64_t lo = 0, hi = 0;
  auto cut = [&](std::int64_t j) {
    const std::int64_t key = ja + j;
    while (lo < np && last[lo] < key) ++lo;
    while (hi < np && first[hi] <= key) ++hi;
    hi = std::max(hi, lo);
    std::fill(st + j * PW, st + j * PW + lo, neg_inf);
    std::fill(st + j * PW + hi, st + j * PW + np, neg_inf);
    lane_lo[j] = lo;
    lane_hi[j] = hi;
  };
  for (std::int64_t j = 0; j < f0; ++j) cut(j);
  for (std::int64_t j = f1; j < nkp; ++j) cut(j);
}

/// The online-softmax step of a panel, W lanes at a time: P^T = exp(S^T - m') in place over
/// `nkp` keys of PW lanes; the panel's running max `m` and sum `l` updated, and the factor
/// `alpha` = exp(m - m') that rescales its output.
template <int PW, class A>
[[gnu::always_inline]] inline void softmax_panel(A* st, std::int64_t nkp, A* m_run, A* l_run, A* alpha) {
  using V = simd_t<A>;
  constexpr int W = FlashTile<A>::width;
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  for (std::int64_t c = 0; c < PW; c += W) {
    A* col = st + c;
    A *m = m_run + c, *l = l_run + c;
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
    // A max that did not move leaves the column as it is: alpha exactly 1, not exp's 1 + 1e-7,
    // which over a long cache of short blocks (a paged pool of small pages) drifts the sum.
    const V a = m_old == mx ? lanes_const<V>(1.0f) : exp_lanes(m_old - shift);
    simd_store(alpha + c, a);
    simd_store(l, simd_fma(a, simd_load(l), sum));
    simd_store(m, mx);
  }
}

/// The forward's two products in A, for every element type on every level: Q^T packed
/// pre-scaled, each key block's K rows and V tiles converted to A as they are packed, and
/// both products by flash_tiles, on query panels of NR vectors (forward_vectors). (The
/// AVX512-BF16 path, forward_bf16.inl, keeps bf16 and falls back on this one, with FlashTile's
/// panel, for blocks whose V holds a NaN or Inf.)
template <class T, class A, int NR = forward_vectors<A>>
struct ConvertedProducts {
  static constexpr int PW = NR * FlashTile<A>::width, MR = FlashTile<A>::mr;
  TensorView<const T> k, v;           ///< the call's K and V
  std::int64_t b, kh;                 ///< batch element, K/V head
  std::int64_t dim, dim_v;            ///< head dims of Q/K and V/O
  A scale;                            ///< what Q is scaled by (score_scale)
  const ForwardScratch<A>& s;         ///< the thread's scratch
  std::ptrdiff_t ldk = ForwardScratch<A>::ld_keys(dim);  ///< stride of the packed K rows
  std::int64_t whole = dim_v / MR * MR;                  ///< V dims in whole MR tiles
  std::ptrdiff_t v_tile = 0;                             ///< elements of one packed V tile
  bool v_finite = true;                                  ///< the block's V holds no NaN or Inf

  /// Query columns pack in groups of this many (forward_query_block).
  static constexpr int query_group = FlashTile<A>::width;

  /// Query columns [i, i + query_group) of the block (i a multiple of query_group), scaled,
  /// from the rows at `src` (null: a padding lane, zero).
  void pack_queries(std::int64_t i, const T* const* src) const {
    using V = simd_t<A>;
    const V sc = simd_splat(scale);
    auto load = [&](int r, std::int64_t d) {
      if (!src[r]) return V{};
      if constexpr (simd_loads_as<A, T>) {
        return simd_load_as<A>(src[r] + d) * sc;
      } else {
        V x;
        for (int w = 0; w < query_group; ++w) x[w] = static_cast<A>(src[r][d + w]);
        return x * sc;
      }
    };
    A* const col = s.qt + i / PW * (dim * PW) + i % PW;
    auto store = [&](int k, std::int64_t d, V x) { simd_store(col + (d + k) * PW, x); };
    for (std::int64_t d = transpose_blocks<V>(dim, load, store); d < dim; ++d)
      for (int r = 0; r < query_group; ++r) col[d * PW + r] = src[r] ? static_cast<A>(src[r][d]) * scale : A(0);
  }

  /// K rows copied (and converted to A) into rows ldk apart: in the caller's tensor a head's
  /// rows are a power of two apart (H D elements), and the MR rows a micro-kernel reads at
  /// once would share a few L1 sets.
  void pack_keys(std::int64_t j0, std::int64_t nk) {
    constexpr std::int64_t ahead = 8;
    for (std::int64_t j = 0; j < nk; ++j) {
      if (j + ahead < nk) prefetch_row(k.row(b, j0 + j + ahead, kh), dim, 3);
      const T* ksrc = k.row(b, j0 + j, kh);
      convert_values(ksrc, s.kbuf + j * ldk, dim);
    }
  }

  /// V packed as tiles of MR head dims: tile t holds, key after key, dims [t MR, t MR + MR).
  /// (Whole tiles take MR contiguous values at a time; a converted type whose vector holds
  /// several tiles' worth (AVX-512: 16 lanes, MR 8) is converted a vector at a time and stored
  /// a tile at a time: fp16 converted 8 at a time went one by one, 4% of its forward.)
  void pack_values(std::int64_t j0, std::int64_t nk) {
    constexpr std::int64_t ahead = 8;
    constexpr int W = Simd<A>::width;
    v_tile = MR * nk;
    for (std::int64_t j = 0; j < nk; ++j) {
      if (j + ahead < nk) prefetch_row(v.row(b, j0 + j + ahead, kh), dim_v, 3);
      const T* vsrc = v.row(b, j0 + j, kh);
      A* const dst = s.vbuf + j * MR;
      std::int64_t d0 = 0;
      if constexpr (!std::is_same_v<T, A> && simd_loads_as<A, T> && W % MR == 0)
        for (; d0 + W <= whole; d0 += W) {
          const simd_t<A> x = simd_load_as<A>(vsrc + d0);
          for (int t = 0; t < W / MR; ++t)
            std::memcpy(dst + (d0 / MR + t) * v_tile, reinterpret_cast<const A*>(&x) + t * MR, MR * sizeof(A));
        }
      for (; d0 < whole; d0 += MR)
        for (int r = 0; r < MR; ++r) dst[d0 / MR * v_tile + r] = static_cast<A>(vsrc[d0 + r]);
      for (std::int64_t d = whole; d < dim_v; ++d) dst[whole / MR * v_tile + d - whole] = static_cast<A>(vsrc[d]);
    }
    v_finite = all_finite(s.vbuf, whole * nk, s.vbuf + whole * nk, nk, dim_v - whole, MR);
  }

  /// Packs key block [j0, j0 + nk).
  void pack_block(std::int64_t j0, std::int64_t nk) {
    pack_keys(j0, nk);
    pack_values(j0, nk);
  }

  /// S^T = K Q^T of query panel `panel` over the `nkp` keys from key `off` of the block.
  void scores(std::int64_t panel, std::int64_t off, std::int64_t nkp, A* st) const {
    flash_tiles<false, NR, 1>(nkp, s.kbuf + off * ldk, ldk, 1, MR * ldk, s.qt + panel * (dim * PW), PW, dim, st, PW,
                       static_cast<const A*>(nullptr));
  }

  /// O^T = alpha O^T + V^T P^T of query panel `panel` over the `nkp` keys from key `off` of
  /// the block, P^T in `st`: A is the packed V, B the P^T panel (the rescale by alpha happens
  /// here, even with no unmasked key). A key hidden from some lanes has P = 0 exactly there,
  /// which adds nothing while V is finite; but 0 x V is NaN when V is (padding, a stale cache
  /// slot): in a block holding such a V row, the keys outside [f0, f1) are added with only the
  /// lanes that see them (lanes [lane_lo, lane_hi) per key), so a hidden key never reaches a row.
  void add_values(std::int64_t panel, std::int64_t off, std::int64_t nkp, std::int64_t f0, std::int64_t f1,
                  const A* st, const A* alpha, const std::int64_t* lane_lo, const std::int64_t* lane_hi) const {
    const A* const vp = s.vbuf + off * MR;
    A* const ot = s.ot + panel * (dim_v * PW);
    if (v_finite) {
      flash_tiles<true, NR, MR>(dim_v, vp, 1, MR, v_tile, st, PW, nkp, ot, PW, alpha);
    } else {
      flash_tiles<true, NR, MR>(dim_v, vp + f0 * MR, 1, MR, v_tile, st + f0 * PW, PW, f1 - f0, ot, PW, alpha);
      flash_tiles_masked<NR>(dim_v, vp, MR, v_tile, st, PW, f0, ot, PW, lane_lo, lane_hi);
      flash_tiles_masked<NR>(dim_v, vp + f1 * MR, MR, v_tile, st + f1 * PW, PW, nkp - f1, ot, PW, lane_lo + f1,
                         lane_hi + f1);
    }
  }
};

/// Output rows [i0, i0 + bq) of head h of batch element b (fewer at the end of the sequence),
/// and their LSE when `lse` is present. V and O have v.dim() head dims, Q and K q.dim(); with a
/// soft-cap, the scores come out as s / cap and each panel's are capped before the mask.
/// `Products` packs Q, K and V and forms the two products (ConvertedProducts, or the bf16 dot
/// products of forward_bf16.inl); this function owns the blocking, masks and softmax.
///
/// Per key block, K and V are packed once, then each panel of PW queries runs the whole step,
/// S^T = K Q^T, the online softmax and O^T += V^T P^T, on the keys it reaches (every row sees
/// one contiguous run of keys, its KeySpan: the block's key loop runs from its first row's
/// first key to its last row's last, skips blocks no panel reaches, and each panel is trimmed
/// to its own keys). The block's Q^T and O^T are stored panel by panel, each panel
/// contiguous, and the panel's S^T fits in L1. Large query blocks make K and V stream from L3
/// once per many queries; the next key block's rows are prefetched into L2 a slice per panel.
template <class T, class O, class A, class Products>
void forward_query_block(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
                         TensorView<A> lse, const KernelParams& p, std::int64_t b, std::int64_t h,
                         std::int64_t i0, std::int64_t bq, const ForwardScratch<A>& s, Products& products) {
  constexpr int PW = Products::PW;
  static_assert(PW <= max_forward_panel<A>, "the scratch holds one panel's S^T of at most max_forward_panel lanes");
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  const std::int64_t dim = q.dim(), dim_v = v.dim(), nq = std::min(bq, q.seq() - i0), kh = p.kv_head(h), sk = k.seq();
  const std::int64_t ncols = (nq + PW - 1) / PW * PW, panels = ncols / PW;  // queries padded to whole panels
  const std::int64_t ot_panel = dim_v * PW;  // elements of one O^T panel
  const A cap = static_cast<A>(p.softcap);

  // Q^T, a group of rows at a time (Products::pack_queries transposes them into lanes); padding
  // lanes are zero (finite scores, never written out). The next group's rows are prefetched:
  // a head's rows are H D elements apart, a stride the hardware prefetchers miss, and each is
  // read once.
  constexpr int G = Products::query_group;
  constexpr std::int64_t ahead = G;
  static_assert(PW % G == 0, "query panels are whole groups");
  for (std::int64_t g = 0; g < ncols; g += G) {
    const T* src[G];
    for (std::int64_t i = g; i < g + G; ++i) {
      if (i + ahead < nq) prefetch_row(q.row(b, i0 + i + ahead, h), dim, 3);
      src[i - g] = i < nq ? q.row(b, i0 + i, h) : nullptr;
      if (i < nq) {
        const KeySpan r = p.row_span(b, i0 + i, sk);
        s.first[i] = r.first;
        s.last[i] = r.last;
      }
      s.m[i] = neg_inf;
      s.l[i] = 0;
    }
    products.pack_queries(g, src);
  }
  std::fill(s.ot, s.ot + ncols * dim_v, A(0));

  // The keys each panel reaches (its rows' ranges joined) and the keys all of its rows see.
  std::int64_t block_lo = sk, block_hi = -1;
  for (std::int64_t panel = 0; panel < panels; ++panel) {
    const std::int64_t i = panel * PW;
    const PanelKeys r = PanelKeys::join(s.first + i, s.last + i, std::min(nq, i + PW) - i, sk);
    s.panel[panel] = r;
    block_lo = std::min(block_lo, r.reach.first);
    block_hi = std::max(block_hi, r.reach.last);
  }

  for (std::int64_t j0 = block_lo; j0 <= block_hi; j0 += fwd_block_k) {
    const std::int64_t nk = std::min(fwd_block_k, block_hi + 1 - j0), j1 = j0 + nk - 1;
    // A block in a gap between the rows' ranges (a window or a document boundary) is skipped.
    bool reached = false;
    for (std::int64_t panel = 0; panel < panels && !reached; ++panel)
      reached = s.panel[panel].reach.reaches(j0, j1);
    if (!reached) continue;
    products.pack_block(j0, nk);

    const std::int64_t jn = j0 + fwd_block_k, next = std::max<std::int64_t>(0, std::min(fwd_block_k, block_hi + 1 - jn));
    const std::int64_t slice = (next + panels - 1) / panels;  // next block's rows prefetched per panel
    for (std::int64_t c0 = 0, panel = 0; c0 < ncols; c0 += PW, ++panel) {
      // A slice of the next key block's K and V rows on their way to L2 while this block
      // computes: at long sequences they come from L3 or memory, and the hardware prefetcher
      // does not run far enough ahead on MR interleaved row streams.
      for (std::int64_t j = jn + panel * slice, je = std::min(jn + next, j + slice); j < je; ++j) {
        prefetch_row(k.row(b, j, kh), dim, 2);
        prefetch_row(v.row(b, j, kh), dim_v, 2);
      }
      // The keys [ja, ja + nkp) of the block this panel reaches; of those, [f0, f1) (counted
      // from ja) are seen by every row of the panel and need no mask.
      const auto [ja, nkp, f0, f1] = s.panel[panel].in_block(j0, j1);
      if (nkp <= 0) continue;  // nothing to add: the panel's state stays as it is
      const std::int64_t np = std::min<std::int64_t>(PW, nq - c0);
      A* const st = s.st;

      // S^T = K Q^T (the Q^T panel stays in L1), capped before the mask's -inf go in.
      products.scores(panel, ja - j0, nkp, st);
      if (cap > 0) softcap_scores(st, nkp * PW, cap);
      if (f0 > 0 || f1 < nkp) cut_keys<PW>(st, ja, nkp, f0, f1, np, s.first + c0, s.last + c0, s.lane_lo, s.lane_hi);
      softmax_panel<PW>(st, nkp, s.m + c0, s.l + c0, s.alpha);
      products.add_values(panel, ja - j0, nkp, f0, f1, st, s.alpha, s.lane_lo, s.lane_hi);
    }
  }

  // The rows out, W at a time: lanes [g, g + W) of O^T turned back into rows, times 1 / l.
  using V = simd_t<A>;
  constexpr int W = FlashTile<A>::width;
  for (std::int64_t g = 0; g < nq; g += W) {
    const int rows = static_cast<int>(std::min<std::int64_t>(W, nq - g));
    A inv[W];
    O* dst[W];
    for (int r = 0; r < rows; ++r) {
      const RowEnd<A> e = row_end(s.m[g + r], s.l[g + r]);
      inv[r] = e.inv;
      dst[r] = out.row(b, i0 + g + r, h);
      if (!lse.absent()) lse(b, i0 + g + r, h) = e.lse;
    }
    const A* const col = s.ot + g / PW * ot_panel + g % PW;
    auto load = [&](int k, std::int64_t d) { return simd_load(col + (d + k) * PW); };
    auto store = [&](int r, std::int64_t d, V x) {
      if (r >= rows) return;
      x *= inv[r];
      if constexpr (simd_stores_as<O, A>)
        simd_store_as<O, A>(dst[r] + d, x);
      else
        for (int w = 0; w < W; ++w) dst[r][d + w] = static_cast<O>(x[w]);
    };
    for (std::int64_t d = transpose_blocks<V>(dim_v, load, store); d < dim_v; ++d)
      for (int r = 0; r < rows; ++r) dst[r][d] = static_cast<O>(col[d * PW + r] * inv[r]);
  }
}
