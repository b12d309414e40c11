#pragma once
/// \file
/// Phases: the components a sequence-parallel call is made of (CUTLASS composes a kernel from a
/// mainloop, an epilogue and a scheduler the same way). Each phase is a struct in its own header
/// that brings everything about itself, and the engine only adds up the phases its policy
/// lists (policy_traits<P>::phases, a PhaseList):
///  - `name`, and `kind`: an *exchange* reshapes the operands for the phases after it and
///    their results back (the Ulysses all-to-all); a *compute* phase computes (the ring loop,
///    the local kernel);
///  - `runs(plan)`: whether it takes part in calls of a plan, at run time (a degree of 1 skips
///    its phase). Every exchange that runs takes part, and the first compute phase that runs
///    computes: the last phase of a list is one that always does (LocalCompute);
///  - `reason(...)` and `divisibility_reason(...)`: its share of the shape rules ("" when
///    none is broken), checked in list order by plan and can_implement (AnythingPolicy lifts
///    the second kind);
///  - optional `State schedule(plan)`: what it decides once per plan (PlanAccess::state reads
///    it back);
///  - `declare(plan, forward, backward)`: its named workspace buffers (Slot) and their sizes;
///  - optional `forward_bytes(plan, w)`, `backward_bytes(plan, w)`: the bytes world rank w
///    sends in it, from the same tables its steps send with;
///  - its steps, each overloaded for forward (ForwardOperands) and backward (BackwardOperands):
///    an exchange has `in(call, x)`, which returns the operands the phases after it see, and
///    `out(call, inner, x)`, which takes their results back into x's outputs; a compute phase
///    has `compute(call, x)`, which writes its results into x's outputs.
/// A new phase is one header with such a struct, plus its name in the `phases` list of the
/// policies that use it (policy/policies.hpp).

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>

#include "seqpar/core/mask.hpp"
#include "seqpar/core/mesh.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/problem.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/types.hpp"
#include "seqpar/core/workspace.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/policy/engine_context.hpp"

namespace seqpar::detail {

/// What a phase does with the phases after it in its list.
enum class PhaseKind : std::uint8_t {
  exchange,  ///< reshapes the operands for the phases after it, and their results back
  compute,   ///< computes the attention of its operands; the first that runs ends the list
};

/// Sizes of this rank's tensors under a plan, in elements. Q and K rows hold D elements, V and
/// O rows (and their gradients) Dv.
struct LocalShape {
  std::size_t B, D, Dv, H, K;  // batch, head_dim of Q/K, head_dim of V/O, heads, kv_heads
  std::size_t lq, lk;      // local tokens
  std::size_t qr, kr;      // tokens of this rank's ring block (what the Ulysses group holds)
  std::size_t hq, hk;      // heads this rank computes (query, K/V)
  std::size_t kv_sent;     // K/V heads this rank packs for its group (shared heads count twice)
  std::size_t kv_max;      // tokens of the longest K/V ring block

  explicit LocalShape(const Plan& p) {
    const int r = p.ring_rank(), u = p.ulysses_rank();
    auto z = [](std::int64_t x) { return static_cast<std::size_t>(x); };
    B = z(p.problem().batch);
    D = z(p.problem().head_dim);
    Dv = z(p.problem().value_dim());
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
    kv_max = z(max_block);
  }
  /// Elements of this rank's heads over its ring block of a Q-shaped tensor (Q, dQ).
  std::size_t q_block() const { return qr * B * hq * D; }
  /// Elements of the same of an O-shaped tensor (O, dO).
  std::size_t o_block() const { return qr * B * hq * Dv; }
  /// Rows (LSE elements) of the same.
  std::size_t q_rows() const { return qr * B * hq; }
  /// Elements of K (or dK) of this rank's K/V heads over `tokens` tokens.
  std::size_t kv_block(std::size_t tokens) const { return tokens * B * hk * D; }
  /// Elements of V (or dV) of the same.
  std::size_t v_block(std::size_t tokens) const { return tokens * B * hk * Dv; }
  /// Elements of a [K | V] (or [dK | dV]) block of `tokens` tokens: V starts at kv_block(tokens).
  std::size_t kv_pair(std::size_t tokens) const { return kv_block(tokens) + v_block(tokens); }

  /// The sizes views take (batch, head dims, ring block tokens, heads), as view extents.
  struct Extents {
    std::int64_t B, D, Dv, qr, kr, hq, hk;  ///< as in LocalShape
  };
  /// This shape's view extents.
  Extents extents() const {
    auto i = [](std::size_t x) { return static_cast<std::int64_t>(x); };
    return {i(B), i(D), i(Dv), i(qr), i(kr), i(hq), i(hk)};
  }
};

/// Buffers several phases use. Each phase that uses one declares it at the size it needs;
/// the layout keeps one buffer of the largest (WorkspaceLayout::declare).
struct SharedSlots {
  /// [K | V] of this rank's K/V heads over the block it computes with: where an exchange
  /// gathers them, and the ring's block in hand (sized for the longest block, as blocks
  /// arriving land there).
  static constexpr Slot kv{"kv_block"};
  /// Backward's dQ of this rank's heads over its ring block, accumulated in acc_t<T>
  /// (whichever compute phase computes).
  static constexpr Slot dq_acc{"dq_acc"};
  /// Backward's [dK | dV] of the block in hand, accumulated in acc_t<T>.
  static constexpr Slot grad{"grad_block"};
};

/// One call's workspace: the plan's layout over the caller's bytes.
struct CallWorkspace {
  const WorkspaceLayout& layout;  ///< the plan's layout of this pass
  std::span<std::byte> bytes;     ///< the caller's workspace
  /// Slot `s` as T* (a phase of this plan declared it).
  template <class T>
  T* get(const Slot& s) const { return layout.template get<T>(bytes, s); }
};

/// What a phase's steps work with during one call.
template <class C, class K>
struct PhaseCall {
  using Comm = C;                             ///< the communicator type
  using Kernel = K;                           ///< the kernel type
  using Space = typename Comm::memory_space;  ///< where tensors live
  EngineContext<Comm>& cx;                    ///< communicators, ops, clock
  Kernel& kernel;                             ///< the local kernel
  const Plan& plan;                           ///< the call's plan
  CallWorkspace ws;                           ///< the call's workspace
};

/// Forward's operands as the phases at one level of the list see them: the caller's tensors
/// at the outside, an exchange's blocks inside it.
template <class T, class Space>
struct ForwardOperands {
  using value_type = T;                ///< element type of Q, K, V, O
  using memory_space = Space;          ///< where the tensors live
  TensorView<const T, Space> q, k, v;  ///< what the compute reads
  PositionMap k_positions;             ///< global positions of k's and v's rows
  TensorView<T, Space> out;            ///< where the compute writes O
  TensorView<acc_t<T>, Space> lse;     ///< where it writes the LSE (absent: not asked for)
};

/// Backward's operands at one level of the list (as ForwardOperands).
template <class T, class Space>
struct BackwardOperands {
  using value_type = T;                           ///< element type of the tensors
  using memory_space = Space;                     ///< where they live
  TensorView<const T, Space> dout, q, k, v, out;  ///< what the compute reads
  TensorView<const acc_t<T>, Space> lse;          ///< the forward's LSE
  PositionMap k_positions;                        ///< global positions of k's and v's rows
  TensorView<T, Space> dq, dk, dv;                ///< where the compute writes the gradients (overwritten)
};

/// The kernel parameters of plan p for keys at `k_positions`.
inline KernelParams kernel_params(const Plan& p, const PositionMap& k_positions) {
  KernelParams params;
  params.scale = p.problem().softmax_scale();
  params.softcap = p.problem().softcap;
  params.causal = p.problem().causal;
  params.q_positions = p.q_diagonals(p.ring_rank());  // bottom-right alignment shifts them
  params.k_positions = k_positions;
  params.mask = p.mask();
  params.group_size = p.problem().heads / p.problem().kv_heads;
  params.q_head_begin = p.q_heads(p.ulysses_rank()).begin;
  params.kv_head_begin = p.kv_heads(p.ulysses_rank()).begin;
  return params;
}

/// True when some query of this rank's ring block sees some key of ring rank `src`'s block,
/// in some batch element, under every mask family (a compute with nothing visible is skipped).
inline bool keys_visible(const Plan& p, int src) {
  if (p.q_heads(p.ulysses_rank()).count == 0 || p.problem().batch == 0) return false;
  const MaskView mask = p.mask();
  const std::int64_t batches = mask.kv_valid != nullptr || mask.doc_batch_stride > 0 ? p.problem().batch : 1;
  const PositionMap q = p.q_diagonals(p.ring_rank()), k = p.kv_layout().block(src);
  for (std::int64_t b = 0; b < batches; ++b)
    if (any_visible(mask, b, q, k)) return true;
  return false;
}

/// The end of every divisibility reason: the policy that lifts the rule.
inline std::string anything_fix(const MeshConfig& mesh) {
  return std::string("; use AnythingPolicy<") + mesh.policy + "> for any shape";
}

/// [dK | dV] of `kv_rows` keys as one view (for fills and sums: any view of its elements will
/// do, and rows of D + Dv cover them whatever the two dims).
template <class A, class Space>
TensorView<A, Space> kv_pair_view(A* g, const LocalShape& n, std::int64_t kv_rows) {
  const auto s = n.extents();
  return TensorView<A, Space>::sbhd(g, s.B, kv_rows, s.hk, s.D + s.Dv);
}

/// Backward's accumulators (SharedSlots::dq_acc, SharedSlots::grad) for a block of `kv_rows`
/// keys, zeroed: what a compute phase adds the kernel's gradients into.
template <class A, class Space>
struct GradientAccumulators {
  TensorView<A, Space> dq;  ///< [Qr, B, hq, D]
  A* grad;                  ///< [dK | dV] of the block in hand
};

/// Zeroes backward's accumulators of a call for a block of `kv_rows` keys.
template <class A, class Call>
GradientAccumulators<A, typename Call::Space> zero_accumulators(Call& call, std::int64_t kv_rows) {
  using AView = TensorView<A, typename Call::Space>;
  const auto s = LocalShape(call.plan).extents();
  call.cx.enter(Phase::pack);
  const AView dq = AView::sbhd(call.ws.template get<A>(SharedSlots::dq_acc), s.B, s.qr, s.hq, s.D);
  call.cx.ops.fill(dq, A(0));
  A* grad = call.ws.template get<A>(SharedSlots::grad);
  call.cx.ops.fill(kv_pair_view<A, typename Call::Space>(grad, LocalShape(call.plan), kv_rows), A(0));
  call.cx.lap(Phase::pack);
  return {dq, grad};
}

/// Writes the gradients a compute phase accumulated (dQ, and [dK | dV] of this rank's own
/// block in `own`) into x's outputs, converting to T.
template <class Call, class T, class Space>
void deliver_gradients(Call& call, const TensorView<acc_t<T>, Space>& dq, const acc_t<T>* own,
                       const BackwardOperands<T, Space>& x) {
  using CView = TensorView<const acc_t<T>, Space>;
  const LocalShape n(call.plan);
  const auto s = n.extents();
  call.cx.enter(Phase::finish);
  call.cx.ops.copy(CView(dq), x.dq);
  call.cx.ops.copy(CView::sbhd(own, s.B, s.kr, s.hk, s.D), x.dk);
  call.cx.ops.copy(CView::sbhd(own + n.kv_block(n.kr), s.B, s.kr, s.hk, s.Dv), x.dv);
  call.cx.lap(Phase::finish);
}

/// The shape rules of a phase that adds none: a phase derives from it instead of spelling two
/// functions that return "".
struct NoShapeRules {
  /// No shape rules: any shape passes.
  static std::string reason(const MeshConfig&, const AttentionProblem&, std::span<const std::int64_t>,
                            std::span<const std::int64_t>) {
    return "";
  }
  /// No divisibility rules either.
  static std::string divisibility_reason(const MeshConfig&, const AttentionProblem&, std::span<const std::int64_t>,
                                         std::span<const std::int64_t>) {
    return "";
  }
};

/// What every phase provides besides its steps (see the file comment; the steps are checked
/// where a call instantiates them). Not named Phase: that is the profile's enum of phases.
template <class P>
concept PhaseComponent = requires(const Plan& p, WorkspaceLayout& ws, const MeshConfig& mesh,
                                  const AttentionProblem& problem, std::span<const std::int64_t> lengths) {
  { P::name } -> std::convertible_to<const char*>;
  { P::kind } -> std::convertible_to<PhaseKind>;
  { P::runs(p) } -> std::convertible_to<bool>;
  { P::reason(mesh, problem, lengths, lengths) } -> std::convertible_to<std::string>;
  { P::divisibility_reason(mesh, problem, lengths, lengths) } -> std::convertible_to<std::string>;
  P::declare(p, ws, ws);
};

/// The phases of a policy, in order, and what the engine does with them: add up their shape
/// rules, their buffers, their traffic and their states into a plan, and run their steps.
template <class... Ph>
struct PhaseList {
  static_assert(sizeof...(Ph) > 0, "seqpar: a phase list needs a compute phase");
  static_assert((PhaseComponent<Ph> && ...),
                "seqpar: every entry of a PhaseList must model PhaseComponent (policy/phase.hpp)");

  /// True when phase X is in the list.
  template <class X>
  static constexpr bool has = (std::is_same_v<X, Ph> || ...);

  /// The first of the phases' shape rules that `problem` with these lengths breaks, or "".
  static std::string reason(const MeshConfig& mesh, const AttentionProblem& problem,
                            std::span<const std::int64_t> q_len, std::span<const std::int64_t> kv_len) {
    return first_answer([&]<class P>() { return P::reason(mesh, problem, q_len, kv_len); });
  }

  /// The first of the phases' divisibility rules (those AnythingPolicy lifts) broken, or "".
  static std::string divisibility_reason(const MeshConfig& mesh, const AttentionProblem& problem,
                                         std::span<const std::int64_t> q_len, std::span<const std::int64_t> kv_len) {
    return first_answer([&]<class P>() { return P::divisibility_reason(mesh, problem, q_len, kv_len); });
  }

  /// Adds the phases that take part in calls of p into its schedule: their states, their
  /// buffers (laid out in list order) and their traffic formulas.
  static void schedule(Plan& p) {
    PlanSchedule& s = PlanAccess::schedule(p);
    each_taking_part(p, [&]<class P>() {
      if constexpr (requires { P::schedule(p); })
        s.phases.push_back({&phase_id<P>, std::make_shared<const typename P::State>(P::schedule(p))});
      P::declare(p, s.forward, s.backward);
    });
    s.forward.place();
    s.backward.place();
    s.forward_bytes = &forward_bytes;
    s.backward_bytes = &backward_bytes;
  }

  /// Bytes world rank w sends in one forward of plan p: the sum over the phases taking part.
  static std::size_t forward_bytes(const Plan& p, int w) {
    std::size_t n = 0;
    each_taking_part(p, [&]<class P>() {
      if constexpr (requires { P::forward_bytes(p, w); }) n += P::forward_bytes(p, w);
    });
    return n;
  }

  /// Bytes world rank w sends in one backward of plan p: the sum over the phases taking part.
  static std::size_t backward_bytes(const Plan& p, int w) {
    std::size_t n = 0;
    each_taking_part(p, [&]<class P>() {
      if constexpr (requires { P::backward_bytes(p, w); }) n += P::backward_bytes(p, w);
    });
    return n;
  }

  /// One forward or backward (by the type of x): each exchange that runs brings the operands
  /// in, lets the phases after it run and takes their results back out into x; the first
  /// compute phase that runs computes.
  template <class Call, class X>
  static void run(Call& call, const X& x) {
    run_from<Ph...>(call, x);
  }

 private:
  /// The first non-empty answer of ask.template operator()<P>() over the phases, in list order.
  template <class Ask>
  static std::string first_answer(Ask&& ask) {
    std::string why;
    ((why.empty() ? void(why = ask.template operator()<Ph>()) : void()), ...);
    return why;
  }

  /// Calls f.template operator()<P>() for each phase taking part in calls of p, in list order:
  /// every exchange that runs, and the first compute phase that runs.
  template <class F>
  static void each_taking_part(const Plan& p, F&& f) {
    bool computed = false;
    auto visit = [&]<class P>() {
      if constexpr (P::kind == PhaseKind::exchange) {
        if (P::runs(p)) f.template operator()<P>();
      } else if (!computed && P::runs(p)) {
        computed = true;
        f.template operator()<P>();
      }
    };
    (visit.template operator()<Ph>(), ...);
  }

  /// Runs phase P and those after it: an exchange wraps them (in, the rest, out); a compute
  /// phase ends the list. A phase that does not run (a degree of 1) hands over to the next.
  template <class P, class... Rest, class Call, class X>
  static void run_from(Call& call, const X& x) {
    if constexpr (P::kind == PhaseKind::exchange) {
      static_assert(sizeof...(Rest) > 0, "seqpar: the last phase of a list must compute");
      if (!P::runs(call.plan)) return run_from<Rest...>(call, x);
      const X inner = P::in(call, x);
      run_from<Rest...>(call, inner);
      P::out(call, inner, x);
    } else if constexpr (sizeof...(Rest) == 0) {
      P::compute(call, x);
    } else {
      if (P::runs(call.plan)) return P::compute(call, x);
      run_from<Rest...>(call, x);
    }
  }
};

}  // namespace seqpar::detail
