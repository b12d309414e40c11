#pragma once
/// \file
/// Plan building and validation. `plan` is collective: every rank contributes the fields it
/// must agree on (PlanField) in one host all-gather, and every rank then runs the same checks
/// on the same gathered copy, so all reach the same verdict and throw the same message (none
/// hangs waiting for a rank that threw). The shape rules themselves are `shape_reason`, a pure
/// function: `can_implement` asks it without communicating, and `plan` throws its answer. The
/// rules every policy shares are here; each phase brings its own (policy/phase.hpp), and the
/// plan's schedule is the sum of the phases the policy lists.

#include <algorithm>
#include <array>
#include <cmath>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "seqpar/core/agreement.hpp"
#include "seqpar/core/checked.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/policy/phase.hpp"
#include "seqpar/policy/policies.hpp"

namespace seqpar {

/// The answer of can_implement: whether a shape runs, and if not why, in plan's words.
struct Implementable {
  bool ok = true;      ///< true: plan would accept the shape
  std::string reason;  ///< why not (empty when ok)
  /// True when the shape runs.
  explicit operator bool() const { return ok; }
};

namespace detail {

/// Every field ranks must agree on, gathered once per plan.
enum PlanField : int {
  f_batch, f_heads, f_kv_heads, f_head_dim, f_causal, f_dtype, f_scale, f_with_lse,
  f_causal_align, f_window_left, f_window_right, f_documents, f_kv_valid, f_head_dim_v, f_softcap, f_sinks,
  f_ulysses, f_ring, f_placement, f_layout, f_anything, f_q_len, f_kv_len, f_count
};
inline constexpr const char* plan_field_names[f_count] = {
    "batch", "heads", "kv_heads", "head_dim", "causal", "dtype", "scale", "with_lse",
    "causal_align", "window.left", "window.right", "documents", "kv_valid", "head_dim_v", "softcap",
    "sinks (given or not)", "ulysses_degree", "ring_degree", "placement", "layout", "anything (AnythingPolicy)",
    "q_len", "kv_len"};

inline constexpr int plan_agreed_fields = f_q_len;  // fields before this one must match

/// This rank's contribution to the gather. (softcap + 0.0: a soft-cap of -0.0, off as 0.0 is,
/// gathers as 0.0, so that ranks meaning the same agree.)
inline std::array<std::int64_t, f_count> plan_fields(const AttentionProblem& pr, const MeshConfig& m, LocalLengths l) {
  return {pr.batch, pr.heads, pr.kv_head_count(), pr.head_dim, pr.causal, static_cast<std::int64_t>(pr.dtype),
          std::bit_cast<std::int64_t>(pr.softmax_scale()), pr.with_lse, static_cast<std::int64_t>(pr.causal_align),
          pr.window.left, pr.window.right, hash_lists(pr.documents), hash_lists({pr.kv_valid}), pr.value_dim(),
          std::bit_cast<std::int64_t>(pr.softcap + 0.0), pr.sinks != nullptr, m.ulysses, m.ring,
          static_cast<std::int64_t>(m.placement), static_cast<std::int64_t>(m.layout), m.anything, l.q, l.kv_count()};
}

/// A gathered field's value as a reader wants it: a number, a name or true/false.
inline std::string field_value(int field, std::int64_t v) {
  std::ostringstream os;
  switch (field) {
    case f_scale: case f_softcap: os << std::bit_cast<double>(v); break;
    case f_dtype: os << dtype_name(static_cast<DType>(v)); break;
    case f_layout: os << layout_name(static_cast<LayoutKind>(v)); break;
    case f_placement: os << (v == 0 ? "ulysses_adjacent" : "ring_adjacent"); break;
    case f_causal_align: os << (v == 0 ? "top_left" : "bottom_right"); break;
    case f_causal: case f_with_lse: case f_anything: case f_sinks: os << (v ? "true" : "false"); break;
    default: os << v;
  }
  return os.str();
}

/// The first agreed field on which some rank differs from rank 0, or -1 when all agree.
inline int first_disagreeing_field(const std::vector<std::int64_t>& all, int world) {
  for (int f = 0; f < plan_agreed_fields; ++f)
    for (int w = 1; w < world; ++w)
      if (all[w * f_count + f] != all[f]) return f;
  return -1;
}

/// "" when every rank agrees on the agreed fields, else which ranks differ from rank 0. The
/// list fields (documents, kv_valid) are gathered as hashes: for those the engine gathers the
/// lists themselves to name the entry that differs (core/agreement.hpp), and this says only
/// that they differ.
inline std::string disagreement_reason(const std::vector<std::int64_t>& all, int world) {
  const int f = first_disagreeing_field(all, world);
  if (f < 0) return "";
  std::string who;
  for (int w = 1; w < world; ++w)
    if (all[w * f_count + f] != all[f])
      who += ", rank " + std::to_string(w) + (f == f_documents || f == f_kv_valid ? " differs" : " has " + field_value(f, all[w * f_count + f]));
  const std::string rank0 = f == f_documents || f == f_kv_valid ? "" : ": rank 0 has " + field_value(f, all[f]);
  return std::string("plan: ranks disagree on ") + plan_field_names[f] + rank0 + who;
}

/// Every buffer of a call (tensors, all-to-all pieces, ring blocks, workspace slots) holds at
/// most twice batch x global length x heads x max(head_dim, head_dim_v) elements of at most 8
/// bytes (a [K | V] block). Requiring the product below 2^58 bytes leaves a factor of 32 for
/// the sums of such sizes a plan forms (a workspace adds a few dozen slots, most of them a
/// rank's share), so every size stays inside 64 bits; the reason names the fields, so a size
/// never wraps silently. The number of scores, batch x heads x query length x key length, is
/// bounded at 2^62, so that counts of visible pairs cannot wrap either.
inline std::string size_reason(const AttentionProblem& pr, std::span<const std::int64_t> q_len,
                               std::span<const std::int64_t> kv_len) {
  constexpr std::int64_t limit = std::int64_t{1} << 58;
  const std::optional<std::int64_t> sq = checked_sum(q_len), skv = checked_sum(kv_len);
  if (!sq || !skv)
    return std::string("plan: size overflow: the ranks' local ") + (sq ? "kv" : "q") +
           " lengths sum past 2^63 tokens";
  const std::int64_t heads = std::max(pr.heads, pr.kv_head_count());
  // The widest row of any tensor (V and O have head_dim_v); the name says which it is.
  const std::int64_t dim = std::max(pr.head_dim, pr.value_dim());
  const std::string dim_name = (pr.value_dim() > pr.head_dim ? " x head_dim_v " : " x head_dim ") + std::to_string(dim);
  // One token's rows first: loops over the batch and the heads must stay bounded even when
  // the sequence is empty (and every tensor with it).
  const std::int64_t per_token[] = {8, pr.batch, heads, dim};
  const std::optional<std::int64_t> token_bytes = checked_product(per_token);
  std::ostringstream why;
  if (!token_bytes || *token_bytes > limit) {
    why << "plan: size overflow: batch " << pr.batch << " x heads " << heads << dim_name
        << " x 8 bytes (one token's rows) exceeds the 2^58-byte limit on one tensor, whatever the length";
    return why.str();
  }
  const std::optional<std::int64_t> bytes = checked_mul(*token_bytes, std::max(*sq, *skv));
  if (!bytes || *bytes > limit) {
    why << "plan: size overflow: batch " << pr.batch << " x global length " << std::max(*sq, *skv) << " x heads "
        << heads << dim_name << " x 8 bytes exceeds the 2^58-byte limit on one tensor";
    return why.str();
  }
  // The score count (Plan::work, the cost model's pairs) must fit too: every rank's and ring
  // step's share is at most this product. 2^62 scores is days of any machine's compute.
  const std::int64_t scores[] = {pr.batch, pr.heads, *sq, *skv};
  const std::optional<std::int64_t> count = checked_product(scores);
  if (count && *count <= (std::int64_t{1} << 62)) return "";
  why << "plan: size overflow: batch " << pr.batch << " x heads " << pr.heads << " x query length " << *sq
      << " x key length " << *skv << " (the number of scores) exceeds 2^62";
  return why.str();
}

/// The mask rules: "" when the mask description is valid for these lengths, else the reason.
inline std::string mask_reason(const AttentionProblem& pr, std::span<const std::int64_t> q_len,
                               std::span<const std::int64_t> kv_len) {
  // size_reason ran first: the sums fit.
  const std::int64_t sq = checked_sum(q_len).value_or(0), skv = checked_sum(kv_len).value_or(0);
  std::ostringstream why;
  const auto B = static_cast<std::size_t>(pr.batch);
  if (pr.causal_align != CausalAlign::top_left && pr.causal_align != CausalAlign::bottom_right)
    why << "plan: causal_align: expected top_left or bottom_right, got " << static_cast<int>(pr.causal_align);
  else if (pr.window.left < -1 || pr.window.right < -1)
    why << "plan: window: expected sides >= 0 (any size; one past the sequence hides nothing), or -1 for "
           "unbounded, got {"
        << pr.window.left << ", " << pr.window.right << "}";
  else if (!pr.documents.empty() && pr.documents.size() != 1 && pr.documents.size() != B)
    why << "plan: documents: expected one list shared by every batch element or one per batch element (" << B
        << "), got " << pr.documents.size() << " lists";
  else if (!pr.documents.empty() && sq != skv)
    why << "plan: documents need equal query and key/value lengths, got " << sq << " and " << skv;
  else if (!pr.kv_valid.empty() && pr.kv_valid.size() != B)
    why << "plan: kv_valid: expected one count per batch element (" << B << "), got " << pr.kv_valid.size();
  if (!why.str().empty()) return why.str();
  for (std::size_t b = 0; b < pr.documents.size(); ++b) {
    std::int64_t total = 0;
    for (std::size_t d = 0; d < pr.documents[b].size(); ++d) {
      const std::int64_t n = pr.documents[b][d];
      if (n < 1)
        return "plan: documents[" + std::to_string(b) + "][" + std::to_string(d) + "]: expected a length >= 1, got " +
               std::to_string(n) + " (empty documents are not allowed)";
      // Stop at the first document past the sequence: the sum cannot come back down, and a
      // later one could wrap it.
      const std::optional<std::int64_t> next = checked_add(total, n);
      if (!next || *next > sq)
        return "plan: documents[" + std::to_string(b) + "]: lengths up to documents[" + std::to_string(b) + "][" +
               std::to_string(d) + "] sum past the global sequence length " + std::to_string(sq);
      total = *next;
    }
    if (total != sq)
      return "plan: documents[" + std::to_string(b) + "]: lengths sum to " + std::to_string(total) +
             ", expected the global sequence length " + std::to_string(sq);
  }
  for (std::size_t b = 0; b < pr.kv_valid.size(); ++b)
    if (pr.kv_valid[b] < 0 || pr.kv_valid[b] > skv)
      return "plan: kv_valid[" + std::to_string(b) + "]: expected 0.." + std::to_string(skv) + " (the key length), got " +
             std::to_string(pr.kv_valid[b]);
  return "";
}

/// The value rules of today's models' features, shared by the attention and the decode plans:
/// "" when `pr.head_dim_v` and `pr.softcap` (0, or 2^-32..2^32) are legal, else the reason, after `who` ("plan: ").
template <class Problem>
std::string feature_values_reason(const Problem& pr, std::string_view who) {
  std::ostringstream why;
  if (pr.head_dim_v < 0) why << who << "head_dim_v: expected >= 1, or 0 for head_dim, got " << pr.head_dim_v;
  else if (!(pr.softcap == 0 || (pr.softcap >= 0x1p-32 && pr.softcap <= 0x1p32)))
    // Kernels fold 1 / cap into the scale and keep the cap in the element type (bf16, half):
    // caps past 2^+-32 would leave their range, and no model uses one.
    why << who << "softcap: expected 0 (off) or a number from 2^-32 to 2^32, got " << pr.softcap;
  return why.str();
}

/// The shape rules of a resolved mesh under the phases `Phases`: "" when `problem` with these
/// per-rank lengths (indexed by world rank) runs, else the reason (naming the rule and the fix).
/// The rules every policy shares come first, then each phase's, in list order; AnythingPolicy
/// lifts the divisibility rules, the shared ones and the phases'.
template <class Phases>
std::string shape_reason(const MeshConfig& mesh, const AttentionProblem& problem, std::span<const std::int64_t> q_len,
                         std::span<const std::int64_t> kv_len) {
  const std::int64_t B = problem.batch, H = problem.heads, K = problem.kv_head_count(), D = problem.head_dim;
  const int world = static_cast<int>(q_len.size());
  std::ostringstream why;
  const double scale = problem.softmax_scale();
  if (B < 0) why << "plan: batch: expected >= 0, got " << B;
  else if (H < 1) why << "plan: heads: expected >= 1, got " << H;
  else if (K < 1 || H % K != 0) why << "plan: kv_heads: expected a divisor of heads " << H << ", got " << K;
  else if (D < 1) why << "plan: head_dim: expected >= 1, got " << D;
  else if (const std::string f = feature_values_reason(problem, "plan: "); !f.empty()) why << f;
  else if (!std::isfinite(scale) || std::abs(scale) > scale_limit)
    why << "plan: scale: expected a finite number with |scale| <= 2^32 (or 0 for 1/sqrt(head_dim)), got "
        << problem.scale;
  else if (static_cast<int>(problem.dtype) > static_cast<int>(DType::f64))
    why << "plan: dtype: expected f16, bf16, f32 or f64, got " << static_cast<int>(problem.dtype);
  if (!why.str().empty()) return why.str();
  for (int w = 0; w < world; ++w)
    if (q_len[w] < 0 || kv_len[w] < 0)
      return "plan: rank " + std::to_string(w) + " gives negative local lengths (q " + std::to_string(q_len[w]) +
             ", kv " + std::to_string(kv_len[w]) + ")";
  const std::string size = size_reason(problem, q_len, kv_len);
  if (!size.empty()) return size;
  const std::string mask = mask_reason(problem, q_len, kv_len);
  if (!mask.empty()) return mask;
  if (std::string phases = Phases::reason(mesh, problem, q_len, kv_len); !phases.empty()) return phases;
  if (mesh.anything) return "";
  const std::string fix = anything_fix(mesh);
  for (int w = 0; w < world; ++w) {
    if (q_len[w] != q_len[0])
      return std::string("plan: ") + mesh.policy + " needs the same local length on every rank (global length " +
             "divisible by the world size " + std::to_string(world) + "): rank 0 holds " + std::to_string(q_len[0]) +
             " tokens, rank " + std::to_string(w) + " holds " + std::to_string(q_len[w]) + fix;
    if (kv_len[w] != q_len[w])
      return std::string("plan: ") + mesh.policy + " needs kv_len == q_len, rank " + std::to_string(w) + " has q " +
             std::to_string(q_len[w]) + " kv " + std::to_string(kv_len[w]) +
             " (joint and cross attention need AnythingPolicy)" + fix;
  }
  return Phases::divisibility_reason(mesh, problem, q_len, kv_len);
}

/// The kernel's share of the feature rules, shared by the attention and the decode plans: ""
/// when kernel K can take `pr`'s soft-cap and value head dim, else the reason after `who`,
/// naming the trait the kernel lacks.
template <class Kernel, class Problem>
std::string kernel_features_reason(const Problem& pr, std::string_view who) {
  if (pr.softcap > 0 && !kernel_supports_softcap<Kernel>)
    return std::string(who) + "this kernel does not soft-cap logits (softcap " + std::to_string(pr.softcap) +
           "): a kernel declares supports_softcap = true when it does; ReferenceKernel, CpuFlashKernel and "
           "CudaFlashKernel do";
  if (pr.value_dim() != pr.head_dim && !kernel_supports_value_dim<Kernel>)
    return std::string(who) + "this kernel needs V's head dim equal to Q's and K's (head_dim " +
           std::to_string(pr.head_dim) + ", head_dim_v " + std::to_string(pr.value_dim()) +
           "): a kernel declares supports_value_dim = true when it takes another; ReferenceKernel, CpuFlashKernel "
           "and CudaFlashKernel do";
  return "";
}

/// The kernel's share of the shape rules: "" when kernel K can take `problem`'s mask and
/// features, else the reason, naming what the kernel lacks. Windows, documents and key padding
/// need `supports_masks`; causal (of either alignment) needs nothing; soft-capping needs
/// `supports_softcap`, a head_dim_v other than head_dim `supports_value_dim`; sinks need
/// nothing (the engine joins them after the merge).
template <class Kernel>
std::string kernel_reason(const AttentionProblem& problem) {
  if (problem.has_extra_mask() && !kernel_supports_masks<Kernel>)
    return "plan: this kernel handles causal masks only, not windows, documents or key padding (a kernel "
           "declares supports_masks = true when it does; ReferenceKernel does)";
  return kernel_features_reason<Kernel>(problem, "plan: ");
}

/// Builds this rank's plan from the gathered fields (validated already): its layouts and heads,
/// then the schedule, the sum of the phases `Phases` that take part.
template <class Phases>
Plan build_plan(const std::vector<std::int64_t>& all, const AttentionProblem& problem, const MeshConfig& mesh, int me,
                std::uint64_t owner) {
  const int world = mesh.world(), U = mesh.ulysses, R = mesh.ring;
  std::vector<std::int64_t> qlen(static_cast<std::size_t>(world)), kvlen(static_cast<std::size_t>(world));
  for (int w = 0; w < world; ++w) {
    const auto m = static_cast<std::size_t>(mesh.ring_rank(w) * U + mesh.ulysses_rank(w));
    qlen[m] = all[w * f_count + f_q_len];
    kvlen[m] = all[w * f_count + f_kv_len];
  }
  const std::int64_t H = problem.heads, G = problem.heads / problem.kv_head_count();
  std::vector<HeadRange> q_heads, kv_heads;
  std::int64_t begin = 0;
  for (std::int64_t count : split_evenly(H, U)) {
    q_heads.push_back({begin, count});
    const std::int64_t kb = begin / G, ke = count > 0 ? (begin + count - 1) / G + 1 : kb;
    kv_heads.push_back({kb, ke - kb});
    begin += count;
  }
  AttentionProblem agreed = problem;
  agreed.kv_heads = problem.kv_head_count();
  Plan p;
  PlanAccess::fill(p, agreed, mesh, me, owner, SequenceLayout(mesh.layout, R, U, qlen),
                   SequenceLayout(mesh.layout, R, U, kvlen), std::move(q_heads), std::move(kv_heads),
                   dtype_bytes(problem.dtype), acc_bytes(problem.dtype));

  Phases::schedule(p);
  return p;
}

}  // namespace detail

/// Would `problem` run under `policy` with these local lengths (one per world rank, in world
/// rank order)? A pure function: no communication, nothing allocated on a device. The answer
/// says why not in the words `plan` would throw (plan runs the same checks).
template <class Policy>
Implementable can_implement(const Policy& policy, const AttentionProblem& problem,
                            std::span<const LocalLengths> all_local_lengths) {
  MeshConfig mesh = mesh_request(policy);
  std::string why = resolve_mesh_reason(mesh, static_cast<int>(all_local_lengths.size()));
  if (why.empty()) {
    std::vector<std::int64_t> q, kv;
    for (const LocalLengths& l : all_local_lengths) {
      q.push_back(l.q);
      kv.push_back(l.kv_count());
    }
    why = detail::shape_reason<policy_phases_of<Policy>>(mesh, problem, q, kv);
  }
  return {why.empty(), why};
}

}  // namespace seqpar
