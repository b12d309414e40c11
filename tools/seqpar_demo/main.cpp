/// \file
/// seqpar_demo: runs one policy on a random attention problem over MPI processes or threads,
/// checks it against the exact reference, and reports the error, the traffic and the time.
/// Its command line is a stable interface (scripts and tests parse the last line, RESULT).
///
/// The files: options (the command line), attention.hpp (from options to policy types),
/// forward_run.hpp, decode_run.hpp and serve_run.hpp (one rank's run), report (tables and
/// RESULT), runs.hpp (the runs by element type, each compiled apart), and this one: the inputs,
/// threads or MPI, and the exit status.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common.hpp"
#include "models.hpp"
#include "options.hpp"
#include "report.hpp"
#include "runs.hpp"
#include "seqpar/seqpar.hpp"

namespace seqpar_demo {
namespace {

/// Runs the options' dtype and policy on one rank.
template <class Comm>
int run_options(Comm& comm, const Options& o, const ex::GlobalInputs& g, int sweep_at) {
  check_degrees(o, comm.size());
  switch (o.dtype) {
    case DType::f64: return run_typed<double>(comm, o, g, sweep_at);
    case DType::bf16: return run_typed<bf16>(comm, o, g, sweep_at);
    default: return run_typed<float>(comm, o, g, sweep_at);
  }
}

/// The global shape of run `at` (the sweep's length `at`, or the one run). Decode: one
/// sequence holding every prompt and its steps' tokens, as causal documents.
ex::GlobalShape shape_for(const Options& o, std::size_t at) {
  ex::GlobalShape shape = ex::make_case(o.lengths()[at], o.heads, o.kv_heads, o.head_dim, o.causal, o.seed, o.batch);
  shape.seq_kv = o.kv_seq ? o.kv_seq : -1;
  shape.causal_align = o.causal_align;
  shape.window = o.window;
  if (!o.docs.empty()) shape.documents = {o.docs};
  shape.kv_valid = o.kv_valid;
  shape.head_dim_v = o.head_dim_v;
  shape.scale = o.scale;
  shape.softcap = o.softcap;
  if (o.sinks) {  // learned logits of either sign, some large enough to take a visible share of a row
    std::mt19937_64 rng(o.seed * 31 + 7);
    std::uniform_real_distribution<float> logit(-4.f, 4.f);
    shape.sinks.resize(static_cast<std::size_t>(o.heads));
    for (float& x : shape.sinks) x = logit(rng);
  }
  if (o.decode) {
    shape.batch = 1;
    shape.seq_q = 0;
    shape.documents = {{}};
    for (std::int64_t n : o.kv_len) {
      shape.documents.front().push_back(n + o.steps * o.new_tokens);
      shape.seq_q += n + o.steps * o.new_tokens;
    }
  }
  return shape;
}

/// The global inputs of run `at`. They come from the seed alone, so every process makes the
/// same global tensors.
ex::GlobalInputs inputs_for(const Options& o, std::size_t at) {
  if (o.serve) return {};  // serve_rank makes each admission's inputs itself
  const ex::GlobalShape shape = shape_for(o, at);
  // bf16 runs: the reference sees the inputs the kernel sees, rounded once to bf16.
  ex::GlobalInputs g = o.dtype == DType::bf16 ? ex::make_inputs<bf16>(shape) : ex::make_inputs(shape);
  if (o.v_in_k) {  // MLA's latent cache: V is the first D_v columns of each K row
    const std::int64_t rows = shape.batch * shape.kv_len() * shape.kv_head_count(), D = shape.head_dim,
                       Dv = shape.value_dim();
    for (std::int64_t r = 0; r < rows; ++r)
      std::copy_n(g.k.begin() + r * D, Dv, g.v.begin() + r * Dv);
  }
  return g;
}

/// True when an MPI launcher started this process (mpirun, mpiexec, srun).
bool under_mpi_launcher() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "SLURM_STEP_NUM_TASKS"})
    if (std::getenv(v)) return true;
  return false;
}

/// Prints error `e` for a command-line user (`kind`: "" or "error: "); returns exit status 2.
int report(const std::exception& e, const char* kind, bool verbose) {
  std::fprintf(stderr, "seqpar_demo: %s%s\n", kind, user_message(e, verbose).c_str());
  return 2;
}

/// The runs the options ask for: the options themselves, or one per layer kind of --model.
std::vector<Options> runs_of(const Options& o) {
  if (o.model.empty()) return {o};
  std::vector<Options> runs = model_runs(o);
  for (Options& r : runs) check_combinations(r);
  return runs;
}

/// Runs every run and length with ranks as threads; returns the worst rank's exit status.
int run_threads(Options& options) {
  options.comm = "threads";
  const int ranks = options.ranks ? options.ranks : 4;
  // A thread and a copy of the inputs per rank: past this, memory runs out before a clear reason.
  constexpr int most_thread_ranks = 1024;
  if (ranks > most_thread_ranks)
    throw UsageError("--ranks: at most " + std::to_string(most_thread_ranks) + " thread ranks in one process, got " +
                     std::to_string(ranks) + " (--advise models up to " + std::to_string(most_advised_ranks) +
                     " without running them)");
  int worst = 0;
  for (const Options& o : runs_of(options))
    for (std::size_t at = 0; at < o.lengths().size(); ++at) {  // a failed check goes on to the next length
      const ex::GlobalInputs g = inputs_for(o, at);
      const int sweep_at = o.sweep.empty() ? -1 : static_cast<int>(at);
      std::vector<int> status(static_cast<std::size_t>(ranks), 0);
      g_planned = false;
      run_ranks(ranks, [&](ThreadCommunicator& comm) {
        status[static_cast<std::size_t>(comm.rank())] = run_options(comm, o, g, sweep_at);
      });
      worst = std::max(worst, *std::max_element(status.begin(), status.end()));
    }
  print_results();
  return worst;
}

#ifdef SEQPAR_HAS_MPI
/// Runs every length on MPI_COMM_WORLD; returns this rank's exit status (an error after the
/// plan, which the other ranks may not share, ends the job instead).
int run_mpi(int& argc, char**& argv, Options& options) {
  options.comm = "mpi";
  const Options& o = options;  // the run options' shared flags (verbose)
  MpiSession session(argc, argv);
  int status = 0, rank = 0;
  {
    MpiCommunicator world(MPI_COMM_WORLD);
    rank = world.rank();
    try {
      // A failed check goes on to the next length; an error ends the sweep.
      for (const Options& r : runs_of(options))
        for (std::size_t at = 0; at < r.lengths().size(); ++at) {
          g_planned = false;
          status = std::max(status, run_options(world, r, inputs_for(r, at), r.sweep.empty() ? -1 : static_cast<int>(at)));
        }
      print_results();
    } catch (const UsageError& e) {
      print_results();
      status = rank == 0 ? report(e, "", o.verbose) : 2;  // every rank failed alike; one reports
      MPI_Barrier(MPI_COMM_WORLD);  // no rank exits (and gets the job killed) before it has
    } catch (const std::exception& e) {
      // plan's checks are collective (every rank throws the same ConfigError); after the plan,
      // forward's and backward's are local: the others may be waiting on this rank, so end the job.
      if (!g_planned && dynamic_cast<const ConfigError*>(&e)) {
        print_results();
        status = rank == 0 ? report(e, "", o.verbose) : 2;
        MPI_Barrier(MPI_COMM_WORLD);
      } else {
        std::fprintf(stderr, "seqpar_demo: rank %d: %s\n", rank, user_message(e, o.verbose).c_str());
        MPI_Abort(MPI_COMM_WORLD, 3);
      }
    }
  }
  return status;
}
#endif

}  // namespace
}  // namespace seqpar_demo

int main(int argc, char** argv) {
  using namespace seqpar_demo;
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const UsageError& e) {
    // Parsed identically on every rank; under mpirun only the first process should speak,
    // but MPI is not initialised yet, so use the launcher's rank variable when it has one.
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (!rank) rank = std::getenv("PMI_RANK");
    if (!rank || std::string_view(rank) == "0") report(e, "", false);
    return 2;
  }
  if (o.model == "list") {
    print_model_list();
    return 0;
  }
  if (o.advise) {
    try {
      return print_advice(o, shape_for(o, 0));
    } catch (const std::exception& e) {
      return report(e, "", o.verbose);
    }
  }
  if (o.comm.empty()) {
#ifdef SEQPAR_HAS_MPI
    o.comm = under_mpi_launcher() ? "mpi" : "threads";
#else
    o.comm = "threads";
#endif
  }
  try {
    if (o.comm == "mpi") {
#ifdef SEQPAR_HAS_MPI
      return run_mpi(argc, argv, o);
#else
      throw UsageError("--comm mpi: this seqpar_demo was built without MPI (configure with SEQPAR_ENABLE_MPI=ON)");
#endif
    }
    return run_threads(o);
  } catch (const UsageError& e) {
    print_results();
    return report(e, "", o.verbose);
  } catch (const ConfigError& e) {
    print_results();
    return report(e, "", o.verbose);
  } catch (const std::exception& e) {
    return report(e, "error: ", o.verbose);
  }
}
