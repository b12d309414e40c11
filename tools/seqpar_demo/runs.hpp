#pragma once
/// \file
/// The runs of seqpar_demo by element type, compiled apart: runs_f32.cpp, runs_f64.cpp and runs_bf16.cpp each
/// instantiate run_typed for one type and every communicator (most of the demo's build), so
/// that two cores build the demo in about half the time of one (CMakeLists.txt: the README's
/// first command builds it). Every other file sees the instantiations as extern.

#include <type_traits>

#include "auto_policy.hpp"
#include "common.hpp"
#include "decode_run.hpp"
#include "forward_run.hpp"
#include "options.hpp"
#include "serve_run.hpp"
#include "seqpar/seqpar.hpp"
#ifdef SEQPAR_HAS_MPI
#include "seqpar/comm/mpi_communicator.hpp"
#endif

namespace seqpar_demo {

/// Runs the options' policy (or decode, or serve) with element type T on one rank.
template <class T, class Comm>
int run_typed(Comm& comm, const Options& o, const ex::GlobalInputs& g, int sweep_at) {
  if (o.policy_auto) return run_rank<T>(comm, choose_policy<T>(comm, o, g.shape), g, sweep_at);
  if constexpr (std::is_same_v<T, bf16>) {  // parse_options refuses --decode and --serve in bf16
    return run_rank<T>(comm, o, g, sweep_at);
  } else {
    if (o.serve) return serve_rank<T>(comm, o);
    if (o.decode) return decode_rank<T>(comm, o, g);
    return run_rank<T>(comm, o, g, sweep_at);
  }
}

/// The explicit instantiations of run_typed<T> for every communicator, each preceded by `prefix`:
/// `extern` here, nothing in the runs_*.cpp files (the definitions).
#define SEQPAR_DEMO_RUN_TYPED(prefix, T, Comm) \
  prefix template int run_typed<T, Comm>(Comm&, const Options&, const ex::GlobalInputs&, int)
#ifdef SEQPAR_HAS_MPI
#define SEQPAR_DEMO_RUNS(prefix, T)                     \
  SEQPAR_DEMO_RUN_TYPED(prefix, T, ThreadCommunicator); \
  SEQPAR_DEMO_RUN_TYPED(prefix, T, MpiCommunicator)
#else
#define SEQPAR_DEMO_RUNS(prefix, T) SEQPAR_DEMO_RUN_TYPED(prefix, T, ThreadCommunicator)
#endif

SEQPAR_DEMO_RUNS(extern, float);
SEQPAR_DEMO_RUNS(extern, double);
SEQPAR_DEMO_RUNS(extern, bf16);

}  // namespace seqpar_demo
