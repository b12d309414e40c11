#pragma once
/// \file
/// The hand-off from a context-parallel prefill to decode: every K/V row the prefill left on a
/// rank moves to the rank and local slot the decode placement gives its token, in one
/// all-to-all: SequenceParallelDecode's own cache (DecodePlan::owner, DecodePlan::slot), or any
/// other destination, such as an engine's paged pool (PagedDecodePlan::owner and slot, then the
/// sequence's page).
///
/// The two layouts differ: a prefill splits the prompt tokens as its policy and layout say
/// (a zigzag or stripe ring split, packed prompts), while the decode cache holds each sequence
/// contiguously or in pages round-robin, in position order. No metadata travels: every rank
/// knows which token every rank's prefill rows hold (the prefill plan's kv_positions, for any
/// rank), so a receiver knows the order in which its rows arrive from each sender.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "seqpar/seqpar.hpp"

namespace seqpar::examples {

/// A token of the decode cache: sequence `b`, position `pos` inside it.
struct CacheToken {
  std::int64_t b = 0;    ///< sequence (batch element of the decode problem)
  std::int64_t pos = 0;  ///< position inside the sequence
};

/// The tokens of the rows at `rows` (positions of one packed sequence, batch 1) when the
/// prompts, of lengths `prompts`, are packed one after another (as documents).
inline std::vector<CacheToken> packed_tokens(const PositionMap& rows, const std::vector<std::int64_t>& prompts) {
  std::vector<std::int64_t> starts{0};
  for (std::int64_t n : prompts) starts.push_back(starts.back() + n);
  std::vector<CacheToken> tokens;
  tokens.reserve(static_cast<std::size_t>(rows.size()));
  for (std::int64_t i = 0; i < rows.size(); ++i) {
    const std::int64_t p = rows(i);
    const auto b = std::upper_bound(starts.begin(), starts.end(), p) - starts.begin() - 1;
    tokens.push_back({b, p - starts[static_cast<std::size_t>(b)]});
  }
  return tokens;
}

/// Where a token's K and V rows go: the rank that stores it, and on that rank the rows to fill
/// (any other rank may leave them null: only the owner writes them).
template <class T>
struct KvDestination {
  int rank = 0;      ///< the rank that stores the token
  T* k = nullptr;    ///< its K row (on `rank`)
  T* v = nullptr;    ///< its V row (on `rank`; unused when V does not move)
};

/// Moves K/V rows to wherever `destination` says (collective: every rank calls it), so that a
/// dense decode cache and an engine's paged pool share one exchange.
/// `tokens[r]`: the token of each of rank r's rows, in row order, for every rank r;
/// `k`, `v`: this rank's rows, `row` and `v_row` elements each, contiguous;
/// `destination(token)` -> KvDestination<T>: every rank must give the same rank for a token
/// (senders and receivers both derive the message sizes from it); the row pointers are read
/// only on that rank, so the owner must have room for the rows (pages) before the call.
/// `v` null: V lives in K's rows (MLA's latent cache), so only K moves. Returns the bytes this
/// rank sent to other ranks (a token's K and V row each).
template <class T, class Comm, class Destination>
std::size_t hand_off_kv(Comm& comm, const std::vector<std::vector<CacheToken>>& tokens, const T* k, const T* v,
                        std::size_t row, std::size_t v_row, Destination&& destination) {
  const auto P = static_cast<std::size_t>(comm.size());
  const int me = comm.rank();
  if (!v) v_row = 0;
  const std::size_t row_bytes = row * sizeof(T), v_row_bytes = v_row * sizeof(T);
  const std::size_t token_bytes = row_bytes + v_row_bytes;  // a message holds K then V
  auto owner = [&](const CacheToken& t) { return static_cast<std::size_t>(destination(t).rank); };

  std::vector<std::size_t> send_counts(P), send_displs(P), recv_counts(P), recv_displs(P);
  for (const CacheToken& t : tokens[static_cast<std::size_t>(me)]) send_counts[owner(t)] += token_bytes;
  for (std::size_t r = 0; r < P; ++r)
    for (const CacheToken& t : tokens[r])
      if (owner(t) == static_cast<std::size_t>(me)) recv_counts[r] += token_bytes;
  for (std::size_t r = 1; r < P; ++r) {
    send_displs[r] = send_displs[r - 1] + send_counts[r - 1];
    recv_displs[r] = recv_displs[r - 1] + recv_counts[r - 1];
  }
  std::vector<std::byte> send(send_displs[P - 1] + send_counts[P - 1] + 1), recv(recv_displs[P - 1] + recv_counts[P - 1] + 1);

  // Pack in row order, each destination's rows together.
  std::vector<std::size_t> at = send_displs;
  const std::vector<CacheToken>& mine = tokens[static_cast<std::size_t>(me)];
  for (std::size_t i = 0; i < mine.size(); ++i) {
    std::byte* to = send.data() + std::exchange(at[owner(mine[i])], at[owner(mine[i])] + token_bytes);
    std::memcpy(to, k + i * row, row_bytes);
    if (v) std::memcpy(to + row_bytes, v + i * v_row, v_row_bytes);
  }
  comm.all_to_all_v(send.data(), send_counts, send_displs, recv.data(), recv_counts, recv_displs);

  // Unpack: sender r's rows arrive in its row order, so walk its tokens and keep mine.
  for (std::size_t r = 0; r < P; ++r) {
    const std::byte* from = recv.data() + recv_displs[r];
    for (const CacheToken& t : tokens[r]) {
      const KvDestination<T> d = destination(t);
      if (d.rank != me) continue;
      std::memcpy(d.k, from, row_bytes);
      if (v) std::memcpy(d.v, from + row_bytes, v_row_bytes);
      from += token_bytes;
    }
  }
  return send_displs[P - 1] + send_counts[P - 1] - send_counts[static_cast<std::size_t>(me)];
}

/// Moves K/V rows to their decode cache slots (collective: every rank calls it).
/// `tokens[r]`: the token of each of rank r's rows, in row order, for every rank r;
/// `k`, `v`: this rank's rows, [tokens[me].size(), K, D] and [.., K, D_v] contiguous;
/// `k_cache`, `v_cache`: this rank's shards, [B, plan.shard_capacity(), K, D] and [.., K, D_v]
/// contiguous. `v` and `v_cache` null: V lives in K's rows (MLA's latent cache, V a column view
/// of K), so only K moves. Returns the bytes this rank sent to other ranks (a token's K and V
/// row each).
template <class T, class Comm>
std::size_t hand_off_kv(Comm& comm, const std::vector<std::vector<CacheToken>>& tokens, const DecodePlan& plan,
                        const T* k, const T* v, T* k_cache, T* v_cache) {
  const DecodeProblem& pr = plan.problem();
  const auto row = static_cast<std::size_t>(pr.kv_head_count() * pr.head_dim);      // elements of one K row
  const auto v_row = static_cast<std::size_t>(pr.kv_head_count() * pr.value_dim());  // and of one V row
  const auto C = static_cast<std::size_t>(plan.shard_capacity());
  return hand_off_kv<T>(comm, tokens, k, v, row, v_row, [&](const CacheToken& t) {
    const int rank = plan.owner(t.b, t.pos);
    if (rank != comm.rank()) return KvDestination<T>{rank};
    const std::size_t slot = static_cast<std::size_t>(t.b) * C + static_cast<std::size_t>(plan.slot(t.b, t.pos));
    return KvDestination<T>{rank, k_cache + slot * row, v_cache ? v_cache + slot * v_row : nullptr};
  });
}

}  // namespace seqpar::examples
