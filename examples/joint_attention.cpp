// joint_attention: one toy MM-DiT attention step across ranks, with lengths that divide nothing.
//   mpirun -np 4 build/examples/joint_attention [text_tokens]
// A 1008 x 1008 image in 16 x 16 patches is 63 x 63 = 3969 tokens; the prompt adds a variable
// number of text tokens; MM-DiT attends over the concatenation [text; image] (no mask). Here
// rank 0 also holds the prompt, so local lengths differ by far more than one token, and 3 heads
// do not divide by the Ulysses degree: AnythingPolicy runs it exactly, without padding.

#include <cstdio>
#include <vector>

#include "cli.hpp"     // argument checks and the verdict line
#include "end_job_on_error.hpp"  // the README's catch, report, MPI_Abort, for the whole program
#include "common.hpp"  // random inputs and the reference
#include "seqpar/comm/mpi_communicator.hpp"
#include "seqpar/seqpar.hpp"

using namespace seqpar;

int main(int argc, char** argv) {
  // The one argument: text tokens, a whole number from 0 to 100000 (default 77).
  examples::Args args(argc, argv, "mpirun -np <ranks> joint_attention [text_tokens]   (0 to 100000; default 77)");
  const std::vector<std::int64_t> given = args.positional(0, 100000, 1);
  if (const auto exit = args.finish()) return *exit;  // before MPI starts, on every rank alike
  const std::int64_t text = given.empty() ? 77 : given[0];
  MpiSession mpi(argc, argv);
  examples::end_job_on_error(argv[0]);  // an error nobody catches: one line, MPI_Abort on every rank
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size(), me = world.rank();
  const std::int64_t image = 63 * 63;

  // USP mesh: Ulysses pairs when P is even, a ring across them.
  using Policy = AnythingPolicy<UnifiedPolicy<>>;
  const int U = P % 2 == 0 ? 2 : 1;
  SequenceParallelAttention<Policy, MpiCommunicator, CpuFlashKernel> attn(world, Policy{{.ulysses_degree = U, .ring_degree = P / U}});

  examples::GlobalShape shape;
  shape.seq_q = text + image;
  shape.heads = 3;
  shape.head_dim = 32;
  // Rank 0: the prompt and its share of the image; the others: their share of the image.
  const std::int64_t mine = split_sequence(image, attn.mesh())[static_cast<std::size_t>(me)] + (me == 0 ? text : 0);
  const Plan plan = attn.plan(shape.problem<float>(), {mine});  // lengths exchanged here, once

  const examples::GlobalInputs g = examples::make_inputs(shape);
  examples::LocalSlices<float> x = examples::local_slices<float>(g, plan.q_positions(me), plan.kv_positions(me));
  std::vector<std::byte> workspace(plan.workspace_bytes());
  const std::int64_t H = shape.heads, D = shape.head_dim;
  using In = TensorView<const float>;
  attn.forward<float>(plan, In::bshd(x.q.data(), 1, mine, H, D), In::bshd(x.k.data(), 1, mine, H, D),
                      In::bshd(x.v.data(), 1, mine, H, D), TensorView<float>::bshd(x.out.data(), 1, mine, H, D),
                      workspace);

  // Gather every rank's rows to rank 0, placed at their global positions (from the plan).
  std::vector<int> counts(static_cast<std::size_t>(P)), displs(static_cast<std::size_t>(P));
  for (int w = 0, off = 0; w < P; off += counts[w++]) {
    counts[w] = static_cast<int>(plan.q_positions(w).size() * H * D);
    displs[w] = off;
  }
  std::vector<float> gathered(me == 0 ? static_cast<std::size_t>(shape.seq_q * H * D) : 0);
  MPI_Gatherv(x.out.data(), counts[me], MPI_FLOAT, gathered.data(), counts.data(), displs.data(), MPI_FLOAT, 0,
              world.native());
  if (me != 0) return 0;
  std::vector<float> out(gathered.size());
  for (int w = 0; w < P; ++w) {
    const PositionMap pos = plan.q_positions(w);
    gather_sequence(TensorView<const float>::bshd(gathered.data() + displs[w], 1, pos.size(), H, D), pos,
                    TensorView<float>::bshd(out.data(), 1, shape.seq_q, H, D));
  }
  const double err = examples::compare(out, examples::reference_rows(g, PositionMap::run(shape.seq_q, 0))).rel();
  std::printf("joint_attention: %lld text + %lld image tokens on %d ranks (rank 0 holds %lld, rank %d holds %lld), "
              "mesh %d x %d, max_rel_err=%.3e (%s the tolerance 1e-5 against the exact reference)\n",
              static_cast<long long>(text), static_cast<long long>(image), P, static_cast<long long>(plan.local_q()),
              P - 1, static_cast<long long>(plan.q_positions(P - 1).size()), U, P / U, err,
              err <= 1e-5 ? "within" : "ABOVE");
  return examples::verdict("joint_attention", err <= 1e-5);
}
