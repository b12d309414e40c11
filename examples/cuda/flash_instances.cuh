#pragma once
// The examples' CudaFlashKernel instances (see seqpar/kernel/cuda/flash_kernel_instances.cuh):
// bf16 forward, out in bf16 and in float. flash_instances.cu defines them once; CMakeLists.txt
// defines SEQPAR_EXAMPLE_FLASH_INSTANCES where it links that file, and the demos then declare
// them extern. A demo compiled on its own instantiates the kernels itself.
#include "seqpar/kernel/cuda/flash_kernel_instances.cuh"

/// The instances, declared (prefix `extern`) or defined (prefix empty).
#define SEQPAR_EXAMPLE_FLASH_INSTANCE_LIST(prefix)                            \
  SEQPAR_CUDA_FLASH_FORWARD_INSTANCE(prefix, __nv_bfloat16, __nv_bfloat16) \
  SEQPAR_CUDA_FLASH_FORWARD_INSTANCE(prefix, __nv_bfloat16, float)

#ifdef SEQPAR_EXAMPLE_FLASH_INSTANCES
SEQPAR_EXAMPLE_FLASH_INSTANCE_LIST(extern)
#endif
