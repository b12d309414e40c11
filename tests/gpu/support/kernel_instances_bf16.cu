// CudaFlashKernel for __nv_bfloat16, compiled once for every GPU test program (see kernel_instances.hpp).
#include "kernel_instances.hpp"

SEQPAR_KERNEL_INSTANCES_16BIT(, __nv_bfloat16)
