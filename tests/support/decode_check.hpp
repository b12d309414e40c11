// The decode scenarios' exact reference: a cache and queries known in whole, every step's
// output against attention over the whole cache in double, by the brute force of
// attention_check.hpp (with today's models' features: D_v, soft-cap, sinks, V as a column view
// of K's rows), on thread ranks or any communicator (tests/test_decode.cpp, the MPI suite and
// the allocation count of tests/test_thread_comm_alloc.cpp); and a step on ranks whose plans
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
#include "support/attention_check.hpp"
#include "support/rank_outcomes.hpp"

namespace seqpar::test {

/// Head dim of the decode cases that vary layout and world, not the kernel (small).
inline constexpr std::int64_t D = 8;

/// Today's models' features of a decode case (the defaults: none, head dim D).
struct DecodeFeatures {
  std::int64_t head_dim = D;    ///< D of Q and K
  std::int64_t head_dim_v = 0;  ///< D_v of V and O (0: D)
  double softcap = 0;           ///< 0: off
  bool sinks = false;           ///< one random logit per query head
  bool v_in_k = false;          ///< V is the first D_v columns of K's rows (MLA's latent cache; D_v <= D)

  /// D_v with 0 resolved.
  std::int64_t value_dim() const { return head_dim_v == 0 ? head_dim : head_dim_v; }
};

/// One decode scenario: world size, per-sequence cache lengths before the first step, page
/// (0 = contiguous), new tokens per step, head counts, exchange, number of steps and features.
struct DecodeCase {
  int ranks;
  std::vector<std::int64_t> kv_len;
  std::int64_t page, new_tokens, heads, kv_heads;
  DecodeExchange exchange;
  int steps;
  DecodeFeatures features{};
};

/// The whole truth: per sequence, K and V for every position up to capacity, every step's
/// queries [B, T, H, D] and, with sinks, one logit per head.
struct Truth {
  std::int64_t B, cap, H, K, T, D, Dv;
  bool v_in_k;
  double softcap;
  std::vector<float> k, v;               // [B, cap, K, D], [B, cap, K, D_v] (with v_in_k: K's first D_v columns)
  std::vector<std::vector<float>> q;     // per step, [B, T, H, D]
  std::vector<float> sinks;              // [H], empty without sinks
  Truth(const DecodeCase& c, std::int64_t capacity)
      : B(static_cast<std::int64_t>(c.kv_len.size())), cap(capacity), H(c.heads), K(c.kv_heads), T(c.new_tokens),
        D(c.features.head_dim), Dv(c.features.value_dim()), v_in_k(c.features.v_in_k), softcap(c.features.softcap) {
    REQUIRE((!v_in_k || Dv <= D));
    std::mt19937_64 rng(5 + c.ranks * 7 + c.page);
    std::normal_distribution<float> n(0.f, 1.f);
    k.resize(static_cast<std::size_t>(B * cap * K * D));
    v.resize(static_cast<std::size_t>(B * cap * K * Dv));
    for (float& x : k) x = n(rng);
    const auto d = static_cast<std::size_t>(D), dv = static_cast<std::size_t>(Dv);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = v_in_k ? k[i / dv * d + i % dv] : n(rng);
    for (int s = 0; s < c.steps; ++s) {
      q.emplace_back(static_cast<std::size_t>(B * T * H * D));
      for (float& x : q.back()) x = n(rng);
    }
    // Logits in [0, 4): each sink weighs about as much as the keys of a short cache.
    std::uniform_real_distribution<float> u(0.f, 4.f);
    if (c.features.sinks)
      for (std::int64_t h = 0; h < H; ++h) sinks.push_back(u(rng));
  }
  const float* krow(std::int64_t b, std::int64_t pos, std::int64_t h) const { return &k[((b * cap + pos) * K + h) * D]; }
  const float* vrow(std::int64_t b, std::int64_t pos, std::int64_t h) const { return &v[((b * cap + pos) * K + h) * Dv]; }
  /// The sinks for a problem (null without).
  const float* sink_logits() const { return sinks.empty() ? nullptr : sinks.data(); }
};

/// Step s's exact output for sequence b, [T, H, D_v] in double: attention of its T queries
/// (positions len..len + T - 1) over positions 0..len + T - 1, causal, by brute force.
/// `sink_shift` is added to every sink (ln 2: a sink counted twice).
inline std::vector<double> reference(const Truth& tr, int s, std::int64_t b, std::int64_t len, double sink_shift = 0) {
  const std::int64_t n = len + tr.T;
  std::vector<float> shifted = tr.sinks;
  for (float& x : shifted) x = static_cast<float>(x + sink_shift);
  AttentionProblem pr;
  pr.batch = 1;
  pr.heads = tr.H;
  pr.kv_heads = tr.K;
  pr.head_dim = tr.D;
  pr.head_dim_v = tr.Dv;
  pr.causal = true;
  pr.causal_align = CausalAlign::bottom_right;  // the T queries are the last T positions
  pr.softcap = tr.softcap;
  pr.sinks = shifted.empty() ? nullptr : shifted.data();
  const float* q = &tr.q[static_cast<std::size_t>(s)][static_cast<std::size_t>(b * tr.T * tr.H * tr.D)];
  const std::vector<double> qd(q, q + tr.T * tr.H * tr.D);
  const std::vector<double> kd(tr.krow(b, 0, 0), tr.krow(b, 0, 0) + n * tr.K * tr.D),
      vd(tr.vrow(b, 0, 0), tr.vrow(b, 0, 0) + n * tr.K * tr.Dv);
  return brute_force_forward({pr, tr.T, n, qd, kd, vd}).out;
}

/// The case's problem: capacity for every step's tokens, elements of type `dtype`, its
/// features, and `sinks` (the truth's sink_logits(), in the decode's memory space).
inline DecodeProblem decode_problem(const DecodeCase& c, DType dtype = DType::f32, const float* sinks = nullptr) {
  std::int64_t capacity = 0;
  for (std::int64_t l : c.kv_len) capacity = std::max(capacity, l);
  const DecodeFeatures& f = c.features;
  return {.batch = static_cast<std::int64_t>(c.kv_len.size()), .heads = c.heads, .kv_heads = c.kv_heads,
          .head_dim = f.head_dim, .head_dim_v = f.head_dim_v, .softcap = f.softcap, .dtype = dtype,
          .new_tokens = c.new_tokens, .kv_len = c.kv_len, .capacity = capacity + c.new_tokens * c.steps,
          .page = c.page, .exchange = c.exchange, .sinks = sinks};
}

/// Writes the K/V of token `pos` of sequence b into this rank's shards kc ([B, shard_capacity,
/// K, D]) and vc ([B, shard_capacity, K, D_v]; untouched with v_in_k, where V is K's columns)
/// when the plan puts the token on this rank (prefill and appends alike).
template <class X>
void put_token(const Truth& tr, const DecodePlan& plan, std::int64_t b, std::int64_t pos, std::vector<X>& kc,
               std::vector<X>& vc) {
  if (plan.owner(b, pos) != plan.rank()) return;
  const std::int64_t s = plan.slot(b, pos), C = plan.shard_capacity();
  REQUIRE(s < C);
  for (std::int64_t h = 0; h < tr.K; ++h) {
    for (std::int64_t e = 0; e < tr.D; ++e)
      kc[static_cast<std::size_t>(((b * C + s) * tr.K + h) * tr.D + e)] = static_cast<X>(tr.krow(b, pos, h)[e]);
    for (std::int64_t e = 0; e < tr.Dv && !tr.v_in_k; ++e)
      vc[static_cast<std::size_t>(((b * C + s) * tr.K + h) * tr.Dv + e)] = static_cast<X>(tr.vrow(b, pos, h)[e]);
  }
}

/// Step s's queries of this rank's query heads into q ([B, T, plan.q_heads(), D]).
template <class X>
void step_queries(const Truth& tr, const DecodePlan& plan, int s, std::vector<X>& q) {
  const HeadRange qh = plan.q_heads();
  const std::int64_t D = tr.D;
  for (std::int64_t b = 0; b < tr.B; ++b)
    for (std::int64_t t = 0; t < tr.T; ++t)
      for (std::int64_t h = 0; h < qh.count; ++h)
        for (std::int64_t e = 0; e < D; ++e)
          q[static_cast<std::size_t>(((b * tr.T + t) * qh.count + h) * D + e)] =
              static_cast<X>(tr.q[static_cast<std::size_t>(s)][static_cast<std::size_t>(((b * tr.T + t) * tr.H + qh.begin + h) * D + e)]);
}

/// Normwise error (max |got - want| / max |want|) of step s's output `out` ([B, T,
/// plan.out_heads(), D_v]) against attention over the whole cache in double; NaN gives infinity.
template <class X>
double step_error(const Truth& tr, const DecodePlan& plan, int s, const std::vector<X>& out) {
  const HeadRange oh = plan.out_heads();
  const std::int64_t Dv = tr.Dv;
  double num = 0, den = 0;
  for (std::int64_t b = 0; b < tr.B; ++b) {
    const std::vector<double> want = reference(tr, s, b, plan.kv_len(b));
    for (std::int64_t t = 0; t < tr.T; ++t)
      for (std::int64_t h = 0; h < oh.count; ++h)
        for (std::int64_t e = 0; e < Dv; ++e) {
          const auto i = static_cast<std::size_t>(((b * tr.T + t) * oh.count + h) * Dv + e);
          const double got = static_cast<double>(out[i]);
          const double w = want[static_cast<std::size_t>((t * tr.H + oh.begin + h) * Dv + e)];
          num = std::isnan(got) ? std::numeric_limits<double>::infinity() : std::max(num, std::abs(got - w));
          den = std::max(den, std::abs(w));
        }
  }
  return den > 0 ? num / den : num;
}

/// How far the first step's exact output moves when every sink counts twice (normwise): a
/// decode that joined a sink on two ranks would be off by this much.
inline double double_sink_shift(const DecodeCase& c) {
  const Truth tr(c, decode_problem(c).capacity);
  double num = 0, den = 0;
  for (std::int64_t b = 0; b < tr.B; ++b) {
    const std::int64_t len = c.kv_len[static_cast<std::size_t>(b)];
    const std::vector<double> once = reference(tr, 0, b, len), twice = reference(tr, 0, b, len, std::log(2.0));
    for (std::size_t i = 0; i < once.size(); ++i) {
      num = std::max(num, std::abs(twice[i] - once[i]));
      den = std::max(den, std::abs(once[i]));
    }
  }
  return den > 0 ? num / den : num;
}

/// Calls the step it is given (the default hook of run_decode_case).
struct JustStep {
  template <class Comm, class Step>
  void operator()(Comm&, int, Step&& step) const { step(); }
};

/// Runs the case's steps on this rank of `world` with `Kernel` and returns the worst normwise
/// error of its steps; every step's bytes must be the plan's. `hook(world, s, step)` runs step
/// s (a test can wrap it, e.g. to count allocations).
template <class Kernel = ReferenceKernel, class Comm, class Hook = JustStep>
double decode_rank_error(Comm& world, const DecodeCase& c, const Truth& tr, Hook hook = {}) {
  const DecodeProblem pr = decode_problem(c, DType::f32, tr.sink_logits());
  const std::int64_t B = pr.batch, T = pr.new_tokens, K = c.kv_heads, Dq = tr.D, Dv = tr.Dv;
  SequenceParallelDecode<Comm, Kernel> dec(world);
  DecodePlan plan = dec.plan(pr);
  const std::int64_t C = plan.shard_capacity();
  std::vector<float> kc(static_cast<std::size_t>(B * C * K * Dq)),
      vc(tr.v_in_k ? 0 : static_cast<std::size_t>(B * C * K * Dv));
  // Prefill leaves the cache where the layout says; each step appends its T tokens.
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t pos = 0; pos < c.kv_len[static_cast<std::size_t>(b)]; ++pos) put_token(tr, plan, b, pos, kc, vc);
  const HeadRange qh = plan.q_heads(), oh = plan.out_heads();
  std::vector<float> q(static_cast<std::size_t>(B * T * qh.count * Dq)),
      out(static_cast<std::size_t>(B * T * oh.count * Dv));
  std::vector<std::byte> ws(plan.workspace_bytes());
  const auto k_view = TensorView<const float>::bshd(kc.data(), B, C, K, Dq);
  TensorView<const float> v_view = TensorView<const float>::bshd(vc.data(), B, C, K, Dv);
  if (tr.v_in_k) {  // MLA: V is the first D_v columns of K's rows, the same memory
    v_view = k_view;
    v_view.extent[3] = Dv;
  }
  double err = 0;
  for (int s = 0; s < c.steps; ++s) {
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < T; ++t) put_token(tr, plan, b, plan.kv_len(b) + t, kc, vc);
    step_queries(tr, plan, s, q);
    const std::uint64_t before = world.stats().bytes_sent;
    hook(world, s, [&] {
      dec.template step<float>(plan, TensorView<const float>::bshd(q.data(), B, T, qh.count, Dq), k_view, v_view,
                               TensorView<float>::bshd(out.data(), B, T, oh.count, Dv), ws);
    });
    CHECK(world.stats().bytes_sent - before == plan.step_bytes());
    err = std::max(err, step_error(tr, plan, s, out));
    plan.advance(T);
  }
  return err;
}

/// Runs the case's steps on thread ranks with `Kernel`; returns the worst normwise error over
/// all ranks and steps (decode_rank_error on each rank).
template <class Kernel = ReferenceKernel, class Hook = JustStep>
double run_decode_case(const DecodeCase& c, Hook hook = {}) {
  const Truth tr(c, decode_problem(c).capacity);
  std::vector<double> err(static_cast<std::size_t>(c.ranks), 0.0);
  run_ranks(c.ranks, [&](ThreadCommunicator& world) {
    err[static_cast<std::size_t>(world.rank())] = decode_rank_error<Kernel>(world, c, tr, hook);
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
