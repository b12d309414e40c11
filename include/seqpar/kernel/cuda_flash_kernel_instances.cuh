#pragma once
/// \file
/// Forwarding header, kept so that existing includes compile: the instance macros lives in
/// seqpar/kernel/cuda/flash_kernel_instances.cuh (one folder per layer).

#include "seqpar/kernel/cuda/flash_kernel_instances.cuh"
