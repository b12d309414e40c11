// The decode scenarios' exact reference: a cache and queries known in whole, every step's
// output against attention over the whole cache in double (tests/test_decode.cpp and the
// allocation count of tests/test_thread_comm_alloc.cpp); and a step on ranks whose plans
// disagree.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "seqpar/decode/sequence_parallel_decode.hpp"
#include "seqpar/seqpar.hpp"
#include "support/rank_outcomes.hpp"

namespace seqpar::test {

/// One decode scenario: world size, per-sequence cache lengths before the first step, page
/// (0 = contiguous), new tokens per step, head counts, exchange and number of steps.
struct DecodeCase {
  int ranks;
  std::vector<std::int64_t> kv_len;
  std::int64_t page, new_tokens, heads, kv_heads;
  DecodeExchange exchange;
  int steps;
};

/// Head dim of every decode case (small: the cases vary layout and world, not the kernel).
inline constexpr std::int64_t D = 8;

/// The whole truth: per sequence, K and V for every position up to capacity, and every step's
/// queries [B, T, H, D].
struct Truth {
  std::int64_t B, cap, H, K, T;
  std::vector<float> k, v;               // [B, cap, K, D]
  std::vector<std::vector<float>> q;     // per step, [B, T, H, D]
  Truth(const DecodeCase& c, std::int64_t capacity)
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
inline std::vector<double> reference(const Truth& tr, int s, std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t len) {
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

/// The case's problem: capacity for every step's tokens, elements of type `dtype`.
inline DecodeProblem decode_problem(const DecodeCase& c, DType dtype = DType::f32) {
  std::int64_t capacity = 0;
  for (std::int64_t l : c.kv_len) capacity = std::max(capacity, l);
  return {.batch = static_cast<std::int64_t>(c.kv_len.size()), .heads = c.heads, .kv_heads = c.kv_heads, .head_dim = D,
          .dtype = dtype, .new_tokens = c.new_tokens, .kv_len = c.kv_len,
          .capacity = capacity + c.new_tokens * c.steps, .page = c.page, .exchange = c.exchange};
}

/// Writes the K/V of token `pos` of sequence b into this rank's shards kc, vc ([B,
/// shard_capacity, K, D]) when the plan puts the token on this rank (prefill and appends alike).
template <class X>
void put_token(const Truth& tr, const DecodePlan& plan, std::int64_t b, std::int64_t pos, std::vector<X>& kc,
               std::vector<X>& vc) {
  if (plan.owner(b, pos) != plan.rank()) return;
  const std::int64_t s = plan.slot(b, pos), C = plan.shard_capacity();
  REQUIRE(s < C);
  for (std::int64_t h = 0; h < tr.K; ++h)
    for (std::int64_t e = 0; e < D; ++e) {
      kc[static_cast<std::size_t>(((b * C + s) * tr.K + h) * D + e)] = static_cast<X>(tr.krow(b, pos, h)[e]);
      vc[static_cast<std::size_t>(((b * C + s) * tr.K + h) * D + e)] = static_cast<X>(tr.vrow(b, pos, h)[e]);
    }
}

/// Step s's queries of this rank's query heads into q ([B, T, plan.q_heads(), D]).
template <class X>
void step_queries(const Truth& tr, const DecodePlan& plan, int s, std::vector<X>& q) {
  const HeadRange qh = plan.q_heads();
  for (std::int64_t b = 0; b < tr.B; ++b)
    for (std::int64_t t = 0; t < tr.T; ++t)
      for (std::int64_t h = 0; h < qh.count; ++h)
        for (std::int64_t e = 0; e < D; ++e)
          q[static_cast<std::size_t>(((b * tr.T + t) * qh.count + h) * D + e)] =
              static_cast<X>(tr.q[static_cast<std::size_t>(s)][static_cast<std::size_t>(((b * tr.T + t) * tr.H + qh.begin + h) * D + e)]);
}

/// Normwise error (max |got - want| / max |want|) of step s's output `out` ([B, T,
/// plan.out_heads(), D]) against attention over the whole cache in double; NaN gives infinity.
template <class X>
double step_error(const Truth& tr, const DecodePlan& plan, int s, const std::vector<X>& out) {
  const HeadRange oh = plan.out_heads();
  double num = 0, den = 0;
  for (std::int64_t b = 0; b < tr.B; ++b)
    for (std::int64_t t = 0; t < tr.T; ++t)
      for (std::int64_t h = 0; h < oh.count; ++h) {
        const auto want = reference(tr, s, b, t, oh.begin + h, plan.kv_len(b));
        for (std::int64_t e = 0; e < D; ++e) {
          const double got = static_cast<double>(out[static_cast<std::size_t>(((b * tr.T + t) * oh.count + h) * D + e)]);
          num = std::isnan(got) ? std::numeric_limits<double>::infinity() : std::max(num, std::abs(got - want[e]));
          den = std::max(den, std::abs(want[e]));
        }
      }
  return den > 0 ? num / den : num;
}

/// Calls the step it is given (the default hook of run_decode_case).
struct JustStep {
  template <class Step>
  void operator()(ThreadCommunicator&, int, Step&& step) const { step(); }
};

/// Runs the case's steps on thread ranks with `Kernel`; returns the worst normwise error over
/// all steps. `hook(world, s, step)` runs step s (a test can wrap it, e.g. to count allocations).
template <class Kernel = ReferenceKernel, class Hook = JustStep>
double run_decode_case(const DecodeCase& c, Hook hook = {}) {
  const DecodeProblem pr = decode_problem(c);
  const std::int64_t B = pr.batch, T = pr.new_tokens;
  const Truth tr(c, pr.capacity);
  std::vector<double> err(static_cast<std::size_t>(c.ranks), 0.0);
  run_ranks(c.ranks, [&](ThreadCommunicator& world) {
    const int me = world.rank();
    SequenceParallelDecode<ThreadCommunicator, Kernel> dec(world);
    DecodePlan plan = dec.plan(pr);
    const std::int64_t C = plan.shard_capacity();
    std::vector<float> kc(static_cast<std::size_t>(B * C * c.kv_heads * D)), vc(kc.size());
    // Prefill leaves the cache where the layout says; each step appends its T tokens.
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t pos = 0; pos < c.kv_len[static_cast<std::size_t>(b)]; ++pos) put_token(tr, plan, b, pos, kc, vc);
    const HeadRange qh = plan.q_heads(), oh = plan.out_heads();
    std::vector<float> q(static_cast<std::size_t>(B * T * qh.count * D)), out(static_cast<std::size_t>(B * T * oh.count * D));
    std::vector<std::byte> ws(plan.workspace_bytes());
    for (int s = 0; s < c.steps; ++s) {
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < T; ++t) put_token(tr, plan, b, plan.kv_len(b) + t, kc, vc);
      step_queries(tr, plan, s, q);
      const std::uint64_t before = world.stats().bytes_sent;
      hook(world, s, [&] {
        dec.template step<float>(plan, TensorView<const float>::bshd(q.data(), B, T, qh.count, D),
                      TensorView<const float>::bshd(kc.data(), B, C, c.kv_heads, D),
                      TensorView<const float>::bshd(vc.data(), B, C, c.kv_heads, D),
                      TensorView<float>::bshd(out.data(), B, T, oh.count, D), ws);
      });
      CHECK(world.stats().bytes_sent - before == plan.step_bytes());
      err[static_cast<std::size_t>(me)] = std::max(err[static_cast<std::size_t>(me)], step_error(tr, plan, s, out));
      plan.advance(T);
    }
  });
  return *std::max_element(err.begin(), err.end());
}

/// One decode step (ReferenceKernel, exchange `ex`, 3 heads) on `ranks` thread ranks after
/// rank `odd` advanced its plan one token further than the others; returns how each rank ended.
inline std::vector<RankOutcome> step_with_odd_rank(int ranks, int odd, DecodeExchange ex) {
  return rank_outcomes(ranks, [&](ThreadCommunicator& world) {
    SequenceParallelDecode<ThreadCommunicator, ReferenceKernel> dec(world);
    DecodePlan plan =
        dec.plan({.batch = 1, .heads = 3, .head_dim = D, .kv_len = {10}, .capacity = 40, .page = 2, .exchange = ex});
    if (world.rank() == odd) plan.advance(1);  // this rank thinks a token more is cached
    const HeadRange qh = plan.q_heads(), oh = plan.out_heads();
    std::vector<float> q(static_cast<std::size_t>(qh.count * D)), o(static_cast<std::size_t>(oh.count * D)),
        kc(static_cast<std::size_t>(plan.shard_capacity() * 3 * D));
    std::vector<std::byte> ws(plan.workspace_bytes());
    dec.step<float>(plan, TensorView<const float>::bshd(q.data(), 1, 1, qh.count, D),
                    TensorView<const float>::bshd(kc.data(), 1, plan.shard_capacity(), 3, D),
                    TensorView<const float>::bshd(kc.data(), 1, plan.shard_capacity(), 3, D),
                    TensorView<float>::bshd(o.data(), 1, 1, oh.count, D), ws);
  });
}

}  // namespace seqpar::test
