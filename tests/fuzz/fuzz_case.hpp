#pragma once
// The contract fuzzer's cases: what one case is (an attention run, a decode run or a
// time-out), the seeded generator that makes case K of seed S biased toward edge values, a
// one-line description, and the documented rules as an independent model (which problems a
// plan must refuse). Nothing here includes the engines: it compiles once, and the runners
// (fuzz_runners.hpp) take the cases it makes.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "seqpar/core/problem.hpp"
#include "seqpar/core/mesh.hpp"
#include "seqpar/decode/decode_plan.hpp"

namespace seqpar::fuzz {

using i64 = std::int64_t;

/// A splitmix64 stream: the same numbers on every platform (std distributions are not), so
/// that `--seed S --case K` reproduces a case anywhere.
class Rng {
 public:
  /// A stream from one 64-bit seed.
  explicit Rng(std::uint64_t seed) : s_(seed) {}
  /// The next 64 random bits.
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// An integer in [lo, hi] (hi - lo well below 2^63).
  i64 range(i64 lo, i64 hi) { return lo + static_cast<i64>(next() % static_cast<std::uint64_t>(hi - lo + 1)); }
  /// True with probability p.
  bool chance(double p) { return unit() < p; }
  /// A double in [0, 1).
  double unit() { return static_cast<double>(next() >> 11) * 0x1p-53; }
  /// One element of a non-empty list.
  template <class V>
  auto pick(const V& list) -> decltype(list[0]) {
    return list[static_cast<std::size_t>(range(0, static_cast<i64>(list.size()) - 1))];
  }

 private:
  std::uint64_t s_;
};

/// The policy families the runners switch over at run time (each with its layout and Anything
/// flag): the engine is keyed on the phases only, so the instantiations stay few.
enum class PolicyKind : int { ulysses, ring, unified };

/// Which policy a rank constructs, with its degrees (Unified) and placement.
struct PolicyChoice {
  PolicyKind kind = PolicyKind::ring;                         ///< family
  LayoutKind layout = LayoutKind::contiguous;                  ///< Ring and Unified
  bool anything = false;                                       ///< wrapped in AnythingPolicy
  int ulysses_degree = 0, ring_degree = 0;                     ///< Unified only (0: derived)
  MeshPlacement placement = MeshPlacement::ulysses_adjacent;   ///< Unified only
};

/// The local kernels a case runs on.
enum class KernelKind : int {
  reference,    ///< ReferenceKernel (exact, double)
  cpu_flash_1,  ///< CpuFlashKernel, 1 thread
  cpu_flash_2,  ///< CpuFlashKernel, 2 threads
  causal_only,  ///< a kernel without supports_masks (plans with windows, documents, padding are refused)
};

/// One attention run: every rank's policy, problem and lengths, and what to check.
struct AttentionCase {
  int world = 1;                       ///< ranks (threads)
  PolicyChoice policy;                 ///< what every rank constructs
  int mesh_disagree_rank = -1;         ///< >= 0: this rank constructs `other_policy` instead
  PolicyChoice other_policy;           ///< the disagreeing rank's policy (same type, other degrees)
  KernelKind kernel = KernelKind::reference;
  int isa = -1;                        ///< CpuFlashOptions::isa (-1: automatic)
  bool f64 = false;                    ///< element type double (else float)
  bool typed_plan = true;              ///< plan<T>(...) (else plan(problem) with problem.dtype)
  AttentionProblem problem;            ///< what every rank plans
  int disagree_rank = -1;              ///< >= 0: this rank plans `other_problem` instead
  std::string disagree_field;          ///< the field that differs (for the description)
  AttentionProblem other_problem;      ///< the disagreeing rank's problem
  /// The sink logits, one per query head (empty: none; NaN and infinities are drawn too). The
  /// problems hold no pointer (a case is copied); problem_of points them here.
  std::vector<float> sinks;
  bool other_sinks = false;            ///< the disagreeing rank gives sinks (`sinks`, or ones of its own)
  std::vector<LocalLengths> lengths;   ///< per world rank
  bool backward = false;               ///< also run and check backward (needs with_lse)
  bool nan_hidden_kv = false;          ///< NaN in K/V rows no query sees
  bool nan_hidden_q = false;           ///< NaN in Q rows that see no key
  std::uint64_t data_seed = 0;         ///< inputs
};

/// One decode run: the problem, how many steps, and the probes between steps.
struct DecodeCase {
  int world = 1;
  KernelKind kernel = KernelKind::reference;  ///< reference or cpu_flash_1/2
  int isa = -1;
  bool f64 = false;
  DecodeProblem problem;
  std::vector<float> sinks;            ///< one logit per query head (empty: none); problem_of points to them
  int disagree_rank = -1;              ///< >= 0: this rank plans `other_problem` instead
  std::string disagree_field;          ///< the field that differs
  DecodeProblem other_problem;         ///< the disagreeing rank's problem (its sinks: given or not)
  bool v_in_k = false;                 ///< V is a column view of K's rows (MLA's latent cache; D_v <= D)
  int steps = 1;                       ///< steps run (when the plan accepts)
  std::vector<i64> advance_probes;     ///< advance(k) tried on a copy of the plan before each step
  std::vector<std::pair<i64, i64>> position_probes;  ///< (b, pos) outside the cache: owner/slot must refuse
  bool nan_unwritten = true;           ///< NaN in cache slots no step has written
  std::uint64_t data_seed = 0;
};

/// One time-out run: a quick collective under a ThreadRunOptions time-out (or the environment
/// variable) that must not expire.
struct TimeoutCase {
  int world = 2;
  i64 timeout_ms = 0;                  ///< ThreadRunOptions::timeout
  bool via_env = false;                ///< set SEQPAR_COMM_TIMEOUT_MS to `env_text` instead
  std::string env_text;                ///< the variable's text
  bool env_valid = true;               ///< env_text is a whole number >= 0 (else ConfigError is fine)
};

/// What a case is.
enum class CaseKind : int { attention, decode, timeout };

/// One case of the fuzzer.
struct FuzzCase {
  CaseKind kind = CaseKind::attention;
  AttentionCase attention;
  DecodeCase decode;
  TimeoutCase timeout;
};

/// Generator options: which case kinds to make, and which known defect classes to keep out
/// of the cases (letters; fuzz_known.hpp lists them), so that the cases can find
/// new defects while known ones are being fixed.
struct GenOptions {
  std::string skip;                    ///< letters of classes whose triggers are not generated
  int only = -1;                       ///< >= 0: only this CaseKind
  /// True when class `letter` is skipped.
  bool skips(char letter) const { return skip.find(letter) != std::string::npos; }
};

/// Case `index` of `seed`: a pure function of the two (and the options).
FuzzCase make_case(std::uint64_t seed, std::uint64_t index, const GenOptions& options);

/// One line with every field of the case (enough to rebuild it by hand).
std::string describe(const FuzzCase& c);

/// The problem rank `rank` plans: the case's (or the disagreeing rank's), its sinks pointing
/// into the case (which must outlive it).
AttentionProblem problem_of(const AttentionCase& c, int rank);
/// The decode problem rank `rank` plans, its sinks pointing into the case.
DecodeProblem problem_of(const DecodeCase& c, int rank);

/// The documented rules as an independent model: "" when `c`'s plan must succeed, else why
/// it must be refused (the model's words, not the library's). Meaningless when ranks disagree.
std::string attention_model_reason(const AttentionCase& c);
/// The same for a decode problem on `world` ranks.
std::string decode_model_reason(const DecodeCase& c);
/// The words the library's refusal must hold when the model refuses for `reason` ("" where the
/// model names no words: the other rules' words are can_implement's to match). The feature
/// rules have them: D_v and the soft-cap by name, the kernel's missing trait, head_dim_v in a
/// size overflow where D_v is the widest row.
///
/// Sinks have no rule a plan can check: their values are read by each call (device memory for
/// CUDA), and every rank must hold the same ones. The fuzzer's contract for values past the
/// finite ones: the rows of a head whose sink is NaN are NaN (O and LSE); +inf is the limit (the
/// sink takes the whole row: O = 0, LSE = +inf) and -inf the answer without the sink, where a
/// row may instead be NaN; every other head is exact. Never a finite value off the limit.
std::string model_words(const std::string& reason);
/// The library's name of a field the generator makes a rank disagree on ("sinks" is agreed as
/// given or not: the values are the caller's to keep alike).
std::string library_field_name(const std::string& field);

/// The mesh a policy runs on for `world` ranks, by the documented rules: {U, R}, or {0, 0}
/// when the degrees do not fit.
std::pair<int, int> model_mesh(const PolicyChoice& p, int world);
/// {ring rank, Ulysses rank} of world rank w on a U x R mesh (any placement other than
/// ulysses_adjacent counts as ring_adjacent, as MeshConfig reads it).
std::pair<int, int> model_coords(const PolicyChoice& p, int U, int R, int w);

/// Sequence lengths summed in 128 bits (they may pass 2^63).
__int128 total_q(const AttentionCase& c);
/// K/V lengths summed in 128 bits.
__int128 total_kv(const AttentionCase& c);

/// The readable name of a policy choice ("AnythingPolicy<UnifiedPolicy<Zigzag>>{2,0,ring_adjacent}").
std::string policy_name(const PolicyChoice& p);
/// The readable name of a kernel choice.
std::string kernel_name(KernelKind k, int isa);

}  // namespace seqpar::fuzz
