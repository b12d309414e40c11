// NcclCommunicator on this machine's GPUs: ranks as threads, one GPU each, with
// ThreadCommunicator as the metadata channel. Two or more GPUs run up to four ranks and move
// real traffic. NCCL allows one rank per GPU, so a one-GPU machine runs a single NCCL rank
// (set-up, split, self copies, the engine on NCCL), and then the same checks on four
// CudaThreadCommunicator ranks on that GPU, so that bytes still move between ranks; the output
// says which ran.

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "seqpar/comm/nccl_communicator.hpp"
#include "support/gpu_check.hpp"

using namespace seqpar;
using namespace seqpar::gpu_test;

using Nccl = NcclCommunicator<ThreadCommunicator>;
static_assert(Communicator<Nccl>);

namespace {

int nccl_ranks() { return std::min(detail::cuda_device_count(), 4); }

/// Ranks of the CudaThreadCommunicator run that stands in for NCCL's traffic between ranks on
/// a one-GPU machine (0 with more GPUs: NCCL moves it there); says which, naming `what`.
int stand_in_ranks(const char* what) {
  if (detail::cuda_device_count() > 1) {
    std::printf("%s: %d NCCL ranks, one per GPU\n", what, nccl_ranks());
    return 0;
  }
  std::printf("%s: one CUDA device, so 1 NCCL rank (no traffic between ranks), then 4 CudaThreadCommunicator ranks "
              "on that device\n",
              what);
  return 4;
}

/// Runs `fn(comm, stream)` on every rank, each on its own GPU with an NCCL communicator.
template <class Fn>
void on_nccl_ranks(int ranks, Fn&& fn) {
  run_ranks(
      ranks,
      [&](ThreadCommunicator& host) {
        SEQPAR_CUDA_CHECK(cudaSetDevice(host.rank()));
        Stream stream;
        Nccl comm = Nccl::create(host, stream);
        fn(comm, stream);
      },
      ThreadRunOptions{std::chrono::milliseconds(120000)});
}

}  // namespace

TEST_CASE("NcclCommunicator moves device bytes: all_to_all_v, exchange, split") {
  const int P = nccl_ranks(), stand_in = stand_in_ranks("moves device bytes");
  CAPTURE(P);
  on_nccl_ranks(P, [&](Nccl& comm, cudaStream_t stream) { check_moves_bytes(comm, stream, P); });
  if (stand_in == 0) return;
  int device = 0;
  SEQPAR_CUDA_CHECK(cudaGetDevice(&device));
  run_ranks<CudaSpace>(
      stand_in,
      [&](CudaThreadCommunicator& comm) {
        SEQPAR_CUDA_CHECK(cudaSetDevice(device));
        Stream stream;
        check_moves_bytes(comm, stream, stand_in);
      },
      ThreadRunOptions{std::chrono::milliseconds(120000)});
}

TEST_CASE("NcclCommunicator runs every policy (bf16, forward and backward)") {
  const int P = nccl_ranks(), stand_in = stand_in_ranks("runs every policy");
  CAPTURE(P);
  const test::GlobalShape c = test::make_case(150, 4, 2, 64, true, 1, 2);
  using T = __nv_bfloat16;
  const test::GlobalData g = test::make_global_as<T>(c);
  const test::ReferenceGrads gr = test::make_global_grads(g);
  GpuRunOptions opt;
  opt.backward = true;
  auto hold = [&](const GpuRunResult& r) {
    CHECK(!r.out.nan);
    CHECK(r.out.rel() <= tolerance<T>);
    CHECK(r.out.lse_rel() <= 1e-5);
    CHECK(!r.grads.nan());
    CHECK(r.grads.worst() <= grad_tolerance<T>);
  };
  // On the NCCL ranks (when `nccl`), then on the stand-in ranks of a one-GPU machine.
  auto check = [&](auto policy, bool nccl) {
    if (nccl) {
      const GpuRunOptions o = resolved(opt, policy, P, c);
      GpuRunResult res;
      std::mutex mu;
      on_nccl_ranks(P, [&](Nccl& comm, cudaStream_t stream) {
        const GpuRunResult mine = run_rank<T>(comm, policy, g, &gr, o, stream);
        std::lock_guard lock(mu);
        merge_into(res, mine);
      });
      hold(res);
    }
    if (stand_in > 0) {
      CAPTURE(stand_in);
      hold(run_on_gpu<T>(stand_in, policy, g, &gr, opt));
    }
  };
  check(AnythingPolicy<UlyssesPolicy>{}, true);
  check(AnythingPolicy<RingPolicy<Zigzag>>{}, true);
  check(AnythingPolicy<RingPolicy<Stripe>>{}, true);
  // 150 tokens: not divisible by 2 x 4 chunks. A 2 x 2 mesh needs 4 ranks: 4 NCCL ranks, or
  // the 4 stand-in ranks of a one-GPU machine; on 2 or 3 GPUs it does not run, and says so.
  if (P == 4 || stand_in == 4)
    check(AnythingPolicy<UnifiedPolicy<Zigzag>>{{2, 2}}, P == 4);
  else
    std::printf("runs every policy: no 2 x 2 mesh on %d NCCL ranks\n", P);
}
