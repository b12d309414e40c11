#pragma once
/// \file
/// The workspace of forward and backward as named slots: what each buffer holds, its size and
/// its lifetime. Aliasing is declared by lifetime (core/workspace.hpp, SlotLife): the packing
/// buffers of the inbound all-to-all (`exchange_in`) and the buffers of the way back
/// (`exchange_out`) share bytes; everything else is live for the whole call. The plan lays the
/// slots out once; a call only looks its buffers up.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "seqpar/core/plan.hpp"
#include "seqpar/core/workspace.hpp"

namespace seqpar::detail {

/// Sizes of this rank's tensors under a plan, in elements.
struct LocalShape {
  std::size_t B, D, H, K;  // batch, head_dim, heads, kv_heads
  std::size_t lq, lk;      // local tokens
  std::size_t qr, kr;      // tokens of this rank's ring block (what the Ulysses group holds)
  std::size_t hq, hk;      // heads this rank computes (query, K/V)
  std::size_t kv_sent;     // K/V heads this rank packs for its group (shared heads count twice)
  std::size_t kv_ring;     // elements of one [K | V] ring buffer

  explicit LocalShape(const Plan& p) {
    const int r = p.ring_rank(), u = p.ulysses_rank();
    auto z = [](std::int64_t x) { return static_cast<std::size_t>(x); };
    B = z(p.problem().batch);
    D = z(p.problem().head_dim);
    H = z(p.problem().heads);
    K = z(p.problem().kv_heads);
    lq = z(p.local_q());
    lk = z(p.local_kv());
    qr = z(p.q_layout().block(r).size());
    kr = z(p.kv_layout().block(r).size());
    hq = z(p.q_heads(u).count);
    hk = z(p.kv_heads(u).count);
    kv_sent = 0;
    for (int v = 0; v < p.mesh().ulysses; ++v) kv_sent += z(p.kv_heads(v).count);
    std::int64_t max_block = 0;
    for (int src = 0; src < p.mesh().ring; ++src) max_block = std::max(max_block, p.kv_layout().block(src).size());
    kv_ring = 2 * (p.mesh().ring > 1 ? z(max_block) : kr) * B * hk * D;
  }
  /// Elements of this rank's heads over its ring block (a gathered Q, O or dO).
  std::size_t q_block() const { return qr * B * hq * D; }
  /// Rows (LSE elements) of the same.
  std::size_t q_rows() const { return qr * B * hq; }
};

/// Forward's slots. The ring buffers hold [K | V] blocks; with T == A the running output
/// lives in the output block itself, so o_acc is used only when T != A.
enum ForwardSlot : std::size_t {
  fs_q_block,  // [Qr, B, hq, D] gathered queries (U > 1)
  fs_ring0,    // [K | V] block in hand (U > 1 or R > 1)
  fs_ring1,    // [K | V] block arriving (R > 1)
  fs_o_acc,    // running output in A (R > 1, T != A)
  fs_o_part,   // one ring step's output in A
  fs_l_acc,    // running LSE
  fs_l_part,   // one ring step's LSE
  fs_q_send,   // packing for the inbound all-to-all
  fs_k_send,
  fs_v_send,
  fs_o_send,   // [Qr, B, hq, D] output block, sent back
  fs_l_send,   // [Qr, B, hq] LSE block, sent back
  fs_o_recv,   // [Lq, B, H, D] pieces received back
  fs_l_recv,
};
static_assert(fs_l_recv + 1 == forward_slot_count);

/// Backward's slots. dK/dV accumulators travel the ring with K/V, in A.
enum BackwardSlot : std::size_t {
  bs_q_block, bs_do_block, bs_o_block, bs_l_block,  // gathered (U > 1)
  bs_ring0, bs_ring1,                               // [K | V]
  bs_grad0, bs_grad1,                               // [dK | dV]: the one in hand, the one arriving
  bs_grad_part,                                     // this step's contribution
  bs_dq_acc,                                        // [Qr, B, hq, D]
  bs_q_send, bs_do_send, bs_o_send, bs_l_send, bs_k_send, bs_v_send,  // inbound packing
  bs_dq_send, bs_dq_recv, bs_dk_send, bs_dv_send, bs_dk_recv, bs_dv_recv,  // the way back
  bs_dk_sum, bs_dv_sum,  // [B, Lk, K, D]: a K/V head several members used gets their sum
};
static_assert(bs_dv_sum + 1 == backward_slot_count);

/// Lays out forward's slots for a plan (element and accumulation sizes from its dtype).
inline WorkspaceLayout<forward_slot_count> forward_layout(const Plan& p) {
  const LocalShape n(p);
  const std::size_t e = p.elem_bytes(), a = p.acc_bytes();
  const bool U = p.mesh().ulysses > 1, R = p.mesh().ring > 1;
  const auto W = SlotLife::whole_call, I = SlotLife::exchange_in, O = SlotLife::exchange_out;
  return WorkspaceLayout<forward_slot_count>({{
      {"q_block", n.q_block() * e, W, U},
      {"ring0", n.kv_ring * e, W, U || R},
      {"ring1", n.kv_ring * e, W, R},
      {"o_acc", n.q_block() * a, W, R && e != a},
      {"o_part", n.q_block() * a, W, R},
      {"l_acc", n.q_rows() * a, W, R},
      {"l_part", n.q_rows() * a, W, R},
      {"q_send", n.lq * n.B * n.H * n.D * e, I, U},
      {"k_send", n.lk * n.B * n.kv_sent * n.D * e, I, U},
      {"v_send", n.lk * n.B * n.kv_sent * n.D * e, I, U},
      {"o_send", n.q_block() * e, O, U},
      {"l_send", n.q_rows() * a, O, U},
      {"o_recv", n.lq * n.B * n.H * n.D * e, O, U},
      {"l_recv", n.lq * n.B * n.H * a, O, U},
  }});
}

/// Lays out backward's slots for a plan.
inline WorkspaceLayout<backward_slot_count> backward_layout(const Plan& p) {
  const LocalShape n(p);
  const std::size_t e = p.elem_bytes(), a = p.acc_bytes();
  const bool U = p.mesh().ulysses > 1, R = p.mesh().ring > 1;
  const auto W = SlotLife::whole_call, I = SlotLife::exchange_in, O = SlotLife::exchange_out;
  const std::size_t full = n.lq * n.B * n.H * n.D, kv_out = n.lk * n.B * n.kv_sent * n.D;
  const std::size_t kv_block = n.kr * n.B * n.hk * n.D, kv_sum = n.lk * n.B * n.K * n.D;
  return WorkspaceLayout<backward_slot_count>({{
      {"q_block", n.q_block() * e, W, U},
      {"do_block", n.q_block() * e, W, U},
      {"o_block", n.q_block() * e, W, U},
      {"l_block", n.q_rows() * a, W, U},
      {"ring0", n.kv_ring * e, W, U || R},
      {"ring1", n.kv_ring * e, W, R},
      {"grad0", n.kv_ring * a, W, true},
      {"grad1", n.kv_ring * a, W, R},
      {"grad_part", n.kv_ring * a, W, R},
      {"dq_acc", n.q_block() * a, W, true},
      {"q_send", full * e, I, U},
      {"do_send", full * e, I, U},
      {"o_send", full * e, I, U},
      {"l_send", n.lq * n.B * n.H * a, I, U},
      {"k_send", kv_out * e, I, U},
      {"v_send", kv_out * e, I, U},
      {"dq_send", n.q_block() * e, O, U},
      {"dq_recv", full * e, O, U},
      {"dk_send", kv_block * e, O, U},
      {"dv_send", kv_block * e, O, U},
      {"dk_recv", kv_out * e, O, U},
      {"dv_recv", kv_out * e, O, U},
      {"dk_sum", kv_sum * a, O, U},
      {"dv_sum", kv_sum * a, O, U},
  }});
}

/// Looks up slots of one call's workspace by name: `slots.get<T>(fs_q_send)`.
template <class Layout>
struct Slots {
  const Layout& layout;          ///< the plan's layout
  std::span<std::byte> bytes;    ///< the caller's workspace
  /// Slot `i` as T* (null when unused).
  template <class T>
  T* get(std::size_t i) const { return layout.template get<T>(bytes, i); }
};

}  // namespace seqpar::detail
