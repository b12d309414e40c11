#pragma once
// Running one fuzz case so that nothing it does can take the caller down: in a child process
// (fork) whose failures and notes stream back through a pipe, with its address space capped
// at 4 GiB (unbounded allocation fails) and a time limit (a hang is killed and reported), or,
// for a debugger, in this process under a watchdog.
#include "fuzz/fuzz_case.hpp"
#include "fuzz/fuzz_report.hpp"

namespace seqpar::fuzz {

/// Runs case `c` in a child process: its failures, plus a crash (signal, non-zero exit) or a
/// hang (no end within `seconds`) as failures of their own.
Report run_isolated(const FuzzCase& c, double seconds);

/// Runs case `c` in this process; a hang past `seconds` ends the program with a message.
Report run_here(const FuzzCase& c, double seconds);

}  // namespace seqpar::fuzz
