// SequenceParallelDecode on the device: CudaFlashKernel over CudaThreadCommunicator (ranks as
// threads on one GPU) and, where NCCL is built, over NcclCommunicator (one GPU per rank), in
// half, bf16 and float, every step against attention over the whole cache in double
// (tests/support/decode_check.hpp, on the inputs rounded to the element type): 3 and 4 ranks,
// 1 and 4 new tokens, contiguous, page 1 and page 16 layouts, both exchanges, GQA and MQA,
// ragged caches with shards that hold nothing of a sequence, and NaN in every cache slot no
// token has been written to (it must reach no row). And PagedDecode over an engine's paged pool
// on the device (CudaFlashKernel called per run of pages): requests joining and leaving, T_b
// 0..16, pages reused after free with NaN in them, float and bf16.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <mutex>
#include <vector>

#include "support/decode_check.hpp"
#include "support/gpu_check.hpp"
#include "support/paged_check.hpp"
#ifdef SEQPAR_TEST_NCCL
#include "seqpar/comm/nccl_communicator.hpp"
#endif

using namespace seqpar;
using namespace seqpar::gpu_test;
using test::D;
using test::DecodeCase;

namespace {

/// The scenarios: 3 and 4 ranks, ragged caches (a sequence shorter than a page, one with no
/// cache at all: shards with nothing of it), every layout, both exchanges, T = 1 and 4.
const std::vector<DecodeCase>& cases() {
  using E = DecodeExchange;
  static const std::vector<DecodeCase> all = {
      {3, {40, 0, 7}, 1, 4, 6, 3, E::all_gather, 2},   // stripe (page 1), T = 4, an empty cache
      {4, {20, 3}, 16, 1, 4, 2, E::heads, 3},          // page 16: ranks 2 and 3 hold nothing at first
      {4, {20, 3}, 16, 4, 5, 1, E::all_gather, 2},     // MQA, 5 heads
      {3, {33, 0}, 0, 1, 5, 5, E::heads, 3},           // contiguous, 5 heads over 3 ranks
      {4, {2, 37}, 1, 4, 4, 4, E::heads, 2},           // stripe, heads exchange, T = 4
  };
  return all;
}

/// The case's truth with K, V and Q rounded to T (so the double reference sees the inputs the
/// kernel gets).
template <class T>
test::Truth rounded_truth(const DecodeCase& c, std::int64_t capacity) {
  test::Truth tr(c, capacity);
  auto round = [](std::vector<float>& xs) {
    for (float& x : xs) x = static_cast<float>(to_double(from_double<T>(x)));
  };
  round(tr.k);
  round(tr.v);
  for (auto& q : tr.q) round(q);
  return tr;
}

/// One rank's decode steps on the device over `world` (kernel, ops and communicator on
/// `stream`); returns the worst normwise error of its steps. Cache slots no token has reached
/// hold NaN.
template <class T, class Comm>
double decode_on_rank(Comm& world, cudaStream_t stream, const DecodeCase& c, const test::Truth& tr) {
  SequenceParallelDecode<Comm, CudaFlashKernel> dec(world);
  dec.kernel().set_stream(stream);
  dec.ops().set_stream(stream);
  if constexpr (requires { world.set_stream(stream); }) world.set_stream(stream);
  DecodePlan plan = dec.plan(test::decode_problem(c, dtype_v<T>));
  const std::int64_t B = tr.B, C = plan.shard_capacity(), K = c.kv_heads, Tn = c.new_tokens;
  const HeadRange qh = plan.q_heads(), oh = plan.out_heads();
  std::vector<double> kc(static_cast<std::size_t>(B * C * K * D), std::numeric_limits<double>::quiet_NaN()), vc = kc,
      q(static_cast<std::size_t>(B * Tn * qh.count * D));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t pos = 0; pos < plan.kv_len(b); ++pos) test::put_token(tr, plan, b, pos, kc, vc);
  DeviceBuffer<T> kd(kc.size()), vd(vc.size()), qd(q.size()), od(static_cast<std::size_t>(B * Tn * oh.count * D));
  DeviceBuffer<std::byte> ws(plan.workspace_bytes());
  using CV = TensorView<const T, CudaSpace>;
  double err = 0;
  for (int s = 0; s < c.steps; ++s) {
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < Tn; ++t) test::put_token(tr, plan, b, plan.kv_len(b) + t, kc, vc);
    test::step_queries(tr, plan, s, q);
    kd.upload(kc);
    vd.upload(vc);
    qd.upload(q);
    od.poison();
    const std::uint64_t before = world.stats().bytes_sent;
    dec.template step<T>(plan, CV::bshd(qd.data(), B, Tn, qh.count, D), CV::bshd(kd.data(), B, C, K, D),
                         CV::bshd(vd.data(), B, C, K, D), TensorView<T, CudaSpace>::bshd(od.data(), B, Tn, oh.count, D),
                         std::span<std::byte>(ws.data(), ws.size()));
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(stream));
    CHECK(world.stats().bytes_sent - before == plan.step_bytes());
    err = std::max(err, test::step_error(tr, plan, s, od.download()));
    plan.advance(Tn);
  }
  return err;
}

/// Runs `body(world, stream)` on c.ranks thread ranks over CudaThreadCommunicator and returns
/// the worst error any rank reports.
template <class Body>
double on_thread_ranks(int ranks, Body&& body) {
  int device = 0;
  SEQPAR_CUDA_CHECK(cudaGetDevice(&device));
  std::mutex mu;
  double worst = 0;
  run_ranks<CudaSpace>(
      ranks,
      [&](CudaThreadCommunicator& world) {
        SEQPAR_CUDA_CHECK(cudaSetDevice(device));
        Stream stream;
        const double e = body(world, static_cast<cudaStream_t>(stream));
        std::lock_guard lock(mu);
        worst = std::max(worst, e);
      },
      ThreadRunOptions{std::chrono::milliseconds(120000)});
  return worst;
}

template <class T>
void check_thread_decode() {
  for (const DecodeCase& c : cases()) {
    CAPTURE(c.ranks);
    CAPTURE(c.page);
    CAPTURE(c.new_tokens);
    CAPTURE(static_cast<int>(c.exchange));
    const test::Truth tr = rounded_truth<T>(c, test::decode_problem(c).capacity);
    const double err = on_thread_ranks(c.ranks, [&](CudaThreadCommunicator& world, cudaStream_t stream) {
      return decode_on_rank<T>(world, stream, c, tr);
    });
    CHECK(err <= tolerance<T>);
  }
}

/// Runs a paged step on the device: the engine's host pool, queries and output copied to and
/// from device buffers of T around the step.
template <class T>
struct DeviceStep {
  cudaStream_t stream;
  template <class Dec>
  std::int64_t operator()(Dec& dec, PagedDecodePlan& plan, const DecodeBatch& batch, const std::vector<float>& q,
                          const test::RankPool& pool, std::vector<float>& out, std::span<std::byte>) const {
    dec.kernel().set_stream(stream);  // the kernel, the ops and the communicator on the rank's stream
    dec.ops().set_stream(stream);
    if constexpr (requires { dec.world().set_stream(stream); }) dec.world().set_stream(stream);
    auto widen = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
    DeviceBuffer<T> kd(pool.k.size()), vd(pool.v.size()), qd(q.size()), od(out.size());
    DeviceBuffer<std::byte> ws(plan.workspace_bytes());
    kd.upload(widen(pool.k));
    vd.upload(widen(pool.v));
    qd.upload(widen(q));
    od.poison();
    using CV = TensorView<const T, CudaSpace>;
    const std::int64_t rows = static_cast<std::int64_t>(q.size()) / (plan.q_heads().count * pool.D);
    const CV k = CV::bshd(kd.data(), pool.pages, pool.page_size, pool.K, pool.D);
    CV v = pool.v_in_k ? k : CV::bshd(vd.data(), pool.pages, pool.page_size, pool.K, pool.Dv);
    v.extent[3] = pool.Dv;  // MLA: the first D_v columns of K's rows
    const std::int64_t n = dec.template step<T>(plan, batch, CV::bshd(qd.data(), 1, rows, plan.q_heads().count, pool.D),
                                                k, v, TensorView<T, CudaSpace>::bshd(od.data(), 1, rows, plan.out_heads().count, pool.Dv),
                                                std::span<std::byte>(ws.data(), ws.size()));
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<double> got = od.download();
    std::copy(got.begin(), got.end(), out.begin());
    return n;
  }
};

/// A paged schedule on the device with its truth rounded to T.
template <class T>
double paged_on_device(const test::PagedCase& c) {
  test::Schedule sch(c);
  auto round = [](std::vector<float>& xs) {
    for (float& x : xs) x = static_cast<float>(to_double(from_double<T>(x)));
  };
  for (test::Request& r : sch.requests) {
    round(r.k);
    round(r.v);
  }
  for (test::ScheduledStep& st : sch.steps) round(st.q);
  return on_thread_ranks(c.ranks, [&](CudaThreadCommunicator& world, cudaStream_t stream) {
    return test::paged_rank_error<CudaFlashKernel>(world, c, sch, DeviceStep<T>{stream}, dtype_v<T>);
  });
}

}  // namespace

TEST_CASE("paged decode on the device: continuously batched steps equal attention over each whole cache") {
  using E = DecodeExchange;
  // (Sinks are in device memory on the device: the host test covers them with this engine.)
  const test::DecodeFeatures mla{.head_dim = 12, .head_dim_v = 8, .softcap = 2.0, .v_in_k = true};
  const std::vector<test::PagedCase> cases = {
      {.ranks = 3, .interleave = 1, .page_size = 4, .heads = 4, .kv_heads = 2, .exchange = E::all_gather, .steps = 6},
      {.ranks = 2, .interleave = 16, .page_size = 16, .heads = 6, .kv_heads = 1, .exchange = E::heads, .steps = 6,
       .dense_table = true, .max_prompt = 60},
      {.ranks = 4, .interleave = 0, .page_size = 4, .heads = 4, .kv_heads = 2, .exchange = E::all_gather, .steps = 5,
       .features = mla, .max_prompt = 40},
  };
  for (const test::PagedCase& c : cases) {
    CAPTURE(c.ranks);
    CHECK(paged_on_device<float>(c) <= tolerance<float>);
    CHECK(paged_on_device<__nv_bfloat16>(c) <= tolerance<__nv_bfloat16>);
  }
}

TEST_CASE("decode on the device: every step equals attention over the whole cache (float)") {
  check_thread_decode<float>();
}
TEST_CASE("decode on the device: every step equals attention over the whole cache (half)") {
  check_thread_decode<__half>();
}
TEST_CASE("decode on the device: every step equals attention over the whole cache (bf16)") {
  check_thread_decode<__nv_bfloat16>();
}

#ifdef SEQPAR_TEST_NCCL
TEST_CASE("decode on the device over NcclCommunicator (one GPU per rank)") {
  // NCCL allows one rank per GPU: up to four ranks where there are GPUs (the emulation has
  // four). A one-GPU machine runs each case on 1 NCCL rank, whose partials merge without any
  // traffic, and then on the case's ranks over CudaThreadCommunicator on that GPU.
  using Nccl = NcclCommunicator<ThreadCommunicator>;
  const int gpus = std::min(detail::cuda_device_count(), 4);
  if (gpus == 1)
    std::printf("decode over NCCL: one CUDA device, so 1 NCCL rank per case, then the case's ranks over "
                "CudaThreadCommunicator on that device\n");
  else
    std::printf("decode over NCCL: up to %d NCCL ranks, one per GPU\n", gpus);
  for (const DecodeCase& base : cases()) {
    DecodeCase c = base;
    c.ranks = std::min(c.ranks, gpus);
    CAPTURE(c.ranks);
    CAPTURE(c.page);
    CAPTURE(static_cast<int>(c.exchange));
    using T = __nv_bfloat16;
    const test::Truth tr = rounded_truth<T>(c, test::decode_problem(c).capacity);
    std::mutex mu;
    double worst = 0;
    run_ranks(
        c.ranks,
        [&](ThreadCommunicator& host) {
          SEQPAR_CUDA_CHECK(cudaSetDevice(host.rank()));
          Stream stream;
          Nccl world = Nccl::create(host, stream);
          const double e = decode_on_rank<T>(world, stream, c, tr);
          std::lock_guard lock(mu);
          worst = std::max(worst, e);
        },
        ThreadRunOptions{std::chrono::milliseconds(120000)});
    CHECK(worst <= tolerance<T>);
    if (gpus == 1) {
      const test::Truth all = rounded_truth<T>(base, test::decode_problem(base).capacity);
      CAPTURE(base.ranks);
      CHECK(on_thread_ranks(base.ranks, [&](CudaThreadCommunicator& world, cudaStream_t stream) {
              return decode_on_rank<T>(world, stream, base, all);
            }) <= tolerance<T>);
    }
  }
}
#endif
