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
  std::vector<std::size_t> send_counts, send_displs, recv_counts, recv_displs;  ///< bytes
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
  std::size_t workspace = 0;       ///< bytes forward needs

  /// Bytes of workspace forward needs (two-phase: size, allocate once, reuse).
  std::size_t workspace_bytes() const { return workspace; }
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
    const int r = mesh.ring_rank(w), u = mesh.ulysses_rank(w), U = mesh.ulysses, R = mesh.ring;
    const auto B = static_cast<std::size_t>(problem.batch), D = static_cast<std::size_t>(problem.head_dim);
    std::size_t bytes = 0;
    if (U > 1) {
      const auto lq = static_cast<std::size_t>(q_layout.length(r, u)), lk = static_cast<std::size_t>(kv_layout.length(r, u));
      std::size_t q_out = 0, kv_out = 0;
      for (int v = 0; v < U; ++v)
        if (v != u) {
          q_out += static_cast<std::size_t>(q_heads[v].count);
          kv_out += static_cast<std::size_t>(kv_heads[v].count);
        }
      bytes += (lq * q_out + 2 * lk * kv_out) * B * D * elem_bytes;  // Q, K, V out
      std::size_t o_back = 0;
      for (int v = 0; v < U; ++v)
        if (v != u) o_back += static_cast<std::size_t>(q_layout.length(r, v));
      const auto hq = static_cast<std::size_t>(q_heads[u].count);
      bytes += o_back * B * hq * D * elem_bytes;  // O back
      if (problem.with_lse) bytes += o_back * B * hq * acc_bytes;
    }
    if (R > 1) {
      const auto hk = static_cast<std::size_t>(kv_heads[u].count);
      for (int s = 0; s < R - 1; ++s) {
        const int src = (r - s + R) % R;
        std::int64_t block = 0;
        for (int v = 0; v < U; ++v) block += kv_layout.length(src, v);
        bytes += 2 * static_cast<std::size_t>(block) * B * hk * D * elem_bytes;
      }
    }
    return bytes;
  }
};

}  // namespace seqpar
