#pragma once
// What the kernel-level GPU tests share: a tensor with a host copy in double and a device copy
// in T (padded head strides, to steer the kernel's path), the normwise error against the
// exact reference (plain, and on poisoned inputs), and whether the device has the tensor-core
// paths.

#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_check.hpp"

namespace seqpar::gpu_test {

/// A logical [B, S, H, D] tensor: host values (rounded to T) and a device copy whose head
/// stride is padded by `pad` elements (pad % 8 == 0 keeps rows 16-byte aligned; other pads
/// force the SIMT path).
template <class T>
struct Tensor {
  std::int64_t b, s, h, d, pad;
  std::vector<double> host;  // contiguous BSHD
  DeviceBuffer<T> dev;

  Tensor(std::int64_t b_, std::int64_t s_, std::int64_t h_, std::int64_t d_, std::int64_t pad_, std::mt19937_64& rng,
         double lo = -1.0, double hi = 1.0)
      : b(b_), s(s_), h(h_), d(d_), pad(pad_), host(static_cast<std::size_t>(b_ * s_ * h_ * d_)),
        dev(static_cast<std::size_t>(b_ * s_ * h_ * (d_ + pad_))) {
    std::uniform_real_distribution<double> u(lo, hi);
    for (auto& x : host) x = to_double(from_double<T>(u(rng)));
    upload();
  }
  /// Copies the host values to the device.
  void upload() {
    std::vector<double> padded(dev.size(), 0.0);
    for (std::int64_t r = 0; r < b * s * h; ++r)
      for (std::int64_t i = 0; i < d; ++i) padded[r * (d + pad) + i] = host[r * d + i];
    dev.upload(padded);
  }
  /// Sets every element of token `j` (all batches and heads) to `value`, here and on the device.
  void set_token(std::int64_t j, double value) {
    for (std::int64_t bb = 0; bb < b; ++bb)
      for (std::int64_t hh = 0; hh < h; ++hh)
        for (std::int64_t i = 0; i < d; ++i) host[((bb * s + j) * h + hh) * d + i] = value;
    upload();
  }
  /// The device copy, read-only.
  TensorView<const T, CudaSpace> view() const { return mut_view(); }
  /// The device copy.
  TensorView<T, CudaSpace> mut_view() const {
    return {dev.data(), {b, s, h, d}, {s * h * (d + pad), h * (d + pad), d + pad, 1}};
  }
  /// The host values.
  TensorView<const double> host_view() const { return TensorView<const double>::bshd(host.data(), b, s, h, d); }
  /// The device values, contiguous BSHD.
  std::vector<double> values() const {
    const std::vector<double> padded = dev.download();
    std::vector<double> out(host.size());
    for (std::int64_t r = 0; r < b * s * h; ++r)
      for (std::int64_t i = 0; i < d; ++i) out[r * d + i] = padded[r * (d + pad) + i];
    return out;
  }
};

/// max |a - b| / max |b|; infinite on NaN; -inf entries must match exactly.
inline double rel_error(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  double err = 0, ref = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return std::numeric_limits<double>::infinity();
    if (std::isinf(want[i])) {
      if (got[i] != want[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    err = std::max(err, std::abs(got[i] - want[i]));
    ref = std::max(ref, std::abs(want[i]));
  }
  return ref > 0 ? err / ref : err;
}

/// Whether the current device has the tensor-core paths (sm_80 and later).
inline bool tensor_core_device() {
  int dev = 0, major = 0;
  SEQPAR_CUDA_CHECK(cudaGetDevice(&dev));
  SEQPAR_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  return major >= 8;
}

/// Poisoned results against the reference on the same poisoned inputs: where the reference is
/// finite, `got` is finite, within `tol` (normwise over those entries) and, given `clean` (the
/// same kernel on unpoisoned inputs), equal to it; where the reference is NaN, `got` is NaN;
/// where it is infinite, `got` is NaN or infinite (an Inf times a rescale that underflowed to 0
/// is NaN). `row_len` elements make a row, for the messages. Returns the reference's finite count.
inline std::size_t check_poisoned(const char* what, const std::vector<double>& got, const std::vector<double>& want,
                           double tol, const std::vector<double>* clean, std::int64_t row_len) {
  REQUIRE(got.size() == want.size());
  std::size_t finite = 0, leaked = 0, lost = 0, changed = 0;
  std::int64_t first_leak = -1, first_lost = -1;
  double err = 0, ref = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const auto row = static_cast<std::int64_t>(i) / row_len;
    if (std::isfinite(want[i])) {
      ++finite;
      if (!std::isfinite(got[i])) {
        if (leaked++ == 0) first_leak = row;
        continue;
      }
      err = std::max(err, std::abs(got[i] - want[i]));
      ref = std::max(ref, std::abs(want[i]));
      if (clean && got[i] != (*clean)[i]) ++changed;
    } else if (std::isnan(want[i]) ? !std::isnan(got[i]) : std::isfinite(got[i])) {
      if (lost++ == 0) first_lost = row;
    }
  }
  INFO(std::string(what) << ": " << finite << " finite of " << got.size() << ", first leaked row " << first_leak
            << ", first row that lost its NaN/Inf " << first_lost);
  CHECK(leaked == 0);
  CHECK(lost == 0);
  CHECK((ref > 0 ? err / ref : err) <= tol);
  CHECK(changed == 0);
  return finite;
}

}  // namespace seqpar::gpu_test
