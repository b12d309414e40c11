// Decode over a sharded KV cache (issue 20): every step against attention over the whole cache
// in double, for world sizes 1-8, ragged caches (some empty on some ranks), contiguous and paged
// layouts (page 1, 16, larger than a shard), 1 and 16 new tokens, GQA, both exchanges, growth
// over many steps with appends on the owner rank; bytes per step equal the plan's count; a rank
// that advanced differently is named on every rank.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "seqpar/decode/sequence_parallel_decode.hpp"
#include "seqpar/seqpar.hpp"
#include "support/rank_outcomes.hpp"

using namespace seqpar;

namespace {

struct Case {
  int ranks;
  std::vector<std::int64_t> kv_len;
  std::int64_t page, new_tokens, heads, kv_heads;
  DecodeExchange exchange;
  int steps;
};

constexpr std::int64_t D = 8;

/// The whole truth: per sequence, K and V for every position up to capacity, and every step's
/// queries [B, T, H, D].
struct Truth {
  std::int64_t B, cap, H, K, T;
  std::vector<float> k, v;               // [B, cap, K, D]
  std::vector<std::vector<float>> q;     // per step, [B, T, H, D]
  Truth(const Case& c, std::int64_t capacity)
      : B(static_cast<std::int64_t>(c.kv_len.size())), cap(capacity), H(c.heads), K(c.kv_heads), T(c.new_tokens) {
    std::mt19937_64 rng(5 + c.ranks * 7 + c.page);
    std::normal_distribution<float> n(0.f, 1.f);
    k.resize(static_cast<std::size_t>(B * cap * K * D));
    v.resize(k.size());
    for (float& x : k) x = n(rng);
    for (float& x : v) x = n(rng);
    for (int s = 0; s < c.steps; ++s) {
      q.emplace_back(static_cast<std::size_t>(B * T * H * D));
      for (float& x : q.back()) x = n(rng);
    }
  }
  const float* krow(std::int64_t b, std::int64_t pos, std::int64_t h) const { return &k[((b * cap + pos) * K + h) * D]; }
  const float* vrow(std::int64_t b, std::int64_t pos, std::int64_t h) const { return &v[((b * cap + pos) * K + h) * D]; }
};

/// Attention of step s's query (b, t, h) over positions 0..len_b + t, in double.
std::vector<double> reference(const Truth& tr, int s, std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t len) {
  const float* q = &tr.q[static_cast<std::size_t>(s)][((b * tr.T + t) * tr.H + h) * D];
  const std::int64_t kh = h / (tr.H / tr.K), n = len + t + 1;
  std::vector<double> sc(static_cast<std::size_t>(n));
  double mx = -std::numeric_limits<double>::infinity();
  for (std::int64_t j = 0; j < n; ++j) {
    double d = 0;
    for (std::int64_t e = 0; e < D; ++e) d += double(q[e]) * tr.krow(b, j, kh)[e];
    sc[j] = d / std::sqrt(double(D));
    mx = std::max(mx, sc[j]);
  }
  std::vector<double> o(D, 0.0);
  double sum = 0;
  for (std::int64_t j = 0; j < n; ++j) sum += std::exp(sc[j] - mx);
  for (std::int64_t j = 0; j < n; ++j)
    for (std::int64_t e = 0; e < D; ++e) o[e] += std::exp(sc[j] - mx) / sum * tr.vrow(b, j, kh)[e];
  return o;
}

/// Runs the case's steps on thread ranks; returns the worst normwise error over all steps.
double run_case(const Case& c) {
  const std::int64_t B = static_cast<std::int64_t>(c.kv_len.size());
  std::int64_t capacity = 0;
  for (std::int64_t l : c.kv_len) capacity = std::max(capacity, l);
  capacity += c.new_tokens * c.steps;
  const Truth tr(c, capacity);
  std::vector<double> err(static_cast<std::size_t>(c.ranks), 0.0);
  run_ranks(c.ranks, [&](ThreadCommunicator& world) {
    const int me = world.rank();
    SequenceParallelDecode<ThreadCommunicator, ReferenceKernel> dec(world);
    DecodeProblem pr{.batch = B, .heads = c.heads, .kv_heads = c.kv_heads, .head_dim = D, .new_tokens = c.new_tokens,
                     .kv_len = c.kv_len, .capacity = capacity, .page = c.page, .exchange = c.exchange};
    DecodePlan plan = dec.plan(pr);
    const std::int64_t C = plan.shard_capacity(), T = c.new_tokens;
    std::vector<float> kc(static_cast<std::size_t>(B * C * c.kv_heads * D)), vc(kc.size());
    // Prefill leaves the cache where the layout says; each step appends its T tokens.
    auto put = [&](std::int64_t b, std::int64_t pos) {
      if (plan.owner(b, pos) != me) return;
      const std::int64_t s = plan.slot(b, pos);
      REQUIRE(s < C);
      for (std::int64_t h = 0; h < c.kv_heads; ++h)
        for (std::int64_t e = 0; e < D; ++e) {
          kc[((b * C + s) * c.kv_heads + h) * D + e] = tr.krow(b, pos, h)[e];
          vc[((b * C + s) * c.kv_heads + h) * D + e] = tr.vrow(b, pos, h)[e];
        }
    };
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t pos = 0; pos < c.kv_len[static_cast<std::size_t>(b)]; ++pos) put(b, pos);
    const HeadRange qh = plan.q_heads(), oh = plan.out_heads();
    std::vector<float> q(static_cast<std::size_t>(B * T * qh.count * D)), out(static_cast<std::size_t>(B * T * oh.count * D));
    std::vector<std::byte> ws(plan.workspace_bytes());
    for (int s = 0; s < c.steps; ++s) {
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < T; ++t) put(b, plan.kv_len(b) + t);
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t h = 0; h < qh.count; ++h)
            for (std::int64_t e = 0; e < D; ++e)
              q[((b * T + t) * qh.count + h) * D + e] = tr.q[static_cast<std::size_t>(s)][((b * T + t) * c.heads + qh.begin + h) * D + e];
      const std::uint64_t before = world.stats().bytes_sent;
      dec.step<float>(plan, TensorView<const float>::bshd(q.data(), B, T, qh.count, D),
                      TensorView<const float>::bshd(kc.data(), B, C, c.kv_heads, D),
                      TensorView<const float>::bshd(vc.data(), B, C, c.kv_heads, D),
                      TensorView<float>::bshd(out.data(), B, T, oh.count, D), ws);
      CHECK(world.stats().bytes_sent - before == plan.step_bytes());
      double num = 0, den = 0;
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t h = 0; h < oh.count; ++h) {
            const auto want = reference(tr, s, b, t, oh.begin + h, plan.kv_len(b));
            for (std::int64_t e = 0; e < D; ++e) {
              num = std::max(num, std::abs(out[((b * T + t) * oh.count + h) * D + e] - want[e]));
              den = std::max(den, std::abs(want[e]));
            }
          }
      err[static_cast<std::size_t>(me)] = std::max(err[static_cast<std::size_t>(me)], den > 0 ? num / den : num);
      plan.advance(T);
    }
  });
  return *std::max_element(err.begin(), err.end());
}

}  // namespace

TEST_CASE("decode: every step equals attention over the whole cache") {
  using E = DecodeExchange;
  const std::vector<Case> cases = {
      {1, {37, 5}, 0, 1, 4, 2, E::all_gather, 3},
      {2, {100, 0, 33}, 0, 1, 4, 2, E::all_gather, 4},      // contiguous, an empty sequence
      {3, {50, 7}, 1, 4, 6, 3, E::all_gather, 5},           // stripe (page 1), T = 4
      {4, {3000, 517}, 16, 4, 4, 2, E::all_gather, 3},      // the demo's shape
      {4, {3000, 517}, 16, 4, 4, 2, E::heads, 3},           // queries sharded by heads
      {5, {9, 0, 130}, 64, 16, 5, 1, E::heads, 3},          // page larger than a shard, T = 16, MQA, 5 ranks
      {6, {2, 3}, 4, 1, 12, 4, E::all_gather, 20},          // caches empty on most ranks, growth over 20 steps
      {7, {61, 300, 1}, 0, 16, 7, 7, E::heads, 4},          // contiguous appends on the last rank, 7 ranks
      {8, {1000}, 1, 2, 8, 2, E::all_gather, 6},            // 8 ranks striped
  };
  for (const Case& c : cases) {
    CAPTURE(c.ranks);
    CAPTURE(c.page);
    CAPTURE(c.new_tokens);
    CAPTURE(static_cast<int>(c.exchange));
    CHECK(run_case(c) < 1e-5);
  }
}

TEST_CASE("decode: the layout puts every token on exactly one rank, in increasing slots") {
  for (int P : {1, 3, 4})
    for (std::int64_t page : {0, 1, 16, 1000}) {
      const CacheLayout l(P, page, {40, 0});
      for (std::int64_t b = 0; b < 2; ++b) {
        std::vector<std::int64_t> next(static_cast<std::size_t>(P), 0);
        for (std::int64_t pos = 0; pos < 200; ++pos) {
          const int r = l.owner(b, pos);
          CHECK(l.slot(b, pos) == next[static_cast<std::size_t>(r)]++);  // slots fill in position order
        }
        for (int r = 0; r < P; ++r) CHECK(l.count(r, b, 200) == next[static_cast<std::size_t>(r)]);
      }
    }
}

TEST_CASE("decode: a rank whose plan advanced differently is named on every rank, no hang") {
  auto out = test::rank_outcomes(3, [](ThreadCommunicator& world) {
    SequenceParallelDecode<ThreadCommunicator, ReferenceKernel> dec(world);
    DecodePlan plan = dec.plan({.batch = 1, .heads = 3, .head_dim = D, .kv_len = {10}, .capacity = 40, .page = 2});
    if (world.rank() == 1) plan.advance(1);  // one rank thinks a token more is cached
    std::vector<float> q(3 * D), kc(static_cast<std::size_t>(plan.shard_capacity() * 3 * D)), o(q.size());
    std::vector<std::byte> ws(plan.workspace_bytes());
    dec.step<float>(plan, TensorView<const float>::bshd(q.data(), 1, 1, 3, D),
                    TensorView<const float>::bshd(kc.data(), 1, plan.shard_capacity(), 3, D),
                    TensorView<const float>::bshd(kc.data(), 1, plan.shard_capacity(), 3, D),
                    TensorView<float>::bshd(o.data(), 1, 1, 3, D), ws);
  });
  for (const auto& o : out) {
    CAPTURE(o.what);
    CHECK(o.kind == "ConfigError");
    CHECK(o.what.find("is at another step than rank") != std::string::npos);
  }
  auto bad = test::rank_outcomes(2, [](ThreadCommunicator& world) {
    SequenceParallelDecode<ThreadCommunicator, ReferenceKernel> dec(world);
    (void)dec.plan({.batch = 2, .heads = 2, .head_dim = D, .new_tokens = 17, .kv_len = {1, 2}, .capacity = 40});
  });
  CHECK(test::all_same_config_error(bad, "decode plan: new_tokens: expected 1..16, got 17"));
}
