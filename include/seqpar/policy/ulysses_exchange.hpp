#pragma once
/// \file
/// The Ulysses exchange, a phase (policy/phase.hpp): the all-to-all that turns "all heads of my
/// tokens" into "my heads of the whole ring block" (gather_heads), and the trip back
/// (scatter_heads). It wraps the phases after it: they see this rank's heads of its ring block.
/// Only policies that list it instantiate it, and it runs when the Ulysses degree is above 1.
///
/// Pieces are packed [seq, batch, heads, dim], so the pieces received from the group's
/// members, back to back in member order, are one strided tensor: the ring block for this
/// rank's heads, with no unpacking. The byte counts come from the tables `tables` makes, the
/// same ones the phase's traffic formulas sum.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "seqpar/core/mesh.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/problem.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/workspace.hpp"
#include "seqpar/policy/engine_context.hpp"
#include "seqpar/policy/phase.hpp"

namespace seqpar::detail {

/// Which heads a Ulysses all-to-all moves, and so which of the plan's head ranges it splits by.
enum class HeadKind : std::uint8_t {
  query,      ///< query heads: Q, O, dO, the LSE, dQ
  key_value,  ///< K/V heads: K, V, dK, dV
};

/// Which way an all-to-all of a table runs.
enum class Direction : std::uint8_t {
  out,   ///< each piece to the peer the table sends it to
  back,  ///< the same pieces returning the way they came
};

/// Runs the all-to-all of table `t` on `c`, in direction `d`.
template <class Comm, class E>
void exchange(Comm& c, const E* send, const AllToAllTable& t, E* recv, Direction d) {
  const auto* s = reinterpret_cast<const std::byte*>(send);
  auto* r = reinterpret_cast<std::byte*>(recv);
  if (d == Direction::back)
    c.all_to_all_v(s, t.recv_counts, t.recv_displs, r, t.send_counts, t.send_displs);
  else
    c.all_to_all_v(s, t.send_counts, t.send_displs, r, t.recv_counts, t.recv_displs);
}

/// The range of heads of `kind` that Ulysses rank m computes.
inline HeadRange heads_of(const Plan& p, HeadKind kind, int m) {
  return kind == HeadKind::key_value ? p.kv_heads(m) : p.q_heads(m);
}

/// Sends each group member its heads of my tokens (`x`), packed in `send`; returns my heads of
/// the whole ring block (`rows` tokens, `nheads` heads), received into `block`.
template <class Comm, class E>
TensorView<const E, typename Comm::memory_space> gather_heads(EngineContext<Comm>& cx,
                                                              TensorView<const E, typename Comm::memory_space> x,
                                                              const Plan& p, HeadKind kind, const AllToAllTable& t,
                                                              E* send, E* block, std::int64_t rows, std::int64_t nheads) {
  using Space = typename Comm::memory_space;
  cx.enter(Phase::pack);
  for (int m = 0; m < p.mesh().ulysses; ++m) {
    const HeadRange h = heads_of(p, kind, m);
    cx.ops.copy(x.slice_heads(h.begin, h.count),
                TensorView<E, Space>::sbhd(send + t.send_displs[m] / sizeof(E), x.batch(), x.seq(), h.count, x.dim()));
  }
  cx.lap(Phase::pack);
  cx.enter(Phase::all_to_all_in);
  exchange(cx.ulysses, send, t, block, Direction::out);
  cx.lap(Phase::all_to_all_in);
  return TensorView<const E, Space>::sbhd(block, x.batch(), rows, nheads, x.dim());
}

/// The reverse trip: `block` (my heads of the whole ring block, any element type S) goes back
/// as E, and each member's heads of my tokens land in `out`. With `sum` (a [B, L, heads, D]
/// scratch in the accumulation type) pieces of the same head from different members add up:
/// K/V heads that several members' query heads share.
template <class E, class Comm, class S>
void scatter_heads(EngineContext<Comm>& cx, TensorView<S, typename Comm::memory_space> block, const Plan& p,
                   HeadKind kind, const AllToAllTable& t, E* send, E* recv,
                   TensorView<E, typename Comm::memory_space> out, acc_t<E>* sum) {
  using Space = typename Comm::memory_space;
  const auto packed = TensorView<E, Space>::sbhd(send, block.batch(), block.seq(), block.heads(), block.dim());
  // The phases inside compute straight into `send` when the types agree: nothing to copy then.
  cx.enter(Phase::finish);
  if (!std::is_same_v<std::remove_const_t<S>, E> ||
      static_cast<const void*>(block.data) != static_cast<const void*>(send) || block.stride != packed.stride)
    cx.ops.copy(TensorView<const S, Space>(block), packed);
  cx.lap(Phase::finish);
  cx.enter(Phase::all_to_all_out);
  exchange(cx.ulysses, send, t, recv, Direction::back);
  cx.lap(Phase::all_to_all_out);
  cx.enter(Phase::unpack);
  using AView = TensorView<acc_t<E>, Space>;
  const AView total = sum ? AView::bshd(sum, out.batch(), out.seq(), out.heads(), out.dim()) : AView{};
  if (sum) cx.ops.fill(total, acc_t<E>(0));
  for (int m = 0; m < p.mesh().ulysses; ++m) {
    const HeadRange h = heads_of(p, kind, m);
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

/// The Ulysses exchange as a phase: an exchange that gives the phases after it this rank's
/// heads of its whole ring block, and takes their results back to the tokens' owners.
struct UlyssesExchange {
  static constexpr const char* name = "UlyssesExchange";  ///< for messages
  static constexpr PhaseKind kind = PhaseKind::exchange;  ///< wraps the phases after it

  /// The all-to-all tables of one mesh rank: Q (and dQ back, reversed), O (back; out with dO
  /// in backward), K and V (and their gradients back), and the LSE (back with O, or out in
  /// backward). Q and K rows hold D elements, O and V rows Dv: separate tables when they differ.
  struct State {
    AllToAllTable q, o, k, v, lse;  ///< by the query heads (q, o, lse), by the K/V heads (k, v)
  };

  /// A Ulysses group of one rank exchanges nothing: the phase runs when the degree is above 1.
  static bool runs(const Plan& p) { return p.mesh().ulysses > 1; }

  /// The tables of mesh rank (r, u): it sends member v v's heads of its tokens and receives its
  /// heads of v's tokens; pieces back to back in member order.
  static State tables(const Plan& p, int r, int u) {
    const auto B = static_cast<std::size_t>(p.problem().batch), D = static_cast<std::size_t>(p.problem().head_dim);
    const auto Dv = static_cast<std::size_t>(p.problem().value_dim());
    auto table = [&](const SequenceLayout& l, HeadKind kind, std::size_t per_row) {
      AllToAllTable t;
      std::size_t so = 0, ro = 0;
      for (int v = 0; v < p.mesh().ulysses; ++v) {
        const std::size_t s = static_cast<std::size_t>(l.length(r, u)) * B *
                              static_cast<std::size_t>(heads_of(p, kind, v).count) * per_row;
        const std::size_t rc = static_cast<std::size_t>(l.length(r, v)) * B *
                               static_cast<std::size_t>(heads_of(p, kind, u).count) * per_row;
        t.send_counts.push_back(s);
        t.send_displs.push_back(so);
        t.recv_counts.push_back(rc);
        t.recv_displs.push_back(ro);
        so += s;
        ro += rc;
      }
      return t;
    };
    return {table(p.q_layout(), HeadKind::query, D * p.elem_bytes()),
            table(p.q_layout(), HeadKind::query, Dv * p.elem_bytes()),
            table(p.kv_layout(), HeadKind::key_value, D * p.elem_bytes()),
            table(p.kv_layout(), HeadKind::key_value, Dv * p.elem_bytes()),
            table(p.q_layout(), HeadKind::query, p.acc_bytes())};
  }

  /// This rank's tables, made once per plan.
  static State schedule(const Plan& p) { return tables(p, p.ring_rank(), p.ulysses_rank()); }

  /// No rule for every shape: any head count splits over the group (some members may get none).
  static std::string reason(const MeshConfig&, const AttentionProblem&, std::span<const std::int64_t>,
                            std::span<const std::int64_t>) {
    return "";
  }

  /// The divisibility rule of the plain policies: every member computes as many query heads.
  static std::string divisibility_reason(const MeshConfig& mesh, const AttentionProblem& problem,
                                         std::span<const std::int64_t>, std::span<const std::int64_t>) {
    if (problem.heads % mesh.ulysses == 0) return "";
    return std::string("plan: ") + mesh.policy + " needs heads divisible by the Ulysses degree: heads " +
           std::to_string(problem.heads) + ", ulysses_degree " + std::to_string(mesh.ulysses) + anything_fix(mesh);
  }

  /// Bytes world rank w sends in one forward: Q, K, V out, O (and the LSE) back.
  static std::size_t forward_bytes(const Plan& p, int w) {
    const int u = p.mesh().ulysses_rank(w);
    const State t = tables(p, p.mesh().ring_rank(w), u);
    const std::size_t lse = p.problem().with_lse ? t.lse.bytes_returned(u) : 0;
    return t.q.bytes_sent(u) + t.k.bytes_sent(u) + t.v.bytes_sent(u) + t.o.bytes_returned(u) + lse;
  }

  /// Bytes world rank w sends in one backward: Q, O, dO, the LSE, K and V out; dQ, dK, dV back.
  static std::size_t backward_bytes(const Plan& p, int w) {
    const int u = p.mesh().ulysses_rank(w);
    const State t = tables(p, p.mesh().ring_rank(w), u);
    return t.q.bytes_sent(u) + 2 * t.o.bytes_sent(u) + t.lse.bytes_sent(u) + t.k.bytes_sent(u) + t.v.bytes_sent(u) +
           t.q.bytes_returned(u) + t.k.bytes_returned(u) + t.v.bytes_returned(u);
  }

  /// Forward's buffers besides SharedSlots::kv (where K and V land).
  struct ForwardSlots {
    static constexpr Slot q_block{"q_block"};                        ///< [Qr, B, hq, D] gathered queries
    static constexpr Slot q_send{"q_send", SlotLife::exchange_in};   ///< [Lq, B, H, D] Q packed by member
    static constexpr Slot k_send{"k_send", SlotLife::exchange_in};   ///< K packed (a shared head once per member)
    static constexpr Slot v_send{"v_send", SlotLife::exchange_in};   ///< V packed alike
    static constexpr Slot o_send{"o_send", SlotLife::exchange_out};  ///< [Qr, B, hq, Dv] output block, sent back
    static constexpr Slot l_send{"l_send", SlotLife::exchange_out};  ///< [Qr, B, hq] LSE block, sent back
    static constexpr Slot o_recv{"o_recv", SlotLife::exchange_out};  ///< [Lq, B, H, Dv] pieces received back
    static constexpr Slot l_recv{"l_recv", SlotLife::exchange_out};  ///< [Lq, B, H] LSE pieces received back
  };

  /// Backward's buffers besides SharedSlots::kv.
  struct BackwardSlots {
    static constexpr Slot q_block{"q_block"};                          ///< [Qr, B, hq, D] gathered Q
    static constexpr Slot do_block{"do_block"};                        ///< gathered dO
    static constexpr Slot o_block{"o_block"};                          ///< gathered O
    static constexpr Slot l_block{"l_block"};                          ///< [Qr, B, hq] gathered LSE
    static constexpr Slot q_send{"q_send", SlotLife::exchange_in};     ///< [Lq, B, H, D] Q packed by member
    static constexpr Slot do_send{"do_send", SlotLife::exchange_in};   ///< dO packed
    static constexpr Slot o_send{"o_send", SlotLife::exchange_in};     ///< O packed
    static constexpr Slot l_send{"l_send", SlotLife::exchange_in};     ///< the LSE packed
    static constexpr Slot k_send{"k_send", SlotLife::exchange_in};     ///< K packed
    static constexpr Slot v_send{"v_send", SlotLife::exchange_in};     ///< V packed
    static constexpr Slot dq_send{"dq_send", SlotLife::exchange_out};  ///< [Qr, B, hq, D] dQ block, sent back
    static constexpr Slot dq_recv{"dq_recv", SlotLife::exchange_out};  ///< [Lq, B, H, D] its pieces received
    static constexpr Slot dk_send{"dk_send", SlotLife::exchange_out};  ///< [Kr, B, hk, D] dK block, sent back
    static constexpr Slot dv_send{"dv_send", SlotLife::exchange_out};  ///< [Kr, B, hk, Dv] dV block, sent back
    static constexpr Slot dk_recv{"dk_recv", SlotLife::exchange_out};  ///< dK pieces received
    static constexpr Slot dv_recv{"dv_recv", SlotLife::exchange_out};  ///< dV pieces received
    /// [B, Lk, K, D] in the accumulation type: a K/V head several members used gets their sum.
    static constexpr Slot dk_sum{"dk_sum", SlotLife::exchange_out};
    static constexpr Slot dv_sum{"dv_sum", SlotLife::exchange_out};  ///< the same for dV ([B, Lk, K, Dv])
  };

  /// Declares the phase's buffers for plan p.
  static void declare(const Plan& p, WorkspaceLayout& forward, WorkspaceLayout& backward) {
    const LocalShape n(p);
    const std::size_t e = p.elem_bytes(), a = p.acc_bytes();
    const std::size_t rows_q = n.lq * n.B * n.H, rows_kv_out = n.lk * n.B * n.kv_sent, rows_kv = n.lk * n.B * n.K;
    const std::size_t kv_in_hand = n.kv_pair(n.kr) * e;
    using F = ForwardSlots;
    forward.declare(F::q_block, n.q_block() * e);
    forward.declare(SharedSlots::kv, kv_in_hand);
    forward.declare(F::q_send, rows_q * n.D * e);
    forward.declare(F::k_send, rows_kv_out * n.D * e);
    forward.declare(F::v_send, rows_kv_out * n.Dv * e);
    forward.declare(F::o_send, n.o_block() * e);
    forward.declare(F::l_send, n.q_rows() * a);
    forward.declare(F::o_recv, rows_q * n.Dv * e);
    forward.declare(F::l_recv, rows_q * a);
    using Bw = BackwardSlots;
    backward.declare(Bw::q_block, n.q_block() * e);
    backward.declare(Bw::do_block, n.o_block() * e);
    backward.declare(Bw::o_block, n.o_block() * e);
    backward.declare(Bw::l_block, n.q_rows() * a);
    backward.declare(SharedSlots::kv, kv_in_hand);
    backward.declare(Bw::q_send, rows_q * n.D * e);
    backward.declare(Bw::do_send, rows_q * n.Dv * e);
    backward.declare(Bw::o_send, rows_q * n.Dv * e);
    backward.declare(Bw::l_send, rows_q * a);
    backward.declare(Bw::k_send, rows_kv_out * n.D * e);
    backward.declare(Bw::v_send, rows_kv_out * n.Dv * e);
    backward.declare(Bw::dq_send, n.q_block() * e);
    backward.declare(Bw::dq_recv, rows_q * n.D * e);
    backward.declare(Bw::dk_send, n.kv_block(n.kr) * e);
    backward.declare(Bw::dv_send, n.v_block(n.kr) * e);
    backward.declare(Bw::dk_recv, rows_kv_out * n.D * e);
    backward.declare(Bw::dv_recv, rows_kv_out * n.Dv * e);
    backward.declare(Bw::dk_sum, rows_kv * n.D * a);
    backward.declare(Bw::dv_sum, rows_kv * n.Dv * a);
  }

  /// Forward, in: my heads of the ring block's Q, K and V (K and V in SharedSlots::kv); the
  /// phases inside write O and the LSE into the blocks that go back.
  template <class Call, class T, class Space>
  static ForwardOperands<T, Space> in(Call& call, const ForwardOperands<T, Space>& x) {
    using F = ForwardSlots;
    const auto s = LocalShape(call.plan).extents();
    ForwardOperands<T, Space> in = x;
    gather_qkv(call, x, F::q_send, F::k_send, F::v_send, F::q_block, in);
    in.out = TensorView<T, Space>::sbhd(call.ws.template get<T>(F::o_send), s.B, s.qr, s.hq, s.Dv);
    in.lse = call.plan.problem().with_lse
                 ? TensorView<acc_t<T>, Space>::sbhd(call.ws.template get<acc_t<T>>(F::l_send), s.B, s.qr, s.hq, 1)
                 : TensorView<acc_t<T>, Space>{};
    return in;
  }

  /// Forward, out: O (and the LSE) back to the tokens' owners, into x's outputs.
  template <class Call, class T, class Space>
  static void out(Call& call, const ForwardOperands<T, Space>& inner, const ForwardOperands<T, Space>& x) {
    using F = ForwardSlots;
    const State& t = PlanAccess::state<UlyssesExchange>(call.plan);
    scatter<T>(call, inner.out, HeadKind::query, t.o, F::o_send, F::o_recv, x.out);
    if (call.plan.problem().with_lse)
      scatter<acc_t<T>>(call, inner.lse, HeadKind::query, t.lse, F::l_send, F::l_recv, x.lse);
  }

  /// Backward, in: my heads of the ring block's Q, K, V, dO, O and the LSE (no activations are
  /// kept between calls); the phases inside write the gradients into the blocks that go back.
  template <class Call, class T, class Space>
  static BackwardOperands<T, Space> in(Call& call, const BackwardOperands<T, Space>& x) {
    using Bw = BackwardSlots;
    const auto s = LocalShape(call.plan).extents();
    const State& t = PlanAccess::state<UlyssesExchange>(call.plan);
    BackwardOperands<T, Space> in = x;
    gather_qkv(call, x, Bw::q_send, Bw::k_send, Bw::v_send, Bw::q_block, in);
    in.dout = gather(call, x.dout, t.o, Bw::do_send, Bw::do_block);
    in.out = gather(call, x.out, t.o, Bw::o_send, Bw::o_block);
    in.lse = gather(call, x.lse, t.lse, Bw::l_send, Bw::l_block);
    in.dq = TensorView<T, Space>::sbhd(call.ws.template get<T>(Bw::dq_send), s.B, s.qr, s.hq, s.D);
    in.dk = TensorView<T, Space>::sbhd(call.ws.template get<T>(Bw::dk_send), s.B, s.kr, s.hk, s.D);
    in.dv = TensorView<T, Space>::sbhd(call.ws.template get<T>(Bw::dv_send), s.B, s.kr, s.hk, s.Dv);
    return in;
  }

  /// Backward, out: dQ, dK and dV back to the tokens' owners, into x's gradients; a K/V head
  /// that several members' query heads read gets the sum of their gradients.
  template <class Call, class T, class Space>
  static void out(Call& call, const BackwardOperands<T, Space>& inner, const BackwardOperands<T, Space>& x) {
    using Bw = BackwardSlots;
    const State& t = PlanAccess::state<UlyssesExchange>(call.plan);
    scatter<T>(call, inner.dq, HeadKind::query, t.q, Bw::dq_send, Bw::dq_recv, x.dq);
    scatter<T>(call, inner.dk, HeadKind::key_value, t.k, Bw::dk_send, Bw::dk_recv, x.dk, &Bw::dk_sum);
    scatter<T>(call, inner.dv, HeadKind::key_value, t.v, Bw::dv_send, Bw::dv_recv, x.dv, &Bw::dv_sum);
  }

 private:
  /// gather_heads of query-head rows into slot `block`, packed in slot `send`.
  template <class Call, class E, class Space>
  static TensorView<const E, Space> gather(Call& call, TensorView<const E, Space> x, const AllToAllTable& t,
                                           const Slot& send, const Slot& block) {
    const auto s = LocalShape(call.plan).extents();
    return gather_heads(call.cx, x, call.plan, HeadKind::query, t, call.ws.template get<E>(send),
                        call.ws.template get<E>(block), s.qr, s.hq);
  }

  /// scatter_heads through slots `send` and `recv`; `sum` (or none) adds up shared K/V heads.
  template <class E, class Call, class S, class Space>
  static void scatter(Call& call, TensorView<S, Space> block, HeadKind kind, const AllToAllTable& t, const Slot& send,
                      const Slot& recv, TensorView<E, Space> out, const Slot* sum = nullptr) {
    scatter_heads<E>(call.cx, block, call.plan, kind, t, call.ws.template get<E>(send), call.ws.template get<E>(recv),
                     out, sum ? call.ws.template get<acc_t<E>>(*sum) : nullptr);
  }

  /// Gathers Q into `q_block`, and K and V into SharedSlots::kv ([K | V]), for forward and
  /// backward alike; the gathered views go into `in`.
  template <class Call, class X>
  static void gather_qkv(Call& call, const X& x, const Slot& q_send, const Slot& k_send, const Slot& v_send,
                         const Slot& q_block, X& in) {
    using T = typename X::value_type;
    const LocalShape n(call.plan);
    const auto s = n.extents();
    const State& t = PlanAccess::state<UlyssesExchange>(call.plan);
    T* kv = call.ws.template get<T>(SharedSlots::kv);
    in.q = gather(call, x.q, t.q, q_send, q_block);
    in.k = gather_heads(call.cx, x.k, call.plan, HeadKind::key_value, t.k, call.ws.template get<T>(k_send), kv, s.kr,
                        s.hk);
    in.v = gather_heads(call.cx, x.v, call.plan, HeadKind::key_value, t.v, call.ws.template get<T>(v_send),
                        kv + n.kv_block(n.kr), s.kr, s.hk);
  }
};

}  // namespace seqpar::detail
