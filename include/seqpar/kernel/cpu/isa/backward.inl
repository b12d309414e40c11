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

/// Whether the `n` values at `x` are all finite: an exponent field of all ones (Inf or NaN) is
/// looked for in the bits, which vectorises (a float test would be a chain of compares).
template <class T>
inline bool finite_values(const T* x, std::int64_t n) {
  using U = std::conditional_t<sizeof(T) == 8, std::uint64_t,
                               std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint16_t>>;
  constexpr U exponent = sizeof(T) == 8 ? U(0x7ff0000000000000ull) : sizeof(T) == 4 ? U(0x7f800000u)
                         : std::is_same_v<T, f16> ? U(0x7c00u) : U(0x7f80u);
  U bad = 0;
  for (std::int64_t d = 0; d < n; ++d) {
    U bits;
    std::memcpy(&bits, x + d, sizeof bits);
    bad |= static_cast<U>((bits & exponent) == exponent);
  }
  return bad == 0;
}

/// Task t of the delta pass: delta = dO . O of FlashBackward::delta_rows query rows of one
/// (batch, head), each summed in vector lanes where it can (a scalar sum is one long chain of
/// dependent adds).
template <class T, class A>
inline void backward_delta_task(const FlashBackward<T, A>& job, std::int64_t t) {
  using V = simd_t<A>;
  constexpr std::int64_t W = FlashTile<A>::width, R = FlashBackward<T, A>::delta_rows;
  const std::int64_t runs = (job.q.seq() + R - 1) / R, pair = t / runs, h = pair % job.q.heads(), b = pair / job.q.heads();
  const std::int64_t dim_v = job.v.dim(), i0 = t % runs * R, i1 = std::min(job.q.seq(), i0 + R);
  for (std::int64_t i = i0; i < i1; ++i) {
    const T* dor = job.dout.row(b, i, h);
    const T* orow = job.out.row(b, i, h);
    V acc{};
    std::int64_t d = 0;
    if constexpr (simd_loads_as<A, T>)
      for (; d + W <= dim_v; d += W) acc = simd_fma(simd_load_as<A>(dor + d), simd_load_as<A>(orow + d), acc);
    A dl = 0;
    for (; d < dim_v; ++d) dl += static_cast<A>(dor[d]) * static_cast<A>(orow[d]);
    for (std::int64_t w = 0; w < W; ++w) dl += acc[w];
    // A row whose Q or dO holds a NaN or Inf is marked by a NaN delta (read once per row here,
    // not once per tile): backward_pack_rows then adds its terms apart, where NaN is what
    // they are anyway.
    if (!finite_values(job.q.row(b, i, h), job.q.dim()) || !finite_values(dor, dim_v))
      dl = std::numeric_limits<A>::quiet_NaN();
    job.delta(b, i, h) = dl;
  }
}

/// Packs a tile's rows through `products` (pack_row, then rows_packed) and sets their LSE and
/// delta (from the delta pass); a row that saw no key at all (LSE -inf) sees none of the block
/// either, and a row that sees none of the block is packed as zeros (null rows). A row that
/// sees keys of the block but whose delta is not finite (its Q or dO holds a NaN or Inf, see
/// backward_delta_task, or its O does) is packed as zeros too, with LSE +inf and delta 0 (so
/// that its P and dS are exactly 0), and listed in s.bad_rows: every product would carry its
/// NaN to keys it does not see (0 x NaN), so its terms are added apart (backward_row_apart).
/// Returns how many rows are listed.
template <class T, class A, class Products>
inline std::int64_t backward_pack_rows(const FlashBackward<T, A>& job, std::int64_t b, std::int64_t h,
                                       std::int64_t i0, std::int64_t nq, const BackwardScratch<A>& s,
                                       const Products& products) {
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < nq; ++i) {
    s.lrow[i] = job.lse(b, i0 + i, h);
    if (s.lrow[i] == -std::numeric_limits<A>::infinity()) s.row_hi[i] = s.row_lo[i] - 1;
    // A row that sees none of the block adds nothing: its P and dS are 0, but dK += dS^T Q
    // and dV += P^T dO still multiply them by its Q and dO rows, and 0 x NaN is NaN (a row
    // that sees no key may hold anything, NaN included, and its O is 0 whatever it holds).
    if (s.row_lo[i] > s.row_hi[i]) {
      products.pack_row(i, nullptr, nullptr);
      s.delta[i] = 0;
      continue;
    }
    const A delta = job.delta(b, i0 + i, h);
    if (!std::isfinite(delta)) {
      products.pack_row(i, nullptr, nullptr);
      s.lrow[i] = std::numeric_limits<A>::infinity();
      s.delta[i] = 0;
      s.bad_rows[bad++] = i;
      continue;
    }
    products.pack_row(i, job.q.row(b, i0 + i, h), job.dout.row(b, i0 + i, h));
    s.delta[i] = delta;
  }
  products.rows_packed(nq);
  return bad;
}

/// The terms of tile row `i` (of the query block from i0; its Q or dO holds a NaN or Inf, see
/// backward_pack_rows) over the task's keys [lo, hi] (from j0), one key at a time in the
/// accumulation type with the products' formulas, so that NaN and Inf reach exactly the
/// gradients the definition gives them: dV and dK of those keys (added to the call's rows,
/// which only this task writes) when `dq` is null, else the row's dQ terms (added to `dq`).
template <class T, class A>
inline void backward_row_apart(const FlashBackward<T, A>& job, std::int64_t b, std::int64_t h, std::int64_t kh,
                               std::int64_t i0, std::int64_t i, std::int64_t j0, std::int64_t lo, std::int64_t hi,
                               A* dq) {
  const KernelParams& p = job.p;
  const std::int64_t dim = job.q.dim(), dim_v = job.v.dim();
  const T* q = job.q.row(b, i0 + i, h);
  const T* dout = job.dout.row(b, i0 + i, h);
  const A scale = static_cast<A>(p.scale), cap = static_cast<A>(p.softcap);
  const A lse = job.lse(b, i0 + i, h), delta = job.delta(b, i0 + i, h);
  for (std::int64_t j = lo; j <= hi; ++j) {
    const T* k = job.k.row(b, j0 + j, kh);
    const T* v = job.v.row(b, j0 + j, kh);
    A x = 0, dp = 0;
    for (std::int64_t d = 0; d < dim; ++d) x += static_cast<A>(q[d]) * static_cast<A>(k[d]);
    for (std::int64_t d = 0; d < dim_v; ++d) dp += static_cast<A>(dout[d]) * static_cast<A>(v[d]);
    A pr, ds;
    if (cap > 0) {
      const A t = std::tanh(x * scale / cap);
      pr = std::exp(cap * t - lse);
      ds = pr * (dp - delta) * scale * (A(1) - t * t);
    } else {
      pr = std::exp(x * scale - lse);
      ds = pr * (dp - delta) * scale;
    }
    if (dq) {
      for (std::int64_t d = 0; d < dim; ++d) dq[d] += ds * static_cast<A>(k[d]);
      continue;
    }
    A* dk = job.dk.row(b, j0 + j, kh);
    A* dv = job.dv.row(b, j0 + j, kh);
    for (std::int64_t d = 0; d < dim; ++d) dk[d] += ds * static_cast<A>(q[d]);
    for (std::int64_t d = 0; d < dim_v; ++d) dv[d] += pr * static_cast<A>(dout[d]);
  }
}

/// P and dS of one row at W keys, from its scores `x` (Q K^T) and `dp` (dO V^T): P = exp(x
/// scale - LSE) and dS = P (dP - delta) scale; capped (x scale = cap t, the score cap tanh(t)),
/// P = exp(cap tanh(t) - LSE) and dS also times tanh's slope, 1 - tanh(t)^2. `nl` is -LSE,
/// `dl` delta; the caller selects 0 at the keys the row does not see.
template <bool Capped, class V>
struct ProbabilityLanes {
  V sc, to_x, cv, one;  ///< scale, scale / cap, cap, 1 in every lane
  V lane;               ///< lane w holds w (key indices from a vector's first key)

  /// P and dS (see the struct).
  [[gnu::always_inline]] void operator()(V x, V dp, V nl, V dl, V& p, V& ds) const {
    if constexpr (Capped) {
      const V t = softcap_lanes(x * to_x, one);
      p = exp_lanes(simd_fma(t, cv, nl));
      ds = p * (dp - dl) * (sc * simd_fma(-t, t, one));
    } else {
      p = exp_lanes(simd_fma(x, sc, nl));
      ds = p * (dp - dl) * sc;
    }
  }

  /// P and dS at keys c .. c + W of a row that sees keys [lo, hi], from its scores at `x` and
  /// `dp` (nl, dl as for operator()): exactly 0 at the keys it does not see (selected, not
  /// multiplied: S or dP is NaN at a key whose K or V is). A vector wholly outside [lo, hi]
  /// takes no exp, one wholly inside no select.
  template <class A>
  [[gnu::always_inline]] void at(const A* x, const A* dp, V nl, V dl, std::int64_t lo, std::int64_t hi, std::int64_t c,
                                 V& p, V& ds) const {
    constexpr std::int64_t W = Simd<A>::width;
    if (c > hi || c + W <= lo) {
      p = ds = V{};
      return;
    }
    (*this)(simd_load(x), simd_load(dp), nl, dl, p, ds);
    if (c >= lo && c + W - 1 <= hi) return;
    const V key = lane + static_cast<A>(c);
    const auto seen = (key >= static_cast<A>(lo)) & (key <= static_cast<A>(hi));
    p = seen ? p : V{};
    ds = seen ? ds : V{};
  }

  /// For `scale` and `cap` (0: none).
  template <class A>
  static ProbabilityLanes make(A scale, A cap) {
    V lane{};
    for (std::int64_t w = 0; w < Simd<A>::width; ++w) lane[w] = static_cast<A>(w);
    return {simd_splat(scale), simd_splat(Capped ? scale / cap : A(0)), simd_splat(cap), simd_splat(A(1)), lane};
  }
};

/// dQ += dS[i][j] K[j] for the tile's rows i (of `nq`) that see key j, whose K row holds a
/// NaN or Inf and so was left out of the dQ product (dS[i][j] and K[j][d] read by the
/// callables (i) and (d)).
template <class A, class DsAt, class KAt>
inline void backward_add_bad_key(const BackwardScratch<A>& s, std::int64_t j, std::int64_t nq, std::int64_t dim,
                                 std::int64_t ld, DsAt ds_at, KAt k_at) {
  for (std::int64_t i = 0; i < nq; ++i) {
    if (j < s.row_lo[i] || j > s.row_hi[i]) continue;
    const A g = ds_at(i);
    for (std::int64_t d = 0; d < dim; ++d) s.dqs[i * ld + d] += g * static_cast<A>(k_at(d));
  }
}

/// The first of the tile's `nq` rows whose last key seen (s.row_hi) is c0 or later: the rows
/// before it see no key of a panel from c0 on. S and dP of such a panel are formed from that
/// row on: on a causal diagonal the rows above the panel's first key see none of it, and P and
/// dS there are 0 without reading S (ProbabilityLanes::at). Where every row reaches the panel
/// (no causal diagonal) this costs one comparison.
template <class A>
inline std::int64_t first_row_reaching(const BackwardScratch<A>& s, std::int64_t nq, std::int64_t c0) {
  std::int64_t r = 0;
  while (r < nq && s.row_hi[r] < c0) ++r;
  return r;
}

/// The backward's operands and products in the accumulation type A, every element type
/// converted on the way in (the path of float, double, and of bf16 / fp16 where no dot
/// product path runs): the five products of a tile through flash_tiles. One per task: its
/// batch element `b` and K/V head `kh` fixed.
template <class T, class A>
struct ConvertedBackward {
  using S = BackwardScratch<A>;
  static constexpr std::int64_t PW = FlashTile<A>::panel, MR = FlashTile<A>::mr, lk = S::ld_keys();
  const FlashBackward<T, A>& job;  ///< the call
  const S& s;                      ///< the thread's scratch
  std::int64_t b, kh;              ///< the task's batch element and K/V head
  std::int64_t dim = job.q.dim(), dim_v = job.v.dim();
  std::int64_t dp = S::padded(dim), ld = S::ld_dim(dim), dpv = S::padded(dim_v), ldv = S::ld_dim(dim_v);
  std::int64_t nbad = 0;  ///< keys of the block on s.bad

  /// K (dim rows), K^T and V^T (key rows, zero past the block's keys up to a whole panel) of
  /// the `nk` keys from j0. A K row holding a NaN or Inf goes into K (the B of dQ = dS K) as
  /// zeros and onto the `bad` list: a row that does not see the key has dS = 0 there, but 0 x
  /// NaN would still reach its dQ; the rows that see it get its term added apart.
  void pack_block(std::int64_t j0, std::int64_t nk) {
    const auto &k = job.k, &v = job.v;
    const std::int64_t kcols = (nk + PW - 1) / PW * PW;
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
  }

  /// Query row `i` of the tile from `q` and `dout` (null: zeros), zero-padded to whole panels.
  void pack_row(std::int64_t i, const T* q, const T* dout) const {
    auto copy = [](const T* src, std::int64_t n, std::int64_t padded, A* dst) {
      if (src) convert_values(src, dst, n);
      std::fill(dst + (src ? n : 0), dst + padded, A(0));
    };
    copy(q, dim, dp, s.qs + i * ld);
    copy(dout, dim_v, dpv, s.dos + i * ldv);
  }

  /// After the tile's rows (nothing to add here).
  void rows_packed(std::int64_t) const {}

  /// P and dS of the tile's `nq` rows over key columns [c_lo, c_hi), in place of S (s.pm) and
  /// dP (s.ds): ProbabilityLanes::at.
  template <bool Capped>
  [[gnu::always_inline]] void probabilities(std::int64_t nq, std::int64_t c_lo, std::int64_t c_hi) const {
    using V = simd_t<A>;
    constexpr std::int64_t W = FlashTile<A>::width;
    const auto lanes = ProbabilityLanes<Capped, V>::make(static_cast<A>(job.p.scale), static_cast<A>(job.p.softcap));
    for (std::int64_t i = 0; i < nq; ++i) {
      const V nl = simd_splat(-s.lrow[i]), dl = simd_splat(s.delta[i]);
      for (std::int64_t c = c_lo; c < c_hi; c += W) {
        A* pr = s.pm + i * lk + c;
        A* dr = s.ds + i * lk + c;
        V p, ds;
        lanes.at(pr, dr, nl, dl, s.row_lo[i], s.row_hi[i], c, p, ds);
        simd_store(pr, p);
        simd_store(dr, ds);
      }
    }
  }

  /// The tile's products over the keys [kmin, kmax] some row sees but dQ's: S = Q K^T and dP
  /// = dO V^T with keys in the lanes (whole key panels from kmin's), P and dS, then dV += P^T
  /// dO and dK += dS^T Q (over the tile's queries) with head dims in the lanes.
  void products(std::int64_t nq, std::int64_t kmin, std::int64_t kmax) const {
    const std::int64_t nv = kmax + 1 - kmin, c_lo = kmin / PW * PW, c_hi = (kmax + PW) / PW * PW;
    for (std::int64_t c0 = c_lo; c0 < c_hi; c0 += PW) {
      const std::int64_t r0 = first_row_reaching(s, nq, c0);
      flash_tiles<false, 2, 1>(nq - r0, s.qs + r0 * ld, ld, 1, MR * ld, s.kt + c0, lk, dim, s.pm + r0 * lk + c0, lk,
                               static_cast<const A*>(nullptr));
      flash_tiles<false, 2, 1>(nq - r0, s.dos + r0 * ldv, ldv, 1, MR * ldv, s.vt + c0, lk, dim_v, s.ds + r0 * lk + c0,
                               lk, static_cast<const A*>(nullptr));
    }
    if (job.p.softcap > 0)
      probabilities<true>(nq, c_lo, c_hi);
    else
      probabilities<false>(nq, c_lo, c_hi);
    for (std::int64_t c0 = 0; c0 < std::max(dp, dpv); c0 += PW) {
      if (c0 < dpv)
        flash_tiles<true, 2, lk>(nv, s.pm + kmin, 1, lk, MR, s.dos + c0, ldv, nq, s.dvs + kmin * ldv + c0, ldv, s.ones);
      if (c0 < dp)
        flash_tiles<true, 2, lk>(nv, s.ds + kmin, 1, lk, MR, s.qs + c0, ld, nq, s.dks + kmin * ld + c0, ld, s.ones);
    }
  }

  /// The tile's dQ share of keys [kmin, kmax] (after products): dS K into s.dqs, head dims in
  /// the lanes, then the terms of those keys whose K row is non-finite.
  void dq_share(std::int64_t nq, std::int64_t kmin, std::int64_t kmax) const {
    for (std::int64_t c0 = 0; c0 < dp; c0 += PW)
      flash_tiles<false, 2, 1>(nq, s.ds + kmin, lk, 1, MR * lk, s.ks + kmin * ld + c0, ld, kmax + 1 - kmin, s.dqs + c0,
                               ld, static_cast<const A*>(nullptr));
    for (std::int64_t n = 0; n < nbad; ++n) {
      const std::int64_t j = s.bad[n];
      if (j < kmin || j > kmax) continue;
      backward_add_bad_key(s, j, nq, dim, ld, [&](std::int64_t i) { return s.ds[i * lk + j]; },
                           [&](std::int64_t d) { return s.kt[d * lk + j]; });
    }
  }
};

/// dst[d] += src[d] for d < n, a vector at a time (GCC 12 at -O2 leaves the plain loop scalar:
/// it would need a run-time check that the rows do not overlap).
template <class A>
inline void add_row(const A* src, std::int64_t n, A* dst) {
  constexpr std::int64_t W = Simd<A>::width;
  std::int64_t d = 0;
  for (; d + W <= n; d += W) simd_store(dst + d, simd_load(dst + d) + simd_load(src + d));
  for (; d < n; ++d) dst[d] += src[d];
}

/// Keys [kmin, kmax] of the block [lo, hi] (task key indices) that the tile's `nq` rows see
/// by s.row_lo / s.row_hi (kmax < kmin: none).
template <class A>
inline void tile_key_span(const BackwardScratch<A>& s, std::int64_t nq, std::int64_t lo, std::int64_t hi,
                          std::int64_t& kmin, std::int64_t& kmax) {
  kmin = hi + 1;
  kmax = lo - 1;
  for (std::int64_t i = 0; i < nq; ++i) {
    const std::int64_t a = std::max(s.row_lo[i], lo), z = std::min(s.row_hi[i], hi);
    if (a > z) continue;
    kmin = std::min(kmin, a);
    kmax = std::max(kmax, z);
  }
}

/// Runs task t of `job` (key blocks [t / P x n, t / P x n + n) of pair t % P, P = batch x K/V
/// heads, n = job.blocks_per_task) with the operands and products of `Products`
/// (ConvertedBackward, or a dot product path). A tile's products run over every key of the
/// task that a row sees, but its dQ share is formed and added one key block at a time, each
/// in its own turn: so a task of two blocks adds to dQ exactly the sums, in exactly the order,
/// that two tasks of one block each would, and the result does not depend on blocks_per_task
/// (nor on the thread count that chose it). Every other sum is per key or per element.
template <class Products, class T, class A>
void backward_task(const FlashBackward<T, A>& job, std::int64_t t, const BackwardScratch<A>& s, std::int32_t* turns) {
  constexpr std::int64_t BQ = FlashBackward<T, A>::BQ, BK = FlashBackward<T, A>::BK;
  static_assert(BK % FlashTile<A>::panel == 0 && max_panel<A> % FlashTile<A>::panel == 0,
                "key blocks and scratch rows must be whole panels");
  const auto &q = job.q, &k = job.k;
  const std::int64_t pairs = q.batch() * k.heads(), b = t % pairs / k.heads(), kh = t % pairs % k.heads();
  const std::int64_t jb = t / pairs * job.blocks_per_task, j0 = jb * BK;
  const std::int64_t nk = std::min(BK * job.blocks_per_task, k.seq() - j0);
  const std::int64_t dim = q.dim(), dim_v = job.v.dim(), nqb = job.query_blocks();
  const std::int64_t ld = BackwardScratch<A>::ld_dim(dim), ldv = BackwardScratch<A>::ld_dim(dim_v);
  Products products{job, s, b, kh};
  products.pack_block(j0, nk);
  // dK and dV of the task's keys, key-major in s.dks and s.dvs unless the products keep them
  // in a layout of their own (AmxBackward: head dims by keys).
  if constexpr (requires { products.clear_key_gradients(nk); }) {
    products.clear_key_gradients(nk);
  } else {
    for (std::int64_t j = 0; j < nk; ++j) {
      std::fill(s.dks + j * ld, s.dks + j * ld + BackwardScratch<A>::padded(dim), A(0));
      std::fill(s.dvs + j * ldv, s.dvs + j * ldv + BackwardScratch<A>::padded(dim_v), A(0));
    }
  }
  bool touched = false;
  for (std::int64_t h = 0; h < q.heads(); ++h) {
    if (job.p.kv_head(h) != kh) continue;
    for (std::int64_t ib = 0; ib < nqb; ++ib) {
      const std::int64_t i0 = ib * BQ, nq = std::min(BQ, q.seq() - i0);
      // Skip the query blocks that see none of this task's keys.
      std::int64_t prev = -1;
      if (!backward_tile_keys(job, b, i0, nq, j0, nk, s, prev)) continue;
      touched = true;
      // The last of the task's blocks the rows see by the mask (a later block's task waits
      // for the turn after it): the block of the last key any row sees (each row sees one
      // run of keys), taken before rows that saw no key at all are dropped.
      std::int64_t first_seen, last_seen;
      tile_key_span(s, nq, 0, nk - 1, first_seen, last_seen);
      const std::int64_t last = last_seen / BK;
      const std::int64_t bad_rows = backward_pack_rows(job, b, h, i0, nq, s, products);
      // (No software prefetch of the next query block's rows: a burst of them before the
      // tile's products measured 2-6% slower at S 2048-8192, D 64 and 128, than the hardware
      // prefetchers alone; the rows are read in order, which those follow.)
      // Keys [kmin, kmax] are those some row sees: the others add nothing and are left out
      // of every product.
      std::int64_t kmin, kmax;
      tile_key_span(s, nq, 0, nk - 1, kmin, kmax);
      if (kmax >= kmin) products.products(nq, kmin, kmax);
      for (std::int64_t r = 0; r < bad_rows; ++r) {
        const std::int64_t i = s.bad_rows[r];
        backward_row_apart<T, A>(job, b, h, kh, i0, i, j0, s.row_lo[i], s.row_hi[i], nullptr);
      }
      // Each key block's dQ share goes after that of `prev`, the last earlier block that
      // these rows see (so in key block order whatever the threads).
      std::int32_t* turn = turns ? turns + (b * q.heads() + h) * nqb + ib : nullptr;
      if (turn) wait_turn(*turn, static_cast<std::int32_t>(prev + 1));
      for (std::int64_t n = 0; n <= last && kmax >= kmin; ++n) {
        std::int64_t lo, hi;  // keys of the task's block n that the rows see
        tile_key_span(s, nq, n * BK, std::min(nk, n * BK + BK) - 1, lo, hi);
        if (hi < lo) continue;
        products.dq_share(nq, lo, hi);
        for (std::int64_t r = 0; r < bad_rows; ++r) {
          const std::int64_t i = s.bad_rows[r];
          const std::int64_t a = std::max(s.row_lo[i], lo), z = std::min(s.row_hi[i], hi);
          if (a <= z) backward_row_apart<T, A>(job, b, h, kh, i0, i, j0, a, z, s.dqs + i * ld);
        }
        for (std::int64_t i = 0; i < nq; ++i) add_row(s.dqs + i * ld, dim, job.dq.row(b, i0 + i, h));
      }
      if (turn) pass_turn(*turn, static_cast<std::int32_t>(jb + last + 1));
    }
  }
  if (!touched) return;
  if constexpr (requires { products.add_key_gradients(nk); }) {
    products.add_key_gradients(nk);
  } else {
    for (std::int64_t j = 0; j < nk; ++j) {
      add_row(s.dks + j * ld, dim, job.dk.row(b, j0 + j, kh));
      add_row(s.dvs + j * ldv, dim_v, job.dv.row(b, j0 + j, kh));
    }
  }
}
