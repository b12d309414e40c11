// Compile-time composition: which phases a policy instantiates, a kernel that writes only T
// under every policy (a 2-byte type whose partials the ring must convert), can_implement
// answering in plan's words without communicating, the read-only plan, and the workspace's
// declared aliasing.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "custom_kernel.hpp"  // examples/: the user kernel of examples/custom_kernel.cpp
#include "seqpar/seqpar.hpp"
#include "support/attention_check.hpp"
#include "support/host_bf16.hpp"

using namespace seqpar;

namespace {

// The phases each policy instantiates, decided at compile time.
static_assert(policy_traits<UlyssesPolicy>::ulysses && !policy_traits<UlyssesPolicy>::ring);
static_assert(!policy_traits<RingPolicy<Zigzag>>::ulysses && policy_traits<RingPolicy<Zigzag>>::ring);
static_assert(policy_traits<UnifiedPolicy<>>::ulysses && policy_traits<UnifiedPolicy<>>::ring);
static_assert(policy_traits<AnythingPolicy<RingPolicy<>>>::ring && policy_traits<AnythingPolicy<RingPolicy<>>>::anything);
// Unified lists the exchange around the sinks and the ring loop; layouts and Anything share one
// engine.
static_assert(std::is_same_v<policy_phases_of<UnifiedPolicy<Zigzag>>,
                             detail::PhaseList<detail::UlyssesExchange, detail::JoinSinks, detail::RingLoop,
                                               detail::LocalCompute>>);
static_assert(
    std::is_same_v<policy_phases_of<RingPolicy<Zigzag>>, policy_phases_of<AnythingPolicy<RingPolicy<Stripe>>>>);
// The user kernel writes only T: for bf16 it cannot write the ring's float partials.
static_assert(LocalAttentionKernel<::examples::PlainKernel, ::test::bf16>);
static_assert(!kernel_writes_acc<::examples::PlainKernel, ::test::bf16>);
static_assert(kernel_writes_acc<::examples::PlainKernel, float>);  // T == A
// The plan is read-only: its accessors return values or const references.
static_assert(std::is_const_v<std::remove_reference_t<decltype(std::declval<Plan&>().problem())>>);
static_assert(std::is_const_v<std::remove_reference_t<decltype(std::declval<Plan&>().q_layout())>>);
static_assert(!std::is_assignable_v<decltype(std::declval<Plan&>().mesh()), MeshConfig>);

constexpr std::int64_t B = 2, H = 4, K = 2, D = 16;

/// Random global Q, K, V (rounded to T, so that the reference sees the same values).
template <class T>
struct Inputs {
  std::int64_t S;
  std::vector<T> q, k, v;
  explicit Inputs(std::int64_t seq) : S(seq) {
    std::mt19937_64 rng(77 + static_cast<unsigned>(seq));
    std::normal_distribution<float> n(0.f, 1.f);
    for (auto* x : {&q, &k, &v}) {
      x->resize(static_cast<std::size_t>(B * S * (x == &q ? H : K) * D));
      for (T& e : *x) e = static_cast<T>(n(rng));
    }
  }
};

/// The rows at `rows` of a global [B, S, h, D] tensor, as this rank's local tensor.
template <class T>
std::vector<T> local_rows(const std::vector<T>& x, std::int64_t S, std::int64_t h, const PositionMap& rows) {
  std::vector<T> local(static_cast<std::size_t>(B * rows.size() * h * D));
  scatter_sequence(TensorView<const T>::bshd(x.data(), B, S, h, D), rows,
                   TensorView<T>::bshd(local.data(), B, rows.size(), h, D));
  return local;
}

/// Runs PlainKernel with element type T under `policy` on `lengths.size()` thread ranks;
/// returns the errors of O and of the LSE (normwise relative, an LSE of -inf matched exactly)
/// over every rank.
template <class T, class Policy>
seqpar::test::Errors run_plain(Policy policy, const std::vector<std::int64_t>& lengths, bool causal) {
  std::int64_t S = 0;
  for (std::int64_t l : lengths) S += l;
  const Inputs<T> g(S);
  // The exact answer: ReferenceKernel in double over the whole sequence.
  std::vector<double> ro(static_cast<std::size_t>(B * S * H * D)), rl(static_cast<std::size_t>(B * S * H));
  KernelParams p;
  p.scale = 1.0 / std::sqrt(double(D));
  p.causal = causal;
  p.q_positions = p.k_positions = PositionMap::run(S, 0);
  p.group_size = H / K;
  ReferenceKernel{}.forward(TensorView<const T>::bshd(g.q.data(), B, S, H, D),
                            TensorView<const T>::bshd(g.k.data(), B, S, K, D),
                            TensorView<const T>::bshd(g.v.data(), B, S, K, D), TensorView<double>::bshd(ro.data(), B, S, H, D),
                            TensorView<double>::lse_bhs(rl.data(), B, S, H), p);
  std::vector<seqpar::test::Errors> err(lengths.size());
  run_ranks(static_cast<int>(lengths.size()), [&](ThreadCommunicator& world) {
    const int me = world.rank();
    SequenceParallelAttention<Policy, ThreadCommunicator, ::examples::PlainKernel> attn(world, policy);
    const AttentionProblem problem{.batch = B, .heads = H, .kv_heads = K, .head_dim = D, .causal = causal, .with_lse = true};
    const Plan plan = attn.template plan<T>(problem, {lengths[static_cast<std::size_t>(me)]});
    const PositionMap qp = plan.q_positions(me), kp = plan.kv_positions(me);
    const std::vector<T> q = local_rows(g.q, S, H, qp), k = local_rows(g.k, S, K, kp), v = local_rows(g.v, S, K, kp);
    std::vector<T> out(q.size());
    std::vector<float> lse(static_cast<std::size_t>(B * qp.size() * H));
    std::vector<std::byte> ws(plan.workspace_bytes());
    using In = TensorView<const T>;
    attn.template forward<T>(plan, In::bshd(q.data(), B, qp.size(), H, D), In::bshd(k.data(), B, kp.size(), K, D),
                             In::bshd(v.data(), B, kp.size(), K, D), TensorView<T>::bshd(out.data(), B, qp.size(), H, D),
                             TensorView<float>::lse_bhs(lse.data(), B, qp.size(), H), ws);
    std::vector<double> want(out.size()), want_l(lse.size()), got(out.begin(), out.end());
    scatter_sequence(TensorView<const double>::bshd(ro.data(), B, S, H, D), qp,
                     TensorView<double>::bshd(want.data(), B, qp.size(), H, D));
    scatter_sequence(TensorView<const double>::lse_bhs(rl.data(), B, S, H), qp,
                     TensorView<double>::lse_bhs(want_l.data(), B, qp.size(), H));
    seqpar::test::Errors& e = err[static_cast<std::size_t>(me)];
    e.merge(seqpar::test::compare(got, want));
    for (std::size_t i = 0; i < lse.size(); ++i) e.add_lse(double(lse[i]), want_l[i]);
  });
  seqpar::test::Errors all;
  for (const seqpar::test::Errors& e : err) all.merge(e);
  return all;
}

/// Checks one policy with float (output and LSE to 1e-5) and bf16 (output rounded to 8 bits:
/// 1e-2; the LSE stays in float, on inputs the reference sees as they are: 1e-5).
template <class Policy>
void check_plain(const char* name, Policy policy, const std::vector<std::int64_t>& lengths) {
  for (bool causal : {false, true}) {
    CAPTURE(name);
    CAPTURE(causal);
    const seqpar::test::Errors f = run_plain<float>(policy, lengths, causal);
    CHECK(!f.nan);
    CHECK(f.rel() <= seqpar::test::tolerance<float>);
    CHECK(f.lse_rel() <= seqpar::test::tolerance<float>);
    const seqpar::test::Errors b = run_plain<::test::bf16>(policy, lengths, causal);
    CHECK(!b.nan);
    CHECK(b.rel() < 1e-2);  // measured 2-5e-3: about one bf16 rounding (2^-8) of the output
    CHECK(b.lse_rel() <= seqpar::test::tolerance<float>);
  }
}

/// A phase as a user would add one, in one place: an exchange that runs outside the others and
/// moves Q into a buffer of its own on the way in and O out of one on the way back (what an
/// exchange does, without the communication). It claims 64 bytes per forward, refuses batch 3,
/// and passes backward's operands through.
struct StagingExchange {
  static constexpr const char* name = "StagingExchange";
  static constexpr detail::PhaseKind kind = detail::PhaseKind::exchange;
  static constexpr Slot q_stage{"q_stage"}, o_stage{"o_stage"};
  struct State {
    std::int64_t rows = 0;  // this rank's query tokens
  };
  static bool runs(const Plan&) { return true; }
  static std::string reason(const MeshConfig&, const AttentionProblem& pr, std::span<const std::int64_t>,
                            std::span<const std::int64_t>) {
    return pr.batch == 3 ? "plan: StagingExchange refuses batch 3" : "";
  }
  static std::string divisibility_reason(const MeshConfig&, const AttentionProblem&, std::span<const std::int64_t>,
                                         std::span<const std::int64_t>) {
    return "";
  }
  static State schedule(const Plan& p) { return {p.local_q()}; }
  static void declare(const Plan& p, WorkspaceLayout& forward, WorkspaceLayout&) {
    const AttentionProblem& pr = p.problem();
    const auto bytes = static_cast<std::size_t>(pr.batch * p.local_q() * pr.heads * pr.head_dim) * p.elem_bytes();
    forward.declare(q_stage, bytes);
    forward.declare(o_stage, bytes);
  }
  static std::size_t forward_bytes(const Plan&, int) { return 64; }
  template <class Call, class T, class Space>
  static detail::ForwardOperands<T, Space> in(Call& call, const detail::ForwardOperands<T, Space>& x) {
    const AttentionProblem& pr = call.plan.problem();
    const std::int64_t rows = detail::PlanAccess::state<StagingExchange>(call.plan).rows;
    T* q = call.ws.template get<T>(q_stage);
    call.cx.ops.copy(x.q, TensorView<T, Space>::bshd(q, pr.batch, rows, pr.heads, pr.head_dim));
    detail::ForwardOperands<T, Space> in = x;
    in.q = TensorView<const T, Space>::bshd(q, pr.batch, rows, pr.heads, pr.head_dim);
    in.out = TensorView<T, Space>::bshd(call.ws.template get<T>(o_stage), pr.batch, rows, pr.heads, pr.head_dim);
    return in;
  }
  template <class Call, class T, class Space>
  static void out(Call& call, const detail::ForwardOperands<T, Space>& inner, const detail::ForwardOperands<T, Space>& x) {
    call.cx.ops.copy(TensorView<const T, Space>(inner.out), x.out);
  }
  template <class Call, class T, class Space>
  static detail::BackwardOperands<T, Space> in(Call&, const detail::BackwardOperands<T, Space>& x) {
    return x;
  }
  template <class Call, class T, class Space>
  static void out(Call&, const detail::BackwardOperands<T, Space>&, const detail::BackwardOperands<T, Space>&) {}
};

}  // namespace

TEST_CASE("composition: a kernel that writes only T runs under all four policies (float and bf16)") {
  const std::vector<std::int64_t> even(4, 24);
  check_plain("UlyssesPolicy", UlyssesPolicy{}, even);
  check_plain("RingPolicy<Zigzag>", RingPolicy<Zigzag>{}, even);
  check_plain("RingPolicy<Stripe>", RingPolicy<Stripe>{}, even);
  check_plain("UnifiedPolicy 2x2", UnifiedPolicy<Contiguous>{2, 2}, even);
  check_plain("Anything<Unified<Zigzag>> 2x2 uneven", AnythingPolicy<UnifiedPolicy<Zigzag>>{{2, 2}},
              std::vector<std::int64_t>{31, 0, 17, 9});
  check_plain("Anything<Ring> 3 ranks", AnythingPolicy<RingPolicy<Contiguous>>{}, std::vector<std::int64_t>{13, 22, 5});
}

TEST_CASE("composition: can_implement answers without communicating, in plan's words") {
  const AttentionProblem pr{.batch = 1, .heads = 6, .kv_heads = 2, .head_dim = 8};
  const std::vector<LocalLengths> even(4, LocalLengths{16}), uneven{{16}, {15}, {16}, {16}};
  CHECK(can_implement(RingPolicy<Zigzag>{}, pr, even));
  CHECK(can_implement(AnythingPolicy<UlyssesPolicy>{}, pr, uneven));
  const Implementable heads = can_implement(UlyssesPolicy{}, pr, even);
  CHECK(!heads);
  CHECK(heads.reason.find("heads divisible by the Ulysses degree: heads 6, ulysses_degree 4") != std::string::npos);
  CHECK(heads.reason.find("use AnythingPolicy<UlyssesPolicy> for any shape") != std::string::npos);
  const Implementable len = can_implement(RingPolicy<Zigzag>{}, pr, uneven);
  CHECK(len.reason.find("AnythingPolicy<RingPolicy<Zigzag>>") != std::string::npos);
  const Implementable mesh = can_implement(UnifiedPolicy<>{3, 0}, pr, even);
  CHECK(mesh.reason == "UnifiedPolicy<Contiguous>: ulysses_degree 3 does not divide the world size 4");
  AttentionProblem nan_scale = pr;
  nan_scale.scale = std::nan("");
  CHECK(can_implement(AnythingPolicy<UlyssesPolicy>{}, nan_scale, even).reason.find("plan: scale") == 0);

  // plan throws exactly can_implement's reason (plus where it was thrown) on every rank.
  std::vector<std::string> thrown(4);
  run_ranks(4, [&](ThreadCommunicator& world) {
    SequenceParallelAttention<UlyssesPolicy, ThreadCommunicator, ReferenceKernel> attn(world);
    CHECK(!attn.can_implement(pr, even));
    try {
      (void)attn.plan(pr, {16});
    } catch (const ConfigError& e) {
      thrown[static_cast<std::size_t>(world.rank())] = e.what();
    }
  });
  for (const std::string& t : thrown) CHECK(t.rfind(heads.reason + " (at ", 0) == 0);
}

TEST_CASE("composition: workspace slots alias only as their lifetimes declare; a short workspace names the slot") {
  static constexpr Slot kept{"kept"}, packing{"packing", SlotLife::exchange_in},
      returned{"returned", SlotLife::exchange_out}, undeclared{"undeclared"};
  WorkspaceLayout layout;
  layout.declare(kept, 100);
  layout.declare(packing, 1000);
  layout.declare(returned, 600);
  layout.declare(kept, 40);  // declared again (a buffer two phases share): one buffer, the larger size
  layout.place();
  std::vector<std::byte> bytes(layout.bytes());
  auto* kept_at = layout.get<std::byte>(bytes, kept);
  auto* packing_at = layout.get<std::byte>(bytes, packing);
  auto* returned_at = layout.get<std::byte>(bytes, returned);
  CHECK_THROWS_WITH_AS(layout.get<std::byte>(bytes, undeclared), doctest::Contains("slot undeclared was not declared"),
                       Error);
  CHECK(packing_at == returned_at);    // never live together: they share bytes
  CHECK(packing_at >= kept_at + 100);  // the whole-call slot is never overlapped
  CHECK(layout.bytes() == 256 + 1000 + workspace_alignment);  // kept (aligned) + the larger group + slack
  std::vector<std::byte> small(700);
  CHECK_THROWS_WITH_AS(layout.get<std::byte>(small, packing), doctest::Contains("workspace: slot packing needs bytes"),
                       ConfigError);
}

TEST_CASE("composition: a slot declared by two phases is one buffer of the larger size, where it was first declared") {
  static constexpr Slot first{"first"}, shared{"shared"}, last{"last"};
  WorkspaceLayout layout;
  layout.declare(first, 10);
  layout.declare(shared, 300);
  layout.declare(last, 10);
  layout.declare(shared, 600);
  layout.place();
  std::vector<std::byte> bytes(layout.bytes());
  CHECK(layout.get<std::byte>(bytes, shared) == layout.get<std::byte>(bytes, first) + 256);
  CHECK(layout.get<std::byte>(bytes, last) == layout.get<std::byte>(bytes, shared) + 768);  // 600, aligned
  CHECK(layout.bytes() == 256 + 768 + 256 + workspace_alignment);  // the last slot too ends aligned
}

TEST_CASE("composition: a phase added in one place runs with the others: its rules, buffers, traffic and steps") {
  // The one line that adds it: its name in a list of phases.
  using Staged = detail::PhaseList<StagingExchange, detail::UlyssesExchange, detail::JoinSinks, detail::RingLoop,
                                   detail::LocalCompute>;
  const UnifiedPolicy<Zigzag> policy{2, 2};
  constexpr std::int64_t S = 32, L = S / 4;
  const Inputs<double> g(S);
  run_ranks(4, [&](ThreadCommunicator& world) {
    SequenceParallelAttention<UnifiedPolicy<Zigzag>, ThreadCommunicator, ReferenceKernel> plain(world, policy);
    detail::MeshEngine<Staged, ThreadCommunicator, ReferenceKernel> staged(world, mesh_request(policy), {});
    AttentionProblem pr{.batch = B, .heads = H, .kv_heads = K, .head_dim = D, .causal = true, .dtype = DType::f64};
    const Plan a = plain.plan(pr, {L}), b = staged.plan(pr, {L});
    for (int w = 0; w < 4; ++w) {  // the traffic is the sum of the phases'
      CHECK(b.forward_bytes(w) == a.forward_bytes(w) + 64);
      CHECK(b.backward_bytes(w) == a.backward_bytes(w));
    }
    CHECK(b.workspace_bytes() > a.workspace_bytes());  // its two buffers, besides the others'
    CHECK(b.backward_workspace_bytes() == a.backward_workspace_bytes());

    const PositionMap qp = a.q_positions(world.rank()), kp = a.kv_positions(world.rank());
    const std::vector<double> q = local_rows(g.q, S, H, qp), k = local_rows(g.k, S, K, kp),
                              v = local_rows(g.v, S, K, kp);
    std::vector<double> out_a(q.size()), out_b(q.size());
    std::vector<std::byte> ws(std::max(a.workspace_bytes(), b.workspace_bytes()));
    using In = TensorView<const double>;
    plain.forward<double>(a, In::bshd(q.data(), B, L, H, D), In::bshd(k.data(), B, L, K, D),
                          In::bshd(v.data(), B, L, K, D), TensorView<double>::bshd(out_a.data(), B, L, H, D), ws);
    staged.forward<double>(b, In::bshd(q.data(), B, L, H, D), In::bshd(k.data(), B, L, K, D),
                           In::bshd(v.data(), B, L, K, D), TensorView<double>::bshd(out_b.data(), B, L, H, D), {}, ws);
    CHECK(out_b == out_a);  // staging copies: the same bits

    pr.batch = 3;  // its rule, with the others', on every rank alike
    CHECK_THROWS_WITH_AS((void)staged.plan(pr, {L}), doctest::Contains("plan: StagingExchange refuses batch 3"),
                         ConfigError);
  });
}

TEST_CASE("composition: plan<T> takes the dtype from T; scatter_sequence takes mutable views") {
  run_ranks(2, [&](ThreadCommunicator& world) {
    SequenceParallelAttention<RingPolicy<>, ThreadCommunicator, ReferenceKernel> attn(world);
    const Plan plan = attn.plan<double>(AttentionProblem{.heads = 2, .head_dim = 4}, {3});
    CHECK(plan.problem().dtype == DType::f64);
    CHECK(plan.acc_bytes() == 8);
  });
  std::vector<float> global{1, 2, 3, 4}, local(2);
  scatter_sequence(TensorView<float>::bshd(global.data(), 1, 4, 1, 1), PositionMap::run(2, 1),
                   TensorView<float>::bshd(local.data(), 1, 2, 1, 1));
  CHECK(local == std::vector<float>{2, 3});
}
