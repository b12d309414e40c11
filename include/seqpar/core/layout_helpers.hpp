#pragma once
/// \file
/// Moving rows between a global sequence and a rank's local slice, for any layout: so that
/// inputs, positional encodings (RoPE angles) and outputs sit where the plan says.

#include <cstdint>

#include "seqpar/core/error.hpp"
#include "seqpar/core/sequence_layout.hpp"
#include "seqpar/core/tensor_view.hpp"

namespace seqpar {

/// Copies the global rows at `positions` into `local` (local row i = global row
/// positions(i)), for every batch and head. Use plan.q_positions(rank) or kv_positions(rank).
template <class S, class D>
void scatter_sequence(TensorView<const S> global, const PositionMap& positions, TensorView<D> local) {
  SEQPAR_CHECK(local.seq() == positions.size(), ConfigError, "scatter_sequence: local.seq: expected ",
               positions.size(), ", got ", local.seq());
  SEQPAR_CHECK(global.batch() == local.batch() && global.heads() == local.heads() && global.dim() == local.dim(),
               ConfigError, "scatter_sequence: global and local must agree on batch, heads and head_dim");
  for (std::int64_t i = 0; i < positions.size(); ++i) {
    const std::int64_t g = positions(i);
    SEQPAR_CHECK(g >= 0 && g < global.seq(), ConfigError, "scatter_sequence: position ", g,
                 " is outside the global sequence of length ", global.seq());
    for (std::int64_t b = 0; b < local.batch(); ++b)
      for (std::int64_t h = 0; h < local.heads(); ++h) {
        const S* in = global.row(b, g, h);
        D* out = local.row(b, i, h);
        for (std::int64_t d = 0; d < local.dim(); ++d) out[d] = static_cast<D>(in[d * global.stride[3]]);
      }
  }
}

/// The inverse: copies local rows back to their global positions (run it for every rank's
/// slice, e.g. after gathering the slices on one rank, to rebuild the global output).
template <class S, class D>
void gather_sequence(TensorView<const S> local, const PositionMap& positions, TensorView<D> global) {
  SEQPAR_CHECK(local.seq() == positions.size(), ConfigError, "gather_sequence: local.seq: expected ",
               positions.size(), ", got ", local.seq());
  SEQPAR_CHECK(global.batch() == local.batch() && global.heads() == local.heads() && global.dim() == local.dim(),
               ConfigError, "gather_sequence: global and local must agree on batch, heads and head_dim");
  for (std::int64_t i = 0; i < positions.size(); ++i) {
    const std::int64_t g = positions(i);
    SEQPAR_CHECK(g >= 0 && g < global.seq(), ConfigError, "gather_sequence: position ", g,
                 " is outside the global sequence of length ", global.seq());
    for (std::int64_t b = 0; b < local.batch(); ++b)
      for (std::int64_t h = 0; h < local.heads(); ++h) {
        const S* in = local.row(b, i, h);
        D* out = global.row(b, g, h);
        for (std::int64_t d = 0; d < local.dim(); ++d) out[d * global.stride[3]] = static_cast<D>(in[d * local.stride[3]]);
      }
  }
}

}  // namespace seqpar
