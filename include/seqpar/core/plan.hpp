#pragma once
/// \file
/// Plan: everything a forward or backward call needs, decided once, collectively, so that the
/// call does no metadata exchange, no host-device sync and no allocation. Users read it
/// (positions, lengths, bytes, workspace sizes, work per rank); the engine's schedule inside
/// it (what each phase decided, the workspace slots, the traffic formulas) is private to it.
///
/// A plan knows no phase: the engine adds up the phases its policy selects (policy/phase.hpp)
/// and the plan holds the result. One traffic model: the bytes a plan reports are each phase's
/// formula over the same all-to-all tables and ring block sizes the engine sends with; the
/// tests hold them against an independent closed form.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "seqpar/core/error.hpp"
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

class Plan;

namespace detail {

/// The address that names phase `Ph` among the states a plan keeps (PlanAccess::state).
template <class Ph>
inline constexpr char phase_id = 0;

/// One phase's own plan-time decisions (its all-to-all tables, which ring steps compute), kept
/// without this header knowing their type: the phase reads them back through PlanAccess::state.
struct PhaseState {
  const void* phase = nullptr;        ///< &phase_id<Ph>
  std::shared_ptr<const void> state;  ///< its Ph::State (immutable, so copies of a plan share it)
};

/// The engine's private schedule: the sum of the phases its policy selects. Which phases those
/// are is the engine's business (policy/phase.hpp); a plan only holds what they added up to.
struct PlanSchedule {
  WorkspaceLayout forward;                                     ///< every phase's forward buffers
  WorkspaceLayout backward;                                    ///< every phase's backward buffers
  std::size_t (*forward_bytes)(const Plan&, int w) = nullptr;  ///< the phases' forward traffic, summed
  std::size_t (*backward_bytes)(const Plan&, int w) = nullptr; ///< the phases' backward traffic, summed
  std::vector<PhaseState> phases;                              ///< each phase's own decisions
};

struct PlanAccess;

/// A process-wide id per engine, so that a call can refuse a plan another object made.
inline std::uint64_t next_engine_id() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

/// What a call says of a plan no engine made, or whose tables a move took.
inline constexpr const char* empty_plan_reason = "the plan is empty (default-made or moved from: make it with plan())";

/// The id of the engine that made a plan (0: none). A move takes it along and leaves 0 behind:
/// a moved-from plan, whose tables went with the move, is then refused as empty, not read.
class OwnerId {
 public:
  OwnerId() = default;
  /// The id `id` (of next_engine_id).
  explicit OwnerId(std::uint64_t id) : id_(id) {}
  OwnerId(const OwnerId&) = default;
  OwnerId& operator=(const OwnerId&) = default;
  /// Takes o's id, leaving o none.
  OwnerId(OwnerId&& o) noexcept : id_(std::exchange(o.id_, 0)) {}
  /// Takes o's id, leaving o none.
  OwnerId& operator=(OwnerId&& o) noexcept {
    id_ = std::exchange(o.id_, 0);
    return *this;
  }
  /// The id (0: none).
  std::uint64_t get() const { return id_; }
  /// Whether the plan belongs to the engine of id `id`.
  bool operator==(std::uint64_t id) const { return id_ == id; }

 private:
  std::uint64_t id_ = 0;
};

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

  /// Bytes world rank w sends to other ranks in one forward: the sum of what each phase of the
  /// policy sends (the Ulysses exchange: Q, K, V out and O, with the LSE, back; the ring loop:
  /// K/V blocks R-1 hops), from the same tables and block sizes the engine sends with.
  std::size_t forward_bytes(int w) const { return schedule_.forward_bytes ? schedule_.forward_bytes(*this, w) : 0; }

  /// Bytes world rank w sends in one backward: the sum of what each phase sends (the Ulysses
  /// exchange: Q, O, dO, the LSE, K and V out, dQ, dK, dV back; the ring loop: K/V R-1 hops
  /// and every block's dK/dV, in the accumulation type, R hops, the last one home).
  std::size_t backward_bytes(int w) const { return schedule_.backward_bytes ? schedule_.backward_bytes(*this, w) : 0; }

 private:
  friend struct detail::PlanAccess;

  AttentionProblem problem_;
  MeshConfig mesh_;
  int world_rank_ = 0;
  detail::OwnerId owner_;  // the engine that made it (none: empty, or moved from)
  std::int64_t fingerprint_ = 0;  // hash of what every rank gave plan(): equal on every rank
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
  static std::uint64_t owner(const Plan& p) { return p.owner_.get(); }
  /// The hash of everything every rank gave plan() (its fields and lengths), the same on every
  /// rank: two plans that hash alike are interchangeable in a call.
  static std::int64_t fingerprint(const Plan& p) { return p.fingerprint_; }
  /// Sets it (plan() does, once the plan is built).
  static void set_fingerprint(Plan& p, std::int64_t f) { p.fingerprint_ = f; }
  /// The state phase `Ph` kept in plan p (Ph::State); p must come from an engine with that phase.
  template <class Ph>
  static const typename Ph::State& state(const Plan& p) {
    for (const PhaseState& s : p.schedule_.phases)
      if (s.phase == &phase_id<Ph>) return *static_cast<const typename Ph::State*>(s.state.get());
    SEQPAR_THROW(Error, "seqpar internal error: the plan holds no state of phase ", Ph::name);
  }
  /// Sets every field of a plan (plan building, policy/plan_builder.hpp).
  static void fill(Plan& p, const AttentionProblem& problem, const MeshConfig& mesh, int world_rank, std::uint64_t owner,
                   SequenceLayout q, SequenceLayout kv, std::vector<HeadRange> q_heads, std::vector<HeadRange> kv_heads,
                   std::size_t elem_bytes, std::size_t acc_bytes) {
    p.problem_ = problem;
    p.mesh_ = mesh;
    p.world_rank_ = world_rank;
    p.owner_ = OwnerId(owner);
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
