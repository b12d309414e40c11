// The attention runner on CpuFlashKernel (its own translation unit: the kernel's vector
// code is the longest to compile).
#include "fuzz/fuzz_attention.hpp"

namespace seqpar::fuzz {

void run_attention_cpu(const AttentionCase& c, Report& report) { run_attention_with<CpuFlashKernel>(c, report); }

}  // namespace seqpar::fuzz
