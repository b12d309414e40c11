#pragma once
/// \file
/// seqpar_demo's report, printed by rank 0: the table of a run (one row per rank, or one row
/// per length in a sweep), the check lines, and the RESULT line that scripts and tests parse
/// (its keys are a stable interface). The RESULT lines are printed last, after every table.

#include <bit>
#include <cstdint>
#include <string>
#include <vector>

#include "common.hpp"
#include "options.hpp"

namespace seqpar_demo {

namespace ex = seqpar::examples;

/// The RESULT lines of the runs so far (rank 0's); printed last, after every table row.
inline std::vector<std::string> g_results;

/// "N1,N2,...".
std::string comma_list(const std::vector<std::int64_t>& v);

/// The mask as the table and RESULT show it: its families joined by '+' (no spaces), e.g.
/// causal+window(512,-1)+docs(8), or none.
std::string mask_name(const ex::GlobalShape& s);

/// Today's models' features as RESULT's features= shows them, joined by '+', e.g.
/// head_dim_v(128)+softcap(50)+sinks, or none.
std::string features_name(const ex::GlobalShape& s);

/// RESULT's " model=NAME layer=KIND" of a --model run ("" otherwise).
std::string model_keys(const Options& o);

/// The kernel line of the report.
void print_kernel(const Options& o);

/// A checked error as RESULT writes it ("n/a" without --check).
std::string error_text(bool checked, double x);

/// --advise: the cost model's ranking of every policy and mesh for the options' problem on
/// --ranks ranks of the --machine preset (nothing runs); returns the exit status.
int print_advice(const Options& o, const ex::GlobalShape& s);

/// The check line: the error against the tolerance, and whether it passes.
bool print_check(const char* what, const ex::ErrorStats& e, double tol, const char* how);

/// The RESULT line's first keys, common to every mode (scripts parse them by name).
std::string result_head(const Options& o, int world, std::int64_t seq, const ex::ErrorStats& err, std::uint64_t bytes,
                        double ms);

/// The per-rank figures of one run, as gathered on every rank, and their totals.
struct RunFigures {
  enum Column { q_tokens, kv_tokens, work, bytes, formula, ms, columns };
  std::vector<std::vector<std::int64_t>> rows;  // per rank, by Column (ms bit-cast)
  std::uint64_t max_bytes = 0;
  double max_ms = 0, total_work = 0, max_work = 0;
  bool bytes_match = true;

  RunFigures(std::vector<std::vector<std::int64_t>> r) : rows(std::move(r)) {
    for (const auto& x : rows) {
      max_bytes = std::max(max_bytes, static_cast<std::uint64_t>(x[bytes]));
      max_ms = std::max(max_ms, rank_ms(x));
      total_work += static_cast<double>(x[work]);
      max_work = std::max(max_work, static_cast<double>(x[work]));
      bytes_match = bytes_match && x[bytes] == x[formula];
    }
  }
  static double rank_ms(const std::vector<std::int64_t>& x) { return std::bit_cast<double>(x[ms]); }
  /// Every rank's FLOPs over the slowest rank's time.
  double gflops(double flops_per_pair) const { return flops_per_pair * total_work / (max_ms * 1e6); }
  /// Max over mean visible score pairs per rank.
  double imbalance() const { return total_work > 0 ? max_work / (total_work / static_cast<double>(rows.size())) : 1.0; }
  /// GB/s of the busiest sender.
  double gbps() const { return static_cast<double>(max_bytes) / (max_ms * 1e6); }
};

/// Rank 0's report of one run: the per-rank table (or, in a sweep, the length's row), and the
/// RESULT line into g_results. Returns whether the check passed (true without --check).
bool report_run(const Options& o, const ex::GlobalShape& s, const MeshConfig& mesh, const RunFigures& f,
                const ex::ErrorStats& err, const ex::ErrorStats& grad_err, double check_s, int sweep_at,
                const std::vector<PhaseProfile>& profiles, double est_ms = -1);

/// The runs' RESULT lines, last (rank 0 has them; the other ranks none).
void print_results();

}  // namespace seqpar_demo
