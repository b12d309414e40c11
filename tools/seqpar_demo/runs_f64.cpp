/// \file
/// seqpar_demo's f64 runs (runs.hpp), for every communicator.

#include "runs.hpp"

namespace seqpar_demo {

SEQPAR_DEMO_RUNS(, double);

}  // namespace seqpar_demo
