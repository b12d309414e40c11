/// \file
/// seqpar_demo's f32 runs (runs.hpp), for every communicator.

#include "runs.hpp"

namespace seqpar_demo {

SEQPAR_DEMO_RUNS(, float);

}  // namespace seqpar_demo
