// CpuFlashKernel's copies for ::seqpar::f16, compiled once for seqpar::cpu_kernels
// (include/seqpar/kernel/cpu/compiled_kernels.hpp).
#include "seqpar/kernel/cpu/flash_kernel.hpp"

SEQPAR_CPU_KERNEL_INSTANCES_16(template, ::seqpar::f16)
