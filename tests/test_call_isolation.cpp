// Calls never mix their messages, and a rank whose call failed part-way refuses further calls
// (ThreadCommunicator; the MPI side is in tests/mpi and tests/mpi_faults):
//  - a rank that catches its kernel's exception in the middle of backward and calls forward
//    again gets the failure latch's CommError at once, and its peers, still inside backward,
//    are woken with CommAborted: no rank returns the data of another call (Ring over Stripe,
//    Ulysses, Unified 2 x 2, and a decode step);
//  - a rank function that catches such an error and returns wakes its peers too;
//  - an exchange refuses a message whose call tag is not its own, and delivers nothing;
//  - a local argument error in forward or backward latches nothing: the next valid call on
//    every rank matches the exact reference (calls are transactional);
//  - the latch is shared by copies and splits, and a time-out sets it;
//  - a user communicator with neither tags nor latch still runs every policy exactly;
//  - with SEQPAR_CHECK_CALLS=1, ranks that pass different plans (of equal message sizes),
//    make different passes, call two objects in different orders, are in plan() against a
//    call, or one of which refused its arguments, all refuse the call before any message,
//    latch nothing, and the next matched call is exact; plans made alike by two plan() calls
//    are interchangeable; any value but 0 and 1 is refused, quoting it.
// Every run has a time-out, so a regression fails instead of hanging.

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support/backward_check.hpp"
#include "support/decode_check.hpp"
#include "support/fault_kernel.hpp"
#include "support/rank_outcomes.hpp"
#include "support/scoped_env.hpp"

using namespace seqpar;
using std::chrono::milliseconds;

namespace {

using Clock = std::chrono::steady_clock;
using test::describe;
using test::rank_outcomes;
/// CpuFlashKernel whose next backward call throws when asked to.
using BackwardFaultKernel = test::BackwardFaultKernel<CpuFlashKernel>;

/// The shape of the fault runs: 4 ranks of 8 tokens, GQA, causal (every ring step computes
/// on some rank, and Stripe gives every rank work in every step).
test::GlobalShape fault_shape() { return test::make_case(32, 4, 2, 16, true, 3); }

/// One rank's tensors for forward and backward of `plan` (inputs from g, as float).
struct RankTensors {
  test::LocalSlices<float> x;
  std::vector<float> dout, dq, dk, dv;
  std::vector<float> lse;
  std::vector<std::byte> ws;
  std::int64_t B = 0, H = 0, K = 0, D = 0;

  RankTensors(const test::GlobalInputs& g, const Plan& plan, int w)
      : x(test::local_slices<float>(g, plan.q_positions(w), plan.kv_positions(w))) {
    const auto& s = g.shape;
    B = s.batch, H = s.heads, K = s.kv_head_count(), D = s.head_dim;
    dout = test::take_rows<float>(g.dout, B, s.seq_q, H, D, plan.q_positions(w));
    dq.assign(x.q.size(), 777.f);
    dk.assign(x.k.size(), 777.f);
    dv.assign(x.v.size(), 777.f);
    lse.assign(static_cast<std::size_t>(B * x.lq * H), 0.f);
    ws.resize(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
  }
  using CV = TensorView<const float>;
  using MV = TensorView<float>;
  CV q() const { return CV::bshd(x.q.data(), B, x.lq, H, D); }
  CV k() const { return CV::bshd(x.k.data(), B, x.lkv, K, D); }
  CV v() const { return CV::bshd(x.v.data(), B, x.lkv, K, D); }
  MV out() { return MV::bshd(x.out.data(), B, x.lq, H, D); }
  MV lse_view() { return MV::lse_bhs(lse.data(), B, x.lq, H); }

  /// forward of `attn` with these tensors (`out_rows`: the output view's rows, to misuse it).
  template <class Attn>
  void forward(Attn& attn, const Plan& plan, std::int64_t out_rows = -1) {
    attn.template forward<float>(plan, q(), k(), v(), MV::bshd(x.out.data(), B, out_rows < 0 ? x.lq : out_rows, H, D),
                                 lse_view(), ws);
  }
  /// backward of `attn` with these tensors (`dq_rows`: the dq view's rows, to misuse it).
  template <class Attn>
  void backward(Attn& attn, const Plan& plan, std::int64_t dq_rows = -1) {
    attn.template backward<float>(plan, CV::bshd(dout.data(), B, x.lq, H, D), q(), k(), v(),
                                  CV::bshd(x.out.data(), B, x.lq, H, D), lse_view(),
                                  MV::bshd(dq.data(), B, dq_rows < 0 ? x.lq : dq_rows, H, D),
                                  MV::bshd(dk.data(), B, x.lkv, K, D), MV::bshd(dv.data(), B, x.lkv, K, D), ws);
  }
};

/// How one rank of a fault run went: what it returned after the failure (it must be nothing).
struct AfterFault {
  std::atomic<int> calls_returned{0};  ///< calls that returned on any rank after the fault began
};

/// Forward on every rank, then backward, in which rank `failing`'s kernel throws; that rank
/// catches the fault and calls forward again. Returns how each rank ended.
template <class Policy>
std::vector<test::RankOutcome> catch_and_call_again(Policy policy, int failing, AfterFault& after,
                                                    std::string& caught) {
  const test::GlobalShape c = fault_shape();
  const auto g = test::make_inputs<float>(c);
  return rank_outcomes(4, [&](ThreadCommunicator& comm) {
    SequenceParallelAttention<Policy, ThreadCommunicator, BackwardFaultKernel> attn(comm, policy);
    const int w = comm.rank();
    const Plan plan = attn.plan(c.problem<float>(true), {8, -1});
    RankTensors t(g, plan, w);
    t.forward(attn, plan);
    attn.kernel().fail_backward = w == failing;
    try {
      t.backward(attn, plan);
    } catch (const std::runtime_error& e) {
      if (w != failing || dynamic_cast<const Error*>(&e)) throw;  // only the kernel's own fault is caught
      caught = e.what();
      t.forward(attn, plan);  // goes on as if nothing happened: refused
    }
    ++after.calls_returned;   // no rank may get here: the backward of the others cannot complete
  });
}

/// Rank `failing` got the latch's refusal naming the failed backward; every other rank was
/// woken with CommAborted naming the refusal; no call returned after the fault.
void check_refused(const std::vector<test::RankOutcome>& out, int failing, const AfterFault& after,
                   const std::string& caught) {
  INFO(describe(out));
  CHECK(caught == "backward kernel fault on purpose");
  CHECK(after.calls_returned == 0);
  for (int r = 0; r < static_cast<int>(out.size()); ++r) {
    CAPTURE(r);
    if (r == failing) {
      CHECK(out[r].kind == "CommError");
      CHECK(out[r].what.find("ThreadCommunicator: ") == 0);
      CHECK(out[r].what.find(": a previous call failed part-way on this rank (an exception left backward after its "
                             "communication began): its peers are woken with CommAborted") != std::string::npos);
    } else {
      CHECK(out[r].kind == "CommAborted");
      CHECK(out[r].what.find("rank " + std::to_string(failing) + " refused ") != std::string::npos);
      CHECK(out[r].what.find("a previous call failed part-way on it") != std::string::npos);
    }
  }
}

}  // namespace

TEST_CASE("call isolation: a rank that catches its failed backward and calls again is refused, peers are woken") {
  const auto run = [](auto policy, int failing) {
    AfterFault after;
    std::string caught;
    const auto start = Clock::now();
    const auto out = catch_and_call_again(policy, failing, after, caught);
    check_refused(out, failing, after, caught);
    CHECK(Clock::now() - start < milliseconds(5000));  // woken, not timed out (10 s)
  };
  SUBCASE("Ring over Stripe") { run(RingPolicy<Stripe>{}, 1); }
  SUBCASE("Ulysses") { run(UlyssesPolicy{}, 1); }
  SUBCASE("Unified 2 x 2") { run(UnifiedPolicy<>{2, 2}, 1); }
}

TEST_CASE("call isolation: a rank function that catches a failed call and returns wakes its peers") {
  const test::GlobalShape c = fault_shape();
  const auto g = test::make_inputs<float>(c);
  std::atomic<int> returned{0};
  const auto start = Clock::now();
  const auto out = rank_outcomes(4, [&](ThreadCommunicator& comm) {
    SequenceParallelAttention<RingPolicy<Stripe>, ThreadCommunicator, BackwardFaultKernel> attn(comm);
    const Plan plan = attn.plan(c.problem<float>(true), {8, -1});
    RankTensors t(g, plan, comm.rank());
    t.forward(attn, plan);
    attn.kernel().fail_backward = comm.rank() == 2;
    try {
      t.backward(attn, plan);
      ++returned;
    } catch (const std::runtime_error& e) {
      if (comm.rank() != 2 || dynamic_cast<const Error*>(&e)) throw;
      CHECK(comm.failed());  // the engine latched it on the way out
    }
  });
  INFO(describe(out));
  CHECK(returned == 0);
  CHECK(out[2].kind == "none");
  for (int r : {0, 1, 3}) {
    CHECK(out[r].kind == "CommAborted");
    CHECK(out[r].what.find("rank 2 returned from its rank function after a call failed part-way on it (an exception "
                           "left backward after its communication began)") != std::string::npos);
  }
  CHECK(Clock::now() - start < milliseconds(5000));
}

namespace {

/// ReferenceKernel whose forward throws at a countdown: a fault in the middle of a decode step.
struct DecodeFaultKernel : ReferenceKernel {
  int* fail_at = nullptr;  ///< this rank's countdown of forward calls: throws when it reaches 0
  template <class T, class O>
  void forward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
               TensorView<acc_t<T>> lse, const KernelParams& p) {
    if (fail_at && (*fail_at)-- == 0) throw std::runtime_error("decode kernel fault on purpose");
    ReferenceKernel::forward(q, k, v, out, lse, p);
  }
};

}  // namespace

TEST_CASE("call isolation: a decode step that fails part-way latches its rank") {
  // Rank 1's kernel throws in step 1 (heads exchange: after the queries' all-to-all); it
  // catches and steps again. Its peers wait in step 1's second all-to-all.
  const test::DecodeCase dc{3, {9, 4}, 2, 2, 6, 3, DecodeExchange::heads, 3};
  const DecodeProblem pr = test::decode_problem(dc);
  const auto outcomes = rank_outcomes(dc.ranks, [&](ThreadCommunicator& world) {
    int countdown = world.rank() == 1 ? 1 : -1;
    SequenceParallelDecode<ThreadCommunicator, DecodeFaultKernel> dec(world);
    dec.kernel().fail_at = &countdown;
    DecodePlan plan = dec.plan(pr);
    const std::int64_t B = pr.batch, T = pr.new_tokens, C = plan.shard_capacity(), D = test::D;
    std::vector<float> kc(static_cast<std::size_t>(B * C * dc.kv_heads * D), 0.5f), vc(kc.size(), 0.25f);
    std::vector<float> q(static_cast<std::size_t>(B * T * plan.q_heads().count * D), 0.125f);
    std::vector<float> out(static_cast<std::size_t>(B * T * plan.out_heads().count * D));
    std::vector<std::byte> ws(plan.workspace_bytes());
    auto step = [&] {
      dec.template step<float>(plan, TensorView<const float>::bshd(q.data(), B, T, plan.q_heads().count, D),
                               TensorView<const float>::bshd(kc.data(), B, C, dc.kv_heads, D),
                               TensorView<const float>::bshd(vc.data(), B, C, dc.kv_heads, D),
                               TensorView<float>::bshd(out.data(), B, T, plan.out_heads().count, D), ws);
      plan.advance(T);
    };
    step();
    try {
      step();
    } catch (const std::runtime_error& e) {
      if (dynamic_cast<const Error*>(&e)) throw;
      step();  // refused
    }
  });
  INFO(describe(outcomes));
  CHECK(outcomes[1].kind == "CommError");
  CHECK(outcomes[1].what.find("a previous call failed part-way on this rank (an exception left a decode step after "
                              "its communication began)") != std::string::npos);
  for (int r : {0, 2}) {
    CHECK(outcomes[r].kind == "CommAborted");
    CHECK(outcomes[r].what.find("rank 1 refused all_to_all_v") != std::string::npos);
  }
}

TEST_CASE("call isolation: an exchange refuses a message of another call and delivers nothing") {
  // Same sizes, same pair, different call tags: only the tag tells them apart.
  const auto out = rank_outcomes(2, [](ThreadCommunicator& c) {
    const int peer = 1 - c.rank();
    std::int64_t mine = 100 + c.rank(), got = -1;
    const std::uint64_t tag = call_tag(CallKind::forward, c.rank() == 0 ? 5 : 4);  // rank 0 is one call ahead
    auto req = c.start_exchange(reinterpret_cast<const std::byte*>(&mine), 8, peer, reinterpret_cast<std::byte*>(&got),
                                8, peer, tag);
    if (c.rank() == 0) std::this_thread::sleep_for(milliseconds(100));  // rank 1 judges first
    try {
      c.wait(req);
    } catch (const CommError&) {
      CHECK(got == -1);  // nothing was copied
      CHECK(c.failed());
      throw;
    }
  });
  INFO(describe(out));
  CHECK(out[1].kind == "CommError");
  CHECK(out[1].what.find("ThreadCommunicator: exchange: rank 0 sent a message of another call (forward call 5) to "
                         "rank 1, which waits for one of forward call 4") != std::string::npos);
  CHECK(out[0].kind == "CommAborted");
  CHECK(out[0].what.find("a message of another call") != std::string::npos);

  // The same tag, or none on either side, delivers.
  for (const std::uint64_t tag : {call_tag(CallKind::backward, 9), untagged_exchange}) {
    CAPTURE(tag);
    std::vector<std::int64_t> got(2, -1);
    run_ranks(2, [&](ThreadCommunicator& c) {
      const int peer = 1 - c.rank();
      const std::int64_t mine = 100 + c.rank();
      auto req = tag == untagged_exchange
                     ? c.start_exchange(reinterpret_cast<const std::byte*>(&mine), 8, peer,
                                        reinterpret_cast<std::byte*>(&got[static_cast<std::size_t>(c.rank())]), 8, peer)
                     : c.start_exchange(reinterpret_cast<const std::byte*>(&mine), 8, peer,
                                        reinterpret_cast<std::byte*>(&got[static_cast<std::size_t>(c.rank())]), 8, peer,
                                        tag);
      c.wait(req);
    }, ThreadRunOptions{test::outcome_timeout});
    CHECK(got == std::vector<std::int64_t>{101, 100});
  }
}

TEST_CASE("call isolation: a local argument error latches nothing, and the next valid call matches the reference") {
  const test::GlobalShape c = fault_shape();
  const auto g = test::make_inputs<float>(c);
  const test::GlobalData want_out = test::make_global_as<float>(c);
  const test::ReferenceGrads want = test::make_global_grads(g);
  // Rank `wrong` (or every rank, with -1) first calls forward with an output view one row
  // short, then backward with a dq view one row short; each is refused by its local check
  // before any message. Ranks that did not err are already waiting in the call, which the
  // erring rank's next, valid call must meet: its call numbers did not advance.
  for (int wrong : {0, 3, -1}) {
    CAPTURE(wrong);
    std::vector<test::Errors> fwd(4);
    std::vector<test::GradErrors> bwd(4);
    std::vector<std::string> errors(4);
    run_ranks(4, [&](ThreadCommunicator& comm) {
      SequenceParallelAttention<RingPolicy<Stripe>, ThreadCommunicator, CpuFlashKernel> attn(comm);
      const int w = comm.rank();
      const Plan plan = attn.plan(c.problem<float>(true), {8, -1});
      RankTensors t(g, plan, w);
      const bool errs = wrong < 0 || w == wrong;
      if (errs) {
        try {
          t.forward(attn, plan, t.x.lq - 1);
        } catch (const ConfigError& e) {
          errors[static_cast<std::size_t>(w)] = e.what();
        }
      }
      CHECK(!comm.failed());
      t.forward(attn, plan);
      fwd[static_cast<std::size_t>(w)] = test::compare_rows(t.x.out, t.lse, want_out, plan.q_positions(w));
      if (errs) {
        try {
          t.backward(attn, plan, t.x.lq - 1);
        } catch (const ConfigError& e) {
          errors[static_cast<std::size_t>(w)] += e.what();
        }
      }
      t.backward(attn, plan);
      bwd[static_cast<std::size_t>(w)] = test::compare_grads(t.dq, t.dk, t.dv, want, c, plan.q_positions(w),
                                                            plan.kv_positions(w));
      CHECK(!comm.failed());
    }, ThreadRunOptions{test::outcome_timeout});
    for (int w = 0; w < 4; ++w) {
      CAPTURE(w);
      const bool errs = wrong < 0 || w == wrong;
      CHECK((errors[static_cast<std::size_t>(w)].find("forward: out.seq: expected 8, got 7") != std::string::npos) == errs);
      CHECK((errors[static_cast<std::size_t>(w)].find("backward: dq.seq: expected 8, got 7") != std::string::npos) == errs);
      CHECK(fwd[static_cast<std::size_t>(w)].within(1e-5));
      CHECK(bwd[static_cast<std::size_t>(w)].worst() <= 1e-4);
    }
  }
}

TEST_CASE("call isolation: the failure latch is shared by copies and splits, and a time-out sets it") {
  // fail() on a split latches the rank: the world and a copy refuse too, with the first reason.
  const auto out = rank_outcomes(2, [](ThreadCommunicator& world) {
    ThreadCommunicator half = world.split(0, world.rank());
    if (world.rank() == 0) {
      half.fail("first reason");
      half.fail("second reason");  // the first stays
      ThreadCommunicator copy = world;
      CHECK(copy.failed());
      CHECK(world.failure_reason() == "first reason");
      world.barrier();  // refused
    }
  });
  INFO(describe(out));
  CHECK(out[0].kind == "CommError");
  CHECK(out[0].what == "ThreadCommunicator: barrier: a previous call failed part-way on this rank (first reason): "
                       "its peers are woken with CommAborted; start the ranks again (a new run_ranks)");
  CHECK(out[1].kind == "none");

  // A time-out latches the rank that timed out: its next operation refuses at once.
  std::string refused;
  Clock::duration took{};
  const auto timed = rank_outcomes(
      2,
      [&](ThreadCommunicator& c) {
        if (c.rank() != 0) return;
        try {
          c.barrier();
        } catch (const CommAborted&) {
          const auto at = Clock::now();
          try {
            std::byte b[4];
            auto req = c.start_exchange(b, 4, 0, b, 4, 0);
            c.wait(req);
          } catch (const CommError& e) {
            refused = e.what();
          }
          took = Clock::now() - at;
        }
      },
      milliseconds(100));
  INFO(describe(timed));
  CHECK(refused.find("ThreadCommunicator: exchange: a previous call failed part-way on this rank (ThreadCommunicator: "
                     "barrier interrupted: time-out after 100 ms in barrier") != std::string::npos);
  CHECK(took < milliseconds(50));
}

namespace {

/// A user's communicator with neither call tags nor a failure latch: the plain concept, over
/// ThreadCommunicator (whose seven-argument start_exchange and fail() it does not show).
struct PlainComm : private ThreadCommunicator {
  static constexpr bool is_seqpar_communicator = true;  ///< opts in to the Communicator concept
  // The rest of the plain concept, as ThreadCommunicator has it.
  using ThreadCommunicator::memory_space;
  using ThreadCommunicator::request_type;
  using ThreadCommunicator::rank;
  using ThreadCommunicator::size;
  using ThreadCommunicator::all_to_all_v;
  using ThreadCommunicator::wait;
  using ThreadCommunicator::all_gather_host;
  using ThreadCommunicator::barrier;
  using ThreadCommunicator::stats;
  /// Wraps `c`.
  explicit PlainComm(ThreadCommunicator c) : ThreadCommunicator(std::move(c)) {}
  /// The untagged exchange only.
  request_type start_exchange(const std::byte* s, std::size_t sb, int dest, std::byte* r, std::size_t rb, int src) {
    return ThreadCommunicator::start_exchange(s, sb, dest, r, rb, src);
  }
  /// A PlainComm over the split.
  PlainComm split(int color, int key) { return PlainComm(ThreadCommunicator::split(color, key)); }
};
static_assert(Communicator<PlainComm>);
static_assert(!detail::has_tagged_exchange<PlainComm> && !detail::has_failure_latch<PlainComm>);
static_assert(detail::has_tagged_exchange<ThreadCommunicator> && detail::has_failure_latch<ThreadCommunicator>);

}  // namespace

TEST_CASE("call isolation: a communicator without tags or latch still runs every policy exactly") {
  const test::GlobalShape c = fault_shape();
  const auto g = test::make_inputs<float>(c);
  const test::GlobalData want_out = test::make_global_as<float>(c);
  const test::ReferenceGrads want = test::make_global_grads(g);
  const auto run = [&](auto policy) {
    using Policy = decltype(policy);
    std::vector<test::Errors> fwd(4);
    std::vector<test::GradErrors> bwd(4);
    run_ranks(4, [&](ThreadCommunicator& comm) {
      PlainComm world(comm);
      SequenceParallelAttention<Policy, PlainComm, CpuFlashKernel> attn(world, policy);
      const int w = comm.rank();
      const Plan plan = attn.plan(c.problem<float>(true), {8, -1});
      RankTensors t(g, plan, w);
      t.forward(attn, plan);
      t.backward(attn, plan);
      fwd[static_cast<std::size_t>(w)] = test::compare_rows(t.x.out, t.lse, want_out, plan.q_positions(w));
      bwd[static_cast<std::size_t>(w)] = test::compare_grads(t.dq, t.dk, t.dv, want, c, plan.q_positions(w),
                                                            plan.kv_positions(w));
    }, ThreadRunOptions{test::outcome_timeout});
    for (int w = 0; w < 4; ++w) {
      CHECK(fwd[static_cast<std::size_t>(w)].within(1e-5));
      CHECK(bwd[static_cast<std::size_t>(w)].worst() <= 1e-4);
    }
  };
  run(RingPolicy<Stripe>{});
  run(UnifiedPolicy<>{2, 2});
}

namespace {

/// How each rank's mismatched call ended, and its next (matched) call against the reference.
struct AgreementRun {
  std::vector<std::string> refused = std::vector<std::string>(4);  ///< the ConfigError each rank got ("" none)
  std::vector<test::Errors> fwd = std::vector<test::Errors>(4);     ///< the matched forward
  std::vector<test::GradErrors> bwd = std::vector<test::GradErrors>(4);  ///< the matched backward
  std::vector<int> checks = std::vector<int>(4);  ///< checks_calls() on each rank (not vector<bool>: one word per rank)
  std::vector<std::uint64_t> gathers = std::vector<std::uint64_t>(4);  ///< host gathers of the matched pair
};

/// 4 ranks under SEQPAR_CHECK_CALLS=1 make two plans, A (causal) and B (not causal: the same
/// message sizes, so without the check the call would run and return wrong rows). Then
/// `mismatched(rank, attn, a, b, tensors)` makes each rank's first call (it may throw
/// ConfigError), and every rank calls forward and backward with plan A, which must be exact.
template <class Policy, class Mismatch>
AgreementRun run_agreement(Policy policy, Mismatch&& mismatched) {
  const test::GlobalShape c = fault_shape();
  const auto g = test::make_inputs<float>(c);
  const test::GlobalData want_out = test::make_global_as<float>(c);
  const test::ReferenceGrads want = test::make_global_grads(g);
  AgreementRun r;
  const test::ScopedEnv on(check_calls_env, "1");
  run_ranks(4, [&](ThreadCommunicator& comm) {
    SequenceParallelAttention<Policy, ThreadCommunicator, CpuFlashKernel> attn(comm, policy);
    const int w = comm.rank();
    const auto u = static_cast<std::size_t>(w);
    const Plan a = attn.plan(c.problem<float>(true), {8, -1});
    AttentionProblem not_causal = c.problem<float>(true);
    not_causal.causal = false;
    const Plan b = attn.plan(not_causal, {8, -1});
    RankTensors t(g, a, w);
    r.checks[u] = attn.checks_calls();
    try {
      mismatched(w, attn, a, b, t);
    } catch (const ConfigError& e) {
      r.refused[u] = e.what();
    }
    CHECK(!comm.failed());
    const std::uint64_t before = comm.stats().host_gathers;
    t.forward(attn, a);
    t.backward(attn, a);
    r.gathers[u] = comm.stats().host_gathers - before;
    r.fwd[u] = test::compare_rows(t.x.out, t.lse, want_out, a.q_positions(w));
    r.bwd[u] = test::compare_grads(t.dq, t.dk, t.dv, want, c, a.q_positions(w), a.kv_positions(w));
  }, ThreadRunOptions{test::outcome_timeout});
  return r;
}

/// Every rank's matched calls were exact, each agreed in one host gather, and rank w's
/// refusal contains `expect(w)` ("" for: no refusal).
template <class Expect>
void check_agreement(const AgreementRun& r, Expect&& expect) {
  for (int w = 0; w < 4; ++w) {
    const auto u = static_cast<std::size_t>(w);
    CAPTURE(w);
    CAPTURE(r.refused[u]);
    CHECK(r.checks[u]);
    const std::string want = expect(w);
    CHECK((want.empty() ? r.refused[u].empty() : r.refused[u].find(want) != std::string::npos));
    CHECK(r.gathers[u] == 2);  // one per call: forward, backward
    CHECK(r.fwd[u].within(1e-5));
    CHECK(r.bwd[u].worst() <= 1e-4);
  }
}

}  // namespace

TEST_CASE("call agreement: ranks that pass different plans all refuse the call before any message") {
  const auto run = [](auto policy) {
    const AgreementRun r = run_agreement(policy, [](int w, auto& attn, const Plan& a, const Plan& b, RankTensors& t) {
      t.forward(attn, w == 2 ? b : a);
    });
    check_agreement(r, [](int) {
      return std::string("forward: ranks pass different plans (SEQPAR_CHECK_CALLS): rank(s) 2 pass a plan other "
                         "than rank(s) 0, 1, 3");
    });
  };
  SUBCASE("Ulysses") { run(UlyssesPolicy{}); }
  SUBCASE("Ring over Zigzag") { run(RingPolicy<Zigzag>{}); }
}

TEST_CASE("call agreement: plans that two plan() calls made alike are interchangeable") {
  const test::GlobalShape c = fault_shape();
  const AgreementRun r = run_agreement(UnifiedPolicy<>{2, 2}, [&](int w, auto& attn, const Plan& a, const Plan&,
                                                                  RankTensors& t) {
    const Plan again = attn.plan(c.problem<float>(true), {8, -1});
    t.forward(attn, w == 1 ? again : a);
  });
  check_agreement(r, [](int) { return std::string(); });
}

TEST_CASE("call agreement: ranks making different passes all refuse the call") {
  const AgreementRun r = run_agreement(RingPolicy<Stripe>{}, [](int w, auto& attn, const Plan& a, const Plan&,
                                                               RankTensors& t) {
    t.forward(attn, a);
    if (w == 3) t.forward(attn, a);  // the others go on to backward
    else t.backward(attn, a);
  });
  check_agreement(r, [](int w) {
    return std::string(w == 3 ? "forward" : "backward") +
           ": ranks disagree on the call (SEQPAR_CHECK_CALLS): rank(s) 0, 1, 2 call backward, rank(s) 3 call forward";
  });
}

TEST_CASE("call agreement: one rank's refused arguments are every rank's refusal, with no wait") {
  const auto start = Clock::now();
  const AgreementRun r = run_agreement(UlyssesPolicy{}, [](int w, auto& attn, const Plan& a, const Plan&,
                                                           RankTensors& t) {
    t.forward(attn, a, w == 1 ? t.x.lq - 1 : -1);
  });
  check_agreement(r, [](int w) {
    return w == 1 ? std::string("forward: out.seq: expected 8, got 7")
                  : std::string("forward: rank(s) 1 refused their arguments (their ConfigError says why), so every "
                                "rank refuses this call (SEQPAR_CHECK_CALLS)");
  });
  CHECK(Clock::now() - start < milliseconds(5000));  // no rank waited for a time-out
}

TEST_CASE("call agreement: SEQPAR_CHECK_CALLS other than 0 or 1 is refused by every rank; unset or 0 is off") {
  for (const char* value : {"yes", "2", "0", ""}) {
    CAPTURE(value);
    const test::ScopedEnv env(check_calls_env, value);
    const bool bad = std::string(value) != "0" && *value != '\0';
    const auto out = rank_outcomes(3, [&](ThreadCommunicator& comm) {
      SequenceParallelAttention<UlyssesPolicy, ThreadCommunicator, CpuFlashKernel> attn(comm);
      CHECK(!attn.checks_calls());
    });
    for (const auto& o : out) {
      CHECK(o.kind == (bad ? "ConfigError" : "none"));
      if (bad) CHECK(o.what.find("SequenceParallelAttention: SEQPAR_CHECK_CALLS: expected 1 (on), 0 or nothing "
                                 "(off); rank(s) 0, 1, 2 have another value (this rank: \"" + std::string(value) +
                                 "\")") == 0);
    }
  }
}

TEST_CASE("call agreement: a rank in plan() while the others are in a call: every rank refuses, none hangs") {
  const test::GlobalShape c = fault_shape();
  const AgreementRun r = run_agreement(RingPolicy<Zigzag>{}, [&](int w, auto& attn, const Plan& a, const Plan&,
                                                               RankTensors& t) {
    if (w == 1) (void)attn.plan(c.problem<float>(true), {8, -1});
    else t.forward(attn, a);
  });
  check_agreement(r, [](int w) {
    return w == 1 ? std::string("plan: rank(s) 0, 2, 3 are in a forward or backward (as SEQPAR_CHECK_CALLS shows)")
                  : std::string("forward: rank(s) 1 are in plan() (as SEQPAR_CHECK_CALLS shows): every rank must "
                                "make an object's calls in the same order");
  });
}

TEST_CASE("call agreement: ranks that call two objects in different orders all refuse, then run in order exactly") {
  const test::GlobalShape c = fault_shape();
  const auto g = test::make_inputs<float>(c);
  const test::GlobalData want_out = test::make_global_as<float>(c);
  std::vector<std::string> refused(4);
  std::vector<test::Errors> fwd(8);
  const test::ScopedEnv on(check_calls_env, "1");
  run_ranks(4, [&](ThreadCommunicator& comm) {
    // Two objects of one policy on one communicator, plans of one problem: equal fingerprints.
    SequenceParallelAttention<UlyssesPolicy, ThreadCommunicator, CpuFlashKernel> x(comm), y(comm);
    const int w = comm.rank();
    const Plan px = x.plan(c.problem<float>(true), {8, -1}), py = y.plan(c.problem<float>(true), {8, -1});
    RankTensors t(g, px, w);
    try {
      if (w == 0) t.forward(x, px);  // rank 0 calls x first, the others y
      else t.forward(y, py);
    } catch (const ConfigError& e) {
      refused[static_cast<std::size_t>(w)] = e.what();
    }
    CHECK(!comm.failed());
    t.forward(x, px);
    fwd[static_cast<std::size_t>(2 * w)] = test::compare_rows(t.x.out, t.lse, want_out, px.q_positions(w));
    t.forward(y, py);
    fwd[static_cast<std::size_t>(2 * w + 1)] = test::compare_rows(t.x.out, t.lse, want_out, py.q_positions(w));
  }, ThreadRunOptions{test::outcome_timeout});
  for (int w = 0; w < 4; ++w) {
    CAPTURE(w);
    CHECK(refused[static_cast<std::size_t>(w)].find(
              "forward: ranks call different objects (SEQPAR_CHECK_CALLS): rank(s) 1, 2, 3 call another "
              "SequenceParallelAttention than rank(s) 0") == 0);
    CHECK(fwd[static_cast<std::size_t>(2 * w)].within(1e-5));
    CHECK(fwd[static_cast<std::size_t>(2 * w + 1)].within(1e-5));
  }
}
