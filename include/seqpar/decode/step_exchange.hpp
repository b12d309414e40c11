#pragma once
/// \file
/// Decode's exchange: the communication of a decode step (decode/sequence_parallel_decode.hpp),
/// as one component that brings its buffers, its share of the plan's checks, its traffic
/// (DecodePlan::step_bytes) and its steps. With DecodeExchange::heads on more than one rank it
/// first gathers the queries (each rank holds its heads); after the local partials it moves
/// each partial (O of D_v values, LSE) in the accumulation type to the ranks that merge it,
/// merges the pieces of this rank's heads in rank order with merge_row and, with sinks, joins
/// each merged row's sink: the merged row is the only place where it counts exactly once.
///
/// Every message ends in an 8-byte tag of the step (its lengths and count), so a rank whose
/// plan advanced differently is named on every rank instead of merged. The tags received are
/// gathered behind this rank's own in the tag slot and read back in one copy of at most
/// 2P x 8 bytes (on a device: a device-to-host transfer and a wait on the ops' stream, once per
/// step), before anything is merged.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/core/agreement.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/types.hpp"
#include "seqpar/core/workspace.hpp"
#include "seqpar/decode/decode_plan.hpp"
#include "seqpar/ops/host_ops.hpp"
#include "seqpar/policy/join_sinks.hpp"

namespace seqpar::detail {

/// Decode's exchange (see the file comment). Its message sizes live in the plan (made once by
/// `schedule`), so a step allocates nothing and exchanges no metadata.
struct StepExchange {
  /// Bytes of the step tag that ends every message.
  static constexpr std::size_t tag_bytes = 8;

  /// Its buffers, all live for the whole step.
  struct Slots {
    static constexpr Slot q_send{"q_send"};  ///< this rank's heads of the queries, and the tag
    static constexpr Slot q_recv{"q_recv"};  ///< every rank's pieces of the queries
    static constexpr Slot q_full{"q_full"};  ///< [B, T, H, D]: the queries of every head
    static constexpr Slot send{"send"};      ///< [O (B, T, h, D_v) | LSE (B, T, h) | tag] per merging rank
    static constexpr Slot recv{"recv"};      ///< the pieces of this rank's heads from every rank
    static constexpr Slot tags{"tags"};      ///< this step's tag, then those received (partials, queries)
  };

  /// Its share of the plan's checks: the exchange is one of the two it knows.
  static void check_problem(const DecodeProblem& pr) {
    SEQPAR_CHECK_ARG(pr.exchange == DecodeExchange::all_gather || pr.exchange == DecodeExchange::heads,
                     "decode plan: exchange", "DecodeExchange::all_gather or DecodeExchange::heads",
                     static_cast<int>(pr.exchange));
  }

  /// True when a step first gathers the queries: the heads exchange on more than one rank
  /// (a single rank holds every head already).
  static bool gathers_queries(const DecodePlan& p) {
    return p.problem_.exchange == DecodeExchange::heads && p.layout_.ranks() > 1;
  }

  /// The byte sizes of every message of a step, by rank: the partials (p.partials_) and, when
  /// the step gathers them, the queries (p.queries_).
  static void schedule(DecodePlan& p) {
    const DecodeProblem& pr = p.problem_;
    const int P = p.layout_.ranks();
    const auto rows = static_cast<std::size_t>(pr.batch * pr.new_tokens), D = static_cast<std::size_t>(pr.head_dim),
               Dv = static_cast<std::size_t>(pr.value_dim());
    const std::size_t a = acc_bytes(pr.dtype), e = dtype_bytes(pr.dtype);
    auto partial = [&](HeadRange h) { return rows * static_cast<std::size_t>(h.count) * (Dv + 1) * a + tag_bytes; };
    const bool by_heads = pr.exchange == DecodeExchange::heads;
    AllToAllTable& s = p.partials_;
    AllToAllTable& q = p.queries_;
    std::size_t send_total = 0, recv_total = 0, q_total = 0;
    for (int v = 0; v < P; ++v) {
      const HeadRange hv = by_heads ? p.heads_of_[static_cast<std::size_t>(v)] : HeadRange{0, pr.heads};
      const std::size_t out = partial(hv), in = partial(p.out_heads_);
      s.send_counts.push_back(out);
      s.send_displs.push_back(by_heads ? send_total : 0);  // all_gather: the one piece, to everyone
      send_total = by_heads ? send_total + out : out;
      s.recv_counts.push_back(in);
      s.recv_displs.push_back(recv_total);
      recv_total += in;
      if (gathers_queries(p)) {
        const std::size_t qv = rows * static_cast<std::size_t>(hv.count) * D * e + tag_bytes;
        q.recv_counts.push_back(qv);
        q.recv_displs.push_back(q_total);
        q_total += qv;
        q.send_displs.push_back(0);  // the one piece of my heads, to everyone
      }
    }
    if (gathers_queries(p))
      q.send_counts.assign(static_cast<std::size_t>(P), q.recv_counts[static_cast<std::size_t>(p.rank_)]);
  }

  /// Declares its buffers for plan p (after schedule).
  static void declare(const DecodePlan& p, WorkspaceLayout& ws) {
    const DecodeProblem& pr = p.problem_;
    if (gathers_queries(p)) {
      const auto rows = static_cast<std::size_t>(pr.batch * pr.new_tokens);
      ws.declare(Slots::q_send, p.queries_.send_counts[static_cast<std::size_t>(p.rank_)]);
      ws.declare(Slots::q_recv, total(p.queries_.recv_counts, p.queries_.recv_displs));
      ws.declare(Slots::q_full,
                 rows * static_cast<std::size_t>(pr.heads * pr.head_dim) * dtype_bytes(pr.dtype));
    }
    ws.declare(Slots::send, total(p.partials_.send_counts, p.partials_.send_displs));
    ws.declare(Slots::recv, total(p.partials_.recv_counts, p.partials_.recv_displs));
    ws.declare(Slots::tags, static_cast<std::size_t>(1 + 2 * p.layout_.ranks()) * tag_bytes);
  }

  /// Bytes this rank sends per step: its partials, its queries when gathered, with their tags.
  static std::size_t bytes_sent(const DecodePlan& p) {
    return p.partials_.bytes_sent(p.rank_) + p.queries_.bytes_sent(p.rank_);
  }

  /// Starts a step: its tag goes into the tag slot, where every message takes it from.
  /// Returns the tag.
  template <class Space>
  static std::int64_t start(TensorOps<Space>& ops, const DecodePlan& p, std::span<std::byte> ws) {
    const std::int64_t tag = step_tag(p);
    ops.fill(TensorView<std::int64_t, Space>::bshd(reinterpret_cast<std::int64_t*>(tag_at(p, ws, 0)), 1, 1, 1, 1), tag);
    return tag;
  }

  /// The queries of every head, [B, T, H, D]: `q` itself, or, when the step gathers them,
  /// every rank's heads put together.
  template <class T, class Comm, class Space = typename Comm::memory_space>
  static TensorView<const T, Space> gather_queries(Comm& world, TensorOps<Space>& ops, const DecodePlan& p,
                                                   TensorView<const T, Space> q, std::span<std::byte> ws) {
    if (!gathers_queries(p)) return q;
    const DecodeProblem& pr = p.problem_;
    const std::int64_t B = pr.batch, Tn = pr.new_tokens, H = pr.heads, D = pr.head_dim;
    const int P = p.layout_.ranks();
    const AllToAllTable& t = p.queries_;
    std::byte* send = p.slots_.get<std::byte>(ws, Slots::q_send);
    std::byte* recv = p.slots_.get<std::byte>(ws, Slots::q_recv);
    const std::size_t mine = t.send_counts[static_cast<std::size_t>(p.rank_)];
    ops.copy(q, TensorView<T, Space>::bshd(reinterpret_cast<T*>(send), B, Tn, p.q_heads().count, D));
    copy_tag(ops, tag_at(p, ws, 0), send + mine - tag_bytes);
    world.all_to_all_v(send, t.send_counts, t.send_displs, recv, t.recv_counts, t.recv_displs);
    T* full = p.slots_.get<T>(ws, Slots::q_full);
    for (int v = 0; v < P; ++v) {
      const auto i = static_cast<std::size_t>(v);
      copy_tag(ops, recv + t.recv_displs[i] + t.recv_counts[i] - tag_bytes, tag_at(p, ws, 1 + P + v));
      const HeadRange h = p.heads_of_[i];
      ops.copy(TensorView<const T, Space>::bshd(reinterpret_cast<const T*>(recv + t.recv_displs[i]), B, Tn, h.count, D),
               TensorView<T, Space>::bshd(full, B, Tn, H, D).slice_heads(h.begin, h.count));
    }
    return TensorView<const T, Space>::bshd(full, B, Tn, H, D);
  }

  /// Sends each merging rank its heads of this rank's partial (o, l), in the accumulation
  /// type, with the step's tag; returns once the pieces of this rank's heads are in.
  template <class A, class Comm, class Space = typename Comm::memory_space>
  static void send_partials(Comm& world, TensorOps<Space>& ops, const DecodePlan& p, TensorView<A, Space> o,
                            TensorView<A, Space> l, std::span<std::byte> ws) {
    const DecodeProblem& pr = p.problem_;
    const std::int64_t B = pr.batch, Tn = pr.new_tokens, H = pr.heads, Dv = pr.value_dim();
    const AllToAllTable& t = p.partials_;
    std::byte* send = p.slots_.get<std::byte>(ws, Slots::send);
    std::byte* recv = p.slots_.get<std::byte>(ws, Slots::recv);
    const bool by_heads = pr.exchange == DecodeExchange::heads;
    const int packs = by_heads ? p.layout_.ranks() : 1;  // all_gather: one piece for all
    for (int v = 0; v < packs; ++v) {
      const auto i = static_cast<std::size_t>(v);
      const HeadRange h = by_heads ? p.heads_of_[i] : HeadRange{0, H};
      std::byte* at = send + t.send_displs[i];
      ops.copy(TensorView<const A, Space>(o.slice_heads(h.begin, h.count)),
               TensorView<A, Space>::bshd(reinterpret_cast<A*>(at), B, Tn, h.count, Dv));
      ops.copy(TensorView<const A, Space>(l.slice_heads(h.begin, h.count)),
               TensorView<A, Space>::bshd(reinterpret_cast<A*>(at) + B * Tn * h.count * Dv, B, Tn, h.count, 1));
      copy_tag(ops, tag_at(p, ws, 0), at + t.send_counts[i] - tag_bytes);
    }
    world.all_to_all_v(send, t.send_counts, t.send_displs, recv, t.recv_counts, t.recv_displs);
  }

  /// Checks every tag received against this step's `tag` (one read-back; the queries' first:
  /// a step that disagrees is named for its first message), then merges the pieces of this
  /// rank's heads in rank order (the same order, so the same bits, everywhere), joins each
  /// merged row's sink when the problem has sinks (in the accumulation type, the sink of the
  /// head's global index), and writes the result to `out`.
  template <class T, class Space>
  static void merge(TensorOps<Space>& ops, DecodePlan& p, std::int64_t tag, TensorView<T, Space> out,
                    std::span<std::byte> ws) {
    using A = acc_t<T>;
    const DecodeProblem& pr = p.problem_;
    const std::int64_t B = pr.batch, Tn = pr.new_tokens, Dv = pr.value_dim(), h = p.out_heads().count;
    const int P = p.layout_.ranks();
    const bool gather_q = gathers_queries(p);
    const AllToAllTable& t = p.partials_;
    std::byte* recv = p.slots_.get<std::byte>(ws, Slots::recv);
    auto piece = [&](int v) {
      A* o = reinterpret_cast<A*>(recv + t.recv_displs[static_cast<std::size_t>(v)]);
      return std::pair{TensorView<A, Space>::bshd(o, B, Tn, h, Dv),
                       TensorView<A, Space>::bshd(o + B * Tn * h * Dv, B, Tn, h, 1)};
    };
    for (int v = 0; v < P; ++v) {
      const auto i = static_cast<std::size_t>(v);
      copy_tag(ops, recv + t.recv_displs[i] + t.recv_counts[i] - tag_bytes, tag_at(p, ws, 1 + v));
    }
    const int received = gather_q ? 2 * P : P;
    tags_to_host(ops, tag_at(p, ws, 1), p.tags_.data(), static_cast<std::size_t>(received));
    for (int v = 0; gather_q && v < P; ++v) check_tag(p, p.tags_[static_cast<std::size_t>(P + v)], v, tag);
    for (int v = 0; v < P; ++v) check_tag(p, p.tags_[static_cast<std::size_t>(v)], v, tag);
    const auto [o0, l0] = piece(0);
    for (int v = 1; v < P; ++v) {
      const auto [ov, lv] = piece(v);
      ops.merge(o0, l0, TensorView<const A, Space>(ov), TensorView<const A, Space>(lv));
    }
    if constexpr (ops_have_sinks<Space>)  // otherwise a plan with sinks was refused (sinks_reason)
      if (pr.sinks != nullptr) ops.join_sinks(o0, l0, pr.sinks + p.out_heads().begin);
    ops.copy(TensorView<const A, Space>(o0), out);
  }

 private:
  /// Bytes a buffer holding every piece of (counts, displacements) needs: the furthest end.
  static std::size_t total(const std::vector<std::size_t>& counts, const std::vector<std::size_t>& displs) {
    std::size_t end = 0;
    for (std::size_t v = 0; v < counts.size(); ++v) end = std::max(end, displs[v] + counts[v]);
    return end;
  }

  /// Tag i of the tag slot: 0 this step's, 1 + v the one rank v's partials carried, 1 + P + v
  /// the one its queries carried.
  static std::byte* tag_at(const DecodePlan& p, std::span<std::byte> ws, int i) {
    return p.slots_.get<std::byte>(ws, Slots::tags) + static_cast<std::size_t>(i) * tag_bytes;
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
  template <class Space>
  static void copy_tag(TensorOps<Space>& ops, const std::byte* from, std::byte* to) {
    using Byte = unsigned char;
    ops.copy(TensorView<const Byte, Space>::bshd(reinterpret_cast<const Byte*>(from), 1, 1, 1, 8),
             TensorView<Byte, Space>::bshd(reinterpret_cast<Byte*>(to), 1, 1, 1, 8));
  }
  /// Reads n tags from Space into host memory (on a device: a copy and a wait on the stream).
  template <class Space>
  static void tags_to_host(TensorOps<Space>& ops, const std::byte* from, std::int64_t* to, std::size_t n) {
    if constexpr (std::is_same_v<Space, HostSpace>)
      std::memcpy(to, from, n * sizeof *to);
    else
      ops.to_host(from, to, n * sizeof *to);
  }
};

}  // namespace seqpar::detail
