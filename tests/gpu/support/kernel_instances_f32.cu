// CudaFlashKernel for float, compiled once for every GPU test program (see kernel_instances.hpp).
#include "kernel_instances.hpp"

SEQPAR_KERNEL_INSTANCES(, float)
