#pragma once
// GPU test support: device buffers and streams (RAII), element conversions for __half and
// __nv_bfloat16, the tolerances of each element type, a policy run on one GPU — P ranks as
// threads over CudaThreadCommunicator, each on its own stream — checked row by row against the
// exact double reference of tests/support (make_global_as / make_global_grads, compare_rows /
// compare_grads), and the byte traffic check of any device communicator.

#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

#include "seqpar/comm/cuda_thread_communicator.hpp"
#include "seqpar/cuda/error.hpp"
#include "seqpar/cuda/types.hpp"
#include "seqpar/kernel/cuda/flash_kernel.cuh"
#include "kernel_instances.hpp"
#include "seqpar/seqpar.hpp"
#include "support/attention_check.hpp"
#include "support/backward_check.hpp"

namespace seqpar::gpu_test {

/// Normwise relative tolerance (max |got - want| / max |want|) of a forward against the exact
/// reference on the same (rounded) inputs. float: the project's 1e-5 (SIMT float math). Half and
/// bf16 round P before P V on tensor cores and round the output: half (11-bit significand, unit
/// roundoff 4.9e-4) and bf16 (8-bit, 3.9e-3) get TransformerEngine's CP-test tolerances, 5e-3
/// and 2.5e-2, about ten times the unit roundoff.
template <class T>
inline constexpr double tolerance = std::is_same_v<T, __half> ? 5e-3 : std::is_same_v<T, __nv_bfloat16> ? 2.5e-2 : 1e-5;

/// Gradients: float as the project's backward (1e-4); half and bf16 as their forward (the
/// gradients are rounded to T at the end).
template <class T>
inline constexpr double grad_tolerance = std::is_same_v<T, float> ? 1e-4 : tolerance<T>;

/// Readable name of an element type.
template <class T>
constexpr const char* type_name() {
  return std::is_same_v<T, __half> ? "half" : std::is_same_v<T, __nv_bfloat16> ? "bf16" : "float";
}

/// x converted to T (exact when x came from a T, as make_global_as<T> inputs do).
template <class T>
T from_double(double x) {
  if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(static_cast<float>(x));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(static_cast<float>(x));
  else
    return static_cast<T>(x);
}

/// x as double.
template <class T>
double to_double(T x) {
  if constexpr (std::is_same_v<T, __half>)
    return static_cast<double>(__half2float(x));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return static_cast<double>(__bfloat162float(x));
  else
    return static_cast<double>(x);
}

/// Device memory of n elements of T, freed on destruction.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    if (n_ > 0) SEQPAR_CUDA_CHECK(cudaMalloc(&p_, n_ * sizeof(T)));
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  T* data() const { return p_; }
  std::size_t size() const { return n_; }

  /// Copies host doubles in, converted to T.
  void upload(const std::vector<double>& x) {
    std::vector<T> h(x.size());
    std::transform(x.begin(), x.end(), h.begin(), from_double<T>);
    upload_raw(h);
  }
  /// Copies host elements in.
  void upload_raw(const std::vector<T>& h) {
    SEQPAR_CHECK(h.size() == n_, ConfigError, "DeviceBuffer::upload: expected ", n_, " elements, got ", h.size());
    if (n_) SEQPAR_CUDA_CHECK(cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
    // cudaMemcpy from pageable memory may return before the DMA lands, and the tests' own
    // streams are non-blocking (not ordered after the legacy stream): wait here.
    SEQPAR_CUDA_CHECK(cudaDeviceSynchronize());
  }
  /// Fills every byte with `byte` (0xff makes float and half NaN: a sentinel for unwritten output).
  void poison(int byte = 0xff) {
    if (n_) SEQPAR_CUDA_CHECK(cudaMemset(p_, byte, n_ * sizeof(T)));
    SEQPAR_CUDA_CHECK(cudaDeviceSynchronize());  // see upload_raw
  }
  /// Copies out as doubles (synchronous).
  std::vector<double> download() const {
    std::vector<T> h(n_);
    if (n_) SEQPAR_CUDA_CHECK(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    std::vector<double> out(n_);
    std::transform(h.begin(), h.end(), out.begin(), to_double<T>);
    return out;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

/// A non-blocking CUDA stream, destroyed at the end of its scope.
class Stream {
 public:
  Stream() { SEQPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { cudaStreamDestroy(s_); }
  operator cudaStream_t() const { return s_; }  // NOLINT: a stream handle
  void sync() const { SEQPAR_CUDA_CHECK(cudaStreamSynchronize(s_)); }

 private:
  cudaStream_t s_ = nullptr;
};

/// Device copy of a global BSHD tensor's rows at `pos` (as T).
template <class T>
DeviceBuffer<T> rows_on_device(const std::vector<double>& global, std::int64_t batch, std::int64_t seq,
                               std::int64_t heads, std::int64_t dim, const PositionMap& pos) {
  DeviceBuffer<T> d(static_cast<std::size_t>(batch * pos.size() * heads * dim));
  d.upload(test::take_rows<double>(global, batch, seq, heads, dim, pos));
  return d;
}

/// How a GPU policy run is set up.
struct GpuRunOptions {
  std::vector<std::int64_t> lengths_q, lengths_kv;  ///< per world rank; empty: even split
  bool with_lse = true;       ///< ask for the LSE
  bool tensor_cores = true;   ///< allow CudaFlashKernel's tensor-core path
  bool backward = false;      ///< also run backward and compare gradients
};

/// Errors of one GPU run.
struct GpuRunResult {
  test::Errors out;       ///< forward output and LSE
  test::GradErrors grads; ///< when backward ran
};

/// Lengths filled in (even split when empty) for `ranks` ranks of `policy`.
template <class Policy>
GpuRunOptions resolved(GpuRunOptions opt, const Policy& policy, int ranks, const test::GlobalShape& c) {
  opt = test::with_lengths(std::move(opt), policy, ranks, c);
  if (opt.backward) opt.with_lse = true;
  return opt;
}

/// One rank's part of a GPU run over any CudaSpace communicator: plan, forward (and backward)
/// on `stream`, and this rank's rows compared with the reference.
template <class T, class Policy, class Comm>
GpuRunResult run_rank(Comm& comm, Policy policy, const test::GlobalData& g, const test::ReferenceGrads* gr,
                      const GpuRunOptions& opt, cudaStream_t stream) {
  const test::GlobalShape& c = g.shape;
  const std::int64_t B = c.batch, H = c.heads, K = c.kv_head_count(), D = c.head_dim;
  using A = acc_t<T>;
  const int w = comm.rank();
  SequenceParallelAttention<Policy, Comm, CudaFlashKernel> attn(comm, policy);
  use_stream(attn, stream);
  attn.kernel().set_tensor_cores(opt.tensor_cores);
  const Plan plan = attn.plan(c.problem<T>(opt.with_lse), {opt.lengths_q[w], opt.lengths_kv[w]});
  const PositionMap qp = plan.q_positions(w), kp = plan.kv_positions(w);
  const std::int64_t lq = qp.size(), lk = kp.size();
  auto q = rows_on_device<T>(g.q, B, c.seq_q, H, D, qp);
  auto k = rows_on_device<T>(g.k, B, c.kv_len(), K, D, kp);
  auto v = rows_on_device<T>(g.v, B, c.kv_len(), K, D, kp);
  DeviceBuffer<T> out(static_cast<std::size_t>(B * lq * H * D));
  DeviceBuffer<A> lse(static_cast<std::size_t>(B * lq * H));
  out.poison();
  lse.poison();
  DeviceBuffer<std::byte> ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
  using CV = TensorView<const T, CudaSpace>;
  using V = TensorView<T, CudaSpace>;
  using AV = TensorView<A, CudaSpace>;
  const CV qv = CV::bshd(q.data(), B, lq, H, D), kv = CV::bshd(k.data(), B, lk, K, D),
           vv = CV::bshd(v.data(), B, lk, K, D);
  const AV lv = opt.with_lse ? AV::lse_bhs(lse.data(), B, lq, H) : AV{};
  attn.template forward<T>(plan, qv, kv, vv, V::bshd(out.data(), B, lq, H, D), lv,
                           std::span<std::byte>(ws.data(), ws.size()));
  SEQPAR_CUDA_CHECK(cudaStreamSynchronize(stream));
  GpuRunResult res;
  res.out = test::compare_rows(out.download(), opt.with_lse ? lse.download() : std::vector<double>{}, g, qp);
  if (opt.backward) {
    auto dout = rows_on_device<T>(g.dout, B, c.seq_q, H, D, qp);
    DeviceBuffer<T> dq(q.size()), dk(k.size()), dv(v.size());
    dq.poison();
    dk.poison();
    dv.poison();
    attn.template backward<T>(plan, CV::bshd(dout.data(), B, lq, H, D), qv, kv, vv, CV::bshd(out.data(), B, lq, H, D),
                              TensorView<const A, CudaSpace>(lv), V::bshd(dq.data(), B, lq, H, D),
                              V::bshd(dk.data(), B, lk, K, D), V::bshd(dv.data(), B, lk, K, D),
                              std::span<std::byte>(ws.data(), ws.size()));
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(stream));
    res.grads = test::compare_grads(dq.download(), dk.download(), dv.download(), *gr, c, qp, kp);
  }
  return res;
}

/// Folds one rank's errors into the run's.
inline void merge_into(GpuRunResult& all, const GpuRunResult& mine) {
  all.out.merge(mine.out);
  all.grads.merge(mine.grads);
}

/// Runs `policy` with `ranks` threads on the current GPU (CudaThreadCommunicator, each rank its
/// own stream) on inputs `g` (rounded to T); compares every rank's rows with the reference,
/// and, with opt.backward, the gradients with `gr`.
template <class T, class Policy>
GpuRunResult run_on_gpu(int ranks, Policy policy, const test::GlobalData& g, const test::ReferenceGrads* gr,
                        GpuRunOptions opt = {}) {
  opt = resolved(std::move(opt), policy, ranks, g.shape);
  int device = 0;
  SEQPAR_CUDA_CHECK(cudaGetDevice(&device));
  GpuRunResult res;
  std::mutex mu;
  run_ranks<CudaSpace>(
      ranks,
      [&](CudaThreadCommunicator& comm) {
        SEQPAR_CUDA_CHECK(cudaSetDevice(device));
        Stream stream;
        const GpuRunResult mine = run_rank<T>(comm, policy, g, gr, opt, stream);
        std::lock_guard lock(mu);
        merge_into(res, mine);
      },
      ThreadRunOptions{std::chrono::milliseconds(120000)});
  return res;
}

/// All-to-all with variable counts, a ring exchange and a split on P ranks of any CudaSpace
/// communicator (run on every rank): rank r sends (j + 1) floats of value 10 r + j to rank j.
template <class Comm>
void check_moves_bytes(Comm& comm, cudaStream_t stream, int P) {
  const int r = comm.rank();
  CHECK(comm.size() == P);
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
  Comm half = comm.split(r % 2, r);
  CHECK(half.size() == (P + 1 - r % 2) / 2);
  CHECK(half.rank() == r / 2);
  CHECK(&half.stats() == &comm.stats());
  half.barrier();
}

}  // namespace seqpar::gpu_test
