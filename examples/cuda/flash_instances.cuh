#pragma once
// The examples' CudaFlashKernel instances, compiled once in flash_instances.cu, declared extern
// (see seqpar/kernel/cuda_flash_kernel_instances.cuh). CMakeLists.txt defines
// SEQPAR_EXAMPLE_FLASH_INSTANCES where it links that file; a demo compiled on its own
// instantiates the kernels itself.
#include "seqpar/kernel/cuda_flash_kernel_instances.cuh"

#ifdef SEQPAR_EXAMPLE_FLASH_INSTANCES
SEQPAR_CUDA_FLASH_FORWARD_INSTANCE(extern, __nv_bfloat16, __nv_bfloat16)
SEQPAR_CUDA_FLASH_FORWARD_INSTANCE(extern, __nv_bfloat16, float)
#endif
