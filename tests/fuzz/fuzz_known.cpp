// known_class: which known defect class a failure belongs to (fuzz_known.hpp lists them).
// A class is recognised by what the case holds (its trigger) and the property it breaks, so a
// crash or hang is classed by its case alone.
#include <cmath>
#include <cstdlib>
#include <limits>

#include "fuzz/fuzz_known.hpp"

namespace seqpar::fuzz {
namespace {

constexpr i64 kHuge = i64{1} << 61;

/// A legal soft-cap CpuFlashKernel does not compute (class r): below 2^-32 or above 2^32.
bool extreme_softcap(double cap) { return cap > 0 && (cap < 0x1p-32 || cap > 0x1p32); }

bool huge_window(const AttentionProblem& p) { return p.window.left > kHuge || p.window.right > kHuge; }

bool huge_documents(const AttentionProblem& p) {
  for (const auto& list : p.documents)
    for (i64 n : list)
      if (n > kHuge) return true;
  return false;
}

/// The time-out a case asks for, in ms (the environment variable's, when it is a number).
double timeout_of(const TimeoutCase& c) {
  if (!c.via_env) return static_cast<double>(c.timeout_ms);
  char* end = nullptr;
  const double v = std::strtod(c.env_text.c_str(), &end);
  return end != nullptr && *end == '\0' ? v : 0.0;
}

}  // namespace

std::string known_class(const FuzzCase& c, const Failure& f) {
  const std::string& p = f.property;
  if (c.kind == CaseKind::attention) {
    const AttentionCase& a = c.attention;
    const bool other = a.disagree_rank >= 0;
    const std::string& d = f.detail;
    const bool wide_degrees = a.policy.kind == PolicyKind::unified &&
                              static_cast<i64>(a.policy.ulysses_degree) * a.policy.ring_degree > std::numeric_limits<int>::max();
    if (wide_degrees) return "p";
    if (extreme_softcap(a.problem.softcap) && a.kernel != KernelKind::reference && a.kernel != KernelKind::causal_only &&
        (p == prop::forward || p == prop::lse || p == prop::backward))
      return "r";
    if (a.problem.head_dim_v > (i64{1} << 40) && d.find("vector::") != std::string::npos)
      return "s";
    if (p == prop::forward && d.find("slot sink_lse") != std::string::npos) return "t";
    if (p == prop::same_refusal && d.find("could not allocate its scratch") != std::string::npos) return "q";
    if (p == prop::message || (p == prop::rules && d.find("size overflow") != std::string::npos)) return "o";
    if (a.kernel == KernelKind::causal_only && a.problem.has_extra_mask() && p == prop::member_can_implement) return "f";
    if (p == prop::disagreement && d.find("hash") != std::string::npos) return "i";
    if ((p == prop::can_implement || p == prop::member_can_implement) && d.find("stripe layout") != std::string::npos)
      return "j";
    if (p == prop::rules) {  // by the rule the plan missed
      if (d.find("documents do not sum") != std::string::npos && huge_documents(a.problem)) return "e";
      if (d.find("below -1") != std::string::npos) return "l";
      if (d.find("placement outside") != std::string::npos) return "m";
      if (d.find("dtype outside") != std::string::npos) return "m";
      return "";
    }
    if (a.nan_hidden_q && p == prop::backward) return "c";
    if (p == prop::no_crash && a.kernel == KernelKind::cpu_flash_2 && a.problem.batch == 0) return "n";
    if ((p == prop::forward || p == prop::lse) && d.rfind("scale ", 0) == 0) return "k";
    if (huge_window(a.problem) || (other && huge_window(a.other_problem))) return "a";
    if (huge_documents(a.problem) || (other && huge_documents(a.other_problem))) return "e";
    return "";
  }
  if (c.kind == CaseKind::decode) {
    const DecodeProblem& d = c.decode.problem;
    if (p == prop::advance) return "b";
    if (extreme_softcap(d.softcap) && c.decode.kernel != KernelKind::reference && p == prop::decode_step) return "r";
    if (p == prop::position) return "g";
    if (p == prop::rules && f.detail.find("dtype outside") != std::string::npos) return "m";
    if (p == prop::decode_step && f.detail.find("outside the visible V") != std::string::npos) return "k";
    for (i64 l : d.kv_len)
      if (d.new_tokens > 0 && l > std::numeric_limits<i64>::max() - d.new_tokens) return "e";
    if (!std::isfinite(d.scale) || static_cast<int>(d.exchange) > 1) return "h";
    return "";
  }
  if (p == prop::timeout && timeout_of(c.timeout) > 9.2e12) return "d";
  return "";
}

}  // namespace seqpar::fuzz
