// CudaFlashKernel's tensor-core kernels for MLA's head dims, compiled once by nvcc (bf16) where
// the GPU test programs leave them out (tests/gpu/CMakeLists.txt: without a GPU the programs are
// only compiled, with SEQPAR_CUDA_MLA_KERNELS=0): the build still checks that they compile, for
// a third of what they cost in every instance file. Their host side (launch and dispatch) is
// compiled by the CPU emulation's build, which runs them.
#include "seqpar/kernel/cuda/flash_kernel.cuh"

namespace seqpar::cuda_detail {

template __global__ void flash_fwd_mma<__nv_bfloat16, float, 192, 128, true, 1>(FwdArgs<__nv_bfloat16, float>);
template __global__ void flash_decode_mma<__nv_bfloat16, float>(FwdArgs<__nv_bfloat16, float>);
template __global__ void flash_bwd_mma<__nv_bfloat16, 192, 128>(BwdArgs<__nv_bfloat16>);

}  // namespace seqpar::cuda_detail
