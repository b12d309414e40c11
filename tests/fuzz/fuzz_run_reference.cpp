// The attention runner on ReferenceKernel and on a kernel without supports_masks (its own
// translation unit: the engines of each kernel compile in parallel).
#include "fuzz/fuzz_attention.hpp"

namespace seqpar::fuzz {

void run_attention_reference(const AttentionCase& c, Report& report) {
  if (c.kernel == KernelKind::causal_only) run_attention_with<CausalOnlyKernel>(c, report);
  else run_attention_with<ReferenceKernel>(c, report);
}

}  // namespace seqpar::fuzz
