// GPU benchmark (run by tests/gpu/run.sh): CudaFlashKernel forward TFLOP/s at 4K-32K tokens,
// head dim 64/128, causal and not, and backward TFLOP/s at 4K and 16K; and each policy's
// forward and backward time on one GPU with 2-8 virtual ranks (threads over
// CudaThreadCommunicator). Prints the results as markdown tables.
//
// Usage: seqpar_gpu_bench [--quick | --smoke]
//   --quick: fewer and shorter points (run.sh, when time runs short);
//   --smoke: tiny shapes, one repetition: checks that every point runs (the CPU emulation of
//            the device runs it as a ctest; its times mean nothing).
// FLOPs counted as 4 B H Sq Sk D (halved for causal), the usual convention.

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "seqpar/comm/cuda_thread_communicator.hpp"
#include "seqpar/cuda/error.hpp"
#include "seqpar/cuda/types.hpp"
#include "seqpar/kernel/cuda/flash_kernel.cuh"
#include "seqpar/seqpar.hpp"
#include "support/kernel_instances.hpp"

using namespace seqpar;

namespace {

/// Device memory filled with uniform values in [-1, 1] (a hash of the index: no host copy).
template <class T>
__global__ void fill_random(T* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    p[i] = cuda_detail::convert<T>(static_cast<float>(x & 0xffffff) / 8388608.0f - 1.0f);
  }
}

template <class T>
struct Buffer {
  T* p = nullptr;
  std::size_t n = 0;
  explicit Buffer(std::size_t count, std::uint32_t seed = 0) : n(count) {
    SEQPAR_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T) + 1));
    if constexpr (!std::is_same_v<T, std::byte>) {
      if (seed) {
        cuda_detail::launch(fill_random<T>, 1024, 256, 0, nullptr, p, n, seed);
      }
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { cudaFree(p); }
};

/// True when the first elements of a device tensor are finite (guards against timing garbage).
template <class T>
bool finite_prefix(const T* p, std::size_t n) {
  std::vector<T> h(std::min<std::size_t>(n, 4096));
  SEQPAR_CUDA_CHECK(cudaMemcpy(h.data(), p, h.size() * sizeof(T), cudaMemcpyDeviceToHost));
  for (const T& x : h)
    if (!std::isfinite(static_cast<float>(x))) return false;
  return true;
}

template <class T>
const char* type_name() {
  return std::is_same_v<T, __half> ? "fp16" : std::is_same_v<T, __nv_bfloat16> ? "bf16" : "fp32";
}

struct KernelRow {
  std::string pass, type, path;
  std::int64_t seq, dim, heads;
  bool causal;
  double ms, tflops;
  bool ok;
};

/// Times CudaFlashKernel forward, or with `backward` its backward (after one forward for out and
/// LSE), on [1, seq, heads, dim] (median of `reps` after a warm-up).
template <class T>
KernelRow time_kernel(bool backward, std::int64_t seq, std::int64_t dim, std::int64_t heads, bool causal,
                      bool tensor_cores, bool ldmatrix, int query_tile, int reps) {
  const std::int64_t B = 1;
  const std::size_t n = static_cast<std::size_t>(B * seq * heads * dim);
  Buffer<T> q(n, 1), k(n, 2), v(n, 3), out(n), dout(backward ? n : 0, 4);
  Buffer<float> lse(static_cast<std::size_t>(B * seq * heads)), dq(backward ? n : 0), dk(backward ? n : 0),
      dv(backward ? n : 0);
  cudaStream_t s;
  SEQPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CudaFlashKernel kernel(s);
  kernel.set_tensor_cores(tensor_cores);
  kernel.set_ldmatrix(ldmatrix);
  kernel.set_query_tile(query_tile);
  KernelParams p;
  p.scale = 1.0 / std::sqrt(double(dim));
  p.causal = causal;
  p.q_positions = PositionMap::run(seq, 0);
  p.k_positions = PositionMap::run(seq, 0);
  using CV = TensorView<const T, CudaSpace>;
  const CV qv = CV::bshd(q.p, B, seq, heads, dim), kv = CV::bshd(k.p, B, seq, heads, dim),
           vv = CV::bshd(v.p, B, seq, heads, dim);
  const auto ov = TensorView<T, CudaSpace>::bshd(out.p, B, seq, heads, dim);
  const auto lv = TensorView<float, CudaSpace>::lse_bhs(lse.p, B, seq, heads);
  using GV = TensorView<float, CudaSpace>;
  const CV gv = CV::bshd(dout.p, B, seq, heads, dim);
  auto run = [&] {
    if (backward)
      kernel.backward(gv, qv, kv, vv, CV(ov), TensorView<const float, CudaSpace>(lv),
                      GV::bshd(dq.p, B, seq, heads, dim), GV::bshd(dk.p, B, seq, heads, dim),
                      GV::bshd(dv.p, B, seq, heads, dim), p);
    else
      kernel.forward(qv, kv, vv, ov, lv, p);
  };
  if (backward) {
    SEQPAR_CUDA_CHECK(cudaMemset(dq.p, 0, n * sizeof(float)));
    SEQPAR_CUDA_CHECK(cudaMemset(dk.p, 0, n * sizeof(float)));
    SEQPAR_CUDA_CHECK(cudaMemset(dv.p, 0, n * sizeof(float)));
    kernel.forward(qv, kv, vv, ov, lv, p);
  }
  SEQPAR_CUDA_CHECK(cudaDeviceSynchronize());
  if (reps > 1) run();  // warm-up (not for a one-shot smoke run)
  cudaEvent_t e0, e1;
  SEQPAR_CUDA_CHECK(cudaEventCreate(&e0));
  SEQPAR_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> times;
  for (int r = 0; r < reps; ++r) {
    SEQPAR_CUDA_CHECK(cudaEventRecord(e0, s));
    run();
    SEQPAR_CUDA_CHECK(cudaEventRecord(e1, s));
    SEQPAR_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    SEQPAR_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  const double ms = times[times.size() / 2];
  // Backward: five products (S, dP, dV, dK, dQ) to the forward's two, 2.5 times its FLOPs.
  const double flops =
      (backward ? 10.0 : 4.0) * B * heads * double(seq) * double(seq) * dim * (causal ? 0.5 : 1.0);
  std::string path = backward ? kernel.backward_path<T>(gv, qv, kv, vv)
                              : kernel.forward_path<T>(qv, kv, vv);
  if (path == "mma" && query_tile != 64) path += " q" + std::to_string(query_tile);
  if (path.rfind("mma", 0) == 0 && !ldmatrix) path += " (no ldmatrix)";
  KernelRow row{backward ? "bwd" : "fwd", type_name<T>(), path, seq, dim, heads, causal, ms,
                flops / (ms * 1e-3) / 1e12, backward ? finite_prefix(dq.p, n) : finite_prefix(out.p, n)};
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(s);
  return row;
}

struct PolicyRow {
  std::string policy;
  int ranks;
  std::int64_t seq;
  double ms, bwd_ms;  // forward; backward after it
  bool ok;
};

/// Times one forward, and one backward, of `policy` over `ranks` virtual ranks on this GPU
/// (median of reps each). The device-memory thread communicator synchronises the device around
/// every copy, so this measures the policy's whole work and traffic serialised on one GPU.
template <class T, class Policy>
PolicyRow time_policy(const char* name, Policy policy, int ranks, std::int64_t seq, std::int64_t heads,
                      std::int64_t dim, bool causal, int reps) {
  std::vector<double> times, bwd_times;
  std::mutex mu;
  bool ok = true;
  run_ranks<CudaSpace>(ranks, [&](CudaThreadCommunicator& comm) {
    cudaStream_t s;
    SEQPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    SequenceParallelAttention<Policy, CudaThreadCommunicator, CudaFlashKernel> attn(comm, policy);
    use_stream(attn, s);
    AttentionProblem prob;
    prob.batch = 1;
    prob.heads = heads;
    prob.head_dim = dim;
    prob.causal = causal;
    prob.dtype = dtype_v<T>;
    prob.with_lse = true;  // backward needs it
    const MeshConfig mesh = attn.mesh();
    const auto lengths = split_mesh(seq, mesh.ring, mesh.ulysses);
    const std::int64_t mine = lengths[static_cast<std::size_t>(mesh.ring_rank(comm.rank()) * mesh.ulysses +
                                                               mesh.ulysses_rank(comm.rank()))];
    const Plan plan = attn.plan(prob, {mine, mine});
    const std::size_t n = static_cast<std::size_t>(mine * heads * dim);
    Buffer<T> q(n, 11 + comm.rank()), k(n, 23 + comm.rank()), v(n, 37 + comm.rank()), out(n),
        dout(n, 41 + comm.rank()), dq(n), dk(n), dv(n);
    Buffer<float> lse(static_cast<std::size_t>(mine * heads));
    Buffer<std::byte> ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
    using CV = TensorView<const T, CudaSpace>;
    using V = TensorView<T, CudaSpace>;
    const CV qv = CV::bshd(q.p, 1, mine, heads, dim), kv = CV::bshd(k.p, 1, mine, heads, dim),
             vv = CV::bshd(v.p, 1, mine, heads, dim);
    const auto lv = TensorView<float, CudaSpace>::lse_bhs(lse.p, 1, mine, heads);
    const std::span<std::byte> wsv(ws.p, ws.n);
    auto forward = [&] {
      attn.template forward<T>(plan, qv, kv, vv, V::bshd(out.p, 1, mine, heads, dim), lv, wsv);
      SEQPAR_CUDA_CHECK(cudaStreamSynchronize(s));
    };
    auto backward = [&] {
      attn.template backward<T>(plan, CV::bshd(dout.p, 1, mine, heads, dim), qv, kv, vv,
                                CV::bshd(out.p, 1, mine, heads, dim), TensorView<const float, CudaSpace>(lv),
                                V::bshd(dq.p, 1, mine, heads, dim), V::bshd(dk.p, 1, mine, heads, dim),
                                V::bshd(dv.p, 1, mine, heads, dim), wsv);
      SEQPAR_CUDA_CHECK(cudaStreamSynchronize(s));
    };
    // Rank 0's wall time of `call` between two barriers.
    auto timed = [&](auto call, std::vector<double>& into) {
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      call();
      comm.barrier();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (comm.rank() == 0) into.push_back(ms);
    };
    SEQPAR_CUDA_CHECK(cudaDeviceSynchronize());
    if (reps > 1) {  // warm-up (not for a one-shot smoke run)
      forward();
      backward();
    }
    for (int r = 0; r < reps; ++r) {
      timed(forward, times);
      timed(backward, bwd_times);
    }
    const bool finite = finite_prefix(out.p, n) && finite_prefix(dq.p, n) && finite_prefix(dk.p, n);
    {
      std::lock_guard lock(mu);
      ok = ok && finite;
    }
    cudaStreamDestroy(s);
  });
  std::sort(times.begin(), times.end());
  std::sort(bwd_times.begin(), bwd_times.end());
  return {name, ranks, seq, times[times.size() / 2], bwd_times[bwd_times.size() / 2], ok};
}

}  // namespace

int main(int argc, char** argv) {
  const bool smoke = argc > 1 && std::strcmp(argv[1], "--smoke") == 0;
  const bool quick = smoke || (argc > 1 && std::strcmp(argv[1], "--quick") == 0);
  const int reps = smoke ? 1 : quick ? 2 : 3;
  // Shapes: seq 4K-32K (quick: 4K), heads 32 at D=64 and 16 at D=128; smoke: seq 256, 2 heads.
  const std::int64_t short_seq = smoke ? 256 : 4096, long_seq = smoke ? 256 : quick ? 4096 : 16384;
  auto kernel_heads = [&](std::int64_t dim) -> std::int64_t { return smoke ? 2 : dim == 64 ? 32 : 16; };
  const int count = detail::cuda_device_count();
  if (count == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  SEQPAR_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  std::fflush(stdout);

  int failures = 0;  // points that threw or wrote non-finite output: the exit status says so
  std::vector<KernelRow> krows;
  auto kernel_point = [&](auto tag, std::int64_t seq, std::int64_t dim, bool causal, bool tc, bool ldsm = true,
                          int query_tile = 64, bool backward = false) {
    using T = decltype(tag);
    try {
      krows.push_back(time_kernel<T>(backward, seq, dim, kernel_heads(dim), causal, tc, ldsm, query_tile, reps));
      const KernelRow& r = krows.back();
      std::printf("kernel %s %s %s seq %lld dim %lld %s: %.3f ms, %.1f TFLOP/s%s\n", r.pass.c_str(), r.type.c_str(),
                  r.path.c_str(),
                  static_cast<long long>(seq), static_cast<long long>(dim), causal ? "causal" : "full", r.ms, r.tflops,
                  r.ok ? "" : " (NON-FINITE OUTPUT)");
      failures += !r.ok;
    } catch (const std::exception& e) {
      std::printf("kernel %s seq %lld dim %lld: ERROR %s\n", type_name<T>(), static_cast<long long>(seq),
                  static_cast<long long>(dim), e.what());
      ++failures;
    }
    std::fflush(stdout);
  };
  const std::vector<std::int64_t> seqs =
      quick ? std::vector<std::int64_t>{short_seq} : std::vector<std::int64_t>{4096, 8192, 16384, 32768};
  for (std::int64_t dim : {128, 64})
    for (bool causal : {false, true})
      for (int query_tile : {64, 128})
        for (std::int64_t seq : seqs) kernel_point(__nv_bfloat16{}, seq, dim, causal, true, true, query_tile);
  kernel_point(__half{}, long_seq, 128, false, true);
  kernel_point(__half{}, long_seq, 128, true, true);
  kernel_point(__nv_bfloat16{}, long_seq, 128, false, true, false);  // without ldmatrix
  kernel_point(__nv_bfloat16{}, short_seq, 128, false, false);  // the SIMT path, for comparison
  kernel_point(float{}, short_seq, 128, false, true);
  kernel_point(float{}, short_seq, 64, true, true);
  // Backward: the tensor-core path at both head dims, causal and not, and the SIMT path once.
  for (std::int64_t dim : {128, 64})
    for (bool causal : {false, true})
      for (std::int64_t seq : quick ? std::vector<std::int64_t>{short_seq} : std::vector<std::int64_t>{4096, 16384})
        kernel_point(__nv_bfloat16{}, seq, dim, causal, true, true, 64, true);
  kernel_point(__nv_bfloat16{}, short_seq, 128, false, false, true, 64, true);

  std::vector<PolicyRow> prows;
  const std::int64_t pseq = smoke ? 256 : quick ? 4096 : 16384, pheads = smoke ? 8 : 16, pdim = smoke ? 64 : 128;
  auto policy_point = [&](const char* name, auto policy, int ranks) {
    try {
      prows.push_back(time_policy<__nv_bfloat16>(name, policy, ranks, pseq, pheads, pdim, true, reps));
      const PolicyRow& r = prows.back();
      std::printf("policy %s P=%d seq %lld: forward %.3f ms, backward %.3f ms%s\n", name, ranks,
                  static_cast<long long>(pseq), r.ms, r.bwd_ms, r.ok ? "" : " (NON-FINITE OUTPUT)");
      failures += !r.ok;
    } catch (const std::exception& e) {
      std::printf("policy %s P=%d: ERROR %s\n", name, ranks, e.what());
      ++failures;
    }
    std::fflush(stdout);
  };
  policy_point("single GPU (Ulysses P=1)", UlyssesPolicy{}, 1);
  for (int P : {2, 4, 8}) {
    policy_point("Ulysses", UlyssesPolicy{}, P);
    policy_point("Ring<Contiguous>", RingPolicy<Contiguous>{}, P);
    policy_point("Ring<Zigzag>", RingPolicy<Zigzag>{}, P);
    policy_point("Ring<Stripe>", RingPolicy<Stripe>{}, P);
    if (P >= 4) policy_point("Unified<Zigzag> 2xR", UnifiedPolicy<Zigzag>{2, 0}, P);
  }

  std::printf("\n## CudaFlashKernel on %s (B=1, H=%lld for D=64, H=%lld for D=128; bwd FLOPs = 2.5 x fwd)\n\n",
              prop.name,
              static_cast<long long>(kernel_heads(64)), static_cast<long long>(kernel_heads(128)));
  std::printf("| pass | type | path | seq | head dim | mask | ms | TFLOP/s |\n|---|---|---|---|---|---|---|---|\n");
  for (const KernelRow& r : krows)
    std::printf("| %s | %s | %s | %lld | %lld | %s | %.3f | %.1f%s |\n", r.pass.c_str(), r.type.c_str(), r.path.c_str(),
                static_cast<long long>(r.seq), static_cast<long long>(r.dim), r.causal ? "causal" : "none", r.ms,
                r.tflops, r.ok ? "" : " (non-finite!)");
  std::printf("\n## Policies on one GPU, P virtual ranks (bf16, causal, seq %lld, H=%lld, D=%lld)\n\n",
              static_cast<long long>(pseq), static_cast<long long>(pheads), static_cast<long long>(pdim));
  std::printf("| policy | P | ms / forward | ms / backward |\n|---|---|---|---|\n");
  for (const PolicyRow& r : prows)
    std::printf("| %s | %d | %.3f | %.3f%s |\n", r.policy.c_str(), r.ranks, r.ms, r.bwd_ms,
                r.ok ? "" : " (non-finite!)");
  if (failures) std::printf("\n%d point(s) failed (see ERROR / NON-FINITE above)\n", failures);
  return failures ? 1 : 0;
}
