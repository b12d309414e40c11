// nccl_demo: sequence-parallel attention with one GPU per rank under mpirun: NCCL moves the
// data, MPI carries the metadata (only when the plan is made).
//   mpirun -np 4 build/examples/cuda/nccl_demo [unified|ulysses|ring]
// Each rank takes the GPU of its node-local rank and holds its slice of a causal bf16 GQA
// problem (8192 tokens, 8 query heads, 2 K/V heads, head dim 128); it runs forward on its own
// stream and checks its rows against the exact double reference. Rank 0 prints the error and
// the time per forward.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "common.hpp"  // random inputs, a rank's slices, the exact reference rows
#include "flash_instances.cuh"  // the kernels, compiled once for both examples
#include "seqpar/comm/mpi_communicator.hpp"
#include "seqpar/comm/nccl_communicator.hpp"
#include "seqpar/kernel/cuda/flash_kernel.cuh"
#include "seqpar/seqpar.hpp"

using namespace seqpar;
using T = __nv_bfloat16;
using Comm = NcclCommunicator<MpiCommunicator>;

namespace {

/// Device copy of a host vector.
template <class E>
E* to_device(const std::vector<E>& host) {
  E* p = nullptr;
  SEQPAR_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(host.size(), 1) * sizeof(E)));
  SEQPAR_CUDA_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(E), cudaMemcpyHostToDevice));
  // The copy ran on the legacy stream, which a non-blocking stream does not wait for.
  SEQPAR_CUDA_CHECK(cudaDeviceSynchronize());
  return p;
}

template <class Policy>
int run(Comm& comm, cudaStream_t stream, Policy policy, const char* name) {
  // Collective: splits NCCL and MPI into the Ulysses and ring groups.
  SequenceParallelAttention<Policy, Comm, CudaFlashKernel> attn(comm, policy);
  use_stream(attn, stream);  // kernel, tensor operations and communicators on one stream

  examples::GlobalShape shape;
  shape.seq_q = 8192;
  shape.heads = 8;
  shape.kv_heads = 2;
  shape.head_dim = 128;
  shape.causal = true;
  const int me = comm.rank();
  const Plan plan = attn.plan(shape.problem<T>(), {split_sequence(shape.seq_q, attn.mesh())[static_cast<std::size_t>(me)]});

  const examples::GlobalInputs inputs = examples::make_inputs(shape);
  const PositionMap qpos = plan.q_positions(me);
  examples::LocalSlices<T> l = examples::local_slices<T>(inputs, qpos, plan.kv_positions(me));
  T *q = to_device(l.q), *k = to_device(l.k), *v = to_device(l.v), *out = to_device(l.out);
  std::byte* ws = nullptr;
  SEQPAR_CUDA_CHECK(cudaMalloc(&ws, std::max<std::size_t>(plan.workspace_bytes(), 1)));
  using CV = TensorView<const T, CudaSpace>;
  const std::int64_t B = shape.batch, H = shape.heads, K = shape.kv_head_count(), D = shape.head_dim;
  auto forward = [&] {
    attn.template forward<T>(plan, CV::bshd(q, B, l.lq, H, D), CV::bshd(k, B, l.lkv, K, D), CV::bshd(v, B, l.lkv, K, D),
                             TensorView<T, CudaSpace>::bshd(out, B, l.lq, H, D),
                             std::span<std::byte>(ws, plan.workspace_bytes()));
  };
  forward();  // warm-up (first NCCL use of each group sets up its connections)
  cudaEvent_t t0, t1;
  SEQPAR_CUDA_CHECK(cudaEventCreate(&t0));
  SEQPAR_CUDA_CHECK(cudaEventCreate(&t1));
  constexpr int reps = 10;
  comm.barrier();
  SEQPAR_CUDA_CHECK(cudaEventRecord(t0, stream));
  for (int r = 0; r < reps; ++r) forward();
  SEQPAR_CUDA_CHECK(cudaEventRecord(t1, stream));
  SEQPAR_CUDA_CHECK(cudaEventSynchronize(t1));
  float ms = 0;
  SEQPAR_CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));

  SEQPAR_CUDA_CHECK(cudaMemcpy(l.out.data(), out, l.out.size() * sizeof(T), cudaMemcpyDeviceToHost));
  const examples::ErrorStats err =
      examples::reduce_errors(comm.host(), examples::compare(l.out, examples::reference_rows(inputs, qpos)));
  const double tolerance = 2.5e-2;  // bf16 (TransformerEngine's CP tolerance)
  if (me == 0)
    std::printf("nccl_demo: %s on %d GPUs (ulysses %d x ring %d): %.3f ms per forward, max_rel_err=%.3e (%s)\n",
                name, comm.size(), attn.mesh().ulysses, attn.mesh().ring, ms / reps, err.rel(),
                err.rel() <= tolerance ? "ok" : "TOO LARGE");
  for (T* p : {q, k, v, out}) cudaFree(p);
  cudaFree(ws);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  return err.rel() <= tolerance ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  MpiSession mpi(argc, argv);
  int status = 0;
  try {
    MpiCommunicator world(MPI_COMM_WORLD);
    MPI_Comm node = MPI_COMM_NULL;
    int local = 0;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world.rank(), MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
    const int devices = detail::cuda_device_count();
    if (devices == 0) {
      if (world.rank() == 0) std::printf("nccl_demo: no CUDA device; nothing to run\n");
      return 0;
    }
    SEQPAR_CUDA_CHECK(cudaSetDevice(local % devices));
    cudaStream_t stream = nullptr;
    SEQPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    {
      Comm comm = Comm::create(world, stream);  // collective: rank 0's NCCL id goes out over MPI
      const std::string which = argc > 1 ? argv[1] : "unified";
      if (which == "ulysses") {
        status = run(comm, stream, AnythingPolicy<UlyssesPolicy>{}, "Ulysses");
      } else if (which == "ring") {
        status = run(comm, stream, AnythingPolicy<RingPolicy<Zigzag>>{}, "Ring<Zigzag>");
      } else {
        // Ulysses groups of two adjacent ranks (same node), rings across them.
        const int u = comm.size() % 2 == 0 ? 2 : 1;
        status = run(comm, stream, AnythingPolicy<UnifiedPolicy<Zigzag>>{{u, 0}}, "Unified<Zigzag>");
      }
    }
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nccl_demo: %s\n", e.what());
    // A peer may be blocked in NCCL or MPI: take the whole job down rather than hang.
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return status;
}
