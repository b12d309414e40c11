// custom_kernel: your own local attention kernel under every seqpar policy.
//   mpirun -np 4 build/examples/custom_kernel
// seqpar does the communication (all-to-all, ring, LSE merge); each rank's attention over its
// slice is the kernel's. examples/custom_kernel.hpp holds the kernel (PlainKernel) and, in its
// comments, how an engine wraps FlashAttention or cuDNN the same way. This program runs the
// kernel forward and backward under Ulysses, Ring, Unified and Anything, and checks every
// rank's rows against the exact attention of the whole sequence.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cli.hpp"     // argument checks and the verdict line
#include "end_job_on_error.hpp"  // the README's catch, report, MPI_Abort, for the whole program
#include "common.hpp"  // the error measure
#include "custom_kernel.hpp"
#include "seqpar/comm/mpi_communicator.hpp"
#include "seqpar/seqpar.hpp"

using namespace seqpar;

namespace {

/// The whole problem, the same on every rank (same seed): Q, K, V and the output gradient dO.
struct Global {
  std::int64_t B = 1, S = 0, H = 0, K = 0, D = 32;
  std::vector<float> q, k, v, dout;
  Global(std::int64_t seq, std::int64_t heads, std::int64_t kv_heads) : S(seq), H(heads), K(kv_heads) {
    std::mt19937 rng(1234);
    std::normal_distribution<float> n(0.f, 1.f);
    auto fill = [&](std::vector<float>& x, std::int64_t h) {
      x.resize(static_cast<std::size_t>(B * S * h * D));
      for (float& e : x) e = n(rng);
    };
    fill(q, H), fill(k, K), fill(v, K), fill(dout, H);
  }
  TensorView<const float> view(const std::vector<float>& x, std::int64_t h) const {
    return TensorView<const float>::bshd(x.data(), B, S, h, D);
  }
};

/// Largest |got - want| over the largest |want| of one tensor's rows (infinite after a NaN).
double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  return seqpar::examples::compare(got, want).rel();
}

/// Runs PlainKernel under `policy` with `lengths[rank]` tokens per rank; returns the worst
/// relative error of O, dQ, dK, dV against ReferenceKernel (double) over the global sequence.
template <class Policy>
double run(MpiCommunicator& world, Policy policy, const Global& g, const std::vector<std::int64_t>& lengths,
           bool causal) {
  const int me = world.rank();
  SequenceParallelAttention<Policy, MpiCommunicator, ::examples::PlainKernel> attn(world, policy);
  AttentionProblem problem{.batch = g.B, .heads = g.H, .kv_heads = g.K, .head_dim = g.D, .causal = causal,
                           .with_lse = true};  // backward needs the forward's LSE
  const Plan plan = attn.template plan<float>(problem, {lengths[static_cast<std::size_t>(me)]});
  const std::int64_t L = plan.local_q(), B = g.B, H = g.H, K = g.K, D = g.D;

  // This rank's rows, wherever the layout puts them.
  auto mine = [&](const std::vector<float>& x, std::int64_t h, const PositionMap& rows) {
    std::vector<float> local(static_cast<std::size_t>(B * rows.size() * h * D));
    scatter_sequence(g.view(x, h), rows, TensorView<float>::bshd(local.data(), B, rows.size(), h, D));
    return local;
  };
  const PositionMap q_rows = plan.q_positions(me), kv_rows = plan.kv_positions(me);
  const std::vector<float> q = mine(g.q, H, q_rows), k = mine(g.k, K, kv_rows), v = mine(g.v, K, kv_rows),
                           dout = mine(g.dout, H, q_rows);
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(B * L * H)), dq(q.size()), dk(k.size()), dv(v.size());
  std::vector<std::byte> workspace(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
  using In = TensorView<const float>;
  using Out = TensorView<float>;
  attn.template forward<float>(plan, In::bshd(q.data(), B, L, H, D), In::bshd(k.data(), B, L, K, D),
                      In::bshd(v.data(), B, L, K, D), Out::bshd(out.data(), B, L, H, D),
                      Out::lse_bhs(lse.data(), B, L, H), workspace);
  attn.template backward<float>(plan, In::bshd(dout.data(), B, L, H, D), In::bshd(q.data(), B, L, H, D),
                       In::bshd(k.data(), B, L, K, D), In::bshd(v.data(), B, L, K, D),
                       In::bshd(out.data(), B, L, H, D), In::lse_bhs(lse.data(), B, L, H),
                       Out::bshd(dq.data(), B, L, H, D), Out::bshd(dk.data(), B, L, K, D),
                       Out::bshd(dv.data(), B, L, K, D), workspace);

  // The exact answer for the whole sequence (every rank computes it: the problem is small).
  const std::int64_t S = g.S;
  std::vector<double> ro(static_cast<std::size_t>(B * S * H * D)), rl(static_cast<std::size_t>(B * S * H));
  std::vector<double> rdq(ro.size(), 0.0), rdk(g.k.size(), 0.0), rdv(g.v.size(), 0.0);
  KernelParams p;
  p.scale = problem.softmax_scale();
  p.causal = causal;
  p.q_positions = p.k_positions = PositionMap::run(S, 0);
  p.group_size = H / K;
  ReferenceKernel ref;
  using DOut = TensorView<double>;
  ref.forward(g.view(g.q, H), g.view(g.k, K), g.view(g.v, K), DOut::bshd(ro.data(), B, S, H, D),
              DOut::lse_bhs(rl.data(), B, S, H), p);
  std::vector<float> ro_f(ro.begin(), ro.end());
  ref.backward(g.view(g.dout, H), g.view(g.q, H), g.view(g.k, K), g.view(g.v, K), In::bshd(ro_f.data(), B, S, H, D),
               TensorView<const double>::lse_bhs(rl.data(), B, S, H), DOut::bshd(rdq.data(), B, S, H, D),
               DOut::bshd(rdk.data(), B, S, K, D), DOut::bshd(rdv.data(), B, S, K, D), p);
  auto my_rows = [&](const std::vector<double>& x, std::int64_t h, const PositionMap& rows) {
    std::vector<double> local(static_cast<std::size_t>(B * rows.size() * h * D));
    scatter_sequence(TensorView<const double>::bshd(x.data(), B, S, h, D), rows,
                     DOut::bshd(local.data(), B, rows.size(), h, D));
    return local;
  };
  const double err = std::max({rel_err(out, my_rows(ro, H, q_rows)), rel_err(dq, my_rows(rdq, H, q_rows)),
                               rel_err(dk, my_rows(rdk, K, kv_rows)), rel_err(dv, my_rows(rdv, K, kv_rows))});
  double worst = 0;  // over the ranks
  MPI_Allreduce(&err, &worst, 1, MPI_DOUBLE, MPI_MAX, world.native());
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  seqpar::examples::Args args(argc, argv, "mpirun -np <ranks> custom_kernel   (no arguments)");
  if (const auto exit = args.finish()) return *exit;  // before MPI starts, on every rank alike
  MpiSession mpi(argc, argv);
  seqpar::examples::end_job_on_error(argv[0]);  // an error nobody catches: one line, MPI_Abort on every rank
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size(), me = world.rank();
  // 2P query heads over P K/V heads (GQA), 64 tokens per rank for the plain policies.
  const std::int64_t H = 2 * P, K = P, even = 64;
  const Global g(even * P, H, K);
  const std::vector<std::int64_t> same(static_cast<std::size_t>(P), even);
  double worst = 0;
  auto report = [&](const char* name, double err) {
    worst = std::max(worst, err);
    if (me == 0) std::printf("custom_kernel: %-34s O, dQ, dK, dV max_rel_err=%.3e\n", name, err);
  };
  report("UlyssesPolicy, causal", run(world, UlyssesPolicy{}, g, same, true));
  report("RingPolicy<Zigzag>, causal", run(world, RingPolicy<Zigzag>{}, g, same, true));
  report("UnifiedPolicy<Contiguous>, full", run(world, UnifiedPolicy<>{.ring_degree = P % 2 == 0 ? 2 : 1}, g, same, false));
  // Anything: an uneven split (rank r holds 64 - 5r tokens, rank 0 one more), zigzag ring.
  std::vector<std::int64_t> uneven(static_cast<std::size_t>(P));
  std::int64_t total = 0;
  for (int r = 0; r < P; ++r) total += uneven[static_cast<std::size_t>(r)] = std::max<std::int64_t>(0, even - 5 * r) + (r == 0);
  const Global gu(total, H, K);
  report("AnythingPolicy<RingPolicy<Zigzag>>", run(world, AnythingPolicy<RingPolicy<Zigzag>>{}, gu, uneven, true));
  if (me == 0) std::printf("custom_kernel: %d ranks, PlainKernel under 4 policies, max_rel_err=%.3e\n", P, worst);
  // Float outputs and float gradient accumulation: 1e-4.
  return seqpar::examples::verdict("custom_kernel", worst <= 1e-4, me == 0);
}
