#pragma once
/// \file
/// AttentionProblem: the global shape and options every rank must agree on.

#include <cmath>
#include <cstdint>
#include <vector>

#include "seqpar/core/mask.hpp"
#include "seqpar/core/types.hpp"

namespace seqpar {

/// The attention every rank computes a slice of: softmax(Q K^T * scale + mask) V over the
/// global sequence. Sequence lengths are not here: each rank gives its own local lengths to
/// `plan`, and the plan gathers them.
struct AttentionProblem {
  std::int64_t batch = 1;     ///< batch size B
  std::int64_t heads = 1;     ///< query heads H
  std::int64_t kv_heads = 0;  ///< key/value heads K (H % K == 0); 0 means K = H
  std::int64_t head_dim = 64; ///< head dimension D of Q and K
  /// Head dimension of V and O, D_v (DeepSeek's MLA: D = 192, D_v = 128); 0 means D_v = D.
  /// Messages and buffers are sized per tensor; kernels need kernel_supports_value_dim.
  std::int64_t head_dim_v = 0;
  bool causal = false;        ///< mask key positions after the query position (global positions)
  double scale = 0.0;         ///< softmax scale; 0 means 1/sqrt(head_dim); otherwise finite, |scale| <= 2^32
  DType dtype = DType::f32;   ///< element type of Q, K, V, O
  bool with_lse = false;      ///< forward also returns the LSE (every rank must agree: it changes the traffic)
  /// Where the causal diagonal (and a window's centre) sits when S_q != S_kv.
  CausalAlign causal_align = CausalAlign::top_left;
  /// Sliding window around the diagonal ({-1, -1}: none), composable with causal.
  Window window{};
  /// Packed documents (varlen): lengths summing to the global sequence, either one list shared
  /// by every batch element or one list per batch element; attention stays inside a
  /// document. Needs S_q == S_kv. Empty: one document.
  std::vector<std::vector<std::int64_t>> documents{};
  /// Key padding: valid keys per batch element (keys at positions >= kv_valid[b] are hidden).
  /// Empty: every key is valid.
  std::vector<std::int64_t> kv_valid{};
  /// Logit soft-capping (Gemma 2, Grok): each scaled score s becomes softcap * tanh(s / softcap)
  /// before the mask and the softmax, forward and backward. 0 is off; otherwise finite and > 0.
  /// Kernels need kernel_supports_softcap.
  double softcap = 0.0;
  /// Attention sinks (GPT-OSS): one logit per query head that joins every row's softmax
  /// denominator once and carries no value, so O = sum_j exp(s_j - L) v_j with
  /// L = log(sum_j exp(s_j) + exp(sink_h)); the LSE returned is that L. `heads` floats, in the
  /// memory space of the attention object (device memory for CUDA), read at every call: update
  /// them in place between calls (an optimizer step) without a new plan; every rank must hold
  /// the same values. Null: no sinks. The engine applies them once, after the partial results
  /// over the keys are merged, so every kernel supports them.
  const float* sinks = nullptr;

  /// True when a mask family besides causal is on (window, documents, key padding).
  bool has_extra_mask() const { return window.active() || !documents.empty() || !kv_valid.empty(); }
  /// K, with 0 resolved to H.
  constexpr std::int64_t kv_head_count() const { return kv_heads == 0 ? heads : kv_heads; }
  /// D_v, with 0 resolved to D.
  constexpr std::int64_t value_dim() const { return head_dim_v == 0 ? head_dim : head_dim_v; }
  /// The scale actually applied.
  double softmax_scale() const {
    return scale != 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(head_dim > 0 ? head_dim : 1));
  }
};

/// This rank's local token counts. For self-attention kv == q; joint and cross attention
/// (AnythingPolicy) may give a different K/V length.
struct LocalLengths {
  std::int64_t q = 0;   ///< local query tokens
  std::int64_t kv = -1; ///< local key/value tokens; -1 means the same as q (other negatives are refused)

  /// kv with -1 resolved (any other negative value stays, for plan to refuse).
  constexpr std::int64_t kv_count() const { return kv == -1 ? q : kv; }
};

}  // namespace seqpar
