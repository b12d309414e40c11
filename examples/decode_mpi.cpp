// decode_mpi: context-parallel prefill, then decode steps with the KV cache left sharded.
//   mpirun -np 4 build/examples/decode_mpi
// An inference engine's view: two prompts (3000 and 517 tokens) are prefilled with ring
// attention over a contiguous split, so rank r ends up holding its slice of every prompt's K/V.
// Decoding keeps that cache where it is: each step appends the new tokens' K/V on the rank that
// owns their position (plan.owner / plan.slot), attends the step's queries to every rank's
// shard and merges the partial results exactly. Per step the ranks exchange a few KiB of
// partial outputs instead of the cache. Every step is checked against attention over the
// whole cache in double.

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cli.hpp"     // argument checks and the verdict line
#include "end_job_on_error.hpp"  // the README's catch, report, MPI_Abort, for the whole program
#include "common.hpp"  // the error measure
#include "seqpar/comm/mpi_communicator.hpp"
#include "seqpar/seqpar.hpp"

using namespace seqpar;

namespace {

constexpr std::int64_t H = 8, K = 2, D = 64, T = 1, steps = 8;
const std::vector<std::int64_t> prompts = {3000, 517};

/// The model's K and V for token `pos` of sequence b (the same numbers on every rank, so the
/// example can check itself; an engine computes them).
float kv_value(std::int64_t b, std::int64_t pos, std::int64_t h, std::int64_t d, int which) {
  return static_cast<float>(std::sin(0.013 * double(pos * 131 + h * 17 + d * 7 + b * 1009 + which * 555)));
}
float q_value(std::int64_t step, std::int64_t b, std::int64_t h, std::int64_t d) {
  return static_cast<float>(std::cos(0.05 * double(step * 97 + b * 31 + h * 13 + d)));
}

}  // namespace

int main(int argc, char** argv) {
  examples::Args args(argc, argv, "mpirun -np <ranks> decode_mpi   (no arguments)");
  if (const auto exit = args.finish()) return *exit;  // before MPI starts, on every rank alike
  MpiSession mpi(argc, argv);
  examples::end_job_on_error(argv[0]);  // an error nobody catches: one line, MPI_Abort on every rank
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size(), me = world.rank();
  const std::int64_t B = static_cast<std::int64_t>(prompts.size());

  // 1. Prefill (sketched): a contiguous ring split of each prompt leaves rank r with tokens
  //    [off_r, off_r + len_r) of it. Here each rank fills its slice of the cache directly.
  SequenceParallelDecode<MpiCommunicator, ReferenceKernel> decode(world);
  DecodePlan plan = decode.plan({.batch = B, .heads = H, .kv_heads = K, .head_dim = D, .new_tokens = T,
                                 .kv_len = prompts, .capacity = 3000 + steps * T, .page = 0});
  const std::int64_t C = plan.shard_capacity();
  std::vector<float> k_cache(static_cast<std::size_t>(B * C * K * D)), v_cache(k_cache.size());
  auto append = [&](std::int64_t b, std::int64_t pos) {  // K/V of token pos go to its owner's slot
    if (plan.owner(b, pos) != me) return;
    const std::int64_t s = plan.slot(b, pos);
    for (std::int64_t h = 0; h < K; ++h)
      for (std::int64_t d = 0; d < D; ++d) {
        k_cache[((b * C + s) * K + h) * D + d] = kv_value(b, pos, h, d, 0);
        v_cache[((b * C + s) * K + h) * D + d] = kv_value(b, pos, h, d, 1);
      }
  };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t pos = 0; pos < prompts[static_cast<std::size_t>(b)]; ++pos) append(b, pos);

  // 2. Decode: append, attend, merge; the plan advances without communicating.
  std::vector<float> q(static_cast<std::size_t>(B * T * H * D)), out(q.size());
  std::vector<std::byte> workspace(plan.workspace_bytes());
  double worst = 0;
  for (std::int64_t s = 0; s < steps; ++s) {
    for (std::int64_t b = 0; b < B; ++b) append(b, plan.kv_len(b));  // this step's token
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t d = 0; d < D; ++d) q[static_cast<std::size_t>((b * H + h) * D + d)] = q_value(s, b, h, d);
    decode.step<float>(plan, TensorView<const float>::bshd(q.data(), B, T, H, D),
                       TensorView<const float>::bshd(k_cache.data(), B, C, K, D),
                       TensorView<const float>::bshd(v_cache.data(), B, C, K, D),
                       TensorView<float>::bshd(out.data(), B, T, H, D), workspace);
    // Check: attention of the new token over the whole sequence so far, in double.
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t n = plan.kv_len(b) + 1, kh = h / (H / K);
        std::vector<double> score(static_cast<std::size_t>(n)), o(D, 0.0);
        double mx = -1e300, sum = 0;
        for (std::int64_t j = 0; j < n; ++j) {
          double dot = 0;
          for (std::int64_t d = 0; d < D; ++d) dot += double(q_value(s, b, h, d)) * kv_value(b, j, kh, d, 0);
          mx = std::max(mx, score[j] = dot / std::sqrt(double(D)));
        }
        for (std::int64_t j = 0; j < n; ++j) sum += std::exp(score[j] - mx);
        for (std::int64_t j = 0; j < n; ++j)
          for (std::int64_t d = 0; d < D; ++d) o[d] += std::exp(score[j] - mx) / sum * kv_value(b, j, kh, d, 1);
        examples::ErrorStats err;  // of this head's row (a NaN makes it infinite)
        for (std::int64_t d = 0; d < D; ++d) err.add_out(out[static_cast<std::size_t>((b * H + h) * D + d)], o[d]);
        worst = std::max(worst, err.rel());
      }
    plan.advance(T);
  }
  double all_worst = 0;
  MPI_Allreduce(&worst, &all_worst, 1, MPI_DOUBLE, MPI_MAX, world.native());
  if (me == 0)
    std::printf("decode_mpi: %d ranks, caches of %lld and %lld tokens sharded (rank 0 holds %lld and %lld), %lld steps: "
                "%zu bytes sent per rank per step, max_rel_err=%.3e\n",
                P, static_cast<long long>(prompts[0]), static_cast<long long>(prompts[1]),
                static_cast<long long>(plan.layout().count(0, 0, plan.kv_len(0))),
                static_cast<long long>(plan.layout().count(0, 1, plan.kv_len(1))),
                static_cast<long long>(steps), plan.step_bytes(), all_worst);
  return examples::verdict("decode_mpi", all_worst <= 1e-5, me == 0);
}
