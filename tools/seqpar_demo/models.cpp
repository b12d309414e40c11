/// \file
/// The model presets (models.hpp), with the configuration file each setting comes from, and
/// their expansion into runs.

#include "models.hpp"

#include <cmath>
#include <cstdio>
#include <initializer_list>

namespace seqpar_demo {

namespace {

/// DeepSeek V3's softmax scale: 1/sqrt(192) times YaRN's mscale squared, mscale = 0.1 ln(40) + 1
/// (rope_scaling: factor 40, mscale_all_dim 1), as its reference inference code computes it.
double deepseek_v3_scale() {
  const double mscale = 0.1 * std::log(40.0) + 1.0;
  return mscale * mscale / std::sqrt(192.0);
}

std::vector<ModelPreset> make_presets() {
  std::vector<ModelPreset> m;
  m.push_back({.name = "llama-3-8b", .title = "Llama 3 8B", .heads = 32, .kv_heads = 8, .head_dim = 128,
               .layers = {{.name = "causal", .share = "all 32"}},
               .settings = "GQA 32/8, D 128, causal",
               .source = "meta-llama/Meta-Llama-3-8B config.json: num_attention_heads 32, num_key_value_heads 8, "
                         "hidden_size 4096"});
  m.push_back({.name = "llama-4-scout", .title = "Llama 4 Scout", .heads = 40, .kv_heads = 8, .head_dim = 128,
               .layers = {{.name = "chunked", .share = "3 of 4", .chunk = 8192},
                          {.name = "global", .share = "1 of 4, without RoPE"}},
               .settings = "GQA 40/8, D 128; chunked causal attention in chunks of 8192 (documents) on 3 layers "
                           "of 4, global causal on the 4th",
               .source = "meta-llama/Llama-4-Scout-17B-16E config.json (text_config): num_attention_heads 40, "
                         "num_key_value_heads 8, head_dim 128, attention_chunk_size 8192, no_rope_layers"});
  m.push_back({.name = "gpt-oss-20b", .title = "GPT-OSS 20B", .heads = 64, .kv_heads = 8, .head_dim = 64,
               .sinks = true,
               .layers = {{.name = "sliding", .share = "1 of 2", .window = 128}, {.name = "full", .share = "1 of 2"}},
               .settings = "GQA 64/8, D 64, sinks on every layer; sliding window 128 alternating with full causal",
               .source = "openai/gpt-oss-20b config.json: num_attention_heads 64, num_key_value_heads 8, "
                         "head_dim 64, sliding_window 128, layer_types; the sinks are each layer's per-head "
                         "parameters"});
  m.push_back({.name = "gemma-2-9b", .title = "Gemma 2 9B", .heads = 16, .kv_heads = 8, .head_dim = 256,
               .scale = 1.0 / 16.0, .softcap = 50,
               .layers = {{.name = "sliding", .share = "1 of 2", .window = 4096}, {.name = "global", .share = "1 of 2"}},
               .settings = "GQA 16/8, D 256, soft-cap 50, scale 1/sqrt(256); sliding window 4096 alternating "
                           "with global causal",
               .source = "google/gemma-2-9b config.json: num_attention_heads 16, num_key_value_heads 8, head_dim "
                         "256, attn_logit_softcapping 50.0, sliding_window 4096, query_pre_attn_scalar 256"});
  m.push_back({.name = "gemma-3-27b", .title = "Gemma 3 27B", .heads = 32, .kv_heads = 16, .head_dim = 128,
               .scale = 1.0 / std::sqrt(168.0),
               .layers = {{.name = "sliding", .share = "5 of 6", .window = 1024}, {.name = "global", .share = "1 of 6"}},
               .settings = "GQA 32/16, D 128, scale 1/sqrt(168); sliding window 1024 on five layers per global "
                           "causal one",
               .source = "google/gemma-3-27b-pt config.json (text_config): num_attention_heads 32, "
                         "num_key_value_heads 16, head_dim 128, query_pre_attn_scalar 168, sliding_window 1024, "
                         "sliding_window_pattern 6"});
  m.push_back({.name = "deepseek-v3", .title = "DeepSeek V3", .heads = 128, .kv_heads = 128, .head_dim = 192,
               .head_dim_v = 128, .scale = deepseek_v3_scale(),
               .layers = {{.name = "mla", .share = "all 61"}},
               .decode = {.heads = 128, .kv_heads = 1, .head_dim = 576, .head_dim_v = 512, .v_in_k = true},
               .settings = "MLA: prefill 128 heads, D 192 / D_v 128, causal; decode (--decode) MQA over the "
                           "latent cache, D 576 / D_v 512, V = the first 512 columns of K; scale "
                           "1.874/sqrt(192)",
               .source = "deepseek-ai/DeepSeek-V3 config.json: num_attention_heads 128, qk_nope_head_dim 128 + "
                         "qk_rope_head_dim 64, v_head_dim 128, kv_lora_rank 512, rope_scaling yarn factor 40, "
                         "mscale_all_dim 1 (scale x (0.1 ln 40 + 1)^2)"});
  m.push_back({.name = "qwen3-32b", .title = "Qwen3 32B", .heads = 64, .kv_heads = 8, .head_dim = 128,
               .layers = {{.name = "causal", .share = "all 64"}},
               .settings = "GQA 64/8, D 128, causal",
               .source = "Qwen/Qwen3-32B config.json: num_attention_heads 64, num_key_value_heads 8, head_dim 128"});
  m.push_back({.name = "flux-dev", .title = "FLUX.1 [dev]", .heads = 24, .kv_heads = 24, .head_dim = 128,
               .text_tokens = 512,
               .layers = {{.name = "joint", .share = "all 57", .causal = false}},
               .settings = "24 heads, D 128, joint attention over 512 text + --seq image tokens (4096 at "
                           "1024x1024), no mask",
               .source = "black-forest-labs/FLUX.1-dev transformer/config.json: num_attention_heads 24, "
                         "attention_head_dim 128; text: T5 with max_sequence_length 512"});
  return m;
}

}  // namespace

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = make_presets();
  return presets;
}

void print_model_list() {
  for (const ModelPreset& m : model_presets()) {
    std::printf("%-14s %s: %s\n", m.name.c_str(), m.title.c_str(), m.settings.c_str());
    std::printf("%-14s layer kinds:", "");
    for (const LayerKind& l : m.layers) std::printf(" %s (%s)", l.name.c_str(), l.share.c_str());
    std::printf("\n%-14s source: %s\n", "", m.source.c_str());
  }
}

std::vector<Options> model_runs(const Options& o) {
  const ModelPreset* m = nullptr;
  for (const ModelPreset& p : model_presets())
    if (p.name == o.model) m = &p;
  if (!m) {
    std::string names;
    for (const ModelPreset& p : model_presets()) names += (names.empty() ? "" : ", ") + p.name;
    throw UsageError("--model: expected list or one of " + names + ", got '" + o.model + "'");
  }
  for (const char* set : {"--heads", "--kv-heads", "--head-dim", "--head-dim-v", "--scale", "--softcap", "--sinks",
                          "--causal", "--window", "--docs", "--kv-seq", "--sweep"})
    if (o.has(set)) throw UsageError(std::string(set) + ": --model sets it (as published; see --model list)");
  Options base = o;
  base.heads = m->heads;
  base.kv_heads = m->kv_heads;
  base.head_dim = m->head_dim;
  base.head_dim_v = m->head_dim_v;
  base.scale = m->scale;
  base.softcap = m->softcap;
  base.sinks = m->sinks;
  if (o.decode) {
    const DecodeShape& d = m->decode;
    if (d.heads) base.heads = d.heads;
    if (d.kv_heads) base.kv_heads = d.kv_heads;
    if (d.head_dim) base.head_dim = d.head_dim;
    if (d.head_dim_v) base.head_dim_v = d.head_dim_v;
    base.v_in_k = d.v_in_k;
    base.layer = d.heads ? "mla-decode" : "decode";
    return {base};  // decode steps attend the whole cache: the model's full-attention layers
  }
  std::vector<Options> runs;
  for (const LayerKind& l : m->layers) {
    Options r = base;
    r.layer = l.name;
    r.causal = l.causal;
    r.seq = o.seq + m->text_tokens;
    const std::int64_t local = o.local ? o.local : (l.window ? l.window : l.chunk);
    if (l.window) r.window = {local - 1, 0};
    if (l.chunk)
      for (std::int64_t at = 0; at < r.seq; at += local) r.docs.push_back(std::min(local, r.seq - at));
    runs.push_back(std::move(r));
  }
  return runs;
}

}  // namespace seqpar_demo
