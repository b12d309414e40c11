#pragma once
/// \file
/// calibrate: the cost model's Machine measured on the machine it runs on. Every rank times
/// its local kernel at once (a one-rank engine, so the engine's own copies count as they will)
/// and a local copy, then an exchange with its ring neighbours (a small one for the latency, a
/// large one for the bandwidth), so that shared cores and memory are shared as in a run; the
/// median rank counts. Every rank returns the same Machine.
/// Collective; a few hundred ms at the default sizes.

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "seqpar/advise/cost_model.hpp"
#include "seqpar/attention.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/types.hpp"

namespace seqpar {

/// What calibrate measures with: the problem's heads, dims, mask and dtype at `tokens` tokens
/// (the local length a rank will compute), `rounds` timed calls per figure (median).
struct CalibrationOptions {
  std::int64_t tokens = 1024;            ///< query and key tokens of the timed local attention
  int rounds = 3;                        ///< timed calls per figure, after one warm-up; the median counts
  std::size_t exchange_bytes = 8 << 20;  ///< the large exchange (bandwidth)
  bool backward = true;                  ///< also time the backward (training)
};

namespace detail {

/// Median of `rounds` timings (ms) of f(), after one untimed call; sync() runs before each
/// call (untimed) so that every rank's calls overlap. Every rank runs sync() as often, even
/// after f() threw (the first exception is kept in `failure`), so none is left waiting.
template <class Sync, class F>
double median_ms(int rounds, Sync&& sync, F&& f, std::string& failure) {
  std::vector<double> t;
  for (int i = 0; i <= std::max(1, rounds); ++i) {
    sync();
    if (!failure.empty()) continue;
    try {
      const auto a = std::chrono::steady_clock::now();
      f();
      if (i > 0) t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  if (t.empty()) return 0.0;
  std::nth_element(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(t.size() / 2), t.end());
  return t[t.size() / 2];
}

/// `lengths` scaled to sum to `total` (each at least 1 while they fit; the last takes the rest).
inline std::vector<std::int64_t> scale_lengths(const std::vector<std::int64_t>& lengths, std::int64_t total) {
  std::int64_t sum = 0;
  for (std::int64_t n : lengths) sum += n;
  std::vector<std::int64_t> out;
  std::int64_t placed = 0;
  for (std::size_t i = 0; i + 1 < lengths.size() && placed + 1 < total; ++i) {
    const std::int64_t n = std::clamp<std::int64_t>(sum > 0 ? lengths[i] * total / sum : 0, 1, total - placed - 1);
    out.push_back(n);
    placed += n;
  }
  out.push_back(total - placed);
  return out;
}

/// One rank's inputs, outputs and workspace for `tokens` local tokens of `problem`, and the
/// timing of an engine's forward and backward on them.
template <class T>
struct TimedAttention {
  using CV = TensorView<const T>;
  std::int64_t L, B, H, K, D, Dv;
  std::vector<T> q, k, v, dout, out, dq, dk, dv;
  std::vector<acc_t<T>> lse;
  std::vector<std::byte> ws;
  bool with_lse;

  TimedAttention(const AttentionProblem& p, const Plan& plan, std::int64_t tokens, unsigned seed)
      : L(tokens), B(p.batch), H(p.heads), K(p.kv_head_count()), D(p.head_dim), Dv(p.value_dim()),
        lse(static_cast<std::size_t>(B * L * H)),
        ws(std::max(plan.workspace_bytes(), p.with_lse ? plan.backward_workspace_bytes() : 0)), with_lse(p.with_lse) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    auto tensor = [&](std::int64_t n) {
      std::vector<T> x(static_cast<std::size_t>(n));
      for (T& e : x) e = T(u(rng));
      return x;
    };
    q = tensor(B * L * H * D), k = tensor(B * L * K * D), v = tensor(B * L * K * Dv), dout = tensor(B * L * H * Dv);
    out.resize(dout.size()), dq.resize(q.size()), dk.resize(k.size()), dv.resize(v.size());
  }
  TensorView<acc_t<T>> lse_view() { return TensorView<acc_t<T>>::lse_bhs(lse.data(), B, L, H); }
  template <class Engine>
  void forward(Engine& e, const Plan& plan) {
    e.forward(plan, CV::bshd(q.data(), B, L, H, D), CV::bshd(k.data(), B, L, K, D), CV::bshd(v.data(), B, L, K, Dv),
              TensorView<T>::bshd(out.data(), B, L, H, Dv), with_lse ? lse_view() : TensorView<acc_t<T>>{}, ws);
  }
  template <class Engine>
  void backward(Engine& e, const Plan& plan) {
    e.backward(plan, CV::bshd(dout.data(), B, L, H, Dv), CV::bshd(q.data(), B, L, H, D), CV::bshd(k.data(), B, L, K, D),
               CV::bshd(v.data(), B, L, K, Dv), CV::bshd(out.data(), B, L, H, Dv), TensorView<const acc_t<T>>(lse_view()),
               TensorView<T>::bshd(dq.data(), B, L, H, D), TensorView<T>::bshd(dk.data(), B, L, K, D),
               TensorView<T>::bshd(dv.data(), B, L, K, Dv), nullptr, ws);
  }
};

/// Median of the world's values (every rank passes its own; every rank gets the same).
template <class Comm>
double world_median(Comm& world, double mine) {
  std::vector<std::int64_t> all(static_cast<std::size_t>(world.size()));
  const std::int64_t bits = std::bit_cast<std::int64_t>(mine);
  world.all_gather_host(std::span<const std::int64_t>(&bits, 1), all);
  std::vector<double> v;
  for (std::int64_t b : all) v.push_back(std::bit_cast<double>(b));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

/// Gathers whether each rank failed (`mine`: this rank's reason, empty when it did not) and,
/// if any did, throws E on every rank: a rank that failed names itself and its reason
/// ("calibrate: rank r <what>: reason"), the others the first that failed. Collective: no rank
/// is left waiting in a later one.
template <class E, class Comm>
void throw_if_any_failed(Comm& world, const std::string& mine, const char* what) {
  std::vector<std::int64_t> failed(static_cast<std::size_t>(world.size()));
  const std::int64_t flag = mine.empty() ? 0 : 1;
  world.all_gather_host(std::span<const std::int64_t>(&flag, 1), failed);
  // A rank that failed itself gives its own reason; the others name the first that failed.
  if (!mine.empty()) throw E("calibrate: rank " + std::to_string(world.rank()) + " " + what + ": " + mine);
  for (int r = 0; r < world.size(); ++r)
    if (failed[static_cast<std::size_t>(r)] != 0) throw E("calibrate: rank " + std::to_string(r) + " " + what);
}

}  // namespace detail

/// Measures `base`'s rates on this machine (see the file comment) for element type T and
/// kernel `kernel`, and returns `base` with forward_gflops, backward_gflops,
/// copy_gbytes_per_s, the ring steps' fixed costs and the intra-node link replaced (the
/// inter-node link too when the world is one node). `problem`'s mask and features are timed as given: the rate is per
/// visible pair, masked blocks' overhead included. Throws (on every rank) when any rank's
/// measurement failed.
template <class T, class Kernel, class Comm>
Machine calibrate(Comm& world, Kernel kernel, AttentionProblem problem, Machine base, CalibrationOptions opt = {}) {
  // Options every measurement below needs (the latency probe sends 8 bytes from the exchange
  // buffers; no tokens, no rate), agreed first: a rank that refused alone would leave the
  // others waiting in the first collective.
  std::string bad_options;
  if (opt.tokens < 1) bad_options = "tokens: expected at least 1, got " + std::to_string(opt.tokens);
  else if (opt.exchange_bytes < 8)
    bad_options = "exchange_bytes: expected at least 8 (the latency probe's message), got " + std::to_string(opt.exchange_bytes);
  else if (problem.batch < 1 || problem.heads < 1 || problem.head_dim < 1)
    // Nothing to time: the kernel rates would come out 0 (or NaN), and every estimate with them.
    bad_options = "problem: calibrate times attention on it: expected batch, heads and head_dim >= 1, got " +
                  std::to_string(problem.batch) + ", " + std::to_string(problem.heads) + " and " +
                  std::to_string(problem.head_dim);
  detail::throw_if_any_failed<ConfigError>(world, bad_options, "refused its options");
  problem.dtype = dtype_v<T>;
  problem.with_lse = opt.backward;
  // Documents are scaled to the timed length, so the mask keeps its density and its cuts.
  for (std::vector<std::int64_t>& docs : problem.documents) docs = detail::scale_lengths(docs, opt.tokens);
  problem.kv_valid.clear();  // sized for the global keys, which calibrate does not know
  const int me = world.rank(), W = world.size();
  std::string failure;
  auto sync = [&] { world.barrier(); };

  // Every rank times a one-rank engine at once, as the ranks of a run compute at once.
  using Engine = SequenceParallelAttention<RingPolicy<Contiguous>, Comm, Kernel>;
  Comm solo = world.split(me, 0);
  Engine attn(solo, RingPolicy<Contiguous>{}, kernel);
  const Plan plan = attn.template plan<T>(problem, {opt.tokens, opt.tokens});
  detail::TimedAttention<T> local(problem, plan, opt.tokens, 7 + static_cast<unsigned>(me));
  const double flops = 2.0 * static_cast<double>(problem.head_dim + problem.value_dim()) * static_cast<double>(plan.work(0));
  const double fwd = detail::median_ms(opt.rounds, sync, [&] { local.forward(attn, plan); }, failure);
  const double bwd =
      !opt.backward ? 0.0 : detail::median_ms(opt.rounds, sync, [&] { local.backward(attn, plan); }, failure);
  std::vector<std::byte> a(opt.exchange_bytes, std::byte{1}), b(opt.exchange_bytes);
  const double copy = detail::median_ms(opt.rounds, sync, [&] { std::memcpy(b.data(), a.data(), a.size()); }, failure);

  // Every rank sends to the next and receives from the previous at once, as in a ring hop or
  // an all-to-all (ranks sharing cores share the copying too): a small message for the
  // latency, a large one for the bandwidth.
  double small = 0, large = 0;
  if (W > 1) {
    const int next = (me + 1) % W, prev = (me + W - 1) % W;
    auto shift = [&](std::size_t n) {
      auto req = world.start_exchange(a.data(), n, next, b.data(), n, prev);
      world.wait(req);
    };
    small = detail::median_ms(std::max(opt.rounds, 9), sync, [&] { shift(8); }, failure);
    large = detail::median_ms(opt.rounds, sync, [&] { shift(opt.exchange_bytes); }, failure);
  }

  // A failure anywhere reaches every rank here, after collectives every rank joined.
  auto agree = [&] { detail::throw_if_any_failed<std::runtime_error>(world, failure, "failed"); };
  agree();

  // A ring over the whole world on a few unmasked tokens a rank: what is left of a step is its
  // fixed cost (the ranks' handshake, a kernel call, the hop's latency), which small blocks
  // and ranks sharing cores make visible.
  double ring_fwd = 0, ring_bwd = 0;
  if (W > 1) {
    constexpr std::int64_t few = 16;
    AttentionProblem unmasked = problem;
    unmasked.causal = false;
    unmasked.window = {};
    unmasked.documents.clear();
    Engine ring(world, RingPolicy<Contiguous>{}, kernel);
    const Plan ring_plan = ring.template plan<T>(unmasked, {few, few});
    detail::TimedAttention<T> tiny(unmasked, ring_plan, few, 11 + static_cast<unsigned>(me));
    ring_fwd = detail::median_ms(opt.rounds, sync, [&] { tiny.forward(ring, ring_plan); }, failure) / W;
    if (opt.backward) ring_bwd = detail::median_ms(opt.rounds, sync, [&] { tiny.backward(ring, ring_plan); }, failure) / W;
    agree();
  }

  // The kernel rates measured with the node's ranks all busy are a core's share; the model
  // wants a whole core's (it shares the cores itself, step by step).
  const int rpn = std::clamp(base.ranks_per_node, 1, W);
  const double contention = base.cores_per_node > 0 ? std::max(1.0, static_cast<double>(rpn) / base.cores_per_node) : 1.0;
  Machine m = base;
  m.forward_gflops = contention * detail::world_median(world, flops / (fwd * 1e6));
  if (opt.backward) m.backward_gflops = contention * detail::world_median(world, 2.5 * flops / (bwd * 1e6));
  m.copy_gbytes_per_s = contention * detail::world_median(world, static_cast<double>(a.size()) / (copy * 1e6));
  if (W > 1) {
    const double lat = detail::world_median(world, small), big = detail::world_median(world, large);
    m.intra = {static_cast<double>(opt.exchange_bytes) / (std::max(big - lat, 1e-6) * 1e6), lat * 1e3};
    if (rpn >= W) m.inter = m.intra;
    // The model counts the hop's latency already.
    m.ring_step_us = std::max(0.0, detail::world_median(world, ring_fwd) * 1e3 - m.intra.latency_us);
    if (opt.backward) m.backward_ring_step_us = std::max(0.0, detail::world_median(world, ring_bwd) * 1e3 - m.intra.latency_us);
  }
  m.source = "measured here by seqpar::calibrate (all ranks at once, " + std::to_string(opt.tokens) + " tokens)";
  return m;
}

}  // namespace seqpar
