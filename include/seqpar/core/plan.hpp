#pragma once
/// \file
/// Plan: everything a forward or backward call needs, decided once, collectively, so that the
/// call does no metadata exchange, no host-device sync and no allocation. Users read it
/// (positions, lengths, bytes, workspace sizes, work per rank); the engine's schedule inside
/// it (all-to-all tables, ring steps, workspace slots) is private to the engine.
///
/// One traffic model: the bytes a plan reports are summed from the same all-to-all tables and
/// ring block sizes the engine sends with (exchange_tables, ring_block_elems); the tests hold
/// them against an independent closed form.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "seqpar/core/key_span.hpp"
#include "seqpar/core/mask.hpp"
#include "seqpar/core/mesh.hpp"
#include "seqpar/core/problem.hpp"
#include "seqpar/core/sequence_layout.hpp"
#include "seqpar/core/workspace.hpp"

namespace seqpar {

/// A contiguous range of heads.
struct HeadRange {
  std::int64_t begin = 0;  ///< first head
  std::int64_t count = 0;  ///< number of heads
};

/// Byte counts and displacements of one all-to-all, indexed by peer.
struct AllToAllTable {
  std::vector<std::size_t> send_counts;  ///< bytes sent to each peer
  std::vector<std::size_t> send_displs;  ///< byte offset of each peer's piece in the send buffer
  std::vector<std::size_t> recv_counts;  ///< bytes received from each peer
  std::vector<std::size_t> recv_displs;  ///< byte offset of each peer's piece in the receive buffer

  /// Bytes this rank sends to the others (its own piece stays local).
  std::size_t bytes_sent(int self) const {
    std::size_t n = 0;
    for (std::size_t v = 0; v < send_counts.size(); ++v) n += static_cast<int>(v) == self ? 0 : send_counts[v];
    return n;
  }
  /// Bytes this rank sends on the reverse trip (the same pieces going back).
  std::size_t bytes_returned(int self) const {
    std::size_t n = 0;
    for (std::size_t v = 0; v < recv_counts.size(); ++v) n += static_cast<int>(v) == self ? 0 : recv_counts[v];
    return n;
  }
};

namespace detail {

/// The Ulysses all-to-all tables of one mesh rank: Q (and O back, reversed), K and V, and the
/// LSE (back with O, or out in backward).
struct ExchangeTables {
  AllToAllTable q, kv, lse;
};

/// Named workspace slots of forward and backward (policy/workspace_layout.hpp fills them).
inline constexpr std::size_t forward_slot_count = 14;
inline constexpr std::size_t backward_slot_count = 24;

/// The engine's private schedule: what it sends, which ring steps compute, where buffers live.
struct PlanSchedule {
  ExchangeTables tables;                          ///< this rank's all-to-all tables
  std::vector<unsigned char> ring_step_computes;  ///< per ring step: does any query see a key?
  std::int64_t max_kv_block = 0;                  ///< longest K/V ring block
  WorkspaceLayout<forward_slot_count> forward;    ///< forward's buffers
  WorkspaceLayout<backward_slot_count> backward;  ///< backward's buffers
};

struct PlanAccess;

/// A process-wide id per engine, so that a call can refuse a plan another object made.
inline std::uint64_t next_engine_id() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace detail

/// The result of SequenceParallelAttention::plan: read-only. It answers where tokens live,
/// how much work and traffic a rank has and how much workspace a call needs; forward and
/// backward refuse a plan made by another object.
class Plan {
 public:
  /// An empty plan (forward refuses it); real plans come from SequenceParallelAttention::plan.
  Plan() = default;

  /// The agreed problem (kv_heads resolved).
  const AttentionProblem& problem() const { return problem_; }
  /// The agreed mesh (degrees, placement, layout).
  const MeshConfig& mesh() const { return mesh_; }
  /// This rank in the world.
  int world_rank() const { return world_rank_; }
  /// This rank's ring rank.
  int ring_rank() const { return mesh_.ring_rank(world_rank_); }
  /// This rank's Ulysses rank.
  int ulysses_rank() const { return mesh_.ulysses_rank(world_rank_); }
  /// Global positions of every rank's queries.
  const SequenceLayout& q_layout() const { return q_layout_; }
  /// Global positions of every rank's keys and values.
  const SequenceLayout& kv_layout() const { return kv_layout_; }
  /// Query heads Ulysses rank u computes.
  HeadRange q_heads(int u) const { return q_heads_[static_cast<std::size_t>(u)]; }
  /// K/V heads Ulysses rank u needs (its query heads' groups).
  HeadRange kv_heads(int u) const { return kv_heads_[static_cast<std::size_t>(u)]; }
  /// Bytes of one element of Q, K, V, O.
  std::size_t elem_bytes() const { return elem_bytes_; }
  /// Bytes of one accumulation element (LSE, partial outputs, gradients in flight).
  std::size_t acc_bytes() const { return acc_bytes_; }

  /// Bytes of workspace forward needs (two-phase: size, allocate once, reuse).
  std::size_t workspace_bytes() const { return schedule_.forward.bytes(); }
  /// Bytes of workspace backward needs (training allocates the larger of the two once).
  std::size_t backward_workspace_bytes() const { return schedule_.backward.bytes(); }
  /// Local query tokens of this rank.
  std::int64_t local_q() const { return q_layout_.length(ring_rank(), ulysses_rank()); }
  /// Local K/V tokens of this rank.
  std::int64_t local_kv() const { return kv_layout_.length(ring_rank(), ulysses_rank()); }
  /// Global query length.
  std::int64_t global_q() const { return q_layout_.total(); }
  /// Global K/V length.
  std::int64_t global_kv() const { return kv_layout_.total(); }
  /// Global positions of world rank w's queries.
  PositionMap q_positions(int w) const { return q_layout_.positions(mesh_.ring_rank(w), mesh_.ulysses_rank(w)); }
  /// Global positions of world rank w's keys and values.
  PositionMap kv_positions(int w) const { return kv_layout_.positions(mesh_.ring_rank(w), mesh_.ulysses_rank(w)); }

  /// The mask as kernels see it (causal, window, documents, key padding); it points into
  /// this plan, so it is valid while the plan is.
  MaskView mask() const { return mask_tables_.view(problem_.causal, problem_.window); }
  /// Diagonal positions of ring rank r's queries: their global positions, shifted by
  /// S_kv - S_q under bottom-right alignment (what the mask compares keys with).
  PositionMap q_diagonals(int r) const {
    PositionMap m = q_layout_.block(r);
    if (problem_.causal_align == CausalAlign::bottom_right)
      for (int s = 0; s < m.segments; ++s) m.seg[s].start += global_kv() - global_q();
    return m;
  }

  /// Score elements (visible query-key pairs under the mask, times batch and heads) world rank
  /// w computes: the measure of load balance.
  std::int64_t work(int w) const {
    const int r = mesh_.ring_rank(w), u = mesh_.ulysses_rank(w);
    const MaskView m = mask();
    // Only key padding and per-batch documents make batch elements differ.
    const bool per_batch = m.kv_valid != nullptr || m.doc_batch_stride > 0;
    std::int64_t pairs = 0;
    for (std::int64_t b = 0; b < (per_batch ? problem_.batch : std::min<std::int64_t>(problem_.batch, 1)); ++b)
      for (int src = 0; src < mesh_.ring; ++src)
        pairs += visible_pairs(m, b, q_diagonals(r), kv_layout_.block(src));
    return pairs * (per_batch ? 1 : problem_.batch) * q_heads(u).count;
  }

  /// Bytes world rank w sends to other ranks in one forward: Q, K, V out and O (and the LSE)
  /// back over the Ulysses tables, K/V blocks R-1 hops round the ring.
  std::size_t forward_bytes(int w) const {
    const int u = mesh_.ulysses_rank(w);
    const detail::ExchangeTables t = exchange_tables(mesh_.ring_rank(w), u);
    const std::size_t lse = problem_.with_lse ? t.lse.bytes_returned(u) : 0;
    return t.q.bytes_sent(u) + 2 * t.kv.bytes_sent(u) + t.q.bytes_returned(u) + lse +
           ring_bytes(w, mesh_.ring - 1, elem_bytes_);
  }

  /// Bytes world rank w sends in one backward: Q, O, dO, the LSE, K and V out and dQ, dK, dV
  /// back over the Ulysses tables; the ring passes K/V R-1 hops and every block's dK/dV (in
  /// the accumulation type) R hops, the last one home.
  std::size_t backward_bytes(int w) const {
    const int u = mesh_.ulysses_rank(w);
    const detail::ExchangeTables t = exchange_tables(mesh_.ring_rank(w), u);
    return 3 * t.q.bytes_sent(u) + t.lse.bytes_sent(u) + 2 * t.kv.bytes_sent(u) + t.q.bytes_returned(u) +
           2 * t.kv.bytes_returned(u) + ring_bytes(w, mesh_.ring - 1, elem_bytes_) +
           ring_bytes(w, mesh_.ring, acc_bytes_);
  }

 private:
  friend struct detail::PlanAccess;

  /// The all-to-all tables of mesh rank (r, u): it sends member v v's heads of its tokens and
  /// receives its heads of v's tokens; pieces back to back in member order.
  detail::ExchangeTables exchange_tables(int r, int u) const {
    const int U = mesh_.ulysses;
    const auto B = static_cast<std::size_t>(problem_.batch), D = static_cast<std::size_t>(problem_.head_dim);
    auto table = [&](const SequenceLayout& l, const std::vector<HeadRange>& heads, std::size_t per_row) {
      AllToAllTable t;
      std::size_t so = 0, ro = 0;
      for (int v = 0; v < U; ++v) {
        const std::size_t s = static_cast<std::size_t>(l.length(r, u)) * B *
                              static_cast<std::size_t>(heads[static_cast<std::size_t>(v)].count) * per_row;
        const std::size_t rc = static_cast<std::size_t>(l.length(r, v)) * B *
                               static_cast<std::size_t>(heads[static_cast<std::size_t>(u)].count) * per_row;
        t.send_counts.push_back(s);
        t.send_displs.push_back(so);
        t.recv_counts.push_back(rc);
        t.recv_displs.push_back(ro);
        so += s;
        ro += rc;
      }
      return t;
    };
    return {table(q_layout_, q_heads_, D * elem_bytes_), table(kv_layout_, kv_heads_, D * elem_bytes_),
            table(q_layout_, q_heads_, acc_bytes_)};
  }

  /// Elements of one [K | V] ring block from ring rank `src` for Ulysses rank u's K/V heads.
  std::size_t ring_block_elems(int src, int u) const {
    return 2 * static_cast<std::size_t>(kv_layout_.block(src).size()) * static_cast<std::size_t>(problem_.batch) *
           static_cast<std::size_t>(kv_heads(u).count) * static_cast<std::size_t>(problem_.head_dim);
  }

  /// Bytes world rank w sends in the first `hops` ring hops (step s sends block r - s).
  std::size_t ring_bytes(int w, int hops, std::size_t bytes_per_elem) const {
    const int R = mesh_.ring, r = mesh_.ring_rank(w), u = mesh_.ulysses_rank(w);
    std::size_t n = 0;
    if (R > 1)
      for (int s = 0; s < hops; ++s) n += ring_block_elems((r - s + R) % R, u) * bytes_per_elem;
    return n;
  }

  AttentionProblem problem_;
  MeshConfig mesh_;
  int world_rank_ = 0;
  std::uint64_t owner_ = 0;  // id of the engine that made it (0: none)
  SequenceLayout q_layout_, kv_layout_;
  std::vector<HeadRange> q_heads_, kv_heads_;
  std::size_t elem_bytes_ = 4, acc_bytes_ = 4;
  MaskTables mask_tables_;  // documents and key padding, what mask() points into
  detail::PlanSchedule schedule_;
};

namespace detail {

/// The engine's door into a Plan: building it and reading its schedule. Not for users.
struct PlanAccess {
  static const PlanSchedule& schedule(const Plan& p) { return p.schedule_; }
  static std::uint64_t owner(const Plan& p) { return p.owner_; }
  static std::size_t ring_block_elems(const Plan& p, int src) { return p.ring_block_elems(src, p.ulysses_rank()); }
  static ExchangeTables exchange_tables(const Plan& p) { return p.exchange_tables(p.ring_rank(), p.ulysses_rank()); }
  /// Sets every field of a plan (plan building, policy/plan_builder.hpp).
  static void fill(Plan& p, const AttentionProblem& problem, const MeshConfig& mesh, int world_rank, std::uint64_t owner,
                   SequenceLayout q, SequenceLayout kv, std::vector<HeadRange> q_heads, std::vector<HeadRange> kv_heads,
                   std::size_t elem_bytes, std::size_t acc_bytes) {
    p.problem_ = problem;
    p.mesh_ = mesh;
    p.world_rank_ = world_rank;
    p.owner_ = owner;
    p.q_layout_ = std::move(q);
    p.kv_layout_ = std::move(kv);
    p.q_heads_ = std::move(q_heads);
    p.kv_heads_ = std::move(kv_heads);
    p.elem_bytes_ = elem_bytes;
    p.acc_bytes_ = acc_bytes;
    p.mask_tables_ = MaskTables(problem.documents, problem.kv_valid);
  }

  /// The schedule, for the builder to fill.
  static PlanSchedule& schedule(Plan& p) { return p.schedule_; }
};

}  // namespace detail
}  // namespace seqpar
