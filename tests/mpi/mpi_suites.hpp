// Test suites that tie an MPI test case to the world sizes it applies to. mpi_main.cpp
// excludes every suite the world's size does not meet, so doctest counts its test cases as
// skipped (the summary's "skipped"), and rank 0 prints which suite and why: a test case never
// passes by returning early on a world it cannot test.
#pragma once

#include <climits>

namespace seqpar::mpi_test {

/// Test cases of a 2 x 2 mesh: 4 ranks exactly.
inline constexpr const char* four_ranks = "needs 4 ranks";
/// Test cases where one rank disagrees with another.
inline constexpr const char* two_or_more_ranks = "needs 2 or more ranks";

/// A suite and the world sizes [min, max] it applies to.
struct SizeSuite {
  const char* name;
  int min, max;
};

/// Every suite mpi_main.cpp filters by world size.
inline constexpr SizeSuite size_suites[] = {{four_ranks, 4, 4}, {two_or_more_ranks, 2, INT_MAX}};

}  // namespace seqpar::mpi_test
