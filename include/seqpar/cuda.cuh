#pragma once
/// \file
/// Umbrella header of the CUDA backend (compile with nvcc; link seqpar::cuda, or seqpar::nccl
/// for NcclCommunicator): CudaFlashKernel, TensorOps<CudaSpace>, the device-memory
/// ThreadCommunicator, use_stream(), the half/bf16 element types, and NcclCommunicator when
/// nccl.h is on the include path. The host-only library is seqpar/seqpar.hpp.

#include "seqpar/comm/cuda_thread_communicator.hpp"
#include "seqpar/cuda/error.hpp"
#include "seqpar/cuda/types.hpp"
#include "seqpar/kernel/cuda/flash_kernel.cuh"
#include "seqpar/ops/cuda_ops.cuh"
#include "seqpar/seqpar.hpp"

#if __has_include(<nccl.h>)
#include "seqpar/comm/nccl_communicator.hpp"
#endif
