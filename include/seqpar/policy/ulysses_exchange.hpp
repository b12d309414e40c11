#pragma once
/// \file
/// The Ulysses exchange: the all-to-all that turns "all heads of my tokens" into "my heads of
/// the whole ring block" (gather_heads), and the trip back (scatter_heads). Only policies with
/// a Ulysses phase (policy_traits<P>::ulysses) instantiate it.
///
/// Pieces are packed [seq, batch, heads, dim], so the pieces received from the group's
/// members, back to back in member order, are one strided tensor: the ring block for this
/// rank's heads, with no unpacking. The byte counts come from the plan's tables (the same ones
/// Plan::forward_bytes sums).

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "seqpar/core/plan.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/policy/engine_context.hpp"

namespace seqpar::detail {

/// Runs the all-to-all of table `t` on `c`; `reversed` sends the pieces back the way they came.
template <class Comm, class E>
void exchange(Comm& c, const E* send, const AllToAllTable& t, E* recv, bool reversed) {
  const auto* s = reinterpret_cast<const std::byte*>(send);
  auto* d = reinterpret_cast<std::byte*>(recv);
  if (reversed)
    c.all_to_all_v(s, t.recv_counts, t.recv_displs, d, t.send_counts, t.send_displs);
  else
    c.all_to_all_v(s, t.send_counts, t.send_displs, d, t.recv_counts, t.recv_displs);
}

/// Sends each group member its heads of my tokens (`x`), packed in `send`; returns my heads of
/// the whole ring block (`rows` tokens, `nheads` heads), received into `block`.
template <class Comm, class E>
TensorView<const E, typename Comm::memory_space> gather_heads(EngineContext<Comm>& cx,
                                                              TensorView<const E, typename Comm::memory_space> x,
                                                              const Plan& p, bool kv_heads, const AllToAllTable& t,
                                                              E* send, E* block, std::int64_t rows, std::int64_t nheads) {
  using Space = typename Comm::memory_space;
  for (int m = 0; m < p.mesh().ulysses; ++m) {
    const HeadRange h = kv_heads ? p.kv_heads(m) : p.q_heads(m);
    cx.ops.copy(x.slice_heads(h.begin, h.count),
                TensorView<E, Space>::sbhd(send + t.send_displs[m] / sizeof(E), x.batch(), x.seq(), h.count, x.dim()));
  }
  cx.lap(Phase::pack);
  exchange(cx.ulysses, send, t, block, false);
  cx.lap(Phase::all_to_all_in);
  return TensorView<const E, Space>::sbhd(block, x.batch(), rows, nheads, x.dim());
}

/// The reverse trip: `block` (my heads of the whole ring block, any element type S) goes back
/// as E, and each member's heads of my tokens land in `out`. With `sum` (a [B, L, heads, D]
/// scratch in the accumulation type) pieces of the same head from different members add up:
/// K/V heads that several members' query heads share.
template <class E, class Comm, class S>
void scatter_heads(EngineContext<Comm>& cx, TensorView<S, typename Comm::memory_space> block, const Plan& p,
                   bool kv_heads, const AllToAllTable& t, E* send, E* recv,
                   TensorView<E, typename Comm::memory_space> out, acc_t<E>* sum) {
  using Space = typename Comm::memory_space;
  const auto packed = TensorView<E, Space>::sbhd(send, block.batch(), block.seq(), block.heads(), block.dim());
  // Forward computes straight into `send` when the types agree: nothing to copy then.
  if (!std::is_same_v<S, E> || static_cast<const void*>(block.data) != static_cast<const void*>(send) ||
      block.stride != packed.stride)
    cx.ops.copy(TensorView<const S, Space>(block), packed);
  cx.lap(Phase::finish);
  exchange(cx.ulysses, send, t, recv, true);
  cx.lap(Phase::all_to_all_out);
  using AView = TensorView<acc_t<E>, Space>;
  const AView total = sum ? AView::bshd(sum, out.batch(), out.seq(), out.heads(), out.dim()) : AView{};
  if (sum) cx.ops.fill(total, acc_t<E>(0));
  for (int m = 0; m < p.mesh().ulysses; ++m) {
    const HeadRange h = kv_heads ? p.kv_heads(m) : p.q_heads(m);
    const auto piece =
        TensorView<const E, Space>::sbhd(recv + t.send_displs[m] / sizeof(E), out.batch(), out.seq(), h.count, out.dim());
    if (sum)
      cx.ops.accumulate(piece, total.slice_heads(h.begin, h.count));
    else
      cx.ops.copy(piece, out.slice_heads(h.begin, h.count));
  }
  if (sum) cx.ops.copy(TensorView<const acc_t<E>, Space>(total), out);
  cx.lap(Phase::unpack);
}

}  // namespace seqpar::detail
