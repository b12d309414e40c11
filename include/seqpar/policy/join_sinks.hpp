#pragma once
/// \file
/// Attention sinks, a phase (policy/phase.hpp): GPT-OSS gives every query head one learned
/// logit that joins each row's softmax denominator and carries no value. Under context
/// parallelism a row's keys are spread over ring steps (and, before the Ulysses exchange, its
/// heads over ranks), so the sink must join the row's result once, after every partial over
/// the keys has been merged: joined to each ring step's partial it would count R times, joined
/// only on one rank it would be missing from every other rank's rows (both are known bugs of
/// other context-parallel implementations). This phase wraps the compute phases, inside the
/// Ulysses exchange: when they are done, each row of this rank's heads over its ring block
/// holds its merged (O, L), and join_sink (kernel/merge_state.hpp) makes it
/// L' = log(exp(L) + exp(sink_h)), O' = O exp(L - L').
///
/// It runs when the problem has sinks. The LSE it needs is the compute's: when the caller did
/// not ask for one, the phase gives the compute a buffer of its own for it.
///
/// Backward needs nothing of it: with the final O and L the gradients of Q, K and V are those
/// of plain attention, and the sinks' own gradient, d sink_h = -sum over rows of
/// exp(sink_h - L) (dO . O), comes from the caller's rows alone (SequenceParallelAttention's
/// backward with d_sinks).

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "seqpar/core/mesh.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/problem.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/workspace.hpp"
#include "seqpar/ops/host_ops.hpp"
#include "seqpar/policy/engine_context.hpp"
#include "seqpar/policy/phase.hpp"

namespace seqpar::detail {

/// True when the tensor operations of memory space `Space` join sinks and take their gradient
/// (join_sinks, sink_grads): plans with sinks are refused on a space whose operations lack them.
template <class Space>
inline constexpr bool ops_have_sinks =
    requires(TensorOps<Space>& ops, TensorView<float, Space> o, TensorView<const float, Space> c, const float* s,
             float* d) {
      ops.join_sinks(o, o, s);
      ops.sink_grads(c, c, c, s, d);
    };

/// Why a plan (attention or decode) with sinks cannot run on memory space `Space` ("" when it
/// can); the reason follows `who`.
template <class Space, class Problem>
std::string sinks_reason(const Problem& problem, std::string_view who = "plan: ") {
  if (problem.sinks == nullptr || ops_have_sinks<Space>) return "";
  return std::string(who) + "sinks are not available on this memory space yet (its TensorOps has no join_sinks / "
         "sink_grads)";
}

/// The sinks as a phase: an exchange that changes no operand on the way in (but the LSE's
/// home) and joins each row's sink on the way out.
struct JoinSinks : NoShapeRules {
  static constexpr const char* name = "JoinSinks";        ///< for messages
  static constexpr PhaseKind kind = PhaseKind::exchange;  ///< wraps the compute phases

  /// It takes part when the problem has sinks.
  static bool runs(const Plan& p) { return p.problem().sinks != nullptr; }

  /// [Qr, B, hq] LSE of this rank's rows, when the caller asked for none.
  static constexpr Slot lse{"sink_lse"};

  /// Declares the LSE buffer (forward only) for plans whose caller asks for no LSE.
  static void declare(const Plan& p, WorkspaceLayout& forward, WorkspaceLayout&) {
    if (!p.problem().with_lse) forward.declare(lse, LocalShape(p).q_rows() * p.acc_bytes());
  }

  /// Forward, in: the operands as they are, with an LSE the compute writes.
  template <class Call, class T, class Space>
  static ForwardOperands<T, Space> in(Call& call, const ForwardOperands<T, Space>& x) {
    ForwardOperands<T, Space> in = x;
    // The slot exists when the caller asks for no LSE; an LSE of no rows (a rank holding no
    // query) looks absent too, and needs none.
    if (in.lse.absent() && !call.plan.problem().with_lse)
      in.lse = TensorView<acc_t<T>, Space>::bshd(call.ws.template get<acc_t<T>>(lse), x.out.batch(), x.out.seq(),
                                                 x.out.heads(), 1);
    return in;
  }

  /// Forward, out: every row's sink joined to its merged result, in place; head h of the
  /// operands is query head q_heads(u).begin + h of the problem.
  template <class Call, class T, class Space>
  static void out(Call& call, const ForwardOperands<T, Space>& inner, const ForwardOperands<T, Space>&) {
    const Plan& p = call.plan;
    call.cx.enter(Phase::finish);
    if constexpr (ops_have_sinks<Space>)  // otherwise the plan was refused (sinks_reason)
      call.cx.ops.join_sinks(inner.out, inner.lse, p.problem().sinks + p.q_heads(p.ulysses_rank()).begin);
    call.cx.lap(Phase::finish);
  }

  /// Backward, in: nothing to change.
  template <class Call, class T, class Space>
  static BackwardOperands<T, Space> in(Call&, const BackwardOperands<T, Space>& x) {
    return x;
  }
  /// Backward, out: nothing to do.
  template <class Call, class T, class Space>
  static void out(Call&, const BackwardOperands<T, Space>&, const BackwardOperands<T, Space>&) {}
};

}  // namespace seqpar::detail
