// doctest main for the MPI test programs: every rank runs every test case (the cases are
// collective); checks compare values already reduced over the ranks, so all ranks agree.
// Rank 0 prints the usual report, the others only their failures. Test cases that need
// another world size (mpi_suites.hpp) are skipped by filter, and rank 0 says so.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdio>

#include "mpi_suites.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  for (const auto& suite : seqpar::mpi_test::size_suites)
    if (size < suite.min || size > suite.max) {
      context.addFilter("test-suite-exclude", suite.name);
      if (rank == 0)
        std::printf("SKIPPED on %d ranks: the test cases of suite \"%s\" (mpiexec -n %d runs them)\n", size,
                    suite.name, suite.min);
    }
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
