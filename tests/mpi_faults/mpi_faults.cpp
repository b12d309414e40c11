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

#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <stdexcept>
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

void abort_on_error(MpiCommunicator& world) {
  try {
    SequenceParallelAttention<UlyssesPolicy, MpiCommunicator, ReferenceKernel> attn(world);
    const AttentionProblem problem{.heads = 2 * world.size(), .head_dim = 8};
    const Plan plan = attn.plan(problem, {4});
    std::vector<float> x(static_cast<std::size_t>(4 * problem.heads * 8), 0.5f), out(x.size());
    std::vector<std::byte> ws(plan.workspace_bytes());
    const auto view = TensorView<const float>::bshd(x.data(), 1, 4, problem.heads, 8);
    const std::int64_t out_len = world.rank() == 0 ? 3 : 4;  // rank 0: one row short
    attn.forward<float>(plan, view, view, view, TensorView<float>::bshd(out.data(), 1, out_len, problem.heads, 8), ws);
    std::printf("rank %d: forward returned, but rank 0 never joined\n", world.rank());
  } catch (const Error& e) {
    std::fprintf(stderr, "rank %d: %s\n", world.rank(), e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
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
    } else {
      if (world.rank() == 0) std::fprintf(stderr, "usage: mpi_faults uncaught|abort\n");
      MPI_Finalize();
      return 2;
    }
  }
  MPI_Finalize();
  return 0;  // not reached in either scenario: a fault must end the job
}
