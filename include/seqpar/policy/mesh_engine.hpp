#pragma once
/// \file
/// The engine behind every policy: a ulysses_degree x ring_degree mesh (Ulysses is the mesh
/// with R = 1, Ring the mesh with U = 1, the general case USP). It runs the phases its policy
/// lists (policy_traits<P>::phases) and knows none of them: each is a component in its own
/// header that brings its buffers, shape rules, traffic and steps (policy/phase.hpp):
///  - the Ulysses all-to-all, in and back: policy/ulysses_exchange.hpp;
///  - the ring loop, forward and backward: policy/ring_loop.hpp;
///  - the local kernel call: policy/local_compute.hpp;
///  - plan building and validation (can_implement too): policy/plan_builder.hpp;
///  - the LSE merge of partial results: kernel/merge_state.hpp.
/// UlyssesPolicy instantiates no ring code and RingPolicy no all-to-all, so a kernel or a
/// communicator only needs what its policy uses. The engine is keyed on the phases alone, not
/// on the policy: the layouts only shape the plan's tables, and Anything only lifts the
/// divisibility checks (on even shapes both send the same bytes), so RingPolicy<Zigzag>,
/// RingPolicy<Stripe> and AnythingPolicy<RingPolicy<Contiguous>> share one compiled engine. A program that switches
/// between policies at run time (seqpar_demo: 14 of them) compiles three engines, not 14.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <limits>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/policy/engine_context.hpp"
#include "seqpar/policy/phase.hpp"
#include "seqpar/policy/plan_builder.hpp"
#include "seqpar/policy/policies.hpp"

namespace seqpar {

/// The environment variable that makes every forward and backward agree on the call before
/// its first message. "1": each call's argument checks run, then one host all-gather over the
/// world of a row per rank (did its arguments pass, forward or backward, which object, the
/// plan's fingerprint), so that ranks which pass different plans, make different passes, call
/// objects in different orders, are in plan() against a call, or one of which refused its
/// arguments, all throw the same ConfigError before any data moves (without it such ranks
/// exchange mismatched data: wrong rows or a time-out). Unset, empty or "0": off,
/// and a call exchanges no metadata. Read when a SequenceParallelAttention is made; on when
/// any rank sets it (the constructor agrees), so every rank joins the gathers. The debugging
/// aid of PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL (which checks collectives' shapes across
/// ranks), for one call's worth of the same.
inline constexpr const char* check_calls_env = "SEQPAR_CHECK_CALLS";

namespace detail {

/// SEQPAR_CHECK_CALLS as this rank has it: 1 on, 0 off (unset, empty or "0"), -1 any other
/// value (which the constructor refuses on every rank alike).
inline int check_calls_from_env() {
  const char* env = std::getenv(check_calls_env);
  if (env == nullptr || *env == '\0' || std::string_view(env) == "0") return 0;
  return std::string_view(env) == "1" ? 1 : -1;
}

/// Marks an engine busy for one call, so that a second thread calling the same object at the
/// same time gets a ConfigError instead of corrupting the first call's communication. Moving
/// an engine moves no call in progress, so a moved-to flag starts free.
class BusyFlag {
 public:
  BusyFlag() = default;
  BusyFlag(BusyFlag&&) noexcept {}
  /// Holds the flag for one call.
  class Hold {
   public:
    Hold(BusyFlag& f, const char* call) : f_(f) {
      SEQPAR_CHECK(!f.busy_.exchange(true, std::memory_order_acquire), ConfigError, call,
                   ": called while another call on this SequenceParallelAttention runs in another thread (an object "
                   "and its communicator serve one thread at a time; give each thread its own)");
    }
    ~Hold() { f_.busy_.store(false, std::memory_order_release); }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    BusyFlag& f_;
  };

 private:
  std::atomic<bool> busy_{false};
};

/// The engine of the phases `Phases` (policy_phases_of<Policy>, a PhaseList) over `Comm` with
/// `Kernel`.
template <class Phases, class Comm, class Kernel>
class MeshEngine {
 public:
  using Space = typename Comm::memory_space;  ///< where tensors live

  /// Collective: all ranks check that they agree on the requested mesh, resolve it for the
  /// world size (every rank alike, so all throw the same ConfigError or none), then split the
  /// world into Ulysses groups and rings.
  MeshEngine(Comm& world, const MeshConfig& request, Kernel kernel)
      : MeshEngine(world, agree_on_mesh(world, request), std::move(kernel)) {}

  /// Collective: gathers every rank's problem and lengths once, validates them identically on
  /// every rank (all throw the same ConfigError, none hangs), and builds the plan.
  Plan plan(const AttentionProblem& problem, LocalLengths lengths) {
    const BusyFlag::Hold hold(busy_, "plan");
    const int world = cx_.world.size();
    const auto mine = plan_fields(problem, cx_.mesh, lengths);
    std::vector<std::int64_t> all(static_cast<std::size_t>(f_count * world));
    cx_.world.all_gather_host(std::span<const std::int64_t>(mine), all);
    std::string why = ranks_in_a_call(all, world, true);
    SEQPAR_CHECK(why.empty(), ConfigError, "plan: ", why);
    why = disagreement_reason(all, world);
    // Lists travel as hashes; on a mismatch every rank sees it and gathers them to say where.
    if (const int field = first_disagreeing_field(all, world); field == f_documents)
      why = list_disagreement(cx_.world, "plan: ", "documents", problem.documents, ListField::lists);
    else if (field == f_kv_valid)
      why = list_disagreement(cx_.world, "plan: ", "kv_valid", {problem.kv_valid}, ListField::one_list);
    if (why.empty()) {
      std::vector<std::int64_t> q(static_cast<std::size_t>(world)), kv(static_cast<std::size_t>(world));
      for (int w = 0; w < world; ++w) {
        q[static_cast<std::size_t>(w)] = all[w * f_count + f_q_len];
        kv[static_cast<std::size_t>(w)] = all[w * f_count + f_kv_len];
      }
      why = shape_reason<Phases>(cx_.mesh, problem, q, kv);
    }
    if (why.empty()) why = kernel_reason<Kernel>(problem);
    if (why.empty()) why = sinks_reason<Space>(problem);
    SEQPAR_CHECK(why.empty(), ConfigError, why);
    Plan p = build_plan<Phases>(all, problem, cx_.mesh, cx_.world.rank(), id_);
    Fnv print;
    print.mix(std::span<const std::int64_t>(all));
    PlanAccess::set_fingerprint(p, print.value());
    // Every rank joins this gather whatever its kernel: a kernel without scratch allocates
    // nothing, but a rank that skipped the gather while another (another kernel type, the
    // one with scratch) joined it would leave the collectives out of step and both waiting.
    why = allocation_disagreement(cx_.world, "plan: ", [&] {
      prepare_for(kernel_, problem.head_dim, problem.value_dim());
      if constexpr (requires { kernel_.reserve(KernelCallBounds{}); }) kernel_.reserve(call_bounds(p));
    });
    SEQPAR_CHECK(why.empty(), ConfigError, why);
    return p;
  }

  /// Forward: the policy's phases in order (with Unified: the Ulysses exchange in, the ring
  /// loop or, on a ring of one, the local kernel, the exchange back; see PhaseList::run).
  /// Allocates nothing and exchanges no metadata (but see agree_on_call).
  template <class T>
  void forward(const Plan& p, TensorView<const T, Space> q, TensorView<const T, Space> k, TensorView<const T, Space> v,
               TensorView<T, Space> out, TensorView<acc_t<T>, Space> lse, std::span<std::byte> workspace) {
    static_assert(LocalAttentionKernel<Kernel, T>,
                  "seqpar: the kernel does not model LocalAttentionKernel for this element type: it needs "
                  "forward(q, k, v, out, lse, params) with out a TensorView<T> (see kernel/local_attention_kernel.hpp)");
    const BusyFlag::Hold hold(busy_, "forward");
    agree_on_call(p, Pass::forward, "forward", [&] {
      check_call(p, dtype_v<T>, "forward", workspace, p.workspace_bytes());
      check_inputs(p, q, k, v, "forward");
      check_view(out, "forward: out", p.problem().batch, p.local_q(), p.problem().heads, p.problem().value_dim(),
                 ViewUse::write);
      check_lse_view(p, lse, "forward");
      // A ring over the caller's own rows (no Ulysses exchange before it, which gathers Q into
      // the workspace) adds into out and lse in place when they hold the accumulation type,
      // while every step reads q again (RingLoop::compute).
      if constexpr (std::is_same_v<T, acc_t<T>>)
        SEQPAR_CHECK(p.mesh().ring == 1 || p.mesh().ulysses > 1 || (!may_overlap(out, q) && !may_overlap(lse, q)),
                     ConfigError, "forward: out or lse overlaps q: the ring reads q at every step while it adds into "
                     "out and lse; give them memory of their own");
    });
    const auto guard = cx_.start_call(Pass::forward);
    PhaseCall<Comm, Kernel> call{cx_, kernel_, p, {PlanAccess::schedule(p).forward, workspace}};
    // The operands as the caller gave them; the phases (exchanges first) take it from there.
    Phases::run(call, ForwardOperands<T, Space>{q, k, v, p.kv_layout().block(p.ring_rank()), out, lse});
    cx_.end_call();
  }

  /// Backward: overwrites dq, dk, dv with the gradients of this rank's slices, running the
  /// policy's phases in the order forward does. Needs the forward's out and lse (so the plan's
  /// problem must have with_lse). The Ulysses exchange gathers Q, K, V, O, dO and the LSE again
  /// (no activations are kept between calls); on the ring, the dK/dV accumulators travel with
  /// their K/V block in the accumulation type and take one last hop home to the rank that
  /// owns the block.
  template <class T>
  void backward(const Plan& p, TensorView<const T, Space> dout, TensorView<const T, Space> q,
                TensorView<const T, Space> k, TensorView<const T, Space> v, TensorView<const T, Space> out,
                TensorView<const acc_t<T>, Space> lse, TensorView<T, Space> dq, TensorView<T, Space> dk,
                TensorView<T, Space> dv, float* d_sinks, std::span<std::byte> workspace) {
    static_assert(LocalAttentionKernel<Kernel, T> && kernel_has_backward<Kernel, T>,
                  "seqpar: the kernel has no backward for this element type (see the backward requirement in "
                  "kernel/local_attention_kernel.hpp)");
    const BusyFlag::Hold hold(busy_, "backward");
    const auto& pr = p.problem();
    agree_on_call(p, Pass::backward, "backward", [&] {
      check_call(p, dtype_v<T>, "backward", workspace, p.backward_workspace_bytes());
      SEQPAR_CHECK(pr.with_lse, ConfigError,
                   "backward: needs the forward's LSE, but the plan's problem has with_lse = false");
      check_inputs(p, q, k, v, "backward");
      check_view(dout, "backward: dout", pr.batch, p.local_q(), pr.heads, pr.value_dim(), ViewUse::read);
      check_view(out, "backward: out", pr.batch, p.local_q(), pr.heads, pr.value_dim(), ViewUse::read);
      check_lse_view(p, lse, "backward");
      check_view(dq, "backward: dq", pr.batch, p.local_q(), pr.heads, pr.head_dim, ViewUse::write);
      check_view(dk, "backward: dk", pr.batch, p.local_kv(), pr.kv_heads, pr.head_dim, ViewUse::write);
      check_view(dv, "backward: dv", pr.batch, p.local_kv(), pr.kv_heads, pr.value_dim(), ViewUse::write);
      SEQPAR_CHECK(!d_sinks || pr.sinks, ConfigError,
                   "backward: d_sinks given, but the plan's problem has no sinks (problem.sinks is null)");
    });
    const auto guard = cx_.start_call(Pass::backward);
    // The sinks' gradient needs only this rank's rows (and no message): it comes first.
    if (d_sinks) {
      cx_.enter(Phase::finish);
      if constexpr (ops_have_sinks<Space>) cx_.ops.sink_grads(dout, out, lse, pr.sinks, d_sinks);
      cx_.lap(Phase::finish);
    }
    PhaseCall<Comm, Kernel> call{cx_, kernel_, p, {PlanAccess::schedule(p).backward, workspace}};
    const PositionMap keys = p.kv_layout().block(p.ring_rank());
    Phases::run(call, BackwardOperands<T, Space>{dout, q, k, v, out, lse, keys, dq, dk, dv});
    cx_.end_call();
  }

  /// The world communicator.
  Comm& world() { return cx_.world; }
  /// This rank's Ulysses group.
  Comm& ulysses_comm() { return cx_.ulysses; }
  /// This rank's ring group.
  Comm& ring_comm() { return cx_.ring; }
  /// The local kernel.
  Kernel& kernel() { return kernel_; }
  /// The resolved mesh.
  const MeshConfig& mesh() const { return cx_.mesh; }
  /// Packing, merge and fill operations (on CUDA: they carry the stream).
  TensorOps<Space>& ops() { return cx_.ops; }
  /// Records the phases of later calls into `profile` (nullptr: stop).
  void set_profile(PhaseProfile* profile) { cx_.clock.set(profile); }
  /// The profile set, or nullptr.
  PhaseProfile* profile() const { return cx_.clock.get(); }
  /// Whether every call agrees with the other ranks on the call first (SEQPAR_CHECK_CALLS).
  bool checks_calls() const { return !call_gather_.empty(); }

 private:
  /// What the constructor's gather agreed: the mesh, whether calls agree first, this rank's
  /// engine id (of its plans) and the object's id on every rank (rank 0's engine id).
  struct Agreed {
    MeshConfig mesh;
    bool check_calls = false;
    std::uint64_t id = 0;
    std::int64_t object = 0;
  };

  MeshEngine(Comm& world, const Agreed& agreed, Kernel kernel)
      : cx_(world, agreed.mesh), kernel_(std::move(kernel)), id_(agreed.id), object_(agreed.object) {
    if (agreed.check_calls) call_gather_.resize(static_cast<std::size_t>(f_count * world.size()));
  }

  static Agreed agree_on_mesh(Comm& world, const MeshConfig& request) {
    constexpr int n_fields = 7;  // the mesh request's five, SEQPAR_CHECK_CALLS, the engine id
    const std::uint64_t id = next_engine_id();
    const std::int64_t mine[n_fields] = {request.ulysses, request.ring, static_cast<std::int64_t>(request.placement),
                                         static_cast<std::int64_t>(request.layout), request.anything,
                                         check_calls_from_env(), static_cast<std::int64_t>(id)};
    const int n = world.size();
    std::vector<std::int64_t> all(static_cast<std::size_t>(n_fields * n));
    world.all_gather_host(mine, all);
    world.stats().uncount_host_gather();  // set-up, not per-call metadata
    static constexpr const char* names[5] = {"ulysses_degree", "ring_degree", "placement", "layout", "anything"};
    static constexpr int fields[5] = {f_ulysses, f_ring, f_placement, f_layout, f_anything};
    for (int f = 0; f < 5; ++f)
      for (int w = 1; w < n; ++w)
        SEQPAR_CHECK(all[w * n_fields + f] == all[f], ConfigError, "SequenceParallelAttention: ranks disagree on ",
                     names[f], ": rank 0 has ", field_value(fields[f], all[f]), ", rank ", w, " has ",
                     field_value(fields[f], all[w * n_fields + f]));
    const auto check_calls_of = [&](int w) { return all[static_cast<std::size_t>(w * n_fields + 5)]; };
    const std::string bad = rank_list(n, [&](int w) { return check_calls_of(w) < 0; });
    bool check_calls = false;
    for (int w = 0; w < n; ++w) check_calls = check_calls || check_calls_of(w) == 1;
    const char* value = std::getenv(check_calls_env);
    SEQPAR_CHECK(bad.empty(), ConfigError, "SequenceParallelAttention: ", check_calls_env,
                 ": expected 1 (on), 0 or nothing (off); rank(s) ", bad, " have another value",
                 check_calls_from_env() < 0 ? std::string(" (this rank: \"") + value + "\")" : std::string());
    return {resolve_mesh(request, n), check_calls, id, all[6]};
  }

  /// A call's row in its agreement (SEQPAR_CHECK_CALLS), as long as a plan's row (f_count):
  /// a rank in plan() and one in a call then gather rows of one size, and each sees the other
  /// for what it is (field 0: call_marker where a plan has its batch).
  enum CallField : int { c_marker, c_refused, c_pass, c_object, c_plan };
  /// Field 0 of a call's row: no plan's batch is this negative.
  static constexpr std::int64_t call_marker = std::numeric_limits<std::int64_t>::min() + 0x5e9a;

  /// The ranks whose gathered row (rows of f_count) is a call's (`calls`) or not, listed, or "".
  static std::string ranks_in_a_call(std::span<const std::int64_t> rows, int world, bool calls) {
    const std::string ranks =
        rank_list(world, [&](int w) { return (rows[static_cast<std::size_t>(w * f_count)] == call_marker) == calls; });
    if (ranks.empty()) return "";
    return "rank(s) " + ranks + (calls ? " are in a forward or backward" : " are in plan()") +
           " (as " + check_calls_env + " shows): every rank must make an object's calls in the same order";
  }

  /// Runs a call's argument checks. With SEQPAR_CHECK_CALLS, then agrees with every rank on the
  /// call (one host all-gather into a buffer the constructor sized): if any rank refused its
  /// arguments, that rank rethrows its own ConfigError and the others one naming it; ranks that
  /// make different passes or pass plans of different fingerprints all throw the same
  /// ConfigError. Either way no message has left, nothing is latched and the call takes no
  /// number (CallGuard), so the next call is paired correctly on every rank.
  template <class Checks>
  void agree_on_call(const Plan& p, Pass pass, const char* call, Checks&& checks) {
    if (call_gather_.empty()) return checks();
    std::exception_ptr refused;
    try {
      checks();
    } catch (const ConfigError&) {
      refused = std::current_exception();
    }
    std::array<std::int64_t, f_count> mine{};
    mine[c_marker] = call_marker;
    mine[c_refused] = refused != nullptr;
    mine[c_pass] = static_cast<std::int64_t>(pass);
    mine[c_object] = object_;
    mine[c_plan] = PlanAccess::fingerprint(p);
    cx_.world.all_gather_host(std::span<const std::int64_t>(mine), std::span<std::int64_t>(call_gather_));
    const int n = cx_.world.size();
    const std::string elsewhere = ranks_in_a_call(call_gather_, n, false);
    SEQPAR_CHECK(elsewhere.empty(), ConfigError, call, ": ", elsewhere);
    // The ranks whose field f is (`same`) or is not rank 0's, or, for c_refused, is set.
    const auto ranks_where = [&](int f, bool same) {
      return rank_list(n, [&](int w) {
        const std::int64_t v = call_gather_[static_cast<std::size_t>(w * f_count + f)];
        return f == c_refused ? v != 0 : (v == call_gather_[static_cast<std::size_t>(f)]) == same;
      });
    };
    const std::string refusers = ranks_where(c_refused, false);
    if (refused) std::rethrow_exception(refused);
    SEQPAR_CHECK(refusers.empty(), ConfigError, call, ": rank(s) ", refusers,
                 " refused their arguments (their ConfigError says why), so every rank refuses this call (",
                 check_calls_env, ")");
    const std::string other_object = ranks_where(c_object, false);
    SEQPAR_CHECK(other_object.empty(), ConfigError, call, ": ranks call different objects (", check_calls_env,
                 "): rank(s) ", other_object, " call another SequenceParallelAttention than rank(s) ",
                 ranks_where(c_object, true), " (every rank must call its objects in the same order)");
    const std::string other_pass = ranks_where(c_pass, false);
    const auto pass_name = [&](bool rank0s) {
      const bool forward = call_gather_[c_pass] == static_cast<std::int64_t>(Pass::forward);
      return forward == rank0s ? "forward" : "backward";
    };
    SEQPAR_CHECK(other_pass.empty(), ConfigError, call, ": ranks disagree on the call (", check_calls_env,
                 "): rank(s) ", ranks_where(c_pass, true), " call ", pass_name(true), ", rank(s) ", other_pass,
                 " call ", pass_name(false));
    const std::string other_plan = ranks_where(c_plan, false);
    SEQPAR_CHECK(other_plan.empty(), ConfigError, call, ": ranks pass different plans (", check_calls_env,
                 "): rank(s) ", other_plan, " pass a plan other than rank(s) ", ranks_where(c_plan, true),
                 " (every rank must pass the plan that one plan() call made, or one made from the same problem "
                 "and lengths)");
  }

  /// The largest kernel call of plan p: this rank's heads over its ring block's queries
  /// against the longest K/V block (the ring's chunked calls take fewer heads, never more).
  static KernelCallBounds call_bounds(const Plan& p) {
    const LocalShape n(p);
    const auto s = n.extents();
    return {p.problem().batch, s.qr, s.hq, static_cast<std::int64_t>(n.kv_max), s.hk,
            p.problem().heads / p.problem().kv_heads, p.problem().head_dim, p.problem().with_lse, s.Dv};
  }

  void check_call(const Plan& p, DType dtype, const char* call, std::span<std::byte> workspace,
                  std::size_t need) const {
    SEQPAR_CHECK(PlanAccess::owner(p) == id_, ConfigError, call, ": ",
                 PlanAccess::owner(p) == 0 ? empty_plan_reason
                                           : "the plan was made by another SequenceParallelAttention (plans "
                                             "belong to the object whose plan() made them)");
    SEQPAR_CHECK(dtype == p.problem().dtype, ConfigError, call, ": element type: the plan was made for ",
                 dtype_name(p.problem().dtype), ", got ", dtype_name(dtype), " (plan with problem.dtype = ",
                 dtype_name(dtype), ", or plan<T>(...))");
    SEQPAR_CHECK(workspace.data() != nullptr || workspace.empty(), ConfigError, call,
                 ": workspace: null data pointer with a size of ", workspace.size(), " bytes");
    SEQPAR_CHECK(workspace.size() >= need, ConfigError, call, ": workspace: expected at least ", need,
                 " bytes (plan.", call == std::string_view("forward") ? "workspace_bytes()" : "backward_workspace_bytes()",
                 "), got ", workspace.size());
  }

  template <class L>
  static void check_lse_view(const Plan& p, TensorView<L, Space> lse, const char* call) {
    const auto& pr = p.problem();
    if (pr.with_lse) {
      // An empty slice (a rank with no queries) may come as no view at all.
      if (lse.absent()) {
        SEQPAR_CHECK(pr.batch * p.local_q() * pr.heads == 0, ConfigError, call,
                     ": lse: this plan needs an LSE view (with_lse = true), got none");
        return;
      }
      check_view(lse, std::string(call) + ": lse", pr.batch, p.local_q(), pr.heads, 1,
                 std::is_const_v<L> ? ViewUse::read : ViewUse::write);
    } else {
      SEQPAR_CHECK(lse.absent(), ConfigError, call, ": lse given, but the plan's problem has with_lse = false");
    }
  }

  template <class T>
  static void check_inputs(const Plan& p, TensorView<const T, Space> q, TensorView<const T, Space> k,
                           TensorView<const T, Space> v, const std::string& call) {
    const auto& pr = p.problem();
    check_view(q, call + ": q", pr.batch, p.local_q(), pr.heads, pr.head_dim, ViewUse::read);
    check_view(k, call + ": k", pr.batch, p.local_kv(), pr.kv_heads, pr.head_dim, ViewUse::read);
    check_view(v, call + ": v", pr.batch, p.local_kv(), pr.kv_heads, pr.value_dim(), ViewUse::read);
  }

  EngineContext<Comm> cx_;
  Kernel kernel_;
  std::uint64_t id_ = 0;     // this rank's engine id: the owner of its plans
  std::int64_t object_ = 0;  // the object's id on every rank (rank 0's engine id)
  BusyFlag busy_;
  std::vector<std::int64_t> call_gather_;  // the call agreement's gather; empty when calls do not agree
};

}  // namespace detail
}  // namespace seqpar
