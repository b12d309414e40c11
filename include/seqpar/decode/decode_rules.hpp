#pragma once
/// \file
/// The plan-time rules both decode faces share (seqpar's own cache and an engine's paged
/// pool): agreeing on the problem's fields in one gather, and the rules of a step's shape
/// (heads, dims, scale, dtype, exchange, today's models' features and what the kernel and the
/// memory space can do with them).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "seqpar/core/agreement.hpp"
#include "seqpar/core/checked.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/decode/step_exchange.hpp"
#include "seqpar/policy/join_sinks.hpp"
#include "seqpar/policy/plan_builder.hpp"

namespace seqpar::detail {

/// One field of a decode plan's agreement: its name in messages, its value on this rank and
/// the attention plan's field it is shown as (doubles, dtype and sinks by value, not by their
/// bits), or -1 for a number.
struct AgreedField {
  const char* name;    ///< as the message names it
  std::int64_t value;  ///< this rank's value (a list travels as its hash)
  int shown_as = -1;   ///< plan_builder's field id for field_value, or -1
};

/// Collective: every rank gives its `fields` (the same names in the same order); one host
/// all-gather, then every rank throws the same ConfigError (after `who`) naming the first
/// field where a rank differs from rank 0. For the field at `list_field` (a list sent as its
/// hash) the message comes from `list_message()`, which is collective too (every rank calls
/// it, since every rank sees the same gathered hashes).
template <class Comm, class ListMessage>
void agree_fields(Comm& world, const char* who, std::span<const AgreedField> fields, int list_field,
                  ListMessage&& list_message) {
  const int P = world.size(), n = static_cast<int>(fields.size());
  std::vector<std::int64_t> mine(fields.size()), all(static_cast<std::size_t>(n * P));
  for (std::size_t f = 0; f < fields.size(); ++f) mine[f] = fields[f].value;
  world.all_gather_host(std::span<const std::int64_t>(mine), all);
  for (int f = 0; f < n; ++f)
    for (int w = 1; w < P; ++w) {
      if (all[static_cast<std::size_t>(w * n + f)] == all[static_cast<std::size_t>(f)]) continue;
      if (f == list_field) SEQPAR_THROW(ConfigError, list_message());
      const int shown = fields[static_cast<std::size_t>(f)].shown_as;
      SEQPAR_THROW(ConfigError, who, "ranks disagree on ", fields[static_cast<std::size_t>(f)].name, ": rank 0 has ",
                   field_value(shown, all[static_cast<std::size_t>(f)]), ", rank ", w, " has ",
                   field_value(shown, all[static_cast<std::size_t>(w * n + f)]));
    }
}

/// The fields of a decode step's shape every rank agrees on, as AgreedFields (`Problem`:
/// DecodeProblem or PagedDecodeProblem, which name them alike).
template <class Problem>
std::vector<AgreedField> shape_fields(const Problem& pr) {
  return {{"heads", pr.heads, f_heads},
          {"kv_heads", pr.kv_head_count(), f_kv_heads},
          {"head_dim", pr.head_dim, f_head_dim},
          {"head_dim_v", pr.value_dim(), f_head_dim_v},
          {"dtype", static_cast<std::int64_t>(pr.dtype), f_dtype},
          {"scale", std::bit_cast<std::int64_t>(pr.scale), f_scale},
          {"softcap", std::bit_cast<std::int64_t>(pr.softcap), f_softcap},
          {"sinks (given or not)", pr.sinks != nullptr, f_sinks},
          {"exchange", static_cast<std::int64_t>(pr.exchange)}};
}

/// The rules of a decode step's shape (after `who`, "decode plan: "): heads, K/V heads, dims,
/// the features' values, scale, dtype and exchange, then what kernel `Kernel` and memory space
/// `Space` cannot do with them, in the attention plan's words.
template <class Kernel, class Space, class Problem>
void check_decode_shape(const Problem& pr, const std::string& who) {
  SEQPAR_CHECK_ARG(pr.heads >= 1, who + "heads", ">= 1", pr.heads);
  SEQPAR_CHECK_ARG(pr.kv_head_count() >= 1 && pr.heads % pr.kv_head_count() == 0, who + "kv_heads",
                   "a divisor of heads " + std::to_string(pr.heads), pr.kv_head_count());
  SEQPAR_CHECK_ARG(pr.head_dim >= 1, who + "head_dim", ">= 1", pr.head_dim);
  const std::string features = feature_values_reason(pr, who);
  SEQPAR_CHECK(features.empty(), ConfigError, features);
  SEQPAR_CHECK_ARG(std::isfinite(pr.scale) && std::abs(pr.scale) <= scale_limit, who + "scale",
                   "a finite number with |scale| <= 2^32 (or 0 for 1/sqrt(head_dim))", pr.scale);
  SEQPAR_CHECK_ARG(static_cast<int>(pr.dtype) <= static_cast<int>(DType::f64), who + "dtype", "f16, bf16, f32 or f64",
                   static_cast<int>(pr.dtype));
  StepExchange::check_exchange(pr.exchange);
  std::string why = kernel_features_reason<Kernel>(pr, who);
  if (why.empty()) why = sinks_reason<Space>(pr, who);
  SEQPAR_CHECK(why.empty(), ConfigError, why);
}

/// The softmax scale of a decode problem (0: 1/sqrt(D)).
template <class Problem>
double decode_scale(const Problem& pr) {
  return pr.scale != 0.0 ? pr.scale : 1.0 / std::sqrt(static_cast<double>(pr.head_dim));
}

/// The StepMessages of a decode problem on rank `rank` of `ranks` (before configure).
template <class Problem>
StepMessages step_messages(const Problem& pr, int ranks, int rank) {
  StepMessages m;
  m.heads = pr.heads;
  m.head_dim = pr.head_dim;
  m.value_dim = pr.value_dim();
  m.dtype = pr.dtype;
  m.exchange = pr.exchange;
  m.sinks = pr.sinks;
  m.ranks = ranks;
  m.rank = rank;
  return m;
}

}  // namespace seqpar::detail
