#pragma once
// Test support: an environment variable set for one scope (the variables seqpar reads when an
// object is made: SEQPAR_COMM_TIMEOUT_MS, SEQPAR_CHECK_CALLS). Set it before the rank threads
// start: setenv is not safe while another thread reads the environment.

#include <cstdlib>

namespace seqpar::test {

/// Sets an environment variable for one scope, and unsets it after.
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  const char* name_;  ///< the variable
};

}  // namespace seqpar::test
