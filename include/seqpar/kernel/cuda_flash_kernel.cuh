#pragma once
/// \file
/// Forwarding header, kept so that existing includes compile: CudaFlashKernel lives in
/// seqpar/kernel/cuda/flash_kernel.cuh (one folder per layer).

#include "seqpar/kernel/cuda/flash_kernel.cuh"
