// cuda_threads_demo: every policy on ONE GPU, its ranks as threads over
// CudaThreadCommunicator (device memory, one stream per rank). This is how the library checks
// its multi-GPU algorithms on a single device; real runs use NcclCommunicator (nccl_demo).
//   build/examples/cuda/cuda_threads_demo
// Prints each policy's error against the exact double reference (bf16, causal, GQA).

#include <cuda_runtime.h>

#include <cstdio>
#include <mutex>
#include <vector>

#include "common.hpp"  // random inputs, a rank's slices, the exact reference rows
#include "flash_instances.cuh"  // the kernels, compiled once for both examples
#include "seqpar/comm/cuda_thread_communicator.hpp"
#include "seqpar/kernel/cuda/flash_kernel.cuh"
#include "seqpar/seqpar.hpp"

using namespace seqpar;
using T = __nv_bfloat16;

namespace {

/// Runs `policy` on `ranks` threads and returns the error of all rows.
template <class Policy>
double run(Policy policy, int ranks, const examples::GlobalInputs& inputs) {
  const examples::GlobalShape& shape = inputs.shape;
  examples::ErrorStats all;
  std::mutex mu;
  run_ranks<CudaSpace>(ranks, [&](CudaThreadCommunicator& comm) {
    cudaStream_t stream = nullptr;
    SEQPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    SequenceParallelAttention<Policy, CudaThreadCommunicator, CudaFlashKernel> attn(comm, policy);
    use_stream(attn, stream);
    const int me = comm.rank();
    const Plan plan = attn.plan(shape.problem<T>(), {split_sequence(shape.seq_q, attn.mesh())[static_cast<std::size_t>(me)]});
    const PositionMap qpos = plan.q_positions(me);
    examples::LocalSlices<T> l = examples::local_slices<T>(inputs, qpos, plan.kv_positions(me));
    std::vector<T*> dev;
    for (auto* host : {&l.q, &l.k, &l.v, &l.out}) {
      T* p = nullptr;
      SEQPAR_CUDA_CHECK(cudaMalloc(&p, host->size() * sizeof(T) + 1));
      SEQPAR_CUDA_CHECK(cudaMemcpy(p, host->data(), host->size() * sizeof(T), cudaMemcpyHostToDevice));
      dev.push_back(p);
    }
    std::byte* ws = nullptr;
    SEQPAR_CUDA_CHECK(cudaMalloc(&ws, plan.workspace_bytes()));
    // The copies ran on the legacy stream, which the rank's non-blocking stream does not wait for.
    SEQPAR_CUDA_CHECK(cudaDeviceSynchronize());
    using CV = TensorView<const T, CudaSpace>;
    const std::int64_t B = shape.batch, H = shape.heads, K = shape.kv_head_count(), D = shape.head_dim;
    attn.template forward<T>(plan, CV::bshd(dev[0], B, l.lq, H, D), CV::bshd(dev[1], B, l.lkv, K, D),
                             CV::bshd(dev[2], B, l.lkv, K, D), TensorView<T, CudaSpace>::bshd(dev[3], B, l.lq, H, D),
                             std::span<std::byte>(ws, plan.workspace_bytes()));
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(stream));
    SEQPAR_CUDA_CHECK(cudaMemcpy(l.out.data(), dev[3], l.out.size() * sizeof(T), cudaMemcpyDeviceToHost));
    const examples::ErrorStats e = examples::compare(l.out, examples::reference_rows(inputs, qpos));
    for (T* p : dev) cudaFree(p);
    cudaFree(ws);
    cudaStreamDestroy(stream);
    std::lock_guard lock(mu);
    all.merge(e);
  });
  return all.rel();
}

}  // namespace

int main() {
  if (detail::cuda_device_count() == 0) {
    std::printf("cuda_threads_demo: no CUDA device; nothing to run\n");
    return 0;
  }
  examples::GlobalShape shape;
  shape.seq_q = 1024;
  shape.heads = 8;
  shape.kv_heads = 2;
  shape.head_dim = 128;
  shape.causal = true;
  const examples::GlobalInputs inputs = examples::make_inputs(shape);
  const double tolerance = 2.5e-2;  // bf16
  bool ok = true;
  auto report = [&](const char* name, int ranks, double err) {
    std::printf("cuda_threads_demo: %-22s %d ranks: max_rel_err=%.3e\n", name, ranks, err);
    ok = ok && err <= tolerance;
  };
  report("Ulysses", 4, run(UlyssesPolicy{}, 4, inputs));
  report("Ring<Zigzag>", 4, run(RingPolicy<Zigzag>{}, 4, inputs));
  report("Unified<Zigzag> 2x2", 4, run(UnifiedPolicy<Zigzag>{2, 2}, 4, inputs));
  report("Anything<Ring<Stripe>>", 3, run(AnythingPolicy<RingPolicy<Stripe>>{}, 3, inputs));
  return ok ? 0 : 1;
}
