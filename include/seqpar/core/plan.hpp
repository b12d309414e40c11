#pragma once
/// \file
/// Plan: everything a forward call needs, decided once, collectively, so that forward does
/// no metadata exchange, no host-device sync and no allocation.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "seqpar/core/mesh.hpp"
#include "seqpar/core/problem.hpp"
#include "seqpar/core/sequence_layout.hpp"

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
};

/// The result of SequenceParallelAttention::plan. Read-only for users; its accessors answer
/// where tokens live and how much work and traffic a rank has.
struct Plan {
  AttentionProblem problem;  ///< the agreed problem
  MeshConfig mesh;           ///< the agreed mesh
  int world_rank = 0;        ///< this rank in the world
  int ring_rank = 0;         ///< this rank's ring rank
  int ulysses_rank = 0;      ///< this rank's Ulysses rank
  SequenceLayout q_layout;   ///< global positions of every rank's queries
  SequenceLayout kv_layout;  ///< global positions of every rank's keys and values
  std::vector<HeadRange> q_heads;   ///< query heads of each Ulysses rank
  std::vector<HeadRange> kv_heads;  ///< K/V heads each Ulysses rank needs
  std::size_t elem_bytes = 4;  ///< bytes of one element of Q, K, V, O
  std::size_t acc_bytes = 4;   ///< bytes of one accumulation element (LSE, partial outputs)

  AllToAllTable q_table;    ///< Q (and O, reversed) all-to-all
  AllToAllTable kv_table;   ///< K and V all-to-all
  AllToAllTable lse_table;  ///< LSE all-to-all back (when problem wants it)
  std::vector<unsigned char> ring_step_computes;  ///< per ring step: is any key visible?
  std::int64_t max_kv_block = 0;   ///< longest K/V ring block
  std::size_t workspace = 0;           ///< bytes forward needs
  std::size_t backward_workspace = 0;  ///< bytes backward needs

  /// Bytes of workspace forward needs (two-phase: size, allocate once, reuse).
  std::size_t workspace_bytes() const { return workspace; }
  /// Bytes of workspace backward needs (training allocates the larger of the two once).
  std::size_t backward_workspace_bytes() const { return backward_workspace; }
  /// Local query tokens of this rank.
  std::int64_t local_q() const { return q_layout.length(ring_rank, ulysses_rank); }
  /// Local K/V tokens of this rank.
  std::int64_t local_kv() const { return kv_layout.length(ring_rank, ulysses_rank); }
  /// Global query length.
  std::int64_t global_q() const { return q_layout.total(); }
  /// Global K/V length.
  std::int64_t global_kv() const { return kv_layout.total(); }
  /// Global positions of world rank w's queries.
  PositionMap q_positions(int w) const { return q_layout.positions(mesh.ring_rank(w), mesh.ulysses_rank(w)); }
  /// Global positions of world rank w's keys and values.
  PositionMap kv_positions(int w) const { return kv_layout.positions(mesh.ring_rank(w), mesh.ulysses_rank(w)); }

  /// Score elements (visible query-key pairs, times batch and heads) world rank w computes:
  /// the measure of causal load balance.
  std::int64_t work(int w) const {
    const int r = mesh.ring_rank(w), u = mesh.ulysses_rank(w);
    std::int64_t pairs = 0;
    for (int src = 0; src < mesh.ring; ++src)
      pairs += visible_pairs(q_layout.block(r), kv_layout.block(src), problem.causal);
    return pairs * problem.batch * q_heads[static_cast<std::size_t>(u)].count;
  }

  /// Bytes world rank w sends to other ranks in one forward (the exact analytic count: no
  /// padding, each K/V head only to the ranks that need it).
  std::size_t forward_bytes(int w) const {
    const Traffic t = traffic(w);
    const std::size_t lse = problem.with_lse ? t.q_back * acc_bytes : 0;
    return (t.q_out + 2 * t.kv_out + t.q_back * D()) * elem_bytes + lse + 2 * t.ring_kv * elem_bytes;
  }

  /// Bytes world rank w sends in one backward: Ulysses sends Q, O, dO, the LSE, K and V out
  /// and dQ, dK, dV back; the ring passes K/V R-1 hops and every block's dK/dV (in the
  /// accumulation type) R hops, the last one home.
  std::size_t backward_bytes(int w) const {
    const Traffic t = traffic(w);
    const std::size_t ulysses = (3 * t.q_out + 2 * t.kv_out + t.q_back * D() + 2 * t.kv_back * D()) * elem_bytes +
                                t.q_out / D() * acc_bytes;
    return ulysses + 2 * t.ring_kv * elem_bytes + 2 * t.ring_all_kv * acc_bytes;
  }

 private:
  std::size_t D() const { return static_cast<std::size_t>(problem.head_dim); }

  /// Elements rank w moves, per tensor (K and V counted once).
  struct Traffic {
    std::size_t q_out = 0;        // my Q rows of other members' heads
    std::size_t kv_out = 0;       // my K rows of other members' K/V heads
    std::size_t q_back = 0;       // rows (token x head) of my heads that go back to other members
    std::size_t kv_back = 0;      // rows of my K/V heads that go back to other members
    std::size_t ring_kv = 0;      // K elements of the R-1 ring hops
    std::size_t ring_all_kv = 0;  // K elements of every ring block (the dK hops)
  };

  Traffic traffic(int w) const {
    const int r = mesh.ring_rank(w), u = mesh.ulysses_rank(w), U = mesh.ulysses, R = mesh.ring;
    const auto B = static_cast<std::size_t>(problem.batch);
    auto z = [](std::int64_t x) { return static_cast<std::size_t>(x); };
    Traffic t;
    if (U > 1) {
      for (int v = 0; v < U; ++v) {
        if (v == u) continue;
        t.q_out += z(q_layout.length(r, u)) * z(q_heads[v].count) * B * D();
        t.kv_out += z(kv_layout.length(r, u)) * z(kv_heads[v].count) * B * D();
        t.q_back += z(q_layout.length(r, v)) * z(q_heads[u].count) * B;
        t.kv_back += z(kv_layout.length(r, v)) * z(kv_heads[u].count) * B;
      }
    }
    if (R > 1) {
      const std::size_t per_token = B * z(kv_heads[u].count) * D();
      for (int s = 0; s < R; ++s) {
        const std::size_t block = z(kv_layout.block((r - s + R) % R).size()) * per_token;
        if (s < R - 1) t.ring_kv += block;
        t.ring_all_kv += block;
      }
    }
    return t;
  }
};

}  // namespace seqpar
