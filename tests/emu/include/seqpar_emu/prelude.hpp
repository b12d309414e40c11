#pragma once
/// \file
/// First include of every translation unit built for the CPU emulation of the CUDA device
/// (tests/emu). It makes the CUDA backend's own sources (include/seqpar/kernel/*.cuh, the
/// device-memory communicators, tests/gpu/*.cu) compile with the host C++ compiler and run
/// on the CPU, kernels included: one fiber per CUDA thread (see device.hpp).
///
/// Before cuda_runtime.h: `__shared__` variables become per-OS-thread statics (every fiber of
/// a block runs on the launching thread; ranks on other threads get their own copy) and
/// `__launch_bounds__` disappears, since the host headers leave both to nvcc.

#define SEQPAR_CUDA_EMULATION 1
#define __shared__ static thread_local
#define __launch_bounds__(...)

#include <cuda_runtime.h>

#include "seqpar_emu/device.hpp"
