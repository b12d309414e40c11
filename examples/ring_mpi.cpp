// ring_mpi: causal ring attention with the zigzag layout under MPI.
//   mpirun -np 4 build/examples/ring_mpi
// Q stays on its rank; K/V blocks travel the ring (the next one in flight while the current
// one computes) and the partial results merge by their log-sum-exp. Zigzag gives rank r the
// chunks r and 2P-1-r of 2P, so every rank has the same causal work. The layout decides
// which global positions a rank holds: feed those to RoPE, and read them from the plan.

#include <cstdio>
#include <vector>

#include "cli.hpp"     // argument checks and the verdict line
#include "end_job_on_error.hpp"  // the README's catch, report, MPI_Abort, for the whole program
#include "common.hpp"  // random inputs and the reference check only
#include "seqpar/comm/mpi_communicator.hpp"
#include "seqpar/seqpar.hpp"

using namespace seqpar;

int main(int argc, char** argv) {
  examples::Args args(argc, argv, "mpirun -np <ranks> ring_mpi   (no arguments)");
  if (const auto exit = args.finish()) return *exit;  // before MPI starts, on every rank alike
  MpiSession mpi(argc, argv);
  examples::end_job_on_error(argv[0]);  // an error nobody catches: one line, MPI_Abort on every rank
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size(), me = world.rank();
  SequenceParallelAttention<RingPolicy<Zigzag>, MpiCommunicator, CpuFlashKernel> attn(world);

  examples::GlobalShape shape;  // 512 P tokens, 8 query heads sharing 2 K/V heads (GQA)
  shape.seq_q = 512 * P;
  shape.heads = 8;
  shape.kv_heads = 2;
  shape.causal = true;
  AttentionProblem problem = shape.problem<float>();
  problem.with_lse = true;  // also return the LSE, e.g. for a backward pass or a later merge
  const std::int64_t B = shape.batch, L = shape.seq_q / P, H = shape.heads, K = 2, D = shape.head_dim;
  const Plan plan = attn.plan(problem, {L});

  // Rank r holds two runs of global positions (zigzag); RoPE must use exactly these.
  const PositionMap mine = plan.q_positions(me);
  const auto runs = examples::gather_rows(world, {mine.seg[0].start, mine.seg[0].count, mine.seg[1].start,
                                                  mine.seg[1].count, plan.work(me)});
  for (int r = 0; r < P && me == 0; ++r)
    std::printf("ring_mpi: rank %d holds positions [%lld, +%lld) and [%lld, +%lld): %lld score pairs\n", r,
                static_cast<long long>(runs[r][0]), static_cast<long long>(runs[r][1]),
                static_cast<long long>(runs[r][2]), static_cast<long long>(runs[r][3]),
                static_cast<long long>(runs[r][4]));

  const examples::GlobalInputs g = examples::make_inputs(shape);
  examples::LocalSlices<float> x = examples::local_slices<float>(g, mine, plan.kv_positions(me));
  std::vector<float> lse(static_cast<std::size_t>(B * L * H));  // [B, H, L] (FlashAttention's order)
  std::vector<std::byte> workspace(plan.workspace_bytes());
  using In = TensorView<const float>;
  attn.forward<float>(plan, In::bshd(x.q.data(), B, L, H, D), In::bshd(x.k.data(), B, L, K, D),
                      In::bshd(x.v.data(), B, L, K, D), TensorView<float>::bshd(x.out.data(), B, L, H, D),
                      TensorView<float>::lse_bhs(lse.data(), B, L, H), workspace);

  const examples::ErrorStats err = examples::reduce_errors(world, examples::compare(x.out, examples::reference_rows(g, mine)));
  if (me == 0)
    std::printf("ring_mpi: %d ranks, %lld tokens, causal zigzag: rank 0 sent %llu bytes (formula %zu), max_rel_err=%.3e\n",
                P, static_cast<long long>(shape.seq_q), static_cast<unsigned long long>(world.stats().bytes_sent),
                plan.forward_bytes(0), err.rel());
  return examples::verdict("ring_mpi", err.rel() <= 1e-5, me == 0);
}
