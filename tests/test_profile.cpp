// PhaseProfile: a forward and backward with a profile set report every phase they ran, the
// phases add up to about the call's total, and the results are bit-identical with the
// profile on and off. Progress polls: on a communicator with test() the ring computes in
// chunks of heads with a poll between them, and gets the same bits as in one call.
#include <doctest/doctest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "support/attention_check.hpp"

using namespace seqpar;
using namespace seqpar::test;

namespace {

/// One rank's outputs of a forward and a backward.
struct Outputs {
  std::vector<float> out, lse, dq, dk, dv;
  bool operator==(const Outputs& o) const {
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    };
    return same(out, o.out) && same(lse, o.lse) && same(dq, o.dq) && same(dk, o.dk) && same(dv, o.dv);
  }
};

/// ThreadCommunicator with a test() that never finishes an exchange early (wait() does), so
/// the engine polls after every chunk of heads; counts the polls of all its copies.
class PollingCommunicator : public ThreadCommunicator {
 public:
  PollingCommunicator(const ThreadCommunicator& c, std::shared_ptr<std::atomic<int>> polls)
      : ThreadCommunicator(c), polls_(std::move(polls)) {}
  PollingCommunicator split(int color, int key) { return {ThreadCommunicator::split(color, key), polls_}; }
  bool test(request_type&) {
    ++*polls_;
    return false;
  }

 private:
  std::shared_ptr<std::atomic<int>> polls_;
};
static_assert(Communicator<PollingCommunicator>);

/// Runs forward then backward of `policy` on `ranks` threads (as Comm), twice: without a
/// profile, then with one. Returns each rank's outputs of both runs and its profile, and the
/// number of progress polls.
template <class Policy, class Comm = ThreadCommunicator>
int run_twice(int ranks, Policy policy, const GlobalShape& c, std::vector<Outputs>& plain,
              std::vector<Outputs>& profiled, std::vector<PhaseProfile>& profiles) {
  auto polls = std::make_shared<std::atomic<int>>(0);
  const GlobalInputs g = make_inputs(c);
  plain.assign(static_cast<std::size_t>(ranks), {});
  profiled.assign(static_cast<std::size_t>(ranks), {});
  profiles.assign(static_cast<std::size_t>(ranks), {});
  const std::int64_t B = c.batch, H = c.heads, K = c.kv_heads, D = c.head_dim;
  run_ranks(ranks, [&](ThreadCommunicator& thread_comm) {
    Comm comm = [&] {
      if constexpr (std::is_same_v<Comm, ThreadCommunicator>) return thread_comm;
      else return Comm(thread_comm, polls);
    }();
    const auto w = static_cast<std::size_t>(comm.rank());
    SequenceParallelAttention<Policy, Comm, CpuFlashKernel> attn(comm, policy);
    const Plan plan = attn.plan(c.problem<float>(true), {split_sequence(c.seq_q, attn.mesh())[w]});
    const PositionMap qp = plan.q_positions(comm.rank()), kp = plan.kv_positions(comm.rank());
    const std::int64_t lq = qp.size(), lk = kp.size();
    const LocalSlices<float> x = local_slices<float>(g, qp, kp);
    const auto& q = x.q;
    const auto& k = x.k;
    const auto& v = x.v;
    const auto dout = take_rows<float>(g.q, B, c.seq_q, H, D, qp);
    std::vector<std::byte> ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
    using CV = TensorView<const float>;
    using V = TensorView<float>;
    auto run = [&](Outputs& o) {
      o.out.assign(q.size(), 0.f);
      o.lse.assign(static_cast<std::size_t>(B * lq * H), 0.f);
      o.dq.assign(q.size(), 0.f);
      o.dk.assign(k.size(), 0.f);
      o.dv.assign(v.size(), 0.f);
      const auto lse = V::lse_bhs(o.lse.data(), B, lq, H);
      attn.template forward<float>(plan, CV::bshd(q.data(), B, lq, H, D), CV::bshd(k.data(), B, lk, K, D),
                                   CV::bshd(v.data(), B, lk, K, D), V::bshd(o.out.data(), B, lq, H, D), lse, ws);
      attn.template backward<float>(plan, CV::bshd(dout.data(), B, lq, H, D), CV::bshd(q.data(), B, lq, H, D),
                                    CV::bshd(k.data(), B, lk, K, D), CV::bshd(v.data(), B, lk, K, D),
                                    CV::bshd(o.out.data(), B, lq, H, D), lse, V::bshd(o.dq.data(), B, lq, H, D),
                                    V::bshd(o.dk.data(), B, lk, K, D), V::bshd(o.dv.data(), B, lk, K, D), ws);
    };
    run(plain[w]);
    attn.set_profile(&profiles[w]);
    run(profiled[w]);
    attn.set_profile(nullptr);
    run(plain[w]);  // off again: records nothing more
  });
  return polls->load();
}

/// The checks every profiled rank must pass: one call of each pass, the phases that ran took
/// time, and together they make up the call's total.
void check_profile(const PhaseProfile& p, bool ulysses, int ring) {
  for (Pass pass : {Pass::forward, Pass::backward}) {
    CAPTURE(static_cast<int>(pass));
    CHECK(p.calls(pass) == 1);
    CHECK(p.steps(pass) == ring);
    const double total = p.total_ms(pass), phases = p.phases_ms(pass);
    CHECK(total > 0);
    // What is not a phase is argument checks and carving the workspace: microseconds.
    CHECK(phases <= total);
    CHECK(phases >= 0.9 * total);
    CHECK(p.ms(pass, Phase::pack) > 0);
    CHECK(p.ms(pass, Phase::compute) > 0);
    for (int s = 0; s < ring; ++s) CHECK(p.ms(pass, Phase::compute, s) > 0);
    CHECK((p.ms(pass, Phase::all_to_all_in) > 0) == ulysses);
    CHECK((p.ms(pass, Phase::all_to_all_out) > 0) == ulysses);
    CHECK((p.ms(pass, Phase::unpack) > 0) == ulysses);
    if (ring > 1) {
      CHECK(p.ms(pass, Phase::merge) > 0);
      CHECK(p.ms(pass, Phase::wait) > 0);
      for (int s = 0; s + 1 < ring; ++s) CHECK(p.hop_ms(pass, s) > 0);
      CHECK(p.hidden_share(pass) >= 0.0);
      CHECK(p.hidden_share(pass) <= 1.0);
    } else {
      CHECK(p.hidden_share(pass) == 0.0);
    }
  }
}

}  // namespace

TEST_CASE("profile: a 2x2 mesh reports every phase, and profiling changes no bit") {
  const GlobalShape c = make_case(256, 4, 2, 32, true, 7);
  std::vector<Outputs> plain, profiled;
  std::vector<PhaseProfile> profiles;
  run_twice(4, UnifiedPolicy<Zigzag>{2, 2}, c, plain, profiled, profiles);
  for (std::size_t w = 0; w < profiles.size(); ++w) {
    CAPTURE(w);
    CHECK(plain[w] == profiled[w]);
    check_profile(profiles[w], true, 2);
  }
}

TEST_CASE("profile: Ulysses and Ring alone report their own phases") {
  const GlobalShape c = make_case(192, 4, 4, 16, false, 8);
  std::vector<Outputs> plain, profiled;
  std::vector<PhaseProfile> profiles;
  run_twice(2, UlyssesPolicy{}, c, plain, profiled, profiles);
  for (std::size_t w = 0; w < profiles.size(); ++w) {
    CHECK(plain[w] == profiled[w]);
    check_profile(profiles[w], true, 1);
  }
  run_twice(3, RingPolicy<Contiguous>{}, c, plain, profiled, profiles);
  for (std::size_t w = 0; w < profiles.size(); ++w) {
    CHECK(plain[w] == profiled[w]);
    check_profile(profiles[w], false, 3);
  }
}

TEST_CASE("profile: reset forgets, and steps past max_steps add into the last slot") {
  PhaseProfile p;
  p.add(Pass::forward, Phase::compute, 0, 1.0);
  p.add(Pass::forward, Phase::compute, PhaseProfile::max_steps + 5, 2.0);
  p.add(Pass::forward, Phase::wait, PhaseProfile::max_steps - 1, 0.5);
  p.add_hop(Pass::forward, 0, 4.0);
  p.add_call(Pass::forward, 4.0);
  CHECK(p.steps(Pass::forward) == PhaseProfile::max_steps);
  CHECK(p.ms(Pass::forward, Phase::compute) == 3.0);
  CHECK(p.ms(Pass::forward, Phase::compute, PhaseProfile::max_steps - 1) == 2.0);
  CHECK(p.phases_ms(Pass::forward) == 3.5);
  CHECK(p.hidden_share(Pass::forward) == doctest::Approx(0.875));
  CHECK(p.calls(Pass::backward) == 0);
  p.reset();
  CHECK(p.calls(Pass::forward) == 0);
  CHECK(p.phases_ms(Pass::forward) == 0.0);
  CHECK(std::string(phase_name(Phase::all_to_all_in)) == "a2a_in");
}

TEST_CASE("progress polls: chunked ring compute gives the same bits as one kernel call") {
  // GQA with a Ulysses group: chunks of K/V heads carry their query heads in backward.
  const GlobalShape c = make_case(128, 8, 4, 16, true, 9);
  std::vector<Outputs> plain, profiled, polled, polled_profiled;
  std::vector<PhaseProfile> profiles;
  run_twice(4, UnifiedPolicy<Zigzag>{2, 2}, c, plain, profiled, profiles);
  const int polls = run_twice<UnifiedPolicy<Zigzag>, PollingCommunicator>(4, UnifiedPolicy<Zigzag>{2, 2}, c, polled,
                                                                          polled_profiled, profiles);
  CHECK(polls > 0);
  for (std::size_t w = 0; w < plain.size(); ++w) {
    CAPTURE(w);
    CHECK(plain[w] == polled[w]);
    CHECK(plain[w] == polled_profiled[w]);
    check_profile(profiles[w], true, 2);
  }
}
