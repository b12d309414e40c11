/// \file
/// seqpar_demo's bf16 runs (forward and backward; no decode or serve) (runs.hpp), for every communicator.

#include "runs.hpp"

namespace seqpar_demo {

SEQPAR_DEMO_RUNS(, bf16);

}  // namespace seqpar_demo
