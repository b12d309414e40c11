// Process-level faults under MPI: a rank that dies must end the whole job, never leave its
// peers blocked in a collective. (MPI errors becoming MpiError, and collective plan checks,
// are tested in tests/mpi.) Each scenario is expected to FAIL, promptly, with its message;
// ctest's time-out turns a hang into a test failure.
//
//   mpi_faults uncaught   rank 1 throws after the plan, uncaught (std::terminate), while its
//                         peers wait for it in forward's all-to-all
//   mpi_faults abort      rank 0 alone passes a wrong output view to forward: a local
//                         ConfigError (forward checks are local: it exchanges no metadata)
//                         while its peers wait in forward's all-to-all; it follows the
//                         recommended pattern (catch seqpar::Error, print, MPI_Abort)
//   mpi_faults finalize   as `abort`, but rank 0 catches its error and calls MPI_Finalize:
//                         it stays alive without joining. Run with SEQPAR_COMM_TIMEOUT_MS
//                         set, every other rank gets a CommError naming all_to_all_v
//                         within the time-out, prints it, and finalizes too (the job ends)
//   mpi_faults barrier    as `finalize`, but rank 0 calls MPI_Barrier(MPI_COMM_WORLD) after
//                         its local error (a wrong recovery: forward's errors are local);
//                         the others end the job with MPI_Abort after the time-out
//   mpi_faults rejoin P   policy P (ring: Ring over Stripe, ulysses, unified: 2 x 2) on 4
//                         ranks, float: forward, backward, in which rank 1's kernel throws;
//                         rank 1 catches it and goes on with forward and backward. Run with
//                         SEQPAR_COMM_TIMEOUT_MS=2000: rank 1's next call is refused at once
//                         (the failure latch), the others get a CommError (time-out, or a
//                         message of another call) within 10 s; no call returns after the
//                         fault (each would print "returned after the fault" and its error
//                         against the exact reference). Then rank 0 ends the job (MPI_Abort).

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "common.hpp"
#include "seqpar/comm/mpi_communicator.hpp"
#include "seqpar/seqpar.hpp"
#include "support/fault_kernel.hpp"

using namespace seqpar;

namespace {

void uncaught(MpiCommunicator& world) {
  SequenceParallelAttention<UlyssesPolicy, MpiCommunicator, ReferenceKernel> attn(world);
  const AttentionProblem problem{.heads = 2 * world.size(), .head_dim = 8};
  const Plan plan = attn.plan(problem, {4});
  if (world.rank() == 1) throw std::runtime_error("rank 1 fails on purpose after the plan");
  std::vector<float> x(static_cast<std::size_t>(4 * problem.heads * 8), 0.5f), out(x.size());
  std::vector<std::byte> ws(plan.workspace_bytes());
  using In = TensorView<const float>;
  const auto view = In::bshd(x.data(), 1, 4, problem.heads, 8);
  attn.forward<float>(plan, view, view, view, TensorView<float>::bshd(out.data(), 1, 4, problem.heads, 8), ws);
  std::printf("rank %d: forward returned, but rank 1 never joined\n", world.rank());
}

/// Ulysses forward where rank 0 alone passes an output view one row short: a local
/// ConfigError on rank 0 while its peers wait for it in forward's all-to-all.
void forward_rank0_short(MpiCommunicator& world) {
  SequenceParallelAttention<UlyssesPolicy, MpiCommunicator, ReferenceKernel> attn(world);
  AttentionProblem problem;
  problem.heads = 2 * world.size();
  problem.head_dim = 8;
  const Plan plan = attn.plan(problem, {4});
  std::vector<float> x(static_cast<std::size_t>(4 * problem.heads * 8), 0.5f), out(x.size());
  std::vector<std::byte> ws(plan.workspace_bytes());
  const auto view = TensorView<const float>::bshd(x.data(), 1, 4, problem.heads, 8);
  const std::int64_t out_len = world.rank() == 0 ? 3 : 4;  // rank 0: one row short
  attn.forward<float>(plan, view, view, view, TensorView<float>::bshd(out.data(), 1, out_len, problem.heads, 8), ws);
  std::printf("rank %d: forward returned, but rank 0 never joined\n", world.rank());
}

void abort_on_error(MpiCommunicator& world) {
  try {
    forward_rank0_short(world);
  } catch (const Error& e) {
    std::fprintf(stderr, "rank %d: %s\n", world.rank(), e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
}

/// `finalize` and `barrier`: rank 0 fails locally and stays alive (see the file comment).
/// Returns only on rank 0 of `finalize`, after MPI_Finalize; the others end the job (they
/// finalize too in `finalize`; rank 1 calls MPI_Abort in `barrier`).
void stays_alive(MpiCommunicator& world, bool finalize) {
  // The ranks that will time out synchronise on their own communicator before the job ends,
  // so every one of them has printed its error first.
  MPI_Comm survivors = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world.rank() == 0 ? MPI_UNDEFINED : 1, world.rank(), &survivors);
  const auto start = std::chrono::steady_clock::now();
  try {
    forward_rank0_short(world);
  } catch (const CommError& e) {  // a peer that waited for rank 0
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    std::fprintf(stderr, "rank %d: CommError after %lld ms%s: %s\n", world.rank(), static_cast<long long>(ms.count()),
                 ms < std::chrono::seconds(10) ? " (within 10 s)" : " (too late)", e.what());
    std::fflush(stderr);
    MPI_Barrier(survivors);
    MPI_Comm_free(&survivors);
    if (finalize) {
      // Rank 0 waits in MPI_Finalize for the others: finalizing ends the job (status 3).
      MPI_Finalize();
      std::exit(3);
    }
    if (world.rank() == 1) MPI_Abort(MPI_COMM_WORLD, 3);  // rank 0 would wait in its barrier forever
    std::this_thread::sleep_for(std::chrono::seconds(60));  // ended by rank 1's MPI_Abort
  } catch (const Error& e) {  // rank 0: a local error
    std::fprintf(stderr, "rank %d: %s\n", world.rank(), e.what());
    std::fflush(stderr);
    if (finalize) {
      MPI_Finalize();
      return;
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

/// `rejoin`: see the file comment. Every rank prints how each call after the fault ended;
/// then all meet on a communicator of their own and rank 0 ends the job.
template <class Policy>
void rejoin(MpiCommunicator& world, Policy policy) {
  namespace ex = seqpar::examples;
  MPI_Comm sync = MPI_COMM_NULL;  // untouched by the failed calls
  MPI_Comm_dup(MPI_COMM_WORLD, &sync);
  const int me = world.rank();
  const ex::GlobalShape shape = ex::make_case(32, 4, 2, 16, true, 11);
  const ex::GlobalInputs g = ex::make_inputs<float>(shape);
  SequenceParallelAttention<Policy, MpiCommunicator, test::BackwardFaultKernel<ReferenceKernel>> attn(world, policy);
  const Plan plan = attn.plan(shape.problem<float>(true), {8, -1});
  const PositionMap qp = plan.q_positions(me), kp = plan.kv_positions(me);
  const std::int64_t B = shape.batch, H = shape.heads, K = shape.kv_head_count(), D = shape.head_dim;
  ex::LocalSlices<float> x = ex::local_slices<float>(g, qp, kp);
  const auto dout = ex::take_rows<float>(g.dout, B, shape.seq_q, H, D, qp);
  std::vector<float> lse(static_cast<std::size_t>(B * x.lq * H)), dq(x.q.size()), dk(x.k.size()), dv(x.v.size());
  std::vector<std::byte> ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
  using CV = TensorView<const float>;
  using MV = TensorView<float>;
  const auto q = CV::bshd(x.q.data(), B, x.lq, H, D), k = CV::bshd(x.k.data(), B, x.lkv, K, D),
             v = CV::bshd(x.v.data(), B, x.lkv, K, D);
  const auto lse_view = MV::lse_bhs(lse.data(), B, x.lq, H);
  auto forward = [&] { attn.template forward<float>(plan, q, k, v, MV::bshd(x.out.data(), B, x.lq, H, D), lse_view, ws); };
  auto backward = [&] {
    attn.template backward<float>(plan, CV::bshd(dout.data(), B, x.lq, H, D), q, k, v,
                                  CV::bshd(x.out.data(), B, x.lq, H, D), lse_view, MV::bshd(dq.data(), B, x.lq, H, D),
                                  MV::bshd(dk.data(), B, x.lkv, K, D), MV::bshd(dv.data(), B, x.lkv, K, D), ws);
  };
  const std::vector<double> want_out = ex::reference_rows(g, qp);
  const ex::ReferenceGrads want = ex::reference_grads(g, qp, kp);
  forward();  // every rank, before the fault
  attn.kernel().fail_backward = me == 1;
  // After the fault every call on every rank must fail: none may return (with anything).
  const char* names[] = {"backward", "forward", "backward", "forward", "backward"};
  for (int call = 0; call < 5; ++call) {
    const auto start = std::chrono::steady_clock::now();
    try {
      if (call % 2 == 0) {
        backward();
        const double err = std::max({ex::compare(dq, want.dq).rel(), ex::compare(dk, want.dk).rel(),
                                     ex::compare(dv, want.dv).rel()});
        std::fprintf(stderr, "rank %d: %s returned after the fault (grad_max_rel_err=%.3g%s)\n", me, names[call], err,
                     err > 1e-4 ? ": WRONG" : "");
      } else {
        forward();
        const double err = ex::compare(x.out, want_out).rel();
        std::fprintf(stderr, "rank %d: %s returned after the fault (max_rel_err=%.3g%s)\n", me, names[call], err,
                     err > 1e-5 ? ": WRONG" : "");
      }
    } catch (const CommError& e) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
      std::fprintf(stderr, "rank %d: CommError in %s after %lld ms%s: %s\n", me, names[call],
                   static_cast<long long>(ms.count()),
                   ms < std::chrono::milliseconds(500) ? " (at once)"
                   : ms < std::chrono::seconds(10)     ? " (within 10 s)"
                                                       : " (too late)",
                   e.what());
      break;
    } catch (const std::runtime_error& e) {  // rank 1: its own kernel's fault; it goes on
      std::fprintf(stderr, "rank %d: caught in %s: %s\n", me, names[call], e.what());
    }
  }
  std::fflush(stderr);
  MPI_Barrier(sync);  // everyone has printed
  if (me == 0) MPI_Abort(MPI_COMM_WORLD, 3);  // the communicators are latched: end the job
  std::this_thread::sleep_for(std::chrono::seconds(60));  // ended by rank 0's MPI_Abort
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  {
    MpiCommunicator world(MPI_COMM_WORLD);
    if (argc == 2 && std::strcmp(argv[1], "uncaught") == 0) {
      uncaught(world);
    } else if (argc == 2 && std::strcmp(argv[1], "abort") == 0) {
      abort_on_error(world);
    } else if (argc == 2 && (std::strcmp(argv[1], "finalize") == 0 || std::strcmp(argv[1], "barrier") == 0)) {
      stays_alive(world, std::strcmp(argv[1], "finalize") == 0);
      if (detail::mpi_finalized()) return 1;  // rank 0 of `finalize`, once the job ends
    } else if (argc == 3 && std::strcmp(argv[1], "rejoin") == 0 && std::strcmp(argv[2], "ring") == 0) {
      rejoin(world, RingPolicy<Stripe>{});
    } else if (argc == 3 && std::strcmp(argv[1], "rejoin") == 0 && std::strcmp(argv[2], "ulysses") == 0) {
      rejoin(world, UlyssesPolicy{});
    } else if (argc == 3 && std::strcmp(argv[1], "rejoin") == 0 && std::strcmp(argv[2], "unified") == 0) {
      rejoin(world, UnifiedPolicy<Stripe>{2, 2});
    } else {
      if (world.rank() == 0)
        std::fprintf(stderr, "usage: mpi_faults uncaught|abort|finalize|barrier|rejoin ring|ulysses|unified\n");
      MPI_Finalize();
      return 2;
    }
  }
  MPI_Finalize();
  return 0;  // not reached in either scenario: a fault must end the job
}
