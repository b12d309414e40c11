// Masks beyond causal: bottom-right causal, sliding windows, packed documents and key
// padding, alone and combined, under every policy and layout, against a brute-force reference
// written from the definitions (not from MaskView), forward and backward; plan.work counts
// visible pairs; masks change no byte on the wire; ring steps no query sees are skipped; bad
// descriptions fail alike on every rank.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "seqpar/seqpar.hpp"
#include "support/backward_check.hpp"
#include "support/mask_brute.hpp"
#include "support/rank_outcomes.hpp"

using namespace seqpar;

namespace {

constexpr std::int64_t H = 4, K = 2, D = 8;

using test::visible_by_definition;

/// Global tensors of one case: Q [B, Sq, H, D], K/V [B, Skv, K, D], dO like Q.
struct Global {
  std::int64_t B, sq, skv;
  std::vector<double> q, k, v, dout;
  Global(std::int64_t b, std::int64_t s_q, std::int64_t s_kv, unsigned seed) : B(b), sq(s_q), skv(s_kv) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> n(0, 1);
    auto fill = [&](std::vector<double>& x, std::int64_t rows, std::int64_t heads) {
      x.resize(static_cast<std::size_t>(B * rows * heads * D));
      for (double& e : x) e = static_cast<float>(n(rng));  // float-representable
    };
    fill(q, sq, H), fill(k, skv, K), fill(v, skv, K), fill(dout, sq, H);
  }
};

/// The brute force of `pr` on g's tensors (test::brute_force_forward, brute_force_grads).
test::BruteProblem brute(const AttentionProblem& pr, const Global& g) { return {pr, g.sq, g.skv, g.q, g.k, g.v}; }

/// What one distributed run returns, gathered into global order (the LSE [B, Sq, H]).
struct Result {
  std::vector<double> o, l, dq, dk, dv;
  std::vector<std::int64_t> work;  // plan.work(w) per rank
  std::uint64_t bytes = 0;         // bytes rank 0 sent in forward + backward
};

/// Runs forward and backward of `pr` under `policy` on lengths.size() thread ranks (query and
/// key lengths per rank) with `Kernel`, and gathers everything.
template <class Policy, class Kernel = ReferenceKernel>
Result run(Policy policy, const AttentionProblem& pr, const Global& g, const std::vector<std::int64_t>& lq,
           const std::vector<std::int64_t>& lk) {
  const int P = static_cast<int>(lq.size());
  Result res;
  res.o.assign(g.q.size(), 0), res.dq.assign(g.q.size(), 0), res.dk.assign(g.k.size(), 0), res.dv.assign(g.v.size(), 0);
  res.l.assign(static_cast<std::size_t>(g.B * g.sq * H), 0);
  res.work.assign(static_cast<std::size_t>(P), 0);
  using CV = TensorView<const double>;
  using V = TensorView<double>;
  const std::int64_t B = g.B;
  run_ranks(P, [&](ThreadCommunicator& world) {
    const int me = world.rank();
    SequenceParallelAttention<Policy, ThreadCommunicator, Kernel> attn(world, policy);
    const Plan plan = attn.template plan<double>(pr, {lq[static_cast<std::size_t>(me)], lk[static_cast<std::size_t>(me)]});
    const PositionMap qp = plan.q_positions(me), kp = plan.kv_positions(me);
    const std::int64_t nq = qp.size(), nk = kp.size();
    auto take = [&](const std::vector<double>& x, std::int64_t rows, std::int64_t heads, const PositionMap& at) {
      std::vector<double> local(static_cast<std::size_t>(B * at.size() * heads * D));
      scatter_sequence(CV::bshd(x.data(), B, rows, heads, D), at, V::bshd(local.data(), B, at.size(), heads, D));
      return local;
    };
    const auto q = take(g.q, g.sq, H, qp), k = take(g.k, g.skv, K, kp), v = take(g.v, g.skv, K, kp),
               dout = take(g.dout, g.sq, H, qp);
    std::vector<double> o(q.size()), l(static_cast<std::size_t>(B * nq * H)), dq(q.size()), dk(k.size()), dv(v.size());
    std::vector<std::byte> ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
    world.stats().reset();
    attn.template forward<double>(plan, CV::bshd(q.data(), B, nq, H, D), CV::bshd(k.data(), B, nk, K, D),
                                  CV::bshd(v.data(), B, nk, K, D), V::bshd(o.data(), B, nq, H, D),
                                  V::lse_bhs(l.data(), B, nq, H), ws);
    attn.template backward<double>(plan, CV::bshd(dout.data(), B, nq, H, D), CV::bshd(q.data(), B, nq, H, D),
                                   CV::bshd(k.data(), B, nk, K, D), CV::bshd(v.data(), B, nk, K, D),
                                   CV::bshd(o.data(), B, nq, H, D), CV::lse_bhs(l.data(), B, nq, H),
                                   V::bshd(dq.data(), B, nq, H, D), V::bshd(dk.data(), B, nk, K, D),
                                   V::bshd(dv.data(), B, nk, K, D), ws);
    if (me == 0) res.bytes = world.stats().bytes_sent;
    res.work[static_cast<std::size_t>(me)] = plan.work(me);
    // Ranks own disjoint rows: each writes its own into the global result.
    gather_sequence(CV::bshd(o.data(), B, nq, H, D), qp, V::bshd(res.o.data(), B, g.sq, H, D));
    gather_sequence(CV::lse_bhs(l.data(), B, nq, H), qp, V::bshd(res.l.data(), B, g.sq, H, 1));
    gather_sequence(CV::bshd(dq.data(), B, nq, H, D), qp, V::bshd(res.dq.data(), B, g.sq, H, D));
    gather_sequence(CV::bshd(dk.data(), B, nk, K, D), kp, V::bshd(res.dk.data(), B, g.skv, K, D));
    gather_sequence(CV::bshd(dv.data(), B, nk, K, D), kp, V::bshd(res.dv.data(), B, g.skv, K, D));
  });
  return res;
}

/// Max |a - b| / max |b| (0 when both are all zeros); -inf entries must match exactly.
double rel(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(b[i]) || std::isinf(a[i])) {
      if (a[i] != b[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return den > 0 ? num / den : num;
}

/// Visible pairs of the whole problem times heads, brute force: what sum(plan.work) must be.
std::int64_t brute_work(const AttentionProblem& pr, const Global& g) {
  std::int64_t n = 0;
  for (std::int64_t b = 0; b < g.B; ++b)
    for (std::int64_t i = 0; i < g.sq; ++i)
      for (std::int64_t j = 0; j < g.skv; ++j) n += visible_by_definition(pr, g.sq, g.skv, b, i, j);
  return n * H;
}

/// One mask case checked under one policy: forward and backward against the brute force from
/// the definitions, in double to the library's 1e-12; work, and bytes equal to the run
/// without the mask.
template <class Policy, class Kernel = ReferenceKernel>
void check(const char* name, Policy policy, const AttentionProblem& pr, const Global& g, const std::vector<std::int64_t>& lq,
           const std::vector<std::int64_t>& lk) {
  CAPTURE(name);
  constexpr double tol = test::tolerance<double>;
  const test::GlobalOutput want = test::brute_force_forward(brute(pr, g));
  const Result got = run<Policy, Kernel>(policy, pr, g, lq, lk);
  CHECK(rel(got.o, want.out) <= tol);
  CHECK(rel(got.l, want.lse) <= tol);
  const test::ReferenceGrads grads = test::brute_force_grads(brute(pr, g), g.dout);
  CHECK(rel(got.dq, grads.dq) <= tol);
  CHECK(rel(got.dk, grads.dk) <= tol);
  CHECK(rel(got.dv, grads.dv) <= tol);
  CHECK(std::accumulate(got.work.begin(), got.work.end(), std::int64_t{0}) == brute_work(pr, g));
  AttentionProblem plain = pr;
  plain.causal = false, plain.window = {}, plain.documents.clear(), plain.kv_valid.clear();
  CHECK(run<Policy, Kernel>(policy, plain, g, lq, lk).bytes == got.bytes);  // a mask is metadata: no byte changes
}

/// The mask families, alone and combined, for a self-attention problem of length S and B = 2.
std::vector<std::pair<std::string, AttentionProblem>> families(std::int64_t S) {
  AttentionProblem base{.batch = 2, .heads = H, .kv_heads = K, .head_dim = D, .dtype = DType::f64, .with_lse = true};
  std::vector<std::pair<std::string, AttentionProblem>> out;
  auto add = [&](std::string n, auto edit) {
    AttentionProblem p = base;
    edit(p);
    out.emplace_back(std::move(n), p);
  };
  add("window 5,3", [](AttentionProblem& p) { p.window = {5, 3}; });
  add("causal window 7", [](AttentionProblem& p) { p.causal = true, p.window = {7, -1}; });
  add("window wider than the sequence", [&](AttentionProblem& p) { p.window = {3 * S, 2 * S}; });
  add("documents causal", [&](AttentionProblem& p) { p.causal = true, p.documents = {{S / 3, 2, S - S / 3 - 2}}; });
  add("documents per batch", [&](AttentionProblem& p) { p.documents = {{S}, {1, S - 4, 3}}; });
  add("documents + causal + window", [&](AttentionProblem& p) {
    p.causal = true, p.window = {4, 0}, p.documents = {{5, S - 11, 6}};
  });
  add("key padding (one element fully padded)", [&](AttentionProblem& p) { p.kv_valid = {S - 5, 0}; });
  add("key padding + causal", [&](AttentionProblem& p) { p.causal = true, p.kv_valid = {S / 2, S}; });
  return out;
}

}  // namespace

TEST_CASE("masks: every family under every policy and layout, forward and backward, against brute force") {
  const std::int64_t S = 40;
  const Global g(2, S, S, 1701);
  const std::vector<std::int64_t> even4(4, S / 4), uneven4{13, 0, 20, 7}, uneven3{9, 17, 14};
  for (const auto& [name, pr] : families(S)) {
    // A copy to capture: Clang before 16 cannot capture a structured binding in a lambda.
    const auto name_c = name;
    CAPTURE(name_c);
    check("Ulysses 4", UlyssesPolicy{}, pr, g, even4, even4);
    check("Ring<Contiguous> 4", RingPolicy<Contiguous>{}, pr, g, even4, even4);
    check("Ring<Zigzag> 4", RingPolicy<Zigzag>{}, pr, g, even4, even4);
    check("Ring<Stripe> 4", RingPolicy<Stripe>{}, pr, g, even4, even4);
    check("Unified<Zigzag> 2x2", UnifiedPolicy<Zigzag>{2, 2}, pr, g, even4, even4);
    check("Anything<Unified<Contiguous>> 2x2 uneven", AnythingPolicy<UnifiedPolicy<>>{{2, 2}}, pr, g, uneven4, uneven4);
    check("Anything<Ring<Zigzag>> 3 uneven", AnythingPolicy<RingPolicy<Zigzag>>{}, pr, g, uneven3, uneven3);
    check("Anything<Ulysses> 3 uneven", AnythingPolicy<UlyssesPolicy>{}, pr, g, uneven3, uneven3);
  }
}

TEST_CASE("masks: CpuFlashKernel under every family, on the policies that reach it in different ways") {
  const std::int64_t S = 40;
  const Global g(2, S, S, 1702);
  const std::vector<std::int64_t> even4(4, S / 4), uneven3{9, 17, 14};
  for (const auto& [name, pr] : families(S)) {
    const auto name_c = name;
    CAPTURE(name_c);
    check<UlyssesPolicy, CpuFlashKernel>("Ulysses 4", UlyssesPolicy{}, pr, g, even4, even4);
    check<RingPolicy<Zigzag>, CpuFlashKernel>("Ring<Zigzag> 4", RingPolicy<Zigzag>{}, pr, g, even4, even4);
    check<UnifiedPolicy<Stripe>, CpuFlashKernel>("Unified<Stripe> 2x2", UnifiedPolicy<Stripe>{2, 2}, pr, g, even4, even4);
    check<AnythingPolicy<RingPolicy<Contiguous>>, CpuFlashKernel>("Anything<Ring> 3 uneven",
                                                                 AnythingPolicy<RingPolicy<>>{}, pr, g, uneven3, uneven3);
  }
}

TEST_CASE("masks: causal alignment top-left and bottom-right with S_q != S_kv (joint / cross attention)") {
  for (const auto& [sq, skv] : {std::pair<std::int64_t, std::int64_t>{12, 30}, {30, 12}}) {
    const Global g(2, sq, skv, 99 + static_cast<unsigned>(sq));
    for (CausalAlign align : {CausalAlign::top_left, CausalAlign::bottom_right})
      for (Window w : {Window{}, Window{3, 2}}) {
        AttentionProblem pr{.batch = 2, .heads = H, .kv_heads = K, .head_dim = D, .causal = w.left < 0,
                            .dtype = DType::f64, .with_lse = true, .causal_align = align, .window = w};
        const auto sq_c = sq;
        CAPTURE(sq_c);
        CAPTURE(static_cast<int>(align));
        const std::vector<std::int64_t> lq{sq / 3, sq - sq / 3 - 2, 2}, lk{skv - 9, 4, 5};
        check("Anything<Ring<Contiguous>> 3", AnythingPolicy<RingPolicy<>>{}, pr, g, lq, lk);
        check("Anything<Unified<Zigzag>> 1x3", AnythingPolicy<UnifiedPolicy<Zigzag>>{{1, 3}}, pr, g, lq, lk);
        check("Anything<Ulysses> 3", AnythingPolicy<UlyssesPolicy>{}, pr, g, lq, lk);
      }
  }
}

TEST_CASE("masks: a ring step whose keys no local query sees is skipped") {
  // Four documents, one per contiguous ring block: every rank computes only its own block.
  run_ranks(4, [&](ThreadCommunicator& world) {
    SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, ReferenceKernel> attn(world);
    const Plan plan = attn.plan<double>({.heads = 2, .head_dim = 4, .documents = {{8, 8, 8, 8}}}, {8});
    const auto& steps = detail::PlanAccess::state<detail::RingLoop>(plan).step_computes;
    CHECK(steps == std::vector<unsigned char>{1, 0, 0, 0});
    CHECK(plan.work(world.rank()) == 8 * 8 * 2);
  });
}

namespace {
/// A kernel that says it handles causal masks only.
struct CausalOnlyKernel : ReferenceKernel {
  static constexpr bool supports_masks = false;
};
}  // namespace

TEST_CASE("masks: invalid descriptions fail alike on every rank; a causal-only kernel refuses the rest") {
  struct Bad {
    const char* needle;
    void (*edit)(AttentionProblem&);
  };
  const Bad bad[] = {
      {"plan: documents[0][1]: expected a length >= 1, got 0 (empty documents are not allowed)",
       [](AttentionProblem& p) { p.documents = {{16, 0, 16}}; }},
      {"plan: documents[0]: lengths sum to 30, expected the global sequence length 32",
       [](AttentionProblem& p) { p.documents = {{10, 20}}; }},
      {"plan: documents: expected one list shared by every batch element or one per batch element (2), got 3 lists",
       [](AttentionProblem& p) { p.documents = {{32}, {32}, {32}}; }},
      {"plan: kv_valid[1]: expected 0..32 (the key length), got 33", [](AttentionProblem& p) { p.kv_valid = {3, 33}; }},
      {"plan: kv_valid: expected one count per batch element (2), got 1", [](AttentionProblem& p) { p.kv_valid = {3}; }},
      {"plan: window: expected sides >= 0 (any size; one past the sequence hides nothing), or -1 for unbounded, got {-2, 4}", [](AttentionProblem& p) { p.window = {-2, 4}; }},
  };
  for (const Bad& b : bad) {
    CAPTURE(b.needle);
    auto outcomes = test::rank_outcomes(4, [&](ThreadCommunicator& c) {
      SequenceParallelAttention<AnythingPolicy<RingPolicy<Zigzag>>, ThreadCommunicator, ReferenceKernel> attn(c);
      AttentionProblem p{.batch = 2, .heads = 2, .head_dim = 4};
      b.edit(p);
      (void)attn.plan(p, {8});
    });
    CHECK(test::all_same_config_error(outcomes, b.needle));
  }
  // Ranks that disagree on a mask list throw the same error (the lists travel as a hash).
  auto differ = test::rank_outcomes(2, [&](ThreadCommunicator& c) {
    SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, ReferenceKernel> attn(c);
    (void)attn.plan({.heads = 2, .head_dim = 4, .documents = {{c.rank() == 0 ? 4 : 3, c.rank() == 0 ? 4 : 5}}}, {4});
  });
  CHECK(test::all_same_config_error(differ, "plan: ranks disagree on documents"));
  // A kernel that handles causal masks only is refused a window at plan time.
  auto cpu = test::rank_outcomes(2, [&](ThreadCommunicator& c) {
    SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, CausalOnlyKernel> attn(c);
    (void)attn.plan({.heads = 2, .head_dim = 4, .window = {2, 2}}, {4});
  });
  CHECK(test::all_same_config_error(cpu, "this kernel handles causal masks only"));
}

TEST_CASE("masks: which layout balances which mask (the README's table)") {
  // max/mean of plan.work on 4 ring ranks, S = 8192, for each mask family and layout; printed
  // as the README's table, and every cell held to the value the README shows (printed to
  // three decimals: 1e-3). Stripe (token t on rank t mod R) gives every rank a share of every
  // document and of every padded stretch, so it balances them all; zigzag balances plain causal.
  struct Row {
    const char* mask;
    AttentionProblem problem;
    double contiguous, zigzag, stripe;  ///< the README's cells
  };
  auto with = [](auto&& set) {
    AttentionProblem p{.heads = 1, .head_dim = 8};
    set(p);
    return p;
  };
  const std::vector<Row> rows = {
      {"causal", with([](auto& p) { p.causal = true; }), 1.750, 1.000, 1.000},
      {"causal + documents 3000, 700, 4100, 392",
       with([](auto& p) { p.causal = true, p.documents = {{3000, 700, 4100, 392}}; }), 1.662, 1.391, 1.001},
      {"causal + documents 8 x 1024",
       with([](auto& p) { p.causal = true, p.documents = {std::vector<std::int64_t>(8, 1024)}; }), 1.000, 1.000, 1.003},
      {"causal + window (512, -1)", with([](auto& p) { p.causal = true, p.window = {512, -1}; }), 1.032, 1.032, 1.000},
      {"window (256, 256)", with([](auto& p) { p.window = {256, 256}; }), 1.016, 1.016, 1.000},
      {"key padding 5000, 8192 (batch 2)", with([](auto& p) { p.batch = 2, p.kv_valid = {5000, 8192}; }), 1.000, 1.000,
       1.000},
      {"causal + key padding 5000, 8192",
       with([](auto& p) { p.causal = true, p.batch = 2, p.kv_valid = {5000, 8192}; }), 1.607, 1.082, 1.000},
  };
  auto imbalance = [](auto policy, const AttentionProblem& problem) {
    std::vector<std::int64_t> work(4);
    run_ranks(4, [&](ThreadCommunicator& world) {
      SequenceParallelAttention<decltype(policy), ThreadCommunicator, ReferenceKernel> attn(world, policy);
      const Plan plan = attn.plan(problem, {8192 / 4});
      work[static_cast<std::size_t>(world.rank())] = plan.work(world.rank());
    });
    const double mean = std::accumulate(work.begin(), work.end(), 0.0) / 4;
    return *std::max_element(work.begin(), work.end()) / mean;
  };
  std::string table = "| mask (S = 8192, 4 ring ranks) | contiguous | zigzag | stripe |\n|---|---|---|---|\n";
  for (const Row& r : rows) {
    const double c = imbalance(RingPolicy<Contiguous>{}, r.problem), z = imbalance(RingPolicy<Zigzag>{}, r.problem),
                 st = imbalance(RingPolicy<Stripe>{}, r.problem);
    char line[160];
    std::snprintf(line, sizeof line, "| %s | %.3f | %.3f | %.3f |\n", r.mask, c, z, st);
    table += line;
    const std::string mask = r.mask;
    CAPTURE(mask);
    CHECK(std::abs(c - r.contiguous) <= 1e-3);
    CHECK(std::abs(z - r.zigzag) <= 1e-3);
    CHECK(std::abs(st - r.stripe) <= 1e-3);
    CHECK(st <= 1.05);  // stripe balances every family, documents of uneven length included
  }
  MESSAGE("max/mean plan.work:\n" << table);
}

TEST_CASE("masks: the examples' reference (examples/common.hpp) applies every family as the brute force does") {
  // The demo's and the examples' --check use reference_rows with the shape's mask; a run of
  // every policy against it must agree, and the reference itself must match visible_by_definition.
  test::GlobalShape s = test::make_case(42, H, K, D, true, 91, 2);
  s.seq_kv = 57;
  s.causal_align = CausalAlign::bottom_right;
  s.window = {9, -1};
  s.kv_valid = {50, 23};
  const test::GlobalInputs g = test::make_inputs(s);
  const std::vector<double> ref = test::reference_rows(g, PositionMap::run(s.seq_q, 0));
  // Brute force, straight from the definitions.
  const AttentionProblem pr = s.problem<double>();
  CHECK(rel(ref, test::brute_force_forward({pr, s.seq_q, s.kv_len(), g.q, g.k, g.v}).out) <= 1e-12);
  // A policy run checked against it (Anything over Ring Zigzag on 3 ranks: S_q != S_kv).
  std::vector<double> err(3, 1.0);
  run_ranks(3, [&](ThreadCommunicator& world) {
    SequenceParallelAttention<AnythingPolicy<RingPolicy<Zigzag>>, ThreadCommunicator, ReferenceKernel> attn(world);
    const Plan plan = attn.plan(s.problem<float>(), {s.seq_q / 3, s.kv_len() / 3});
    err[static_cast<std::size_t>(world.rank())] = examples::forward_error<float>(attn, plan, g).rel();
  });
  for (double e : err) CHECK(e < 1e-5);
}

TEST_CASE("masks: the brute force's window sides may be as large as INT64_MAX (no overflow)") {
  // A side of INT64_MAX bounds nothing: the definition must agree with the unbounded side
  // for every pair, diagonals shifted either way (S_q > S_kv and S_q < S_kv, bottom-right).
  constexpr std::int64_t big = std::numeric_limits<std::int64_t>::max();
  for (const auto& [sq, skv] : {std::pair<std::int64_t, std::int64_t>{5, 9}, {9, 5}})
    for (CausalAlign align : {CausalAlign::top_left, CausalAlign::bottom_right})
      for (bool causal : {false, true})
        for (const auto& [huge, same] : {std::pair<Window, Window>{{big, big}, {-1, -1}}, {{big, 2}, {-1, 2}},
                                         {{1, big}, {1, -1}}}) {
          AttentionProblem a{.heads = 1, .head_dim = 1, .causal = causal, .causal_align = align, .window = huge};
          AttentionProblem b = a;
          b.window = same;
          std::int64_t differ = 0;
          for (std::int64_t i = 0; i < sq; ++i)
            for (std::int64_t j = 0; j < skv; ++j)
              differ += visible_by_definition(a, sq, skv, 0, i, j) != visible_by_definition(b, sq, skv, 0, i, j);
          const auto sq_c = sq;
          CAPTURE(sq_c);
          CAPTURE(causal);
          const auto huge_right = huge.right;
          CAPTURE(huge_right);
          CHECK(differ == 0);
        }
}
