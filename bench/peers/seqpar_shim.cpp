/// \file
/// A C ABI over seqpar's CpuFlashKernel, for the peer benchmark (bench/peers/peers.py loads
/// it with ctypes). Not part of the library or its build: run.sh compiles it with the flags
/// the project uses for its own programs. Errors come back as a non-zero status with the
/// message in seqpar_shim_last_error(), never as an exception across the C boundary.

#include <seqpar/seqpar.hpp>

#include <cmath>
#include <cstdint>
#include <exception>
#include <string>
#include <type_traits>

namespace {

thread_local std::string last_error;

/// Runs `f`, turning an exception into status 1 and its message into last_error.
template <class F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown exception";
  }
  return 1;
}

/// Stands in for seqpar::cpu_isa_name() while the library has none: a non-template function
/// of that name, when it exists, wins the overload resolution below over this template.
struct NoIsaName {};
template <class = void>
NoIsaName cpu_isa_name() {
  return {};
}

/// The vector path the kernel uses: its isa() (named by cpu_isa_name when it is an enum) where
/// the library picks one at run time, else the width fixed when this file was compiled.
template <class K>
const char* isa_name(const K* kernel) {
  static thread_local std::string name;
  using namespace seqpar;
  if constexpr (requires { std::string(cpu_isa_name(kernel->isa())); }) {
    name = cpu_isa_name(kernel->isa());
  } else if constexpr (requires { std::string(kernel->isa()); }) {
    name = kernel->isa();
  } else if constexpr (!std::is_same_v<decltype(cpu_isa_name()), NoIsaName>) {
    name = cpu_isa_name();
  } else {
#if defined(__AVX512F__)
    name = "compile-time width (AVX-512)";
#elif defined(__AVX2__)
    name = "compile-time width (AVX2)";
#else
    name = "compile-time width (SSE)";
#endif
  }
  return name.c_str();
}

}  // namespace

extern "C" {

/// The message of the last failed call on this thread ("" if none).
const char* seqpar_shim_last_error() { return last_error.c_str(); }

/// A kernel that runs on `threads` threads, prepared for head dims up to `max_head_dim`;
/// null on error.
void* seqpar_shim_create(int threads, std::int64_t max_head_dim) {
  seqpar::CpuFlashKernel* k = nullptr;
  guarded([&] {
    k = new seqpar::CpuFlashKernel(threads);
    k->prepare(max_head_dim);
  });
  return k;
}

void seqpar_shim_destroy(void* kernel) { delete static_cast<seqpar::CpuFlashKernel*>(kernel); }

/// Name of the CPU path `kernel` runs (see isa_name).
const char* seqpar_shim_isa(void* kernel) { return isa_name(static_cast<const seqpar::CpuFlashKernel*>(kernel)); }

}  // extern "C"

namespace {

/// One self-attention forward over a whole sequence of element type T (see the entries below).
template <class T>
int forward_typed(void* kernel, const void* q, const void* k, const void* v, void* out, float* lse, std::int64_t b,
                  std::int64_t s, std::int64_t h, std::int64_t d, int causal) {
  return guarded([&] {
    using namespace seqpar;
    KernelParams p;
    p.scale = 1.0 / std::sqrt(double(d));
    p.causal = causal != 0;
    p.q_positions = PositionMap::run(s, 0);
    p.k_positions = PositionMap::run(s, 0);
    using CV = TensorView<const T>;
    const auto lse_view = lse ? TensorView<float>::lse_bhs(lse, b, s, h) : TensorView<float>{};
    static_cast<CpuFlashKernel*>(kernel)->forward(
        CV::bshd(static_cast<const T*>(q), b, s, h, d), CV::bshd(static_cast<const T*>(k), b, s, h, d),
        CV::bshd(static_cast<const T*>(v), b, s, h, d), TensorView<T>::bshd(static_cast<T*>(out), b, s, h, d),
        lse_view, p);
  });
}

}  // namespace

extern "C" {

/// Self-attention forward over one whole sequence: q, k, v, out contiguous [B, S, H, D]
/// float32; lse contiguous [B, H, S] float32 (may be null); scale 1/sqrt(D). Returns 0 on success.
int seqpar_shim_forward(void* kernel, const float* q, const float* k, const float* v, float* out, float* lse,
                        std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d, int causal) {
  return forward_typed<float>(kernel, q, k, v, out, lse, b, s, h, d, causal);
}

/// As seqpar_shim_forward with q, k, v, out in bf16 (torch.bfloat16's bits: the upper half of
/// a float32, what seqpar::bf16 holds); lse stays float32. Returns 0 on success.
int seqpar_shim_forward_bf16(void* kernel, const void* q, const void* k, const void* v, void* out, float* lse,
                             std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d, int causal) {
  return forward_typed<seqpar::bf16>(kernel, q, k, v, out, lse, b, s, h, d, causal);
}

}  // extern "C"
