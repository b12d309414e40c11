#pragma once
/// \file
/// CpuFlashKernel: blocked online-softmax attention on the CPU (FlashAttention-2's loop
/// structure), for float and double, with the causal mask taken from global positions.
///
/// Layout of the work (why it is fast). Everything runs *transposed*: a block of queries is
/// packed once as Q^T [head_dim][block_q] (pre-scaled), the scores of a key block are formed
/// as S^T = K Q^T [block_k][block_q] and the output accumulates as O^T [head_dim][block_q].
/// Queries then sit in SIMD lanes, so
///  - both products are the same register-tiled micro-kernel C[MR x 2 vectors] += A B, with
///    A read by broadcast straight from the caller's K or V rows (no per-key-block packing or
///    transposing; only Q is packed, once per query block) and B a contiguous panel of Q^T or
///    P^T that stays in L1;
///  - the softmax statistics (running max m, sum l, rescale alpha) of a column of queries are
///    lane-wise vector operations over the rows of S^T, and exp is the vectorised fast_exp.
/// O^T is transposed back, divided by l, once per query block. Per thread the working set is
/// Q^T, O^T (head_dim x query block each) and S^T (block_k x query block): 96 or 192 KiB at
/// head_dim 128 in float, in L2; one micro-kernel's B panel (<= 16 KiB) stays in L1. The next
/// key block's K and V rows are prefetched into L2 while the current one computes.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/kernel/cpu_flash_backward.hpp"
#include "seqpar/kernel/cpu_flash_tile.hpp"
#include "seqpar/kernel/fast_exp.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/kernel/thread_pool.hpp"

namespace seqpar {

/// Options of CpuFlashKernel.
struct CpuFlashOptions {
  /// Threads a forward or backward call uses: the caller plus threads - 1 pool workers,
  /// created once. Forward splits its work over (batch x heads x query blocks), backward over
  /// (key blocks x batch x K/V heads). 1 runs on the caller alone.
  int threads = 1;
};

/// Fast local attention on the CPU (see the file comment for the blocking). Each (batch,
/// head, block of queries) streams over blocks of keys, keeping a running max, sum and
/// output (online softmax), so memory stays O(block). Key blocks that a causal mask hides
/// entirely are skipped; blocks it shows entirely skip the mask. Scratch (one slice per
/// thread) and the thread pool are made by prepare() and the constructor, so forward
/// allocates nothing and starts no thread. One forward at a time per object; copies get
/// their own pool and scratch.
class CpuFlashKernel {
 public:
  static constexpr bool is_seqpar_kernel = true;  ///< opts in to LocalAttentionKernel
  using memory_space = HostSpace;                 ///< host tensors
  static constexpr std::int64_t block_q = 128;    ///< most query rows per block (a multiple of every tile's query panel)
  static constexpr std::int64_t block_k = 128;    ///< key rows per block

  /// Query rows per block for `key_len` keys. Each query block streams all of K and V once:
  /// at long key sequences they come from L3 or memory, so 128-row blocks halve that traffic;
  /// at short ones 64-row blocks waste less work on causal diagonals and make more tasks.
  static constexpr std::int64_t query_block_rows(std::int64_t key_len) { return key_len >= 4096 ? 128 : 64; }

  /// One thread.
  CpuFlashKernel() = default;
  /// With options (e.g. `CpuFlashKernel(CpuFlashOptions{.threads = 2})`); starts the pool.
  explicit CpuFlashKernel(CpuFlashOptions options) { set_threads(options.threads); }
  /// Shorthand for `CpuFlashKernel(CpuFlashOptions{.threads = threads})`.
  explicit CpuFlashKernel(int threads) : CpuFlashKernel(CpuFlashOptions{.threads = threads}) {}
  /// Same options, own pool and scratch (the engine stores its kernel by value).
  CpuFlashKernel(const CpuFlashKernel& other) : CpuFlashKernel(other.options_) { prepare(other.prepared_dim_); }
  /// Same options, own pool and scratch.
  CpuFlashKernel& operator=(const CpuFlashKernel& other) {
    if (this != &other) {
      set_threads(other.options_.threads);
      prepare(other.prepared_dim_);
    }
    return *this;
  }
  /// Takes over the pool and scratch; `other` is left a prepared-for-nothing, 1-thread kernel.
  CpuFlashKernel(CpuFlashKernel&& other) noexcept
      : options_(std::exchange(other.options_, CpuFlashOptions{})), pool_(std::move(other.pool_)),
        prepared_dim_(std::exchange(other.prepared_dim_, 0)), thread_stride_(std::exchange(other.thread_stride_, 0)),
        scratch_(std::move(other.scratch_)), backward_scratch_(std::move(other.backward_scratch_)) {}
  /// Takes over the pool and scratch; `other` is left a prepared-for-nothing, 1-thread kernel.
  CpuFlashKernel& operator=(CpuFlashKernel&& other) noexcept {
    if (this != &other) {
      options_ = std::exchange(other.options_, CpuFlashOptions{});
      pool_ = std::move(other.pool_);
      prepared_dim_ = std::exchange(other.prepared_dim_, 0);
      thread_stride_ = std::exchange(other.thread_stride_, 0);
      scratch_ = std::move(other.scratch_);
      other.scratch_.clear();
      backward_scratch_ = std::move(other.backward_scratch_);
      other.backward_scratch_.clear();
    }
    return *this;
  }
  ~CpuFlashKernel() = default;

  /// Sets the thread count (>= 1; throws ConfigError otherwise) and (re)starts the pool and
  /// the per-thread scratch. Not to be called while a forward runs.
  void set_threads(int threads) {
    SEQPAR_CHECK(threads >= 1, ConfigError, "CpuFlashKernel threads: expected >= 1, got ", threads);
    options_.threads = threads;
    if (threads == 1)
      pool_.reset();
    else if (!pool_ || pool_->size() != threads)
      pool_ = std::make_unique<detail::ThreadPool>(threads);
    const std::int64_t dim = prepared_dim_;
    prepared_dim_ = 0;
    prepare(dim);
  }
  /// Threads a forward or backward call uses.
  int threads() const { return options_.threads; }
  /// The options in force.
  const CpuFlashOptions& options() const { return options_; }

  /// Sizes the scratch of every thread for head dims up to `max_head_dim` (both float and
  /// double).
  void prepare(std::int64_t max_head_dim) {
    if (max_head_dim <= prepared_dim_) return;
    thread_stride_ = round_up(scratch_bytes(max_head_dim), 256);
    scratch_.resize(static_cast<std::size_t>(options_.threads) * thread_stride_ + 64);
    prepared_dim_ = max_head_dim;
  }

  /// See LocalAttentionKernel. `out` may be T or the accumulation type.
  template <class T, class O>
  void forward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
               TensorView<acc_t<T>> lse, const KernelParams& p) {
    using A = acc_t<T>;
    const std::int64_t dim = q.dim();
    prepare(dim);  // no-op once prepared
    const std::int64_t bq = query_block_rows(k.seq()), nqb = (q.seq() + bq - 1) / bq;
    const std::int64_t per_batch = q.heads() * nqb, tasks = q.batch() * per_batch;
    // Later query blocks see more keys under a causal mask: hand them out first, so that the
    // cheap ones fill the gaps at the end.
    auto task = [&](std::int64_t t, int worker) {
      const std::int64_t b = t / per_batch, h = (t % per_batch) / nqb, qb = nqb - 1 - t % nqb;
      query_block<T, O, A>(q, k, v, out, lse, p, b, h, qb * bq, bq, thread_scratch<A>(worker, dim));
    };
    if (pool_)
      pool_->run(tasks, task);
    else
      for (std::int64_t t = 0; t < tasks; ++t) task(t, 0);
  }

  /// See LocalAttentionKernel's backward: adds this key block's dq, dk, dv, recomputing the
  /// probabilities from the LSE, on the forward's threads (kernel/cpu_flash_backward.hpp has
  /// the split). dq, dk, dv come out bit-identical whatever the thread count. Its scratch is
  /// separate from forward's: one slice per thread, sized by prepare_backward() (the engine
  /// calls it at plan), plus, with more than one thread, one turn counter per (batch, head,
  /// query block), made on the first call with a larger query shape.
  template <class T>
  void backward(TensorView<const T> dout, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                TensorView<const T> out, TensorView<const acc_t<T>> lse, TensorView<acc_t<T>> dq,
                TensorView<acc_t<T>> dk, TensorView<acc_t<T>> dv, const KernelParams& p) {
    using A = acc_t<T>;
    const detail::FlashBackward<T, A> job{dout, q, k, v, out, lse, dq, dk, dv, p};
    const std::size_t turn_bytes = pool_ ? round_up(static_cast<std::size_t>(job.turn_count()) * 4, 256) : 0;
    const std::size_t stride = detail::flash_backward_thread_bytes(q.dim());
    prepare_backward(q.dim(), turn_bytes);
    std::byte* base = aligned(backward_scratch_.data());
    std::int32_t* turns = pool_ ? reinterpret_cast<std::int32_t*>(base) : nullptr;
    if (turns) std::fill(turns, turns + job.turn_count(), 0);
    auto task = [&](std::int64_t t, int worker) {
      detail::BackwardScratch<A> s;
      detail::BackwardScratch<A>::carve(base + turn_bytes + static_cast<std::size_t>(worker) * stride, q.dim(), &s);
      job.task(t, s, turns);
    };
    if (pool_)
      pool_->run(job.tasks(), task);
    else
      for (std::int64_t t = 0; t < job.tasks(); ++t) task(t, 0);
  }
  /// Sizes the backward scratch for head dims up to `max_head_dim` and every thread, after
  /// `turn_bytes` of turn counters (a no-op once large enough).
  void prepare_backward(std::int64_t max_head_dim, std::size_t turn_bytes = 0) {
    const std::size_t need =
        turn_bytes + static_cast<std::size_t>(options_.threads) * detail::flash_backward_thread_bytes(max_head_dim) + 64;
    if (backward_scratch_.size() < need) backward_scratch_.resize(need);
  }

 private:
  /// One thread's scratch, carved for element type A and head dim `dim`.
  template <class A>
  struct Scratch {
    A *qt, *ot, *st, *m, *l, *alpha, *kbuf, *vbuf;
    std::int64_t *qpos, *kpos;
  };

  static constexpr std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

  /// Carves the scratch at `base` (or, with a null base, only measures it).
  template <class A>
  static std::size_t carve(std::byte* base, std::int64_t dim, Scratch<A>* s) {
    std::size_t used = 0;
    auto take = [&](auto*& ptr, std::int64_t count) {
      using E = std::remove_reference_t<decltype(*ptr)>;
      ptr = reinterpret_cast<E*>(base + used);
      used += round_up(static_cast<std::size_t>(count) * sizeof(E), 64);
    };
    Scratch<A> tmp;
    Scratch<A>& r = s ? *s : tmp;
    take(r.qt, dim * block_q);
    take(r.ot, dim * block_q);
    take(r.st, block_k * block_q);
    take(r.m, block_q);
    take(r.l, block_q);
    take(r.alpha, block_q);
    take(r.kbuf, block_k * dim);  // K and V converted to A, only when T is not A
    take(r.vbuf, block_k * dim);
    take(r.qpos, block_q);
    take(r.kpos, block_k);
    return used;
  }

  static std::size_t scratch_bytes(std::int64_t dim) {
    return std::max(carve<float>(nullptr, dim, nullptr), carve<double>(nullptr, dim, nullptr));
  }

  /// The first 64-byte boundary in a scratch buffer.
  static std::byte* aligned(std::byte* p) { return p + (64 - reinterpret_cast<std::uintptr_t>(p) % 64) % 64; }

  template <class A>
  Scratch<A> thread_scratch(int worker, std::int64_t dim) {
    std::byte* base = aligned(scratch_.data());
    Scratch<A> s;
    carve<A>(base + static_cast<std::size_t>(worker) * thread_stride_, dim, &s);
    return s;
  }

  template <class T, class O, class A>
  static void query_block(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
                          TensorView<A> lse, const KernelParams& p, std::int64_t b, std::int64_t h,
                          std::int64_t i0, std::int64_t bq, const Scratch<A>& s) {
    using V = detail::simd_t<A>;
    using Tile = detail::FlashTile<A>;
    constexpr int W = Tile::width, PW = Tile::panel;
    static_assert(block_q % PW == 0 && 64 % PW == 0, "query blocks must be whole query panels");
    constexpr A neg_inf = -std::numeric_limits<A>::infinity();
    const std::int64_t dim = q.dim(), nq = std::min(bq, q.seq() - i0), kh = p.kv_head(h);
    const std::int64_t ncols = (nq + PW - 1) / PW * PW;  // queries padded to whole panels
    const A scale = static_cast<A>(p.scale);

    // Q^T, scaled; padding lanes are zero (finite scores, never written out).
    for (std::int64_t i = 0; i < ncols; ++i) {
      if (i < nq) {
        const T* src = q.row(b, i0 + i, h);
        for (std::int64_t d = 0; d < dim; ++d) s.qt[d * bq + i] = static_cast<A>(src[d]) * scale;
        if (p.causal) s.qpos[i] = p.q_positions(i0 + i);
      } else {
        for (std::int64_t d = 0; d < dim; ++d) s.qt[d * bq + i] = A(0);
      }
      s.m[i] = neg_inf;
      s.l[i] = 0;
    }
    for (std::int64_t d = 0; d < dim; ++d) std::fill(s.ot + d * bq, s.ot + d * bq + ncols, A(0));

    const std::int64_t q_lo = p.causal ? s.qpos[0] : 0, q_hi = p.causal ? s.qpos[nq - 1] : 0;
    for (std::int64_t j0 = 0; j0 < k.seq(); j0 += block_k) {
      std::int64_t nk = std::min(block_k, k.seq() - j0);
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
      // K and V rows: the caller's memory when already in A, else converted once here.
      const A *kr, *vr;
      std::ptrdiff_t ks, vs;
      if constexpr (std::is_same_v<T, A>) {
        kr = k.row(b, j0, kh);
        vr = v.row(b, j0, kh);
        ks = k.stride[1];
        vs = v.stride[1];
      } else {
        for (std::int64_t j = 0; j < nk; ++j) {
          const T* ksrc = k.row(b, j0 + j, kh);
          const T* vsrc = v.row(b, j0 + j, kh);
          for (std::int64_t d = 0; d < dim; ++d) {
            s.kbuf[j * dim + d] = static_cast<A>(ksrc[d]);
            s.vbuf[j * dim + d] = static_cast<A>(vsrc[d]);
          }
        }
        kr = s.kbuf;
        vr = s.vbuf;
        ks = vs = dim;
      }

      // Start the next key block's K and V rows on their way to L2 while this one computes:
      // at long sequences they come from L3 or memory, and the hardware prefetcher does not
      // run far enough ahead on MR interleaved row streams.
      if (const std::int64_t jn = j0 + block_k; jn < k.seq())
        for (std::int64_t j = jn, je = std::min(k.seq(), jn + block_k); j < je; ++j) {
          const char* kp = reinterpret_cast<const char*>(k.row(b, j, kh));
          const char* vp = reinterpret_cast<const char*>(v.row(b, j, kh));
          for (std::int64_t off = 0; off < dim * std::int64_t(sizeof(T)); off += 64) {
            __builtin_prefetch(kp + off, 0, 2);
            __builtin_prefetch(vp + off, 0, 2);
          }
        }
      // S^T = K Q^T, one query panel at a time (its Q^T panel stays in L1).
      for (std::int64_t c0 = 0; c0 < ncols; c0 += PW)
        detail::flash_tiles<false>(nk, kr, ks, 1, s.qt + c0, bq, dim, s.st + c0, bq, static_cast<const A*>(nullptr));
      if (masked)
        for (std::int64_t j = 0; j < nk; ++j)
          for (std::int64_t i = 0; i < nq; ++i)
            if (s.kpos[j] > s.qpos[i]) s.st[j * bq + i] = neg_inf;

      // Online softmax, W queries at a time: P^T = exp(S^T - m') in place.
      for (std::int64_t c = 0; c < ncols; c += W) {
        V mx = detail::simd_load(s.m + c);
        const V m_old = mx;
        for (std::int64_t j = 0; j < nk; ++j) mx = detail::simd_max(detail::simd_load(s.st + j * bq + c), mx);
        // A column that saw only hidden keys keeps m = -inf; shifting it by 0 makes its
        // weights exp(-inf) = 0 instead of NaN. NaN scores pass through to the output.
        const V shift = mx == neg_inf ? V{} : mx;
        V sum{};
        for (std::int64_t j = 0; j < nk; ++j) {
          A* sj = s.st + j * bq + c;
          const V e = detail::exp_lanes(detail::simd_load(sj) - shift);
          detail::simd_store(sj, e);
          sum += e;
        }
        const V alpha = detail::exp_lanes(m_old - shift);
        detail::simd_store(s.alpha + c, alpha);
        detail::simd_store(s.l + c, detail::simd_fma(alpha, detail::simd_load(s.l + c), sum));
        detail::simd_store(s.m + c, mx);
      }

      // O^T = alpha O^T + V^T P^T: A reads V column-wise (head-dim rows), B is a P^T panel.
      for (std::int64_t c0 = 0; c0 < ncols; c0 += PW)
        detail::flash_tiles<true>(dim, vr, 1, vs, s.st + c0, bq, nk, s.ot + c0, bq, s.alpha + c0);
    }

    for (std::int64_t i = 0; i < nq; ++i) {
      O* dst = out.row(b, i0 + i, h);
      const A l = s.l[i];
      const A inv = l != 0 ? A(1) / l : A(0);
      for (std::int64_t d = 0; d < dim; ++d) dst[d] = static_cast<O>(s.ot[d * bq + i] * inv);
      if (!lse.absent()) lse(b, i0 + i, h) = l != 0 ? s.m[i] + std::log(l) : neg_inf;
    }
  }

  CpuFlashOptions options_;
  std::unique_ptr<detail::ThreadPool> pool_;
  std::int64_t prepared_dim_ = 0;
  std::size_t thread_stride_ = 0;
  std::vector<std::byte> scratch_;
  std::vector<std::byte> backward_scratch_;  // backward's own; copies start empty and grow on use
};

}  // namespace seqpar
