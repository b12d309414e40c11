// Misuse of the public API that must not hang, wrap or crash: a plan from another object,
// sizes that overflow, a head_dim no kernel can allocate for, two threads calling one object
// at once, a ring's output over its input: each must be a ConfigError naming the cause. And
// uses that must simply work: ranks with different kernels, no LSE view on a rank without rows.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <latch>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "seqpar/seqpar.hpp"
#include "support/rank_outcomes.hpp"

using namespace seqpar;
using test::all_same_config_error;
using test::rank_outcomes;

TEST_CASE("misuse: a plan made by another object is refused, even with the same degrees") {
  // Unified 2 x 2 with the Ulysses groups adjacent, and with the rings adjacent: same degrees,
  // different rank placement. Accepting A's plan in B deadlocked in the all-to-all.
  auto out = rank_outcomes(4, [](ThreadCommunicator& c) {
    using P = UnifiedPolicy<>;
    SequenceParallelAttention<P, ThreadCommunicator, ReferenceKernel> a(c, P{2, 2, MeshPlacement::ulysses_adjacent});
    SequenceParallelAttention<P, ThreadCommunicator, ReferenceKernel> b(c, P{2, 2, MeshPlacement::ring_adjacent});
    const Plan plan = a.plan({.heads = 4, .head_dim = 8}, {4});
    std::vector<float> x(4 * 4 * 8), o(x.size());
    std::vector<std::byte> ws(plan.workspace_bytes());
    using CV = TensorView<const float>;
    const CV in = CV::bshd(x.data(), 1, 4, 4, 8);
    b.forward<float>(plan, in, in, in, TensorView<float>::bshd(o.data(), 1, 4, 4, 8), ws);
  });
  CHECK(all_same_config_error(out, "forward: the plan was made by another SequenceParallelAttention"));

  auto empty = rank_outcomes(2, [](ThreadCommunicator& c) {
    SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, ReferenceKernel> a(c);
    std::vector<std::byte> ws(256);
    a.forward<float>(Plan{}, {}, {}, {}, {}, ws);
  });
  CHECK(all_same_config_error(empty, "forward: the plan is empty (default-made or moved from: make it with plan())"));

  // A moved-from plan: its tables went with the move, so it must be refused as empty, not read
  // (it kept its owner and crashed reading its layout).
  auto moved = rank_outcomes(2, [](ThreadCommunicator& c) {
    SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, ReferenceKernel> a(c);
    Plan plan = a.plan({.heads = 2, .head_dim = 8}, {4});
    const Plan taken = std::move(plan);
    CHECK(taken.local_q() == 4);
    std::vector<float> x(4 * 2 * 8), o(x.size());
    std::vector<std::byte> ws(taken.workspace_bytes());
    using CV = TensorView<const float>;
    const CV in = CV::bshd(x.data(), 1, 4, 2, 8);
    a.forward<float>(plan, in, in, in, TensorView<float>::bshd(o.data(), 1, 4, 2, 8), ws);  // NOLINT(bugprone-use-after-move)
  });
  CHECK(all_same_config_error(moved, "forward: the plan is empty (default-made or moved from: make it with plan())"));
  auto moved_decode = rank_outcomes(2, [](ThreadCommunicator& c) {
    SequenceParallelDecode<ThreadCommunicator, ReferenceKernel> dec(c);
    DecodePlan plan = dec.plan({.heads = 2, .head_dim = 8, .kv_len = {5}, .capacity = 16});
    const DecodePlan taken = std::move(plan);
    CHECK_THROWS_WITH_AS(plan.advance(1),  // NOLINT(bugprone-use-after-move)
                         doctest::Contains("DecodePlan::advance: the plan is empty (default-made or moved from"),
                         ConfigError);
    CHECK(plan.steps() == 0);
    std::vector<std::byte> ws(taken.workspace_bytes());
    dec.step<float>(plan, {}, {}, {}, {}, ws);  // NOLINT(bugprone-use-after-move)
  });
  CHECK(all_same_config_error(moved_decode, "decode step: the plan is empty (default-made or moved from"));
}

TEST_CASE("misuse: a soft-cap of -0.0 on one rank and 0.0 on another agree: both mean off") {
  auto out = rank_outcomes(2, [](ThreadCommunicator& c) {
    SequenceParallelAttention<UlyssesPolicy, ThreadCommunicator, ReferenceKernel> a(c);
    const Plan plan = a.plan({.heads = 2, .head_dim = 8, .softcap = c.rank() == 0 ? -0.0 : 0.0}, {4});
    CHECK(plan.global_q() == 8);
  });
  for (const auto& o : out) CHECK(o.kind == "none");
}

TEST_CASE("misuse: sizes that overflow 64 bits are a ConfigError naming the fields") {
  auto out = rank_outcomes(4, [](ThreadCommunicator& c) {
    SequenceParallelAttention<AnythingPolicy<RingPolicy<>>, ThreadCommunicator, ReferenceKernel> a(c);
    (void)a.plan({.batch = std::int64_t{1} << 24, .heads = 128, .head_dim = 128}, {std::int64_t{1} << 30});
  });
  CHECK(all_same_config_error(out, "plan: size overflow: batch 16777216 x global length 4294967296 x heads 128 x "
                                   "head_dim 128 x 8 bytes exceeds the 2^58-byte limit"));
  // A sum of lengths that wraps.
  auto sum = rank_outcomes(2, [](ThreadCommunicator& c) {
    SequenceParallelAttention<AnythingPolicy<RingPolicy<>>, ThreadCommunicator, ReferenceKernel> a(c);
    (void)a.plan({.heads = 1, .head_dim = 1}, {std::numeric_limits<std::int64_t>::max() - 1});
  });
  CHECK(all_same_config_error(sum, "plan: size overflow"));
  // Tensors that fit whose score count does not: 2^32 tokens of one head of width 1 (16 GiB
  // per tensor) have 2^64 query-key pairs, which Plan::work and the cost model count in int64.
  auto scores = rank_outcomes(1, [](ThreadCommunicator& c) {
    SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, ReferenceKernel> a(c);
    (void)a.plan({.heads = 1, .head_dim = 1}, {std::int64_t{1} << 32});
  });
  CHECK(all_same_config_error(scores, "plan: size overflow: batch 1 x heads 1 x query length 4294967296 x key length "
                                      "4294967296 (the number of scores) exceeds 2^62"));
  // The largest score count a plan takes, 2^62, is counted exactly.
  run_ranks(1, [](ThreadCommunicator& c) {
    SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, ReferenceKernel> a(c);
    const Plan plan = a.plan({.heads = 4, .head_dim = 1}, {std::int64_t{1} << 30});
    CHECK(plan.work(0) == std::int64_t{1} << 62);
  });
}

TEST_CASE("misuse: a head_dim the kernel cannot allocate for is a ConfigError, not std::bad_alloc") {
  auto out = rank_outcomes(2, [](ThreadCommunicator& c) {
    SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, CpuFlashKernel> a(c);
    (void)a.plan({.heads = 1, .head_dim = std::int64_t{1} << 40}, {2});
  });
  CHECK(all_same_config_error(out, "plan: the kernel could not allocate its scratch on rank(s) 0, 1 (std::bad_alloc"));
}

TEST_CASE("misuse: when only some ranks cannot allocate their scratch, every rank refuses the plan alike") {
  // One query head over a Ulysses group of two: rank 0 computes it for a batch of 2^50 and
  // cannot have the scratch of its threaded backward; rank 1 computes no head and needs none. Both
  // must refuse, or rank 1 would wait for rank 0 in its first call.
  auto out = rank_outcomes(2, [](ThreadCommunicator& c) {
    SequenceParallelAttention<AnythingPolicy<UlyssesPolicy>, ThreadCommunicator, CpuFlashKernel> a(c, {}, CpuFlashKernel(2));
    (void)a.plan({.batch = std::int64_t{1} << 50, .heads = 1, .head_dim = 8, .with_lse = true}, {1});
  });
  INFO(describe(out));
  CHECK(all_same_config_error(out, "plan: the kernel could not allocate its scratch on rank(s) 0"));
}

namespace {
/// ReferenceKernel that, on its first forward, says it started and waits to be released: a
/// call in progress for as long as the test needs.
struct HeldKernel : ReferenceKernel {
  std::latch* started = nullptr;
  std::atomic<bool>* release = nullptr;
  template <class... Args>
  void forward(Args&&... args) {
    if (started) {
      started->count_down();
      while (!release->load()) std::this_thread::yield();
      started = nullptr;
    }
    ReferenceKernel::forward(std::forward<Args>(args)...);
  }
};
}  // namespace

TEST_CASE("misuse: two threads calling one object at once get a ConfigError, not a crash") {
  std::latch started(1);
  std::atomic<bool> release{false};
  std::string second_error;
  run_ranks(1, [&](ThreadCommunicator& c) {
    HeldKernel k;
    k.started = &started;
    k.release = &release;
    SequenceParallelAttention<UlyssesPolicy, ThreadCommunicator, HeldKernel> a(c, {}, k);
    const Plan plan = a.plan({.heads = 2, .head_dim = 4}, {3});
    std::vector<float> x(3 * 2 * 4, 0.5f), o1(x.size()), o2(x.size());
    std::vector<std::byte> ws(plan.workspace_bytes());
    using CV = TensorView<const float>;
    const CV in = CV::bshd(x.data(), 1, 3, 2, 4);
    std::thread first([&] { a.forward<float>(plan, in, in, in, TensorView<float>::bshd(o1.data(), 1, 3, 2, 4), ws); });
    started.wait();  // the first call is inside the kernel now
    try {
      a.forward<float>(plan, in, in, in, TensorView<float>::bshd(o2.data(), 1, 3, 2, 4), ws);
    } catch (const ConfigError& e) {
      second_error = e.what();
    }
    release = true;
    first.join();
    CHECK(o1[0] == doctest::Approx(0.5));  // the first call finished normally
  });
  CHECK(second_error.find("forward: called while another call on this SequenceParallelAttention runs in another "
                          "thread") == 0);
}

// A mask places rows by their positions; a default PositionMap holds none, with which every
// row would see no key and the output would be zeros. Every host kernel refuses such a call,
// forward and backward, and runs it once every row has a position.
TEST_CASE("misuse: a kernel given a mask but not the rows' positions refuses instead of returning zeros") {
  constexpr std::int64_t S = 40, H = 2, D = 16;
  std::vector<float> x(S * H * D, 0.5f), out(S * H * D), lse(S * H), dq(S * H * D), dk(S * H * D), dv(S * H * D);
  const auto in = TensorView<const float>::bshd(x.data(), 1, S, H, D);
  const auto grad = [&](std::vector<float>& g) { return TensorView<float>::bshd(g.data(), 1, S, H, D); };
  const auto lse_view = TensorView<float>::bshd(lse.data(), 1, S, H, 1);
  auto run = [&](auto& kernel, const KernelParams& p) {
    kernel.template forward<float, float>(in, in, in, grad(out), lse_view, p);
    kernel.template backward<float>(in, in, in, in, TensorView<const float>(grad(out)), TensorView<const float>(lse_view),
                                    grad(dq), grad(dk), grad(dv), p);
  };
  KernelParams causal;
  causal.causal = true;
  KernelParams window;
  window.mask.window_left = 8;
  CpuFlashKernel fast;
  ReferenceKernel exact;
  for (const KernelParams* p : {&causal, &window}) {
    CHECK_THROWS_WITH_AS(run(fast, *p), doctest::Contains("CpuFlashKernel::forward: a mask is on"), ConfigError);
    CHECK_THROWS_WITH_AS(run(exact, *p), doctest::Contains("ReferenceKernel::forward: a mask is on"), ConfigError);
    KernelParams placed = *p;
    placed.q_positions = PositionMap::run(S, 0);
    CHECK_THROWS_WITH_AS(run(fast, placed), doctest::Contains("expected at least 40 and 40, got 40 and 0"), ConfigError);
    placed.k_positions = PositionMap::run(S, 0);
    CHECK_NOTHROW(run(fast, placed));
    CHECK(out[(S - 1) * H * D] == doctest::Approx(0.5f));  // V is 0.5 everywhere: every row sees a key
    CHECK_NOTHROW(run(exact, placed));
  }
  // Without a mask the positions are not read: none needed.
  CHECK_NOTHROW(run(fast, KernelParams{}));
}

namespace {
/// Tokens a rank holds in the small runs below, and their shape: 2 heads of dim 8.
constexpr std::int64_t kHeads = 2, kDim = 8;

/// `n` values in (-1, 1), never 0, from `seed`.
std::vector<float> values(std::size_t n, unsigned seed) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(((i * 37 + seed * 101) % 199) + 1) / 200.0f - 0.5f;
  return v;
}
}  // namespace

TEST_CASE("misuse: a ring forward refuses out or lse over q, which it reads again at every step; Ulysses computes in place") {
  constexpr std::int64_t L = 5;
  using CV = TensorView<const float>;
  auto ring = rank_outcomes(2, [](ThreadCommunicator& c) {
    SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, CpuFlashKernel> a(c);
    const Plan plan = a.plan<float>({.heads = kHeads, .head_dim = kDim}, {L});
    std::vector<float> q = values(L * kHeads * kDim, 1 + c.rank()), kv = values(q.size(), 3 + c.rank());
    std::vector<std::byte> ws(plan.workspace_bytes());
    const auto qv = TensorView<float>::bshd(q.data(), 1, L, kHeads, kDim);
    a.forward<float>(plan, qv, CV::bshd(kv.data(), 1, L, kHeads, kDim), CV::bshd(kv.data(), 1, L, kHeads, kDim), qv, ws);
  });
  INFO(describe(ring));
  CHECK(all_same_config_error(ring, "forward: out or lse overlaps q"));

  // Ulysses gathers Q into its workspace before it writes the output: out over q is exact.
  auto ulysses = rank_outcomes(2, [](ThreadCommunicator& c) {
    SequenceParallelAttention<UlyssesPolicy, ThreadCommunicator, CpuFlashKernel> a(c);
    const Plan plan = a.plan<float>({.heads = kHeads, .head_dim = kDim}, {L});
    std::vector<float> q = values(L * kHeads * kDim, 1 + c.rank()), kv = values(q.size(), 3 + c.rank()), apart(q.size());
    std::vector<std::byte> ws(plan.workspace_bytes());
    const auto qv = TensorView<float>::bshd(q.data(), 1, L, kHeads, kDim);
    const CV kvv = CV::bshd(kv.data(), 1, L, kHeads, kDim);
    a.forward<float>(plan, qv, kvv, kvv, TensorView<float>::bshd(apart.data(), 1, L, kHeads, kDim), ws);
    a.forward<float>(plan, qv, kvv, kvv, qv, ws);
    SEQPAR_CHECK(q == apart, ConfigError, "in place differs from apart");
  });
  INFO(describe(ulysses));
  for (const auto& o : ulysses) CHECK(o.kind == "none");
}

TEST_CASE("misuse: ranks with different kernel types plan and compute together") {
  // A plan's scratch agreement is a gather every rank joins, whatever its kernel: a rank whose
  // kernel has no scratch skipped it once, and both ranks then waited in each other's gathers.
  auto out = rank_outcomes(2, [](ThreadCommunicator& c) {
    auto run = [&](auto kernel) {
      constexpr std::int64_t L = 5;
      SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, decltype(kernel)> a(c, {}, kernel);
      const Plan plan = a.template plan<float>({.heads = kHeads, .head_dim = kDim}, {L});
      std::vector<float> x = values(L * kHeads * kDim, 5 + c.rank()), o(x.size());
      std::vector<std::byte> ws(plan.workspace_bytes());
      const auto in = TensorView<const float>::bshd(x.data(), 1, L, kHeads, kDim);
      a.template forward<float>(plan, in, in, in, TensorView<float>::bshd(o.data(), 1, L, kHeads, kDim), ws);
    };
    if (c.rank() == 0)
      run(ReferenceKernel{});
    else
      run(CpuFlashKernel{});
  });
  INFO(describe(out));
  for (const auto& o : out) CHECK(o.kind == "none");
}

TEST_CASE("misuse: a rank holding no query rows may give no LSE view, forward and backward") {
  auto out = rank_outcomes(2, [](ThreadCommunicator& c) {
    SequenceParallelAttention<AnythingPolicy<RingPolicy<>>, ThreadCommunicator, CpuFlashKernel> a(c);
    const std::int64_t L = c.rank() == 0 ? 0 : 5, n = L * kHeads * kDim;
    const Plan plan = a.plan<float>({.heads = kHeads, .head_dim = kDim, .causal = true, .with_lse = true}, {L});
    std::vector<float> x = values(static_cast<std::size_t>(n) + 1, 7), o(x.size()), l(static_cast<std::size_t>(L * kHeads) + 1);
    std::vector<float> dq(x.size()), dk(x.size()), dv(x.size());
    std::vector<std::byte> ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
    using CV = TensorView<const float>;
    const CV in = CV::bshd(x.data(), 1, L, kHeads, kDim);
    const auto lse = L == 0 ? TensorView<float>{} : TensorView<float>::bshd(l.data(), 1, L, kHeads, 1);
    auto grad = [&](std::vector<float>& g) { return TensorView<float>::bshd(g.data(), 1, L, kHeads, kDim); };
    a.forward<float>(plan, in, in, in, grad(o), lse, ws);
    a.backward<float>(plan, in, in, in, in, CV(grad(o)), TensorView<const float>(lse), grad(dq), grad(dk), grad(dv), ws);
  });
  INFO(describe(out));
  for (const auto& o : out) CHECK(o.kind == "none");
}

TEST_CASE("misuse: a SEQPAR_CPU_ISA that names no level is refused, not ignored") {
  // The level is read once a process: ctest's test_misuse_misspelt_cpu_isa runs this case
  // alone with SEQPAR_CPU_ISA=AVX2 (the names are lower case); without it there is nothing to check.
  const char* env = std::getenv("SEQPAR_CPU_ISA");
  if (env == nullptr || std::string_view(env) != "AVX2") return;
  CHECK_THROWS_WITH_AS(CpuFlashKernel{}, doctest::Contains("SEQPAR_CPU_ISA: expected amx_bf16, avx512_bf16"), ConfigError);
  CHECK_THROWS_AS(CpuFlashKernel{}, ConfigError);  // every time, not only the first
}
