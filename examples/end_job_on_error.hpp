#pragma once
/// \file
/// The README's "catch, report, MPI_Abort" for a whole example program. An error that leaves
/// main uncaught would otherwise reach std::terminate's default: `abort()` (exit status 134,
/// "terminate called after throwing ..."), and a rank that instead returned from main would
/// finalize MPI while its peers may still wait for it. With end_job_on_error(argv[0]) after
/// MPI starts, such an error prints one line, `<program>: rank R: <what>`, and ends every rank
/// with MPI_Abort: status 2 for a ConfigError (a bad argument or SEQPAR_* variable, which every
/// rank refuses alike), 1 for any other error. It is a terminate handler: an exception that no
/// handler catches calls it before any destructor runs (the Itanium C++ ABI, which GCC and
/// Clang follow, does not unwind such a stack), so MPI is still up when it aborts.

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

#include "seqpar/core/error.hpp"

namespace seqpar::examples {

namespace end_job {
/// The program name the handler prints.
inline std::string& job_program() {
  static std::string name = "example";
  return name;
}

/// The terminate handler end_job_on_error installs.
[[noreturn]] inline void report_and_end_job() {
  const std::exception_ptr error = std::current_exception();  // keeps what() alive below
  const char* what = "std::terminate without an exception";
  int status = 1;
  try {
    if (error) std::rethrow_exception(error);
  } catch (const ConfigError& e) {
    what = e.what();
    status = 2;
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "an exception that is not a std::exception";
  }
  int up = 0, down = 0, rank = -1;
  MPI_Initialized(&up);
  MPI_Finalized(&down);
  if (up && !down) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "%s: rank %d: %s\n", job_program().c_str(), rank, what);
  std::fflush(stderr);
  if (up && !down) MPI_Abort(MPI_COMM_WORLD, status);
  std::_Exit(status);
}
}  // namespace end_job

/// Makes an error that leaves main end the whole job with one line naming it (see the file
/// comment). `argv0`: the program's path, of which the name is printed.
inline void end_job_on_error(std::string_view argv0) {
  end_job::job_program() = std::string(argv0.substr(argv0.find_last_of('/') + 1));
  std::set_terminate(end_job::report_and_end_job);
}

}  // namespace seqpar::examples
