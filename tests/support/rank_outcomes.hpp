#pragma once
// Test support for failure paths: runs ranks on threads and records, per rank, which seqpar
// exception it ended with. Every run has a time-out, so a regression that leaves a rank
// blocked fails the test (as a "CommError" time-out) instead of hanging the suite.

#include <chrono>
#include <exception>
#include <string>
#include <vector>

#include "seqpar/comm/thread_communicator.hpp"
#include "seqpar/core/error.hpp"

namespace seqpar::test {

/// How one rank ended.
struct RankOutcome {
  std::string kind = "none";  ///< "none", "ConfigError", "CommAborted", "CommError", "Error" or "other"
  std::string what;           ///< the exception's message
};

/// Generous: only a rank that is really stuck waits this long.
inline constexpr std::chrono::milliseconds outcome_timeout{10000};

/// Runs `fn()`, records in `me` which seqpar exception (if any) it ended with, and rethrows
/// it, so that run_ranks wakes the rank's peers exactly as in real use.
template <class Fn>
void record_outcome(RankOutcome& me, Fn&& fn) {
  try {
    fn();
  } catch (const CommAborted& e) {  // before CommError: it is one
    me = {"CommAborted", e.what()};
    throw;
  } catch (const ConfigError& e) {
    me = {"ConfigError", e.what()};
    throw;
  } catch (const CommError& e) {
    me = {"CommError", e.what()};
    throw;
  } catch (const Error& e) {
    me = {"Error", e.what()};
    throw;
  } catch (const std::exception& e) {
    me = {"other", e.what()};
    throw;
  }
}

/// Runs `fn(comm)` on `ranks` threads and returns how each rank ended. The rank's exception
/// is rethrown after it is recorded so that run_ranks wakes its peers, exactly as in real use.
template <class Fn>
std::vector<RankOutcome> rank_outcomes(int ranks, Fn&& fn, std::chrono::milliseconds timeout = outcome_timeout) {
  std::vector<RankOutcome> out(static_cast<std::size_t>(ranks));
  try {
    run_ranks(
        ranks,
        [&](ThreadCommunicator& comm) { record_outcome(out[static_cast<std::size_t>(comm.rank())], [&] { fn(comm); }); },
        ThreadRunOptions{timeout});
  } catch (const std::exception&) {
    // Each rank's outcome is already recorded; the caller checks them.
  }
  return out;
}

/// True when every rank threw ConfigError with the same message containing `needle`: the
/// shape of a collective check that every rank evaluates on the same gathered data.
inline bool all_same_config_error(const std::vector<RankOutcome>& out, const std::string& needle) {
  for (const auto& o : out)
    if (o.kind != "ConfigError" || o.what != out.front().what || o.what.find(needle) == std::string::npos)
      return false;
  return !out.empty();
}

/// True when every rank threw ConfigError containing `needle` (messages may differ in detail,
/// e.g. a workspace shortfall depends on each rank's buffer alignment).
inline bool all_config_error(const std::vector<RankOutcome>& out, const std::string& needle) {
  for (const auto& o : out)
    if (o.kind != "ConfigError" || o.what.find(needle) == std::string::npos) return false;
  return !out.empty();
}

/// One line per rank, for INFO() when a check fails.
inline std::string describe(const std::vector<RankOutcome>& out) {
  std::string s;
  for (std::size_t r = 0; r < out.size(); ++r)
    s += "\n  rank " + std::to_string(r) + ": " + out[r].kind + (out[r].what.empty() ? "" : ": " + out[r].what);
  return s;
}

}  // namespace seqpar::test
