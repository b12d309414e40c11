#pragma once
/// \file
/// What every CudaFlashKernel device kernel shares: the argument blocks FwdArgs and BwdArgs
/// (the whole of what a kernel reads besides shared memory, passed by value at launch), the
/// score map (scale and soft-cap), the warp reductions, and backward_row_stats (the
/// per-query-row D_i and LSE that both backward kernels stage). Split out of
/// kernel/cuda/flash_kernel.cuh so that the SIMT and tensor-core kernels
/// (kernel/cuda/flash_simt.cuh, kernel/cuda/flash_tensor_core_forward.cuh,
/// kernel/cuda/flash_tensor_core_backward.cuh) depend on one small header rather than on each
/// other. Include kernel/cuda/flash_kernel.cuh to use the kernel.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "seqpar/cuda/types.hpp"
#include "seqpar/core/mask.hpp"
#include "seqpar/core/sequence_layout.hpp"
#include "seqpar/ops/cuda_ops.cuh"
#include "seqpar/kernel/tile_math.hpp"

namespace seqpar {
namespace cuda_detail {

/// How a kernel turns a dot product q.k into the score its softmax takes, in log2 units (the
/// kernels exponentiate with exp2): dot * scale * log2(e), or with a soft-cap c (Gemma 2's
/// logit soft-capping), c log2(e) tanh(dot * scale / c). Both are one multiply of the dot
/// product, `mul`, and `finish` of the product, so a kernel may fold `mul` into Q as it loads it.
struct ScoreMap {
  float mul = 0.0f;       ///< multiplies the dot product: scale log2(e), or scale / c with a cap
  float cap_log2 = 0.0f;  ///< c log2(e); 0: no cap

  /// The map of softmax scale `scale` and soft-cap `softcap` (0: none), host side.
  static ScoreMap from(double scale, double softcap) {
    if (softcap > 0)
      return {static_cast<float>(scale / softcap), static_cast<float>(softcap) * tile::log2e};
    return {static_cast<float>(scale) * tile::log2e, 0.0f};
  }
  /// Whether a cap applies.
  SEQPAR_HOST_DEVICE bool capped() const { return cap_log2 > 0.0f; }
  /// The score (log2 units) of x = dot * mul.
  SEQPAR_HOST_DEVICE float finish(float x) const { return capped() ? cap_log2 * tanhf(x) : x; }
  /// The score (log2 units) of x = dot * mul, and in `ds_factor` what the cap contributes to
  /// dS = dL / d(scaled dot): 1 - tanh(x)^2, which is 1 - (s / c)^2 of the capped score s
  /// (1 without a cap).
  SEQPAR_HOST_DEVICE float finish(float x, float& ds_factor) const {
    if (!capped()) {
      ds_factor = 1.0f;
      return x;
    }
    const float t = tanhf(x);
    ds_factor = 1.0f - t * t;
    return cap_log2 * t;
  }
};

/// Everything a forward kernel reads besides shared memory.
template <class T, class O>
struct FwdArgs {
  DeviceView<const T> q, k, v;
  DeviceView<O> out;
  DeviceView<float> lse;  // data == nullptr: not written
  std::int64_t sq, sk;
  int dim, dim_v;    // D of Q and K; D_v of V and O
  ScoreMap score;    // scale and soft-cap
  MaskView mask;     // causal merged in; tables in device memory (DeviceMaskTables)
  PositionMap qpos, kpos;  // query diagonals, key positions (KernelParams)
  tile::HeadMap heads;
};

/// Everything the backward kernel reads.
template <class T>
struct BwdArgs {
  DeviceView<const T> dout, q, k, v, out;
  DeviceView<const float> lse;
  DeviceView<float> dq, dk, dv;
  std::int64_t sq, sk;
  int dim, dim_v;    // D of Q, K, dQ, dK; D_v of V, O, dO, dV
  float scale;       // softmax scale (dQ and dK are scale dS K and scale dS^T Q)
  ScoreMap score;    // scale and soft-cap of the forward's scores
  MaskView mask;     // causal merged in; tables in device memory (DeviceMaskTables)
  PositionMap qpos, kpos;  // query diagonals, key positions (KernelParams)
  tile::HeadMap heads;
};

/// The maximum of `x` over the 32 lanes of the warp (every lane gets it).
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
/// The sum of `x` over the 32 lanes of the warp (every lane gets it).
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

/// Whether `x` is nonzero in any of the 32 lanes of the warp (every lane gets it).
__device__ __forceinline__ bool warp_any(bool x) {
  int v = x ? 1 : 0;
  for (int o = 16; o > 0; o >>= 1) v |= __shfl_xor_sync(0xffffffffu, v, o);
  return v != 0;
}

/// What the backward needs per query row besides Q and dO: D_i = rowsum(dO * O) into sD and
/// the LSE in log2 units into sL, for query rows i0 .. i0 + nq of head h; each warp fills ROWS
/// consecutive rows. Rows past nq get D = 0 and LSE = -inf, the marker of a row that
/// contributes nothing (so does a row that saw no key in the forward).
template <int ROWS, class T>
__device__ __forceinline__ void backward_row_stats(const BwdArgs<T>& a, std::int64_t b, std::int64_t h,
                                                   std::int64_t i0, int nq, float* sD, float* sL) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int rr = 0; rr < ROWS; ++rr) {
    const int r = warp * ROWS + rr;
    float acc = 0.0f;
    if (r < nq) {
      const T* orow = a.out.row(b, i0 + r, h);
      const T* grow = a.dout.row(b, i0 + r, h);
      for (int d = lane; d < a.dim_v; d += 32) acc += to_float(orow[d]) * to_float(grow[d]);
    }
    acc = warp_sum(acc);
    if (lane == 0) {
      sD[r] = acc;
      sL[r] = r < nq ? *a.lse.row(b, i0 + r, h) * tile::log2e : -INFINITY;
    }
  }
}

}  // namespace cuda_detail
}  // namespace seqpar
