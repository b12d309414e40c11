#pragma once
/// \file
/// PagedDecode<Comm, Kernel>: decode steps the way serving engines run them. The engine owns
/// the KV memory (one pool of pages per rank, a block table per sequence: core/paged_cache.hpp)
/// and the batch changes every step (continuous batching): sequences join after their prefill
/// and leave when done, each brings its own number of new tokens T_b (1 to decode, 2-16 to
/// verify speculated tokens or take a small prefill piece, 0 to sit a step out). The plan
/// fixes only maxima (batch, T, rows, heads, dims) and the placement rule (TokenPlacement:
/// which rank stores each token, queryable for writing new K/V); seqpar never allocates or
/// frees pages.
///
/// A step (all host arrays, no collective besides the exchange itself): every rank attends
/// the step's packed query rows (sequence after sequence, FlashInfer's qo_indptr order) to its
/// own pages, each row limited to the slots whose positions it may see (the cache before it
/// and its sequence's earlier new tokens), then decode's exchange (decode/step_exchange.hpp)
/// merges the partial (O, LSE) pieces exactly, with sinks joined once per row. A kernel with
/// forward_paged (kernel_supports_paged: CpuFlashKernel) reads the pages in place in one call;
/// any other kernel with supports_masks (ReferenceKernel, CudaFlashKernel) is called once per
/// run of pages that follow each other in the pool, and the runs are merged with ops().merge.
///
/// Agreement without a collective: every message starts with the step's tag, a hash of the
/// batch (ids, lengths, new tokens, splits) and the step count. A rank whose batch differs is named
/// on every rank (ConfigError), and so is a rank that refuses its own part of the step (a
/// block table without the pages its tokens need, a page id outside the pool, a length out of
/// range): it still takes part in the exchange, carrying a refusal instead of a tag, so no
/// peer waits for it. Message sizes follow the step's row count, so ranks that disagree on it
/// fail in the exchange itself (ThreadCommunicator's size check: CommError; MPI: a rank sent
/// more than its peer receives, MPI_ERR_TRUNCATE as an MpiError) or, where a message is
/// shorter than its receive (which MPI does not report), at the tag that message overwrote:
/// never a hang or a merge. Views that check_view refuses (wrong extents, a null pointer, a
/// strided head dim, negative strides, an out that overlaps itself) and a workspace that is too small are this
/// rank's programming errors: they throw before the exchange (peers then wait in it until the
/// communicator's time-out, as for any rank that leaves before a collective).
///
/// Fixed buffers, as CUDA-graph replay needs: q and out may have more rows than the step
/// uses (the first `rows` are read and written), the workspace is sized for the maxima, and
/// nothing is allocated per step.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/core/agreement.hpp"
#include "seqpar/core/checked.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/paged_cache.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/workspace.hpp"
#include "seqpar/decode/decode_plan.hpp"
#include "seqpar/decode/decode_rules.hpp"
#include "seqpar/decode/step_exchange.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/ops/host_ops.hpp"
#include "seqpar/policy/plan_builder.hpp"

namespace seqpar {

/// Most new tokens of one sequence in one paged step (a decode token, a speculative
/// verification, or a small prefill piece).
inline constexpr std::int64_t paged_max_new_tokens = 16;

/// A paged decode problem: the maxima every step stays within, the attention's shape and
/// today's models' features (as DecodeProblem), and the placement rule.
struct PagedDecodeProblem {
  std::int64_t max_batch = 1;       ///< most sequences in one step
  std::int64_t max_new_tokens = 1;  ///< most new tokens T_b of one sequence in one step (1..16)
  std::int64_t max_rows = 0;        ///< most query rows of one step (sum of T_b); 0: max_batch x max_new_tokens
  std::int64_t heads = 1;           ///< query heads H
  std::int64_t kv_heads = 0;        ///< K/V heads (0: H)
  std::int64_t head_dim = 64;       ///< D of Q and K
  std::int64_t head_dim_v = 0;      ///< D_v of V and O (0: D); MLA's latent cache: V a column view of K's pages
  double scale = 0.0;               ///< softmax scale; 0: 1/sqrt(D)
  double softcap = 0.0;             ///< logit soft-cap (0: off); the kernel needs kernel_supports_softcap
  DType dtype = DType::f32;         ///< element type of Q, the pools and O
  /// Placement (TokenPlacement): runs of `interleave` tokens round-robin over the ranks
  /// (vLLM's interleave_size; any size, independent of the pool's page size), or 0 for
  /// contiguous (each sequence's split over the ranks, later tokens on the last rank).
  std::int64_t interleave = 1;
  DecodeExchange exchange = DecodeExchange::all_gather;  ///< how partials are combined
  const float* sinks = nullptr;     ///< H sink logits in the memory space of the step (or none), as DecodeProblem

  /// K/V heads with 0 resolved.
  std::int64_t kv_head_count() const { return kv_heads == 0 ? heads : kv_heads; }
  /// D_v, with 0 resolved to D.
  std::int64_t value_dim() const { return head_dim_v == 0 ? head_dim : head_dim_v; }
  /// Most rows of one step, with 0 resolved.
  std::int64_t row_limit() const { return max_rows > 0 ? max_rows : max_batch * max_new_tokens; }
};

/// One step's batch, host arrays with one entry per sequence, in the order of the step's
/// packed query rows. Sequences may join and leave between any two steps.
struct DecodeBatch {
  std::span<const std::int64_t> ids;         ///< the engine's sequence ids (part of what ranks agree on)
  std::span<const std::int64_t> kv_len;      ///< global tokens cached before this step's new ones
  std::span<const std::int64_t> new_tokens;  ///< T_b in 0..max_new_tokens, their K/V already in the pool
  /// Contiguous placement only: each sequence's split (the prefill length spread over the
  /// ranks); ignored with interleave > 0 (may be empty).
  std::span<const std::int64_t> split;
  BlockTable pages;  ///< this rank's pages of each sequence (row b for sequence b); the one rank-local part

  /// Sequences.
  std::int64_t size() const { return static_cast<std::int64_t>(ids.size()); }
};

template <class Comm, class Kernel>
class PagedDecode;

/// The plan of PagedDecode: made once (collective), used by every step whatever its batch.
/// Read-only to users.
class PagedDecodePlan {
 public:
  /// An empty plan.
  PagedDecodePlan() = default;
  /// The agreed problem.
  const PagedDecodeProblem& problem() const { return problem_; }
  /// The placement rule.
  const TokenPlacement& placement() const { return placement_; }
  /// This rank.
  int rank() const { return messages_.rank; }
  /// Rank that stores token `pos` of a sequence (`split`: its split, contiguous placement);
  /// ConfigError for a pos outside 0..2^61 or a split outside 0..2^60 (as a step's).
  int owner(std::int64_t pos, std::int64_t split = 0) const {
    check_token("owner", "pos", pos, split);
    return placement_.owner(pos, split);
  }
  /// Local slot of token `pos` on its owner (`split` as for owner).
  std::int64_t slot(std::int64_t pos, std::int64_t split = 0) const {
    check_token("slot", "pos", pos, split);
    return placement_.slot(pos, split);
  }
  /// Tokens of a sequence of `length` tokens that this rank stores (its slots 0..n-1): with a
  /// page size, the pages it needs here are ceil(n / page_size). Ranges as for owner.
  std::int64_t local_tokens(std::int64_t length, std::int64_t split = 0) const {
    check_token("local_tokens", "length", length, split);
    return placement_.count(rank(), length, split);
  }
  /// Heads whose merged output this rank returns (all with DecodeExchange::all_gather).
  HeadRange out_heads() const { return messages_.out_heads; }
  /// Query heads this rank provides: all heads (all_gather) or its own (heads exchange).
  HeadRange q_heads() const { return messages_.out_heads; }
  /// Bytes this rank sends in a step of `rows` query rows: partials (D_v + 1 values in the
  /// accumulation type per row and head it sends), gathered queries (heads exchange) and one
  /// 8-byte tag per message. Never depends on the cache lengths. `rows`: 0..row_limit() (a
  /// step's rows, what the plan was sized for), else a ConfigError.
  std::size_t step_bytes(std::int64_t rows) const {
    SEQPAR_CHECK(rows >= 0 && rows <= problem_.row_limit(), ConfigError, "PagedDecodePlan::step_bytes: rows: expected 0..",
                 problem_.row_limit(), " (the plan's max_rows), got ", rows);
    detail::StepMessages m = messages_;
    detail::StepExchange::resize(m, rows);
    return detail::StepExchange::bytes_sent(m);
  }
  /// Workspace bytes of any step.
  std::size_t workspace_bytes() const { return slots_.bytes(); }
  /// Steps completed (every rank counts alike: part of the step tag).
  std::int64_t steps() const { return steps_; }

 private:
  template <class Comm, class Kernel>
  friend class PagedDecode;

  /// Checks the arguments of owner, slot and local_tokens (`call`), as DecodePlan does:
  /// `value` (the position or length named `name`) in 0..2^61, past any step's (kv_len up to
  /// 2^60, 16 new tokens), and with the contiguous placement `split` in 0..2^60, as a step's.
  void check_token(const char* call, const char* name, std::int64_t value, std::int64_t split) const {
    SEQPAR_CHECK(value >= 0 && value <= (std::int64_t{1} << 61), ConfigError, "PagedDecodePlan::", call, ": ", name,
                 ": expected 0..2^61, got ", value);
    SEQPAR_CHECK(placement_.interleave > 0 || (split >= 0 && split <= (std::int64_t{1} << 60)), ConfigError,
                 "PagedDecodePlan::", call, ": split: expected 0..2^60, got ", split);
  }

  PagedDecodeProblem problem_;
  TokenPlacement placement_;
  detail::OwnerId owner_;  // the engine that made it (none: empty, or moved from)
  std::int64_t steps_ = 0;
  detail::StepMessages messages_;
  WorkspaceLayout slots_;
  std::vector<std::int64_t> begin_;    // [max_batch + 1] each sequence's first row, per step
  std::vector<std::int64_t> key_end_;  // [max_rows] each row's visible local slots, per step
  std::vector<std::int64_t> run_end_;  // [max_new_tokens] a run's visible slots per row (per-run calls)
};

/// Decode steps over an engine-owned paged KV pool with continuous batching (see the file
/// comment). Usage: construct on every rank; `plan(problem)` once (collective); allocate
/// plan.workspace_bytes() once; per step write each new token's K/V at slot plan.slot(pos)
/// of the pages of rank plan.owner(pos) (slot s: page pages(b)[s / page_size], row
/// s % page_size), then call step with the batch. Thread safety: one object serves one thread
/// at a time.
template <class Comm, class Kernel>
class PagedDecode {
  static_assert(Communicator<Comm>, "PagedDecode<Comm, ...>: Comm does not model seqpar::Communicator");
  static_assert(enable_kernel<Kernel>, "PagedDecode<..., Kernel>: Kernel does not opt in to LocalAttentionKernel");
  static_assert(std::is_same_v<typename Comm::memory_space, typename Kernel::memory_space>,
                "PagedDecode: the communicator and the kernel work in different memory spaces");

 public:
  using memory_space = typename Comm::memory_space;  ///< where tensors live
  /// A tensor a step reads, of elements T (never deduced from it: step takes T from `out`).
  template <class T>
  using Input = std::type_identity_t<TensorView<const T, memory_space>>;

  /// Not collective; `world` must outlive this object.
  explicit PagedDecode(Comm& world, Kernel kernel = {}) : world_(world), kernel_(std::move(kernel)) {}

  /// Collective: every rank gives the same problem; on a refusal every rank throws the same
  /// ConfigError naming the field.
  PagedDecodePlan plan(const PagedDecodeProblem& pr) {
    using detail::AgreedField;
    const int P = world_.size(), me = world_.rank();
    std::vector<AgreedField> fields = detail::shape_fields(pr);
    fields.insert(fields.begin(), {{"max_batch", pr.max_batch}, {"max_new_tokens", pr.max_new_tokens},
                                   {"max_rows", pr.row_limit()}});
    fields.push_back({"interleave", pr.interleave});
    detail::agree_fields(world_, "paged decode plan: ", fields, -1, [] { return std::string(); });
    const std::string who = "paged decode plan: ";
    SEQPAR_CHECK_ARG(pr.max_batch >= 1 && pr.max_batch <= (std::int64_t{1} << 24), who + "max_batch", "1..2^24",
                     pr.max_batch);
    SEQPAR_CHECK_ARG(pr.max_new_tokens >= 1 && pr.max_new_tokens <= paged_max_new_tokens, who + "max_new_tokens",
                     "1..16", pr.max_new_tokens);
    SEQPAR_CHECK_ARG(pr.max_rows >= 0 && pr.row_limit() <= pr.max_batch * pr.max_new_tokens, who + "max_rows",
                     "0 (max_batch x max_new_tokens) or 1.." + std::to_string(pr.max_batch * pr.max_new_tokens),
                     pr.max_rows);
    SEQPAR_CHECK_ARG(pr.interleave >= 0, who + "interleave", ">= 0 (0: contiguous)", pr.interleave);
    detail::check_decode_shape<Kernel, memory_space>(pr, who);
    static_assert(kernel_supports_masks<Kernel>,
                  "seqpar: paged decode limits each query row to its own visible slots: the kernel needs "
                  "supports_masks (ReferenceKernel has it)");
    // A step's largest buffer: rows x H x (max(D, D_v) + 1) values of at most 8 bytes.
    const std::int64_t dim = std::max(pr.head_dim, pr.value_dim());
    const std::int64_t row_bytes[] = {8, pr.row_limit(), pr.heads, dim + 1};
    const std::optional<std::int64_t> bytes = checked_product(row_bytes);
    SEQPAR_CHECK(bytes && *bytes <= (std::int64_t{1} << 58), ConfigError, who, "size overflow: rows ", pr.row_limit(),
                 " x heads ", pr.heads, " x ", dim + 1, " x 8 bytes exceeds the 2^58-byte limit on one buffer");

    PagedDecodePlan p;
    p.problem_ = pr;
    p.problem_.kv_heads = pr.kv_head_count();
    p.placement_ = {P, pr.interleave};
    p.owner_ = detail::OwnerId(id_);
    p.begin_.assign(static_cast<std::size_t>(pr.max_batch + 1), 0);
    p.key_end_.assign(static_cast<std::size_t>(pr.row_limit()), 0);
    p.run_end_.assign(static_cast<std::size_t>(pr.max_new_tokens), 0);
    p.messages_ = detail::step_messages(pr, P, me);
    detail::StepExchange::configure(p.messages_, pr.row_limit(), p.slots_);
    declare_partials(p);
    p.slots_.place();
    // Every rank joins the gather whatever its kernel (see MeshEngine::plan).
    const std::string why = detail::allocation_disagreement(world_, "paged decode plan: ", [&] {
      prepare_for(kernel_, pr.head_dim, pr.value_dim());
      // Calls read at most T rows of a sequence (or all rows, paged) against a run of pages
      // of any length: the decode path's partials are bounded by its chunk count, not by keys.
      if constexpr (requires { kernel_.reserve(KernelCallBounds{}); })
        kernel_.reserve({pr.max_batch, pr.max_new_tokens, pr.heads, std::int64_t{1} << 40, p.problem_.kv_heads,
                         pr.heads / p.problem_.kv_heads, pr.head_dim, false, pr.value_dim()});
    });
    SEQPAR_CHECK(why.empty(), ConfigError, why);
    return p;
  }

  /// One step (see the file comment): q [1, >= rows, plan.q_heads(), D] (the packed rows of
  /// the batch's sequences, sequence b's T_b rows after those of sequences before it),
  /// k_pool [num_pages, page_size, K, D], v_pool [num_pages, page_size, K, D_v] (may view
  /// k_pool's rows), out [1, >= rows, plan.out_heads(), D_v]; rows = the sum of T_b. The new
  /// tokens' K/V must already be in their slots. Every view passes check_view (out must not
  /// overlap itself; the pools may have any non-negative strides: NHD or HND pages), else
  /// ConfigError before the exchange. Returns the rows written.
  template <class T>
  std::int64_t step(PagedDecodePlan& plan, const DecodeBatch& batch, Input<T> q, Input<T> k_pool, Input<T> v_pool,
                    TensorView<T, memory_space> out, std::span<std::byte> workspace) {
    using A = acc_t<T>;
    using detail::StepExchange;
    static_assert(LocalAttentionKernel<Kernel, T>, "seqpar: the kernel does not model LocalAttentionKernel for T");
    const PagedDecodeProblem& pr = plan.problem_;
    const char* const who = "paged decode step: ";  // (no std::string: a step allocates nothing)
    SEQPAR_CHECK(plan.owner_ == id_, ConfigError, who,
                 plan.owner_ == 0 ? detail::empty_plan_reason : "the plan was made by another PagedDecode");
    SEQPAR_CHECK(dtype_v<T> == pr.dtype, ConfigError, who, "element type: the plan was made for ",
                 dtype_name(pr.dtype), ", got ", dtype_name(dtype_v<T>));
    const std::int64_t H = pr.heads, K = pr.kv_heads, D = pr.head_dim, Dv = pr.value_dim();
    check_step_view(q, "paged decode step: q", 1, plan.q_heads().count, D, ViewUse::read);
    check_step_view(out, "paged decode step: out", 1, plan.out_heads().count, Dv, ViewUse::write);
    // Read only, so any strides: NHD or HND pages, MLA's V the first D_v columns of K's rows.
    check_step_view(k_pool, "paged decode step: k_pool", k_pool.batch(), K, D, ViewUse::read);
    check_step_view(v_pool, "paged decode step: v_pool", v_pool.batch(), K, Dv, ViewUse::read);
    SEQPAR_CHECK(v_pool.batch() == k_pool.batch() && v_pool.seq() == k_pool.seq(), ConfigError, who,
                 "v_pool: expected the pages of k_pool (", k_pool.batch(), " pages of ", k_pool.seq(), " tokens), got ",
                 v_pool.batch(), " of ", v_pool.seq());
    SEQPAR_CHECK(workspace.size() >= plan.slots_.bytes(), ConfigError, who, "workspace: expected at least ",
                 plan.slots_.bytes(), " bytes (plan.workspace_bytes()), got ", workspace.size());

    // The rows every rank sizes its messages by, from the batch however malformed; the
    // batch's own problems become a refusal that travels in the tag.
    const std::int64_t rows = sized_rows(pr, batch);
    const PagedKV<T, memory_space> cache{k_pool, v_pool, batch.pages};
    const std::string refusal = batch_reason(plan, batch, cache, rows, q.seq(), out.seq());
    constexpr std::int64_t refused = 0x5e9a7e75ed5e9a7e;  // in place of a tag: "this rank refuses the step"
    std::int64_t tag = refusal.empty() ? step_tag(plan, batch) : refused;
    if (refusal.empty() && tag == refused) tag ^= 1;
    StepExchange::resize(plan.messages_, rows);
    const auto& slots = plan.slots_;
    detail::CallGuard<Comm> call("an exception left a paged decode step after its communication began", world_);
    StepExchange::start(ops_, slots, tag, workspace);
    const TensorView<const T, memory_space> q_rows =
        refusal.empty() ? q.slice_seq(0, rows) : TensorView<const T, memory_space>{};
    const auto qa = StepExchange::gather_queries(world_, ops_, plan.messages_, slots, q_rows, workspace);
    const auto o_view = TensorView<A, memory_space>::bshd(slots.template get<A>(workspace, part_o), 1, rows, H, Dv);
    const auto l_view = TensorView<A, memory_space>::bshd(slots.template get<A>(workspace, part_l), 1, rows, H, 1);
    if (refusal.empty()) attend<T>(plan, batch, qa, cache, o_view, l_view, workspace);

    StepExchange::send_partials(world_, ops_, plan.messages_, slots, o_view, l_view, workspace);
    call.complete();  // every message is in: the checks below fail alike everywhere, no peer waits
    ++plan.steps_;    // every rank that got here counts the step, refused or not
    StepExchange::receive_tags(ops_, plan.messages_, slots, workspace);
    check_tags(plan, tag, refused, refusal);
    StepExchange::merge(ops_, plan.messages_, slots, out.slice_seq(0, rows), workspace);
    return rows;
  }

  /// The world communicator.
  Comm& world() { return world_; }
  /// The local kernel.
  Kernel& kernel() { return kernel_; }
  /// The tensor operations between the kernel calls (on CUDA: give them the kernel's and the
  /// communicator's stream).
  TensorOps<memory_space>& ops() { return ops_; }

 private:
  /// The local partial's buffers (accumulation type), and one run's partial for per-run calls.
  static constexpr Slot part_o{"part_o"}, part_l{"part_l"}, run_o{"run_o"}, run_l{"run_l"}, run_t{"run_t"};

  static void declare_partials(PagedDecodePlan& p) {
    const PagedDecodeProblem& pr = p.problem_;
    const auto rows = static_cast<std::size_t>(pr.row_limit()), H = static_cast<std::size_t>(pr.heads),
               Dv = static_cast<std::size_t>(pr.value_dim()), T = static_cast<std::size_t>(pr.max_new_tokens);
    const std::size_t a = acc_bytes(pr.dtype), e = dtype_bytes(pr.dtype);
    p.slots_.declare(part_o, rows * H * Dv * a);
    p.slots_.declare(part_l, rows * H * a);
    // A call per run needs a run's partial (other element types than these two are given it
    // whether their kernel reads pages in place or not: a few rows of spare workspace).
    const bool in_place = (pr.dtype == DType::f32 && kernel_supports_paged<Kernel, float>) ||
                          (pr.dtype == DType::f64 && kernel_supports_paged<Kernel, double>);
    if (!in_place) {
      p.slots_.declare(run_o, T * H * Dv * a);
      p.slots_.declare(run_l, T * H * a);
      p.slots_.declare(run_t, T * H * Dv * e);
    }
  }

  /// Checks one of a step's views with check_view (a programming error of this rank: thrown
  /// at once): [batch, any seq >= 0, heads, dim] (q and out: any rows; the pools: any page
  /// size), contiguous head dim, non-negative strides, a pointer, and for `use` write no overlap.
  template <class V>
  static void check_step_view(const V& v, const char* name, std::int64_t batch, std::int64_t heads, std::int64_t dim,
                              ViewUse use) {
    SEQPAR_CHECK(v.batch() >= 0 && v.seq() >= 0, ConfigError, name, ": expected extents >= 0, got [", v.batch(),
                 ", ", v.seq(), ", ", v.heads(), ", ", v.dim(), "]");
    check_view(v, name, batch, v.seq(), heads, dim, use);
  }

  /// The step's row count as every rank computes it from its batch: T_b clamped to
  /// 0..max_new_tokens over the first max_batch sequences, at most the plan's rows. (A valid
  /// batch gives its true count; an invalid one is refused anyway.)
  static std::int64_t sized_rows(const PagedDecodeProblem& pr, const DecodeBatch& batch) {
    std::int64_t rows = 0;
    const std::int64_t n = std::min<std::int64_t>(pr.max_batch, static_cast<std::int64_t>(batch.new_tokens.size()));
    for (std::int64_t b = 0; b < n; ++b)
      rows += std::clamp<std::int64_t>(batch.new_tokens[static_cast<std::size_t>(b)], 0, pr.max_new_tokens);
    return std::min(rows, pr.row_limit());
  }

  /// Why this rank refuses the step ("" when it takes it): the batch's lengths, its block
  /// table against the pool, and q, out rows. Fills the plan's per-row arrays on the way.
  template <class T>
  static std::string batch_reason(PagedDecodePlan& p, const DecodeBatch& batch,
                                  const PagedKV<T, memory_space>& cache, std::int64_t rows, std::int64_t q_rows,
                                  std::int64_t out_rows) {
    const PagedDecodeProblem& pr = p.problem_;
    const std::int64_t B = batch.size();
    auto why = [](auto&&... parts) {
      std::ostringstream os;
      (os << ... << parts);
      return os.str();
    };
    if (B > pr.max_batch) return why("batch: ", B, " sequences, the plan's max_batch is ", pr.max_batch);
    if (static_cast<std::int64_t>(batch.kv_len.size()) != B || static_cast<std::int64_t>(batch.new_tokens.size()) != B)
      return why("batch: ids, kv_len and new_tokens need one entry per sequence, got ", B, ", ", batch.kv_len.size(),
                 " and ", batch.new_tokens.size());
    const bool contiguous = pr.interleave == 0;
    if (contiguous && static_cast<std::int64_t>(batch.split.size()) != B)
      return why("batch: split: the contiguous placement needs one split per sequence (", B, "), got ",
                 batch.split.size());
    std::int64_t total = 0;
    for (std::int64_t b = 0; b < B; ++b) {
      const auto i = static_cast<std::size_t>(b);
      const std::int64_t len = batch.kv_len[i], t = batch.new_tokens[i];
      if (t < 0 || t > pr.max_new_tokens)
        return why("batch: new_tokens[", b, "]: expected 0..", pr.max_new_tokens, " (max_new_tokens), got ", t);
      if (len < 0 || len > (std::int64_t{1} << 60))
        return why("batch: kv_len[", b, "]: expected 0..2^60, got ", len);
      if (contiguous && (batch.split[i] < 0 || batch.split[i] > (std::int64_t{1} << 60)))
        return why("batch: split[", b, "]: expected 0..2^60, got ", batch.split[i]);
      total += t;
    }
    if (total > pr.row_limit()) return why("batch: ", total, " query rows, the plan's max_rows is ", pr.row_limit());
    if (rows > q_rows || rows > out_rows)
      return why("q and out need ", rows, " rows (the batch's new tokens), they have ", q_rows, " and ", out_rows);
    if (cache.page_size() < 1) return why("k_pool: pages of ", cache.page_size(), " tokens (expected >= 1)");
    // Each row's visible slots here: those of positions before it and its own.
    const int me = p.rank();
    p.begin_[0] = 0;
    for (std::int64_t b = 0; b < B; ++b) {
      const auto i = static_cast<std::size_t>(b);
      const std::int64_t len = batch.kv_len[i], t = batch.new_tokens[i], split = contiguous ? batch.split[i] : 0;
      p.begin_[i + 1] = p.begin_[i] + t;
      for (std::int64_t r = 0; r < t; ++r)
        p.key_end_[static_cast<std::size_t>(p.begin_[i] + r)] = p.placement_.count(me, len + r + 1, split);
      if (t == 0) continue;  // sits out: its pages are not read
      const std::string table = batch.pages.reason(b, cache.pages_for(p.placement_.count(me, len + t, split)),
                                                   cache.num_pages());
      if (!table.empty()) return table;
    }
    return "";
  }

  /// The step's tag: the batch (ids, lengths, new tokens, splits) and the step count, hashed.
  static std::int64_t step_tag(const PagedDecodePlan& p, const DecodeBatch& batch) {
    detail::Fnv f;
    f.mix(batch.size());
    f.mix(batch.ids);
    f.mix(batch.kv_len);
    f.mix(batch.new_tokens);
    if (p.problem_.interleave == 0) f.mix(batch.split);
    f.mix(p.steps_);
    return f.value();
  }

  /// Refusals first (every rank names the rank that refused), then tags that differ.
  static void check_tags(const PagedDecodePlan& p, std::int64_t tag, std::int64_t refused, const std::string& mine) {
    const detail::StepMessages& m = p.messages_;
    const int P = m.ranks;
    const int n = detail::StepExchange::gathers_queries(m) ? 2 * P : P;
    for (int i = 0; i < n; ++i) {
      const int v = i % P;
      if (m.tags[static_cast<std::size_t>(i)] != refused) continue;
      if (v == m.rank) SEQPAR_THROW(ConfigError, "paged decode step: rank ", v, " refused the step: ", mine);
      SEQPAR_THROW(ConfigError, "paged decode step: rank ", v, " refused the step (its own error says why)");
    }
    for (int i = 0; i < n; ++i)
      SEQPAR_CHECK(m.tags[static_cast<std::size_t>(i)] == tag, ConfigError, "paged decode step: rank ", i % P,
                   "'s batch differs from rank ", m.rank,
                   "'s (sequence ids, kv_len, new_tokens, split or the step count): every rank must be given the "
                   "same batch");
  }

  /// The local partial of every row over this rank's pages: one paged call, or a call per run.
  template <class T>
  void attend(PagedDecodePlan& p, const DecodeBatch& batch, TensorView<const T, memory_space> q,
              const PagedKV<T, memory_space>& cache, TensorView<acc_t<T>, memory_space> o,
              TensorView<acc_t<T>, memory_space> l, std::span<std::byte> ws) {
    const PagedDecodeProblem& pr = p.problem_;
    KernelParams params;
    params.scale = detail::decode_scale(pr);
    params.softcap = pr.softcap;
    params.group_size = pr.heads / pr.kv_heads;
    if constexpr (kernel_supports_paged<Kernel, T>) {
      kernel_.forward_paged(q, cache, PagedRows{batch.size(), p.begin_.data(), p.key_end_.data()}, o, l, params);
    } else {
      attend_runs<T>(p, batch, q, cache, o, l, params, ws);
    }
  }

  /// A kernel without forward_paged: each sequence's rows against each run of its pages
  /// (PagedKV::run_end), the runs merged in order.
  template <class T>
  void attend_runs(PagedDecodePlan& p, const DecodeBatch& batch, TensorView<const T, memory_space> q,
                   const PagedKV<T, memory_space>& cache, TensorView<acc_t<T>, memory_space> o,
                   TensorView<acc_t<T>, memory_space> l, KernelParams params, std::span<std::byte> ws) {
    using A = acc_t<T>;
    using S = memory_space;
    const PagedDecodeProblem& pr = p.problem_;
    const std::int64_t H = pr.heads, K = pr.kv_heads, D = pr.head_dim, Dv = pr.value_dim();
    ops_.fill(o, A(0));
    ops_.fill(l, -std::numeric_limits<A>::infinity());
    for (std::int64_t b = 0; b < batch.size(); ++b) {
      const auto i = static_cast<std::size_t>(b);
      const std::int64_t r0 = p.begin_[i], t = p.begin_[i + 1] - r0;
      if (t == 0) continue;
      const std::int64_t keys = p.key_end_[static_cast<std::size_t>(r0 + t - 1)];  // the last row sees the most
      const auto ob = o.slice_seq(r0, t), lb = l.slice_seq(r0, t);
      const auto ro = TensorView<A, S>::bshd(p.slots_.template get<A>(ws, run_o), 1, t, H, Dv);
      const auto rl = TensorView<A, S>::bshd(p.slots_.template get<A>(ws, run_l), 1, t, H, 1);
      for (std::int64_t s = 0; s < keys;) {
        const std::int64_t e = cache.run_end(b, s, keys);
        for (std::int64_t r = 0; r < t; ++r)
          p.run_end_[static_cast<std::size_t>(r)] = std::clamp<std::int64_t>(p.key_end_[static_cast<std::size_t>(r0 + r)] - s, 0, e - s);
        params.q_positions = PositionMap::run(t, 0);
        params.k_positions = PositionMap::run(e - s, 0);
        params.mask.row_key_end = p.run_end_.data();
        params.mask.row_stride = t;
        const auto kr = run_view(cache.k_pool, cache.k_row(b, s, 0), e - s, K, D);
        const auto vr = run_view(cache.v_pool, cache.v_row(b, s, 0), e - s, K, Dv);
        if constexpr (kernel_writes_acc<Kernel, T>) {
          kernel_.forward(q.slice_seq(r0, t), kr, vr, ro, rl, params);
        } else {
          const auto rt = TensorView<T, S>::bshd(p.slots_.template get<T>(ws, run_t), 1, t, H, Dv);
          kernel_.forward(q.slice_seq(r0, t), kr, vr, rt, rl, params);
          ops_.copy(TensorView<const T, S>(rt), ro);
        }
        ops_.merge(ob, lb, TensorView<const A, S>(ro), TensorView<const A, S>(rl));
        s = e;
      }
    }
  }

  /// A run of `n` slots starting at `first` in a pool: [1, n, heads, dim] with the pool's
  /// seq and head strides.
  template <class T>
  static TensorView<const T, memory_space> run_view(TensorView<const T, memory_space> pool, const T* first,
                                                    std::int64_t n, std::int64_t heads, std::int64_t dim) {
    TensorView<const T, memory_space> v;
    v.data = first;
    v.extent = {1, n, heads, dim};
    v.stride = {n * pool.stride[1], pool.stride[1], pool.stride[2], 1};
    return v;
  }

  Comm& world_;
  Kernel kernel_;
  TensorOps<memory_space> ops_;
  std::uint64_t id_ = detail::next_engine_id();
};

}  // namespace seqpar
