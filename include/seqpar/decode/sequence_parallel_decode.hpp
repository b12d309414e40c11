#pragma once
/// \file
/// SequenceParallelDecode<Comm, Kernel>: one decode step over a KV cache sharded across the
/// ranks (decode/decode_plan.hpp has the layouts and the plan).
///
/// A step: decode's exchange gathers the queries (heads exchange only: each rank holds its
/// heads), the local kernel attends the step's queries to this rank's shard (every row limited
/// to the slots whose positions it may see: the cache before it and the step's earlier
/// tokens), and decode's exchange moves the partial (O, LSE) pieces in the accumulation type
/// to the ranks that merge them, each merging its pieces in rank order with merge_row
/// (decode/step_exchange.hpp). Today's models: the kernel soft-caps the scores
/// (KernelParams::softcap); V, O and the partials have D_v, so V may be a column view of the K
/// cache's rows (MLA's latent cache: no second copy); a sink joins each row once, after the
/// merge, on the rank that returns that row. Nothing is allocated and no metadata is
/// exchanged: every message carries one 8-byte tag of the step (its lengths and count), so a
/// rank whose plan advanced differently is named on every rank instead of merging garbage or
/// hanging.
///
/// The same step runs on host memory and on a device (a CudaSpace communicator with
/// CudaFlashKernel): every byte of the buffers moves through TensorOps (the tags too: a fill of
/// the workspace's tag slot, then 8-byte copies into and out of the messages), the merge is
/// ops().merge, and the per-row key ends stay in the plan's host memory, where a device kernel
/// takes them from (CudaFlashKernel's DeviceMaskTables copies them to the device when they
/// change, that is once per step). Reading the received tags back is, on a device, a
/// device-to-host transfer and a wait on ops().stream(), once per step, before the merge (the
/// price of naming a disagreeing rank on the host; the merge and the output copy are then
/// enqueued without a wait). Put the kernel, the ops and the communicator on one stream.

#include <algorithm>
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
#include "seqpar/decode/decode_rules.hpp"
#include "seqpar/decode/step_exchange.hpp"
#include "seqpar/ops/host_ops.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/policy/join_sinks.hpp"
#include "seqpar/policy/plan_builder.hpp"

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
    std::vector<AgreedField> fields = shape_fields(pr);
    fields.insert(fields.begin(), {"batch", pr.batch, f_batch});
    fields.insert(fields.end(), {{"new_tokens", pr.new_tokens}, {"capacity", pr.capacity}, {"page", pr.page},
                                 {"kv_len", hash_lists({pr.kv_len})}});
    // kv_len travels as a hash: every rank sees the mismatch, and all gather the lengths.
    agree_fields(world_, "decode plan: ", fields, static_cast<int>(fields.size()) - 1, [&] {
      return list_disagreement(world_, "decode plan: ", "kv_len", {pr.kv_len}, ListField::one_list);
    });
    check_problem(pr);

    DecodePlan p;
    p.problem_ = pr;
    p.problem_.kv_heads = pr.kv_head_count();
    p.layout_ = CacheLayout(P, pr.page, pr.kv_len);
    p.rank_ = me;
    p.owner_ = OwnerId(id_);
    p.len_ = pr.kv_len;
    for (std::int64_t b = 0; b < pr.batch; ++b)
      p.shard_capacity_ = std::max(p.shard_capacity_, p.layout_.count(me, b, pr.capacity));
    p.row_key_end_.assign(static_cast<std::size_t>(pr.batch * pr.new_tokens), 0);
    p.messages_ = step_messages(pr, P, me);
    StepExchange::configure(p.messages_, pr.batch * pr.new_tokens, p.slots_);
    p.step_bytes_ = StepExchange::bytes_sent(p.messages_);
    declare_partials(p);
    p.slots_.place();
    // Every rank joins the gather whatever its kernel (see MeshEngine::plan).
    const std::string why = allocation_disagreement(world_, "decode plan: ", [&] {
      // Forward scratch only (decode has no backward), for rows of D (Q, K) and D_v (V, O).
      if constexpr (requires { kernel_.prepare(std::int64_t{}, std::int64_t{}); })
        kernel_.prepare(pr.head_dim, pr.value_dim());
      else if constexpr (requires { kernel_.prepare(std::int64_t{}); })
        kernel_.prepare(std::max(pr.head_dim, pr.value_dim()));
      if constexpr (requires { kernel_.reserve(KernelCallBounds{}); })  // every step: T rows against the shard
        kernel_.reserve({pr.batch, pr.new_tokens, pr.heads, p.shard_capacity_, p.problem_.kv_heads,
                         pr.heads / p.problem_.kv_heads, pr.head_dim, false, pr.value_dim()});
    });
    SEQPAR_CHECK(why.empty(), ConfigError, why);
    return p;
  }

  /// One step (see the file comment). q: [B, T, q_heads, D]; k_cache [B, shard_capacity, K, D]
  /// and v_cache [B, shard_capacity, K, D_v] with the step's new K/V already in their slots
  /// (v_cache may be a column view of k_cache's rows); out: [B, T, out_heads, D_v]. The plan is
  /// not advanced (advance it once the step's tokens are cache).
  template <class T>
  void step(DecodePlan& p, TensorView<const T, Space> q, TensorView<const T, Space> k_cache,
            TensorView<const T, Space> v_cache, TensorView<T, Space> out, std::span<std::byte> workspace) {
    using A = acc_t<T>;
    static_assert(LocalAttentionKernel<Kernel, T>, "seqpar: the kernel does not model LocalAttentionKernel for T");
    static_assert(kernel_supports_masks<Kernel>,
                  "seqpar: decode limits each query row to its own visible cache slots: the kernel needs "
                  "supports_masks (ReferenceKernel has it)");
    const DecodeProblem& pr = p.problem_;
    SEQPAR_CHECK(p.owner_ == id_, ConfigError, "decode step: ",
                 p.owner_ == 0 ? empty_plan_reason : "the plan was made by another SequenceParallelDecode");
    SEQPAR_CHECK(dtype_v<T> == pr.dtype, ConfigError, "decode step: element type: the plan was made for ",
                 dtype_name(pr.dtype), ", got ", dtype_name(dtype_v<T>));
    const std::int64_t B = pr.batch, Tn = pr.new_tokens, H = pr.heads, K = pr.kv_heads, D = pr.head_dim;
    const std::int64_t Dv = pr.value_dim(), C = p.shard_capacity_;
    check_view(q, "decode step: q", B, Tn, p.q_heads().count, D, ViewUse::read);
    check_view(k_cache, "decode step: k_cache", B, C, K, D, ViewUse::read);
    // Read only, so any strides: MLA's V is the first D_v columns of K's rows (K's pointer and strides).
    check_view(v_cache, "decode step: v_cache", B, C, K, Dv, ViewUse::read);
    check_view(out, "decode step: out", B, Tn, p.out_heads().count, Dv, ViewUse::write);
    for (std::int64_t b = 0; b < B; ++b)
      SEQPAR_CHECK(p.kv_len(b) <= pr.capacity - Tn, ConfigError, "decode step: sequence ", b, " holds ", p.kv_len(b),
                   " tokens: the step's ", Tn, " would exceed the capacity ", pr.capacity);
    const auto& slots = p.slots_;
    SEQPAR_CHECK(workspace.size() >= slots.bytes(), ConfigError, "decode step: workspace: expected at least ",
                 slots.bytes(), " bytes (plan.workspace_bytes()), got ", workspace.size());
    CallGuard<Comm> call("an exception left a decode step after its communication began", world_);
    const std::int64_t tag = step_tag(p);
    StepExchange::start(ops_, slots, tag, workspace);
    const TensorView<const T, Space> qa = StepExchange::gather_queries(world_, ops_, p.messages_, slots, q, workspace);

    // The partial over this shard: row (b, t) sees the slots of positions <= kv_len(b) + t.
    const int me = world_.rank();
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < Tn; ++t)
        p.row_key_end_[static_cast<std::size_t>(b * Tn + t)] = p.layout_.count(me, b, p.kv_len(b) + t + 1);
    KernelParams params;
    params.scale = decode_scale(pr);
    params.softcap = pr.softcap;
    params.q_positions = PositionMap::run(Tn, 0);
    params.k_positions = PositionMap::run(C, 0);
    params.group_size = H / K;
    params.mask.row_key_end = p.row_key_end_.data();
    params.mask.row_stride = Tn;
    const auto o_view = TensorView<A, Space>::bshd(slots.template get<A>(workspace, part_o), B, Tn, H, Dv);
    const auto l_view = TensorView<A, Space>::bshd(slots.template get<A>(workspace, part_l), B, Tn, H, 1);
    if constexpr (kernel_writes_acc<Kernel, T>) {
      kernel_.forward(qa, k_cache, v_cache, o_view, l_view, params);
    } else {  // a kernel that writes only T: compute in T, widen
      T* t_out = slots.template get<T>(workspace, part_t);
      kernel_.forward(qa, k_cache, v_cache, TensorView<T, Space>::bshd(t_out, B, Tn, H, Dv), l_view, params);
      ops_.copy(TensorView<const T, Space>::bshd(t_out, B, Tn, H, Dv), o_view);
    }

    StepExchange::send_partials(world_, ops_, p.messages_, slots, o_view, l_view, workspace);
    call.complete();  // every message is in: the checks below fail alike everywhere, no peer waits
    StepExchange::receive_tags(ops_, p.messages_, slots, workspace);
    check_tags(p, tag);
    StepExchange::merge(ops_, p.messages_, slots, out, workspace);
  }

  Comm& world() { return world_; }
  Kernel& kernel() { return kernel_; }
  TensorOps<Space>& ops() { return ops_; }

 private:
  /// The local partial's buffers (in the accumulation type; a kernel that writes only T
  /// computes into part_t first), live for the whole step.
  static constexpr Slot part_o{"part_o"}, part_l{"part_l"}, part_t{"part_t"};

  /// Declares the local partial's buffers (decode's exchange declares its own).
  static void declare_partials(DecodePlan& p) {
    const DecodeProblem& pr = p.problem_;
    const auto rows = static_cast<std::size_t>(pr.batch * pr.new_tokens), H = static_cast<std::size_t>(pr.heads),
               Dv = static_cast<std::size_t>(pr.value_dim());
    const std::size_t a = acc_bytes(pr.dtype), e = dtype_bytes(pr.dtype);
    p.slots_.declare(part_o, rows * H * Dv * a);
    p.slots_.declare(part_l, rows * H * a);
    if (e != a) p.slots_.declare(part_t, rows * H * Dv * e);
  }

  static void check_problem(const DecodeProblem& pr) {
    SEQPAR_CHECK_ARG(pr.batch >= 1, "decode plan: batch", ">= 1", pr.batch);
    check_decode_shape<Kernel, Space>(pr, "decode plan: ");
    SEQPAR_CHECK_ARG(pr.new_tokens >= 1 && pr.new_tokens <= 16, "decode plan: new_tokens", "1..16", pr.new_tokens);
    SEQPAR_CHECK_ARG(pr.page >= 0, "decode plan: page", ">= 0 (0: contiguous)", pr.page);
    SEQPAR_CHECK_ARG(pr.capacity >= pr.new_tokens, "decode plan: capacity", ">= new_tokens " + std::to_string(pr.new_tokens),
                     pr.capacity);
    // The largest tensor a rank may be given is a whole cache, batch x capacity x K x
    // max(D, D_v) elements of at most 8 bytes (a step's rows add one LSE value to D_v); the
    // plan's sizes stay in 64 bits while that is below 2^58.
    const std::int64_t dim = std::max(pr.head_dim, pr.value_dim());
    const std::int64_t cache[] = {8, pr.batch, pr.capacity, pr.kv_head_count(), dim};
    const std::int64_t rows[] = {8, pr.batch, pr.new_tokens, pr.heads, dim + 1};
    const std::optional<std::int64_t> cache_bytes = checked_product(cache), row_bytes = checked_product(rows);
    constexpr std::int64_t limit = std::int64_t{1} << 58;
    SEQPAR_CHECK(cache_bytes && *cache_bytes <= limit && row_bytes && *row_bytes <= limit, ConfigError,
                 "decode plan: size overflow: batch ", pr.batch, " x capacity ", pr.capacity, " x kv_heads ",
                 pr.kv_head_count(), " (heads ", pr.heads, ")",
                 pr.value_dim() > pr.head_dim ? " x head_dim_v " : " x head_dim ", dim,
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

  /// The step's identity: the lengths, T and the step count, hashed (nothing allocated).
  static std::int64_t step_tag(const DecodePlan& p) {
    Fnv f;
    f.mix(std::span<const std::int64_t>(p.len_));
    f.mix(p.problem_.new_tokens);
    f.mix(p.step_);
    return f.value();
  }
  /// Every rank's tag against this step's (the queries' first: a step that disagrees is
  /// named for its first message).
  static void check_tags(const DecodePlan& p, std::int64_t tag) {
    const detail::StepMessages& m = p.messages_;
    const int P = m.ranks;
    for (int i = StepExchange::gathers_queries(m) ? 0 : P; i < 2 * P; ++i) {
      const int v = i < P ? i : i - P;  // the queries' tags lie at P + v: check them first
      const std::int64_t theirs = m.tags[static_cast<std::size_t>(i < P ? P + v : v)];
      SEQPAR_CHECK(theirs == tag, ConfigError, "decode step: rank ", v, " is at another step than rank ", p.rank_,
                   " (their cache lengths or step count differ: every rank must advance its plan alike)");
    }
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

  /// A tensor a step reads (q, the cache shards): elements T in memory_space. T is never
  /// deduced from it (step takes T from `out`, or from step<T>).
  template <class T>
  using Input = std::type_identity_t<TensorView<const T, memory_space>>;

  /// Not collective; `world` must outlive this object.
  explicit SequenceParallelDecode(Comm& world, Kernel kernel = {}) : engine_(world, std::move(kernel)) {}
  /// Collective: the plan for a cache layout, reused every step. On a refusal every rank
  /// throws the same ConfigError (naming the field, and for kv_len the differing entry).
  DecodePlan plan(const DecodeProblem& problem) { return engine_.plan(problem); }
  /// One step: q [B, T, plan.q_heads(), D], the cache shards k_cache [B, plan.shard_capacity(),
  /// K, D] and v_cache [.., K, D_v] holding the step's new K/V (v_cache may be a column view of
  /// k_cache's rows: MLA's latent cache), out [B, T, plan.out_heads(), D_v] (T is deduced from
  /// it). The plan's lengths and step count are not changed (advance does that); arguments are
  /// checked before the first message, so a ConfigError from them leaves everything usable.
  template <class T>
  void step(DecodePlan& plan, Input<T> q, Input<T> k_cache, Input<T> v_cache, TensorView<T, memory_space> out,
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
