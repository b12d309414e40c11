#pragma once
/// \file
/// MeshConfig: how the world's ranks form the ulysses_degree x ring_degree mesh that every
/// policy runs on (Ulysses is the mesh 1 x P, Ring the mesh P x 1).

#include <cstdint>
#include <vector>

#include "seqpar/core/sequence_layout.hpp"

namespace seqpar {

/// Which ranks are neighbours in the mesh.
enum class MeshPlacement : std::int64_t {
  ulysses_adjacent = 0,  ///< a Ulysses group is consecutive world ranks (same node: fast all-to-all)
  ring_adjacent = 1,     ///< a ring group is consecutive world ranks
};

/// The resolved arrangement of a policy over a world of ulysses * ring ranks.
struct MeshConfig {
  int ulysses = 1;   ///< Ulysses degree U (ranks in one all-to-all group)
  int ring = 1;      ///< ring degree R (ranks in one ring)
  MeshPlacement placement = MeshPlacement::ulysses_adjacent;  ///< rank placement
  LayoutKind layout = LayoutKind::contiguous;  ///< how ring blocks take global positions
  bool anything = false;  ///< divisibility rules lifted (AnythingPolicy)
  const char* policy = "";  ///< readable policy name, for messages

  /// World size.
  constexpr int world() const { return ulysses * ring; }
  /// Ring rank (0..R-1) of world rank w.
  constexpr int ring_rank(int w) const { return placement == MeshPlacement::ulysses_adjacent ? w / ulysses : w % ring; }
  /// Ulysses rank (0..U-1) of world rank w.
  constexpr int ulysses_rank(int w) const { return placement == MeshPlacement::ulysses_adjacent ? w % ulysses : w / ring; }
  /// World rank of mesh rank (r, u).
  constexpr int world_rank(int r, int u) const {
    return placement == MeshPlacement::ulysses_adjacent ? r * ulysses + u : u * ring + r;
  }
};

/// Local length of every world rank for a global length `total`, as even as the mesh allows
/// (ring blocks, then their pieces, differ by at most one token). Valid for every layout,
/// stripe included; a plain policy still needs `total` to divide evenly.
inline std::vector<std::int64_t> split_sequence(std::int64_t total, const MeshConfig& mesh) {
  const std::vector<std::int64_t> per_mesh = split_mesh(total, mesh.ring, mesh.ulysses);
  std::vector<std::int64_t> out(static_cast<std::size_t>(mesh.world()));
  for (int w = 0; w < mesh.world(); ++w)
    out[static_cast<std::size_t>(w)] = per_mesh[static_cast<std::size_t>(mesh.ring_rank(w) * mesh.ulysses + mesh.ulysses_rank(w))];
  return out;
}

}  // namespace seqpar
