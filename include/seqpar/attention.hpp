#pragma once
/// \file
/// SequenceParallelAttention<Policy, Communicator, LocalAttentionKernel>: the public entry.

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/profile.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/policy/mesh_engine.hpp"
#include "seqpar/policy/policies.hpp"

namespace seqpar {

/// Attention over a sequence split across the ranks of `Comm`, arranged by `Policy`, each
/// rank computing with `Kernel`.
///
/// Usage: construct on every rank (collective: splits the communicator into the mesh), call
/// `plan(problem, my_lengths)` once per shape (collective: all ranks validate that they agree,
/// or all throw the same ConfigError), allocate `plan.workspace_bytes()` once, then call
/// `forward` as often as needed: it allocates nothing and exchanges no metadata (unless
/// SEQPAR_CHECK_CALLS=1 asks every call to agree first: checks_calls()).
///
/// Only the phases the policy uses are compiled (policy_traits): a kernel needs a backward only
/// if backward is called, and a kernel that writes only T works with every policy.
///
/// Thread safety: one object is used by one thread at a time (its calls are collective with
/// the other ranks' objects, in the same order on every rank).
template <class Policy, class Comm, class Kernel>
class SequenceParallelAttention {
  static_assert(is_policy_v<Policy>,
                "SequenceParallelAttention<Policy, ...>: Policy must be UlyssesPolicy, RingPolicy<Layout>, "
                "UnifiedPolicy<Layout> or AnythingPolicy<one of those>");
  static_assert(Communicator<Comm>,
                "SequenceParallelAttention<..., Comm, ...>: Comm does not model seqpar::Communicator "
                "(see comm/communicator.hpp for the requirements and the opt-in)");
  static_assert(enable_kernel<Kernel>,
                "SequenceParallelAttention<..., Kernel>: Kernel does not opt in to seqpar::LocalAttentionKernel "
                "(declare static constexpr bool is_seqpar_kernel = true; see kernel/local_attention_kernel.hpp)");
  static_assert(std::is_same_v<typename Comm::memory_space, typename Kernel::memory_space>,
                "SequenceParallelAttention: the communicator and the kernel work in different memory spaces "
                "(e.g. a HostSpace communicator with a CudaSpace kernel)");

 public:
  using policy_type = Policy;                          ///< the policy
  using memory_space = typename Comm::memory_space;    ///< where tensors and workspace live

  /// A tensor a call reads (q, k, v; backward's dout and out): elements T in memory_space.
  /// T is never deduced from it: forward and backward take T from `out` and `dq`, or from
  /// forward<T>, so these arguments convert as the declared type allows.
  template <class T>
  using Input = std::type_identity_t<TensorView<const T, memory_space>>;
  /// A tensor backward writes besides dq (dk, dv); T is not deduced from it either.
  template <class T>
  using Output = std::type_identity_t<TensorView<T, memory_space>>;
  /// The LSE forward writes, [B, Lq, H, 1] in the accumulation type acc_t<T> (not deduced).
  template <class T>
  using Lse = std::type_identity_t<TensorView<acc_t<T>, memory_space>>;
  /// The LSE backward reads: the one forward wrote (not deduced).
  template <class T>
  using LseInput = std::type_identity_t<TensorView<const acc_t<T>, memory_space>>;

  /// Collective over `world`: checks that every rank has the same policy and degrees, then
  /// builds the mesh. `world` must outlive this object.
  explicit SequenceParallelAttention(Comm& world, Policy policy = {}, Kernel kernel = {})
      : policy_(policy), engine_(world, mesh_request(policy), std::move(kernel)) {}

  /// Collective: makes the plan for `problem` with this rank's local lengths. On a refusal
  /// every rank throws the same ConfigError and this object is unchanged (the kernel's scratch
  /// may have grown).
  Plan plan(const AttentionProblem& problem, LocalLengths lengths) { return engine_.plan(problem, lengths); }
  /// Collective: makes the plan for element type T (problem.dtype is set from T, so forward<T>
  /// cannot disagree with it).
  template <class T>
  Plan plan(AttentionProblem problem, LocalLengths lengths) {
    problem.dtype = dtype_v<T>;
    return engine_.plan(problem, lengths);
  }
  /// Would `problem` run with these local lengths (one per world rank)? Asks no rank: the
  /// same checks as plan, as a value (see seqpar::can_implement).
  /// Unlike the free function it also knows the kernel, so it refuses what only the kernel
  /// cannot take (a window, documents or key padding without supports_masks), as plan does.
  Implementable can_implement(const AttentionProblem& problem, std::span<const LocalLengths> all_local_lengths) const {
    Implementable shape = seqpar::can_implement(policy_, problem, all_local_lengths);
    if (!shape) return shape;
    std::string why = detail::kernel_reason<Kernel>(problem);
    if (why.empty()) why = detail::sinks_reason<memory_space>(problem);
    return {why.empty(), std::move(why)};
  }

  /// Computes this rank's output rows (and LSE rows when the plan's problem has with_lse).
  /// q [B, Lq, H, D], k [B, Lkv, K, D], v [B, Lkv, K, D_v], out [B, Lq, H, D_v] (T is deduced
  /// from it), lse [B, Lq, H, 1] or absent (with sinks: the LSE with each row's sink joined).
  /// On a ring without a Ulysses exchange, float and double out and lse must not overlap q
  /// (the ring adds into them while it reads q at every step); Ulysses may write out over q.
  /// Every argument is checked before the first message: a ConfigError from those checks
  /// leaves this object (and out, lse) untouched and usable. A failure after communication
  /// began leaves out and lse unspecified (see the README's "Failures and time-outs").
  template <class T>
  void forward(const Plan& plan, Input<T> q, Input<T> k, Input<T> v, TensorView<T, memory_space> out, Lse<T> lse,
               std::span<std::byte> workspace) {
    engine_.template forward<T>(plan, q, k, v, out, lse, workspace);
  }

  /// Forward without LSE.
  template <class T>
  void forward(const Plan& plan, Input<T> q, Input<T> k, Input<T> v, TensorView<T, memory_space> out,
               std::span<std::byte> workspace) {
    engine_.template forward<T>(plan, q, k, v, out, {}, workspace);
  }

  /// Gradients of this rank's slices: dq [B, Lq, H, D] (T is deduced from it), dk
  /// [B, Lkv, K, D] and dv [B, Lkv, K, D_v], from dout [B, Lq, H, D_v] and the forward's q, k,
  /// v, out and lse (the plan's problem needs with_lse). Overwrites dq, dk, dv. Workspace:
  /// plan.backward_workspace_bytes(). Allocates nothing. Arguments are checked before the
  /// first message, as in forward. With sinks, the overload with d_sinks also gives theirs.
  template <class T>
  void backward(const Plan& plan, Input<T> dout, Input<T> q, Input<T> k, Input<T> v, Input<T> out, LseInput<T> lse,
                TensorView<T, memory_space> dq, Output<T> dk, Output<T> dv, std::span<std::byte> workspace) {
    engine_.template backward<T>(plan, dout, q, k, v, out, lse, dq, dk, dv, nullptr, workspace);
  }

  /// Backward of a problem with sinks, also writing their gradient: d_sinks, `heads` floats
  /// in memory_space, is overwritten with d sink_h = -sum over this rank's query rows of
  /// exp(sink_h - L) (dO . O). Like any parameter's gradient under sequence parallelism it is
  /// this rank's share: sum it over the ranks of the attention (an all-reduce, as for the
  /// weights' gradients). It needs no communication of its own.
  template <class T>
  void backward(const Plan& plan, Input<T> dout, Input<T> q, Input<T> k, Input<T> v, Input<T> out, LseInput<T> lse,
                TensorView<T, memory_space> dq, Output<T> dk, Output<T> dv, float* d_sinks,
                std::span<std::byte> workspace) {
    engine_.template backward<T>(plan, dout, q, k, v, out, lse, dq, dk, dv, d_sinks, workspace);
  }

  /// The resolved mesh (degrees, placement, layout).
  const MeshConfig& mesh() const { return engine_.mesh(); }
  /// The world communicator; its stats() include the traffic of the mesh's sub-groups.
  Comm& world() { return engine_.world(); }
  /// This rank's Ulysses group.
  Comm& ulysses_comm() { return engine_.ulysses_comm(); }
  /// This rank's ring group.
  Comm& ring_comm() { return engine_.ring_comm(); }
  /// The local kernel (e.g. to set its thread count).
  Kernel& kernel() { return engine_.kernel(); }
  /// The tensor operations between kernel calls (packing, merge); on CUDA it holds the stream.
  TensorOps<memory_space>& ops() { return engine_.ops(); }

  /// Times the phases of every later forward and backward into `profile` (nullptr: stop),
  /// to find the time spent outside the kernel. Off by default: then no clock is read. The
  /// profile must outlive its use; recording allocates nothing and changes no result.
  void set_profile(PhaseProfile* profile) { engine_.set_profile(profile); }
  /// The profile set by set_profile, or nullptr.
  PhaseProfile* profile() const { return engine_.profile(); }
  /// Whether each forward and backward first agrees with the other ranks on the call (its
  /// pass, its plan, every rank's arguments accepted): SEQPAR_CHECK_CALLS=1 on any rank when
  /// this object was made (see seqpar::check_calls_env). Off, a call exchanges no metadata.
  bool checks_calls() const { return engine_.checks_calls(); }

 private:
  Policy policy_;
  detail::MeshEngine<policy_phases_of<Policy>, Comm, Kernel> engine_;
};

}  // namespace seqpar
