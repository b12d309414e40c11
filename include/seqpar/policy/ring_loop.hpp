#pragma once
/// \file
/// The ring loop, a phase (policy/phase.hpp) that computes: K/V blocks travel the ring in a
/// double buffer while the current block computes; each step's partial output merges into the
/// running output by the LSE rule (kernel/merge_state.hpp); steps whose keys no local query
/// sees are skipped (the phase's State). Only policies that list it instantiate it, and it
/// runs when the ring degree is above 1 (otherwise the next compute phase, the local kernel,
/// computes).
///
/// On a communicator that can poll (test(), e.g. MPI), the kernel runs in chunks of heads with
/// a progress poll after each while a hop is in flight, since such a communicator may move a
/// large message only when called. Every head is computed on its own whatever the chunk, so the
/// bits do not change.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/core/mesh.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/problem.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/workspace.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/policy/engine_context.hpp"
#include "seqpar/policy/phase.hpp"

namespace seqpar::detail {

/// Elements of one [K | V] ring block from ring rank `src` for Ulysses rank u's K/V heads (K
/// rows of D elements, V rows of Dv).
inline std::size_t ring_block_elems(const Plan& p, int src, int u) {
  return static_cast<std::size_t>(p.kv_layout().block(src).size()) * static_cast<std::size_t>(p.problem().batch) *
         static_cast<std::size_t>(p.kv_heads(u).count) *
         static_cast<std::size_t>(p.problem().head_dim + p.problem().value_dim());
}

/// The stripe layout's rule: token t lives on ring rank t mod R, so the lengths follow from
/// the total (ring rank r's block holds ceil((S - r) / R) tokens). "" when `len` (per world
/// rank, sums checked already) does, or the layout is another.
inline std::string stripe_reason(const MeshConfig& mesh, std::span<const std::int64_t> len, const char* which) {
  if (mesh.layout != LayoutKind::stripe || mesh.ring <= 1) return "";
  std::vector<std::int64_t> block(static_cast<std::size_t>(mesh.ring), 0);
  std::int64_t total = 0;
  for (std::size_t w = 0; w < len.size(); ++w) {
    block[static_cast<std::size_t>(mesh.ring_rank(static_cast<int>(w)))] += len[w];
    total += len[w];
  }
  for (int r = 0; r < mesh.ring; ++r) {
    const std::int64_t want = total > r ? (total - r + mesh.ring - 1) / mesh.ring : 0;
    if (block[static_cast<std::size_t>(r)] != want)
      return "plan: stripe layout: ring rank " + std::to_string(r) + " must hold " + std::to_string(want) + " of the " +
             std::to_string(total) + " tokens of the " + which + " (token t lives on ring rank t mod " +
             std::to_string(mesh.ring) + "), got " + std::to_string(block[static_cast<std::size_t>(r)]) +
             "; use split_sequence() for the lengths, or the contiguous or zigzag layout";
  }
  return "";
}

template <class Comm, class Kernel>
struct RingSteps;

/// The ring loop as a phase: it computes this rank's queries against every ring rank's K/V
/// block, one ring step each, the block in hand travelling on while it computes.
struct RingLoop {
  static constexpr const char* name = "RingLoop";        ///< for messages
  static constexpr PhaseKind kind = PhaseKind::compute;  ///< computes; ends the list when it runs

  /// Which ring steps compute: step s (the block of ring rank r - s) only if some query of this
  /// rank's block sees some key of it.
  struct State {
    std::vector<unsigned char> step_computes;  ///< per ring step: does any query see a key?
  };

  /// A ring of one rank has no hops: the phase runs when the ring degree is above 1.
  static bool runs(const Plan& p) { return p.mesh().ring > 1; }

  /// Which steps compute, decided once per plan.
  static State schedule(const Plan& p) {
    const int R = p.mesh().ring, r = p.ring_rank();
    State s;
    for (int step = 0; step < R; ++step) s.step_computes.push_back(keys_visible(p, (r - step + R) % R));
    return s;
  }

  /// The rule the layout puts on every shape: stripe lengths follow from the total.
  static std::string reason(const MeshConfig& mesh, const AttentionProblem&, std::span<const std::int64_t> q_len,
                            std::span<const std::int64_t> kv_len) {
    if (std::string why = stripe_reason(mesh, q_len, "queries"); !why.empty()) return why;
    return stripe_reason(mesh, kv_len, "keys and values");
  }

  /// The divisibility rule of the plain policies: a zigzag block splits into two equal chunks.
  static std::string divisibility_reason(const MeshConfig& mesh, const AttentionProblem&,
                                         std::span<const std::int64_t> q_len, std::span<const std::int64_t>) {
    if (mesh.layout != LayoutKind::zigzag || q_len.empty() || (q_len[0] * mesh.ulysses) % 2 == 0) return "";
    return std::string("plan: ") + mesh.policy + " with the zigzag layout needs an even ring block length, got " +
           std::to_string(q_len[0] * mesh.ulysses) + anything_fix(mesh);
  }

  /// Bytes world rank w sends in the first `hops` ring hops (step s sends block r - s).
  static std::size_t hop_bytes(const Plan& p, int w, int hops, std::size_t bytes_per_elem) {
    const int R = p.mesh().ring, r = p.mesh().ring_rank(w), u = p.mesh().ulysses_rank(w);
    std::size_t n = 0;
    for (int s = 0; s < hops; ++s) n += ring_block_elems(p, (r - s + R) % R, u) * bytes_per_elem;
    return n;
  }

  /// Bytes world rank w sends in one forward: K/V blocks R-1 hops.
  static std::size_t forward_bytes(const Plan& p, int w) { return hop_bytes(p, w, p.mesh().ring - 1, p.elem_bytes()); }

  /// Bytes world rank w sends in one backward: K/V R-1 hops, and every block's dK/dV (in the
  /// accumulation type) R hops, the last one home.
  static std::size_t backward_bytes(const Plan& p, int w) {
    return hop_bytes(p, w, p.mesh().ring - 1, p.elem_bytes()) + hop_bytes(p, w, p.mesh().ring, p.acc_bytes());
  }

  /// Forward's buffers besides SharedSlots::kv (the block in hand). With T == A the running
  /// output lives in the output block itself, so o_acc is declared only when T != A.
  struct ForwardSlots {
    static constexpr Slot kv_next{"kv_next"};  ///< [K | V] block arriving
    static constexpr Slot o_acc{"o_acc"};      ///< running output in A
    static constexpr Slot o_part{"o_part"};    ///< one ring step's output in A
    static constexpr Slot l_acc{"l_acc"};      ///< running LSE
    static constexpr Slot l_part{"l_part"};    ///< one ring step's LSE
  };

  /// Backward's buffers besides the shared ones. dK/dV accumulators travel the ring with
  /// K/V, in A: SharedSlots::grad is the one in hand.
  struct BackwardSlots {
    static constexpr Slot kv_next{"kv_next"};      ///< [K | V] block arriving
    static constexpr Slot grad_next{"grad_next"};  ///< [dK | dV] accumulator arriving
    static constexpr Slot grad_part{"grad_part"};  ///< this step's contribution
  };

  /// Declares the phase's buffers for plan p: ring buffers sized for the longest block.
  static void declare(const Plan& p, WorkspaceLayout& forward, WorkspaceLayout& backward) {
    const LocalShape n(p);
    const std::size_t e = p.elem_bytes(), a = p.acc_bytes(), ring = n.kv_pair(n.kv_max);
    using F = ForwardSlots;
    forward.declare(SharedSlots::kv, ring * e);
    forward.declare(F::kv_next, ring * e);
    if (e != a) forward.declare(F::o_acc, n.o_block() * a);
    forward.declare(F::o_part, n.o_block() * a);
    forward.declare(F::l_acc, n.q_rows() * a);
    forward.declare(F::l_part, n.q_rows() * a);
    using Bw = BackwardSlots;
    backward.declare(SharedSlots::kv, ring * e);
    backward.declare(Bw::kv_next, ring * e);
    backward.declare(SharedSlots::grad, ring * a);
    backward.declare(Bw::grad_next, ring * a);
    backward.declare(Bw::grad_part, ring * a);
    backward.declare(SharedSlots::dq_acc, n.q_block() * a);
  }

  /// Forward over the R ring steps into x's output and LSE. With T == A the running output
  /// (and the LSE, when asked for) live where they end: no copy at the end.
  template <class Call, class T, class Space>
  static void compute(Call& call, const ForwardOperands<T, Space>& x) {
    using A = acc_t<T>;
    using AView = TensorView<A, Space>;
    using F = ForwardSlots;
    const Plan& p = call.plan;
    const auto s = LocalShape(p).extents();
    const auto& ws = call.ws;
    T* const kv = take_in_hand(call, x);
    RingSteps<typename Call::Comm, typename Call::Kernel> ring{call.cx, call.kernel};
    const KernelParams params = kernel_params(p, x.k_positions);
    A* const l_acc = ws.template get<A>(F::l_acc);
    auto run = [&](AView o_acc, AView l_out) {
      ring.template forward<T>(p, x.q, kv, ws.template get<T>(F::kv_next), ws.template get<A>(F::o_part),
                               ws.template get<A>(F::l_part), params, o_acc, l_out);
    };
    if constexpr (std::is_same_v<T, A>) {
      // (The running output and LSE are then the caller's tensors, while every step reads Q
      // again: MeshEngine::forward refuses out or lse over q.)
      run(x.out, x.lse.absent() ? AView::sbhd(l_acc, s.B, s.qr, s.hq, 1) : x.lse);
    } else {
      const AView o_acc = AView::sbhd(ws.template get<A>(F::o_acc), s.B, s.qr, s.hq, s.Dv);
      const AView l_all = AView::sbhd(l_acc, s.B, s.qr, s.hq, 1);
      run(o_acc, l_all);
      call.cx.enter(Phase::finish);
      call.cx.ops.copy(TensorView<const A, Space>(o_acc), x.out);
      if (!x.lse.absent()) call.cx.ops.copy(TensorView<const A, Space>(l_all), x.lse);
      call.cx.lap(Phase::finish);
    }
  }

  /// Backward over the R ring steps into x's gradients: each block's dK/dV accumulator follows
  /// the block round the ring and comes home to the rank that owns it.
  template <class Call, class T, class Space>
  static void compute(Call& call, const BackwardOperands<T, Space>& x) {
    using A = acc_t<T>;
    using Bw = BackwardSlots;
    const Plan& p = call.plan;
    const auto& ws = call.ws;
    T* const kv = take_in_hand(call, x);
    const auto acc = zero_accumulators<A>(call, LocalShape(p).extents().kr);
    T* const ring[2] = {kv, ws.template get<T>(Bw::kv_next)};
    A* const grad[2] = {acc.grad, ws.template get<A>(Bw::grad_next)};
    const A* own = RingSteps<typename Call::Comm, typename Call::Kernel>{call.cx, call.kernel}.template backward<T>(
        p, x.q, x.dout, x.out, x.lse, ring, grad, ws.template get<A>(Bw::grad_part), kernel_params(p, x.k_positions),
        acc.dq);
    deliver_gradients(call, acc.dq, own, x);
  }

 private:
  /// The block in hand ([K | V] in SharedSlots::kv), where the hops start from: K and V are
  /// copied there unless an exchange before this phase gathered them there.
  template <class Call, class X>
  static auto* take_in_hand(Call& call, const X& x) {
    using T = typename X::value_type;
    using Space = typename X::memory_space;
    T* const kv = call.ws.template get<T>(SharedSlots::kv);
    if (x.k.data == kv) return kv;
    const LocalShape n(call.plan);
    const auto s = n.extents();
    call.cx.enter(Phase::pack);
    call.cx.ops.copy(x.k, TensorView<T, Space>::sbhd(kv, s.B, s.kr, s.hk, s.D));
    call.cx.ops.copy(x.v, TensorView<T, Space>::sbhd(kv + n.kv_block(n.kr), s.B, s.kr, s.hk, s.Dv));
    call.cx.lap(Phase::pack);
    return kv;
  }
};

/// The loop itself, over one engine's context and kernel.
template <class Comm, class Kernel>
struct RingSteps {
  using Space = typename Comm::memory_space;  ///< where tensors live
  EngineContext<Comm>& cx;                    ///< communicators, ops, clock
  Kernel& kernel;                             ///< the local kernel

  /// True when the communicator can make progress on a started exchange without blocking.
  static constexpr bool can_poll = requires(Comm& c, typename Comm::request_type& r) {
    { c.test(r) } -> std::convertible_to<bool>;
  };
  /// Progress polls per ring step while a hop is in flight (see the file comment).
  static constexpr std::int64_t progress_chunks = 8;

  /// One ring hop in flight: started, maybe seen complete by a progress poll, then waited.
  struct Hop {
    typename Comm::request_type req{};
    PhaseClock::time_point started{}, done{};
    int step = -1;  // -1: no hop
    bool complete = false;

    void start(EngineContext<Comm>& c, typename Comm::request_type&& r, int s) {
      started = c.clock.now();
      req = std::move(r);
      step = s;
      c.lap(Phase::wait, s);  // posting the hop is communication, charged with its wait
    }
    /// Lets the communicator move bytes while the rank computes; true once the hop is done.
    bool poll(EngineContext<Comm>& c) {
      if constexpr (can_poll) {
        if (step >= 0 && !complete && c.ring.test(req)) {
          complete = true;
          done = c.clock.now();
        }
      }
      return step < 0 || complete;
    }
    void finish(EngineContext<Comm>& c) {
      c.enter(Phase::wait, step);
      c.ring.wait(req);
      c.lap(Phase::wait, step);
      c.clock.hop(c.pass, step, started, complete ? done : c.mark);
    }
  };

  /// Runs `run(first, count)` over `units` heads: in one call, or, while `a` (or `b`) is in
  /// flight on a communicator that can poll, in chunks with a poll after each.
  template <class Run>
  void compute_polling(std::int64_t units, Run run, Hop& a, Hop* b = nullptr) {
    auto done = [&] {
      const bool da = a.poll(cx), db = b ? b->poll(cx) : true;  // poll both, always
      return da && db;
    };
    const std::int64_t chunk = std::max<std::int64_t>(1, (units + progress_chunks - 1) / progress_chunks);
    std::int64_t h = 0;
    if constexpr (can_poll)
      for (; h < units && !done(); h += std::min(chunk, units - h)) run(h, std::min(chunk, units - h));
    if (h < units) run(h, units - h);
  }

  /// Starts the hop of the block from ring rank `src` (elements of type E: K/V or their
  /// gradients): mine to the next rank, the previous rank's into `into`. Both sides know every
  /// block's size from the plan, with the sizes Plan::forward_bytes counts. The hop carries
  /// the call's tag (where the communicator takes one), so a message of another call is
  /// refused rather than taken for this one's, even when its size fits.
  template <class E>
  typename Comm::request_type start_hop(const Plan& p, const E* from, int src, E* into) {
    const int R = p.mesh().ring, r = p.ring_rank(), u = p.ulysses_rank();
    return detail::start_exchange(cx.ring, reinterpret_cast<const std::byte*>(from),
                                  sizeof(E) * ring_block_elems(p, src, u), (r + 1) % R,
                                  reinterpret_cast<std::byte*>(into),
                                  sizeof(E) * ring_block_elems(p, (src - 1 + R) % R, u), (r - 1 + R) % R, cx.tag);
  }

  /// kernel.forward over query heads with progress polls.
  template <class T, class O>
  void compute_forward(TensorView<const T, Space> q, TensorView<const T, Space> k, TensorView<const T, Space> v,
                       TensorView<O, Space> o, TensorView<acc_t<T>, Space> l, const KernelParams& params, Hop& hop) {
    compute_polling(q.heads(), [&](std::int64_t h, std::int64_t c) {
      KernelParams part = params;
      part.q_head_begin += h;
      if (c == q.heads())
        kernel.forward(q, k, v, o, l, params);
      else
        kernel.forward(q.slice_heads(h, c), k, v, o.slice_heads(h, c), l.slice_heads(h, c), part);
    }, hop);
  }

  /// Forward over R > 1 steps; the running output and LSE end in o_acc, l_acc. The first step
  /// that computes writes them directly (no zeroing, no merge); later steps compute into the
  /// step buffers (o_part, l_part) and merge. A kernel that writes only T (not the
  /// accumulation type A) computes into o_part's bytes as T, and the merge converts.
  template <class T>
  void forward(const Plan& p, TensorView<const T, Space> qb, T* ring0, T* ring1, acc_t<T>* o_part_bytes,
               acc_t<T>* l_part_bytes, KernelParams params, TensorView<acc_t<T>, Space> o_acc,
               TensorView<acc_t<T>, Space> l_acc) {
    using A = acc_t<T>;
    const int R = p.mesh().ring, r = p.ring_rank();
    const auto B = p.problem().batch, D = p.problem().head_dim, Dv = p.problem().value_dim();
    const auto hk = p.kv_heads(p.ulysses_rank()).count, Q = o_acc.seq(), hq = o_acc.heads();
    constexpr bool writes_acc = kernel_writes_acc<Kernel, T>;
    using Part = std::conditional_t<writes_acc, A, T>;
    const auto o_part = TensorView<Part, Space>::sbhd(reinterpret_cast<Part*>(o_part_bytes), B, Q, hq, Dv);
    const auto l_part = TensorView<A, Space>::sbhd(l_part_bytes, B, Q, hq, 1);
    const auto& computes = PlanAccess::state<RingLoop>(p).step_computes;
    T* cur = ring0;
    T* nxt = ring1;
    bool empty = true;  // no step has written o_acc yet
    for (int s = 0; s < R; ++s) {
      const int src = (r - s + R) % R;
      const std::int64_t kb = p.kv_layout().block(src).size();
      Hop hop;
      if (s + 1 < R) {
        cx.enter(Phase::wait, s);  // posting the hop: charged with its wait
        hop.start(cx, start_hop(p, cur, src, nxt), s);
      }
      if (computes[static_cast<std::size_t>(s)]) {
        cx.enter(Phase::compute, s);
        params.k_positions = p.kv_layout().block(src);
        const auto k = TensorView<const T, Space>::sbhd(cur, B, kb, hk, D);
        const auto v = TensorView<const T, Space>::sbhd(cur + kb * B * hk * D, B, kb, hk, Dv);
        if constexpr (writes_acc) {
          compute_forward(qb, k, v, empty ? o_acc : o_part, empty ? l_acc : l_part, params, hop);
        } else {
          compute_forward(qb, k, v, o_part, empty ? l_acc : l_part, params, hop);
          if (empty) cx.ops.copy(TensorView<const T, Space>(o_part), o_acc);
        }
        cx.lap(Phase::compute, s);
        if (!empty) {
          cx.enter(Phase::merge, s);
          cx.ops.merge(o_acc, l_acc, TensorView<const Part, Space>(o_part), TensorView<const A, Space>(l_part));
          cx.lap(Phase::merge, s);
        }
        empty = false;
      }
      if (s + 1 < R) {
        hop.finish(cx);
        std::swap(cur, nxt);
      }
    }
    if (empty) {  // no key block reached any of my queries
      cx.enter(Phase::finish);
      cx.ops.fill(o_acc, A(0));
      cx.ops.fill(l_acc, -std::numeric_limits<A>::infinity());
      cx.lap(Phase::finish);
    }
  }

  /// kernel.backward over K/V heads with progress polls. Chunks of K/V heads own their dK/dV
  /// and their query heads' dQ, so chunking changes no bit.
  template <class T>
  void compute_backward(TensorView<const T, Space> dob, TensorView<const T, Space> q, TensorView<const T, Space> k,
                        TensorView<const T, Space> v, TensorView<const T, Space> ob,
                        TensorView<const acc_t<T>, Space> lb, TensorView<acc_t<T>, Space> dq,
                        TensorView<acc_t<T>, Space> dk, TensorView<acc_t<T>, Space> dv, const KernelParams& params,
                        Hop& a, Hop* b) {
    const std::int64_t hk = k.heads();
    compute_polling(hk, [&](std::int64_t j, std::int64_t c) {
      if (c == hk) return kernel.backward(dob, q, k, v, ob, lb, dq, dk, dv, params);
      const std::int64_t G = params.group_size, hq = q.heads();
      const std::int64_t h0 = std::max<std::int64_t>(0, (params.kv_head_begin + j) * G - params.q_head_begin);
      const std::int64_t h1 = std::min<std::int64_t>(hq, (params.kv_head_begin + j + c) * G - params.q_head_begin);
      KernelParams part = params;
      part.q_head_begin += h0;
      part.kv_head_begin += j;
      kernel.backward(dob.slice_heads(h0, h1 - h0), q.slice_heads(h0, h1 - h0), k.slice_heads(j, c),
                      v.slice_heads(j, c), ob.slice_heads(h0, h1 - h0), lb.slice_heads(h0, h1 - h0),
                      dq.slice_heads(h0, h1 - h0), dk.slice_heads(j, c), dv.slice_heads(j, c), part);
    }, a, b);
  }

  /// Backward over R > 1 steps; returns the buffer holding this rank's own block's [dK | dV]
  /// (the sum of every rank's contributions). Each block's gradient accumulator follows the
  /// block one hop behind: step s computes into a zeroed `grad_part` while the accumulator of
  /// the same block is still arriving from the previous rank, then adds it in and sends it on,
  /// so the hop overlaps the compute. After the last step the hop brings each block home.
  /// `ring` and `grad` are the two buffers of each; `grad[0]` is zeroed by the caller.
  template <class T>
  const acc_t<T>* backward(const Plan& p, TensorView<const T, Space> q, TensorView<const T, Space> dob,
                           TensorView<const T, Space> ob, TensorView<const acc_t<T>, Space> lb, T* const ring[2],
                           acc_t<T>* const grad[2], acc_t<T>* grad_part, KernelParams params,
                           TensorView<acc_t<T>, Space> dq_acc) {
    using A = acc_t<T>;
    using CView = TensorView<const T, Space>;
    using AView = TensorView<A, Space>;
    const int R = p.mesh().ring, r = p.ring_rank();
    const auto B = p.problem().batch, D = p.problem().head_dim, Dv = p.problem().value_dim();
    const auto hk = p.kv_heads(p.ulysses_rank()).count;
    const auto& computes = PlanAccess::state<RingLoop>(p).step_computes;
    const LocalShape n(p);
    auto grad_view = [&](A* g, std::int64_t kb) { return kv_pair_view<A, Space>(g, n, kb); };
    auto compute = [&](const T* kv, std::int64_t kb, int src, A* g, Hop& a, Hop* b) {
      const std::int64_t k_elems = kb * B * hk * D;
      params.k_positions = p.kv_layout().block(src);
      compute_backward<T>(dob, q, CView::sbhd(kv, B, kb, hk, D), CView::sbhd(kv + k_elems, B, kb, hk, Dv), ob, lb,
                          dq_acc, AView::sbhd(g, B, kb, hk, D), AView::sbhd(g + k_elems, B, kb, hk, Dv), params, a, b);
    };
    T* cur = ring[0];
    T* nxt = ring[1];
    A* g_cur = grad[0];
    A* g_nxt = grad[1];
    Hop g_hop;
    for (int s = 0; s < R; ++s) {
      const int src = (r - s + R) % R;
      const std::int64_t kb = p.kv_layout().block(src).size();
      Hop kv_hop;
      if (s + 1 < R) {
        cx.enter(Phase::wait, s);
        kv_hop.start(cx, start_hop(p, cur, src, nxt), s);
      }
      if (s == 0) {
        cx.enter(Phase::compute, s);
        if (computes[0]) compute(cur, kb, src, g_cur, kv_hop, nullptr);
        cx.lap(Phase::compute, s);
      } else {
        // Requests to one peer complete in the order they started: the gradient hop first.
        if (computes[static_cast<std::size_t>(s)]) {
          cx.enter(Phase::pack, s);
          cx.ops.fill(grad_view(grad_part, kb), A(0));
          cx.lap(Phase::pack, s);
          cx.enter(Phase::compute, s);
          compute(cur, kb, src, grad_part, kv_hop, &g_hop);
          cx.lap(Phase::compute, s);
        }
        g_hop.finish(cx);
        std::swap(g_cur, g_nxt);
        if (computes[static_cast<std::size_t>(s)]) {
          cx.enter(Phase::merge, s);
          cx.ops.accumulate(TensorView<const A, Space>(grad_view(grad_part, kb)), grad_view(g_cur, kb));
          cx.lap(Phase::merge, s);
        }
      }
      g_hop = Hop{};
      cx.enter(Phase::wait, s);
      g_hop.start(cx, start_hop(p, g_cur, src, g_nxt), s);
      if (s + 1 < R) {
        kv_hop.finish(cx);
        std::swap(cur, nxt);
      }
    }
    g_hop.finish(cx);
    return g_nxt;
  }
};

}  // namespace seqpar::detail
