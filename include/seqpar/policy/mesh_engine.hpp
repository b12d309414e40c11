#pragma once
/// \file
/// The engine behind every policy: a ulysses_degree x ring_degree mesh (Ulysses is the mesh
/// with R = 1, Ring the mesh with U = 1, the general case USP). It strings the phases
/// together; each phase lives in its own header:
///  - plan building and validation: policy/plan_builder.hpp (can_implement too);
///  - the workspace's named slots: policy/workspace_layout.hpp;
///  - 1. the Ulysses all-to-all in and 3. back: policy/ulysses_exchange.hpp;
///  - 2. the ring loop, forward and backward: policy/ring_loop.hpp;
///  - the LSE merge of partial results: kernel/merge_state.hpp.
/// The policy decides at compile time which phases exist (policy_traits): UlyssesPolicy
/// instantiates no ring code and RingPolicy no all-to-all, so a kernel or a communicator only
/// needs what its policy uses. The engine is keyed on those phases alone, not on the policy:
/// the layouts only shape the plan's tables, and Anything only lifts the divisibility checks
/// (on even shapes both send the same bytes), so RingPolicy<Zigzag>, RingPolicy<Stripe> and
/// AnythingPolicy<RingPolicy<Contiguous>> share one compiled engine. A program that switches
/// between policies at run time (seqpar_demo: 14 of them) compiles three engines, not 14.

#include <atomic>
#include <cstddef>
#include <new>
#include <cstdint>
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
#include "seqpar/policy/plan_builder.hpp"
#include "seqpar/policy/policies.hpp"
#include "seqpar/policy/ring_loop.hpp"
#include "seqpar/policy/ulysses_exchange.hpp"
#include "seqpar/policy/workspace_layout.hpp"

namespace seqpar::detail {

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

/// The engine of the phases `Phases` (policy_phases_of<Policy>) over `Comm` with `Kernel`.
template <class Phases, class Comm, class Kernel>
class MeshEngine {
  static constexpr bool has_ulysses = Phases::ulysses;  // the all-to-all phase exists
  static constexpr bool has_ring = Phases::ring;        // the ring loop exists

 public:
  using Space = typename Comm::memory_space;  ///< where tensors live

  /// Collective: all ranks check that they agree on the requested mesh, resolve it for the
  /// world size (every rank alike, so all throw the same ConfigError or none), then split the
  /// world into Ulysses groups and rings.
  MeshEngine(Comm& world, const MeshConfig& request, Kernel kernel)
      : cx_(world, agree_on_mesh(world, request)), kernel_(std::move(kernel)) {}

  /// Collective: gathers every rank's problem and lengths once, validates them identically on
  /// every rank (all throw the same ConfigError, none hangs), and builds the plan.
  Plan plan(const AttentionProblem& problem, LocalLengths lengths) {
    const BusyFlag::Hold hold(busy_, "plan");
    const int world = cx_.world.size();
    const auto mine = plan_fields(problem, cx_.mesh, lengths);
    std::vector<std::int64_t> all(static_cast<std::size_t>(f_count * world));
    cx_.world.all_gather_host(std::span<const std::int64_t>(mine), all);
    std::string why = disagreement_reason(all, world);
    // Lists travel as hashes; on a mismatch every rank sees it and gathers them to say where.
    if (const int field = first_disagreeing_field(all, world); field == f_documents)
      why = list_disagreement(cx_.world, "plan: ", "documents", problem.documents, false);
    else if (field == f_kv_valid)
      why = list_disagreement(cx_.world, "plan: ", "kv_valid", {problem.kv_valid}, true);
    if (why.empty()) {
      std::vector<std::int64_t> q(static_cast<std::size_t>(world)), kv(static_cast<std::size_t>(world));
      for (int w = 0; w < world; ++w) {
        q[static_cast<std::size_t>(w)] = all[w * f_count + f_q_len];
        kv[static_cast<std::size_t>(w)] = all[w * f_count + f_kv_len];
      }
      why = shape_reason(cx_.mesh, problem, q, kv);
    }
    if (why.empty()) why = kernel_reason<Kernel>(problem);
    SEQPAR_CHECK(why.empty(), ConfigError, why);
    Plan p = build_plan(all, problem, cx_.mesh, cx_.world.rank(), id_);
    try {  // every rank has the same head_dim, so every rank fails alike
      if constexpr (requires { kernel_.prepare(std::int64_t{}); }) kernel_.prepare(problem.head_dim);
      if constexpr (requires { kernel_.prepare_backward(std::int64_t{}); }) kernel_.prepare_backward(problem.head_dim);
      if constexpr (requires { kernel_.reserve(KernelCallBounds{}); }) kernel_.reserve(call_bounds(p));
    } catch (const std::bad_alloc&) {
      SEQPAR_THROW(ConfigError, "plan: the kernel could not allocate its scratch for head_dim ", problem.head_dim,
                   " (std::bad_alloc)");
    }
    return p;
  }

  /// Forward: the Ulysses exchange in, the local kernel or the ring loop, the exchange back.
  /// Allocates nothing and exchanges no metadata.
  template <class T>
  void forward(const Plan& p, TensorView<const T, Space> q, TensorView<const T, Space> k, TensorView<const T, Space> v,
               TensorView<T, Space> out, TensorView<acc_t<T>, Space> lse, std::span<std::byte> workspace) {
    using A = acc_t<T>;
    static_assert(LocalAttentionKernel<Kernel, T>,
                  "seqpar: the kernel does not model LocalAttentionKernel for this element type: it needs "
                  "forward(q, k, v, out, lse, params) with out a TensorView<T> (see kernel/local_attention_kernel.hpp)");
    const BusyFlag::Hold hold(busy_, "forward");
    check_call(p, dtype_v<T>, "forward", workspace, p.workspace_bytes());
    check_inputs(p, q, k, v, "forward");
    check_view(out, "forward: out", p.problem().batch, p.local_q(), p.problem().heads, p.problem().head_dim, true);
    check_lse_view(p, lse, "forward");
    const auto call = cx_.start_call(Pass::forward);
    const LocalShape n(p);
    const auto B = p.problem().batch, D = p.problem().head_dim, qr = to_i(n.qr), hq = to_i(n.hq);
    const Slots<WorkspaceLayout<forward_slot_count>> ws{PlanAccess::schedule(p).forward, workspace};
    using View = TensorView<T, Space>;
    using AView = TensorView<A, Space>;
    const ExchangeTables& tab = PlanAccess::schedule(p).tables;
    const bool U = has_ulysses && p.mesh().ulysses > 1, R = has_ring && p.mesh().ring > 1;

    const Blocks<T> in = stage_inputs(p, q, k, v, ws.template get<T>(fs_q_send), ws.template get<T>(fs_k_send),
                                      ws.template get<T>(fs_v_send), ws.template get<T>(fs_q_block),
                                      ws.template get<T>(fs_ring0));
    KernelParams params = kernel_params(p);
    View o_block = U ? View::sbhd(ws.template get<T>(fs_o_send), B, qr, hq, D) : out;
    AView l_block = U ? AView::sbhd(ws.template get<A>(fs_l_send), B, qr, hq, 1) : lse;
    if (!p.problem().with_lse) l_block = AView{};
    if (!R) {
      params.k_positions = p.kv_layout().block(0);
      kernel_.forward(in.q, in.k, in.v, o_block, l_block, params);
      cx_.lap(Phase::compute);
    } else if constexpr (has_ring) {
      RingLoop<Comm, Kernel> ring{cx_, kernel_};
      A* l_acc = ws.template get<A>(fs_l_acc);
      auto run = [&](AView o_acc, AView l_out) {
        ring.template forward<T>(p, in.q, ws.template get<T>(fs_ring0), ws.template get<T>(fs_ring1),
                                 ws.template get<A>(fs_o_part), ws.template get<A>(fs_l_part), params, o_acc, l_out);
      };
      if constexpr (std::is_same_v<T, A>) {
        // The running output can live where it ends (out, or the all-to-all send buffer): no
        // copy at the end. The LSE too, when the caller asked for it.
        run(o_block, l_block.absent() ? AView::sbhd(l_acc, B, qr, hq, 1) : l_block);
      } else {
        const AView o_acc = AView::sbhd(ws.template get<A>(fs_o_acc), B, qr, hq, D), l_all = AView::sbhd(l_acc, B, qr, hq, 1);
        run(o_acc, l_all);
        cx_.ops.copy(TensorView<const A, Space>(o_acc), o_block);
        if (!l_block.absent()) cx_.ops.copy(TensorView<const A, Space>(l_all), l_block);
        cx_.lap(Phase::finish);
      }
    }
    if constexpr (has_ulysses) {
      if (U) {
        scatter_heads<T>(cx_, o_block, p, false, tab.q, ws.template get<T>(fs_o_send), ws.template get<T>(fs_o_recv),
                         out, nullptr);
        if (p.problem().with_lse)
          scatter_heads<A>(cx_, l_block, p, false, tab.lse, ws.template get<A>(fs_l_send),
                           ws.template get<A>(fs_l_recv), lse, nullptr);
      }
    }
    cx_.end_call();
  }

  /// Backward: adds nothing, overwrites dq, dk, dv with the gradients of this rank's slices.
  /// Needs the forward's out and lse (so the plan's problem must have with_lse). Ulysses
  /// gathers Q, K, V, O, dO and the LSE again (no activations are kept between calls); on the
  /// ring, the dK/dV accumulators travel with their K/V block in the accumulation type and
  /// take one last hop home to the rank that owns the block.
  template <class T>
  void backward(const Plan& p, TensorView<const T, Space> dout, TensorView<const T, Space> q,
                TensorView<const T, Space> k, TensorView<const T, Space> v, TensorView<const T, Space> out,
                TensorView<const acc_t<T>, Space> lse, TensorView<T, Space> dq, TensorView<T, Space> dk,
                TensorView<T, Space> dv, std::span<std::byte> workspace) {
    using A = acc_t<T>;
    static_assert(LocalAttentionKernel<Kernel, T> && kernel_has_backward<Kernel, T>,
                  "seqpar: the kernel has no backward for this element type (see the backward requirement in "
                  "kernel/local_attention_kernel.hpp)");
    const BusyFlag::Hold hold(busy_, "backward");
    check_call(p, dtype_v<T>, "backward", workspace, p.backward_workspace_bytes());
    SEQPAR_CHECK(p.problem().with_lse, ConfigError,
                 "backward: needs the forward's LSE, but the plan's problem has with_lse = false");
    const auto& pr = p.problem();
    check_inputs(p, q, k, v, "backward");
    check_view(dout, "backward: dout", pr.batch, p.local_q(), pr.heads, pr.head_dim, false);
    check_view(out, "backward: out", pr.batch, p.local_q(), pr.heads, pr.head_dim, false);
    check_lse_view(p, lse, "backward");
    check_view(dq, "backward: dq", pr.batch, p.local_q(), pr.heads, pr.head_dim, true);
    check_view(dk, "backward: dk", pr.batch, p.local_kv(), pr.kv_heads, pr.head_dim, true);
    check_view(dv, "backward: dv", pr.batch, p.local_kv(), pr.kv_heads, pr.head_dim, true);
    const auto call = cx_.start_call(Pass::backward);
    const LocalShape n(p);
    const auto B = pr.batch, D = pr.head_dim, qr = to_i(n.qr), kr = to_i(n.kr), hq = to_i(n.hq), hk = to_i(n.hk);
    const Slots<WorkspaceLayout<backward_slot_count>> ws{PlanAccess::schedule(p).backward, workspace};
    using AView = TensorView<A, Space>;
    const ExchangeTables& tab = PlanAccess::schedule(p).tables;
    const bool U = has_ulysses && p.mesh().ulysses > 1, R = has_ring && p.mesh().ring > 1;

    const Blocks<T> in = stage_inputs(p, q, k, v, ws.template get<T>(bs_q_send), ws.template get<T>(bs_k_send),
                                      ws.template get<T>(bs_v_send), ws.template get<T>(bs_q_block),
                                      ws.template get<T>(bs_ring0));
    TensorView<const T, Space> dob = dout, ob = out;
    TensorView<const A, Space> lb = lse;
    if constexpr (has_ulysses) {
      if (U) {
        dob = gather_heads(cx_, dout, p, false, tab.q, ws.template get<T>(bs_do_send), ws.template get<T>(bs_do_block), qr, hq);
        ob = gather_heads(cx_, out, p, false, tab.q, ws.template get<T>(bs_o_send), ws.template get<T>(bs_o_block), qr, hq);
        lb = gather_heads(cx_, lse, p, false, tab.lse, ws.template get<A>(bs_l_send), ws.template get<A>(bs_l_block), qr, hq);
      }
    }
    const AView dq_acc = AView::sbhd(ws.template get<A>(bs_dq_acc), B, qr, hq, D);
    cx_.ops.fill(dq_acc, A(0));
    A* own = ws.template get<A>(bs_grad0);
    cx_.ops.fill(AView::sbhd(own, B, 2 * kr, hk, D), A(0));
    cx_.lap(Phase::pack);
    const KernelParams params = kernel_params(p);
    if (!R) {
      KernelParams local = params;
      local.k_positions = p.kv_layout().block(p.ring_rank());
      if (PlanAccess::schedule(p).ring_step_computes[0])
        kernel_.backward(dob, in.q, in.k, in.v, ob, lb, dq_acc, AView::sbhd(own, B, kr, hk, D),
                         AView::sbhd(own + n.kr * n.B * n.hk * n.D, B, kr, hk, D), local);
      cx_.lap(Phase::compute);
    } else if constexpr (has_ring) {
      T* const ring[2] = {ws.template get<T>(bs_ring0), ws.template get<T>(bs_ring1)};
      A* const grad[2] = {own, ws.template get<A>(bs_grad1)};
      own = const_cast<A*>(RingLoop<Comm, Kernel>{cx_, kernel_}.template backward<T>(
          p, in.q, dob, ob, lb, ring, grad, ws.template get<A>(bs_grad_part), params, dq_acc));
    }

    const AView dk_block = AView::sbhd(own, B, kr, hk, D);
    const AView dv_block = AView::sbhd(own + n.kr * n.B * n.hk * n.D, B, kr, hk, D);
    if (U) {
      if constexpr (has_ulysses) {
        scatter_heads<T>(cx_, dq_acc, p, false, tab.q, ws.template get<T>(bs_dq_send), ws.template get<T>(bs_dq_recv),
                         dq, nullptr);
        scatter_heads<T>(cx_, dk_block, p, true, tab.kv, ws.template get<T>(bs_dk_send),
                         ws.template get<T>(bs_dk_recv), dk, ws.template get<A>(bs_dk_sum));
        scatter_heads<T>(cx_, dv_block, p, true, tab.kv, ws.template get<T>(bs_dv_send),
                         ws.template get<T>(bs_dv_recv), dv, ws.template get<A>(bs_dv_sum));
      }
    } else {
      cx_.ops.copy(TensorView<const A, Space>(dq_acc), dq);
      cx_.ops.copy(TensorView<const A, Space>(dk_block), dk);
      cx_.ops.copy(TensorView<const A, Space>(dv_block), dv);
      cx_.lap(Phase::finish);
    }
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

 private:
  static MeshConfig agree_on_mesh(Comm& world, const MeshConfig& request) {
    const std::int64_t mine[5] = {request.ulysses, request.ring, static_cast<std::int64_t>(request.placement),
                                  static_cast<std::int64_t>(request.layout), request.anything};
    const int n = world.size();
    std::vector<std::int64_t> all(static_cast<std::size_t>(5 * n));
    world.all_gather_host(mine, all);
    world.stats().uncount_host_gather();  // set-up, not per-call metadata
    static constexpr const char* names[5] = {"ulysses_degree", "ring_degree", "placement", "layout", "anything"};
    static constexpr int fields[5] = {f_ulysses, f_ring, f_placement, f_layout, f_anything};
    for (int f = 0; f < 5; ++f)
      for (int w = 1; w < n; ++w)
        SEQPAR_CHECK(all[w * 5 + f] == all[f], ConfigError, "SequenceParallelAttention: ranks disagree on ",
                     names[f], ": rank 0 has ", field_value(fields[f], all[f]), ", rank ", w, " has ",
                     field_value(fields[f], all[w * 5 + f]));
    return resolve_mesh(request, n);
  }

  static std::int64_t to_i(std::size_t x) { return static_cast<std::int64_t>(x); }

  /// The largest kernel call of plan p: this rank's heads over its ring block's queries
  /// against the longest K/V block (the ring's chunked calls take fewer heads, never more).
  static KernelCallBounds call_bounds(const Plan& p) {
    const LocalShape n(p);
    const std::int64_t kv = std::max(to_i(n.kr), PlanAccess::schedule(p).max_kv_block);
    return {p.problem().batch, to_i(n.qr), to_i(n.hq), kv, to_i(n.hk), p.problem().heads / p.problem().kv_heads,
            p.problem().head_dim, p.problem().with_lse};
  }

  void check_call(const Plan& p, DType dtype, const char* call, std::span<std::byte> workspace,
                  std::size_t need) const {
    SEQPAR_CHECK(PlanAccess::owner(p) == id_, ConfigError, call,
                 PlanAccess::owner(p) == 0 ? ": the plan is empty (make it with plan())"
                                           : ": the plan was made by another SequenceParallelAttention (plans "
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
      // An empty slice (a rank with no queries) may come with a null pointer.
      SEQPAR_CHECK(!lse.absent() || pr.batch * p.local_q() * pr.heads == 0, ConfigError, call,
                   ": lse: this plan needs an LSE view (with_lse = true), got none");
      check_view(lse, std::string(call) + ": lse", pr.batch, p.local_q(), pr.heads, 1, !std::is_const_v<L>);
    } else {
      SEQPAR_CHECK(lse.absent(), ConfigError, call, ": lse given, but the plan's problem has with_lse = false");
    }
  }

  template <class T>
  static void check_inputs(const Plan& p, TensorView<const T, Space> q, TensorView<const T, Space> k,
                           TensorView<const T, Space> v, const std::string& call) {
    const auto& pr = p.problem();
    check_view(q, call + ": q", pr.batch, p.local_q(), pr.heads, pr.head_dim, false);
    check_view(k, call + ": k", pr.batch, p.local_kv(), pr.kv_heads, pr.head_dim, false);
    check_view(v, call + ": v", pr.batch, p.local_kv(), pr.kv_heads, pr.head_dim, false);
  }

  static KernelParams kernel_params(const Plan& p) {
    KernelParams params;
    params.scale = p.problem().softmax_scale();
    params.causal = p.problem().causal;
    params.q_positions = p.q_diagonals(p.ring_rank());  // bottom-right alignment shifts them
    params.mask = p.mask();
    params.group_size = p.problem().heads / p.problem().kv_heads;
    params.q_head_begin = p.q_heads(p.ulysses_rank()).begin;
    params.kv_head_begin = p.kv_heads(p.ulysses_rank()).begin;
    return params;
  }

  /// Q, K, V of this rank's heads over its whole ring block.
  template <class T>
  struct Blocks {
    TensorView<const T, Space> q, k, v;
  };

  /// Phase 1: the Ulysses exchange in; K and V land in ring buffer `kv` ([K | V]) whenever they
  /// will travel the ring. With neither phase the caller's tensors are used as they are.
  template <class T>
  Blocks<T> stage_inputs(const Plan& p, TensorView<const T, Space> q, TensorView<const T, Space> k,
                         TensorView<const T, Space> v, T* q_send, T* k_send, T* v_send, T* q_block, T* kv) {
    const LocalShape n(p);
    const auto B = p.problem().batch, D = p.problem().head_dim;
    const auto qr = to_i(n.qr), kr = to_i(n.kr), hq = to_i(n.hq), hk = to_i(n.hk);
    const std::size_t k_elems = n.kr * n.B * n.hk * n.D;
    using CView = TensorView<const T, Space>;
    if constexpr (has_ulysses) {
      if (p.mesh().ulysses > 1) {
        const ExchangeTables& tab = PlanAccess::schedule(p).tables;
        return {gather_heads(cx_, q, p, false, tab.q, q_send, q_block, qr, hq),
                gather_heads(cx_, k, p, true, tab.kv, k_send, kv, kr, hk),
                gather_heads(cx_, v, p, true, tab.kv, v_send, kv + k_elems, kr, hk)};
      }
    }
    if constexpr (has_ring) {
      if (p.mesh().ring > 1) {
        cx_.ops.copy(k, TensorView<T, Space>::sbhd(kv, B, kr, hk, D));
        cx_.ops.copy(v, TensorView<T, Space>::sbhd(kv + k_elems, B, kr, hk, D));
        cx_.lap(Phase::pack);
        return {q, CView::sbhd(kv, B, kr, hk, D), CView::sbhd(kv + k_elems, B, kr, hk, D)};
      }
    }
    return {q, k, v};
  }

  EngineContext<Comm> cx_;
  Kernel kernel_;
  std::uint64_t id_ = next_engine_id();
  BusyFlag busy_;
};

}  // namespace seqpar::detail
