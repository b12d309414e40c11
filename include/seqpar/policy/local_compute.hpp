#pragma once
/// \file
/// The local compute, a phase (policy/phase.hpp): one kernel call over the operands as the
/// phases before it left them (this rank's tokens, or with the Ulysses exchange its heads of
/// the ring block). Every policy lists it last: it computes whenever no compute phase before
/// it runs (a ring of one rank, or no ring at all).

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "seqpar/core/mesh.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/problem.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/workspace.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/policy/engine_context.hpp"
#include "seqpar/policy/phase.hpp"

namespace seqpar::detail {

/// The local kernel as a phase: the compute of last resort.
struct LocalCompute : NoShapeRules {
  static constexpr const char* name = "LocalCompute";     ///< for messages
  static constexpr PhaseKind kind = PhaseKind::compute;  ///< computes; ends the list

  /// Whether backward has anything to compute: a block whose keys no query sees adds nothing.
  struct State {
    bool keys_visible = false;  ///< some query of this rank's block sees some key of its block
  };

  /// It computes whenever it is reached (no compute phase before it ran).
  static bool runs(const Plan&) { return true; }

  // No shape rules of its own (NoShapeRules): the kernel's are asked separately (kernel_reason).

  /// Whether any key is visible, decided once per plan.
  static State schedule(const Plan& p) { return {keys_visible(p, p.ring_rank())}; }

  /// Backward's accumulators; forward writes straight into its outputs.
  static void declare(const Plan& p, WorkspaceLayout&, WorkspaceLayout& backward) {
    const LocalShape n(p);
    backward.declare(SharedSlots::grad, n.kv_pair(n.kr) * p.acc_bytes());
    backward.declare(SharedSlots::dq_acc, n.q_block() * p.acc_bytes());
  }

  /// Forward: one kernel call into x's output and LSE.
  template <class Call, class T, class Space>
  static void compute(Call& call, const ForwardOperands<T, Space>& x) {
    call.cx.enter(Phase::compute);
    call.kernel.forward(x.q, x.k, x.v, x.out, x.lse, kernel_params(call.plan, x.k_positions));
    call.cx.lap(Phase::compute);
  }

  /// Backward: one kernel call into zeroed accumulators (none when no key is visible), then
  /// the gradients into x's.
  template <class Call, class T, class Space>
  static void compute(Call& call, const BackwardOperands<T, Space>& x) {
    using A = acc_t<T>;
    using AView = TensorView<A, Space>;
    const LocalShape n(call.plan);
    const auto s = n.extents();
    const auto acc = zero_accumulators<A>(call, s.kr);
    call.cx.enter(Phase::compute);
    if (PlanAccess::state<LocalCompute>(call.plan).keys_visible)
      call.kernel.backward(x.dout, x.q, x.k, x.v, x.out, x.lse, acc.dq, AView::sbhd(acc.grad, s.B, s.kr, s.hk, s.D),
                           AView::sbhd(acc.grad + n.kv_block(n.kr), s.B, s.kr, s.hk, s.Dv),
                           kernel_params(call.plan, x.k_positions));
    call.cx.lap(Phase::compute);
    deliver_gradients(call, acc.dq, acc.grad, x);
  }
};

}  // namespace seqpar::detail
