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
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/workspace.hpp"
#include "seqpar/kernel/host_ops.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"

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

/// The buffers forward carves from the workspace. Phase-1 send buffers and phase-3 return
/// buffers are never live together, so they share bytes.
template <class T, class A>
struct MeshBuffers {
  T* q_block = nullptr;            // [Qr, B, hq, D] gathered queries (U > 1)
  T* ring[2] = {nullptr, nullptr}; // [K | V] blocks, each [Kb, B, hk, D]
  A* o_acc = nullptr;              // running output [Qr, B, hq, D] (R > 1)
  A* l_acc = nullptr;              // running LSE [Qr, B, hq]
  A* o_part = nullptr;             // one step's output
  A* l_part = nullptr;             // one step's LSE
  T* q_send = nullptr;             // phase 1 packing
  T* k_send = nullptr;
  T* v_send = nullptr;
  T* o_send = nullptr;  // phase 3: [Qr, B, hq, D]
  A* l_send = nullptr;  // [Qr, B, hq]
  T* o_recv = nullptr;  // [Lq, B, H, D] pieces
  A* l_recv = nullptr;
};

/// Carves the buffers; with a sizing carver it only counts bytes.
template <class T, class A>
MeshBuffers<T, A> carve_buffers(WorkspaceCarver& c, const Plan& p) {
  MeshBuffers<T, A> buf;
  const int U = p.mesh.ulysses, R = p.mesh.ring, r = p.ring_rank, u = p.ulysses_rank;
  const auto B = static_cast<std::size_t>(p.problem.batch), D = static_cast<std::size_t>(p.problem.head_dim);
  const auto H = static_cast<std::size_t>(p.problem.heads);
  const auto hq = static_cast<std::size_t>(p.q_heads[u].count), hk = static_cast<std::size_t>(p.kv_heads[u].count);
  std::size_t qr = 0, kr = 0;
  for (int v = 0; v < U; ++v) {
    qr += static_cast<std::size_t>(p.q_layout.length(r, v));
    kr += static_cast<std::size_t>(p.kv_layout.length(r, v));
  }
  if (U > 1) buf.q_block = c.take<T>(qr * B * hq * D);
  if (R > 1) {
    const std::size_t kv = 2 * static_cast<std::size_t>(p.max_kv_block) * B * hk * D;
    buf.ring[0] = c.take<T>(kv);
    buf.ring[1] = c.take<T>(kv);
    buf.o_acc = c.take<A>(qr * B * hq * D);
    buf.o_part = c.take<A>(qr * B * hq * D);
    buf.l_acc = c.take<A>(qr * B * hq);
    buf.l_part = c.take<A>(qr * B * hq);
  } else if (U > 1) {
    buf.ring[0] = c.take<T>(2 * kr * B * hk * D);
  }
  if (U > 1) {
    const auto lq = static_cast<std::size_t>(p.local_q()), lk = static_cast<std::size_t>(p.local_kv());
    std::size_t kv_sent = 0;
    for (int v = 0; v < U; ++v) kv_sent += static_cast<std::size_t>(p.kv_heads[v].count);
    const std::size_t start = c.mark();
    buf.q_send = c.take<T>(lq * B * H * D);
    buf.k_send = c.take<T>(lk * B * kv_sent * D);
    buf.v_send = c.take<T>(lk * B * kv_sent * D);
    const std::size_t end1 = c.mark();
    c.rewind(start);
    buf.o_send = c.take<T>(qr * B * hq * D);
    buf.l_send = c.take<A>(qr * B * hq);
    buf.o_recv = c.take<T>(lq * B * H * D);
    buf.l_recv = c.take<A>(lq * B * H);
    if (c.mark() < end1) c.rewind(end1);
  }
  return buf;
}

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

  /// Collective: all ranks check that they agree on the mesh, then split the world.
  MeshEngine(Comm& world, MeshConfig mesh, Kernel kernel)
      : world_(world), mesh_(mesh), kernel_(std::move(kernel)),
        ulysses_(split_checked(world, mesh)), ring_(world.split(mesh.ulysses_rank(world.rank()), mesh.ring_rank(world.rank()))) {}

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

    for (int src = 0; src < R; ++src) {
      std::int64_t block = 0;
      for (int v = 0; v < U; ++v) block += p.kv_layout.length(src, v);
      p.max_kv_block = std::max(p.max_kv_block, block);
    }
    const PositionMap& qb = p.q_layout.block(r);
    for (int s = 0; s < R; ++s) {
      const PositionMap& kb = p.kv_layout.block((r - s + R) % R);
      const bool any = qb.size() > 0 && kb.size() > 0 && nq(u) > 0 && B > 0 &&
                       !(problem.causal && kb.first() > qb.last());
      p.ring_step_computes.push_back(any);
    }

    WorkspaceCarver sizing;
    if (problem.dtype == DType::f64)
      carve_buffers<double, double>(sizing, p);
    else if (problem.dtype == DType::f32)
      carve_buffers<float, float>(sizing, p);
    else
      carve_buffers<std::uint16_t, float>(sizing, p);  // 2-byte types: same sizes
    p.workspace = sizing.bytes_needed();
    if constexpr (requires { kernel_.prepare(std::int64_t{}); }) kernel_.prepare(problem.head_dim);
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
    check_call(p, q, k, v, out, lse, dtype_v<T>);
    const int U = p.mesh.ulysses, R = p.mesh.ring, r = p.ring_rank, u = p.ulysses_rank;
    const std::int64_t B = p.problem.batch, D = p.problem.head_dim;
    const std::int64_t hq = p.q_heads[u].count, hk = p.kv_heads[u].count;
    std::int64_t qr = 0, kr = 0;
    for (int m = 0; m < U; ++m) {
      qr += p.q_layout.length(r, m);
      kr += p.kv_layout.length(r, m);
    }
    WorkspaceCarver carver(workspace);
    const MeshBuffers<T, A> buf = carve_buffers<T, A>(carver, p);
    using CView = TensorView<const T, Space>;
    using View = TensorView<T, Space>;
    using AView = TensorView<A, Space>;

    // 1. This rank's heads of its whole ring block.
    CView qb = q, kb = k, vb = v;
    if (U > 1) {
      pack_heads(q, p.q_heads, p.q_table, buf.q_send);
      pack_heads(k, p.kv_heads, p.kv_table, buf.k_send);
      pack_heads(v, p.kv_heads, p.kv_table, buf.v_send);
      const std::size_t k_elems = static_cast<std::size_t>(kr * B * hk * D);
      exchange(ulysses_, buf.q_send, p.q_table, buf.q_block, false);
      exchange(ulysses_, buf.k_send, p.kv_table, buf.ring[0], false);
      exchange(ulysses_, buf.v_send, p.kv_table, buf.ring[0] + k_elems, false);
      qb = CView::sbhd(buf.q_block, B, qr, hq, D);
      kb = CView::sbhd(buf.ring[0], B, kr, hk, D);
      vb = CView::sbhd(buf.ring[0] + k_elems, B, kr, hk, D);
    } else if (R > 1) {
      const std::size_t k_elems = static_cast<std::size_t>(kr * B * hk * D);
      ops_.copy(k, View::sbhd(buf.ring[0], B, kr, hk, D));
      ops_.copy(v, View::sbhd(buf.ring[0] + k_elems, B, kr, hk, D));
    }

    KernelParams params;
    params.scale = p.problem.softmax_scale();
    params.causal = p.problem.causal;
    params.q_positions = p.q_layout.block(r);
    params.group_size = p.problem.heads / p.problem.kv_heads;
    params.q_head_begin = p.q_heads[u].begin;
    params.kv_head_begin = p.kv_heads[u].begin;

    // 2. Attention of the block against every K/V block.
    View o_block = U > 1 ? View::sbhd(buf.o_send, B, qr, hq, D) : out;
    AView l_block = U > 1 ? AView::sbhd(buf.l_send, B, qr, hq, 1) : lse;
    if (!p.problem.with_lse) l_block = AView{};
    if (R == 1) {
      params.k_positions = p.kv_layout.block(0);
      kernel_.forward(qb, kb, vb, o_block, l_block, params);
    } else {
      ring_forward<T>(p, qb, buf, params, qr, hq, hk);
      const AView o_acc = AView::sbhd(buf.o_acc, B, qr, hq, D), l_acc = AView::sbhd(buf.l_acc, B, qr, hq, 1);
      ops_.copy(TensorView<const A, Space>(o_acc), o_block);
      if (!l_block.absent()) ops_.copy(TensorView<const A, Space>(l_acc), l_block);
    }

    // 3. Back to "all heads, my tokens".
    if (U > 1) {
      exchange(ulysses_, buf.o_send, p.q_table, buf.o_recv, true);
      unpack_heads(buf.o_recv, p.q_heads, p.q_table, out);
      if (p.problem.with_lse) {
        exchange(ulysses_, buf.l_send, p.lse_table, buf.l_recv, true);
        unpack_heads(buf.l_recv, p.q_heads, p.lse_table, lse);
      }
    }
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

 private:
  static Comm split_checked(Comm& world, const MeshConfig& mesh) {
    const std::int64_t mine[5] = {mesh.ulysses, mesh.ring, static_cast<std::int64_t>(mesh.placement),
                                  static_cast<std::int64_t>(mesh.layout), mesh.anything};
    const int n = world.size();
    std::vector<std::int64_t> all(static_cast<std::size_t>(5 * n));
    world.all_gather_host(mine, all);
    --world.stats().host_gathers;  // set-up, not per-call metadata
    static constexpr const char* names[5] = {"ulysses_degree", "ring_degree", "placement", "layout", "anything"};
    for (int f = 0; f < 5; ++f)
      for (int w = 1; w < n; ++w)
        SEQPAR_CHECK(all[w * 5 + f] == all[f], ConfigError, "SequenceParallelAttention: ranks disagree on ",
                     names[f], ": rank 0 has ", all[f], ", rank ", w, " has ", all[w * 5 + f]);
    SEQPAR_CHECK(mesh.world() == n, ConfigError, mesh.policy, ": ulysses_degree x ring_degree = ", mesh.ulysses, " x ",
                 mesh.ring, " must equal the communicator size ", n);
    const int w = world.rank();
    return world.split(mesh.ring_rank(w), mesh.ulysses_rank(w));
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

  template <class T>
  void check_call(const Plan& p, TensorView<const T, Space> q, TensorView<const T, Space> k,
                  TensorView<const T, Space> v, TensorView<T, Space> out, TensorView<acc_t<T>, Space> lse,
                  DType dtype) const {
    SEQPAR_CHECK(dtype == p.problem.dtype, ConfigError, "forward: element type: the plan was made for ",
                 dtype_name(p.problem.dtype), ", got ", dtype_name(dtype));
    SEQPAR_CHECK(p.world_rank == world_.rank() && p.mesh.ulysses == mesh_.ulysses && p.mesh.ring == mesh_.ring,
                 ConfigError, "forward: the plan was made by another SequenceParallelAttention");
    const auto& pr = p.problem;
    check_view(q, "forward: q", pr.batch, p.local_q(), pr.heads, pr.head_dim, false);
    check_view(k, "forward: k", pr.batch, p.local_kv(), pr.kv_heads, pr.head_dim, false);
    check_view(v, "forward: v", pr.batch, p.local_kv(), pr.kv_heads, pr.head_dim, false);
    check_view(out, "forward: out", pr.batch, p.local_q(), pr.heads, pr.head_dim, true);
    if (pr.with_lse)
      check_view(lse, "forward: lse", pr.batch, p.local_q(), pr.heads, 1, true);
    else
      SEQPAR_CHECK(lse.absent(), ConfigError, "forward: lse given, but the plan's problem has with_lse = false");
  }

  /// Copies each member's heads of the local tokens into its piece of the send buffer.
  template <class T>
  void pack_heads(TensorView<const T, Space> x, const std::vector<HeadRange>& heads, const AllToAllTable& t, T* send) {
    for (std::size_t m = 0; m < heads.size(); ++m) {
      T* dst = send + t.send_displs[m] / sizeof(T);
      ops_.copy(x.slice_heads(heads[m].begin, heads[m].count),
                TensorView<T, Space>::sbhd(dst, x.batch(), x.seq(), heads[m].count, x.dim()));
    }
  }

  /// Copies the pieces received back (each member's heads of my tokens) into the output.
  /// They arrive on the reversed table, so piece m sits at the table's send displacement.
  template <class E>
  void unpack_heads(const E* recv, const std::vector<HeadRange>& heads, const AllToAllTable& t, TensorView<E, Space> out) {
    for (std::size_t m = 0; m < heads.size(); ++m) {
      const E* src = recv + t.send_displs[m] / sizeof(E);
      ops_.copy(TensorView<const E, Space>::sbhd(src, out.batch(), out.seq(), heads[m].count, out.dim()),
                out.slice_heads(heads[m].begin, heads[m].count));
    }
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

  template <class T, class A>
  void ring_forward(const Plan& p, TensorView<const T, Space> qb, const MeshBuffers<T, A>& buf, KernelParams params,
                    std::int64_t qr, std::int64_t hq, std::int64_t hk) {
    const int R = p.mesh.ring, r = p.ring_rank, U = p.mesh.ulysses;
    const std::int64_t B = p.problem.batch, D = p.problem.head_dim;
    using AView = TensorView<A, Space>;
    const AView o_acc = AView::sbhd(buf.o_acc, B, qr, hq, D), l_acc = AView::sbhd(buf.l_acc, B, qr, hq, 1);
    const AView o_part = AView::sbhd(buf.o_part, B, qr, hq, D), l_part = AView::sbhd(buf.l_part, B, qr, hq, 1);
    ops_.fill(o_acc, A(0));
    ops_.fill(l_acc, -std::numeric_limits<A>::infinity());
    auto block_len = [&](int src) {
      std::int64_t n = 0;
      for (int m = 0; m < U; ++m) n += p.kv_layout.length(src, m);
      return n;
    };
    T* cur = buf.ring[0];
    T* nxt = buf.ring[1];
    const int next = (r + 1) % R, prev = (r - 1 + R) % R;
    for (int s = 0; s < R; ++s) {
      const int src = (r - s + R) % R;
      const std::int64_t kb = block_len(src);
      typename Comm::request_type req{};
      if (s + 1 < R) {
        const std::int64_t kn = block_len((src - 1 + R) % R);
        req = ring_.start_exchange(reinterpret_cast<const std::byte*>(cur), sizeof(T) * 2 * kb * B * hk * D, next,
                                   reinterpret_cast<std::byte*>(nxt), sizeof(T) * 2 * kn * B * hk * D, prev);
      }
      if (p.ring_step_computes[s]) {
        const std::size_t k_elems = static_cast<std::size_t>(kb * B * hk * D);
        params.k_positions = p.kv_layout.block(src);
        kernel_.forward(qb, TensorView<const T, Space>::sbhd(cur, B, kb, hk, D),
                        TensorView<const T, Space>::sbhd(cur + k_elems, B, kb, hk, D), o_part, l_part, params);
        ops_.merge(o_acc, l_acc, TensorView<const A, Space>(o_part), TensorView<const A, Space>(l_part));
      }
      if (s + 1 < R) {
        ring_.wait(req);
        std::swap(cur, nxt);
      }
    }
  }

  Comm& world_;
  MeshConfig mesh_;
  Kernel kernel_;
  Comm ulysses_;
  Comm ring_;
  TensorOps<Space> ops_;
};

}  // namespace seqpar::detail
