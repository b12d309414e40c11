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

#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "seqpar/comm/mpi_communicator.hpp"
#include "seqpar/seqpar.hpp"

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
    } else {
      if (world.rank() == 0) std::fprintf(stderr, "usage: mpi_faults uncaught|abort|finalize|barrier\n");
      MPI_Finalize();
      return 2;
    }
  }
  MPI_Finalize();
  return 0;  // not reached in either scenario: a fault must end the job
}
