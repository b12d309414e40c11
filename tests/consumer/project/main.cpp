// The consumers' program: 3 ranks as threads run a causal GQA forward of uneven length with
// AnythingPolicy<RingPolicy<Zigzag>> and compare it with ReferenceKernel over the whole
// sequence. Exits 0 only when the error is within float tolerance.

#include <seqpar/seqpar.hpp>
#ifdef SEQPAR_HAS_MPI
#include <seqpar/comm/mpi_communicator.hpp>
static_assert(seqpar::Communicator<seqpar::MpiCommunicator>, "seqpar::mpi: MpiCommunicator must model Communicator");
#endif
#ifdef SEQPAR_HAS_NCCL
#include <seqpar/comm/nccl_communicator.hpp>
static_assert(seqpar::Communicator<seqpar::NcclCommunicator<seqpar::ThreadCommunicator>>,
              "seqpar::nccl: NcclCommunicator must model Communicator");
#endif

#include <cmath>
#include <cstdio>
#include <mutex>
#include <vector>

int main() {
  using namespace seqpar;
  constexpr int P = 3;
  constexpr std::int64_t S = 37, H = 4, K = 2, D = 16;
  std::vector<float> q(S * H * D), k(S * K * D), v(S * K * D), out(q.size(), 0.0f);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * float(i) + 0.1f);
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = std::cos(0.23f * float(i) + 0.2f);
    v[i] = std::sin(0.71f * float(i) + 0.3f);
  }
  using In = TensorView<const float>;
  std::mutex mu;
  run_ranks(P, [&](ThreadCommunicator& comm) {
    using Policy = AnythingPolicy<RingPolicy<Zigzag>>;
    SequenceParallelAttention<Policy, ThreadCommunicator, CpuFlashKernel> attn(comm);
    const AttentionProblem problem{.heads = H, .kv_heads = K, .head_dim = D, .causal = true};
    const std::int64_t L = split_sequence(S, attn.mesh())[comm.rank()];
    const Plan plan = attn.plan(problem, {L});
    const PositionMap pos = plan.q_positions(comm.rank());
    std::vector<float> lq(L * H * D), lk(L * K * D), lv(L * K * D), lo(L * H * D);
    scatter_sequence(In::bshd(q.data(), 1, S, H, D), pos, TensorView<float>::bshd(lq.data(), 1, L, H, D));
    scatter_sequence(In::bshd(k.data(), 1, S, K, D), pos, TensorView<float>::bshd(lk.data(), 1, L, K, D));
    scatter_sequence(In::bshd(v.data(), 1, S, K, D), pos, TensorView<float>::bshd(lv.data(), 1, L, K, D));
    std::vector<std::byte> ws(plan.workspace_bytes());
    attn.forward<float>(plan, In::bshd(lq.data(), 1, L, H, D), In::bshd(lk.data(), 1, L, K, D),
                        In::bshd(lv.data(), 1, L, K, D), TensorView<float>::bshd(lo.data(), 1, L, H, D), ws);
    std::lock_guard lock(mu);
    gather_sequence(In::bshd(lo.data(), 1, L, H, D), pos, TensorView<float>::bshd(out.data(), 1, S, H, D));
  });

  std::vector<double> want(q.size());
  KernelParams p;
  p.scale = 1.0 / std::sqrt(double(D));
  p.causal = true;
  p.q_positions = p.k_positions = PositionMap::run(S, 0);
  p.group_size = H / K;
  ReferenceKernel{}.forward(In::bshd(q.data(), 1, S, H, D), In::bshd(k.data(), 1, S, K, D), In::bshd(v.data(), 1, S, K, D),
                            TensorView<double>::bshd(want.data(), 1, S, H, D), TensorView<double>{}, p);
  double err = 0, ref = 0;
  bool finite = true;
  for (std::size_t i = 0; i < want.size(); ++i) {
    finite = finite && std::isfinite(out[i]);
    err = std::fmax(err, std::fabs(out[i] - want[i]));
    ref = std::fmax(ref, std::fabs(want[i]));
  }
  std::printf("seqpar consumer: %d ranks, relative error %.3g%s\n", P, err / ref, finite ? "" : ", NOT FINITE");
  return finite && err / ref <= 1e-5 ? 0 : 1;
}
