// unified_mpi: USP (Unified Sequence Parallelism) on a 2 x 2 mesh under MPI.
//   mpirun -np 4 build/examples/unified_mpi
// The 4 ranks form ulysses_degree x ring_degree = 2 x 2. Ranks {0,1} and {2,3} are Ulysses
// groups (adjacent ranks: on one node their all-to-all uses the fast links); ranks {0,2} and
// {1,3} are rings, whose K/V traffic is the part that crosses nodes. With causal masking the
// zigzag layout balances the work: ring rank r takes chunks r and 2R-1-r, split across its
// Ulysses group.

#include <cstdio>

#include "cli.hpp"     // argument checks and the verdict line
#include "end_job_on_error.hpp"  // the README's catch, report, MPI_Abort, for the whole program
#include "common.hpp"  // random inputs and the reference check
#include "seqpar/comm/mpi_communicator.hpp"
#include "seqpar/seqpar.hpp"

using namespace seqpar;

int main(int argc, char** argv) {
  examples::Args args(argc, argv, "mpirun -np 4 unified_mpi   (no arguments)");
  if (const auto exit = args.finish()) return *exit;  // before MPI starts, on every rank alike
  MpiSession mpi(argc, argv);
  examples::end_job_on_error(argv[0]);  // an error nobody catches: one line, MPI_Abort on every rank
  MpiCommunicator world(MPI_COMM_WORLD);
  if (world.size() != 4) {
    if (world.rank() == 0) std::fprintf(stderr, "unified_mpi: run with 4 ranks (mpirun -np 4), got %d\n", world.size());
    return 2;
  }
  using Policy = UnifiedPolicy<Zigzag>;
  const Policy policy{.ulysses_degree = 2, .ring_degree = 2};
  // Collective: splits the world into the Ulysses and ring sub-communicators.
  SequenceParallelAttention<Policy, MpiCommunicator, CpuFlashKernel> attn(world, policy);

  examples::GlobalShape shape;
  shape.seq_q = 2048;
  shape.heads = 8;
  shape.causal = true;
  const Plan plan = attn.plan(shape.problem<float>(), {shape.seq_q / 4});

  // One forward on this rank's slice, checked against the exact reference (common.hpp spells
  // out the same calls as ulysses_mpi.cpp).
  world.stats().reset();
  const examples::ErrorStats mine = examples::forward_error<float>(attn, plan, examples::make_inputs(shape));
  const examples::ErrorStats err = examples::reduce_errors(world, mine);
  const std::uint64_t sent = world.stats().bytes_sent;  // world + both sub-groups
  const auto rows = examples::gather_rows(world, {plan.ring_rank(), plan.ulysses_rank(), attn.ulysses_comm().size(),
                                                  attn.ring_comm().size(), static_cast<std::int64_t>(sent)});
  for (int r = 0; r < 4 && world.rank() == 0; ++r)
    std::printf("unified_mpi: rank %d = (ring %lld, ulysses %lld): ulysses group of %lld, ring of %lld, "
                "sent %lld bytes (formula %zu), %lld score pairs\n",
                r, static_cast<long long>(rows[r][0]), static_cast<long long>(rows[r][1]),
                static_cast<long long>(rows[r][2]), static_cast<long long>(rows[r][3]),
                static_cast<long long>(rows[r][4]), plan.forward_bytes(r), static_cast<long long>(plan.work(r)));
  if (world.rank() == 0) std::printf("unified_mpi: max_rel_err=%.3e\n", err.rel());
  return examples::verdict("unified_mpi", err.rel() <= 1e-5, world.rank() == 0);
}
