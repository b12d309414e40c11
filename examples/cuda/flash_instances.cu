// The CudaFlashKernel instances both CUDA examples run, compiled once for the two of them
// (flash_instances.cuh declares them extern there): bf16 forward, out in bf16 and in float.
#include "seqpar/kernel/cuda_flash_kernel_instances.cuh"

SEQPAR_CUDA_FLASH_FORWARD_INSTANCE(, __nv_bfloat16, __nv_bfloat16)
SEQPAR_CUDA_FLASH_FORWARD_INSTANCE(, __nv_bfloat16, float)
