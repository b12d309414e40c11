// Causal load balance: the score elements each rank computes, counted twice, independently:
// by the plan (plan.work) and by a kernel that counts the visible (query, key) pairs of every
// call it gets. Zigzag and Stripe keep every rank within 5% of the mean; Contiguous does not
// (so the check can fail), and its fully masked ring steps are skipped, not computed.
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "support/attention_check.hpp"

using namespace seqpar;

namespace {

/// CpuFlashKernel that also counts the visible pairs (times batch and heads) and the calls
/// it gets, by brute force over the positions of each call.
struct CountingKernel {
  static constexpr bool is_seqpar_kernel = true;
  using memory_space = HostSpace;
  CpuFlashKernel inner;
  std::int64_t pairs = 0, calls = 0;

  void prepare(std::int64_t max_head_dim) { inner.prepare(max_head_dim); }

  template <class T, class O>
  void forward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
               TensorView<acc_t<T>> lse, const KernelParams& p) {
    ++calls;
    std::int64_t visible = 0;
    for (std::int64_t i = 0; i < q.seq(); ++i)
      for (std::int64_t j = 0; j < k.seq(); ++j) visible += !p.causal || p.k_positions(j) <= p.q_positions(i);
    pairs += visible * q.batch() * q.heads();
    inner.forward(q, k, v, out, lse, p);
  }
};

struct Counted {
  std::vector<std::int64_t> plan_work, kernel_pairs, kernel_calls;
};

/// Runs the policy with the counting kernel (checking the answer too) and returns both counts.
template <class Policy>
Counted count_work(int ranks, Policy policy, const test::GlobalData& g, test::RunOptions opt = {}) {
  Counted out;
  out.kernel_pairs.resize(ranks);
  out.kernel_calls.resize(ranks);
  const auto r = test::run_policy<float, Policy, CountingKernel>(
      ranks, policy, g, opt, [&](int w, auto& attn, const Plan&) {
        out.kernel_pairs[w] = attn.kernel().pairs;
        out.kernel_calls[w] = attn.kernel().calls;
      });
  CHECK(r.err.within(1e-5));
  out.plan_work = r.work;
  CHECK(out.plan_work == out.kernel_pairs);
  return out;
}

/// Largest |work - mean| / mean over the ranks.
double imbalance(const std::vector<std::int64_t>& work) {
  const double mean = std::accumulate(work.begin(), work.end(), 0.0) / static_cast<double>(work.size());
  double worst = 0;
  for (auto w : work) worst = std::max(worst, std::abs(static_cast<double>(w) - mean) / mean);
  return worst;
}

/// A long causal sequence with tiny heads: the balance needs length, not width.
/// 3360 = 2^5 * 3 * 5 * 7 divides evenly (and into even local lengths) for P = 2..8.
test::GlobalShape long_causal(std::int64_t seq) {
  return test::make_case(seq, 2, 1, 2, true, 4242);
}

}  // namespace

TEST_CASE("balance: zigzag and stripe keep every rank's causal work within 5% of the mean") {
  const test::GlobalShape c = long_causal(3360);
  const auto g = test::make_global_as<float>(c);
  const std::int64_t total = 3360LL * 3361 / 2 * c.heads;  // every visible pair, all ranks together
  for (int P = 2; P <= 8; ++P) {
    CAPTURE(P);
    const auto zig = count_work(P, RingPolicy<Zigzag>{}, g);
    const auto str = count_work(P, RingPolicy<Stripe>{}, g);
    const auto con = count_work(P, RingPolicy<Contiguous>{}, g);
    CHECK(imbalance(zig.plan_work) <= 0.05);
    CHECK(imbalance(str.plan_work) <= 0.05);
    // Contiguous: the last rank sees (2P-1)/P of the mean, the first 1/P.
    CHECK(imbalance(con.plan_work) > 0.4);
    for (const auto* w : {&zig.plan_work, &str.plan_work, &con.plan_work})
      CHECK(std::accumulate(w->begin(), w->end(), std::int64_t{0}) == total);
    for (int r = 0; r < P; ++r) {
      CAPTURE(r);
      // Contiguous rank r: blocks of later ranks are entirely in the future and are skipped.
      CHECK(con.kernel_calls[r] == r + 1);
      // Zigzag and stripe: every step has visible keys.
      CHECK(zig.kernel_calls[r] == P);
      CHECK(str.kernel_calls[r] == P);
    }
  }
}

TEST_CASE("balance: USP (zigzag over the ring, split across the Ulysses group) is balanced too") {
  for (int P : {4, 6, 8})
    for (int U : {2, P / 2}) {
      if (P % U) continue;
      CAPTURE(P);
      CAPTURE(U);
      // One query head per Ulysses member, so every member has work.
      test::GlobalShape c = long_causal(1680);
      c.heads = U;
      c.kv_heads = 1;
      const auto g = test::make_global_as<float>(c);
      for (auto placement : {MeshPlacement::ulysses_adjacent, MeshPlacement::ring_adjacent}) {
        CHECK(imbalance(count_work(P, UnifiedPolicy<Zigzag>{U, P / U, placement}, g).plan_work) <= 0.05);
        CHECK(imbalance(count_work(P, UnifiedPolicy<Stripe>{U, P / U, placement}, g).plan_work) <= 0.05);
        CHECK(imbalance(count_work(P, UnifiedPolicy<Contiguous>{U, P / U, placement}, g).plan_work) > 0.2);
      }
      if (P == 4) break;  // U = 2 = P / 2: once is enough
    }
}

TEST_CASE("balance: uneven lengths (AnythingPolicy, seq 4099) stay balanced with zigzag and stripe") {
  const test::GlobalShape c = long_causal(4099);
  const auto g = test::make_global_as<float>(c);
  for (int P = 2; P <= 8; ++P) {
    CAPTURE(P);
    CHECK(imbalance(count_work(P, AnythingPolicy<RingPolicy<Zigzag>>{}, g).plan_work) <= 0.05);
    CHECK(imbalance(count_work(P, AnythingPolicy<RingPolicy<Stripe>>{}, g).plan_work) <= 0.05);
    CHECK(imbalance(count_work(P, AnythingPolicy<RingPolicy<Contiguous>>{}, g).plan_work) > 0.4);
  }
}

TEST_CASE("balance: without a mask every rank does the same work and no step is skipped") {
  test::GlobalShape c = long_causal(480);
  c.causal = false;
  const auto g = test::make_global_as<float>(c);
  for (int P : {3, 5, 8}) {
    const auto con = count_work(P, RingPolicy<Contiguous>{}, g);
    CHECK(imbalance(con.plan_work) == 0.0);
    for (int r = 0; r < P; ++r) CHECK(con.kernel_calls[r] == P);
  }
}
