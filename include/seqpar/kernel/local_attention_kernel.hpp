#pragma once
/// \file
/// The LocalAttentionKernel concept: what each rank computes on its slice.

#include <algorithm>
#include <concepts>
#include <cstdint>

#include "seqpar/core/error.hpp"
#include "seqpar/core/key_span.hpp"
#include "seqpar/core/mask.hpp"
#include "seqpar/core/paged_cache.hpp"
#include "seqpar/core/sequence_layout.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/types.hpp"

namespace seqpar {

/// Everything a local kernel needs besides the tensors: the scale, the mask as global
/// positions of the query and key rows plus the mask's families, and how local query heads map
/// to local K/V heads.
struct KernelParams {
  double scale = 1.0;          ///< multiplies Q K^T
  /// Soft-cap of the scaled scores: s = softcap * tanh(s / softcap) before the mask and the
  /// softmax (0: off). Only kernels with kernel_supports_softcap are given one.
  double softcap = 0.0;
  bool causal = false;         ///< key j is visible to query i only if k_positions(j) <= q_positions(i)
  PositionMap q_positions;     ///< diagonal position of each query row (its global position, shifted by
                               ///< S_kv - S_q for bottom-right alignment)
  PositionMap k_positions;     ///< global position of each key row
  MaskView mask;               ///< window, documents, key padding (see core/mask.hpp); causal is `causal`
  std::int64_t group_size = 1; ///< query heads per K/V head in the global problem (H / K)
  std::int64_t q_head_begin = 0;  ///< global index of local query head 0
  std::int64_t kv_head_begin = 0; ///< global index of local K/V head 0

  /// Local K/V head that local query head `h` reads.
  constexpr std::int64_t kv_head(std::int64_t h) const { return (q_head_begin + h) / group_size - kv_head_begin; }

  /// The mask with `causal` merged in: what MaskView::keys and row_span read.
  constexpr MaskView full_mask() const {
    MaskView m = mask;
    m.causal = m.causal || causal;
    return m;
  }
  /// The visible key positions of the query with diagonal position `q` in batch element `b`
  /// (every family, causal included): a contiguous range.
  constexpr KeyRange keys(std::int64_t b, std::int64_t q) const { return full_mask().keys(b, q); }
  /// True when key position `k` is visible to query diagonal `q` in batch element `b`.
  constexpr bool visible(std::int64_t b, std::int64_t q, std::int64_t k) const {
    const KeyRange r = keys(b, q);
    return r.lo <= k && k <= r.hi;
  }
  /// The keys local query row `i` of batch element `b` sees among the call's `sk` keys, as
  /// local key indices (core/key_span.hpp: one contiguous run, both ends non-decreasing down
  /// the rows).
  constexpr KeySpan row_span(std::int64_t b, std::int64_t i, std::int64_t sk) const {
    return seqpar::row_span(full_mask(), q_positions, k_positions, sk, b, i);
  }
  /// True when a window, documents or key padding is on (a kernel without
  /// kernel_supports_masks is never given one: the plan refuses it).
  constexpr bool extra_mask() const {
    return mask.window_left >= 0 || mask.window_right >= 0 || mask.doc_count > 0 || mask.kv_valid != nullptr ||
           mask.row_key_end != nullptr;
  }
  /// Checks that a call of `q_rows` query rows and `k_rows` key rows can be placed: with causal
  /// or another mask family on, the mask reads each row's position, so q_positions and
  /// k_positions must hold one for every row (the first q_rows and k_rows are read). A default
  /// PositionMap holds none: every row would see no key, and the output would be zeros, not an
  /// error. Throws ConfigError naming `call` otherwise; the engines always set them.
  void check_positions(std::int64_t q_rows, std::int64_t k_rows, const char* call) const {
    if (!full_mask().any()) return;
    SEQPAR_CHECK(q_positions.size() >= q_rows && k_positions.size() >= k_rows, ConfigError, call,
                 ": a mask is on, so KernelParams.q_positions and k_positions must hold a position for every row: "
                 "expected at least ", q_rows, " and ", k_rows, ", got ", q_positions.size(), " and ",
                 k_positions.size(), " (e.g. PositionMap::run(rows, first position))");
  }
};

/// The largest kernel call a plan will make: a kernel with `reserve(bounds)` sizes whatever
/// scratch depends on the call's shape for it when the plan is made, so that no later call of
/// that plan allocates (calls never exceed any field).
struct KernelCallBounds {
  std::int64_t batch = 0;       ///< B
  std::int64_t q_rows = 0;      ///< most query rows of one call
  std::int64_t heads = 0;       ///< most query heads of one call
  std::int64_t kv_rows = 0;     ///< most key rows of one call
  std::int64_t kv_heads = 0;    ///< most K/V heads of one call
  std::int64_t group_size = 1;  ///< query heads per K/V head in the problem (H / K)
  std::int64_t head_dim = 0;    ///< D
  bool backward = false;        ///< backward calls too (the plan has with_lse)
  std::int64_t value_dim = 0;   ///< D_v of V and O (0: D); last, so that positional initialisers keep their meaning
};

/// Opt-in for LocalAttentionKernel: true when the type declares
/// `static constexpr bool is_seqpar_kernel = true;`.
template <class K>
inline constexpr bool enable_kernel = requires { requires K::is_seqpar_kernel; };

/// A LocalAttentionKernel computes attention of local queries against one block of keys.
/// Requirements, for element type T, A = acc_t<T> and Space = K::memory_space:
/// - opt-in: `enable_kernel<K>`;
/// - `typename K::memory_space`: where its tensors live; SequenceParallelAttention also
///   requires it to equal the communicator's;
/// - `K` is move-constructible (the engine owns its copy), and default-constructible when
///   SequenceParallelAttention is not given one;
/// - `k.forward(q, k, v, out, lse, params)` with q, k, v `TensorView<const T, Space>`
///   ([B, Sq, H, D], [B, Sk, Hkv, D], [B, Sk, Hkv, D_v]), out `TensorView<T, Space>` [B, Sq, H, D_v]
///   and lse `TensorView<A, Space>` [B, Sq, H, 1] (may be absent: then not written). It writes
///   out = softmax(q k^T * scale + mask) v and lse = natural-log sum of exp of the visible
///   scores, per row; a row that sees no key gets out = 0 and lse = -inf, never NaN, and a NaN
///   in a row stays in that row. Query head h reads K/V head params.kv_head(h). Batch element b
///   of the view is batch element b of the problem (key padding and per-batch documents use it);
/// - views may have any strides with head_dim contiguous (the engine passes packed
///   [S, B, H, D] blocks), any extent may be 0, and positions strictly increase within a call
///   (a kernel may stop at the first key tile a causal mask hides);
/// - backward (only for SequenceParallelAttention::backward, see kernel_has_backward):
///   `k.backward(dout, q, k, v, out, lse, dq, dk, dv, params)` with dout, out
///   `TensorView<const T, Space>` [B, Sq, H, D_v], lse `TensorView<const A, Space>` [B, Sq, H, 1]
///   (the LSE of the *whole* attention, not of this block), and dq [B, Sq, H, D], dk
///   [B, Sk, Hkv, D], dv [B, Sk, Hkv, D_v] as `TensorView<A, Space>`: it ADDS this key
///   block's contribution to dq, dk and dv (so ring steps and the query heads sharing a K/V
///   head accumulate). It recomputes
///   the probabilities as exp(q k^T * scale - lse); rows with lse = -inf contribute nothing;
/// - masks: key j is visible to query i iff params.visible(b, q_positions(i), k_positions(j));
///   the visible keys of a row are one contiguous range (params.keys), one run of local key
///   indices (params.row_span, core/key_span.hpp). A kernel that handles windows, documents
///   and key padding declares `static constexpr bool supports_masks = true`
///   (kernel_supports_masks); without it, plans with those masks are refused (causal, of
///   either alignment, needs nothing: q_positions already carry the alignment). Hidden keys
///   must never be read into a row: a NaN stored there stays out;
/// - features of today's models, each declared by the kernel that has it, refused by plan
///   (naming it) for one that does not: `supports_softcap` (params.softcap > 0: every visible
///   score s becomes softcap * tanh(s / softcap) after the scale, and backward multiplies dS
///   by 1 - (s / softcap)^2 of the capped s) and `supports_value_dim` (v, out, dout have head
///   dim D_v = v.dim(), which may differ from q's and k's D; dq and dk keep D). Attention sinks
///   need nothing from a kernel: the engine applies them after the merge;
/// - optional, a paged cache (kernel_supports_paged): `k.forward_paged(q, cache, rows, out,
///   lse, params)` with q `TensorView<const T, Space>` [1, R, H, D] (packed rows, sequence b's
///   at rows [rows.begin[b], rows.begin[b + 1])), cache `PagedKV<T, Space>` (core/
///   paged_cache.hpp: pools and block table), out [1, R, H, D_v] and lse [1, R, H, 1] as
///   `TensorView<A, Space>`: row r of sequence b attends the sequence's local slots
///   [0, rows.key_end[r]) read in place from the pages, with params' scale, softcap and head
///   map (its mask and positions are unused); rows seeing no slot get O = 0, LSE = -inf.
///   Without it, PagedDecode calls `forward` once per run of pages;
/// - optional: `k.prepare(max_head_dim)` (and `k.prepare_backward(max_head_dim)`) is called when
///   a plan is made, so that forward (backward) allocates nothing, and so is
///   `k.reserve(const KernelCallBounds&)`, with the largest call the plan will make, for
///   scratch that depends on the shape (CpuFlashKernel's threaded backward and decode
///   partials); a forward that also accepts
///   `out` of type `TensorView<A, Space>` lets ring policies keep partial outputs in A.
/// The concept checks the forward's syntax; the semantics above are what the policies rely on.
/// examples/custom_kernel.hpp is a kernel that meets every rule.
template <class K, class T>
concept LocalAttentionKernel =
    enable_kernel<K> &&
    requires(K& kern, TensorView<const T, typename K::memory_space> in, TensorView<T, typename K::memory_space> out,
             TensorView<acc_t<T>, typename K::memory_space> lse, const KernelParams& p) {
      typename K::memory_space;
      kern.forward(in, in, in, out, lse, p);
    };

/// True when kernel K has the backward the concept's doc comment describes.
template <class K, class T>
inline constexpr bool kernel_has_backward =
    requires(K& kern, TensorView<const T, typename K::memory_space> in,
             TensorView<const acc_t<T>, typename K::memory_space> lse,
             TensorView<acc_t<T>, typename K::memory_space> grad, const KernelParams& p) {
      kern.backward(in, in, in, in, in, lse, grad, grad, grad, p);
    };

/// True when kernel K handles windows, documents and key padding (not only causal masks).
template <class K>
inline constexpr bool kernel_supports_masks = requires { requires K::supports_masks; };

/// Sizes a kernel's per-head-dim scratch, forward and backward, for rows of `head_dim` (Q, K)
/// and `value_dim` (V, O): with both dims where the kernel takes them, else the wider one.
template <class K>
void prepare_for(K& kernel, std::int64_t head_dim, std::int64_t value_dim) {
  const std::int64_t widest = std::max(head_dim, value_dim);
  if constexpr (requires { kernel.prepare(head_dim, value_dim); })
    kernel.prepare(head_dim, value_dim);
  else if constexpr (requires { kernel.prepare(head_dim); })
    kernel.prepare(widest);
  if constexpr (requires { kernel.prepare_backward(head_dim, value_dim); })
    kernel.prepare_backward(head_dim, value_dim);
  else if constexpr (requires { kernel.prepare_backward(head_dim); })
    kernel.prepare_backward(widest);
}

/// True when kernel K applies KernelParams::softcap, forward and backward.
template <class K>
inline constexpr bool kernel_supports_softcap = requires { requires K::supports_softcap; };

/// True when kernel K takes V (and writes O) with a head dimension other than Q's and K's.
template <class K>
inline constexpr bool kernel_supports_value_dim = requires { requires K::supports_value_dim; };

/// True when kernel K attends a paged cache in place (forward_paged, see LocalAttentionKernel).
template <class K, class T>
inline constexpr bool kernel_supports_paged =
    requires(K& kern, TensorView<const T, typename K::memory_space> q, const PagedKV<T, typename K::memory_space>& c,
             const PagedRows& rows, TensorView<acc_t<T>, typename K::memory_space> o, const KernelParams& p) {
      kern.forward_paged(q, c, rows, o, o, p);
    };

/// True when kernel K can write its output directly in the accumulation type.
template <class K, class T>
inline constexpr bool kernel_writes_acc =
    requires(K& kern, TensorView<const T, typename K::memory_space> in,
             TensorView<acc_t<T>, typename K::memory_space> out, const KernelParams& p) {
      kern.forward(in, in, in, out, out, p);
    };

}  // namespace seqpar
