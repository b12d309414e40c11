#pragma once
/// \file
/// CpuFlashKernel: blocked online-softmax attention on the CPU (FlashAttention-2's loop
/// structure), for float and double, with every mask family of core/mask.hpp (causal,
/// sliding windows, packed documents, key padding) taken from global positions.
///
/// Layout of the work (why it is fast). Everything runs *transposed*: a block of queries is
/// packed once as Q^T [head_dim][block_q] (pre-scaled), the scores of a key block are formed
/// as S^T = K Q^T [block_k][block_q] and the output accumulates as O^T [head_dim][block_q].
/// Queries then sit in SIMD lanes, so
///  - both products are the same register-tiled micro-kernel C[MR x NR vectors] += A B, with
///    A read by broadcast from the key block's K rows or V tiles (copied once per key block
///    and query block, K into rows whose stride avoids L1 set conflicts, V into MR-dim tiles)
///    and B a contiguous panel of Q^T or P^T that stays in L1; on AVX-512 the float tile's k
///    loop is inline assembly (isa/simd.inl, tile_8xn_asm) over query panels of 3 vectors
///    (48 queries: each broadcast feeds three FMAs), elsewhere panels are 2 vectors;
///  - the softmax statistics (running max m, sum l, rescale alpha) of a column of queries are
///    lane-wise vector operations over the rows of S^T, and exp is the vectorised fast_exp.
/// Q^T is packed and O^T transposed back (divided by l) once per query block, a vector's
/// width of rows at a time through in-register transposes (isa/simd.inl, transpose_lanes).
/// Per thread the working set is Q^T, O^T (head_dim x query block each) and S^T (block_k x
/// query block): 96 or 192 KiB at head_dim 128 in float, in L2; one micro-kernel's B panel
/// (<= 16 KiB) stays in L1. The next key block's K and V rows are prefetched into L2 while
/// the current one computes.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>

#include "seqpar/core/bfloat16.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/paged_cache.hpp"
#include "seqpar/kernel/cpu/flash_backward.hpp"
#include "seqpar/kernel/cpu/flash_decode.hpp"
#include "seqpar/kernel/cpu/flash_scratch.hpp"
#include "seqpar/kernel/cpu/isa.hpp"
#include "seqpar/kernel/cpu/isa_kernels.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/kernel/cpu/thread_pool.hpp"

namespace seqpar {

/// Options of CpuFlashKernel.
struct CpuFlashOptions {
  /// Threads a forward or backward call uses: the caller plus threads - 1 pool workers,
  /// created once. Forward splits its work over (batch x heads x query blocks), backward over
  /// (key blocks x batch x K/V heads). 1 runs on the caller alone.
  int threads = 1;
  /// Vector instruction set (kernel/cpu/isa.hpp): automatic picks the widest this CPU runs
  /// (capped by the environment variable SEQPAR_CPU_ISA); a level the CPU cannot run is a
  /// ConfigError when the kernel is made.
  CpuIsa isa = CpuIsa::automatic;
};

/// Fast local attention on the CPU (see the file comment for the blocking). Each (batch,
/// head, block of queries) streams over blocks of keys, keeping a running max, sum and
/// output (online softmax), so memory stays O(block). Each query row sees one contiguous run
/// of keys (params.keys; every family of core/mask.hpp): a query block's key loop runs from
/// its first row's first key to its last row's last, key blocks that no row sees are skipped,
/// each query panel is trimmed to its rows' keys, and only the keys a range boundary cuts go
/// through the mask (the lanes that do not see such a key never read it, so a NaN stored
/// there stays out). Scratch (one slice per thread) and the thread pool are made by prepare()
/// and the constructor, so forward allocates nothing and starts no thread. One forward at a
/// time per object; copies get their own pool and scratch.
///
/// Today's models: a soft-cap (KernelParams::softcap) scales Q by scale / cap and caps each
/// block of scores with a vector tanh (kernel/cpu/isa/simd.inl) before the mask, forward,
/// decode path and backward alike; V and O may have their own head dim (v.dim(), MLA's
/// D_v), every product and scratch buffer sized by the dim it carries.
class CpuFlashKernel {
 public:
  static constexpr bool is_seqpar_kernel = true;    ///< opts in to LocalAttentionKernel
  static constexpr bool supports_masks = true;      ///< windows, documents, key padding
  static constexpr bool supports_softcap = true;    ///< logit soft-capping, forward and backward
  static constexpr bool supports_value_dim = true;  ///< V and O with their own head dim (D_v != D)
  using memory_space = HostSpace;                   ///< host tensors
  static constexpr std::int64_t block_q = detail::fwd_block_q;  ///< most query rows per block
  static constexpr std::int64_t block_k = detail::fwd_block_k;  ///< key rows per block

  /// Query rows per block for `key_len` keys. Each query block streams all of K and V once and
  /// packs each key block of them: from 1K keys they no longer fit in L2 and come from L3 or
  /// memory, so 256- and (from 2K keys) 512-row blocks cut that traffic and packing 4-8x (a
  /// mask's range boundaries are trimmed per query panel, so large blocks waste no work there); below,
  /// 64-row blocks make more tasks for the threads. The forward cuts the queries into as many
  /// blocks as these sizes make, of equal size rounded up to whole query panels.
  static constexpr std::int64_t query_block_rows(std::int64_t key_len) {
    return key_len >= 2048 ? 512 : key_len >= 1024 ? 256 : 64;
  }

  /// One thread, the widest instruction set.
  CpuFlashKernel() = default;
  /// With options (e.g. `CpuFlashKernel(CpuFlashOptions{.threads = 2})`); starts the pool.
  explicit CpuFlashKernel(CpuFlashOptions options) : isa_(resolve_cpu_isa(options.isa)) {
    options_.isa = options.isa;
    set_threads(options.threads);
  }
  /// Shorthand for `CpuFlashKernel(CpuFlashOptions{.threads = threads})`.
  explicit CpuFlashKernel(int threads) : CpuFlashKernel(CpuFlashOptions{.threads = threads}) {}
  /// Same options, own pool and scratch (the engine stores its kernel by value).
  CpuFlashKernel(const CpuFlashKernel& other) : CpuFlashKernel(other.options_) {
    prepare(other.prepared_dim_, other.prepared_dim_v_);
  }
  /// Same options, own pool and scratch.
  CpuFlashKernel& operator=(const CpuFlashKernel& other) {
    if (this != &other) {
      options_.isa = other.options_.isa;
      isa_ = other.isa_;
      set_threads(other.options_.threads);
      prepare(other.prepared_dim_, other.prepared_dim_v_);
    }
    return *this;
  }
  /// Takes over the pool and scratch; `other` is left a prepared-for-nothing, 1-thread kernel.
  CpuFlashKernel(CpuFlashKernel&& other) noexcept
      : options_(std::exchange(other.options_, CpuFlashOptions{})), isa_(other.isa_), pool_(std::move(other.pool_)),
        prepared_dim_(std::exchange(other.prepared_dim_, 0)), prepared_dim_v_(std::exchange(other.prepared_dim_v_, 0)),
        thread_stride_(std::exchange(other.thread_stride_, 0)),
        scratch_(std::move(other.scratch_)), backward_scratch_(std::move(other.backward_scratch_)),
        decode_scratch_(std::move(other.decode_scratch_)) {}
  /// Takes over the pool and scratch; `other` is left a prepared-for-nothing, 1-thread kernel.
  CpuFlashKernel& operator=(CpuFlashKernel&& other) noexcept {
    if (this != &other) {
      options_ = std::exchange(other.options_, CpuFlashOptions{});
      isa_ = other.isa_;
      pool_ = std::move(other.pool_);
      prepared_dim_ = std::exchange(other.prepared_dim_, 0);
      prepared_dim_v_ = std::exchange(other.prepared_dim_v_, 0);
      thread_stride_ = std::exchange(other.thread_stride_, 0);
      scratch_ = std::move(other.scratch_);  // a moved-from ScratchBuffer is empty
      backward_scratch_ = std::move(other.backward_scratch_);
      decode_scratch_ = std::move(other.decode_scratch_);
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
    const std::int64_t dim = std::exchange(prepared_dim_, 0), dim_v = std::exchange(prepared_dim_v_, 0);
    prepare(dim, dim_v);
  }
  /// Threads a forward or backward call uses.
  int threads() const { return options_.threads; }
  /// The options in force.
  const CpuFlashOptions& options() const { return options_; }
  /// The instruction set this kernel runs (options().isa resolved; never automatic).
  CpuIsa isa() const { return isa_; }

  /// Sizes the scratch of every thread for head dims up to `max_head_dim` and value dims up to
  /// `max_value_dim` (0: the head dim), both float and double; a no-op once large enough.
  void prepare(std::int64_t max_head_dim, std::int64_t max_value_dim = 0) {
    const std::int64_t dim_v = max_value_dim > 0 ? max_value_dim : max_head_dim;
    if (max_head_dim <= prepared_dim_ && dim_v <= prepared_dim_v_) return;
    prepared_dim_ = std::max(prepared_dim_, max_head_dim);
    prepared_dim_v_ = std::max(prepared_dim_v_, dim_v);
    thread_stride_ = detail::flash_thread_bytes<detail::ForwardScratch>(prepared_dim_, prepared_dim_v_);
    scratch_.grow(static_cast<std::size_t>(options_.threads) * thread_stride_ + 64);
  }

  /// See LocalAttentionKernel. `out` may be T or the accumulation type.
  /// Up to 16 query rows (a decode step) take the decode path of kernel/cpu/flash_decode.hpp:
  /// the query heads of a GQA group together, K and V read in place, a group's keys split
  /// over the threads when there are fewer groups than threads (its partials buffer is sized
  /// by reserve(), which the engines call at plan; a call larger than that grows it once).
  template <class T, class O>
  void forward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
               TensorView<acc_t<T>> lse, const KernelParams& p) {
    p.check_positions(q.seq(), k.seq(), "CpuFlashKernel::forward");
    prepare(q.dim(), v.dim());  // no-op once prepared
    using Decode = detail::FlashDecode<T, O, acc_t<T>>;
    if (Decode::applies(q, k, p)) {
      run_decode(Decode{q, k, v, out, lse, p}, k.seq());
      return;
    }
    forward_tasks<T, O>(q, k, v, out, lse, p);
  }

  /// See LocalAttentionKernel's forward_paged (float, double and bf16 pools): the decode path
  /// above with the pages read in place, each sequence of the step a batch element of up to 16
  /// rows, a key block ending where its run of pages ends (pages whose ids follow each other in
  /// an NHD pool are one run), and the group's keys split over the threads as for a dense call.
  template <class T>
  void forward_paged(TensorView<const T> q, const PagedKV<T>& cache, const PagedRows& rows, TensorView<acc_t<T>> out,
                     TensorView<acc_t<T>> lse, const KernelParams& p) {
    using A = acc_t<T>;
    prepare(q.dim(), cache.v_pool.dim());
    std::int64_t most = 0, keys = 0;
    for (std::int64_t b = 0; b < rows.batch; ++b) {
      const std::int64_t n = rows.begin[b + 1] - rows.begin[b];
      SEQPAR_CHECK(n >= 0 && n <= detail::decode_max_queries, ConfigError, "CpuFlashKernel::forward_paged: sequence ",
                   b, " has ", n, " query rows, expected 0..", detail::decode_max_queries);
      most = std::max(most, n);
      if (n > 0) keys = std::max(keys, rows.key_end[rows.begin[b + 1] - 1]);
    }
    // (most_tokens before split: the split's rows per task follow the longest sequence's.)
    run_decode(detail::FlashDecode<T, A, A>{q, cache.k_pool, cache.v_pool, out, lse, p, &cache, &rows,
                                            std::max<std::int64_t>(1, most)},
               keys);
  }

  /// See LocalAttentionKernel's backward: adds this key block's dq, dk, dv, recomputing the
  /// probabilities from the LSE, on the forward's threads (kernel/cpu/flash_backward.hpp has
  /// the split). dq, dk, dv come out bit-identical whatever the thread count. Its scratch is
  /// separate from forward's: one slice per thread, each query row's delta = dO . O and, with
  /// more than one thread, one turn counter per (batch, head, query block), sized by
  /// reserve() (the engine calls it at plan; a direct call with a larger query shape grows it
  /// once).
  template <class T>
  void backward(TensorView<const T> dout, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                TensorView<const T> out, TensorView<const acc_t<T>> lse, TensorView<acc_t<T>> dq,
                TensorView<acc_t<T>> dk, TensorView<acc_t<T>> dv, const KernelParams& p) {
    using A = acc_t<T>;
    p.check_positions(q.seq(), k.seq(), "CpuFlashKernel::backward");
    detail::FlashBackward<T, A> job{dout, q, k, v, out, lse, dq, dk, dv, p, nullptr,
                                    detail::FlashBackward<T, A>::blocks_for(k.seq(), q.batch(), k.heads(), threads())};
    const std::size_t delta_bytes = round_up(job.delta_bytes(q.batch(), q.heads(), q.seq()), 256);
    const std::size_t turn_bytes = pool_ ? round_up(static_cast<std::size_t>(job.turn_count()) * 4, 256) : 0;
    reserve_backward(q.dim(), v.dim(), delta_bytes + turn_bytes);
    std::byte* base = aligned(backward_scratch_.data());
    job.deltas = reinterpret_cast<A*>(base);
    std::int32_t* turns = pool_ ? reinterpret_cast<std::int32_t*>(base + delta_bytes) : nullptr;
    if (turns) std::fill(turns, turns + job.turn_count(), 0);
    backward_tasks<T>(job, base + delta_bytes + turn_bytes, turns);
  }
  /// Sizes every scratch a call within `c` needs (the engines call it when they make a plan):
  /// forward's and backward's per-thread slices, backward's turn counters with more than one
  /// thread, and the decode path's partials. After it such calls allocate nothing.
  void reserve(const KernelCallBounds& c) {
    prepare(c.head_dim, c.value_dim);
    if (c.backward) {
      const std::int64_t query_blocks = (c.q_rows + detail::bwd_block_q - 1) / detail::bwd_block_q;
      const std::size_t deltas = round_up(detail::FlashBackward<float, float>::delta_bytes(c.batch, c.heads, c.q_rows), 256);
      reserve_backward(c.head_dim, c.value_dim > 0 ? c.value_dim : c.head_dim,
                       deltas + (pool_ ? round_up(static_cast<std::size_t>(c.batch * c.heads * query_blocks) * 4, 256) : 0));
    }
    const std::size_t decode = std::max(detail::decode_part_bytes_bound<float>(options_.threads, c),
                                        detail::decode_part_bytes_bound<double>(options_.threads, c));
    if (decode > 0) decode_scratch_.grow(decode + 64);
  }
  /// Sizes the backward scratch for head dims up to `max_head_dim`, value dims up to
  /// `max_value_dim` (0: the head dim) and every thread (a no-op once large enough).
  void prepare_backward(std::int64_t max_head_dim, std::int64_t max_value_dim = 0) {
    reserve_backward(max_head_dim, max_value_dim > 0 ? max_value_dim : max_head_dim, 0);
  }

 private:
  /// Sizes the backward scratch for dims up to (`dim`, `dim_v`) and every thread, after
  /// `call_bytes` of per-call values (deltas, turn counters; a no-op once large enough).
  void reserve_backward(std::int64_t dim, std::int64_t dim_v, std::size_t call_bytes) {
    const std::size_t per_thread = detail::flash_thread_bytes<detail::BackwardScratch>(dim, dim_v);
    const std::size_t need = call_bytes + static_cast<std::size_t>(options_.threads) * per_thread + 64;
    backward_scratch_.grow(need);
  }

  /// Runs a decode-path job whose groups hold at most `keys` keys: its key chunks for this
  /// kernel's threads, their partials in the decode scratch (sized by reserve; a larger call
  /// grows it once), then the tasks.
  template <class T, class O, class A>
  void run_decode(detail::FlashDecode<T, O, A> job, std::int64_t keys) {
    job.chunks = detail::FlashDecode<T, O, A>::chunks_for(options_.threads, job.groups(), keys);
    if (const std::size_t bytes = job.part_bytes(); bytes > 0) {
      decode_scratch_.grow(bytes + 64);
      job.part = reinterpret_cast<A*>(aligned(decode_scratch_.data()));
    }
    decode_tasks<T, O>(job);
  }

  // The three ways into the per-instruction-set copies (kernel/cpu/isa_kernels.hpp), where
  // nearly all of the kernel's compile time goes. Defined after the class and not inline, so
  // that a build can compile them once (kernel/cpu/compiled_kernels.hpp) and every other
  // translation unit only calls them. Their last template argument, SEQPAR_CPU_ISA_DISPATCH,
  // is part of their symbols: a unit built with another value than the compiled copies fails
  // to link rather than mixing two builds of the kernel in one program.

  /// The forward's tasks on the copy of isa().
  template <class T, class O, int dispatch = SEQPAR_CPU_ISA_DISPATCH>
  void forward_tasks(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
                     TensorView<acc_t<T>> lse, const KernelParams& p);
  /// The backward's tasks on the copy of isa(), each thread on its scratch slice after `base`.
  template <class T, int dispatch = SEQPAR_CPU_ISA_DISPATCH>
  void backward_tasks(const detail::FlashBackward<T, acc_t<T>>& job, std::byte* base, std::int32_t* turns);
  /// The decode path's tasks on the copy of isa().
  template <class T, class O, int dispatch = SEQPAR_CPU_ISA_DISPATCH>
  void decode_tasks(const detail::FlashDecode<T, O, acc_t<T>>& job);

  /// dispatch_cpu_isa functor of forward: the tasks, (batch x heads x query blocks), on the pool.
  struct ForwardOn {
    template <class Kernels, class T, class O, class A>
    static void run(CpuFlashKernel& self, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                    TensorView<O> out, TensorView<A> lse, const KernelParams& p) {
      // bf16 forms its products on AMX tiles, or by AVX512-BF16's vdpbf16ps, where the level
      // says so (isa/forward_bf16.inl); the tiles take head dims that are whole tiles only.
      [[maybe_unused]] const bool amx = std::is_same_v<T, bf16> && Kernels::amx && self.isa_ == CpuIsa::amx_bf16 &&
                                        detail::amx_fits(q.dim(), v.dim());
      [[maybe_unused]] const bool dot = std::is_same_v<T, bf16> && Kernels::bf16_dot && self.isa_ == CpuIsa::avx512_bf16;
      // As many query blocks as query_block_rows asks for, of equal size in whole panels of
      // the path that runs (48 lanes for float on AVX-512): 2048 queries are 4 blocks of 528
      // rows, not 5 of 480 (each block packs all of K and V once).
      const std::int64_t panel = amx || dot ? Kernels::bf16_panel : Kernels::template forward_panel<A>;
      const std::int64_t most = query_block_rows(k.seq()), blocks = std::max<std::int64_t>(1, (q.seq() + most - 1) / most);
      const std::int64_t per_block = (q.seq() + blocks - 1) / blocks;
      const std::int64_t bq = std::max<std::int64_t>(1, (per_block + panel - 1) / panel) * panel;
      const std::int64_t nqb = (q.seq() + bq - 1) / bq;
      const std::int64_t per_batch = q.heads() * nqb, tasks = q.batch() * per_batch;
      // Later query blocks see more keys under a causal mask: hand them out first, so that the
      // cheap ones fill the gaps at the end.
      self.run_tasks(tasks, [&](std::int64_t t, int worker) {
        const std::int64_t b = t / per_batch, h = (t % per_batch) / nqb, qb = nqb - 1 - t % nqb;
        const auto scratch = self.thread_scratch<A>(worker, q.dim(), v.dim());
        if constexpr (std::is_same_v<T, bf16> && Kernels::amx) {
          if (amx) {
            Kernels::template forward_amx<O>(q, k, v, out, lse, p, b, h, qb * bq, bq, scratch);
            return;
          }
        }
        if constexpr (std::is_same_v<T, bf16> && Kernels::bf16_dot) {
          if (dot) {
            Kernels::template forward_bf16_dot<O>(q, k, v, out, lse, p, b, h, qb * bq, bq, scratch);
            return;
          }
        }
        Kernels::template forward<T, O, A>(q, k, v, out, lse, p, b, h, qb * bq, bq, scratch);
      });
    }
  };

  /// dispatch_cpu_isa functor of the decode path: the tasks (groups x key chunks), then, with
  /// chunks, the merge of each group's partials.
  struct DecodeOn {
    template <class Kernels, class T, class O, class A>
    static void run(CpuFlashKernel& self, const detail::FlashDecode<T, O, A>& job) {
      self.run_tasks(job.tasks(), [&](std::int64_t t, int worker) {
        Kernels::template decode<T, O, A>(job, t, self.thread_scratch<A>(worker, job.q.dim(), job.v.dim()));
      });
      if (job.chunks > 1) self.run_tasks(job.groups(), [&](std::int64_t g, int) { job.merge(g); });
    }
  };

  /// dispatch_cpu_isa functor of backward: job's tasks on the pool, each thread on its
  /// scratch slice after `base`.
  struct BackwardOn {
    template <class Kernels, class T, class A>
    static void run(CpuFlashKernel& self, const detail::FlashBackward<T, A>& job, std::byte* base,
                    std::int32_t* turns) {
      const std::int64_t dim = job.q.dim(), dim_v = job.v.dim();
      const std::size_t stride = detail::flash_thread_bytes<detail::BackwardScratch>(dim, dim_v);
      // bf16 forms its products on AMX tiles where the forward does and its head dims suit
      // them, or by AVX512-BF16's vdpbf16ps where the forward does (not otherwise on the AMX
      // level: its CPUs issue vdpbf16ps at half the FMA's rate).
      [[maybe_unused]] const bool amx = std::is_same_v<T, bf16> && Kernels::amx && self.isa_ == CpuIsa::amx_bf16 &&
                                        detail::amx_backward_fits(dim, dim_v);
      [[maybe_unused]] const bool dot = std::is_same_v<T, bf16> && Kernels::bf16_dot && self.isa_ == CpuIsa::avx512_bf16;
      self.run_tasks(job.delta_tasks(), [&](std::int64_t t, int) { Kernels::backward_deltas(job, t); });
      self.run_tasks(job.tasks(), [&](std::int64_t t, int worker) {
        detail::BackwardScratch<A> s;
        detail::BackwardScratch<A>::carve(base + static_cast<std::size_t>(worker) * stride, dim, dim_v, &s);
        if constexpr (std::is_same_v<T, bf16> && Kernels::amx) {
          if (amx) {
            Kernels::backward_amx(job, t, s, turns);
            return;
          }
        }
        if constexpr (std::is_same_v<T, bf16> && Kernels::bf16_dot) {
          if (dot) {
            Kernels::backward_bf16_dot(job, t, s, turns);
            return;
          }
        }
        Kernels::template backward<T, A>(job, t, s, turns);
      });
    }
  };

  static constexpr std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

  /// Runs task(t, worker) for t in [0, tasks) on the pool, or on the caller alone.
  template <class Task>
  void run_tasks(std::int64_t tasks, Task&& task) {
    if (pool_)
      pool_->run(tasks, task);
    else
      for (std::int64_t t = 0; t < tasks; ++t) task(t, 0);
  }

  /// The first 64-byte boundary in a scratch buffer.
  static std::byte* aligned(std::byte* p) { return p + (64 - reinterpret_cast<std::uintptr_t>(p) % 64) % 64; }

  /// Worker `worker`'s forward scratch, carved for head dim `dim` and value dim `dim_v`.
  template <class A>
  detail::ForwardScratch<A> thread_scratch(int worker, std::int64_t dim, std::int64_t dim_v) {
    std::byte* base = aligned(scratch_.data());
    detail::ForwardScratch<A> s;
    detail::ForwardScratch<A>::carve(base + static_cast<std::size_t>(worker) * thread_stride_, dim, dim_v, &s);
    return s;
  }

  CpuFlashOptions options_;
  CpuIsa isa_ = default_cpu_isa();
  std::unique_ptr<detail::ThreadPool> pool_;
  std::int64_t prepared_dim_ = 0;    // head dim the forward scratch is sized for
  std::int64_t prepared_dim_v_ = 0;  // value dim the forward scratch is sized for
  std::size_t thread_stride_ = 0;
  // Each call rewrites what it reads of these, so they grow without copying or zero-filling
  // (ScratchBuffer; builds without NDEBUG fill new bytes with NaN, and the tests pass so). A
  // copied kernel has its own: the forward's sized as the original's, the others on use.
  detail::ScratchBuffer scratch_;           // forward's per-thread slices
  detail::ScratchBuffer backward_scratch_;  // backward's per-call values and per-thread slices
  detail::ScratchBuffer decode_scratch_;    // the decode path's partials
};

template <class T, class O, int dispatch>
void CpuFlashKernel::forward_tasks(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                                   TensorView<O> out, TensorView<acc_t<T>> lse, const KernelParams& p) {
  detail::dispatch_cpu_isa<ForwardOn>(isa_, *this, q, k, v, out, lse, p);
}

template <class T, int dispatch>
void CpuFlashKernel::backward_tasks(const detail::FlashBackward<T, acc_t<T>>& job, std::byte* base,
                                    std::int32_t* turns) {
  detail::dispatch_cpu_isa<BackwardOn>(isa_, *this, job, base, turns);
}

template <class T, class O, int dispatch>
void CpuFlashKernel::decode_tasks(const detail::FlashDecode<T, O, acc_t<T>>& job) {
  detail::dispatch_cpu_isa<DecodeOn>(isa_, *this, job);
}

}  // namespace seqpar

#include "seqpar/kernel/cpu/compiled_kernels.hpp"
