#pragma once
/// \file
/// The one engine behind every policy: a ulysses_degree x ring_degree mesh. Ulysses is the
/// mesh with R = 1, Ring the mesh with U = 1; the general case is USP. Plain policies and
/// AnythingPolicy share this code: Anything only lifts the divisibility checks, so on shapes
/// that divide evenly both send the same bytes and take the same time.
///
/// Forward on mesh rank (r, u):
///  1. Ulysses all-to-all (U > 1): every rank sends each group member the member's heads of
///     its own tokens. Pieces are packed [seq, batch, heads, dim], so the pieces received
///     from the members, concatenated along the sequence, are one strided tensor: the whole
///     ring block for this rank's heads, with no unpacking.
///  2. Ring (R > 1): K/V blocks travel the ring in a double buffer; the next block is in
///     flight while the current one computes. Each step's partial output (in the accumulation
///     type) merges into the running output by the LSE rule. Steps a causal mask hides
///     entirely are skipped (the kernel skips hidden tiles inside a step).
///  3. Ulysses all-to-all back (U > 1) of O (and the LSE when asked for).

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/profile.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/workspace.hpp"
#include "seqpar/kernel/host_ops.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/policy/policies.hpp"

namespace seqpar::detail {

/// Bytes of one element of a DType.
constexpr std::size_t dtype_bytes(DType t) { return t == DType::f64 ? 8 : t == DType::f32 ? 4 : 2; }

/// Every field ranks must agree on, gathered once per plan; validation runs on the gathered
/// copy so that every rank reaches the same verdict and throws the same message.
enum PlanField : int {
  f_batch, f_heads, f_kv_heads, f_head_dim, f_causal, f_dtype, f_scale, f_with_lse,
  f_ulysses, f_ring, f_placement, f_layout, f_anything, f_q_len, f_kv_len, f_count
};
inline constexpr const char* plan_field_names[f_count] = {
    "batch", "heads", "kv_heads", "head_dim", "causal", "dtype", "scale", "with_lse",
    "ulysses_degree", "ring_degree", "placement", "layout", "anything (AnythingPolicy)", "q_len", "kv_len"};
inline constexpr int plan_agreed_fields = f_q_len;  // fields before this one must match

/// Lists the world ranks whose value of `field` differs from rank 0's, for the message.
inline std::string disagreement(const std::vector<std::int64_t>& all, int world, int field) {
  std::string who;
  for (int w = 1; w < world; ++w)
    if (all[w * f_count + field] != all[field])
      who += (who.empty() ? "" : ", ") + std::string("rank ") + std::to_string(w) + " has " +
             std::to_string(all[w * f_count + field]);
  return who;
}

/// Sizes of this rank's tensors under a plan, in elements.
struct LocalShape {
  std::size_t B, D, H, K;  // batch, head_dim, heads, kv_heads
  std::size_t lq, lk;      // local tokens
  std::size_t qr, kr;      // tokens of this rank's ring block (what the Ulysses group holds)
  std::size_t hq, hk;      // heads this rank computes (query, K/V)
  std::size_t kv_sent;     // K/V heads this rank packs for its group (shared heads count twice)
  std::size_t kv_ring;     // elements of one [K | V] ring buffer

  explicit LocalShape(const Plan& p) {
    const int r = p.ring_rank, u = p.ulysses_rank;
    B = static_cast<std::size_t>(p.problem.batch);
    D = static_cast<std::size_t>(p.problem.head_dim);
    H = static_cast<std::size_t>(p.problem.heads);
    K = static_cast<std::size_t>(p.problem.kv_heads);
    lq = static_cast<std::size_t>(p.local_q());
    lk = static_cast<std::size_t>(p.local_kv());
    qr = static_cast<std::size_t>(p.q_layout.block(r).size());
    kr = static_cast<std::size_t>(p.kv_layout.block(r).size());
    hq = static_cast<std::size_t>(p.q_heads[u].count);
    hk = static_cast<std::size_t>(p.kv_heads[u].count);
    kv_sent = 0;
    for (const HeadRange& h : p.kv_heads) kv_sent += static_cast<std::size_t>(h.count);
    kv_ring = 2 * (p.mesh.ring > 1 ? static_cast<std::size_t>(p.max_kv_block) : kr) * B * hk * D;
  }
};

/// The buffers forward carves from the workspace. Phase-1 send buffers and phase-3 return
/// buffers are never live together, so they share bytes.
template <class T, class A>
struct ForwardBuffers {
  T* q_block = nullptr;             // [Qr, B, hq, D] gathered queries (U > 1)
  T* ring[2] = {nullptr, nullptr};  // [K | V] blocks, each [Kb, B, hk, D]
  A* o_acc = nullptr;               // running output [Qr, B, hq, D] (R > 1 and T != A)
  A* l_acc = nullptr;               // running LSE [Qr, B, hq]
  A* o_part = nullptr;              // one step's output
  A* l_part = nullptr;              // one step's LSE
  T* q_send = nullptr;              // phase 1: packing
  T* k_send = nullptr;
  T* v_send = nullptr;
  T* o_send = nullptr;  // phase 3: [Qr, B, hq, D]
  A* l_send = nullptr;  // [Qr, B, hq]
  T* o_recv = nullptr;  // [Lq, B, H, D] pieces
  A* l_recv = nullptr;
};

/// Carves the forward buffers; with a sizing carver it only counts bytes.
template <class T, class A>
ForwardBuffers<T, A> carve_forward(WorkspaceCarver& c, const Plan& p) {
  ForwardBuffers<T, A> buf;
  const LocalShape n(p);
  const bool ulysses = p.mesh.ulysses > 1, ring = p.mesh.ring > 1;
  if (ulysses) buf.q_block = c.take<T>(n.qr * n.B * n.hq * n.D);
  if (ulysses || ring) buf.ring[0] = c.take<T>(n.kv_ring);
  if (ring) {
    buf.ring[1] = c.take<T>(n.kv_ring);
    // With T == A the running output lives in the output block itself (see forward).
    if constexpr (!std::is_same_v<T, A>) buf.o_acc = c.take<A>(n.qr * n.B * n.hq * n.D);
    buf.o_part = c.take<A>(n.qr * n.B * n.hq * n.D);
    buf.l_acc = c.take<A>(n.qr * n.B * n.hq);
    buf.l_part = c.take<A>(n.qr * n.B * n.hq);
  }
  if (ulysses) {
    const std::size_t start = c.mark();
    buf.q_send = c.take<T>(n.lq * n.B * n.H * n.D);
    buf.k_send = c.take<T>(n.lk * n.B * n.kv_sent * n.D);
    buf.v_send = c.take<T>(n.lk * n.B * n.kv_sent * n.D);
    const std::size_t end1 = c.mark();
    c.rewind(start);
    buf.o_send = c.take<T>(n.qr * n.B * n.hq * n.D);
    buf.l_send = c.take<A>(n.qr * n.B * n.hq);
    buf.o_recv = c.take<T>(n.lq * n.B * n.H * n.D);
    buf.l_recv = c.take<A>(n.lq * n.B * n.H);
    if (c.mark() < end1) c.rewind(end1);
  }
  return buf;
}

/// The buffers backward carves. dK/dV accumulators travel the ring with K/V, in A.
template <class T, class A>
struct BackwardBuffers {
  T* q_block = nullptr;  // gathered [Qr, B, hq, D] (U > 1)
  T* do_block = nullptr;
  T* o_block = nullptr;
  A* l_block = nullptr;  // [Qr, B, hq]
  T* ring[2] = {nullptr, nullptr};  // [K | V]
  A* grad[2] = {nullptr, nullptr};  // [dK | dV] accumulators: the one in hand, the one arriving
  A* grad_part = nullptr;           // this step's contribution, added once the accumulator arrived
  A* dq_acc = nullptr;              // [Qr, B, hq, D]
  T* q_send = nullptr;  // phase 1
  T* do_send = nullptr;
  T* o_send = nullptr;
  A* l_send = nullptr;
  T* k_send = nullptr;
  T* v_send = nullptr;
  T* dq_send = nullptr;  // phase 3
  T* dq_recv = nullptr;
  T* dk_send = nullptr;
  T* dv_send = nullptr;
  T* dk_recv = nullptr;
  T* dv_recv = nullptr;
  A* dk_sum = nullptr;  // [B, Lk, K, D]: a K/V head several members used gets their sum
  A* dv_sum = nullptr;
};

/// Carves the backward buffers; with a sizing carver it only counts bytes.
template <class T, class A>
BackwardBuffers<T, A> carve_backward(WorkspaceCarver& c, const Plan& p) {
  BackwardBuffers<T, A> buf;
  const LocalShape n(p);
  const bool ulysses = p.mesh.ulysses > 1, ring = p.mesh.ring > 1;
  const std::size_t q_elems = n.qr * n.B * n.hq * n.D;
  if (ulysses) {
    buf.q_block = c.take<T>(q_elems);
    buf.do_block = c.take<T>(q_elems);
    buf.o_block = c.take<T>(q_elems);
    buf.l_block = c.take<A>(n.qr * n.B * n.hq);
  }
  if (ulysses || ring) buf.ring[0] = c.take<T>(n.kv_ring);
  if (ring) buf.ring[1] = c.take<T>(n.kv_ring);
  buf.grad[0] = c.take<A>(n.kv_ring);
  if (ring) {
    buf.grad[1] = c.take<A>(n.kv_ring);
    buf.grad_part = c.take<A>(n.kv_ring);
  }
  buf.dq_acc = c.take<A>(q_elems);
  if (ulysses) {
    const std::size_t start = c.mark();
    buf.q_send = c.take<T>(n.lq * n.B * n.H * n.D);
    buf.do_send = c.take<T>(n.lq * n.B * n.H * n.D);
    buf.o_send = c.take<T>(n.lq * n.B * n.H * n.D);
    buf.l_send = c.take<A>(n.lq * n.B * n.H);
    buf.k_send = c.take<T>(n.lk * n.B * n.kv_sent * n.D);
    buf.v_send = c.take<T>(n.lk * n.B * n.kv_sent * n.D);
    const std::size_t end1 = c.mark();
    c.rewind(start);
    buf.dq_send = c.take<T>(q_elems);
    buf.dq_recv = c.take<T>(n.lq * n.B * n.H * n.D);
    buf.dk_send = c.take<T>(n.kr * n.B * n.hk * n.D);
    buf.dv_send = c.take<T>(n.kr * n.B * n.hk * n.D);
    buf.dk_recv = c.take<T>(n.lk * n.B * n.kv_sent * n.D);
    buf.dv_recv = c.take<T>(n.lk * n.B * n.kv_sent * n.D);
    buf.dk_sum = c.take<A>(n.lk * n.B * n.K * n.D);
    buf.dv_sum = c.take<A>(n.lk * n.B * n.K * n.D);
    if (c.mark() < end1) c.rewind(end1);
  }
  return buf;
}

/// Workspace bytes of a carve function for the plan's element type.
template <template <class, class> class Carve>
std::size_t workspace_for(const Plan& p) {
  WorkspaceCarver sizing;
  if (p.problem.dtype == DType::f64)
    Carve<double, double>::run(sizing, p);
  else if (p.problem.dtype == DType::f32)
    Carve<float, float>::run(sizing, p);
  else
    Carve<std::uint16_t, float>::run(sizing, p);  // 2-byte types: only the sizes matter
  return sizing.bytes_needed();
}
template <class T, class A>
struct CarveForward {
  static void run(WorkspaceCarver& c, const Plan& p) { carve_forward<T, A>(c, p); }
};
template <class T, class A>
struct CarveBackward {
  static void run(WorkspaceCarver& c, const Plan& p) { carve_backward<T, A>(c, p); }
};

/// Fills an all-to-all table: this rank sends member v `send_elems(v)` elements and receives
/// `recv_elems(v)` from it; pieces are packed back to back in member order.
template <class SendElems, class RecvElems>
AllToAllTable make_table(int U, std::size_t bytes, SendElems send_elems, RecvElems recv_elems) {
  AllToAllTable t;
  std::size_t so = 0, ro = 0;
  for (int v = 0; v < U; ++v) {
    const std::size_t s = send_elems(v) * bytes, r = recv_elems(v) * bytes;
    t.send_counts.push_back(s);
    t.send_displs.push_back(so);
    t.recv_counts.push_back(r);
    t.recv_displs.push_back(ro);
    so += s;
    ro += r;
  }
  return t;
}

/// The engine: owns the Ulysses and ring sub-communicators of a world communicator.
template <class Comm, class Kernel>
class MeshEngine {
 public:
  using Space = typename Comm::memory_space;

  /// Collective: all ranks check that they agree on the requested mesh (mesh_request), resolve
  /// it for the world size (every rank alike, so all throw the same ConfigError or none), then
  /// split the world into Ulysses groups and rings.
  MeshEngine(Comm& world, MeshConfig request, Kernel kernel)
      : world_(world), mesh_(agree_on_mesh(world, request)), kernel_(std::move(kernel)),
        ulysses_(world.split(mesh_.ring_rank(world.rank()), mesh_.ulysses_rank(world.rank()))),
        ring_(world.split(mesh_.ulysses_rank(world.rank()), mesh_.ring_rank(world.rank()))) {}

  /// Collective: gathers every rank's problem and lengths once, validates them identically
  /// on every rank (all throw the same ConfigError, none hangs), and builds the plan.
  Plan plan(const AttentionProblem& problem, LocalLengths lengths) {
    const int world = world_.size(), me = world_.rank();
    const std::int64_t mine[f_count] = {
        problem.batch, problem.heads, problem.kv_head_count(), problem.head_dim, problem.causal,
        static_cast<std::int64_t>(problem.dtype), std::bit_cast<std::int64_t>(problem.softmax_scale()),
        problem.with_lse, mesh_.ulysses, mesh_.ring, static_cast<std::int64_t>(mesh_.placement),
        static_cast<std::int64_t>(mesh_.layout), mesh_.anything, lengths.q, lengths.kv_count()};
    std::vector<std::int64_t> all(static_cast<std::size_t>(f_count * world));
    world_.all_gather_host(mine, all);
    validate(all, world);

    Plan p;
    p.problem = problem;
    p.problem.kv_heads = problem.kv_head_count();
    p.mesh = mesh_;
    p.world_rank = me;
    p.ring_rank = mesh_.ring_rank(me);
    p.ulysses_rank = mesh_.ulysses_rank(me);
    const int U = mesh_.ulysses, R = mesh_.ring;
    std::vector<std::int64_t> qlen(static_cast<std::size_t>(world)), kvlen(static_cast<std::size_t>(world));
    for (int w = 0; w < world; ++w) {
      const std::size_t m = static_cast<std::size_t>(mesh_.ring_rank(w) * U + mesh_.ulysses_rank(w));
      qlen[m] = all[w * f_count + f_q_len];
      kvlen[m] = all[w * f_count + f_kv_len];
    }
    p.q_layout = SequenceLayout(mesh_.layout, R, U, qlen);
    p.kv_layout = SequenceLayout(mesh_.layout, R, U, kvlen);

    const std::int64_t H = problem.heads, G = problem.heads / problem.kv_head_count();
    std::int64_t begin = 0;
    for (std::int64_t count : split_evenly(H, U)) {
      p.q_heads.push_back({begin, count});
      const std::int64_t kb = begin / G, ke = count > 0 ? (begin + count - 1) / G + 1 : kb;
      p.kv_heads.push_back({kb, ke - kb});
      begin += count;
    }
    p.elem_bytes = dtype_bytes(problem.dtype);
    p.acc_bytes = problem.dtype == DType::f64 ? 8 : 4;

    const int r = p.ring_rank, u = p.ulysses_rank;
    const auto B = static_cast<std::size_t>(problem.batch), D = static_cast<std::size_t>(problem.head_dim);
    auto len = [](const SequenceLayout& l, int rr, int v) { return static_cast<std::size_t>(l.length(rr, v)); };
    auto nq = [&](int v) { return static_cast<std::size_t>(p.q_heads[v].count); };
    auto nk = [&](int v) { return static_cast<std::size_t>(p.kv_heads[v].count); };
    p.q_table = make_table(U, p.elem_bytes, [&](int v) { return len(p.q_layout, r, u) * B * nq(v) * D; },
                           [&](int v) { return len(p.q_layout, r, v) * B * nq(u) * D; });
    p.kv_table = make_table(U, p.elem_bytes, [&](int v) { return len(p.kv_layout, r, u) * B * nk(v) * D; },
                            [&](int v) { return len(p.kv_layout, r, v) * B * nk(u) * D; });
    // O and the LSE go back on their tables reversed: the pieces of Q's trip, head_dim 1.
    p.lse_table = make_table(U, p.acc_bytes, [&](int v) { return len(p.q_layout, r, u) * B * nq(v); },
                             [&](int v) { return len(p.q_layout, r, v) * B * nq(u); });

    for (int src = 0; src < R; ++src) p.max_kv_block = std::max(p.max_kv_block, p.kv_layout.block(src).size());
    const PositionMap& qb = p.q_layout.block(r);
    for (int s = 0; s < R; ++s) {
      const PositionMap& kb = p.kv_layout.block((r - s + R) % R);
      const bool any = qb.size() > 0 && kb.size() > 0 && nq(u) > 0 && B > 0 &&
                       !(problem.causal && kb.first() > qb.last());
      p.ring_step_computes.push_back(any);
    }

    p.workspace = workspace_for<CarveForward>(p);
    p.backward_workspace = workspace_for<CarveBackward>(p);
    if constexpr (requires { kernel_.prepare(std::int64_t{}); }) kernel_.prepare(problem.head_dim);
    if constexpr (requires { kernel_.prepare_backward(std::int64_t{}); }) kernel_.prepare_backward(problem.head_dim);
    return p;
  }

  /// Forward (see the file comment). Allocates nothing and exchanges no metadata.
  template <class T>
  void forward(const Plan& p, TensorView<const T, Space> q, TensorView<const T, Space> k, TensorView<const T, Space> v,
               TensorView<T, Space> out, TensorView<acc_t<T>, Space> lse, std::span<std::byte> workspace) {
    using A = acc_t<T>;
    static_assert(LocalAttentionKernel<Kernel, T>,
                  "seqpar: the kernel does not model LocalAttentionKernel for this element type "
                  "(see kernel/local_attention_kernel.hpp for the requirements)");
    check_plan(p, dtype_v<T>, "forward");
    check_inputs(p, q, k, v, "forward");
    check_view(out, "forward: out", p.problem.batch, p.local_q(), p.problem.heads, p.problem.head_dim, true);
    if (p.problem.with_lse)
      check_view(lse, "forward: lse", p.problem.batch, p.local_q(), p.problem.heads, 1, true);
    else
      SEQPAR_CHECK(lse.absent(), ConfigError, "forward: lse given, but the plan's problem has with_lse = false");
    check_workspace(workspace, p.workspace_bytes(), "forward");
    start_call(Pass::forward);
    const LocalShape n(p);
    const auto B = p.problem.batch, D = p.problem.head_dim;
    const auto qr = to_i(n.qr), hq = to_i(n.hq);
    WorkspaceCarver carver(workspace);
    const ForwardBuffers<T, A> buf = carve_forward<T, A>(carver, p);
    using View = TensorView<T, Space>;
    using AView = TensorView<A, Space>;

    const Blocks<T> in = gather_qkv(p, q, k, v, buf.q_send, buf.k_send, buf.v_send, buf.q_block, buf.ring[0]);
    KernelParams params = kernel_params(p);

    View o_block = p.mesh.ulysses > 1 ? View::sbhd(buf.o_send, B, qr, hq, D) : out;
    AView l_block = p.mesh.ulysses > 1 ? AView::sbhd(buf.l_send, B, qr, hq, 1) : lse;
    if (!p.problem.with_lse) l_block = AView{};
    if (p.mesh.ring == 1) {
      params.k_positions = p.kv_layout.block(0);
      kernel_.forward(in.q, in.k, in.v, o_block, l_block, params);
      lap(Phase::compute);
    } else if constexpr (std::is_same_v<T, A>) {
      // The running output can live where it ends (out, or the all-to-all send buffer): no
      // copy at the end. The LSE too, when the caller asked for it.
      ring_forward<T>(p, in.q, buf, params, o_block,
                      l_block.absent() ? AView::sbhd(buf.l_acc, B, qr, hq, 1) : l_block);
    } else {
      const AView o_acc = AView::sbhd(buf.o_acc, B, qr, hq, D), l_acc = AView::sbhd(buf.l_acc, B, qr, hq, 1);
      ring_forward<T>(p, in.q, buf, params, o_acc, l_acc);
      ops_.copy(TensorView<const A, Space>(o_acc), o_block);
      if (!l_block.absent()) ops_.copy(TensorView<const A, Space>(l_acc), l_block);
      lap(Phase::finish);
    }

    if (p.mesh.ulysses > 1) {
      scatter_heads<T>(o_block, p.q_heads, p.q_table, buf.o_send, buf.o_recv, out, nullptr);
      if (p.problem.with_lse) scatter_heads<A>(l_block, p.q_heads, p.lse_table, buf.l_send, buf.l_recv, lse, nullptr);
    }
    clock_.call(call_start_, Pass::forward);
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
    check_plan(p, dtype_v<T>, "backward");
    SEQPAR_CHECK(p.problem.with_lse, ConfigError,
                 "backward: needs the forward's LSE, but the plan's problem has with_lse = false");
    const auto& pr = p.problem;
    check_inputs(p, q, k, v, "backward");
    check_view(dout, "backward: dout", pr.batch, p.local_q(), pr.heads, pr.head_dim, false);
    check_view(out, "backward: out", pr.batch, p.local_q(), pr.heads, pr.head_dim, false);
    check_view(lse, "backward: lse", pr.batch, p.local_q(), pr.heads, 1, false);
    check_view(dq, "backward: dq", pr.batch, p.local_q(), pr.heads, pr.head_dim, true);
    check_view(dk, "backward: dk", pr.batch, p.local_kv(), pr.kv_heads, pr.head_dim, true);
    check_view(dv, "backward: dv", pr.batch, p.local_kv(), pr.kv_heads, pr.head_dim, true);
    check_workspace(workspace, p.backward_workspace_bytes(), "backward");
    start_call(Pass::backward);
    const LocalShape n(p);
    const auto B = pr.batch, D = pr.head_dim;
    const auto qr = to_i(n.qr), kr = to_i(n.kr), hq = to_i(n.hq), hk = to_i(n.hk);
    WorkspaceCarver carver(workspace);
    const BackwardBuffers<T, A> buf = carve_backward<T, A>(carver, p);
    using CView = TensorView<const T, Space>;
    using AView = TensorView<A, Space>;

    const Blocks<T> in = gather_qkv(p, q, k, v, buf.q_send, buf.k_send, buf.v_send, buf.q_block, buf.ring[0]);
    CView dob = dout, ob = out;
    TensorView<const A, Space> lb = lse;
    if (p.mesh.ulysses > 1) {
      dob = gather_heads(dout, p.q_heads, p.q_table, buf.do_send, buf.do_block, qr, hq);
      ob = gather_heads(out, p.q_heads, p.q_table, buf.o_send, buf.o_block, qr, hq);
      lb = gather_heads(lse, p.q_heads, p.lse_table, buf.l_send, buf.l_block, qr, hq);
    }
    const AView dq_acc = AView::sbhd(buf.dq_acc, B, qr, hq, D);
    ops_.fill(dq_acc, A(0));
    lap(Phase::pack);
    const A* own_grad = ring_backward<T>(p, in, dob, ob, lb, buf, dq_acc);

    const AView dk_block = AView::sbhd(const_cast<A*>(own_grad), B, kr, hk, D);
    const AView dv_block = AView::sbhd(const_cast<A*>(own_grad) + n.kr * n.B * n.hk * n.D, B, kr, hk, D);
    if (p.mesh.ulysses > 1) {
      scatter_heads<T>(dq_acc, p.q_heads, p.q_table, buf.dq_send, buf.dq_recv, dq, nullptr);
      scatter_heads<T>(dk_block, p.kv_heads, p.kv_table, buf.dk_send, buf.dk_recv, dk, buf.dk_sum);
      scatter_heads<T>(dv_block, p.kv_heads, p.kv_table, buf.dv_send, buf.dv_recv, dv, buf.dv_sum);
    } else {
      ops_.copy(TensorView<const A, Space>(dq_acc), dq);
      ops_.copy(TensorView<const A, Space>(dk_block), dk);
      ops_.copy(TensorView<const A, Space>(dv_block), dv);
      lap(Phase::finish);
    }
    clock_.call(call_start_, Pass::backward);
  }

  /// The world communicator.
  Comm& world() { return world_; }
  /// This rank's Ulysses group.
  Comm& ulysses_comm() { return ulysses_; }
  /// This rank's ring group.
  Comm& ring_comm() { return ring_; }
  /// The local kernel.
  Kernel& kernel() { return kernel_; }
  /// The resolved mesh.
  const MeshConfig& mesh() const { return mesh_; }
  /// Packing, merge and fill operations (on CUDA: they carry the stream).
  TensorOps<Space>& ops() { return ops_; }
  /// Records the phases of later calls into `profile` (nullptr: stop).
  void set_profile(PhaseProfile* profile) { clock_.set(profile); }
  /// The profile set, or nullptr.
  PhaseProfile* profile() const { return clock_.get(); }

 private:
  static MeshConfig agree_on_mesh(Comm& world, const MeshConfig& request) {
    const std::int64_t mine[5] = {request.ulysses, request.ring, static_cast<std::int64_t>(request.placement),
                                  static_cast<std::int64_t>(request.layout), request.anything};
    const int n = world.size();
    std::vector<std::int64_t> all(static_cast<std::size_t>(5 * n));
    world.all_gather_host(mine, all);
    --world.stats().host_gathers;  // set-up, not per-call metadata
    static constexpr const char* names[5] = {"ulysses_degree", "ring_degree", "placement", "layout", "anything"};
    for (int f = 0; f < 5; ++f)
      for (int w = 1; w < n; ++w)
        SEQPAR_CHECK(all[w * 5 + f] == all[f], ConfigError, "SequenceParallelAttention: ranks disagree on ",
                     names[f], ": rank 0 has ", all[f], ", rank ", w, " has ", all[w * 5 + f]);
    return resolve_mesh(request, n);
  }

  void validate(const std::vector<std::int64_t>& all, int world) const {
    for (int f = 0; f < plan_agreed_fields; ++f) {
      const std::string who = disagreement(all, world, f);
      SEQPAR_CHECK(who.empty(), ConfigError, "plan: ranks disagree on ", plan_field_names[f], ": rank 0 has ", all[f],
                   ", ", who);
    }
    const std::int64_t B = all[f_batch], H = all[f_heads], K = all[f_kv_heads], D = all[f_head_dim];
    SEQPAR_CHECK_ARG(B >= 0, "plan: batch", ">= 0", B);
    SEQPAR_CHECK_ARG(H >= 1, "plan: heads", ">= 1", H);
    SEQPAR_CHECK_ARG(K >= 1 && H % K == 0, "plan: kv_heads", "a divisor of heads " + std::to_string(H), K);
    SEQPAR_CHECK_ARG(D >= 1, "plan: head_dim", ">= 1", D);
    for (int w = 0; w < world; ++w) {
      SEQPAR_CHECK(all[w * f_count + f_q_len] >= 0 && all[w * f_count + f_kv_len] >= 0, ConfigError,
                   "plan: rank ", w, " gives negative local lengths (q ", all[w * f_count + f_q_len], ", kv ",
                   all[w * f_count + f_kv_len], ")");
    }
    if (mesh_.anything) return;
    const std::string fix = std::string("; use AnythingPolicy<") + mesh_.policy + "<...>> for any shape";
    for (int w = 0; w < world; ++w) {
      const std::int64_t lq = all[w * f_count + f_q_len], lk = all[w * f_count + f_kv_len];
      SEQPAR_CHECK(lq == all[f_q_len], ConfigError, "plan: ", mesh_.policy, " needs the same local length on every rank ",
                   "(global length divisible by the world size ", world, "): rank 0 holds ", all[f_q_len],
                   " tokens, rank ", w, " holds ", lq, fix);
      SEQPAR_CHECK(lk == lq, ConfigError, "plan: ", mesh_.policy, " needs kv_len == q_len, rank ", w, " has q ", lq,
                   " kv ", lk, " (joint and cross attention need AnythingPolicy)", fix);
    }
    SEQPAR_CHECK(H % mesh_.ulysses == 0, ConfigError, "plan: ", mesh_.policy, " needs heads divisible by the Ulysses degree: heads ",
                 H, ", ulysses_degree ", mesh_.ulysses, fix);
    SEQPAR_CHECK(mesh_.layout != LayoutKind::zigzag || (all[f_q_len] * mesh_.ulysses) % 2 == 0, ConfigError, "plan: ",
                 mesh_.policy, " with the zigzag layout needs an even ring block length, got ",
                 all[f_q_len] * mesh_.ulysses, fix);
  }

  static std::int64_t to_i(std::size_t x) { return static_cast<std::int64_t>(x); }

  void check_plan(const Plan& p, DType dtype, const char* call) const {
    SEQPAR_CHECK(dtype == p.problem.dtype, ConfigError, call, ": element type: the plan was made for ",
                 dtype_name(p.problem.dtype), ", got ", dtype_name(dtype));
    SEQPAR_CHECK(p.world_rank == world_.rank() && p.mesh.ulysses == mesh_.ulysses && p.mesh.ring == mesh_.ring,
                 ConfigError, call, ": the plan was made by another SequenceParallelAttention");
  }

  static void check_workspace(std::span<std::byte> workspace, std::size_t need, const char* call) {
    SEQPAR_CHECK(workspace.data() != nullptr || workspace.empty(), ConfigError, call,
                 ": workspace: null data pointer with a size of ", workspace.size(), " bytes");
    SEQPAR_CHECK(workspace.size() >= need, ConfigError, call, ": workspace: expected at least ", need,
                 " bytes (plan.", call == std::string_view("forward") ? "workspace_bytes()" : "backward_workspace_bytes()",
                 "), got ", workspace.size());
  }

  template <class T>
  void check_inputs(const Plan& p, TensorView<const T, Space> q, TensorView<const T, Space> k,
                    TensorView<const T, Space> v, const std::string& call) const {
    const auto& pr = p.problem;
    check_view(q, call + ": q", pr.batch, p.local_q(), pr.heads, pr.head_dim, false);
    check_view(k, call + ": k", pr.batch, p.local_kv(), pr.kv_heads, pr.head_dim, false);
    check_view(v, call + ": v", pr.batch, p.local_kv(), pr.kv_heads, pr.head_dim, false);
  }

  KernelParams kernel_params(const Plan& p) const {
    KernelParams params;
    params.scale = p.problem.softmax_scale();
    params.causal = p.problem.causal;
    params.q_positions = p.q_layout.block(p.ring_rank);
    params.group_size = p.problem.heads / p.problem.kv_heads;
    params.q_head_begin = p.q_heads[p.ulysses_rank].begin;
    params.kv_head_begin = p.kv_heads[p.ulysses_rank].begin;
    return params;
  }

  /// Q, K, V of this rank's heads over its whole ring block.
  template <class T>
  struct Blocks {
    TensorView<const T, Space> q, k, v;
  };

  /// Step 1 of the file comment. K and V land in ring buffer `kv` ([K | V]) whenever they
  /// will travel the ring; with neither Ulysses nor ring the caller's tensors are used as is.
  template <class T>
  Blocks<T> gather_qkv(const Plan& p, TensorView<const T, Space> q, TensorView<const T, Space> k,
                       TensorView<const T, Space> v, T* q_send, T* k_send, T* v_send, T* q_block, T* kv) {
    const LocalShape n(p);
    const auto B = p.problem.batch, D = p.problem.head_dim;
    const auto qr = to_i(n.qr), kr = to_i(n.kr), hq = to_i(n.hq), hk = to_i(n.hk);
    const std::size_t k_elems = n.kr * n.B * n.hk * n.D;
    using View = TensorView<T, Space>;
    if (p.mesh.ulysses > 1) {
      return {gather_heads(q, p.q_heads, p.q_table, q_send, q_block, qr, hq),
              gather_heads(k, p.kv_heads, p.kv_table, k_send, kv, kr, hk),
              gather_heads(v, p.kv_heads, p.kv_table, v_send, kv + k_elems, kr, hk)};
    }
    if (p.mesh.ring > 1) {
      ops_.copy(k, View::sbhd(kv, B, kr, hk, D));
      ops_.copy(v, View::sbhd(kv + k_elems, B, kr, hk, D));
      lap(Phase::pack);
      return {q, TensorView<const T, Space>::sbhd(kv, B, kr, hk, D),
              TensorView<const T, Space>::sbhd(kv + k_elems, B, kr, hk, D)};
    }
    return {q, k, v};
  }

  /// Ulysses all-to-all: sends each member its heads of my tokens, returns my heads of the
  /// whole ring block. Pieces are packed [seq, batch, heads, dim] so that the received pieces,
  /// back to back, form the block as one strided view.
  template <class E>
  TensorView<const E, Space> gather_heads(TensorView<const E, Space> x, const std::vector<HeadRange>& heads,
                                          const AllToAllTable& t, E* send, E* block, std::int64_t rows,
                                          std::int64_t nheads) {
    for (std::size_t m = 0; m < heads.size(); ++m)
      ops_.copy(x.slice_heads(heads[m].begin, heads[m].count),
                TensorView<E, Space>::sbhd(send + t.send_displs[m] / sizeof(E), x.batch(), x.seq(), heads[m].count,
                                           x.dim()));
    lap(Phase::pack);
    exchange(ulysses_, send, t, block, false);
    lap(Phase::all_to_all_in);
    return TensorView<const E, Space>::sbhd(block, x.batch(), rows, nheads, x.dim());
  }

  /// The reverse trip: `block` (my heads of the whole ring block, any element type) goes
  /// back as E, and each member's heads of my tokens land in `out`. With `sum` (an [B, L,
  /// heads, D] scratch in the accumulation type) pieces of the same head from different
  /// members add up: K/V heads that several members' query heads share.
  template <class E, class S>
  void scatter_heads(TensorView<S, Space> block, const std::vector<HeadRange>& heads, const AllToAllTable& t, E* send,
                     E* recv, TensorView<E, Space> out, acc_t<E>* sum) {
    // Forward computes straight into `send` when the types agree: nothing to copy then.
    if (!std::is_same_v<S, E> || static_cast<const void*>(block.data) != static_cast<const void*>(send) ||
        block.stride != TensorView<E, Space>::sbhd(send, block.batch(), block.seq(), block.heads(), block.dim()).stride)
      ops_.copy(TensorView<const S, Space>(block),
                TensorView<E, Space>::sbhd(send, block.batch(), block.seq(), block.heads(), block.dim()));
    lap(Phase::finish);
    exchange(ulysses_, send, t, recv, true);
    lap(Phase::all_to_all_out);
    using AView = TensorView<acc_t<E>, Space>;
    const AView total = sum ? AView::bshd(sum, out.batch(), out.seq(), out.heads(), out.dim()) : AView{};
    if (sum) ops_.fill(total, acc_t<E>(0));
    for (std::size_t m = 0; m < heads.size(); ++m) {
      const auto piece = TensorView<const E, Space>::sbhd(recv + t.send_displs[m] / sizeof(E), out.batch(), out.seq(),
                                                          heads[m].count, out.dim());
      if (sum)
        ops_.accumulate(piece, total.slice_heads(heads[m].begin, heads[m].count));
      else
        ops_.copy(piece, out.slice_heads(heads[m].begin, heads[m].count));
    }
    if (sum) ops_.copy(TensorView<const acc_t<E>, Space>(total), out);
    lap(Phase::unpack);
  }

  template <class E>
  void exchange(Comm& c, const E* send, const AllToAllTable& t, E* recv, bool reversed) {
    const auto* s = reinterpret_cast<const std::byte*>(send);
    auto* d = reinterpret_cast<std::byte*>(recv);
    if (reversed)
      c.all_to_all_v(s, t.recv_counts, t.recv_displs, d, t.send_counts, t.send_displs);
    else
      c.all_to_all_v(s, t.send_counts, t.send_displs, d, t.recv_counts, t.recv_displs);
  }

  /// Starts the ring hop of `elems(src)`-sized buffers: mine to the next rank, the previous
  /// rank's into `into`. Both sides know every block's size from the plan.
  template <class E>
  typename Comm::request_type ring_hop(const Plan& p, const E* from, int src, E* into, std::size_t per_token) {
    const int R = p.mesh.ring, r = p.ring_rank;
    const auto bytes = [&](int block) {
      return sizeof(E) * 2 * static_cast<std::size_t>(p.kv_layout.block(block).size()) * per_token;
    };
    return ring_.start_exchange(reinterpret_cast<const std::byte*>(from), bytes(src), (r + 1) % R,
                                reinterpret_cast<std::byte*>(into), bytes((src - 1 + R) % R), (r - 1 + R) % R);
  }

  /// The ring loop of forward: the running output and LSE end in o_acc, l_acc. The first
  /// step that computes writes them directly (no zeroing, no merge); later steps compute into
  /// the step buffers and merge.
  template <class T, class A>
  void ring_forward(const Plan& p, TensorView<const T, Space> qb, const ForwardBuffers<T, A>& buf,
                    KernelParams params, TensorView<A, Space> o_acc, TensorView<A, Space> l_acc) {
    const int R = p.mesh.ring, r = p.ring_rank;
    const LocalShape n(p);
    const auto B = p.problem.batch, D = p.problem.head_dim, hk = to_i(n.hk);
    using AView = TensorView<A, Space>;
    const AView o_part = AView::sbhd(buf.o_part, o_acc.batch(), o_acc.seq(), o_acc.heads(), D);
    const AView l_part = AView::sbhd(buf.l_part, o_acc.batch(), o_acc.seq(), o_acc.heads(), 1);
    T* cur = buf.ring[0];
    T* nxt = buf.ring[1];
    bool empty = true;  // no step has written o_acc yet
    for (int s = 0; s < R; ++s) {
      const int src = (r - s + R) % R;
      const std::int64_t kb = p.kv_layout.block(src).size();
      Hop hop;
      if (s + 1 < R) hop.start(*this, ring_hop(p, cur, src, nxt, n.B * n.hk * n.D), s);
      if (p.ring_step_computes[s]) {
        params.k_positions = p.kv_layout.block(src);
        compute_forward(qb, TensorView<const T, Space>::sbhd(cur, B, kb, hk, D),
                        TensorView<const T, Space>::sbhd(cur + kb * B * hk * D, B, kb, hk, D),
                        empty ? o_acc : o_part, empty ? l_acc : l_part, params, hop);
        lap(Phase::compute, s);
        if (!empty) {
          ops_.merge(o_acc, l_acc, TensorView<const A, Space>(o_part), TensorView<const A, Space>(l_part));
          lap(Phase::merge, s);
        }
        empty = false;
      }
      if (s + 1 < R) {
        hop.finish(*this);
        std::swap(cur, nxt);
      }
    }
    if (empty) {  // no key block reached any of my queries
      ops_.fill(o_acc, A(0));
      ops_.fill(l_acc, -std::numeric_limits<A>::infinity());
      lap(Phase::finish);
    }
  }

  /// True when the communicator can make progress on a started exchange without blocking.
  static constexpr bool can_poll = requires(Comm& c, typename Comm::request_type& r) {
    { c.test(r) } -> std::convertible_to<bool>;
  };

  /// One ring hop in flight: started, maybe seen complete by a progress poll, then waited.
  struct Hop {
    typename Comm::request_type req{};
    PhaseClock::time_point started{}, done{};
    int step = -1;    // -1: no hop
    bool complete = false;

    void start(MeshEngine& e, typename Comm::request_type&& r, int s) {
      started = e.clock_.now();
      req = std::move(r);
      step = s;
      e.lap(Phase::wait, s);  // posting the hop is communication, charged with its wait
    }
    /// Lets the communicator move bytes while the rank computes; true once the hop is done.
    bool poll(MeshEngine& e) {
      if constexpr (can_poll) {
        if (step >= 0 && !complete && e.ring_.test(req)) {
          complete = true;
          done = e.clock_.now();
        }
      }
      return step < 0 || complete;
    }
    void finish(MeshEngine& e) {
      e.ring_.wait(req);
      e.lap(Phase::wait, step);
      e.clock_.hop(e.pass_, step, started, complete ? done : e.mark_);
    }
  };

  /// Progress polls per ring step while a hop is in flight: a communicator with test() (MPI)
  /// may move a large message only when called, so the kernel runs in up to this many
  /// chunks of heads with a poll after each. Every head is computed on its own whatever the
  /// chunk, so the bits do not change. Polling stops once the hops are done.
  static constexpr std::int64_t progress_chunks = 8;

  /// Runs `run(first, count)` over `units` heads: in one call, or, while `a` (or `b`) is in
  /// flight on a communicator that can poll, in chunks with a poll after each.
  template <class Run>
  void compute_polling(std::int64_t units, Run run, Hop& a, Hop* b = nullptr) {
    auto done = [&] {
      const bool da = a.poll(*this), db = b ? b->poll(*this) : true;  // poll both, always
      return da && db;
    };
    const std::int64_t chunk = std::max<std::int64_t>(1, (units + progress_chunks - 1) / progress_chunks);
    std::int64_t h = 0;
    if constexpr (can_poll)
      for (; h < units && !done(); h += std::min(chunk, units - h)) run(h, std::min(chunk, units - h));
    if (h < units) run(h, units - h);
  }

  /// kernel_.forward with progress polls (compute_polling over query heads).
  template <class T, class O>
  void compute_forward(TensorView<const T, Space> q, TensorView<const T, Space> k, TensorView<const T, Space> v,
                       TensorView<O, Space> o, TensorView<acc_t<T>, Space> l, const KernelParams& params, Hop& hop) {
    compute_polling(q.heads(), [&](std::int64_t h, std::int64_t c) {
      KernelParams part = params;
      part.q_head_begin += h;
      if (c == q.heads())
        kernel_.forward(q, k, v, o, l, params);
      else
        kernel_.forward(q.slice_heads(h, c), k, v, o.slice_heads(h, c), l.slice_heads(h, c), part);
    }, hop);
  }

  /// Ring backward; returns the buffer holding this rank's own block's [dK | dV] (the sum of
  /// every rank's contributions). Each block's gradient accumulator follows the block one hop
  /// behind: step s computes into a zeroed `grad_part` while the accumulator of the same block
  /// is still arriving from the previous rank, then adds it in and sends it on, so the hop
  /// overlaps the compute. After the last step the hop brings each block home. With R == 1
  /// it is one local kernel call.
  template <class T, class A>
  const A* ring_backward(const Plan& p, const Blocks<T>& in, TensorView<const T, Space> dob,
                         TensorView<const T, Space> ob, TensorView<const A, Space> lb,
                         const BackwardBuffers<T, A>& buf, TensorView<A, Space> dq_acc) {
    const int R = p.mesh.ring, r = p.ring_rank;
    const LocalShape n(p);
    const auto B = p.problem.batch, D = p.problem.head_dim, hk = to_i(n.hk);
    KernelParams params = kernel_params(p);
    using CView = TensorView<const T, Space>;
    using AView = TensorView<A, Space>;
    const std::size_t per_token = n.B * n.hk * n.D;
    auto grad_view = [&](A* g, std::int64_t kb) { return AView::sbhd(g, B, 2 * kb, hk, D); };
    // Chunks of K/V heads own their dK/dV and their query heads' dQ, so chunking (for
    // progress polls) changes no bit.
    auto compute = [&](const T* kv, std::int64_t kb, int src, A* grad, Hop& a, Hop* b) {
      const std::size_t k_elems = static_cast<std::size_t>(kb) * per_token;
      params.k_positions = p.kv_layout.block(src);
      const CView k = R > 1 ? CView::sbhd(kv, B, kb, hk, D) : in.k, v = R > 1 ? CView::sbhd(kv + k_elems, B, kb, hk, D) : in.v;
      const AView dk = AView::sbhd(grad, B, kb, hk, D), dv = AView::sbhd(grad + k_elems, B, kb, hk, D);
      compute_polling(hk, [&](std::int64_t j, std::int64_t c) {
        if (c == hk) return kernel_.backward(dob, in.q, k, v, ob, lb, dq_acc, dk, dv, params);
        const std::int64_t G = params.group_size, hq = in.q.heads();
        const std::int64_t h0 = std::max<std::int64_t>(0, (params.kv_head_begin + j) * G - params.q_head_begin);
        const std::int64_t h1 = std::min<std::int64_t>(hq, (params.kv_head_begin + j + c) * G - params.q_head_begin);
        KernelParams part = params;
        part.q_head_begin += h0;
        part.kv_head_begin += j;
        kernel_.backward(dob.slice_heads(h0, h1 - h0), in.q.slice_heads(h0, h1 - h0), k.slice_heads(j, c),
                         v.slice_heads(j, c), ob.slice_heads(h0, h1 - h0), lb.slice_heads(h0, h1 - h0),
                         dq_acc.slice_heads(h0, h1 - h0), dk.slice_heads(j, c), dv.slice_heads(j, c), part);
      }, a, b);
    };
    A* g_cur = buf.grad[0];
    ops_.fill(grad_view(g_cur, to_i(n.kr)), A(0));
    lap(Phase::pack);
    if (R == 1) {
      Hop none;
      if (p.ring_step_computes[0]) compute(in.k.data, to_i(n.kr), r, g_cur, none, nullptr);
      lap(Phase::compute);
      return g_cur;
    }
    T* cur = buf.ring[0];
    T* nxt = buf.ring[1];
    A* g_nxt = buf.grad[1];
    Hop g_hop;
    for (int s = 0; s < R; ++s) {
      const int src = (r - s + R) % R;
      const std::int64_t kb = p.kv_layout.block(src).size();
      Hop kv_hop;
      if (s + 1 < R) kv_hop.start(*this, ring_hop(p, cur, src, nxt, per_token), s);
      if (s == 0) {
        if (p.ring_step_computes[s]) compute(cur, kb, src, g_cur, kv_hop, nullptr);
        lap(Phase::compute, s);
      } else {
        // Requests to one peer complete in the order they started: the gradient hop first.
        const bool computes = p.ring_step_computes[s];
        if (computes) {
          ops_.fill(grad_view(buf.grad_part, kb), A(0));
          lap(Phase::pack, s);
          compute(cur, kb, src, buf.grad_part, kv_hop, &g_hop);
          lap(Phase::compute, s);
        }
        g_hop.finish(*this);
        std::swap(g_cur, g_nxt);
        if (computes) {
          ops_.accumulate(TensorView<const A, Space>(grad_view(buf.grad_part, kb)), grad_view(g_cur, kb));
          lap(Phase::merge, s);
        }
      }
      g_hop = Hop{};
      g_hop.start(*this, ring_hop(p, g_cur, src, g_nxt, per_token), s);
      if (s + 1 < R) {
        kv_hop.finish(*this);
        std::swap(cur, nxt);
      }
    }
    g_hop.finish(*this);
    return g_nxt;
  }

  /// Starts timing a call of `pass` (a no-op without a profile).
  void start_call(Pass pass) {
    pass_ = pass;
    mark_ = call_start_ = clock_.now();
  }
  /// Charges the time since the last lap to `phase` at ring step `step`.
  void lap(Phase phase, int step = 0) { mark_ = clock_.lap(mark_, pass_, phase, step); }

  Comm& world_;
  MeshConfig mesh_;
  Kernel kernel_;
  Comm ulysses_;
  Comm ring_;
  TensorOps<Space> ops_;
  PhaseClock clock_;
  Pass pass_ = Pass::forward;
  PhaseClock::time_point call_start_{}, mark_{};
};

}  // namespace seqpar::detail
