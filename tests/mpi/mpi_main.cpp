// doctest main for the MPI test programs: every rank runs every test case (the cases are
// collective); checks compare values already reduced over the ranks, so all ranks agree.
// Rank 0 prints the usual report, the others only their failures.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  if (rank != 0) {
    context.setOption("minimal", true);
    context.setOption("no-colors", true);
  }
  const int failed = context.run();
  // Failures are per rank; the job fails if any rank failed.
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
