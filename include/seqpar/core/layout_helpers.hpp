#pragma once
/// \file
/// Moving rows between a global sequence and a rank's local slice, for any layout: so that
/// inputs, positional encodings (RoPE angles) and outputs sit where the plan says.

#include <cstdint>

#include "seqpar/core/error.hpp"
#include "seqpar/core/sequence_layout.hpp"
#include "seqpar/core/tensor_view.hpp"

namespace seqpar {

namespace detail {

/// Copies row i of `local` to or from global row positions(i), checking shapes once.
template <bool ToLocal, class S, class D>
void move_rows(TensorView<S> from, const PositionMap& positions, TensorView<D> to, const char* call) {
  const auto& local = ToLocal ? to.extent : from.extent;
  const auto& global = ToLocal ? from.extent : to.extent;
  SEQPAR_CHECK(local[1] == positions.size(), ConfigError, call, ": local.seq: expected ", positions.size(), ", got ",
               local[1]);
  SEQPAR_CHECK(global[0] == local[0] && global[2] == local[2] && global[3] == local[3], ConfigError, call,
               ": global and local must agree on batch, heads and head_dim");
  for (std::int64_t i = 0; i < positions.size(); ++i) {
    const std::int64_t g = positions(i);
    SEQPAR_CHECK(g >= 0 && g < global[1], ConfigError, call, ": position ", g,
                 " is outside the global sequence of length ", global[1]);
    const std::int64_t src_row = ToLocal ? g : i, dst_row = ToLocal ? i : g;
    for (std::int64_t b = 0; b < local[0]; ++b)
      for (std::int64_t h = 0; h < local[2]; ++h) {
        const auto* in = from.row(b, src_row, h);
        D* out = to.row(b, dst_row, h);
        for (std::int64_t d = 0; d < local[3]; ++d) out[d * to.stride[3]] = static_cast<D>(in[d * from.stride[3]]);
      }
  }
}

}  // namespace detail

/// Copies the global rows at `positions` into `local` (local row i = global row
/// positions(i)), for every batch and head. Use plan.q_positions(rank) or kv_positions(rank).
/// `global` may be a view of const or mutable elements.
template <class S, class D>
void scatter_sequence(TensorView<S> global, const PositionMap& positions, TensorView<D> local) {
  detail::move_rows<true>(global, positions, local, "scatter_sequence");
}

/// The inverse: copies local rows back to their global positions (run it for every rank's
/// slice, e.g. after gathering the slices on one rank, to rebuild the global output).
template <class S, class D>
void gather_sequence(TensorView<S> local, const PositionMap& positions, TensorView<D> global) {
  detail::move_rows<false>(local, positions, global, "gather_sequence");
}

}  // namespace seqpar
