#pragma once
/// \file
/// Decode over a sharded KV cache: the problem, the cache layouts and the plan.
///
/// After a context-parallel prefill the KV cache is already split across the ranks. A decode
/// step leaves it there: every rank attends the step's queries (T new tokens per sequence,
/// causal among themselves) to the keys it stores and gets a partial (O, LSE); one exchange of
/// the partials and the LSE merge (kernel/merge_state.hpp) give the exact output. Bytes per
/// step depend on B x T x heads x D_v (the partials; the heads exchange adds the queries' D),
/// never on the cache length.
///
/// Cache layouts, per sequence (batch element):
///  - contiguous (as a contiguous prefill leaves it): the first `kv_len[b]` tokens split as
///    evenly as possible over the ranks in rank order; tokens appended later go to the last
///    rank;
///  - paged: pages of `page` tokens round-robin over the ranks (page p on rank p mod P), so
///    the cache stays balanced as it grows; page = 1 stripes single tokens (SGLang's layout).
/// A rank stores its tokens of a sequence in increasing position order in local slots 0, 1,
/// ...: `owner(b, pos)` and `slot(b, pos)` say where the K/V of a token live, so the engine
/// appends new K/V in the right place. Plans advance by k tokens (`advance`) without a
/// collective: every rank computes the new lengths itself.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/sequence_layout.hpp"
#include "seqpar/core/workspace.hpp"
#include "seqpar/core/types.hpp"
#include "seqpar/decode/step_exchange.hpp"

namespace seqpar {

/// One decode problem: the batch's shapes, the cache lengths before the first step, the layout
/// of the cache over the ranks and the exchange; and today's models' features, as in
/// AttentionProblem (core/problem.hpp): a value head dim, logit soft-capping and sinks.
struct DecodeProblem {
  std::int64_t batch = 1;       ///< sequences B
  std::int64_t heads = 1;       ///< query heads H
  std::int64_t kv_heads = 0;    ///< K/V heads (0: H)
  std::int64_t head_dim = 64;   ///< D of Q and K
  /// D_v of V and O (0: D). Partials, messages and the merge are sized by it. MLA's latent
  /// cache: D 576, D_v 512, V a column view of K's rows (same pointer and strides, no copy).
  std::int64_t head_dim_v = 0;
  double scale = 0.0;           ///< softmax scale; 0: 1/sqrt(D)
  /// Logit soft-cap (Gemma 2, Grok): each scaled score s becomes softcap * tanh(s / softcap);
  /// 0 is off. The kernel needs kernel_supports_softcap.
  double softcap = 0.0;
  DType dtype = DType::f32;     ///< element type of Q, the cache and O
  std::int64_t new_tokens = 1;  ///< T: query tokens per sequence per step (1..16), causal among themselves
  std::vector<std::int64_t> kv_len{};  ///< global cache length of each sequence before the first step
  std::int64_t capacity = 0;    ///< most tokens a sequence's cache will hold (sizes each rank's shard)
  std::int64_t page = 0;        ///< 0: contiguous layout; N > 0: pages of N tokens round-robin
  DecodeExchange exchange = DecodeExchange::all_gather;  ///< how partials are combined
  /// Attention sinks (GPT-OSS): one logit per query head, H floats in the decode object's
  /// memory space (device memory for CUDA), read at every step; null: none. A step joins each
  /// row's sink once, after the partials of every rank are merged (a sink joined to every
  /// rank's partial would count P times).
  const float* sinks = nullptr;

  /// K/V heads with 0 resolved.
  std::int64_t kv_head_count() const { return kv_heads == 0 ? heads : kv_heads; }
  /// D_v, with 0 resolved to D.
  std::int64_t value_dim() const { return head_dim_v == 0 ? head_dim : head_dim_v; }
};

/// Which rank stores each token of a sequence, and at which local slot: the placement rule of
/// both decode faces (no communication; any rank, and the engine, can ask).
///  - interleave N > 0: runs of N tokens round-robin over the ranks, token p on rank
///    (p / N) mod P (vLLM's decode context parallelism with interleave_size N; N = 1 stripes
///    single tokens, SGLang's layout), so the cache stays balanced as it grows;
///  - interleave 0, contiguous (as a contiguous prefill leaves it): the sequence's first
///    `split` tokens as evenly as possible in rank order (the first split % P ranks one more),
///    tokens appended later on the last rank.
/// A rank keeps a sequence's tokens in position order: its local slot s holds its s-th token.
struct TokenPlacement {
  int ranks = 1;                 ///< P
  std::int64_t interleave = 0;   ///< tokens per round-robin run; 0: contiguous

  /// Rank that stores token `pos` (`split`: the contiguous placement's prefill length).
  int owner(std::int64_t pos, std::int64_t split = 0) const {
    if (interleave > 0) return static_cast<int>((pos / interleave) % ranks);
    if (pos >= split) return ranks - 1;  // appended tokens stay with the last rank
    const std::int64_t base = split / ranks, extra = split % ranks, cut = extra * (base + 1);
    return static_cast<int>(pos < cut ? pos / (base + 1) : extra + (pos - cut) / (base > 0 ? base : 1));
  }
  /// Tokens among positions [0, end) that rank r stores.
  std::int64_t count(int r, std::int64_t end, std::int64_t split = 0) const {
    if (end <= 0) return 0;
    if (interleave > 0) {
      const std::int64_t full = end / interleave, rest = end % interleave;  // whole runs, then a partial one
      const std::int64_t mine = full / ranks + (r < full % ranks ? 1 : 0);
      return mine * interleave + (full % ranks == r ? rest : 0);
    }
    const std::int64_t base = split / ranks, extra = split % ranks;
    const std::int64_t begin = r * base + std::min<std::int64_t>(r, extra), len = base + (r < extra ? 1 : 0);
    std::int64_t c = std::clamp<std::int64_t>(end - begin, 0, len);
    if (r == ranks - 1 && end > split) c += end - split;
    return c;
  }
  /// Local slot of token `pos` on its owner: its rank among the owner's tokens.
  std::int64_t slot(std::int64_t pos, std::int64_t split = 0) const { return count(owner(pos, split), pos, split); }
};

/// Where cache tokens live in SequenceParallelDecode's own cache: the placement, with each
/// sequence's contiguous split fixed at plan time.
class CacheLayout {
 public:
  /// An empty layout.
  CacheLayout() = default;
  /// `initial[b]`: tokens of sequence b at plan time (they fix the contiguous split).
  CacheLayout(int ranks, std::int64_t page, std::vector<std::int64_t> initial)
      : placement_{ranks, page}, initial_(std::move(initial)) {}

  /// Rank that stores the K/V of token `pos` of sequence `b`. Like count and slot, it refuses
  /// (ConfigError) a sequence outside the batch and a negative position or rank.
  int owner(std::int64_t b, std::int64_t pos) const { return placement_.owner(position(pos, "owner"), split(b, "owner")); }
  /// Tokens of sequence b among positions [0, end) that rank r stores.
  std::int64_t count(int r, std::int64_t b, std::int64_t end) const {
    SEQPAR_CHECK(r >= 0 && r < placement_.ranks, ConfigError, "CacheLayout::count: rank: expected 0..",
                 placement_.ranks - 1, ", got ", r);
    return placement_.count(r, end, split(b, "count"));
  }
  /// Local slot of token `pos` of sequence b on its owner: its rank among the owner's tokens.
  std::int64_t slot(std::int64_t b, std::int64_t pos) const { return placement_.slot(position(pos, "slot"), split(b, "slot")); }
  /// Ranks.
  int ranks() const { return placement_.ranks; }
  /// Page size (0: contiguous).
  std::int64_t page() const { return placement_.interleave; }
  /// The placement rule.
  const TokenPlacement& placement() const { return placement_; }

 private:
  std::int64_t split(std::int64_t b, const char* call) const {
    SEQPAR_CHECK(b >= 0 && b < static_cast<std::int64_t>(initial_.size()), ConfigError, "CacheLayout::", call,
                 ": sequence: expected 0..", static_cast<std::int64_t>(initial_.size()) - 1, ", got ", b);
    return placement_.interleave > 0 ? 0 : initial_[static_cast<std::size_t>(b)];
  }
  static std::int64_t position(std::int64_t pos, const char* call) {
    SEQPAR_CHECK(pos >= 0, ConfigError, "CacheLayout::", call, ": pos: expected >= 0, got ", pos);
    return pos;
  }

  TokenPlacement placement_;
  std::vector<std::int64_t> initial_;
};

namespace detail {
template <class Comm, class Kernel>
class DecodeEngine;
}  // namespace detail

/// The plan of SequenceParallelDecode: made once per cache layout (collective), reused every
/// step, advanced without communication. Read-only to users except advance().
class DecodePlan {
 public:
  /// An empty plan.
  DecodePlan() = default;
  /// The agreed problem.
  const DecodeProblem& problem() const { return problem_; }
  /// Where tokens live.
  const CacheLayout& layout() const { return layout_; }
  /// This rank.
  int rank() const { return rank_; }
  /// Current global cache length of sequence b (before this step's tokens).
  std::int64_t kv_len(std::int64_t b) const { return len_[checked_sequence(b, "kv_len")]; }
  /// Rank that stores token `pos` of sequence b: b in [0, batch), pos in [0, capacity)
  /// (anything else is a ConfigError, so that a caller writing at slot(b, pos) on
  /// owner(b, pos) never writes outside a shard).
  int owner(std::int64_t b, std::int64_t pos) const {
    check_token(b, pos, "owner");
    return layout_.owner(b, pos);
  }
  /// Local slot of token `pos` of sequence b on its owner (in [0, shard_capacity()); same
  /// arguments as owner).
  std::int64_t slot(std::int64_t b, std::int64_t pos) const {
    check_token(b, pos, "slot");
    return layout_.slot(b, pos);
  }
  /// Slots of this rank's cache shard per sequence ([B, shard_capacity, K, D] tensors).
  std::int64_t shard_capacity() const { return shard_capacity_; }
  /// Tokens of sequence b this rank stores once the step's T tokens are appended.
  std::int64_t local_len(std::int64_t b) const { return layout_.count(rank_, b, kv_len(b) + problem_.new_tokens); }
  /// Heads whose merged output this rank returns (all of them with DecodeExchange::all_gather).
  HeadRange out_heads() const { return messages_.out_heads; }
  /// Query heads this rank provides: all heads (all_gather) or its own (heads exchange).
  HeadRange q_heads() const { return messages_.out_heads; }
  /// Bytes this rank sends per step: partial O (D_v wide) and LSE (accumulation type) to the
  /// ranks that merge them, the gathered queries (D wide) in the heads exchange, and an
  /// 8-byte step tag per message that lets every rank detect a step whose lengths disagree.
  std::size_t step_bytes() const { return step_bytes_; }
  /// Workspace bytes of a step.
  std::size_t workspace_bytes() const { return slots_.bytes(); }
  /// Moves every sequence on by `tokens` (after a step: its T tokens are now cache). Local:
  /// every rank must advance alike, and a step detects when they did not. Transactional: it
  /// checks every sequence first, so when it throws (a negative count, or a sequence that
  /// would pass the capacity) the plan is exactly as before.
  void advance(std::int64_t tokens) {
    SEQPAR_CHECK(owner_.get() != 0, ConfigError, "DecodePlan::advance: ", detail::empty_plan_reason);
    SEQPAR_CHECK(tokens >= 0, ConfigError, "DecodePlan::advance: tokens: expected >= 0, got ", tokens);
    for (std::size_t b = 0; b < len_.size(); ++b)  // len_[b] <= capacity: the difference cannot wrap
      SEQPAR_CHECK(tokens <= problem_.capacity - len_[b], ConfigError, "DecodePlan::advance: sequence ", b, " holds ",
                   len_[b], " tokens: ", tokens, " more would pass the capacity ", problem_.capacity,
                   " (the plan is unchanged)");
    for (std::int64_t& len : len_) len += tokens;
    ++step_;
  }
  /// Steps advanced so far.
  std::int64_t steps() const { return step_; }

 private:
  template <class Comm, class Kernel>
  friend class detail::DecodeEngine;

  /// b as an index of the batch; ConfigError naming `call` otherwise.
  std::size_t checked_sequence(std::int64_t b, const char* call) const {
    SEQPAR_CHECK(b >= 0 && b < static_cast<std::int64_t>(len_.size()), ConfigError, "DecodePlan::", call,
                 ": sequence: expected 0..", static_cast<std::int64_t>(len_.size()) - 1, ", got ", b);
    return static_cast<std::size_t>(b);
  }
  /// Checks a (sequence, position) pair of owner() and slot().
  void check_token(std::int64_t b, std::int64_t pos, const char* call) const {
    checked_sequence(b, call);
    SEQPAR_CHECK(pos >= 0 && pos < problem_.capacity, ConfigError, "DecodePlan::", call, ": pos: expected 0..",
                 problem_.capacity - 1, " (below the capacity), got ", pos);
  }

  DecodeProblem problem_;
  CacheLayout layout_;
  int rank_ = 0;
  detail::OwnerId owner_;  // the engine that made it (none: empty, or moved from)
  std::vector<std::int64_t> len_;
  std::int64_t step_ = 0;
  std::int64_t shard_capacity_ = 0;
  detail::StepMessages messages_;     // the exchange's message sizes, fixed (decode/step_exchange.hpp)
  std::size_t step_bytes_ = 0;        // what those send
  WorkspaceLayout slots_;             // where a step's buffers live
  std::vector<std::int64_t> row_key_end_;  // [B x T] per step, filled without allocating
};

}  // namespace seqpar
