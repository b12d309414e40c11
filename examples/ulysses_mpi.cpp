// ulysses_mpi: the smallest host program that runs seqpar under MPI.
//   mpirun -np 4 build/examples/ulysses_mpi
// Every rank holds seq/P tokens of Q, K and V with all heads. UlyssesPolicy trades them
// (all-to-all) for heads/P heads of the whole sequence, attends locally, and trades the
// output back, so each rank ends with the exact attention output of its own tokens.

#include <cstdio>
#include <vector>

#include "cli.hpp"     // argument checks and the verdict line
#include "end_job_on_error.hpp"  // the README's catch, report, MPI_Abort, for the whole program
#include "common.hpp"  // random inputs and the reference check only
#include "seqpar/comm/mpi_communicator.hpp"
#include "seqpar/seqpar.hpp"

using namespace seqpar;

int main(int argc, char** argv) {
  examples::Args args(argc, argv, "mpirun -np <ranks> ulysses_mpi   (no arguments)");
  if (const auto exit = args.finish()) return *exit;  // before MPI starts, on every rank alike
  MpiSession mpi(argc, argv);              // MPI_Init / MPI_Finalize
  examples::end_job_on_error(argv[0]);  // an error nobody catches: one line, MPI_Abort on every rank
  MpiCommunicator world(MPI_COMM_WORLD);   // errors become seqpar::MpiError
  const int P = world.size(), me = world.rank();

  // Collective: every rank builds the same attention object (it splits nothing for Ulysses).
  SequenceParallelAttention<UlyssesPolicy, MpiCommunicator, CpuFlashKernel> attn(world);

  // Global problem: 1 x (256 P) tokens, 2P heads of dimension 64. Plain Ulysses needs the
  // sequence and the heads to divide by P (AnythingPolicy<UlyssesPolicy> lifts that).
  examples::GlobalShape shape;
  shape.seq_q = 256 * P;
  shape.heads = 2 * P;
  const std::int64_t B = shape.batch, L = shape.seq_q / P, H = shape.heads, D = shape.head_dim;
  const Plan plan = attn.plan(shape.problem<float>(), {L});  // collective; validates all ranks agree

  // This rank's tokens (a real program already holds them): rows plan.q_positions(me).
  const examples::GlobalInputs g = examples::make_inputs(shape);
  const PositionMap mine = plan.q_positions(me);
  examples::LocalSlices<float> x = examples::local_slices<float>(g, mine, plan.kv_positions(me));

  std::vector<std::byte> workspace(plan.workspace_bytes());  // once per plan; forward allocates nothing
  using In = TensorView<const float>;
  attn.forward<float>(plan, In::bshd(x.q.data(), B, L, H, D), In::bshd(x.k.data(), B, L, H, D),
                      In::bshd(x.v.data(), B, L, H, D), TensorView<float>::bshd(x.out.data(), B, L, H, D),
                      workspace);

  // Check against the exact (double) attention of these rows; merged over the ranks.
  const examples::ErrorStats err = examples::reduce_errors(world, examples::compare(x.out, examples::reference_rows(g, mine)));
  if (me == 0)
    std::printf("ulysses_mpi: %d ranks, %lld tokens, %lld heads: rank 0 sent %llu bytes, max_rel_err=%.3e\n", P,
                static_cast<long long>(shape.seq_q), static_cast<long long>(H),
                static_cast<unsigned long long>(world.stats().bytes_sent), err.rel());
  return examples::verdict("ulysses_mpi", err.rel() <= 1e-5, me == 0);
}
