#pragma once
/// \file
/// seqpar_demo's model presets (--model NAME): the attention settings of published open models,
/// each layer kind (a mask over one token placement) run in turn on the same ranks. The figures
/// come from the models' published configuration files, cited in models.cpp beside each one.

#include <cstdint>
#include <string>
#include <vector>

#include "options.hpp"

namespace seqpar_demo {

/// One kind of attention layer of a model: its mask.
struct LayerKind {
  std::string name;          ///< as RESULT's layer= shows it, e.g. "sliding" or "full"
  std::string share;         ///< which of the model's layers have it, e.g. "1 of 2"
  bool causal = true;        ///< causal mask
  std::int64_t window = 0;   ///< sliding window of N keys (the row's own and the N - 1 before it); 0: none
  std::int64_t chunk = 0;    ///< chunked attention: causal within chunks of N tokens; 0: none
};

/// The decode layer of a model (--decode), when it differs from the prefill's heads and dims.
struct DecodeShape {
  std::int64_t heads = 0, kv_heads = 0, head_dim = 0, head_dim_v = 0;  ///< 0: the prefill's
  bool v_in_k = false;  ///< V is the first head_dim_v columns of the cached K rows (one cache)
};

/// A model's attention settings, as published.
struct ModelPreset {
  std::string name;            ///< --model's value, lower case as the model is published
  std::string title;           ///< the model's name for people
  std::int64_t heads = 0, kv_heads = 0, head_dim = 0;
  std::int64_t head_dim_v = 0; ///< 0: head_dim
  double scale = 0;            ///< 0: 1/sqrt(head_dim)
  double softcap = 0;          ///< 0: off
  bool sinks = false;          ///< one learned logit per query head
  std::int64_t text_tokens = 0;  ///< joint attention: text tokens placed before the --seq image tokens
  std::vector<LayerKind> layers;
  DecodeShape decode{};        ///< --decode's layer
  std::string settings;        ///< the settings in one line (--model list, the README's table)
  std::string source;          ///< where the settings come from
};

/// Every preset, in the README's order.
const std::vector<ModelPreset>& model_presets();

/// Prints --model list: each preset with its settings and source.
void print_model_list();

/// The runs of `o.model`: one Options per layer kind (prefill), or the one decode layer with
/// --decode, each with the model's heads, dims, scale, soft-cap, sinks and mask set. Throws
/// UsageError naming the option that --model sets, or an unknown model.
std::vector<Options> model_runs(const Options& o);

}  // namespace seqpar_demo
