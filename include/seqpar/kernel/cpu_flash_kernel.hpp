#pragma once
/// \file
/// Forwarding header, kept so that existing includes compile: CpuFlashKernel lives in
/// seqpar/kernel/cpu/flash_kernel.hpp (one folder per layer).

#include "seqpar/kernel/cpu/flash_kernel.hpp"
