// packed_documents: one LLM training step's attention over packed documents, forward and backward.
//   mpirun -np 4 build/examples/packed_documents [--window N] [document_length ...]
// Pretraining packs documents of uneven length into one sequence (here 3000, 700, 4100 and 392
// tokens: 8192) and attends causally *within* each document: no token sees another document.
// The documents (and optionally a sliding window) are part of the problem every rank agrees on
// in plan. The layout decides the balance: contiguous blocks leave the rank that holds the long
// document most of the work, while Stripe (token t on rank t mod P) gives every rank a share of
// every document. plan.work(r) is rank r's count of visible score pairs; masked blocks cost
// nothing. AnythingPolicy lets the total be any length on any number of ranks.

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cli.hpp"     // argument checks and the verdict line
#include "end_job_on_error.hpp"  // the README's catch, report, MPI_Abort, for the whole program
#include "common.hpp"  // random inputs and the reference check
#include "seqpar/comm/mpi_communicator.hpp"
#include "seqpar/seqpar.hpp"

using namespace seqpar;

/// max/mean of plan.work over the ranks: 1 is perfect balance.
static double imbalance(const Plan& plan, int P) {
  std::int64_t max = 0, sum = 0;
  for (int r = 0; r < P; ++r) max = std::max(max, plan.work(r)), sum += plan.work(r);
  return sum > 0 ? static_cast<double>(max) * P / static_cast<double>(sum) : 1.0;
}

int main(int argc, char** argv) {
  examples::Args args(argc, argv,
                      "mpirun -np <ranks> packed_documents [--window N] [document_length ...]\n"
                      "  document_length  tokens of each packed document: 1 to 32768 each, at most 64 documents,\n"
                      "                   32768 tokens in all (default: 3000 700 4100 392)\n"
                      "  --window N       a token also sees at most the N tokens before it (0 to 32768; default: all)");
  const std::int64_t window = args.option("--window", 0, 32768, -1);
  std::vector<std::int64_t> documents = args.positional(1, 32768, 64);
  if (documents.empty()) documents = {3000, 700, 4100, 392};
  std::int64_t S = 0;
  for (std::int64_t n : documents) S += n;
  if (S > 32768) args.reject("the documents add up to " + std::to_string(S) + " tokens, more than 32768");
  if (const auto exit = args.finish()) return *exit;  // before MPI starts, on every rank alike

  MpiSession mpi(argc, argv);
  examples::end_job_on_error(argv[0]);  // an error nobody catches: one line, MPI_Abort on every rank
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size(), me = world.rank();
  using Policy = AnythingPolicy<RingPolicy<Stripe>>;
  SequenceParallelAttention<Policy, MpiCommunicator, CpuFlashKernel> attn(world);

  examples::GlobalShape shape;  // 4 query heads sharing 2 K/V heads (GQA), small for the check's sake
  shape.seq_q = S;
  shape.heads = 4;
  shape.kv_heads = 2;
  shape.head_dim = 32;
  shape.causal = true;
  shape.documents = {documents};  // one list, shared by the batch
  shape.window = {window, -1};    // {-1, -1}: no window
  const AttentionProblem problem = shape.problem<float>(/*with_lse=*/true);  // backward needs the LSE
  // Stripe's lengths follow from the total: rank r holds the positions r, r + P, r + 2P, ...
  // (a model with positions restarting per document subtracts the document's start for RoPE).
  const std::int64_t L = split_sequence(S, attn.mesh())[static_cast<std::size_t>(me)];
  const Plan plan = attn.plan(problem, {L});

  if (me == 0) {
    std::printf("packed_documents: %zu documents in %lld tokens, causal within each", documents.size(),
                static_cast<long long>(S));
    if (window >= 0) std::printf(", window %lld", static_cast<long long>(window));
    std::printf(", %d ranks, Stripe layout\n", P);
    for (int r = 0; r < P; ++r)
      std::printf("packed_documents: rank %d holds %lld tokens, plan.work = %lld score pairs\n", r,
                  static_cast<long long>(plan.q_positions(r).size()), static_cast<long long>(plan.work(r)));
  }
  // For comparison, the plan of the same problem with contiguous blocks (plans are collective).
  SequenceParallelAttention<AnythingPolicy<RingPolicy<Contiguous>>, MpiCommunicator, CpuFlashKernel> blocks(world);
  const Plan contiguous = blocks.plan(problem, {L});
  if (me == 0)
    std::printf("packed_documents: work max/mean = %.3f with Stripe (contiguous blocks: %.3f)\n", imbalance(plan, P),
                imbalance(contiguous, P));

  // The step: forward keeps out and the LSE, backward turns dO into dQ, dK, dV.
  const examples::GlobalInputs g = examples::make_inputs(shape);
  const PositionMap q_rows = plan.q_positions(me), kv_rows = plan.kv_positions(me);
  examples::LocalSlices<float> x = examples::local_slices<float>(g, q_rows, kv_rows);
  const std::int64_t B = shape.batch, H = shape.heads, K = shape.kv_heads, D = shape.head_dim;
  const std::vector<float> dout = examples::take_rows<float>(g.dout, B, S, H, D, q_rows);
  std::vector<float> lse(static_cast<std::size_t>(B * L * H)), dq(x.q.size()), dk(x.k.size()), dv(x.v.size());
  std::vector<std::byte> workspace(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
  using In = TensorView<const float>;
  using Out = TensorView<float>;
  attn.forward<float>(plan, In::bshd(x.q.data(), B, L, H, D), In::bshd(x.k.data(), B, L, K, D),
                      In::bshd(x.v.data(), B, L, K, D), Out::bshd(x.out.data(), B, L, H, D),
                      Out::lse_bhs(lse.data(), B, L, H), workspace);
  attn.backward<float>(plan, In::bshd(dout.data(), B, L, H, D), In::bshd(x.q.data(), B, L, H, D),
                       In::bshd(x.k.data(), B, L, K, D), In::bshd(x.v.data(), B, L, K, D),
                       In::bshd(x.out.data(), B, L, H, D), In::lse_bhs(lse.data(), B, L, H),
                       Out::bshd(dq.data(), B, L, H, D), Out::bshd(dk.data(), B, L, K, D),
                       Out::bshd(dv.data(), B, L, K, D), workspace);

  // Check every rank's rows against the exact (double) attention with the same mask.
  auto error = [&](const std::vector<float>& got, const std::vector<double>& want) {
    return examples::reduce_errors(world, examples::compare(got, want)).rel();
  };
  const double out_err = error(x.out, examples::reference_rows(g, q_rows));
  const examples::ReferenceGrads ref = examples::reference_grads(g, q_rows, kv_rows);
  const double grad_err = std::max({error(dq, ref.dq), error(dk, ref.dk), error(dv, ref.dv)});
  if (me == 0)
    std::printf("packed_documents: forward max_rel_err=%.3e (tolerance 1e-5), dQ/dK/dV max_rel_err=%.3e (1e-4)\n",
                out_err, grad_err);
  return examples::verdict("packed_documents", out_err <= 1e-5 && grad_err <= 1e-4, me == 0);
}
