// Exact or refused, never silently wrong: integer edges of user input (huge window sides,
// lengths that sum past 2^63, cache positions outside the shard), refused calls that leave
// their object as it was, time-outs too large for the clock, a kernel's own limits in
// can_implement, NaN in a row that sees no key, and disagreement messages that name values.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "support/attention_check.hpp"
#include "support/rank_outcomes.hpp"

using namespace seqpar;
using test::GlobalShape;

namespace {

constexpr std::int64_t big = std::numeric_limits<std::int64_t>::max();

/// Runs fn on `ranks` threads with a time-out (a hang fails); checks may run on any rank.
template <class Fn>
void on_ranks(int ranks, Fn&& fn) {
  run_ranks(ranks, fn, ThreadRunOptions{std::chrono::milliseconds(20000)});
}

/// ReferenceKernel without supports_masks: a kernel that handles causal masks only.
struct CausalOnlyKernel {
  static constexpr bool is_seqpar_kernel = true;
  using memory_space = HostSpace;
  template <class T, class O>
  void forward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
               TensorView<acc_t<T>> lse, const KernelParams& p) {
    ReferenceKernel{}.forward(q, k, v, out, lse, p);
  }
};

/// A forward of `Policy` on `ranks` threads for shape `s`, against the exact reference of the
/// same shape with `equivalent` window (a window that means the same by definition); returns
/// the error and checks that plan.work matches the equivalent's on every rank.
template <class Policy, class Kernel>
double huge_window_error(int ranks, GlobalShape s, Window equivalent, Policy policy = {}) {
  GlobalShape same = s;
  same.window = equivalent;
  const test::GlobalData g = test::make_global(same);  // the reference, from the plain window
  test::GlobalData huge = g;
  huge.shape = s;  // the same inputs, run with the huge window
  test::RunOptions opt;
  opt.lengths_q = test::even_lengths(mesh_config(policy, ranks), s.seq_q);
  opt.lengths_kv = test::even_lengths(mesh_config(policy, ranks), s.kv_len());
  const test::RunResult got = test::run_policy<float, Policy, Kernel>(ranks, policy, huge, opt);
  const test::RunResult plain = test::run_policy<float, Policy, Kernel>(ranks, policy, g, opt);
  CHECK(got.work == plain.work);
  CHECK_FALSE(got.err.nan);
  CHECK(plain.err.within(1e-5));
  return got.err.within(1e-5) ? got.err.rel() : 1.0;
}

}  // namespace

TEST_CASE("exact or refused: a window side of any size means what it says; a huge one is unbounded") {
  using Stripe = AnythingPolicy<RingPolicy<seqpar::Stripe>>;
  GlobalShape s{.batch = 1, .seq_q = 48, .seq_kv = 40, .heads = 2, .head_dim = 16};
  s.causal_align = CausalAlign::bottom_right;
  for (const auto& [huge, plain] : {std::pair{Window{-1, big}, Window{-1, -1}}, std::pair{Window{big, 2}, Window{-1, 2}},
                                    std::pair{Window{big, big}, Window{-1, -1}},
                                    std::pair{Window{big - 1, 0}, Window{-1, 0}},
                                    std::pair{Window{3, big}, Window{3, -1}}}) {
    // A copy to capture: Clang before 16 cannot capture a structured binding in a lambda.
    const auto huge_left = huge.left;
    CAPTURE(huge_left);
    const auto huge_right = huge.right;
    CAPTURE(huge_right);
    s.window = huge;
    s.causal = false;
    CHECK(huge_window_error<Stripe, CpuFlashKernel>(4, s, plain) <= 1e-5);
    CHECK(huge_window_error<Stripe, ReferenceKernel>(4, s, plain) <= 1e-5);
    s.causal = true;
    using Unified = AnythingPolicy<UnifiedPolicy<Zigzag>>;
    CHECK(huge_window_error<Unified, CpuFlashKernel>(4, s, plain, Unified{{2, 2}}) <= 1e-5);
  }
  // Top-left, self-attention, the ring skipping nothing it must compute.
  GlobalShape t{.batch = 2, .seq_q = 96, .heads = 3, .head_dim = 8, .causal = true};
  t.window = {big, big};
  CHECK(huge_window_error<RingPolicy<Zigzag>, CpuFlashKernel>(3, t, Window{}) <= 1e-5);
}

TEST_CASE("exact or refused: documents or lengths whose sum passes 2^63 are refused by name") {
  auto out = test::rank_outcomes(2, [](ThreadCommunicator& comm) {
    SequenceParallelAttention<AnythingPolicy<RingPolicy<>>, ThreadCommunicator, ReferenceKernel> attn(comm);
    AttentionProblem p{.heads = 2, .head_dim = 8, .causal = true};
    p.documents = {{big, big, 18}};
    (void)attn.plan(p, {8});
  });
  INFO(test::describe(out));
  CHECK(test::all_same_config_error(out, "documents[0]: lengths up to documents[0][0] sum past the global sequence length 16"));
  const AttentionProblem p{.heads = 2, .head_dim = 8};
  const LocalLengths lengths[] = {{big, big}, {big, big}};
  const Implementable why = can_implement(AnythingPolicy<UlyssesPolicy>{}, p, lengths);
  CHECK_FALSE(why.ok);
  CHECK(why.reason.find("sum past 2^63") != std::string::npos);
}

TEST_CASE("exact or refused: a refused DecodePlan::advance leaves the plan as it was") {
  on_ranks(2, [](ThreadCommunicator& world) {
    SequenceParallelDecode<ThreadCommunicator, ReferenceKernel> dec(world);
    DecodePlan plan = dec.plan({.batch = 2, .heads = 2, .head_dim = 8, .kv_len = {10, 30}, .capacity = 40});
    CHECK_THROWS_AS(plan.advance(11), ConfigError);  // sequence 1 would hold 41
    CHECK(plan.kv_len(0) == 10);
    CHECK(plan.kv_len(1) == 30);
    CHECK(plan.steps() == 0);
    CHECK_THROWS_AS(plan.advance(big), ConfigError);
    CHECK_THROWS_AS(plan.advance(-1), ConfigError);
    CHECK(plan.kv_len(0) == 10);
    CHECK(plan.kv_len(1) == 30);
    plan.advance(9);
    CHECK(plan.kv_len(1) == 39);
    CHECK(plan.steps() == 1);
  });
}

TEST_CASE("exact or refused: owner and slot refuse positions and sequences outside the cache") {
  on_ranks(3, [](ThreadCommunicator& world) {
    SequenceParallelDecode<ThreadCommunicator, ReferenceKernel> dec(world);
    for (std::int64_t page : {0, 1, 4}) {
      const DecodePlan plan = dec.plan({.batch = 2, .heads = 2, .head_dim = 8, .kv_len = {10, 3}, .capacity = 40, .page = page});
      for (std::int64_t pos : {std::int64_t{-1}, std::int64_t{-5}, std::int64_t{40}, big, -big - 1}) {
        CAPTURE(pos);
        CHECK_THROWS_AS((void)plan.owner(0, pos), ConfigError);
        CHECK_THROWS_AS((void)plan.slot(1, pos), ConfigError);
      }
      CHECK_THROWS_AS((void)plan.owner(2, 0), ConfigError);
      CHECK_THROWS_AS((void)plan.slot(-1, 0), ConfigError);
      CHECK_THROWS_AS((void)plan.kv_len(2), ConfigError);
      // The layout the plan hands out refuses sequences outside the batch, negative positions
      // and ranks outside the world too (it read past its per-sequence table).
      const CacheLayout& layout = plan.layout();
      CHECK_THROWS_WITH_AS((void)layout.owner(5, 0), doctest::Contains("CacheLayout::owner: sequence: expected 0..1, got 5"), ConfigError);
      CHECK_THROWS_AS((void)layout.slot(-1, 0), ConfigError);
      CHECK_THROWS_WITH_AS((void)layout.slot(0, -3), doctest::Contains("CacheLayout::slot: pos: expected >= 0, got -3"), ConfigError);
      CHECK_THROWS_AS((void)layout.count(0, 2, 3), ConfigError);
      CHECK_THROWS_AS((void)layout.count(3, 0, 3), ConfigError);
      CHECK(layout.count(0, 1, 40) + layout.count(1, 1, 40) + layout.count(2, 1, 40) == 40);
      // Every legal position has an owner and a slot inside its shard.
      for (std::int64_t pos = 0; pos < 40; ++pos) {
        const int r = plan.owner(1, pos);
        CHECK((r >= 0 && r < 3));
        if (r == world.rank()) CHECK((plan.slot(1, pos) >= 0 && plan.slot(1, pos) < plan.shard_capacity()));
      }
    }
  });
}

TEST_CASE("exact or refused: decode plans refuse what attention refuses") {
  struct Bad {
    DecodeProblem problem;
    std::string reason;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<Bad> cases = {
      {{.heads = 2, .head_dim = 8, .scale = nan, .kv_len = {3}, .capacity = 8}, "decode plan: scale: expected a finite"},
      {{.heads = 2, .head_dim = 8, .scale = INFINITY, .kv_len = {3}, .capacity = 8}, "decode plan: scale: expected a finite"},
      {{.heads = 2, .head_dim = 8, .kv_len = {3}, .capacity = 8, .exchange = static_cast<DecodeExchange>(7)},
       "decode plan: exchange: expected DecodeExchange::all_gather or DecodeExchange::heads, got 7"},
      {{.heads = 2, .head_dim = 8, .dtype = static_cast<DType>(9), .kv_len = {3}, .capacity = 8},
       "decode plan: dtype: expected f16, bf16, f32 or f64, got 9"},
      {{.heads = 2, .head_dim = 8, .new_tokens = 2, .kv_len = {big - 1}, .capacity = big},
       "decode plan: size overflow"},
      {{.heads = 2, .head_dim = 8, .new_tokens = 2, .kv_len = {big - 1}, .capacity = 1000},
       "decode plan: kv_len[0]: expected 0..capacity - new_tokens = 998, got 9223372036854775806"},
      {{.heads = 2, .head_dim = 8, .new_tokens = 4, .kv_len = {0}, .capacity = 3},
       "decode plan: capacity: expected >= new_tokens 4, got 3"},
  };
  for (const Bad& c : cases) {
    CAPTURE(c.reason);
    auto out = test::rank_outcomes(2, [&](ThreadCommunicator& world) {
      SequenceParallelDecode<ThreadCommunicator, ReferenceKernel> dec(world);
      (void)dec.plan(c.problem);
    });
    INFO(test::describe(out));
    CHECK(test::all_same_config_error(out, c.reason));
  }
}

TEST_CASE("exact or refused: disagreement on a list names the first entry that differs and both values") {
  auto out = test::rank_outcomes(3, [](ThreadCommunicator& comm) {
    SequenceParallelAttention<AnythingPolicy<RingPolicy<>>, ThreadCommunicator, ReferenceKernel> attn(comm);
    AttentionProblem p{.batch = 2, .heads = 2, .head_dim = 8};
    p.kv_valid = {12, comm.rank() == 2 ? 7 : 9};
    (void)attn.plan(p, {4});
  });
  INFO(test::describe(out));
  CHECK(test::all_same_config_error(out, "plan: ranks disagree on kv_valid: rank 2 has kv_valid[1] = 7 (rank 0: 9)"));
  auto docs = test::rank_outcomes(3, [](ThreadCommunicator& comm) {
    SequenceParallelAttention<AnythingPolicy<RingPolicy<>>, ThreadCommunicator, ReferenceKernel> attn(comm);
    AttentionProblem p{.heads = 2, .head_dim = 8, .causal = true};
    p.documents = comm.rank() == 1 ? std::vector<std::vector<std::int64_t>>{{5, 7}}
                                   : std::vector<std::vector<std::int64_t>>{{5, 4, 3}};
    (void)attn.plan(p, {4});
  });
  INFO(test::describe(docs));
  CHECK(test::all_same_config_error(docs, "plan: ranks disagree on documents: rank 1 has documents[0][1] = 7 (rank 0: 4)"));
  auto dec = test::rank_outcomes(3, [](ThreadCommunicator& world) {
    SequenceParallelDecode<ThreadCommunicator, ReferenceKernel> d(world);
    (void)d.plan({.batch = 2, .heads = 2, .head_dim = 8,
                  .kv_len = world.rank() == 0 ? std::vector<std::int64_t>{3, 4} : std::vector<std::int64_t>{3, 4, 5},
                  .capacity = 16});
  });
  INFO(test::describe(dec));
  CHECK(test::all_same_config_error(dec, "decode plan: ranks disagree on kv_len: rank 1 has kv_len with 3 entries (rank 0: 2); rank 2 has kv_len with 3 entries (rank 0: 2)"));
}

TEST_CASE("exact or refused: the member can_implement knows the kernel's limits, as plan does") {
  on_ranks(2, [](ThreadCommunicator& comm) {
    SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, CausalOnlyKernel> attn(comm);
    AttentionProblem p{.heads = 2, .head_dim = 8, .causal = true};
    const LocalLengths lengths[] = {{8}, {8}};
    CHECK(attn.can_implement(p, lengths).ok);  // causal alone: any kernel
    p.window = {4, -1};
    const Implementable why = attn.can_implement(p, lengths);
    CHECK_FALSE(why.ok);
    std::string thrown;
    try {
      (void)attn.plan(p, {8});
    } catch (const ConfigError& e) {
      thrown = e.what();
    }
    CHECK(thrown.rfind(why.reason, 0) == 0);  // plan's message, plus where it was thrown
    CHECK(why.reason.find("supports_masks") != std::string::npos);
  });
}

TEST_CASE("exact or refused: a time-out too large for the clock means never, not at once") {
  for (auto t : {std::chrono::milliseconds::max(), std::chrono::milliseconds(big), std::chrono::milliseconds(9'300'000'000'000)}) {
    CAPTURE(t.count());
    run_ranks(
        3,
        [](ThreadCommunicator& comm) {
          comm.barrier();
          const std::int64_t mine[1] = {comm.rank()};
          std::vector<std::int64_t> all(3);
          comm.all_gather_host(mine, all);
          CHECK(all == std::vector<std::int64_t>{0, 1, 2});
        },
        ThreadRunOptions{t});
  }
  ::setenv(comm_timeout_env, "99999999999999999999999999", 1);  // past 64 bits
  CHECK(comm_timeout_from_env() == std::chrono::milliseconds::max());
  ::setenv(comm_timeout_env, "-5", 1);
  CHECK_THROWS_AS(comm_timeout_from_env(), ConfigError);
  ::unsetenv(comm_timeout_env);
  const auto now = std::chrono::steady_clock::now();
  CHECK(saturating_deadline<std::chrono::steady_clock>(now, std::chrono::milliseconds::max()) ==
        std::chrono::steady_clock::time_point::max());
  CHECK(saturating_deadline<std::chrono::steady_clock>(now, std::chrono::milliseconds(5)) ==
        now + std::chrono::milliseconds(5));
}
