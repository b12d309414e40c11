#pragma once
/// \file
/// Memory spaces, element types and the accumulation type.

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace seqpar {

/// Host (CPU) memory. Communicators and kernels name the space they work in; a pair that
/// disagrees fails to compile.
struct HostSpace {
  static constexpr const char* name = "HostSpace";  ///< readable name, for messages
};

/// CUDA device memory.
struct CudaSpace {
  static constexpr const char* name = "CudaSpace";  ///< readable name, for messages
};

/// Element type of Q, K, V and O, recorded in a plan so that forward can check it.
enum class DType : std::uint8_t { f16, bf16, f32, f64 };

/// Readable name of a DType ("f32", ...).
constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
    case DType::f64: return "f64";
  }
  return "?";
}

/// Maps an element type to its DType; specialised for the CUDA half types in the CUDA headers.
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> : std::integral_constant<DType, DType::f32> {};
template <>
struct dtype_of<double> : std::integral_constant<DType, DType::f64> {};

/// Shorthand for dtype_of<T>::value.
template <class T>
inline constexpr DType dtype_v = dtype_of<std::remove_const_t<T>>::value;

/// Accumulation type: float32 for every type except double, which keeps double so that the
/// double path can serve as an exact check. LSE, softmax statistics and ring partial outputs
/// use it.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<std::remove_const_t<T>, double>, double, float>;

/// Bytes of one element of a DType.
constexpr std::size_t dtype_bytes(DType t) { return t == DType::f64 ? 8 : t == DType::f32 ? 4 : 2; }
/// Bytes of one element of a DType's accumulation type (acc_t): 8 for f64, else 4.
constexpr std::size_t acc_bytes(DType t) { return t == DType::f64 ? 8 : 4; }

}  // namespace seqpar
