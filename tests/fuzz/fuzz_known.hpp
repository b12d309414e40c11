#pragma once
// The known defect classes: which class a failure belongs to, so that a run can tell a known
// defect from a new one, and (with --skip) keep known triggers out of the cases.
#include <string>

#include "fuzz/fuzz_case.hpp"
#include "fuzz/fuzz_report.hpp"

namespace seqpar::fuzz {

/// The known defect class (one letter) a failure of case `c` belongs to, or "" for a new one.
/// The letters, and what the generator leaves out for each with --skip:
///  a  a huge window side (> 2^61) wraps the mask (crashes CpuFlashKernel's decode path)
///  b  DecodePlan::advance half-applies a refused advance, accepts INT64_MAX
///  c  NaN in Q of a row that sees no key poisons dK (CpuFlashKernel backward)
///  d  a time-out above ~9.2e12 ms expires at once
///  e  documents whose lengths sum past 2^63 are accepted; decode kv_len + new_tokens wraps
///  f  the member can_implement of a kernel without supports_masks accepts masks plan refuses
///  g  owner and slot take any position
///  h  decode accepts a non-finite scale and a DecodeExchange outside the enum
///  i  disagreement errors print hashes instead of values
/// Found by this fuzzer (not yet fixed when it was written):
///  j  AnythingPolicy with the stripe layout: can_implement accepts lengths that do not
///     follow from the total, plan refuses them (SequenceLayout's check)
///  k  a finite scale whose scores pass the float range (|scale| ~1e38 and up; ~1e300 in
///     double decode) gives NaN or an infinite LSE instead of a refusal or a finite answer
///  l  LocalLengths::kv below -1 is taken as "same as q" instead of refused
///  m  enums outside their range accepted by plan: MeshPlacement (read as ring_adjacent),
///     DType of an untyped attention plan and of a decode plan
///  n  CpuFlashKernel with 2+ threads divides by zero (SIGFPE) on batch 0 with 1-16 query
///     rows (its decode path's chunk count)
///  o  the size check's words: lengths summing past 2^63 are refused naming the wrapped
///     global length; batch INT64_MAX with empty sequences is refused as "exceeds 2^58 bytes"
///  p  Unified degrees whose product wraps int are accepted: {INT_MAX, INT_MAX} on one rank
///     constructs, and plan throws std::bad_alloc
///  q  plan refuses on some ranks only when the kernel cannot allocate its scratch (a huge
///     batch: the ranks whose share needs scratch throw, the others return a plan and wait)
/// Found when the fuzzer learnt today's models' features (D_v, soft-cap, sinks):
///  r  (fixed) CpuFlashKernel with a legal soft-cap at the ends of the range (denormal or tiny, or past
///     the float range in float) gives NaN, or no cap at all: it divides the scale by the cap
///     and casts the cap to the element type (fixed: plans refuse a cap outside 2^-32..2^32)
///  s  (fixed) a head_dim_v so wide that the kernel's scratch passes vector::max_size (with batch 0 the
///     size rules pass) escapes plan as std::length_error, not ConfigError (allocation_disagreement
///     caught std::bad_alloc only; fixed: it takes std::length_error as the same refusal)
///  t  (fixed) with sinks and with_lse, a rank holding no query rows failed forward with
///     "slot sink_lse was not declared" (its empty LSE view reads as absent)
std::string known_class(const FuzzCase& c, const Failure& f);

/// Every class letter known_class can return.
inline constexpr const char* known_letters = "abcdefghijklmnopqrst";

}  // namespace seqpar::fuzz
