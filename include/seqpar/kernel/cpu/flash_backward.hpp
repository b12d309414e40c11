#pragma once
/// \file
/// Backward of CpuFlashKernel (FlashAttention-2 style): probabilities are recomputed from the
/// saved LSE one (query block, key block) tile at a time, so memory stays O(block). This file
/// has the work split and the dQ turn order; kernel/cpu/isa/backward.inl the tile loop, once
/// per instruction set.
///
/// Work split. A task is one key block (or two, below) of one (batch, K/V head): it owns their dK, dV
/// rows (summed in scratch over every query block and every query head of the group, then
/// added to the caller's once), so tasks never share a dK or dV row. dQ rows are shared by
/// every key block; each task forms its dQ share of a tile in scratch and adds it to the
/// caller's rows in key-block order: a per-(batch, head, query block) turn counter says
/// which key block may add next. The sums, and their order, are thus the same whatever the
/// thread count, and dq, dk, dv are bit-identical from 1 to N threads, with no dQ copy per
/// thread to reduce. Tasks are numbered key block major, so threads first run different
/// (batch, K/V head) pairs, which never wait for each other; when there are fewer pairs
/// than threads, consecutive key blocks of one pair pipeline, the later one a tile behind.
/// A key block that no row of a query block sees skips that query block (a causal mask hides
/// a suffix of the key blocks from it, a window or a document a prefix too, padding a
/// suffix); one that does not skip it waits for the last earlier key block that does not
/// either (the turn counter holds one past the last key block that added). Deadlock-free
/// because a task waits only on tasks of lower index and the pool hands tasks out in
/// increasing order: the earliest running task never waits.
///
/// A task may take two consecutive key blocks (blocks_per_task): its tiles then run their
/// products over both, so each query row is packed, and streamed from memory, once per two
/// blocks (3-9% less time at S 8192, one thread). It forms and adds the dQ share of each block
/// apart, in that block's turn, so dq gets the same sums in the same order either way, and the
/// choice may follow the thread count without costing the bit-identity: two blocks where that
/// leaves every thread 8 tasks or more (a causal mask makes tasks uneven), else one.
///
/// delta = dO . O (the row term of dS = P (dP - delta)) is formed once per query row, by a pass
/// over the rows before the tasks (as FlashAttention-2's preprocessing kernel does), not once
/// per tile: every key block would read the row's O again for it. Its B x H x S values sit in
/// the call's scratch beside the turn counters.
///
/// Per tile (BQ queries, BK keys) five products run through one register-tiled
/// micro-kernel (kernel/cpu/isa/simd.inl; for bf16 on the avx512_bf16 level, the pair
/// micro-kernel of kernel/cpu/isa/forward_bf16.inl, and on the amx_bf16 level AMX tiles, P
/// and dS rounded to bf16, see backward_bf16.inl): S = Q K^T and dP = dO V^T with keys in the SIMD
/// lanes, then P = exp(S scale - LSE) and dS = P (dP - delta) scale lane-wise (soft-capped:
/// t = tanh(S scale / cap), P = exp(cap t - LSE), dS also times 1 - t^2), then dV += P^T dO,
/// dK += dS^T Q and dQ = dS K with head dims in the lanes (D_v of them for dV, D for the
/// others). A tile runs from the
/// first key any of its rows sees to the last (each row sees one contiguous run of keys); P
/// and dS are selected to exactly 0 at the keys a row does not see, and a K row holding a NaN
/// or Inf enters dQ only for the rows that see it, so a hidden key adds nothing to any
/// gradient, not even NaN x 0. Every operand is packed into scratch, rows zero-padded to
/// whole panels, which serves every head_dim, stride and element type with one code path;
/// and it is faster than reading the caller's rows: rows of one head are a power-of-two
/// stride apart there and fall into a few L1 sets. Scratch rows are one panel longer than
/// their data for the same reason.

#include <atomic>
#include <chrono>
#include <cstdint>

#include "seqpar/core/poll.hpp"
#include "seqpar/kernel/cpu/flash_scratch.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"

namespace seqpar::detail {

/// The back-off of a dQ turn wait: the earlier key block is usually a tile behind, so spin
/// first, then yield for about 200 yields of an idle core; the naps are short because a turn
/// waits for one tile's work, not for a transfer.
inline constexpr Backoff turn_backoff{.spins = 64, .yield_for = std::chrono::microseconds(40),
                                     .nap = std::chrono::microseconds(20)};

/// Waits (poll_until, core/poll.hpp) until `turn` reaches `mine`. The acquire load makes the
/// earlier key blocks' dQ adds visible. (Not std::atomic wait / notify: libstdc++ 12's can
/// lose a wake-up, which left two workers asleep for good with 5 threads on 2 cores; a polling
/// nap cannot miss one, and a shared machine's preempted peer still gets its core.)
inline void wait_turn(std::int32_t& turn, std::int32_t mine) {
  const std::atomic_ref<std::int32_t> t(turn);
  poll_until([&] { return t.load(std::memory_order_acquire) == mine; }, no_deadline, turn_backoff);
}

/// Hands `turn` to key block `next` (release: this block's dQ adds happen before).
inline void pass_turn(std::int32_t& turn, std::int32_t next) {
  std::atomic_ref<std::int32_t>(turn).store(next, std::memory_order_release);
}

/// One backward call: the views, and how its work divides. Each instruction set's
/// backward_delta_task(job, t) (kernel/cpu/isa/backward.inl) first runs for every t in [0,
/// delta_tasks()), then backward_task(job, t, scratch, turns) for every t in [0, tasks()).
/// `turns` (one int32 per (batch, head, query block), zeroed before the first
/// task) orders the dQ adds when tasks run concurrently; tasks run one by one in increasing
/// order need none (null).
template <class T, class A>
struct FlashBackward {
  static constexpr std::int64_t BQ = bwd_block_q, BK = bwd_block_k;

  TensorView<const T> dout, q, k, v, out;  ///< inputs (v, out, dout: D_v head dims)
  TensorView<const A> lse;                 ///< forward's LSE
  TensorView<A> dq, dk, dv;                ///< gradients, added to (dv: D_v head dims)
  const KernelParams& p;                   ///< scale, soft-cap, mask, head map
  A* deltas;                               ///< [batch][heads][query rows]: dO . O, by backward_delta_task
  std::int64_t blocks_per_task = 1;        ///< key blocks of one task: 1 or bwd_task_blocks (blocks_for)

  /// Key blocks per task for a call on `threads` threads: two where that still leaves every
  /// thread 8 tasks or more (or there is one thread), so that a causal mask's uneven tasks
  /// even out; else one. Either gives the same bits (see backward_task).
  static std::int64_t blocks_for(std::int64_t keys, std::int64_t batch, std::int64_t kv_heads, int threads) {
    const std::int64_t long_tasks = (keys + bwd_task_blocks * BK - 1) / (bwd_task_blocks * BK) * batch * kv_heads;
    return threads <= 1 || long_tasks >= 8 * std::int64_t{threads} ? bwd_task_blocks : 1;
  }

  /// dO . O of query row i of head h of batch element b (set by the delta pass).
  A& delta(std::int64_t b, std::int64_t i, std::int64_t h) const {
    return deltas[(b * q.heads() + h) * q.seq() + i];
  }
  /// Bytes of `deltas` for B x H x S query rows (either accumulation type).
  static std::size_t delta_bytes(std::int64_t batch, std::int64_t heads, std::int64_t rows) {
    return static_cast<std::size_t>(batch * heads * rows) * sizeof(double);
  }
  /// Tasks of the delta pass: a run of delta_rows rows of one (batch, head) each.
  std::int64_t delta_tasks() const { return q.batch() * q.heads() * ((q.seq() + delta_rows - 1) / delta_rows); }
  /// Rows per delta task (a few microseconds of reading dO and O).
  static constexpr std::int64_t delta_rows = 256;

  /// Query blocks per (batch, head).
  std::int64_t query_blocks() const { return (q.seq() + BQ - 1) / BQ; }
  /// Turn counters the threaded run needs.
  std::int64_t turn_count() const { return q.batch() * q.heads() * query_blocks(); }
  /// Tasks: runs of blocks_per_task key blocks x batch x K/V heads.
  std::int64_t tasks() const {
    const std::int64_t keys = BK * blocks_per_task;
    return (k.seq() + keys - 1) / keys * q.batch() * k.heads();
  }
};

}  // namespace seqpar::detail
