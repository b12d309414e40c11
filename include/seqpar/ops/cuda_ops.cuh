#pragma once
/// \file
/// TensorOps<CudaSpace>: the operations the policies run between kernel calls (strided copy
/// with type conversion for all-to-all packing, accumulate, fill, the float32 LSE merge of
/// ring partial results, and the attention sinks: joining them to the merged rows and their
/// gradient), as CUDA kernels on a caller-given stream. The merge and the sinks run the same
/// row rules as the host, merge_row, join_sink and sink_grad_row (kernel/merge_state.hpp).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "seqpar/cuda/error.hpp"
#include "seqpar/cuda/types.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/cuda/launch.cuh"
#include "seqpar/ops/host_ops.hpp"

namespace seqpar {
namespace cuda_detail {

/// Element conversions through float, the only type every CUDA element type converts to
/// exactly; same-type copies stay bit-exact.
template <class T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __half>)
    return __half2float(x);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(x);
  else
    return static_cast<float>(x);
}

/// Converts `x` to D, rounding to nearest.
template <class D, class S>
__device__ __forceinline__ D convert(S x) {
  if constexpr (std::is_same_v<D, S>)
    return x;
  else if constexpr (std::is_same_v<D, __half>)
    return __float2half_rn(to_float(x));
  else if constexpr (std::is_same_v<D, __nv_bfloat16>)
    return __float2bfloat16_rn(to_float(x));
  else if constexpr (std::is_same_v<S, __half> || std::is_same_v<S, __nv_bfloat16>)
    return static_cast<D>(to_float(x));
  else
    return static_cast<D>(x);
}

/// A TensorView reduced to what a kernel needs: the pointer, three strides (head_dim is
/// contiguous) and the extents used to unflatten an index.
template <class T>
struct DeviceView {
  T* data;
  std::int64_t stride_b, stride_s, stride_h;
  std::int64_t seq, heads, dim;

  __device__ __forceinline__ T* row(std::int64_t b, std::int64_t s, std::int64_t h) const {
    return data + b * stride_b + s * stride_s + h * stride_h;
  }
};

/// Host-side conversion from a TensorView.
template <class T, class Space>
DeviceView<T> device_view(const TensorView<T, Space>& v) {
  return {v.data, v.stride[0], v.stride[1], v.stride[2], v.extent[1], v.extent[2], v.extent[3]};
}

/// Splits a flat row index (over batch, seq, heads) into its coordinates.
struct RowCoord {
  std::int64_t b, s, h;
};
template <class T>
__device__ __forceinline__ RowCoord unflatten_row(std::int64_t row, const DeviceView<T>& v) {
  const std::int64_t h = row % v.heads;
  const std::int64_t bs = row / v.heads;
  return {bs / v.seq, bs % v.seq, h};
}

enum class CopyMode { assign, add };

/// dst = src or dst += src, one thread per element, grid-stride.
template <CopyMode mode, class S, class D>
__global__ void copy_kernel(DeviceView<const S> src, DeviceView<D> dst, std::int64_t total) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const std::int64_t d = i % src.dim;
    const RowCoord r = unflatten_row(i / src.dim, src);
    const S x = src.row(r.b, r.s, r.h)[d];
    D& y = dst.row(r.b, r.s, r.h)[d];
    if constexpr (mode == CopyMode::assign)
      y = convert<D>(x);
    else
      y = convert<D>(to_float(y) + to_float(x));
  }
}

/// dst = value, one thread per element.
template <class D>
__global__ void fill_kernel(DeviceView<D> dst, D value, std::int64_t total) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const RowCoord r = unflatten_row(i / dst.dim, dst);
    dst.row(r.b, r.s, r.h)[i % dst.dim] = value;
  }
}

/// merge_row per row, one warp per row: every lane merges its columns with the row's old
/// LSE, then lane 0 writes the new LSE (after the warp has read the old one).
template <class A, class P>
__global__ void merge_kernel(DeviceView<A> o1, DeviceView<A> l1, DeviceView<const P> o2, DeviceView<const A> l2,
                             std::int64_t rows) {
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t row = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; row < rows;
       row += warps) {
    const RowCoord r = unflatten_row(row, o1);
    const A la = *l1.row(r.b, r.s, r.h);
    const A lb = *l2.row(r.b, r.s, r.h);
    A* out = o1.row(r.b, r.s, r.h);
    const P* in = o2.row(r.b, r.s, r.h);
    for (std::int64_t d = lane; d < o1.dim; d += 32) {
      A l = la;
      merge_row(out + d, l, in + d, lb, 1);
    }
    __syncwarp();
    if (lane == 0) {
      A l = la;
      merge_row<A, P>(nullptr, l, nullptr, lb, 0);
      *l1.row(r.b, r.s, r.h) = l;
    }
  }
}

/// join_sink per row, one warp per row, as merge_kernel: every lane joins the sink to its
/// columns with the row's old LSE, then lane 0 writes the new LSE.
template <class O, class A>
__global__ void join_sinks_kernel(DeviceView<O> o, DeviceView<A> l, const float* sinks, std::int64_t rows) {
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t row = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; row < rows;
       row += warps) {
    const RowCoord r = unflatten_row(row, o);
    const A la = *l.row(r.b, r.s, r.h), sink = static_cast<A>(sinks[r.h]);
    O* out = o.row(r.b, r.s, r.h);
    for (std::int64_t d = lane; d < o.dim; d += 32) {
      A lc = la;
      join_sink(out + d, lc, sink, 1);
    }
    __syncwarp();
    if (lane == 0) {
      A lc = la;
      join_sink<A, O>(nullptr, lc, sink, 0);
      *l.row(r.b, r.s, r.h) = lc;
    }
  }
}

/// Threads per block of sink_grads_kernel (a power of two: the reduction halves it).
inline constexpr int sink_grad_threads = 256;

/// d_sinks[h] for head h = blockIdx.x: thread t sums sink_grad_row over rows t, t + 256, ...
/// of the head (b major, s minor), then the block adds the 256 partial sums pairwise in a fixed
/// order. No atomics, so the same inputs give the same bits on every run.
template <class T, class A>
__global__ void __launch_bounds__(sink_grad_threads)
    sink_grads_kernel(DeviceView<const T> dout, DeviceView<const T> out, DeviceView<const A> l, const float* sinks,
                      float* d_sinks, std::int64_t batch) {
  __shared__ A part[sink_grad_threads];
  const std::int64_t h = blockIdx.x, rows = batch * out.seq;
  const A sink = static_cast<A>(sinks[h]);
  A sum = 0;
  for (std::int64_t r = threadIdx.x; r < rows; r += sink_grad_threads) {
    const std::int64_t b = r / out.seq, s = r - b * out.seq;
    sum += sink_grad_row(dout.row(b, s, h), out.row(b, s, h), *l.row(b, s, h), sink, out.dim);
  }
  part[threadIdx.x] = sum;
  __syncthreads();
  for (int half = sink_grad_threads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) d_sinks[h] = static_cast<float>(part[0]);
}

/// Blocks for a grid-stride launch over `work` items: enough to fill the GPU, capped so the
/// launch stays cheap.
inline unsigned grid_for(std::int64_t work, int threads) {
  const std::int64_t blocks = (work + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, 16384));
}

template <class S, class D>
void check_same_extents(const TensorView<S, CudaSpace>& src, const TensorView<D, CudaSpace>& dst, const char* what) {
  for (int i = 0; i < 4; ++i)
    SEQPAR_CHECK(src.extent[i] == dst.extent[i], ConfigError, "TensorOps<CudaSpace>::", what, ": extent[", i,
                 "] of dst: expected ", src.extent[i], " (as src), got ", dst.extent[i]);
}

/// Checks that the LSE view `l` has a row for every row of `o` ([B, S, H] alike).
template <class O, class A>
void check_rows(const TensorView<O, CudaSpace>& o, const TensorView<A, CudaSpace>& l, const char* what) {
  for (int i = 0; i < 3; ++i)
    SEQPAR_CHECK(l.extent[i] == o.extent[i], ConfigError, "TensorOps<CudaSpace>::", what, ": extent[", i,
                 "] of the LSE: expected ", o.extent[i], " (as the output), got ", l.extent[i]);
}

}  // namespace cuda_detail

/// Tensor operations on device memory, enqueued on `stream()` (default: the legacy default
/// stream). Give it the stream the kernel and the communicator use, so that every step of a
/// forward is ordered: SequenceParallelAttention::ops().set_stream(s), or use_stream().
template <>
struct TensorOps<CudaSpace> {
  /// The stream every operation is enqueued on.
  cudaStream_t stream() const { return stream_; }
  /// Sets the stream.
  void set_stream(cudaStream_t s) { stream_ = s; }

  /// dst = src, converting the element type; extents must match.
  template <class S, class D>
  void copy(TensorView<const S, CudaSpace> src, TensorView<D, CudaSpace> dst) const {
    elementwise<cuda_detail::CopyMode::assign>(src, dst, "copy");
  }
  /// dst += src, converting the element type (the sum is formed in float); extents must match.
  template <class S, class D>
  void accumulate(TensorView<const S, CudaSpace> src, TensorView<D, CudaSpace> dst) const {
    elementwise<cuda_detail::CopyMode::add>(src, dst, "accumulate");
  }
  /// Sets every element of `dst` to `value`.
  template <class D>
  void fill(TensorView<D, CudaSpace> dst, D value) const {
    const std::int64_t total = dst.numel();
    if (total == 0) return;
    constexpr int threads = 256;
    cuda_detail::launch(cuda_detail::fill_kernel<D>, cuda_detail::grid_for(total, threads), threads, 0, stream_,
                        cuda_detail::device_view(dst), value, total);
  }
  /// Merges (o2, l2) into (o1, l1) row by row with merge_row (float32 LSE rule); o2 may be of
  /// the element type (a kernel that writes only T).
  template <class A, class P>
  void merge(TensorView<A, CudaSpace> o1, TensorView<A, CudaSpace> l1, TensorView<const P, CudaSpace> o2,
             TensorView<const A, CudaSpace> l2) const {
    cuda_detail::check_same_extents(o2, o1, "merge");
    const std::int64_t rows = o1.batch() * o1.seq() * o1.heads();
    if (rows == 0) return;
    constexpr int threads = 256;
    cuda_detail::launch(cuda_detail::merge_kernel<A, P>, cuda_detail::grid_for(rows * 32, threads), threads, 0, stream_,
                        cuda_detail::device_view(o1), cuda_detail::device_view(l1), cuda_detail::device_view(o2),
                        cuda_detail::device_view(l2), rows);
  }
  /// Joins head h's sink, sinks[h] (h counted from the view's first head), to every row of
  /// (o, l) with join_sink, as TensorOps<HostSpace>::join_sinks. `sinks` is in device memory.
  template <class O, class A>
  void join_sinks(TensorView<O, CudaSpace> o, TensorView<A, CudaSpace> l, const float* sinks) const {
    cuda_detail::check_rows(o, l, "join_sinks");
    const std::int64_t rows = o.batch() * o.seq() * o.heads();
    if (rows == 0) return;
    constexpr int threads = 256;
    cuda_detail::launch(cuda_detail::join_sinks_kernel<O, A>, cuda_detail::grid_for(rows * 32, threads), threads, 0,
                        stream_, cuda_detail::device_view(o), cuda_detail::device_view(l), sinks, rows);
  }
  /// d_sinks[h] = the sum over every row of head h of sink_grad_row (overwrites; h counted
  /// from the views' first head), as TensorOps<HostSpace>::sink_grads: a reduction in a fixed
  /// order, the same bits on every run. `sinks` and `d_sinks` are in device memory.
  template <class T, class A>
  void sink_grads(TensorView<const T, CudaSpace> dout, TensorView<const T, CudaSpace> out,
                  TensorView<const A, CudaSpace> l, const float* sinks, float* d_sinks) const {
    cuda_detail::check_same_extents(out, dout, "sink_grads");
    cuda_detail::check_rows(out, l, "sink_grads");
    if (out.heads() == 0) return;
    SEQPAR_CHECK(out.heads() <= 0x7fffffff, ConfigError, "TensorOps<CudaSpace>::sink_grads: heads: expected <= ",
                 0x7fffffff, ", got ", out.heads());
    cuda_detail::launch(cuda_detail::sink_grads_kernel<T, A>, static_cast<unsigned>(out.heads()),
                        cuda_detail::sink_grad_threads, 0, stream_, cuda_detail::device_view(dout),
                        cuda_detail::device_view(out), cuda_detail::device_view(l), sinks, d_sinks, out.batch());
  }
  /// Copies `bytes` of device memory at `src` to host memory at `dst` after everything enqueued
  /// on stream() so far, and waits for them: a host synchronisation with the stream, meant for
  /// a few bytes of metadata (decode's step tags), not for tensors.
  void to_host(const void* src, void* dst, std::size_t bytes) const {
    if (bytes == 0) return;
    SEQPAR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

 private:
  template <cuda_detail::CopyMode mode, class S, class D>
  void elementwise(TensorView<const S, CudaSpace> src, TensorView<D, CudaSpace> dst, const char* what) const {
    cuda_detail::check_same_extents(src, dst, what);
    const std::int64_t total = src.numel();
    if (total == 0) return;
    constexpr int threads = 256;
    cuda_detail::launch(cuda_detail::copy_kernel<mode, S, D>, cuda_detail::grid_for(total, threads), threads, 0,
                        stream_, cuda_detail::device_view(src), cuda_detail::device_view(dst), total);
  }

  cudaStream_t stream_ = nullptr;
};

}  // namespace seqpar
