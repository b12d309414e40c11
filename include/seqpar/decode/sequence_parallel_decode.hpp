#pragma once
/// \file
/// SequenceParallelDecode<Comm, Kernel>: one decode step over a KV cache sharded across the
/// ranks (decode/decode_plan.hpp has the layouts and the plan).
///
/// A step: (heads exchange only: all-gather the queries, each rank holding its heads), the
/// local kernel attends the step's queries to this rank's shard (every row limited to the
/// slots whose positions it may see: the cache before it and the step's earlier tokens), one
/// all-to-all moves the partial (O, LSE) pieces in the accumulation type to the ranks that
/// merge them, and each merges its pieces in rank order with merge_row. Nothing is allocated
/// and no metadata is exchanged: every message carries one 8-byte tag of the step (its lengths
/// and count), so a rank whose plan advanced differently is named on every rank instead of
/// merging garbage or hanging.
///
/// The same step runs on host memory and on a device (a CudaSpace communicator with
/// CudaFlashKernel): every byte of the buffers moves through TensorOps (the tags too: a fill of
/// the workspace's tag slot, then 8-byte copies into and out of the messages), the merge is
/// ops().merge, and the per-row key ends stay in the plan's host memory, where a device kernel
/// takes them from (CudaFlashKernel's DeviceMaskTables copies them to the device when they
/// change, that is once per step). The received tags are gathered behind this rank's own in
/// the tag slot and read back in one copy of at most 2P x 8 bytes; on a device that copy is a
/// device-to-host transfer and a wait on ops().stream(), once per step, before the merge (the
/// price of naming a disagreeing rank on the host; the merge and the output copy are then
/// enqueued without a wait). Put the kernel, the ops and the communicator on one stream.

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/core/agreement.hpp"
#include "seqpar/core/checked.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/workspace.hpp"
#include "seqpar/decode/decode_plan.hpp"
#include "seqpar/ops/host_ops.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"

namespace seqpar {
namespace detail {

/// The decode engine; SequenceParallelDecode is its public face.
template <class Comm, class Kernel>
class DecodeEngine {
  static_assert(std::is_same_v<typename Comm::memory_space, typename Kernel::memory_space>,
                "SequenceParallelDecode: the communicator and the kernel work in different memory spaces "
                "(e.g. a HostSpace communicator with a CudaSpace kernel)");

 public:
  using Space = typename Comm::memory_space;  ///< where tensors live

  DecodeEngine(Comm& world, Kernel kernel) : world_(world), kernel_(std::move(kernel)) {}

  /// Collective: every rank gives the same problem; all validate the gathered copy alike.
  DecodePlan plan(const DecodeProblem& pr) {
    const int P = world_.size(), me = world_.rank();
    const std::int64_t mine[] = {pr.batch, pr.heads, pr.kv_head_count(), pr.head_dim,
                                 static_cast<std::int64_t>(pr.dtype), std::bit_cast<std::int64_t>(pr.scale),
                                 pr.new_tokens, pr.capacity, pr.page, static_cast<std::int64_t>(pr.exchange),
                                 hash_lists({pr.kv_len})};
    static constexpr const char* names[] = {"batch", "heads", "kv_heads", "head_dim", "dtype", "scale",
                                            "new_tokens", "capacity", "page", "exchange", "kv_len"};
    constexpr int n = static_cast<int>(std::size(mine)), f_kv_len = n - 1;
    std::vector<std::int64_t> all(static_cast<std::size_t>(n * P));
    world_.all_gather_host(std::span<const std::int64_t>(mine, n), all);
    for (int f = 0; f < n; ++f)
      for (int w = 1; w < P; ++w) {
        if (all[w * n + f] == all[f]) continue;
        // kv_len travels as a hash: every rank sees the mismatch, and all gather the lengths.
        if (f == f_kv_len) SEQPAR_THROW(ConfigError, list_disagreement(world_, "decode plan: ", "kv_len", {pr.kv_len}, true));
        if (f == 5)  // the scale travels as its bits
          SEQPAR_THROW(ConfigError, "decode plan: ranks disagree on scale: rank 0 has ", std::bit_cast<double>(all[f]),
                       ", rank ", w, " has ", std::bit_cast<double>(all[w * n + f]));
        SEQPAR_THROW(ConfigError, "decode plan: ranks disagree on ", names[f], ": rank 0 has ", all[f], ", rank ", w,
                     " has ", all[w * n + f]);
      }
    check_problem(pr);

    DecodePlan p;
    p.problem_ = pr;
    p.problem_.kv_heads = pr.kv_head_count();
    p.layout_ = CacheLayout(P, pr.page, pr.kv_len);
    p.rank_ = me;
    p.owner_ = id_;
    p.len_ = pr.kv_len;
    for (std::int64_t b = 0; b < pr.batch; ++b)
      p.shard_capacity_ = std::max(p.shard_capacity_, p.layout_.count(me, b, pr.capacity));
    std::int64_t begin = 0;
    for (std::int64_t count : split_evenly(pr.heads, P)) {
      p.heads_of_.push_back({begin, count});
      begin += count;
    }
    p.out_heads_ = pr.exchange == DecodeExchange::heads ? p.heads_of_[static_cast<std::size_t>(me)]
                                                         : HeadRange{0, pr.heads};
    p.row_key_end_.assign(static_cast<std::size_t>(pr.batch * pr.new_tokens), 0);
    p.tags_.assign(static_cast<std::size_t>(2 * P), 0);
    p.pieces_ = pieces(p);
    p.slots_ = layout(p);
    if constexpr (requires { kernel_.prepare(std::int64_t{}); }) kernel_.prepare(pr.head_dim);
    if constexpr (requires { kernel_.reserve(KernelCallBounds{}); })  // every step: T rows against the shard
      kernel_.reserve({pr.batch, pr.new_tokens, pr.heads, p.shard_capacity_, p.problem_.kv_heads,
                       pr.heads / p.problem_.kv_heads, pr.head_dim, false});
    return p;
  }

  /// One step (see the file comment). q: [B, T, q_heads, D]; k_cache, v_cache: [B,
  /// shard_capacity, K, D] with the step's new K/V already in their slots; out: [B, T,
  /// out_heads, D]. The plan is not advanced (advance it once the step's tokens are cache).
  template <class T>
  void step(DecodePlan& p, TensorView<const T, Space> q, TensorView<const T, Space> k_cache,
            TensorView<const T, Space> v_cache, TensorView<T, Space> out, std::span<std::byte> workspace) {
    using A = acc_t<T>;
    static_assert(LocalAttentionKernel<Kernel, T>, "seqpar: the kernel does not model LocalAttentionKernel for T");
    static_assert(kernel_supports_masks<Kernel>,
                  "seqpar: decode limits each query row to its own visible cache slots: the kernel needs "
                  "supports_masks (ReferenceKernel has it)");
    const DecodeProblem& pr = p.problem_;
    SEQPAR_CHECK(p.owner_ == id_, ConfigError, "decode step: the plan was made by another SequenceParallelDecode");
    SEQPAR_CHECK(dtype_v<T> == pr.dtype, ConfigError, "decode step: element type: the plan was made for ",
                 dtype_name(pr.dtype), ", got ", dtype_name(dtype_v<T>));
    const std::int64_t B = pr.batch, Tn = pr.new_tokens, H = pr.heads, K = pr.kv_heads, D = pr.head_dim;
    const std::int64_t C = p.shard_capacity_;
    check_view(q, "decode step: q", B, Tn, p.q_heads().count, D, false);
    check_view(k_cache, "decode step: k_cache", B, C, K, D, false);
    check_view(v_cache, "decode step: v_cache", B, C, K, D, false);
    check_view(out, "decode step: out", B, Tn, p.out_heads().count, D, true);
    for (std::int64_t b = 0; b < B; ++b)
      SEQPAR_CHECK(p.kv_len(b) <= pr.capacity - Tn, ConfigError, "decode step: sequence ", b, " holds ", p.kv_len(b),
                   " tokens: the step's ", Tn, " would exceed the capacity ", pr.capacity);
    const auto& slots = p.slots_;
    SEQPAR_CHECK(workspace.size() >= slots.bytes(), ConfigError, "decode step: workspace: expected at least ",
                 slots.bytes(), " bytes (plan.workspace_bytes()), got ", workspace.size());
    CallGuard<Comm> call("an exception left a decode step after its communication began", world_);
    const DecodePieces& sz = p.pieces_;
    const std::int64_t tag = step_tag(p);
    const int P = world_.size(), me = world_.rank();
    // tags[0]: this step's tag; then those received with the partials (P) and the queries (P).
    auto* tags = slots.template get<std::byte>(workspace, s_tags);
    ops_.fill(TensorView<std::int64_t, Space>::bshd(reinterpret_cast<std::int64_t*>(tags), 1, 1, 1, 1), tag);
    auto tag_at = [&](int i) { return tags + static_cast<std::size_t>(i) * sizeof tag; };
    const bool gather_q = pr.exchange == DecodeExchange::heads && P > 1;

    // Queries: all heads, in a [B, T, H, D] tensor.
    TensorView<const T, Space> qa = q;
    if (gather_q) {
      std::byte* send = slots.template get<std::byte>(workspace, s_q_send);
      std::byte* recv = slots.template get<std::byte>(workspace, s_q_recv);
      ops_.copy(q, TensorView<T, Space>::bshd(reinterpret_cast<T*>(send), B, Tn, p.q_heads().count, D));
      copy_tag(tag_at(0), send + sz.q[me] - sizeof tag);
      world_.all_to_all_v(send, sz.q_send_counts, sz.zero, recv, sz.q, sz.q_displs);
      T* full = slots.template get<T>(workspace, s_q_full);
      for (int v = 0; v < P; ++v) {
        copy_tag(recv + sz.q_displs[v] + sz.q[v] - sizeof tag, tag_at(1 + P + v));
        const HeadRange h = p.heads_of_[static_cast<std::size_t>(v)];
        ops_.copy(TensorView<const T, Space>::bshd(reinterpret_cast<const T*>(recv + sz.q_displs[v]), B, Tn, h.count, D),
                  TensorView<T, Space>::bshd(full, B, Tn, H, D).slice_heads(h.begin, h.count));
      }
      qa = TensorView<const T, Space>::bshd(full, B, Tn, H, D);
    }

    // The partial over this shard: row (b, t) sees the slots of positions <= kv_len(b) + t.
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < Tn; ++t)
        p.row_key_end_[static_cast<std::size_t>(b * Tn + t)] = p.layout_.count(me, b, p.kv_len(b) + t + 1);
    KernelParams params;
    params.scale = DecodeEngine::scale(pr);
    params.q_positions = PositionMap::run(Tn, 0);
    params.k_positions = PositionMap::run(C, 0);
    params.group_size = H / K;
    params.mask.row_key_end = p.row_key_end_.data();
    params.mask.row_stride = Tn;
    A* part_o = slots.template get<A>(workspace, s_part_o);
    A* part_l = slots.template get<A>(workspace, s_part_l);
    const auto o_view = TensorView<A, Space>::bshd(part_o, B, Tn, H, D);
    const auto l_view = TensorView<A, Space>::bshd(part_l, B, Tn, H, 1);
    if constexpr (kernel_writes_acc<Kernel, T>) {
      kernel_.forward(qa, k_cache, v_cache, o_view, l_view, params);
    } else {  // a kernel that writes only T: compute in T, widen
      T* part_t = slots.template get<T>(workspace, s_part_t);
      kernel_.forward(qa, k_cache, v_cache, TensorView<T, Space>::bshd(part_t, B, Tn, H, D), l_view, params);
      ops_.copy(TensorView<const T, Space>::bshd(part_t, B, Tn, H, D), o_view);
    }

    // Pack each merging rank's heads: [O (B, T, h, D) | LSE (B, T, h) | tag].
    std::byte* send = slots.template get<std::byte>(workspace, s_send);
    std::byte* recv = slots.template get<std::byte>(workspace, s_recv);
    const int packs = pr.exchange == DecodeExchange::heads ? P : 1;  // all_gather: one piece for all
    for (int v = 0; v < packs; ++v) {
      const HeadRange h = pr.exchange == DecodeExchange::heads ? p.heads_of_[static_cast<std::size_t>(v)] : HeadRange{0, H};
      std::byte* at = send + sz.send_displs[v];
      ops_.copy(TensorView<const A, Space>(o_view.slice_heads(h.begin, h.count)),
                TensorView<A, Space>::bshd(reinterpret_cast<A*>(at), B, Tn, h.count, D));
      ops_.copy(TensorView<const A, Space>(l_view.slice_heads(h.begin, h.count)),
                TensorView<A, Space>::bshd(reinterpret_cast<A*>(at) + B * Tn * h.count * D, B, Tn, h.count, 1));
      copy_tag(tag_at(0), at + sz.send_counts[v] - sizeof tag);
    }
    world_.all_to_all_v(send, sz.send_counts, sz.send_displs, recv, sz.recv_counts, sz.recv_displs);
    call.complete();  // every message is in: the checks below fail alike everywhere, no peer waits

    // Merge the pieces of my heads in rank order (the same order, so the same bits, everywhere).
    const std::int64_t h = p.out_heads().count;
    auto piece = [&](int v) {
      A* o = reinterpret_cast<A*>(recv + sz.recv_displs[v]);
      return std::pair{TensorView<A, Space>::bshd(o, B, Tn, h, D), TensorView<A, Space>::bshd(o + B * Tn * h * D, B, Tn, h, 1)};
    };
    for (int v = 0; v < P; ++v) copy_tag(recv + sz.recv_displs[v] + sz.recv_counts[v] - sizeof tag, tag_at(1 + v));
    // One read-back of every received tag (the queries' first: a step that disagrees is named
    // for its first message), before anything is merged into the output.
    const int received = gather_q ? 2 * P : P;
    tags_to_host(tag_at(1), p.tags_.data(), static_cast<std::size_t>(received));
    for (int v = 0; gather_q && v < P; ++v) check_tag(p, p.tags_[static_cast<std::size_t>(P + v)], v, tag);
    for (int v = 0; v < P; ++v) check_tag(p, p.tags_[static_cast<std::size_t>(v)], v, tag);
    const auto [o0, l0] = piece(0);
    for (int v = 1; v < P; ++v) {
      const auto [ov, lv] = piece(v);
      ops_.merge(o0, l0, TensorView<const A, Space>(ov), TensorView<const A, Space>(lv));
    }
    ops_.copy(TensorView<const A, Space>(o0), out);
  }

  Comm& world() { return world_; }
  Kernel& kernel() { return kernel_; }
  TensorOps<Space>& ops() { return ops_; }

 private:
  /// The sizes of a step's messages (made once, by plan).
  DecodePieces pieces(const DecodePlan& p) const {
    const DecodeProblem& pr = p.problem_;
    const int P = world_.size(), me = world_.rank();
    const auto rows = static_cast<std::size_t>(pr.batch * pr.new_tokens);
    const std::size_t a = acc_bytes(pr.dtype), e = dtype_bytes(pr.dtype), tag = 8;
    const auto D = static_cast<std::size_t>(pr.head_dim);
    auto partial = [&](HeadRange h) { return rows * static_cast<std::size_t>(h.count) * (D + 1) * a + tag; };
    DecodePieces s;
    const bool by_heads = pr.exchange == DecodeExchange::heads;
    for (int v = 0; v < P; ++v) {
      const HeadRange hv = by_heads ? p.heads_of_[static_cast<std::size_t>(v)] : HeadRange{0, pr.heads};
      const std::size_t out = partial(hv), in = partial(p.out_heads_);
      s.send_counts.push_back(out);
      s.send_displs.push_back(by_heads ? s.send_total : 0);  // all_gather: the one piece, to everyone
      s.send_total = by_heads ? s.send_total + out : out;
      s.recv_counts.push_back(in);
      s.recv_displs.push_back(s.recv_total);
      s.recv_total += in;
      if (by_heads && P > 1) {
        const std::size_t qv = rows * static_cast<std::size_t>(hv.count) * D * e + tag;
        s.q.push_back(qv);
        s.q_displs.push_back(s.q_total);
        s.q_total += qv;
        s.zero.push_back(0);
      }
    }
    if (by_heads && P > 1)
      s.q_send_counts.assign(static_cast<std::size_t>(P), s.q[static_cast<std::size_t>(me)]);
    return s;
  }

  /// The step's workspace slots (made once, by plan, after pieces).
  WorkspaceLayout<s_count> layout(const DecodePlan& p) const {
    const DecodeProblem& pr = p.problem_;
    const DecodePieces& sz = p.pieces_;
    const auto rows = static_cast<std::size_t>(pr.batch * pr.new_tokens), H = static_cast<std::size_t>(pr.heads),
               D = static_cast<std::size_t>(pr.head_dim);
    const std::size_t a = acc_bytes(pr.dtype), e = dtype_bytes(pr.dtype);
    const bool gather_q = pr.exchange == DecodeExchange::heads && world_.size() > 1;
    const auto W = SlotLife::whole_call;
    return WorkspaceLayout<s_count>({{
        {"q_send", gather_q ? sz.q[static_cast<std::size_t>(world_.rank())] : 0, W, gather_q},
        {"q_recv", sz.q_total, W, gather_q},
        {"q_full", rows * H * D * e, W, gather_q},
        {"part_o", rows * H * D * a, W, true},
        {"part_l", rows * H * a, W, true},
        {"part_t", rows * H * D * e, W, e != a},
        {"send", sz.send_total, W, true},
        {"recv", sz.recv_total, W, true},
        {"tags", static_cast<std::size_t>(1 + 2 * world_.size()) * 8, W, true},
    }});
  }

  static void check_problem(const DecodeProblem& pr) {
    SEQPAR_CHECK_ARG(pr.batch >= 1, "decode plan: batch", ">= 1", pr.batch);
    SEQPAR_CHECK_ARG(pr.heads >= 1, "decode plan: heads", ">= 1", pr.heads);
    SEQPAR_CHECK_ARG(pr.kv_head_count() >= 1 && pr.heads % pr.kv_head_count() == 0, "decode plan: kv_heads",
                     "a divisor of heads " + std::to_string(pr.heads), pr.kv_head_count());
    SEQPAR_CHECK_ARG(pr.head_dim >= 1, "decode plan: head_dim", ">= 1", pr.head_dim);
    SEQPAR_CHECK_ARG(std::isfinite(pr.scale) && std::abs(pr.scale) <= scale_limit, "decode plan: scale",
                     "a finite number with |scale| <= 2^32 (or 0 for 1/sqrt(head_dim))", pr.scale);
    SEQPAR_CHECK_ARG(static_cast<int>(pr.dtype) <= static_cast<int>(DType::f64), "decode plan: dtype",
                     "f16, bf16, f32 or f64", static_cast<int>(pr.dtype));
    SEQPAR_CHECK_ARG(pr.exchange == DecodeExchange::all_gather || pr.exchange == DecodeExchange::heads,
                     "decode plan: exchange", "DecodeExchange::all_gather or DecodeExchange::heads",
                     static_cast<int>(pr.exchange));
    SEQPAR_CHECK_ARG(pr.new_tokens >= 1 && pr.new_tokens <= 16, "decode plan: new_tokens", "1..16", pr.new_tokens);
    SEQPAR_CHECK_ARG(pr.page >= 0, "decode plan: page", ">= 0 (0: contiguous)", pr.page);
    SEQPAR_CHECK_ARG(pr.capacity >= pr.new_tokens, "decode plan: capacity", ">= new_tokens " + std::to_string(pr.new_tokens),
                     pr.capacity);
    // The largest tensor a rank may be given is a whole cache, batch x capacity x K x D
    // elements of at most 8 bytes; the plan's sizes stay in 64 bits while that is below 2^58.
    const std::int64_t cache[] = {8, pr.batch, pr.capacity, pr.kv_head_count(), pr.head_dim};
    const std::int64_t rows[] = {8, pr.batch, pr.new_tokens, pr.heads, pr.head_dim + 1};
    const std::optional<std::int64_t> cache_bytes = checked_product(cache), row_bytes = checked_product(rows);
    constexpr std::int64_t limit = std::int64_t{1} << 58;
    SEQPAR_CHECK(cache_bytes && *cache_bytes <= limit && row_bytes && *row_bytes <= limit, ConfigError,
                 "decode plan: size overflow: batch ", pr.batch, " x capacity ", pr.capacity, " x kv_heads ",
                 pr.kv_head_count(), " (heads ", pr.heads, ") x head_dim ", pr.head_dim,
                 " x 8 bytes exceeds the 2^58-byte limit on one tensor");
    SEQPAR_CHECK(static_cast<std::int64_t>(pr.kv_len.size()) == pr.batch, ConfigError,
                 "decode plan: kv_len: expected one length per sequence (", pr.batch, "), got ", pr.kv_len.size());
    // capacity >= new_tokens: the bound below cannot wrap, and kv_len + new_tokens is then
    // at most the capacity.
    for (std::size_t b = 0; b < pr.kv_len.size(); ++b)
      SEQPAR_CHECK(pr.kv_len[b] >= 0 && pr.kv_len[b] <= pr.capacity - pr.new_tokens, ConfigError,
                   "decode plan: kv_len[", b, "]: expected 0..capacity - new_tokens = ", pr.capacity - pr.new_tokens,
                   ", got ", pr.kv_len[b]);
  }

  static double scale(const DecodeProblem& pr) {
    return pr.scale != 0.0 ? pr.scale : 1.0 / std::sqrt(static_cast<double>(pr.head_dim));
  }

  /// The step's identity: the lengths, T and the step count, hashed (nothing allocated).
  static std::int64_t step_tag(const DecodePlan& p) {
    Fnv f;
    f.mix(std::span<const std::int64_t>(p.len_));
    f.mix(p.problem_.new_tokens);
    f.mix(p.step_);
    return f.value();
  }
  static void check_tag(const DecodePlan& p, std::int64_t theirs, int from, std::int64_t mine) {
    SEQPAR_CHECK(theirs == mine, ConfigError, "decode step: rank ", from, " is at another step than rank ", p.rank_,
                 " (their cache lengths or step count differ: every rank must advance its plan alike)");
  }

  /// Copies an 8-byte step tag between two places in Space (any alignment: bytes).
  void copy_tag(const std::byte* from, std::byte* to) const {
    using Byte = unsigned char;
    ops_.copy(TensorView<const Byte, Space>::bshd(reinterpret_cast<const Byte*>(from), 1, 1, 1, 8),
              TensorView<Byte, Space>::bshd(reinterpret_cast<Byte*>(to), 1, 1, 1, 8));
  }
  /// Reads n tags from Space into host memory (on a device: a copy and a wait on the stream).
  void tags_to_host(const std::byte* from, std::int64_t* to, std::size_t n) const {
    if constexpr (std::is_same_v<Space, HostSpace>)
      std::memcpy(to, from, n * sizeof *to);
    else
      ops_.to_host(from, to, n * sizeof *to);
  }

  Comm& world_;
  Kernel kernel_;
  TensorOps<Space> ops_;
  std::uint64_t id_ = next_engine_id();
};

}  // namespace detail

/// Decode steps over a KV cache sharded across the ranks of `Comm`, each rank computing with
/// `Kernel` (which needs supports_masks). Usage: construct on every rank, `plan(problem)` once
/// per cache layout (collective), allocate plan.workspace_bytes() once; per step append the
/// new K/V at plan.slot(b, pos) on plan.owner(b, pos), call step, then plan.advance(T).
/// On a device (CudaSpace), give the kernel, ops() and the communicator one stream; a step
/// then waits once on it, to read the step tags back (see the file comment).
/// Thread safety: one object serves one thread at a time.
template <class Comm, class Kernel>
class SequenceParallelDecode {
  static_assert(Communicator<Comm>, "SequenceParallelDecode<Comm, ...>: Comm does not model seqpar::Communicator");
  static_assert(enable_kernel<Kernel>, "SequenceParallelDecode<..., Kernel>: Kernel does not opt in to LocalAttentionKernel");

 public:
  using memory_space = typename Comm::memory_space;  ///< where tensors live

  /// Not collective; `world` must outlive this object.
  explicit SequenceParallelDecode(Comm& world, Kernel kernel = {}) : engine_(world, std::move(kernel)) {}
  /// Collective: the plan for a cache layout, reused every step. On a refusal every rank
  /// throws the same ConfigError (naming the field, and for kv_len the differing entry).
  DecodePlan plan(const DecodeProblem& problem) { return engine_.plan(problem); }
  /// One step: q [B, T, plan.q_heads(), D], the cache shards [B, plan.shard_capacity(), K, D]
  /// holding the step's new K/V, out [B, T, plan.out_heads(), D]. The plan's lengths and step
  /// count are not changed (advance does that); arguments are checked before the first
  /// message, so a ConfigError from them leaves everything usable.
  template <class T>
  void step(DecodePlan& plan, std::type_identity_t<TensorView<const T, memory_space>> q,
            std::type_identity_t<TensorView<const T, memory_space>> k_cache,
            std::type_identity_t<TensorView<const T, memory_space>> v_cache, TensorView<T, memory_space> out,
            std::span<std::byte> workspace) {
    engine_.template step<T>(plan, q, k_cache, v_cache, out, workspace);
  }
  /// The world communicator.
  Comm& world() { return engine_.world(); }
  /// The local kernel.
  Kernel& kernel() { return engine_.kernel(); }
  /// The tensor operations between the kernel calls (on CUDA: set their stream to the kernel's
  /// and the communicator's).
  TensorOps<memory_space>& ops() { return engine_.ops(); }

 private:
  detail::DecodeEngine<Comm, Kernel> engine_;
};

}  // namespace seqpar
