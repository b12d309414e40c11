#pragma once
/// \file
/// The CUDA element types seqpar accepts: __half (DType::f16) and __nv_bfloat16 (DType::bf16).
/// Both accumulate in float (acc_t). Host code can include this with a plain C++ compiler.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "seqpar/core/types.hpp"

namespace seqpar {

/// IEEE half precision: DType::f16.
template <>
struct dtype_of<__half> : std::integral_constant<DType, DType::f16> {};
/// bfloat16: DType::bf16.
template <>
struct dtype_of<__nv_bfloat16> : std::integral_constant<DType, DType::bf16> {};

}  // namespace seqpar
