#pragma once
/// \file
/// Backward of CpuFlashKernel (FlashAttention-2 style): probabilities are recomputed from the
/// saved LSE one (query block, key block) tile at a time, so memory stays O(block).
///
/// Work split. A task is one key block of one (batch, K/V head): it owns that block's dK, dV
/// rows (summed in scratch over every query block and every query head of the group, then
/// added to the caller's once), so tasks never share a dK or dV row. dQ rows are shared by
/// every key block; each task forms its dQ share of a tile in scratch and adds it to the
/// caller's rows in key-block order: a per-(batch, head, query block) turn counter says
/// which key block may add next. The sums, and their order, are thus the same whatever the
/// thread count, and dq, dk, dv are bit-identical from 1 to N threads, with no dQ copy per
/// thread to reduce. Tasks are numbered key block major, so threads first run different
/// (batch, K/V head) pairs, which never wait for each other; when there are fewer pairs
/// than threads, consecutive key blocks of one pair pipeline, the later one a tile behind.
/// Deadlock-free because the pool hands tasks out in increasing order and a causal mask
/// hides, from a query block, a suffix of the key blocks: the earliest running task never
/// waits.
///
/// Per tile (BQ queries, BK keys) five products run through one register-tiled
/// micro-kernel (kernel/cpu_flash_tile.hpp): S = Q K^T and dP = dO V^T with keys in the SIMD
/// lanes, then P = exp(S scale - LSE) and dS = P (dP - delta) scale lane-wise, then
/// dV += P^T dO, dK += dS^T Q and dQ = dS K with head dims in the lanes. A tile stops at the
/// last key any of its rows sees (causal diagonals). Every operand is packed into scratch,
/// rows zero-padded to whole panels, which serves every head_dim, stride and element type
/// with one code path; and it is faster than reading the caller's rows: rows of one head are
/// a power-of-two stride apart there and fall into a few L1 sets. Scratch rows are one panel
/// longer than their data for the same reason.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <thread>
#include <type_traits>

#include "seqpar/kernel/cpu_flash_tile.hpp"
#include "seqpar/kernel/fast_exp.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"

namespace seqpar::detail {

/// Query rows and key rows of a backward tile. Each task streams every query row of its heads
/// once per key block, so wide key blocks pay: 256 against 64 keys takes 7-18% less time at
/// head_dim 256 to 64 (seq 2048, 8 heads, non-causal). 72 query rows are whole register tiles of 6 and 8
/// rows; 256 keys are whole panels on every target.
inline constexpr std::int64_t bwd_block_q = 72, bwd_block_k = 256;

/// One thread's backward scratch for accumulation type A, carved from one byte range.
/// "Key rows" are ld_keys() long, "dim rows" ld_dim(dim) long.
template <class A>
struct BackwardScratch {
  A* ks;     ///< [BK] dim rows: keys (B of dQ = dS K)
  A* kt;     ///< [dim] key rows: keys transposed (B of S)
  A* vt;     ///< [dim] key rows: values transposed (B of dP)
  A* dks;    ///< [BK] dim rows: dK of the task's key block
  A* dvs;    ///< [BK] dim rows: dV of the task's key block
  A* qs;     ///< [BQ] dim rows: queries
  A* dos;    ///< [BQ] dim rows: output gradients
  A* dqs;    ///< [BQ] dim rows: this tile's dQ share
  A* pm;     ///< [BQ] key rows: S, then P
  A* ds;     ///< [BQ] key rows: dP, then dS
  A* lrow;   ///< [BQ] LSE of the tile's rows
  A* delta;  ///< [BQ] rowsum(dO * O)
  A* ones;   ///< one panel of 1 (the alpha of an accumulating micro-kernel call)
  std::int64_t* limit;  ///< [BQ] keys of the block the row sees (a prefix: positions increase)
  std::int64_t* kpos;   ///< [BK] global positions of the block's keys

  /// Head dim rounded up to whole micro-kernel panels (the columns the products form).
  static constexpr std::int64_t padded(std::int64_t dim) {
    constexpr std::int64_t pw = FlashTile<A>::panel;
    return (dim + pw - 1) / pw * pw;
  }
  /// Stride of dim rows: one panel more than needed, so that rows are not a power of two apart.
  static constexpr std::int64_t ld_dim(std::int64_t dim) { return padded(dim) + FlashTile<A>::panel; }
  /// Stride of key rows (same reason).
  static constexpr std::int64_t ld_keys() { return bwd_block_k + FlashTile<A>::panel; }

  /// Carves the scratch for head dim `dim` at `base`, or with a null base only measures it;
  /// returns the bytes used.
  static std::size_t carve(std::byte* base, std::int64_t dim, BackwardScratch* s) {
    constexpr std::int64_t BQ = bwd_block_q, BK = bwd_block_k;
    const std::int64_t ld = ld_dim(dim), lk = ld_keys();
    BackwardScratch tmp;
    BackwardScratch& r = s ? *s : tmp;
    std::size_t used = 0;
    auto take = [&](auto*& ptr, std::int64_t count) {
      using E = std::remove_reference_t<decltype(*ptr)>;
      ptr = reinterpret_cast<E*>(base + used);
      used += (static_cast<std::size_t>(count) * sizeof(E) + 63) / 64 * 64;
    };
    take(r.ks, BK * ld);
    take(r.kt, dim * lk);
    take(r.vt, dim * lk);
    take(r.dks, BK * ld);
    take(r.dvs, BK * ld);
    take(r.qs, BQ * ld);
    take(r.dos, BQ * ld);
    take(r.dqs, BQ * ld);
    take(r.pm, BQ * lk);
    take(r.ds, BQ * lk);
    take(r.lrow, BQ);
    take(r.delta, BQ);
    take(r.ones, FlashTile<A>::panel);
    take(r.limit, BQ);
    take(r.kpos, BK);
    if (s) std::fill(r.ones, r.ones + FlashTile<A>::panel, A(1));
    return used;
  }
};

/// Bytes of one thread's backward scratch for head dims up to `dim`, float or double
/// (rounded to 256 so that slices stay aligned).
inline std::size_t flash_backward_thread_bytes(std::int64_t dim) {
  const std::size_t n = std::max(BackwardScratch<float>::carve(nullptr, dim, nullptr),
                                 BackwardScratch<double>::carve(nullptr, dim, nullptr));
  return (n + 255) / 256 * 256;
}

/// Spins briefly, then sleeps on the counter, until `turn` reaches `mine`. The acquire load
/// makes the earlier key blocks' dQ adds visible.
inline void wait_turn(std::int32_t& turn, std::int32_t mine) {
  std::atomic_ref<std::int32_t> t(turn);
  for (int spin = 0;; ++spin) {
    const std::int32_t seen = t.load(std::memory_order_acquire);
    if (seen == mine) return;
    if (spin < 64) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#else
      std::this_thread::yield();
#endif
    } else {
      t.wait(seen, std::memory_order_acquire);  // a shared machine: do not burn a preempted peer's core
    }
  }
}

/// Hands `turn` to key block `next` (release: this block's dQ adds happen before).
inline void pass_turn(std::int32_t& turn, std::int32_t next) {
  std::atomic_ref<std::int32_t> t(turn);
  t.store(next, std::memory_order_release);
  t.notify_all();
}

/// One backward call: the views, and task(t) for every t in [0, tasks()). `turns` (one
/// int32 per (batch, head, query block), zeroed before the first task) orders the dQ adds
/// when tasks run concurrently; tasks run one by one in increasing order need none (null).
template <class T, class A>
struct FlashBackward {
  static constexpr std::int64_t BQ = bwd_block_q, BK = bwd_block_k;

  TensorView<const T> dout, q, k, v, out;  ///< inputs
  TensorView<const A> lse;                 ///< forward's LSE
  TensorView<A> dq, dk, dv;                ///< gradients, added to
  const KernelParams& p;                   ///< scale, mask, head map

  /// Query blocks per (batch, head).
  std::int64_t query_blocks() const { return (q.seq() + BQ - 1) / BQ; }
  /// Turn counters the threaded run needs.
  std::int64_t turn_count() const { return q.batch() * q.heads() * query_blocks(); }
  /// Tasks: key blocks x batch x K/V heads.
  std::int64_t tasks() const { return (k.seq() + BK - 1) / BK * q.batch() * k.heads(); }

  /// Runs task t (key block t / (batch x K/V heads) of pair t % (batch x K/V heads)).
  void task(std::int64_t t, const BackwardScratch<A>& s, std::int32_t* turns) const {
    using V = simd_t<A>;
    using S = BackwardScratch<A>;
    constexpr std::int64_t W = FlashTile<A>::width, PW = FlashTile<A>::panel;
    static_assert(BK % PW == 0, "key blocks must be whole panels");
    const std::int64_t pairs = q.batch() * k.heads(), b = t % pairs / k.heads(), kh = t % pairs % k.heads();
    const std::int64_t jb = t / pairs, j0 = jb * BK, nk = std::min(BK, k.seq() - j0);
    const std::int64_t dim = q.dim(), dp = S::padded(dim), ld = S::ld_dim(dim), lk = S::ld_keys();
    const std::int64_t nqb = query_blocks(), kcols = (nk + PW - 1) / PW * PW;
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
        pack_rows(b, h, i0, nq, nk, s);
        // Keys after the last one any row sees add nothing: leave them out of every product.
        const std::int64_t nv = *std::max_element(s.limit, s.limit + nq), vcols = (nv + PW - 1) / PW * PW;

        // S = Q K^T, dP = dO V^T: keys in lanes, one key panel at a time.
        for (std::int64_t c0 = 0; c0 < vcols; c0 += PW) {
          flash_tiles<false>(nq, s.qs, ld, 1, s.kt + c0, lk, dim, s.pm + c0, lk, static_cast<const A*>(nullptr));
          flash_tiles<false>(nq, s.dos, ld, 1, s.vt + c0, lk, dim, s.ds + c0, lk, static_cast<const A*>(nullptr));
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
          flash_tiles<true>(nv, s.pm, 1, lk, s.dos + c0, ld, nq, s.dvs + c0, ld, s.ones);
          flash_tiles<true>(nv, s.ds, 1, lk, s.qs + c0, ld, nq, s.dks + c0, ld, s.ones);
          flash_tiles<false>(nq, s.ds, lk, 1, s.ks + c0, ld, nv, s.dqs + c0, ld, static_cast<const A*>(nullptr));
        }
        std::int32_t* turn = turns ? turns + (b * q.heads() + h) * nqb + ib : nullptr;
        if (turn) wait_turn(*turn, static_cast<std::int32_t>(jb));
        for (std::int64_t i = 0; i < nq; ++i) {
          A* dst = dq.row(b, i0 + i, h);
          const A* src = s.dqs + i * ld;
          for (std::int64_t d = 0; d < dim; ++d) dst[d] += src[d];
        }
        if (turn) pass_turn(*turn, static_cast<std::int32_t>(jb + 1));
      }
    }
    if (!touched) return;
    for (std::int64_t j = 0; j < nk; ++j) {
      A* dkr = dk.row(b, j0 + j, kh);
      A* dvr = dv.row(b, j0 + j, kh);
      for (std::int64_t d = 0; d < dim; ++d) {
        dkr[d] += s.dks[j * ld + d];
        dvr[d] += s.dvs[j * ld + d];
      }
    }
  }

 private:
  /// Packs the tile's Q and dO rows (zero-padded to whole panels), their LSE and delta, and
  /// how many of the block's nk keys each row sees (none for a row that saw no key at all).
  void pack_rows(std::int64_t b, std::int64_t h, std::int64_t i0, std::int64_t nq, std::int64_t nk,
                 const BackwardScratch<A>& s) const {
    using V = simd_t<A>;
    constexpr std::int64_t W = FlashTile<A>::width;
    const std::int64_t dim = q.dim(), dp = BackwardScratch<A>::padded(dim), ld = BackwardScratch<A>::ld_dim(dim);
    std::int64_t seen = 0;  // keys at or before the row's position: non-decreasing down the rows
    for (std::int64_t i = 0; i < nq; ++i) {
      const T* qr = q.row(b, i0 + i, h);
      const T* dor = dout.row(b, i0 + i, h);
      const T* orow = out.row(b, i0 + i, h);
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
      s.lrow[i] = lse(b, i0 + i, h);
      if (p.causal)
        for (const std::int64_t qp = p.q_positions(i0 + i); seen < nk && s.kpos[seen] <= qp;) ++seen;
      s.limit[i] = s.lrow[i] == -std::numeric_limits<A>::infinity() ? 0 : p.causal ? seen : nk;
    }
  }
};

}  // namespace seqpar::detail
