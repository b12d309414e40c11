#pragma once
/// \file
/// Decode's exchange: the communication of a decode step, shared by both decode faces
/// (decode/sequence_parallel_decode.hpp over seqpar's own cache, decode/paged_decode.hpp over
/// an engine's paged pool), as one component that brings its buffers, its share of the plan's
/// checks, its traffic and its steps. With DecodeExchange::heads on more than one rank it first
/// gathers the queries (each rank holds its heads); after the local partials it moves each
/// partial (O of D_v values, LSE) in the accumulation type to the ranks that merge it, merges
/// the pieces of this rank's heads in rank order with merge_row and, with sinks, joins each
/// merged row's sink: the merged row is the only place where it counts exactly once.
///
/// A step has `rows` query rows (batch x new tokens, or the paged step's packed rows); message
/// sizes follow them, so a step that uses fewer rows than the plan's maximum sends only those.
/// Every message starts with an 8-byte tag of the step (the caller's hash of what every rank
/// must agree on), so a rank whose step differs is named on every rank instead of merged. At
/// the start, not the end: a message shorter than its receive (MPI's all-to-all does not say
/// so) still overwrites the tag, where a tag at the end left the previous step's there, which
/// passed when the two steps agreed. The tags received are gathered behind this rank's own in
/// the tag slot and read back in one copy of at most 2P x 8 bytes (on a device: a
/// device-to-host transfer and a wait on the ops' stream, once per step), then handed to the
/// caller's check before anything is merged.

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
#include "seqpar/ops/host_ops.hpp"
#include "seqpar/policy/join_sinks.hpp"

namespace seqpar {

/// How the partials of a decode step are combined.
enum class DecodeExchange : std::uint8_t {
  all_gather = 0,  ///< queries replicated; every rank receives every partial and merges all heads
  heads = 1,       ///< queries sharded by heads (as tensor parallelism leaves them): an all-to-all
                   ///< by heads, each rank merges the heads it owns
};

namespace detail {

/// The exchange's part of a decode plan: the shape of its messages and where the tags land.
/// Made once by StepExchange::configure; a step only rewrites the message sizes (resize), so
/// nothing is allocated.
struct StepMessages {
  std::int64_t heads = 1, head_dim = 1, value_dim = 1;  ///< H, D (queries), D_v (partials)
  DType dtype = DType::f32;                             ///< element type of the queries
  DecodeExchange exchange = DecodeExchange::all_gather;  ///< see DecodeExchange
  const float* sinks = nullptr;                         ///< H sink logits in the step's memory space, or none
  int ranks = 1, rank = 0;                              ///< P, this rank
  std::int64_t rows = 0;                                ///< query rows of the current sizes
  std::vector<HeadRange> heads_of;                      ///< heads each rank merges (heads exchange)
  HeadRange out_heads;                                  ///< heads this rank provides and returns
  AllToAllTable partials, queries;                      ///< message sizes for `rows` rows
  std::vector<std::int64_t> tags;                       ///< the tags received, read back: partials, then queries
};

/// Decode's exchange (see the file comment).
struct StepExchange {
  /// Bytes of the step tag that starts every message.
  static constexpr std::size_t tag_bytes = 8;

  /// Its buffers, all live for the whole step.
  struct Slots {
    static constexpr Slot q_send{"q_send"};  ///< the tag, then this rank's heads of the queries
    static constexpr Slot q_recv{"q_recv"};  ///< every rank's pieces of the queries
    static constexpr Slot q_full{"q_full"};  ///< [rows, H, D]: the queries of every head
    static constexpr Slot send{"send"};      ///< [tag | O (rows, h, D_v) | LSE (rows, h)] per merging rank
    static constexpr Slot recv{"recv"};      ///< the pieces of this rank's heads from every rank
    static constexpr Slot tags{"tags"};      ///< this step's tag, then those received (partials, queries)
  };

  /// Its share of the plan's checks: the exchange is one of the two it knows.
  static void check_exchange(DecodeExchange exchange) {
    SEQPAR_CHECK_ARG(exchange == DecodeExchange::all_gather || exchange == DecodeExchange::heads,
                     "decode plan: exchange", "DecodeExchange::all_gather or DecodeExchange::heads",
                     static_cast<int>(exchange));
  }

  /// Sets up m for P ranks (m's shape fields already set), with message sizes for `max_rows`
  /// rows, and declares the buffers for them in `ws`.
  static void configure(StepMessages& m, std::int64_t max_rows, WorkspaceLayout& ws) {
    std::int64_t begin = 0;
    m.heads_of.clear();
    for (std::int64_t count : split_evenly(m.heads, m.ranks)) {
      m.heads_of.push_back({begin, count});
      begin += count;
    }
    m.out_heads = m.exchange == DecodeExchange::heads ? m.heads_of[static_cast<std::size_t>(m.rank)]
                                                      : HeadRange{0, m.heads};
    m.tags.assign(static_cast<std::size_t>(2 * m.ranks), 0);
    const auto P = static_cast<std::size_t>(m.ranks);
    for (AllToAllTable* t : {&m.partials, &m.queries})
      for (auto* v : {&t->send_counts, &t->send_displs, &t->recv_counts, &t->recv_displs}) v->assign(P, 0);
    if (!gathers_queries(m)) m.queries = {};
    resize(m, max_rows);
    if (gathers_queries(m)) {
      ws.declare(Slots::q_send, m.queries.send_counts[static_cast<std::size_t>(m.rank)]);
      ws.declare(Slots::q_recv, total(m.queries.recv_counts, m.queries.recv_displs));
      ws.declare(Slots::q_full, static_cast<std::size_t>(max_rows * m.heads * m.head_dim) * dtype_bytes(m.dtype));
    }
    ws.declare(Slots::send, total(m.partials.send_counts, m.partials.send_displs));
    ws.declare(Slots::recv, total(m.partials.recv_counts, m.partials.recv_displs));
    ws.declare(Slots::tags, static_cast<std::size_t>(1 + 2 * m.ranks) * tag_bytes);
  }

  /// Sets the message sizes for a step of `rows` rows (at most configure's max_rows; the
  /// tables keep their length, so nothing is allocated).
  static void resize(StepMessages& m, std::int64_t rows) {
    m.rows = rows;
    const auto r = static_cast<std::size_t>(rows), D = static_cast<std::size_t>(m.head_dim),
               Dv = static_cast<std::size_t>(m.value_dim);
    const std::size_t a = acc_bytes(m.dtype), e = dtype_bytes(m.dtype);
    auto partial = [&](HeadRange h) { return r * static_cast<std::size_t>(h.count) * (Dv + 1) * a + tag_bytes; };
    const bool by_heads = m.exchange == DecodeExchange::heads;
    std::size_t send_total = 0, recv_total = 0, q_total = 0;
    for (std::size_t v = 0; v < static_cast<std::size_t>(m.ranks); ++v) {
      const HeadRange hv = by_heads ? m.heads_of[v] : HeadRange{0, m.heads};
      const std::size_t out = partial(hv), in = partial(m.out_heads);
      m.partials.send_counts[v] = out;
      m.partials.send_displs[v] = by_heads ? send_total : 0;  // all_gather: the one piece, to everyone
      send_total = by_heads ? send_total + out : out;
      m.partials.recv_counts[v] = in;
      m.partials.recv_displs[v] = recv_total;
      recv_total += in;
      if (gathers_queries(m)) {
        const std::size_t qv = r * static_cast<std::size_t>(hv.count) * D * e + tag_bytes;
        m.queries.recv_counts[v] = qv;
        m.queries.recv_displs[v] = q_total;
        q_total += qv;
        m.queries.send_displs[v] = 0;  // the one piece of my heads, to everyone
      }
    }
    if (gathers_queries(m))
      for (std::size_t& c : m.queries.send_counts) c = m.queries.recv_counts[static_cast<std::size_t>(m.rank)];
  }

  /// True when a step first gathers the queries: the heads exchange on more than one rank
  /// (a single rank holds every head already).
  static bool gathers_queries(const StepMessages& m) { return m.exchange == DecodeExchange::heads && m.ranks > 1; }

  /// Bytes this rank sends per step at the current sizes: its partials, its queries when
  /// gathered, with their tags.
  static std::size_t bytes_sent(const StepMessages& m) {
    return m.partials.bytes_sent(m.rank) + m.queries.bytes_sent(m.rank);
  }

  /// Starts a step: its tag goes into the tag slot, where every message takes it from.
  template <class Space>
  static void start(TensorOps<Space>& ops, const WorkspaceLayout& slots, std::int64_t tag, std::span<std::byte> ws) {
    ops.fill(TensorView<std::int64_t, Space>::bshd(reinterpret_cast<std::int64_t*>(tag_at(slots, ws, 0)), 1, 1, 1, 1),
             tag);
  }

  /// The queries of every head, [q.batch, q.seq, H, D] with q.batch x q.seq = m.rows: `q`
  /// itself, or, when the step gathers them, every rank's heads put together.
  template <class T, class Comm, class Space = typename Comm::memory_space>
  static TensorView<const T, Space> gather_queries(Comm& world, TensorOps<Space>& ops, const StepMessages& m,
                                                   const WorkspaceLayout& slots, TensorView<const T, Space> q,
                                                   std::span<std::byte> ws) {
    if (!gathers_queries(m)) return q;
    const std::int64_t B = q.batch(), S = q.seq(), H = m.heads, D = m.head_dim;
    const AllToAllTable& t = m.queries;
    std::byte* send = slots.get<std::byte>(ws, Slots::q_send);
    std::byte* recv = slots.get<std::byte>(ws, Slots::q_recv);
    copy_tag(ops, tag_at(slots, ws, 0), send);
    ops.copy(q, TensorView<T, Space>::bshd(reinterpret_cast<T*>(send + tag_bytes), B, S, m.out_heads.count, D));
    world.all_to_all_v(send, t.send_counts, t.send_displs, recv, t.recv_counts, t.recv_displs);
    T* full = slots.get<T>(ws, Slots::q_full);
    for (int v = 0; v < m.ranks; ++v) {
      const auto i = static_cast<std::size_t>(v);
      copy_tag(ops, recv + t.recv_displs[i], tag_at(slots, ws, 1 + m.ranks + v));
      const HeadRange h = m.heads_of[i];
      ops.copy(TensorView<const T, Space>::bshd(reinterpret_cast<const T*>(recv + t.recv_displs[i] + tag_bytes), B, S,
                                                h.count, D),
               TensorView<T, Space>::bshd(full, B, S, H, D).slice_heads(h.begin, h.count));
    }
    return TensorView<const T, Space>::bshd(full, B, S, H, D);
  }

  /// Sends each merging rank its heads of this rank's partial (o, l: [B, S, H, .] with
  /// B x S = m.rows), in the accumulation type, with the step's tag; returns once the pieces
  /// of this rank's heads are in.
  template <class A, class Comm, class Space = typename Comm::memory_space>
  static void send_partials(Comm& world, TensorOps<Space>& ops, const StepMessages& m, const WorkspaceLayout& slots,
                            TensorView<A, Space> o, TensorView<A, Space> l, std::span<std::byte> ws) {
    const std::int64_t B = o.batch(), S = o.seq(), Dv = m.value_dim;
    const AllToAllTable& t = m.partials;
    std::byte* send = slots.get<std::byte>(ws, Slots::send);
    std::byte* recv = slots.get<std::byte>(ws, Slots::recv);
    const bool by_heads = m.exchange == DecodeExchange::heads;
    const int packs = by_heads ? m.ranks : 1;  // all_gather: one piece for all
    for (int v = 0; v < packs; ++v) {
      const auto i = static_cast<std::size_t>(v);
      const HeadRange h = by_heads ? m.heads_of[i] : HeadRange{0, m.heads};
      std::byte* at = send + t.send_displs[i];
      copy_tag(ops, tag_at(slots, ws, 0), at);
      A* body = reinterpret_cast<A*>(at + tag_bytes);
      ops.copy(TensorView<const A, Space>(o.slice_heads(h.begin, h.count)),
               TensorView<A, Space>::bshd(body, B, S, h.count, Dv));
      ops.copy(TensorView<const A, Space>(l.slice_heads(h.begin, h.count)),
               TensorView<A, Space>::bshd(body + B * S * h.count * Dv, B, S, h.count, 1));
    }
    world.all_to_all_v(send, t.send_counts, t.send_displs, recv, t.recv_counts, t.recv_displs);
  }

  /// Reads back every tag received (one copy) into m.tags: rank v's partials' tag at v and,
  /// when the step gathered the queries, their tag at P + v. The caller checks them before
  /// merge, so that a step that disagrees is named instead of merged.
  template <class Space>
  static void receive_tags(TensorOps<Space>& ops, StepMessages& m, const WorkspaceLayout& slots,
                           std::span<std::byte> ws) {
    const AllToAllTable& t = m.partials;
    std::byte* recv = slots.get<std::byte>(ws, Slots::recv);
    for (int v = 0; v < m.ranks; ++v) {
      const auto i = static_cast<std::size_t>(v);
      copy_tag(ops, recv + t.recv_displs[i], tag_at(slots, ws, 1 + v));
    }
    const int received = gathers_queries(m) ? 2 * m.ranks : m.ranks;
    tags_to_host(ops, tag_at(slots, ws, 1), m.tags.data(), static_cast<std::size_t>(received));
  }

  /// Merges the pieces of this rank's heads in rank order (the same order, so the same bits,
  /// everywhere), joins each merged row's sink when there are sinks (in the accumulation type,
  /// the sink of the head's global index), and writes the result to `out` ([B, S, h, D_v] with
  /// B x S = m.rows).
  template <class T, class Space>
  static void merge(TensorOps<Space>& ops, const StepMessages& m, const WorkspaceLayout& slots,
                    TensorView<T, Space> out, std::span<std::byte> ws) {
    using A = acc_t<T>;
    const std::int64_t B = out.batch(), S = out.seq(), Dv = m.value_dim, h = m.out_heads.count;
    const AllToAllTable& t = m.partials;
    std::byte* recv = slots.get<std::byte>(ws, Slots::recv);
    auto piece = [&](int v) {
      A* o = reinterpret_cast<A*>(recv + t.recv_displs[static_cast<std::size_t>(v)] + tag_bytes);
      return std::pair{TensorView<A, Space>::bshd(o, B, S, h, Dv), TensorView<A, Space>::bshd(o + B * S * h * Dv, B, S, h, 1)};
    };
    const auto [o0, l0] = piece(0);
    for (int v = 1; v < m.ranks; ++v) {
      const auto [ov, lv] = piece(v);
      ops.merge(o0, l0, TensorView<const A, Space>(ov), TensorView<const A, Space>(lv));
    }
    if constexpr (ops_have_sinks<Space>)  // otherwise a plan with sinks was refused (sinks_reason)
      if (m.sinks != nullptr) ops.join_sinks(o0, l0, m.sinks + m.out_heads.begin);
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
  static std::byte* tag_at(const WorkspaceLayout& slots, std::span<std::byte> ws, int i) {
    return slots.get<std::byte>(ws, Slots::tags) + static_cast<std::size_t>(i) * tag_bytes;
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

}  // namespace detail
}  // namespace seqpar
