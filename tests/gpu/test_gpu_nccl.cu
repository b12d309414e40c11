// NcclCommunicator on this machine's GPUs: ranks as threads, one GPU each, with
// ThreadCommunicator as the metadata channel. NCCL allows one rank per GPU, so a one-GPU
// machine runs a single rank (set-up, split, self copies, the engine on NCCL); two or more GPUs
// run up to four ranks and move real traffic.

#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "seqpar/comm/nccl_communicator.hpp"
#include "support/gpu_check.hpp"

using namespace seqpar;
using namespace seqpar::gpu_test;

using Nccl = NcclCommunicator<ThreadCommunicator>;
static_assert(Communicator<Nccl>);

namespace {

int nccl_ranks() { return std::min(detail::cuda_device_count(), 4); }

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
  const int P = nccl_ranks();
  CAPTURE(P);
  on_nccl_ranks(P, [&](Nccl& comm, cudaStream_t stream) {
    const int r = comm.rank();
    CHECK(comm.size() == P);
    // Rank r sends (j + 1) floats of value 10 r + j to rank j.
    std::vector<double> send;
    std::vector<std::size_t> sc, sd, rc, rd;
    for (int j = 0; j < P; ++j) {
      sd.push_back(send.size() * sizeof(float));
      for (int i = 0; i <= j; ++i) send.push_back(10 * r + j);
      sc.push_back(static_cast<std::size_t>(j + 1) * sizeof(float));
      rd.push_back(static_cast<std::size_t>(j * (r + 1)) * sizeof(float));
      rc.push_back(static_cast<std::size_t>(r + 1) * sizeof(float));
    }
    DeviceBuffer<float> s(send.size()), d(static_cast<std::size_t>(P * (r + 1))), e(static_cast<std::size_t>(P * P));
    s.upload(send);
    comm.stats().reset();
    comm.all_to_all_v(reinterpret_cast<const std::byte*>(s.data()), sc, sd, reinterpret_cast<std::byte*>(d.data()), rc, rd);
    const int from = (r + P - 1) % P;
    auto req = comm.start_exchange(reinterpret_cast<const std::byte*>(d.data()), d.size() * sizeof(float), (r + 1) % P,
                                   reinterpret_cast<std::byte*>(e.data()),
                                   static_cast<std::size_t>(P * (from + 1)) * sizeof(float), from);
    comm.wait(req);
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<double> mine = d.download(), passed = e.download();
    for (int j = 0; j < P; ++j)
      for (int i = 0; i <= r; ++i) CHECK(mine[j * (r + 1) + i] == 10 * j + r);
    for (int j = 0; j < P; ++j)
      for (int i = 0; i <= from; ++i) CHECK(passed[j * (from + 1) + i] == 10 * j + from);
    CHECK(comm.stats().all_to_alls == 1);
    CHECK(comm.stats().exchanges == 1);
    // Split into even and odd ranks; the halves see their own sizes and share the stats.
    Nccl half = comm.split(r % 2, r);
    CHECK(half.size() == (P + 1 - r % 2) / 2);
    CHECK(half.rank() == r / 2);
    CHECK(&half.stats() == &comm.stats());
    half.barrier();
  });
}

TEST_CASE("NcclCommunicator runs every policy (bf16, forward and backward)") {
  const int P = nccl_ranks();
  CAPTURE(P);
  const test::GlobalShape c = test::make_case(150, 4, 2, 64, true, 1, 2);
  using T = __nv_bfloat16;
  const test::GlobalData g = test::make_global_as<T>(c);
  const test::ReferenceGrads gr = test::make_global_grads(g);
  GpuRunOptions opt;
  opt.backward = true;
  auto check = [&](auto policy) {
    const GpuRunOptions o = resolved(opt, policy, P, c);
    GpuRunResult res;
    std::mutex mu;
    on_nccl_ranks(P, [&](Nccl& comm, cudaStream_t stream) {
      const GpuRunResult mine = run_rank<T>(comm, policy, g, &gr, o, stream);
      std::lock_guard lock(mu);
      merge_into(res, mine);
    });
    CHECK(!res.out.nan);
    CHECK(res.out.rel() <= tolerance<T>);
    CHECK(res.out.lse_rel() <= 1e-5);
    CHECK(!res.grads.nan());
    CHECK(res.grads.worst() <= grad_tolerance<T>);
  };
  check(AnythingPolicy<UlyssesPolicy>{});
  check(AnythingPolicy<RingPolicy<Zigzag>>{});
  check(AnythingPolicy<RingPolicy<Stripe>>{});
  if (P == 4) check(AnythingPolicy<UnifiedPolicy<Zigzag>>{{2, 2}});  // 150 tokens: not divisible by 2 x 4 chunks
}
