// The CudaFlashKernel instances both CUDA examples run, compiled once for the two of them
// (the list: flash_instances.cuh).
#include "flash_instances.cuh"

SEQPAR_EXAMPLE_FLASH_INSTANCE_LIST()
