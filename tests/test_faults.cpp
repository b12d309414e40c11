// Faults on ThreadCommunicator: a rank that throws wakes every peer blocked in any operation
// (all_to_all_v, exchange, barrier, all_gather_host, also inside split groups) with
// CommAborted naming the failure, and run_ranks rethrows the original exception; the optional
// time-out turns a peer that never arrives into a CommError; mismatched sizes are CommErrors
// on both sides. Every run is bounded by a time-out, so a regression fails instead of hanging.

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support/attention_check.hpp"
#include "support/rank_outcomes.hpp"

using namespace seqpar;
using test::describe;
using test::rank_outcomes;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

using Comm = ThreadCommunicator;

/// The operations a rank can block in, each called the same way on every rank.
enum class Op { all_to_all_v, exchange, barrier, all_gather_host };

const char* op_name(Op op) {
  switch (op) {
    case Op::all_to_all_v: return "all_to_all_v";
    case Op::exchange: return "exchange";
    case Op::barrier: return "barrier";
    case Op::all_gather_host: return "all_gather_host";
  }
  return "?";
}

/// Runs `op` once on `c` with small, consistent sizes.
void call(Comm& c, Op op) {
  const auto n = static_cast<std::size_t>(c.size());
  std::vector<std::byte> send(4 * n, std::byte{1}), recv(4 * n);
  std::vector<std::size_t> counts(n, 4), displs(n);
  for (std::size_t j = 0; j < n; ++j) displs[j] = 4 * j;
  switch (op) {
    case Op::all_to_all_v:
      c.all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs);
      break;
    case Op::exchange: {
      auto req = c.start_exchange(send.data(), 4, (c.rank() + 1) % c.size(), recv.data(), 4,
                                  (c.rank() + c.size() - 1) % c.size());
      c.wait(req);
      break;
    }
    case Op::barrier:
      c.barrier();
      break;
    case Op::all_gather_host: {
      const std::int64_t mine[2] = {c.rank(), 7};
      std::vector<std::int64_t> all(2 * n);
      c.all_gather_host(mine, all);
      break;
    }
  }
}

constexpr Op all_ops[] = {Op::all_to_all_v, Op::exchange, Op::barrier, Op::all_gather_host};

}  // namespace

TEST_CASE("faults: a rank that throws wakes the peers blocked in every operation") {
  for (Op op : all_ops) {
    // delay 0: the peers find the world already failed; delay 50 ms: they are blocked first.
    for (int delay_ms : {0, 50}) {
      CAPTURE(op_name(op));
      CAPTURE(delay_ms);
      const auto start = Clock::now();
      const auto out = rank_outcomes(3, [&](Comm& c) {
        if (c.rank() == 0) {
          std::this_thread::sleep_for(milliseconds(delay_ms));
          throw std::runtime_error("boom on purpose");
        }
        call(c, op);
      });
      INFO(describe(out));
      CHECK(out[0].kind == "other");
      for (int r : {1, 2}) {
        CHECK(out[r].kind == "CommAborted");
        CHECK(out[r].what.find("rank 0 failed: boom on purpose") != std::string::npos);
      }
      // Woken by the failure, not by the 10 s time-out of rank_outcomes.
      CHECK(Clock::now() - start < milliseconds(5000));
    }
  }
}

TEST_CASE("faults: run_ranks rethrows the original exception, not the CommAborted it caused") {
  for (Op op : all_ops) {
    CAPTURE(op_name(op));
    CHECK_THROWS_WITH_AS(run_ranks(
                             4,
                             [&](Comm& c) {
                               if (c.rank() == 2) throw std::logic_error("rank 2 gave up");
                               call(c, op);
                             },
                             ThreadRunOptions{test::outcome_timeout}),
                         "rank 2 gave up", std::logic_error);
  }
}

TEST_CASE("faults: a failure wakes ranks blocked in split groups") {
  // Groups {0, 1} and {2, 3}. Rank 0 fails late: rank 1 is blocked in its group's barrier,
  // ranks 2 and 3 finish theirs and then block in a world barrier. All three are woken.
  const auto out = rank_outcomes(4, [](Comm& c) {
    Comm g = c.split(c.rank() / 2, c.rank());
    if (c.rank() == 0) {
      std::this_thread::sleep_for(milliseconds(30));
      throw std::runtime_error("group failure");
    }
    g.barrier();
    if (c.rank() >= 2) c.barrier();
  });
  INFO(describe(out));
  CHECK(out[0].kind == "other");
  for (int r : {1, 2, 3}) {
    CHECK(out[r].kind == "CommAborted");
    CHECK(out[r].what.find("rank 0 failed: group failure") != std::string::npos);
  }
  CHECK(out[1].what.find("barrier interrupted") != std::string::npos);
}

TEST_CASE("faults: the time-out turns a peer that never arrives into a CommError") {
  for (Op op : all_ops) {
    CAPTURE(op_name(op));
    const auto start = Clock::now();
    // Rank 1 returns without calling the operation: nobody fails, rank 0 would wait forever.
    const auto out = rank_outcomes(
        2,
        [&](Comm& c) {
          if (c.rank() == 0) call(c, op);
        },
        milliseconds(200));
    const auto took = Clock::now() - start;
    INFO(describe(out));
    CHECK(out[0].kind == "CommAborted");  // a CommError: the time-out is a communicator failure
    CHECK(out[0].what.find("time-out after 200 ms in " + std::string(op_name(op))) != std::string::npos);
    CHECK(out[1].kind == "none");
    CHECK(took >= milliseconds(200));
    CHECK(took < milliseconds(5000));
  }
  // run_ranks reports it as a CommError.
  CHECK_THROWS_AS(run_ranks(
                      2, [](Comm& c) { if (c.rank() == 0) c.barrier(); }, ThreadRunOptions{milliseconds(100)}),
                  CommError);
}

TEST_CASE("faults: a slow peer within the time-out, or with none, is not a failure") {
  for (Op op : all_ops) {
    CAPTURE(op_name(op));
    auto slow = [&](Comm& c) {
      if (c.rank() == 1) std::this_thread::sleep_for(milliseconds(150));
      call(c, op);
    };
    const auto bounded = rank_outcomes(3, slow, milliseconds(5000));
    INFO(describe(bounded));
    for (const auto& o : bounded) CHECK(o.kind == "none");
    CHECK_NOTHROW(run_ranks(3, slow));  // no time-out: waits as long as it takes
  }
}

TEST_CASE("faults: sizes the two sides disagree on are CommErrors, not corruption") {
  // all_to_all_v: rank 1 sends 8 bytes to rank 0, which expects 4.
  const auto a2a = rank_outcomes(2, [](Comm& c) {
    std::vector<std::byte> send(16), recv(16);
    std::vector<std::size_t> sc{4, 4}, rc{4, 4}, d{0, 8};
    if (c.rank() == 1) sc[0] = 8;
    c.all_to_all_v(send.data(), sc, d, recv.data(), rc, d);
  });
  INFO(describe(a2a));
  CHECK(a2a[0].kind == "CommError");
  CHECK(a2a[0].what.find("rank 1 sends 8 bytes to rank 0, which expects 4") != std::string::npos);
  CHECK((a2a[1].kind == "CommAborted" || a2a[1].kind == "CommError"));

  // exchange: rank 0 sends 12 bytes, rank 1 expects 8.
  const auto ex = rank_outcomes(2, [](Comm& c) {
    std::vector<std::byte> send(16), recv(16);
    const int peer = 1 - c.rank();
    auto req = c.start_exchange(send.data(), c.rank() == 0 ? 12 : 8, peer, recv.data(), 8, peer);
    c.wait(req);
  });
  INFO(describe(ex));
  CHECK(ex[1].kind == "CommError");
  CHECK(ex[1].what.find("rank 0 sent 12 bytes to rank 1, which expects 8") != std::string::npos);
  CHECK(ex[0].kind == "CommAborted");

  // all_gather_host: different counts.
  const auto ag = rank_outcomes(3, [](Comm& c) {
    const std::vector<std::int64_t> mine(c.rank() == 2 ? 3 : 2, 1);
    std::vector<std::int64_t> all(mine.size() * 3);
    c.all_gather_host(mine, all);
  });
  INFO(describe(ag));
  // The rank that checks first throws CommError; the others are woken with CommAborted (also
  // a CommError) carrying the same explanation.
  int first = 0;
  for (const auto& o : ag) {
    first += o.kind == "CommError";
    CHECK((o.kind == "CommError" || o.kind == "CommAborted"));
    CHECK(o.what.find("integers, rank ") != std::string::npos);
  }
  CHECK(first >= 1);

  // A rank outside the group.
  const auto bad_rank = rank_outcomes(1, [](Comm& c) {
    std::byte b[4];
    (void)c.start_exchange(b, 4, 1, b, 4, 0);
  });
  INFO(describe(bad_rank));
  CHECK(bad_rank[0].kind == "ConfigError");
  CHECK(bad_rank[0].what.find("dest: expected a rank in [0, 1), got 1") != std::string::npos);
}

namespace {

/// CpuFlashKernel that throws on demand: a fault in the middle of a forward call.
struct FailingKernel : CpuFlashKernel {
  int fail_on_call = -1;  ///< the local forward call (0-based) that throws; -1: none
  int calls = 0;          ///< local forward calls so far
  template <class T, class O>
  void forward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
               TensorView<acc_t<T>> lse, const KernelParams& p) {
    if (calls++ == fail_on_call) throw std::runtime_error("kernel fault on purpose");
    CpuFlashKernel::forward(q, k, v, out, lse, p);
  }
};

/// The case the kernel-fault tests run: 4 ranks of 6 tokens, GQA.
test::GlobalShape fault_case() { return test::make_case(24, 4, 2, 16, false, 1); }

/// One forward of `policy` on 4 ranks whose rank `failing` throws in its local kernel call
/// number `fail_on_call`; returns how each rank ended. The workspace and the local tensors
/// are locals of the rank function, so the failing rank frees them while it unwinds.
template <class Policy>
std::vector<test::RankOutcome> forward_with_kernel_fault(Policy policy, int failing, int fail_on_call) {
  const test::GlobalShape c = fault_case();
  const auto g = test::make_inputs<float>(c);
  return rank_outcomes(4, [&](Comm& comm) {
    SequenceParallelAttention<Policy, Comm, FailingKernel> attn(comm, policy);
    const Plan plan = attn.plan(c.problem<float>(), {6, -1});
    attn.kernel().fail_on_call = comm.rank() == failing ? fail_on_call : -1;
    auto q = test::take_rows<float>(g.q, 1, c.seq_q, c.heads, c.head_dim, plan.q_positions(comm.rank()));
    auto k = test::take_rows<float>(g.k, 1, c.seq_q, c.kv_heads, c.head_dim, plan.kv_positions(comm.rank()));
    std::vector<float> o(q.size());
    std::vector<std::byte> ws(plan.workspace_bytes());
    using CV = TensorView<const float>;
    attn.template forward<float>(plan, CV::bshd(q.data(), 1, 6, c.heads, c.head_dim),
                                 CV::bshd(k.data(), 1, 6, c.kv_heads, c.head_dim),
                                 CV::bshd(k.data(), 1, 6, c.kv_heads, c.head_dim),
                                 TensorView<float>::bshd(o.data(), 1, 6, c.heads, c.head_dim), ws);
  });
}

/// Rank `failing` ended with the kernel fault; every other rank was woken with CommAborted
/// naming it.
void check_kernel_fault(const std::vector<test::RankOutcome>& out, int failing) {
  INFO(describe(out));
  for (int r = 0; r < static_cast<int>(out.size()); ++r) {
    if (r == failing) {
      CHECK(out[r].kind == "other");
      CHECK(out[r].what == "kernel fault on purpose");
    } else {
      CHECK(out[r].kind == "CommAborted");
      CHECK(out[r].what.find("rank " + std::to_string(failing) + " failed: kernel fault on purpose") !=
            std::string::npos);
    }
  }
}

}  // namespace

TEST_CASE("faults: a kernel that throws on one rank mid-forward fails the call on every rank") {
  // Ulysses: the faulty rank throws after the first all-to-all; the others block in the
  // all-to-all that brings the output back and are woken.
  check_kernel_fault(forward_with_kernel_fault(UlyssesPolicy{}, 3, 0), 3);
  // The same communicators' world is not reused after a failure: a fresh run_ranks works.
  CHECK(test::run_policy<float>(4, UlyssesPolicy{}, test::make_global_as<float>(fault_case())).err.within(1e-5));
}

TEST_CASE("faults: a kernel that throws mid-ring frees nothing a peer still copies") {
  // The faulty rank throws in a ring step with its next hop posted: the workspace holding
  // that block unwinds while the next rank may be copying it (ASan and TSan watch this test;
  // it repeats to meet the copy at different moments). One kernel call per ring step. Rank
  // r + 1 may still take the failing rank's last posted block and run on, so only faults
  // early enough that every rank still needs a hop from the failing side reach all of them:
  // steps 0 and 1 of a 4-rank ring, step 0 of a 2 x 2 mesh (after its last ring step only
  // the failing Ulysses group fails).
  for (int rep = 0; rep < 10; ++rep) {
    for (int fail_on_call : {0, 1}) {
      CAPTURE(fail_on_call);
      check_kernel_fault(forward_with_kernel_fault(RingPolicy<>{}, 1, fail_on_call), 1);
    }
    check_kernel_fault(forward_with_kernel_fault(UnifiedPolicy<>{2, 2}, 2, 0), 2);
  }
}

// ---------------------------------------------------------------------------------------------
// A rank that fails while its ring send is in flight must not free the send buffer under a
// peer that is copying it (or is about to). The rank function's locals (the workspace, the
// send buffer) are destroyed while the exception unwinds, before run_ranks learns of the
// failure, so the communicator itself has to hold the unwinding back.

namespace {

/// A memory space whose copies take long enough to be interrupted: half the bytes, a pause,
/// the other half. A sender that failed mid-copy and freed its buffer makes the second half
/// read freed memory, which ASan reports (and TSan reports as a race with the free).
struct PausingSpace {
  static constexpr const char* name = "PausingSpace";  ///< readable name, for messages
};

/// Set while a PausingSpace copy is paused between its halves.
std::atomic<bool> copy_paused{false};

}  // namespace

/// Copies of PausingSpace (see there).
template <>
struct seqpar::SpaceCopy<PausingSpace> {
  /// Copies `bytes` from src to dst in two halves, 150 ms apart.
  static void copy(std::byte* dst, const std::byte* src, std::size_t bytes) {
    const std::size_t half = bytes / 2;
    std::memcpy(dst, src, half);
    copy_paused = true;
    std::this_thread::sleep_for(milliseconds(150));
    std::memcpy(dst + half, src + half, bytes - half);
    copy_paused = false;
  }
};

namespace {

/// `n` random bytes (the payload whose arrival the tests check exactly).
std::vector<std::byte> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(gen() & 0xff);
  return v;
}

}  // namespace

TEST_CASE("faults: a sender that fails while a peer copies its ring send waits for the copy") {
  // Rank 1 is already copying rank 0's message when rank 0 throws and unwinds its buffer.
  constexpr std::size_t n = 1 << 16;
  const auto payload = random_bytes(n, 7);
  std::vector<std::byte> received(n);
  std::string rank1_error;
  const auto start = Clock::now();
  CHECK_THROWS_WITH_AS(test::within(milliseconds(30000),
                                    [&] {
                                      run_ranks<PausingSpace>(2, [&](BasicThreadCommunicator<PausingSpace>& c) {
                                        std::vector<std::byte> send(payload), recv(n);
                                        auto req = c.start_exchange(send.data(), n, 1 - c.rank(), recv.data(), n,
                                                                    1 - c.rank());
                                        if (c.rank() == 0) {
                                          while (!copy_paused) std::this_thread::yield();
                                          throw std::runtime_error("rank 0 fails mid-copy");
                                        }
                                        try {
                                          c.wait(req);
                                        } catch (const CommAborted& e) {
                                          rank1_error = e.what();
                                          received = recv;
                                          throw;
                                        }
                                      });
                                    },
                                    "fail mid-copy"),
                       "rank 0 fails mid-copy", std::runtime_error);
  // The copy that had started finished from live memory; the rank was then woken.
  CHECK(received == payload);
  CHECK(rank1_error.find("rank 0 failed: rank 0 fails mid-copy") != std::string::npos);
  CHECK(Clock::now() - start < milliseconds(5000));
}

TEST_CASE("faults: a peer that reaches a failed sender's message after it unwound never reads it") {
  // Rank 0 throws with its send posted and unwinds the buffer; it holds the exception back
  // for a while (as a rank busy with cleanup would), so rank 1 reaches the message before the
  // group is failed. It must wait for the failure, not copy the freed bytes.
  std::atomic<bool> unwound{false};
  const auto start = Clock::now();
  const auto out = rank_outcomes(2, [&](Comm& c) {
    const auto peer = 1 - c.rank();
    std::vector<std::byte> recv(4096);
    if (c.rank() == 0) {
      try {
        const auto send = random_bytes(4096, 11);
        auto req = c.start_exchange(send.data(), send.size(), peer, recv.data(), recv.size(), peer);
        throw std::runtime_error("fault with the send in flight");
      } catch (...) {
        unwound = true;
        std::this_thread::sleep_for(milliseconds(200));
        throw;
      }
    }
    while (!unwound) std::this_thread::yield();
    const auto send = random_bytes(4096, 12);
    auto req = c.start_exchange(send.data(), send.size(), peer, recv.data(), recv.size(), peer);
    c.wait(req);
  });
  INFO(describe(out));
  CHECK(out[0].kind == "other");
  CHECK(out[1].kind == "CommAborted");
  CHECK(out[1].what.find("rank 0 failed: fault with the send in flight") != std::string::npos);
  CHECK(Clock::now() - start < milliseconds(5000));
}
