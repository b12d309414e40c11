// The contract fuzzer's regression corpus: each defect it found, as the smallest case that
// shows it, named by the property it breaks. Every case runs through the fuzzer's own checks
// in a child process (a crash or a hang fails the case, not this program). While a defect's
// class is listed in SEQPAR_FUZZ_OPEN_CLASSES (tests/fuzz/CMakeLists.txt) its case must still
// break that property; once the class is removed, the case must keep every contract. So a fix
// that lands without its letter being removed fails here, and so does a regression after.
// Last, a self-test of the checks: a run fabricated from the reference passes them, and each
// way of breaking it fails the property that names it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "fuzz/fuzz_isolate.hpp"
#include "fuzz/fuzz_runners.hpp"
#include "seqpar/policy/policies.hpp"

using namespace seqpar;
using namespace seqpar::fuzz;

namespace {

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

/// An attention case: `world` ranks of `policy` on `kernel`, planning `p` with `lengths`.
FuzzCase attention(int world, PolicyChoice policy, KernelKind kernel, AttentionProblem p, std::vector<LocalLengths> lengths) {
  FuzzCase c;
  c.kind = CaseKind::attention;
  c.attention.world = world;
  c.attention.policy = policy;
  c.attention.kernel = kernel;
  c.attention.problem = std::move(p);
  c.attention.lengths = std::move(lengths);
  c.attention.data_seed = 12345;
  return c;
}

/// A decode case of `p` on `world` ranks with ReferenceKernel, one step.
FuzzCase decode(int world, DecodeProblem p) {
  FuzzCase c;
  c.kind = CaseKind::decode;
  c.decode.world = world;
  c.decode.problem = std::move(p);
  c.decode.data_seed = 777;
  return c;
}

PolicyChoice ulysses(bool anything = false) { return {PolicyKind::ulysses, LayoutKind::contiguous, anything}; }

/// Case `c` keeps every contract; or, while class `letter` is open, breaks `property`.
void expect_contract(const FuzzCase& c, char letter, const char* property) {
  const Report r = run_isolated(c, 60);
  std::string seen;
  for (const Failure& f : r.failures) seen += "\n  " + f.property + ": " + f.detail;
  INFO("case: " << describe(c));
  INFO("failures:" << (seen.empty() ? std::string(" none") : seen));
  if (std::string(SEQPAR_FUZZ_OPEN_CLASSES).find(letter) != std::string::npos) {
    const bool shown = std::any_of(r.failures.begin(), r.failures.end(), [&](const Failure& f) { return f.property == property; });
    const std::string name(1, letter);
    CHECK_MESSAGE(shown, "class " << name << " no longer breaks \"" << std::string(property) << "\": if its fix has landed, "
                                  << "remove " << name << " from SEQPAR_FUZZ_OPEN_CLASSES in tests/fuzz/CMakeLists.txt");
  } else {
    CHECK(r.failures.empty());
  }
}

/// Case `c` keeps every contract.
void expect_clean(const FuzzCase& c) {
  const Report r = run_isolated(c, 60);
  std::string seen;
  for (const Failure& f : r.failures) seen += "\n  " + f.property + ": " + f.detail;
  INFO("case: " << describe(c));
  CHECK_MESSAGE(r.failures.empty(), "failures:" << seen);
}

AttentionProblem small(std::int64_t heads = 1, std::int64_t dim = 8) {
  AttentionProblem p;
  p.heads = heads;
  p.head_dim = dim;
  p.with_lse = true;
  return p;
}

}  // namespace

TEST_CASE("fuzz regression (a): a window side of INT64_MAX hides no key it should show") {
  AttentionProblem p = small();
  p.window = {-1, kMax};  // d + right wraps: every key hidden
  expect_contract(attention(1, ulysses(), KernelKind::reference, p, {{8}}), 'a', prop::forward);
  p.window = {kMax, 2};  // bottom-right with S_q > S_kv: a diagonal below -1 minus left wraps
  p.causal_align = CausalAlign::bottom_right;
  expect_contract(attention(1, ulysses(true), KernelKind::cpu_flash_1, p, {{8, 4}}), 'a', prop::forward);
  p.window = {kMax - 1, 0};  // past 16 query rows: CpuFlashKernel's forward_query_block crashes
  const PolicyChoice stripe{PolicyKind::ring, LayoutKind::stripe, true};
  expect_contract(attention(2, stripe, KernelKind::cpu_flash_1, p, {{17, 8}, {16, 8}}), 'a', prop::no_crash);
}

TEST_CASE("fuzz regression (b): DecodePlan::advance applies in whole or not at all") {
  DecodeProblem p{.batch = 2, .heads = 1, .head_dim = 8, .kv_len = {1, 6}, .capacity = 8};
  FuzzCase c = decode(1, p);
  c.decode.advance_probes = {3};  // fits sequence 0, not sequence 1
  expect_contract(c, 'b', prop::advance);
  c.decode.advance_probes = {kMax};  // kv_len + k wraps below the capacity
  expect_contract(c, 'b', prop::advance);
}

TEST_CASE("fuzz regression (c): a NaN in the Q row of a query that sees no key reaches no gradient") {
  AttentionProblem p = small();
  p.causal = true;
  p.causal_align = CausalAlign::bottom_right;  // S_q 4 > S_kv 2: queries 0 and 1 see nothing
  FuzzCase c = attention(1, ulysses(true), KernelKind::cpu_flash_1, p, {{4, 2}});
  c.attention.backward = true;
  c.attention.nan_hidden_q = true;
  expect_contract(c, 'c', prop::backward);
}

TEST_CASE("fuzz regression (d): a time-out of INT64_MAX ms means never") {
  FuzzCase c;
  c.kind = CaseKind::timeout;
  c.timeout.world = 2;
  c.timeout.timeout_ms = kMax;
  expect_contract(c, 'd', prop::timeout);
  c.timeout.timeout_ms = 9'300'000'000'000;
  expect_contract(c, 'd', prop::timeout);
}

TEST_CASE("fuzz regression (e): lengths whose sum wraps past 2^63 are refused") {
  AttentionProblem p = small();
  p.documents = {{kMax, kMax, 18}};  // sums to 16 in wrapped 64-bit arithmetic
  expect_contract(attention(1, ulysses(true), KernelKind::reference, p, {{16}}), 'e', prop::rules);
  expect_contract(decode(1, {.batch = 1, .heads = 1, .head_dim = 8, .new_tokens = 2, .kv_len = {kMax - 1}, .capacity = kMax}),
                  'e', prop::rules);
}

TEST_CASE("fuzz regression (f): the member can_implement of a kernel without supports_masks refuses masks") {
  AttentionProblem p = small();
  p.window = {2, -1};
  expect_contract(attention(1, ulysses(), KernelKind::causal_only, p, {{8}}), 'f', prop::member_can_implement);
}

TEST_CASE("fuzz regression (g): owner and slot refuse positions outside the cache") {
  FuzzCase c = decode(2, {.batch = 1, .heads = 1, .head_dim = 8, .kv_len = {5}, .capacity = 8});
  c.decode.position_probes = {{0, -1}, {0, 8}};
  expect_contract(c, 'g', prop::position);
}

TEST_CASE("fuzz regression (h): decode refuses a NaN scale and an exchange outside its enum") {
  expect_contract(decode(1, {.batch = 1, .heads = 1, .head_dim = 8, .scale = std::nan(""), .kv_len = {5}, .capacity = 8}),
                  'h', prop::rules);
  expect_contract(decode(1, {.batch = 1, .heads = 1, .head_dim = 8, .kv_len = {5}, .capacity = 8,
                             .exchange = static_cast<DecodeExchange>(7)}),
                  'h', prop::rules);
}

TEST_CASE("fuzz regression (i): ranks that disagree on documents are told the lengths, not hashes") {
  AttentionProblem p = small();
  p.documents = {{6, 2}};
  FuzzCase c = attention(2, ulysses(), KernelKind::reference, p, {{4}, {4}});
  c.attention.disagree_rank = 1;
  c.attention.disagree_field = "documents";
  c.attention.other_problem = p;
  c.attention.other_problem.documents = {{4, 4}};
  expect_contract(c, 'i', prop::disagreement);
}

TEST_CASE("fuzz regression (j): can_implement refuses stripe lengths that do not follow from the total") {
  const PolicyChoice stripe{PolicyKind::ring, LayoutKind::stripe, true};
  expect_contract(attention(2, stripe, KernelKind::reference, small(), {{3}, {1}}), 'j', prop::can_implement);
}

TEST_CASE("fuzz regression (k): a finite scale whose scores pass the float range is refused or computed") {
  AttentionProblem p = small();
  p.scale = 4e38;  // finite in double; past FLT_MAX, and so is the float LSE
  const PolicyChoice ring{PolicyKind::ring, LayoutKind::contiguous};
  expect_contract(attention(2, ring, KernelKind::reference, p, {{4}, {4}}), 'k', prop::forward);
}

TEST_CASE("fuzz regression (l): a K/V length below -1 is refused, not read as \"same as q\"") {
  expect_contract(attention(1, ulysses(true), KernelKind::reference, small(), {{4, -2}}), 'l', prop::rules);
}

TEST_CASE("fuzz regression (m): enums outside their range are refused") {
  PolicyChoice unified{PolicyKind::unified, LayoutKind::contiguous, false, 1, 0, static_cast<MeshPlacement>(5)};
  expect_contract(attention(1, unified, KernelKind::reference, small(), {{4}}), 'm', prop::rules);
  FuzzCase untyped = attention(1, ulysses(), KernelKind::reference, small(), {{4}});
  untyped.attention.typed_plan = false;
  untyped.attention.problem.dtype = static_cast<DType>(9);
  expect_contract(untyped, 'm', prop::rules);
  expect_contract(decode(1, {.batch = 1, .heads = 1, .head_dim = 8, .dtype = static_cast<DType>(9), .kv_len = {5},
                             .capacity = 8}),
                  'm', prop::rules);
}

TEST_CASE("fuzz regression (n): CpuFlashKernel with two threads runs an empty batch") {
  AttentionProblem p = small();
  p.batch = 0;
  expect_contract(attention(1, ulysses(true), KernelKind::cpu_flash_2, p, {{4}}), 'n', prop::no_crash);
}

TEST_CASE("fuzz regression (o): a size refusal names the true lengths") {
  expect_contract(attention(2, ulysses(true), KernelKind::reference, small(), {{1}, {kMax}}), 'o', prop::message);
  AttentionProblem p = small();
  p.batch = kMax;  // every tensor is empty: 0 bytes, below any limit
  expect_contract(attention(1, ulysses(true), KernelKind::reference, p, {{0}}), 'o', prop::rules);
}

TEST_CASE("fuzz regression (p): Unified degrees whose product wraps int are refused at construction") {
  const PolicyChoice wide{PolicyKind::unified, LayoutKind::contiguous, false, std::numeric_limits<int>::max(),
                          std::numeric_limits<int>::max()};
  expect_contract(attention(1, wide, KernelKind::reference, small(), {{4}}), 'p', prop::rules);
}

TEST_CASE("fuzz regression (r): a soft-cap at the ends of its legal range is computed or refused") {
  AttentionProblem p = small();
  p.softcap = 5e-324;  // denormal: scale / softcap overflows, 0 x inf is NaN
  expect_contract(attention(1, ulysses(), KernelKind::cpu_flash_1, p, {{8}}), 'r', prop::forward);
  p.softcap = 1e300;  // in float the cap is inf: inf x tanh(0) is NaN
  expect_contract(attention(1, ulysses(), KernelKind::cpu_flash_1, p, {{8}}), 'r', prop::forward);
}

TEST_CASE("fuzz regression (s): a head_dim_v past any allocation is refused with ConfigError") {
  AttentionProblem p = small();
  p.batch = 0;                          // every tensor is empty: the size rules pass
  p.head_dim_v = std::int64_t{1} << 55;  // the kernel's scratch passes vector::max_size
  expect_contract(attention(1, ulysses(), KernelKind::cpu_flash_1, p, {{4}}), 's', prop::refusal_type);
}

TEST_CASE("fuzz regression (t): with sinks and an LSE, a rank holding no query rows runs forward") {
  AttentionProblem p = small(2);
  FuzzCase c = attention(2, {PolicyKind::ring, LayoutKind::contiguous, true}, KernelKind::reference, p, {{0, 3}, {4, 1}});
  c.attention.sinks = {0.5f, -1.0f};
  c.attention.backward = true;
  expect_contract(c, 't', prop::forward);
}

TEST_CASE("fuzz regression: D_v, soft-cap and sinks together keep every contract, sinks past the finite too") {
  // GQA, a window, D_v > D, a soft-cap that bites and sinks on a 2 x 1 mesh, forward and backward.
  AttentionProblem p = small(4);
  p.kv_heads = 2;
  p.causal = true;
  p.window = {3, -1};
  p.head_dim_v = 12;
  p.softcap = 2.0;
  FuzzCase c = attention(2, {PolicyKind::unified, LayoutKind::zigzag, true, 2, 1}, KernelKind::cpu_flash_1, p, {{5}, {3}});
  c.attention.sinks = {0.5f, -2.0f, 3.0f, 30.0f};
  c.attention.backward = true;
  Report r = run_isolated(c, 60);
  CHECK(r.failures.empty());
  CHECK(std::find(r.notes.begin(), r.notes.end(), "attention: sinks' gradient checked") != r.notes.end());
  // A NaN, +inf and -inf sink: their heads NaN or the limit, the others exact.
  c.attention.sinks = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(), 1.0f};
  expect_clean(c);
  // Decode with MLA's latent cache: V the first D_v columns of K's rows, a soft-cap and sinks.
  FuzzCase d = decode(3, {.batch = 2, .heads = 4, .kv_heads = 1, .head_dim = 16, .head_dim_v = 8, .softcap = 5.0,
                          .new_tokens = 2, .kv_len = {7, 0}, .capacity = 12, .page = 2});
  d.decode.v_in_k = true;
  d.decode.sinks = {0.25f, -1.0f, 2.0f, std::numeric_limits<float>::quiet_NaN()};
  r = run_isolated(d, 60);
  CHECK(r.failures.empty());
  CHECK(std::find(r.notes.begin(), r.notes.end(), "decode: steps checked with D_v < D, V in K's rows") != r.notes.end());
}

TEST_CASE("fuzz regression: the corpus's cases keep every other contract") {
  // A case of each kind that no known class touches: the checks themselves pass on it.
  AttentionProblem p = small(4);
  p.kv_heads = 2;
  p.causal = true;
  p.window = {3, -1};
  p.kv_valid = {7};
  FuzzCase c = attention(2, {PolicyKind::unified, LayoutKind::zigzag, true, 2, 1}, KernelKind::cpu_flash_1, p, {{5}, {3}});
  c.attention.backward = true;
  c.attention.nan_hidden_kv = true;
  const Report r = run_isolated(c, 60);
  CHECK(r.failures.empty());
  CHECK(std::find(r.notes.begin(), r.notes.end(), "attention: backward checked") != r.notes.end());
  const Report d = run_isolated(decode(3, {.batch = 2, .heads = 2, .head_dim = 8, .new_tokens = 2, .kv_len = {7, 0},
                                          .capacity = 12, .page = 2}),
                                60);
  CHECK(d.failures.empty());
  CHECK(std::find(d.notes.begin(), d.notes.end(), "decode: steps checked exactly") != d.notes.end());
}

namespace {

/// The rows at positions `pos` of a global [B, S, heads, width] tensor.
std::vector<double> rows_at(const std::vector<double>& g, std::int64_t B, std::int64_t S, std::int64_t heads,
                            std::int64_t width, const PositionMap& pos) {
  std::vector<double> out;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < pos.size(); ++i) {
      const auto at = g.begin() + ((b * S + pos(i)) * heads) * width;
      out.insert(out.end(), at, at + heads * width);
    }
  return out;
}

bool breaks(const Report& r, const char* property) {
  return std::any_of(r.failures.begin(), r.failures.end(), [&](const Failure& f) { return f.property == property; });
}

}  // namespace

TEST_CASE("fuzz self-test: every attention check fails on a wrong answer, and none on the right one") {
  // Two ranks of RingPolicy<Contiguous>, GQA, causal with a window, D_v != D, a soft-cap and
  // sinks: a run fabricated from the reference itself (plans built the way plan builds them),
  // then broken one way at a time.
  AttentionProblem p = small(2, 4);
  p.kv_heads = 1;
  p.causal = true;
  p.window = {2, -1};
  p.head_dim_v = 6;
  p.softcap = 1.5;
  const RingPolicy<Contiguous> policy;
  FuzzCase fc = attention(2, {PolicyKind::ring, LayoutKind::contiguous}, KernelKind::reference, p, {{3}, {3}});
  AttentionCase& c = fc.attention;
  c.backward = true;
  c.sinks = {0.3f, -0.7f};
  const MeshConfig mesh = mesh_config(policy, 2);
  // The run the reference of case `k` (with data `d`) gives; the sinks' gradient all on rank 0.
  auto fabricate = [&](const AttentionCase& k, const CaseData& d) {
    std::vector<std::int64_t> all;
    for (int w = 0; w < 2; ++w)
      for (std::int64_t v : detail::plan_fields(problem_of(k, w), mesh, k.lengths[static_cast<std::size_t>(w)]))
        all.push_back(v);
    AttentionRun run;
    run.free_verdict = can_implement(policy, problem_of(k, 0), std::span<const LocalLengths>(k.lengths));
    for (int w = 0; w < 2; ++w) {
      RankResult r;
      r.plan = detail::build_plan<policy_phases_of<RingPolicy<Contiguous>>>(all, problem_of(k, w), mesh, w, 1);
      r.member_asked = true;
      r.member = run.free_verdict;
      r.planned = r.forwarded = r.backwarded = true;
      r.qpos = r.plan.q_positions(w);
      r.kvpos = r.plan.kv_positions(w);
      r.out = rows_at(d.ref.out, d.B, d.Sq, d.H, d.Dv, r.qpos);
      r.lse = rows_at(d.ref.lse, d.B, d.Sq, d.H, 1, r.qpos);
      r.dq = rows_at(d.ref.dq, d.B, d.Sq, d.H, d.D, r.qpos);
      r.dk = rows_at(d.ref.dk, d.B, d.Skv, d.K, d.D, r.kvpos);
      r.dv = rows_at(d.ref.dv, d.B, d.Skv, d.K, d.Dv, r.kvpos);
      r.d_sinks = w == 0 ? d.ref.d_sinks : std::vector<double>(d.ref.d_sinks.size(), 0.0);
      r.forward_traffic = {r.plan.forward_bytes(w), r.plan.forward_bytes(w), 0};
      r.backward_traffic = {r.plan.backward_bytes(w), r.plan.backward_bytes(w), 0};
      run.ranks.push_back(std::move(r));
    }
    return run;
  };
  const CaseData d = prepare_attention(c);
  REQUIRE(d.ready);
  const AttentionRun good = fabricate(c, d);
  auto analyse = [&](const AttentionRun& run) {
    Report rep;
    analyse_attention(c, d, run, rep);
    return rep;
  };
  const Report right = analyse(good);
  for (const Failure& f : right.failures) INFO(f.property << ": " << f.detail);
  CHECK(right.failures.empty());

  auto broken = [&](auto&& change, const char* property) {
    AttentionRun run = good;
    change(run);
    const Report r = analyse(run);
    INFO("expected to break: " << std::string(property));
    CHECK(breaks(r, property));
  };
  broken([](AttentionRun& r) { r.ranks[1].out[3] += 1e-3; }, prop::forward);
  broken([](AttentionRun& r) { r.ranks[0].lse[1] += 1e-3; }, prop::lse);
  broken([](AttentionRun& r) { r.ranks[1].dk[2] += 1e-2; }, prop::backward);
  broken([](AttentionRun& r) { r.ranks[0].dq[0] = std::nan(""); }, prop::backward);
  broken([](AttentionRun& r) { r.ranks[1].dv[5] += 1e-2; }, prop::backward);  // V's last column (D_v > D)
  broken([](AttentionRun& r) { r.ranks[1].d_sinks[1] += 1e-2; }, prop::backward);
  broken([](AttentionRun& r) { r.ranks[0].out[0] = std::nan(""); }, prop::forward);  // a finite sink: no NaN
  broken([](AttentionRun& r) { r.ranks[1].forward_traffic.sent += 4; }, prop::traffic);
  broken([](AttentionRun& r) { r.ranks[0].backward_traffic.gathers = 1; }, prop::traffic);
  broken([](AttentionRun& r) { r.ranks[1].qpos = r.ranks[0].qpos; }, prop::layout);
  broken([](AttentionRun& r) { r.ranks[1].plan_call.kind = "ConfigError"; }, prop::same_refusal);
  broken([](AttentionRun& r) { r.free_verdict = {false, "no"}; }, prop::can_implement);
  broken([](AttentionRun& r) { r.ranks[0].member = {false, "no"}; }, prop::member_can_implement);
  broken([](AttentionRun& r) { r.ranks[1].forward = {}, r.ranks[1].forward.kind = "CommAborted"; }, prop::forward);
  broken([](AttentionRun& r) {  // a refusal in words other than can_implement's
    for (RankResult& rank : r.ranks) rank.plan_call.kind = "ConfigError", rank.plan_call.what = "plan: something";
    r.free_verdict = {false, "plan: something else"};
  }, prop::can_implement);

  // A NaN sink on head 0: its rows must be NaN (a finite value there is wrong), head 1 exact.
  AttentionCase nan_case = c;
  nan_case.sinks = {std::numeric_limits<float>::quiet_NaN(), 0.3f};
  const CaseData dn = prepare_attention(nan_case);
  const AttentionRun nan_run = fabricate(nan_case, dn);
  Report rn;
  analyse_attention(nan_case, dn, nan_run, rn);
  for (const Failure& f : rn.failures) INFO(f.property << ": " << f.detail);
  CHECK(rn.failures.empty());
  AttentionRun wrong = nan_run;
  wrong.ranks[0].out[0] = 0.25;  // row 0, head 0, element 0: finite where NaN is the answer
  rn = {};
  analyse_attention(nan_case, dn, wrong, rn);
  CHECK(breaks(rn, prop::forward));
  wrong = nan_run;
  wrong.ranks[0].out[6] = std::nan("");  // row 0, head 1: its sink is finite
  rn = {};
  analyse_attention(nan_case, dn, wrong, rn);
  CHECK(breaks(rn, prop::forward));
}

TEST_CASE("fuzz regression (q): every rank refuses alike when the kernel cannot allocate its scratch") {
  // Head 0 goes to rank 0, which needs scratch for 2^40 batch rows and cannot have it (the
  // child's address space is capped); rank 1 computes no head and needs none.
  AttentionProblem p = small();
  p.batch = std::int64_t{1} << 40;
  expect_contract(attention(2, ulysses(true), KernelKind::cpu_flash_2, p, {{2}, {2}}), 'q', prop::same_refusal);
}

TEST_CASE("the checks hold a row whose V values cancel to the accuracy its terms allow") {
  // One query over 2999 zero-mean V values of head dim 1: |O| is ~50x smaller than the terms
  // it sums, so float's rounding, bounded by eps * sum_j p_j |v_j|, is ~1e-5 of |O|. The
  // checks measure errors against that sum (NormError's magnitude), not |O| alone.
  FuzzCase c = decode(4, {.batch = 1, .heads = 5, .kv_heads = 1, .head_dim = 1, .kv_len = {2999}, .capacity = 3001, .page = kMax});
  c.decode.kernel = KernelKind::cpu_flash_1;
  c.decode.isa = 2;
  c.decode.advance_probes = {1};
  c.decode.data_seed = 14367442863588565289u;  // the inputs of the run that found it: error 1.05e-5 of |O|
  expect_clean(c);
}

TEST_CASE("the checks hold float gradients in the subnormal range to what float can represent") {
  // Scale 1e-30 and a sink of 30, which takes nearly all of each row's probability: every
  // gradient is ~1e-43, subnormal in float, where one rounding of a term (up to 2^-150) is
  // ~1e-3 of the values. The checks allow those roundings (NormError's floor) and hold the
  // rest to the float tolerance.
  AttentionProblem p = small(1, 48);
  p.causal = true;
  p.scale = 1e-30;
  FuzzCase c = attention(2, ulysses(true), KernelKind::cpu_flash_2, p, {{18, -1}, {13, 13}});
  c.attention.sinks = {30.0f};
  c.attention.backward = true;
  c.attention.nan_hidden_kv = true;
  for (int isa : {-1, 0}) {  // the widest level, and the 128-bit one every CPU has
    c.attention.isa = isa;
    expect_clean(c);
  }
}
