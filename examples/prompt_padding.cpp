// prompt_padding: diffusion-style joint attention over a batch of prompts padded to one length.
//   mpirun -np 3 build/examples/prompt_padding [--image N] [--pad N] [prompt_length ...]
// A text-to-image transformer (MM-DiT) attends jointly over image tokens followed by text
// tokens, with no causal mask. The prompts of a batch differ in length but the batch has one
// shape, so every prompt is padded to `pad` tokens (77, as CLIP's tokenizer does). Key padding
// hides the padding: problem.kv_valid[b] = image + length of prompt b hides every key at or
// past that position (which is why the text comes last); padded queries still get an output,
// which the model drops. Hidden keys are never read: here the padding's K and V hold NaN, as
// stale memory might, and the result is still exact. The split is uneven (every rank a share
// of the image, the last one the text too) and 3 heads divide no Ulysses degree:
// AnythingPolicy<UnifiedPolicy<>> runs it on any number of ranks, sending no padding.

#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "cli.hpp"     // argument checks and the verdict line
#include "end_job_on_error.hpp"  // the README's catch, report, MPI_Abort, for the whole program
#include "common.hpp"  // random inputs and the reference check
#include "seqpar/comm/mpi_communicator.hpp"
#include "seqpar/seqpar.hpp"

using namespace seqpar;

int main(int argc, char** argv) {
  examples::Args args(argc, argv,
                      "mpirun -np <ranks> prompt_padding [--image N] [--pad N] [prompt_length ...]\n"
                      "  prompt_length  text tokens of each prompt in the batch: 0 to pad, at most 16 prompts\n"
                      "                 (default: 77 31 5)\n"
                      "  --image N      image tokens per batch element (1 to 16384; default 1024: 512 x 512 pixels\n"
                      "                 in 16 x 16 patches)\n"
                      "  --pad N        the padded text length (0 to 4096; default 77)");
  const std::int64_t image = args.option("--image", 1, 16384, 1024);
  const std::int64_t pad = args.option("--pad", 0, 4096, 77);
  std::vector<std::int64_t> prompts = args.positional(0, 4096, 16);
  if (prompts.empty()) prompts = {77, 31, 5};
  for (std::int64_t n : prompts)
    if (n > pad) args.reject("a prompt of " + std::to_string(n) + " tokens does not fit the padded length " +
                             std::to_string(pad) + " (--pad)");
  if (const auto exit = args.finish()) return *exit;  // before MPI starts, on every rank alike

  MpiSession mpi(argc, argv);
  examples::end_job_on_error(argv[0]);  // an error nobody catches: one line, MPI_Abort on every rank
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size(), me = world.rank();
  using Policy = AnythingPolicy<UnifiedPolicy<>>;  // Ulysses pairs when P is even, a ring across them
  const int U = P % 2 == 0 ? 2 : 1;
  const Policy policy{{.ulysses_degree = U, .ring_degree = P / U}};
  SequenceParallelAttention<Policy, MpiCommunicator, CpuFlashKernel> attn(world, policy);

  examples::GlobalShape shape;  // [image; text padded to pad] per batch element
  shape.batch = static_cast<std::int64_t>(prompts.size());
  shape.seq_q = image + pad;
  shape.heads = 3;
  shape.head_dim = 32;
  for (std::int64_t n : prompts) shape.kv_valid.push_back(image + n);  // keys past the prompt are hidden
  // Every rank its share of the image; the last one also the padded text.
  const std::int64_t L = split_sequence(image, attn.mesh())[static_cast<std::size_t>(me)] + (me == P - 1 ? pad : 0);
  const Plan plan = attn.plan(shape.problem<float>(), {L});

  const examples::GlobalInputs g = examples::make_inputs(shape);
  const PositionMap q_rows = plan.q_positions(me), kv_rows = plan.kv_positions(me);
  examples::LocalSlices<float> x = examples::local_slices<float>(g, q_rows, kv_rows);
  const std::int64_t B = shape.batch, H = shape.heads, D = shape.head_dim;
  const float garbage = std::numeric_limits<float>::quiet_NaN();
  for (std::int64_t b = 0; b < B; ++b)  // the padding's K and V, which no row may read
    for (std::int64_t i = 0; i < x.lkv; ++i)
      if (kv_rows(i) >= shape.kv_valid[static_cast<std::size_t>(b)]) {
        const std::int64_t row = (b * x.lkv + i) * H * D;
        std::fill_n(x.k.begin() + row, H * D, garbage);
        std::fill_n(x.v.begin() + row, H * D, garbage);
      }
  std::vector<std::byte> workspace(plan.workspace_bytes());
  using In = TensorView<const float>;
  attn.forward<float>(plan, In::bshd(x.q.data(), B, L, H, D), In::bshd(x.k.data(), B, L, H, D),
                      In::bshd(x.v.data(), B, L, H, D), TensorView<float>::bshd(x.out.data(), B, L, H, D),
                      workspace);

  const examples::ErrorStats my_err = examples::compare(x.out, examples::reference_rows(g, q_rows));
  const double err = examples::reduce_errors(world, my_err).rel();
  if (me == 0) {
    std::printf("prompt_padding: %lld prompts of", static_cast<long long>(B));
    for (std::int64_t n : prompts) std::printf(" %lld", static_cast<long long>(n));
    std::printf(" text tokens padded to %lld, after %lld image tokens; %d ranks, mesh %d x %d\n",
                static_cast<long long>(pad), static_cast<long long>(image), P, U, P / U);
    for (int r = 0; r < P; ++r) {
      const PositionMap pos = plan.q_positions(r);
      std::printf("prompt_padding: rank %d holds %lld tokens, positions %lld..%lld, %lld visible score pairs\n", r,
                  static_cast<long long>(pos.size()), static_cast<long long>(pos.size() ? pos(0) : 0),
                  static_cast<long long>(pos.size() ? pos(pos.size() - 1) : -1), static_cast<long long>(plan.work(r)));
    }
    std::printf("prompt_padding: max_rel_err=%.3e (tolerance 1e-5), padding K/V set to NaN\n", err);
  }
  return examples::verdict("prompt_padding", err <= 1e-5, me == 0);
}
