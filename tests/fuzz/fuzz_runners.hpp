#pragma once
// Running fuzz cases: the entry (run_case), the runners per kernel (each in its own
// translation unit, so the engines compile in parallel and once), and what the attention
// runner hands its analysis: every rank's outcomes and outputs, converted to double so that
// the checks compile once (fuzz_attention.cpp) for every kernel and element type.
#include <cstddef>
#include <utility>
#include <string>
#include <vector>

#include "fuzz/brute_force.hpp"
#include "fuzz/fuzz_case.hpp"
#include "fuzz/fuzz_report.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/policy/plan_builder.hpp"
#include "support/rank_outcomes.hpp"

namespace seqpar::fuzz {

/// Runs one case and records every broken property in `report`.
void run_case(const FuzzCase& c, Report& report);

/// Attention on ReferenceKernel and on a kernel without supports_masks (fuzz_run_reference.cpp).
void run_attention_reference(const AttentionCase& c, Report& report);
/// Attention on CpuFlashKernel (fuzz_run_cpu.cpp).
void run_attention_cpu(const AttentionCase& c, Report& report);
/// Decode (fuzz_decode.cpp).
void run_decode(const DecodeCase& c, Report& report);
/// Time-outs (fuzz_timeout.cpp).
void run_timeout(const TimeoutCase& c, Report& report);

/// How one call on one rank ended: kind "none", or the exception's kind ("ConfigError",
/// "CommAborted", "CommError", "Error", "other"; "bounded" for a workspace the runner refused
/// to allocate) and message.
struct Outcome : test::RankOutcome {
  /// True when the call returned.
  bool ok() const { return kind == "none"; }
  /// "kind: what".
  std::string text() const { return ok() ? "returned" : kind + ": " + what; }
};

/// Runs `fn`, records how it ended in `out`, and rethrows what it threw (so that run_ranks
/// wakes the peers, exactly as in real use).
template <class Fn>
void record(Outcome& out, Fn&& fn) {
  test::record_outcome(out, std::forward<Fn>(fn));
}

/// A message without the " (at file:line)" suffix of the check macros.
std::string strip_location(const std::string& message);

/// The global inputs and the exact answer of an attention case, made before the ranks run
/// (when the shapes are small enough to check).
struct CaseData {
  bool ready = false;   ///< shapes small enough: inputs and reference exist
  bool exact = true;    ///< the scale is tame enough for the tolerances (else only bounds are checked)
  std::int64_t B = 0, Sq = 0, Skv = 0, H = 0, K = 0, D = 0, Dv = 0;
  /// Per query head: its sink is not finite (its rows may be NaN where the limit is wanted).
  std::vector<unsigned char> wild_sink;
  Visibility vis;
  GlobalTensors x;
  ReferenceResult ref;
};

/// The inputs (rounded to float unless `c.f64`), NaN planted where the case asks, and the answer.
CaseData prepare_attention(const AttentionCase& c);

/// What one call sent: payload bytes to other ranks, what the plan says it sends, and the
/// metadata all-gathers it did (a call does none).
struct Traffic {
  std::uint64_t sent = 0, planned = 0, gathers = 0;
};

/// What one rank left behind.
struct RankResult {
  Outcome construct, plan_call, forward, backward;  ///< how each call ended
  bool member_asked = false;
  Implementable member;  ///< the member can_implement on this rank's problem and every rank's lengths
  bool planned = false;
  Plan plan;
  PositionMap qpos, kvpos;
  std::vector<double> out, lse;  ///< [B, Lq, H, D] and [B, Lq, H]
  std::vector<double> dq, dk, dv;
  std::vector<double> d_sinks;  ///< [H] this rank's share of the sinks' gradient (empty: not asked)
  bool forwarded = false, backwarded = false;
  Traffic forward_traffic, backward_traffic;  ///< of the checked calls
};

/// Every rank's result and the free can_implement's answer.
struct AttentionRun {
  std::vector<RankResult> ranks;
  Implementable free_verdict;
};

/// The contract checks of an attention case on its run.
void analyse_attention(const AttentionCase& c, const CaseData& data, const AttentionRun& run, Report& report);

}  // namespace seqpar::fuzz
