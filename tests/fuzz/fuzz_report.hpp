#pragma once
// What a fuzz case reports: failures, each naming the contract property it breaks, and notes
// of what it checked. fuzz_known.hpp classes failures into the known defect classes.
#include <functional>
#include <string>
#include <vector>

#include "fuzz/fuzz_case.hpp"

namespace seqpar::fuzz {

/// The contract properties a case checks (the names failures carry).
namespace prop {
inline constexpr const char* can_implement = "can_implement agrees with plan";
inline constexpr const char* member_can_implement = "the member can_implement agrees with plan";
inline constexpr const char* same_refusal = "every rank refuses alike or none does";
inline constexpr const char* rules = "plan refuses exactly what the documented rules refuse";
inline constexpr const char* refusal_type = "misuse is refused with ConfigError";
inline constexpr const char* layout = "the ranks' positions partition the sequence";
inline constexpr const char* work = "plan.work equals the visible pairs";
inline constexpr const char* forward = "forward equals the reference";
inline constexpr const char* lse = "the LSE equals the reference";
inline constexpr const char* backward = "backward equals the reference";
inline constexpr const char* traffic = "the plan's byte counts are the bytes sent";
inline constexpr const char* disagreement = "a disagreement names the values";
inline constexpr const char* message = "a refusal names the actual values";
inline constexpr const char* reason_words = "a refusal names the rule the documented rules apply";
inline constexpr const char* no_crash = "no crash";
inline constexpr const char* no_hang = "no hang";
inline constexpr const char* bounded = "allocation stays bounded";
inline constexpr const char* decode_step = "a decode step equals attention over the whole cache";
inline constexpr const char* advance = "DecodePlan::advance applies in whole or not at all";
inline constexpr const char* position = "owner and slot refuse positions outside the cache";
inline constexpr const char* decode_layout = "the decode layout puts each token in one slot";
inline constexpr const char* timeout = "a huge time-out means never";
}  // namespace prop

/// One broken property.
struct Failure {
  std::string property;  ///< one of prop::*
  std::string detail;    ///< what was seen against what was expected
};

/// The failures of one case, and notes of what it got as far as checking (so that a run can
/// say how many cases reached the forward, the backward, the decode steps). The sinks, when
/// set, get each as it is found (a case run in a child process streams them to its parent,
/// so a crash later loses none).
struct Report {
  std::vector<Failure> failures;
  std::vector<std::string> notes;
  std::function<void(const Failure&)> sink;
  std::function<void(const std::string&)> note_sink;
  /// Records a failure.
  void fail(std::string property, std::string detail) {
    failures.push_back({std::move(property), std::move(detail)});
    if (sink) sink(failures.back());
  }
  /// Records what the case checked.
  void note(std::string what) {
    notes.push_back(std::move(what));
    if (note_sink) note_sink(notes.back());
  }
};

}  // namespace seqpar::fuzz
