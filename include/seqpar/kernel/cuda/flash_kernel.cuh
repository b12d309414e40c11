#pragma once
/// \file
/// CudaFlashKernel: flash attention on NVIDIA GPUs for __half, __nv_bfloat16 and float inputs,
/// float32 accumulation and a natural-log float32 LSE, with every mask family of core/mask.hpp
/// (causal of either alignment, windows, packed documents, key padding, decode's per-row key
/// ends: supports_masks) taken from global positions, GQA, through KernelParams, logit
/// soft-capping (supports_softcap: tanh on the device, forward and backward) and a head
/// dimension D_v of V and O other than Q's and K's D (supports_value_dim: DeepSeek's MLA). It
/// models LocalAttentionKernel in CudaSpace.
///
/// Which (D, D_v) pairs take the tensor cores (with or without a soft-cap): (64, 64),
/// (128, 128) and (192, 128) (MLA prefill), forward and backward; (576, 512) (MLA decode),
/// forward only, by a kernel of its own. Every other pair, D and D_v each up to max_head_dim,
/// and the backward at (576, 512), take the SIMT path. The two MLA pairs need
/// SEQPAR_CUDA_MLA_KERNELS (on by default; without it they take SIMT too).
///
/// Forward paths, chosen per call:
/// - tensor cores (sm_80+, half/bf16, a (D, D_v) pair above, 16-byte aligned rows): 64 query
///   rows x 64 keys per tile, four warps of 16 query rows (or, with set_query_tile(128) at
///   (64, 64) and (128, 128), 128 rows: two m-tiles per warp), mma.sync m16n8k16 for Q K^T
///   and P V with P kept in registers, K/V fragments by ldmatrix, K/V tiles streamed into
///   shared memory with cp.async (the V load overlaps Q K^T, the next K load overlaps softmax
///   and P V);
/// - tensor cores for MLA decode (sm_80+, half/bf16, (576, 512), the same alignment): the query
///   heads sharing a K/V head packed with the query rows into 32-row blocks, the warps
///   splitting the keys for S and the 512 output columns for P V
///   (kernel/cuda/flash_tensor_core_decode.cuh);
/// - SIMT (every type, any D and D_v, any strides): 32 x 32 tiles, one warp per eight query
///   rows, float in shared memory; a head wider than 256 is walked in chunks of 256 columns
///   and its output split over blocks by slices of 256 columns (kernel/cuda/flash_simt.cuh).
/// Both walk key tiles with the online softmax of kernel/tile_math.hpp over the keys their
/// rows see (each row sees one contiguous run of keys: kernel/cuda/flash_mask.cuh), skip tiles
/// the mask hides, and test the mask per element only on tiles it cuts. Query tiles are
/// launched last-first so the heaviest causal tiles start early.
///
/// Backward follows the LocalAttentionKernel contract: it recomputes P from the saved LSE and
/// ADDS into float dq, dk, dv with atomics, so ring steps and query heads sharing a K/V head
/// accumulate. One block per 64-key (SIMT: 32-key) tile keeps that tile's dK, dV in registers
/// while the query tiles stream past, and adds its share of dQ to global memory. It needs no
/// scratch: each block recomputes rowsum(dO * O) for the query tiles it visits. Two paths, on
/// the prefill forward's conditions (and dout's rows 16-byte aligned):
/// - tensor cores (half/bf16, the (D, D_v) pairs above): all five products (S, dP, dV, dK, dQ)
///   by mma.sync with ldmatrix operands, P and dS fed back from the accumulators as A operands;
/// - SIMT (every type, any D and D_v): float in shared memory, slices of 256 columns of dQ,
///   dK, dV per block on wider heads.
///
/// Every launch goes on `stream()`; nothing synchronises the host and nothing is allocated,
/// except when a call's mask tables (documents, key padding, row key ends) differ from the
/// previous call's: the kernel object then uploads them to a device buffer of its own (see
/// cuda_detail::DeviceMaskTables: repeated calls with the same plan copy nothing).
///
/// This header holds the host class and what it launches with; the device code is split by
/// path: kernel/cuda/flash_args.cuh (argument blocks and shared helpers),
/// kernel/cuda/flash_simt.cuh (SIMT forward and backward), kernel/cuda/flash_mma.cuh
/// (mma.sync, ldmatrix, cp.async), kernel/cuda/flash_tensor_core_forward.cuh,
/// kernel/cuda/flash_tensor_core_decode.cuh and kernel/cuda/flash_tensor_core_backward.cuh.
/// Include this one.

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <type_traits>

#include "seqpar/cuda/error.hpp"
#include "seqpar/cuda/types.hpp"
#include "seqpar/kernel/cuda/flash_args.cuh"
#include "seqpar/kernel/cuda/flash_mask.cuh"
#include "seqpar/kernel/cuda/flash_simt.cuh"
#include "seqpar/kernel/cuda/flash_tensor_core_backward.cuh"
#include "seqpar/kernel/cuda/flash_tensor_core_decode.cuh"
#include "seqpar/kernel/cuda/flash_tensor_core_forward.cuh"
#include "seqpar/ops/cuda_ops.cuh"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/kernel/tile_math.hpp"

/// 1 (the default): CudaFlashKernel compiles its tensor-core kernels for MLA's head dims,
/// (D, D_v) = (192, 128) and (576, 512); 0: it leaves them out and runs those dims on SIMT,
/// which saves a program that runs no MLA about 12 s of nvcc CPU time per 16-bit element type
/// and architecture (forward and backward, sm_90). A program must define it alike in all its
/// translation units (per target).
#ifndef SEQPAR_CUDA_MLA_KERNELS
#define SEQPAR_CUDA_MLA_KERNELS 1
#endif

namespace seqpar {
namespace cuda_detail {

/// Raises a kernel's dynamic shared memory limit when it needs more than the default 48 KiB.
/// The opt-in (cudaFuncSetAttribute, per kernel and device) is a host call into the driver, so
/// it is made once per kernel, device and size rather than on every launch; the record is
/// process-wide (a cudaDeviceReset, which forgets the opt-in, is not seen).
inline void allow_smem(const void* kernel, std::size_t bytes) {
  if (bytes <= 48 * 1024) return;
  int device = 0;
  SEQPAR_CUDA_CHECK(cudaGetDevice(&device));
  struct Grant {
    const void* kernel;
    int device;
    std::size_t bytes;
  };
  static std::mutex mu;
  static std::array<Grant, 128> grants{};  // more kernels x devices than this: no record, a call each time
  static std::size_t used = 0;
  std::lock_guard lock(mu);
  Grant* grant = nullptr;
  for (std::size_t i = 0; i < used; ++i)
    if (grants[i].kernel == kernel && grants[i].device == device) grant = &grants[i];
  if (grant && grant->bytes >= bytes) return;
  SEQPAR_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  if (grant)
    grant->bytes = bytes;
  else if (used < grants.size())
    grants[used++] = {kernel, device, bytes};
}
/// allow_smem for a typed kernel pointer.
template <class Kernel>
void allow_smem(Kernel* kernel, std::size_t bytes) {
  allow_smem(reinterpret_cast<const void*>(kernel), bytes);
}

template <class T, class Space>
bool rows_aligned_16(const TensorView<T, Space>& v) {
  constexpr std::int64_t per16 = 16 / static_cast<std::int64_t>(sizeof(T));
  return reinterpret_cast<std::uintptr_t>(v.data) % 16 == 0 && v.stride[0] % per16 == 0 &&
         v.stride[1] % per16 == 0 && v.stride[2] % per16 == 0;
}

}  // namespace cuda_detail

/// Flash attention in CUDA device memory (see the file comment). Set the stream with the
/// constructor, set_stream(), or use_stream() on a SequenceParallelAttention.
class CudaFlashKernel {
 public:
  static constexpr bool is_seqpar_kernel = true;  ///< opts in to LocalAttentionKernel
  using memory_space = CudaSpace;                 ///< device tensors
  static constexpr std::int64_t max_head_dim = 1024;  ///< largest D and D_v supported
  static constexpr bool supports_masks = true;        ///< windows, documents, key padding, row key ends
  static constexpr bool supports_softcap = true;      ///< logit soft-capping, forward and backward
  static constexpr bool supports_value_dim = true;    ///< D_v != D
  /// Whether the MLA pairs (192, 128) and (576, 512) have tensor-core kernels (SEQPAR_CUDA_MLA_KERNELS).
  static constexpr bool mla_kernels = SEQPAR_CUDA_MLA_KERNELS != 0;

  /// A kernel that launches on the legacy default stream (set_stream changes it).
  CudaFlashKernel() = default;
  /// A kernel that launches on `stream`.
  explicit CudaFlashKernel(cudaStream_t stream) : stream_(stream) {}

  /// The stream every launch goes on.
  cudaStream_t stream() const { return stream_; }
  /// Sets the stream.
  void set_stream(cudaStream_t s) { stream_ = s; }
  /// Allows (default) or forbids the tensor-core path; without it every call runs SIMT.
  void set_tensor_cores(bool on) { tensor_cores_ = on; }
  /// Whether the tensor-core path may be used.
  bool tensor_cores() const { return tensor_cores_; }
  /// Tensor-core path: load K and V fragments with ldmatrix (default, faster) or with plain
  /// shared loads (false; a cross-check of the ldmatrix layouts, at (64, 64) and (128, 128):
  /// the MLA kernels always use ldmatrix, as the layouts do not change with the dims).
  void set_ldmatrix(bool on) { ldmatrix_ = on; }
  /// Whether the tensor-core path uses ldmatrix.
  bool ldmatrix() const { return ldmatrix_; }
  /// Tensor-core path: query rows per block, 64 (default: one 16-row m-tile per warp, Q in
  /// registers) or 128 (two m-tiles per warp sharing every K and V fragment, Q in shared
  /// memory: FlashAttention-2's H100 tile). tests/gpu/run.sh times both. (192, 128) takes 64
  /// rows either way: two m-tiles of its 128 output columns spill (ptxas, sm_90).
  void set_query_tile(int rows) {
    SEQPAR_CHECK(rows == 64 || rows == 128, ConfigError, "CudaFlashKernel::set_query_tile: expected 64 or 128, got ",
                 rows);
    query_tile_ = rows;
  }
  /// Query rows per block of the tensor-core path.
  int query_tile() const { return query_tile_; }

  /// Called when a plan is made: rejects head dims the kernels do not cover, before any forward.
  void prepare(std::int64_t head_dim) const {
    SEQPAR_CHECK(head_dim >= 1 && head_dim <= max_head_dim, ConfigError,
                 "CudaFlashKernel: head_dim: expected 1..", max_head_dim, ", got ", head_dim);
  }

  /// Which forward path these arguments take: "mma" (tensor cores, the prefill or the MLA
  /// decode kernel) or "simt".
  template <class T>
  const char* forward_path(TensorView<const T, CudaSpace> q, TensorView<const T, CudaSpace> k,
                           TensorView<const T, CudaSpace> v) const {
    return uses_mma(q, k, v) || uses_decode_mma(q, k, v) ? "mma" : "simt";
  }

  /// Which backward path these arguments take: "mma" (tensor cores: the prefill forward's
  /// conditions, dout's rows 16-byte aligned too) or "simt".
  template <class T>
  const char* backward_path(TensorView<const T, CudaSpace> dout, TensorView<const T, CudaSpace> q,
                            TensorView<const T, CudaSpace> k, TensorView<const T, CudaSpace> v) const {
    return uses_mma_backward(dout, q, k, v) ? "mma" : "simt";
  }

  /// See LocalAttentionKernel. `out` may be T or float (ring partial results); `lse` may be
  /// absent. Enqueued on stream(); returns without waiting.
  template <class T, class O>
  void forward(TensorView<const T, CudaSpace> q, TensorView<const T, CudaSpace> k, TensorView<const T, CudaSpace> v,
               TensorView<O, CudaSpace> out, TensorView<acc_t<T>, CudaSpace> lse, const KernelParams& p) const;

  /// See LocalAttentionKernel: adds this key block's contribution to dq, dk, dv (float).
  template <class T>
  void backward(TensorView<const T, CudaSpace> dout, TensorView<const T, CudaSpace> q, TensorView<const T, CudaSpace> k,
                TensorView<const T, CudaSpace> v, TensorView<const T, CudaSpace> out,
                TensorView<const acc_t<T>, CudaSpace> lse, TensorView<acc_t<T>, CudaSpace> dq,
                TensorView<acc_t<T>, CudaSpace> dk, TensorView<acc_t<T>, CudaSpace> dv, const KernelParams& p) const;

 private:
  template <class T>
  static constexpr bool is_element =
      std::is_same_v<T, float> || std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

  /// One block per `tile` rows of `rows` and column slice (x), head (y) and batch element (z).
  template <class T>
  static dim3 grid_of(const TensorView<T, CudaSpace>& rows, int tile, int slices = 1) {
    const std::int64_t tiles = (rows.seq() + tile - 1) / tile * slices;
    SEQPAR_CHECK(rows.heads() <= 65535 && rows.batch() <= 65535 && tiles <= 0x7fffffff, ConfigError,
                 "CudaFlashKernel: heads and batch must be <= 65535 each, got heads ", rows.heads(), ", batch ",
                 rows.batch());
    return dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(rows.heads()), static_cast<unsigned>(rows.batch()));
  }

  static void check_same(const char* name, const std::array<std::int64_t, 4>& got,
                         const std::array<std::int64_t, 4>& want) {
    for (int i = 0; i < 4; ++i)
      SEQPAR_CHECK(got[i] == want[i], ConfigError, "CudaFlashKernel: ", name, ".extent[", i, "]: expected ", want[i],
                   ", got ", got[i]);
  }

  template <class T>
  void check_shapes(const TensorView<const T, CudaSpace>& q, const TensorView<const T, CudaSpace>& k,
                    const TensorView<const T, CudaSpace>& v, const std::array<std::int64_t, 4>& out,
                    const char* what) const {
    SEQPAR_CHECK(q.dim() >= 1 && q.dim() <= max_head_dim, ConfigError, "CudaFlashKernel::", what,
                 ": head_dim: expected 1..", max_head_dim, ", got ", q.dim());
    SEQPAR_CHECK(v.dim() >= 1 && v.dim() <= max_head_dim, ConfigError, "CudaFlashKernel::", what,
                 ": v.dim (D_v): expected 1..", max_head_dim, ", got ", v.dim());
    SEQPAR_CHECK(k.dim() == q.dim() && k.batch() == q.batch() && v.batch() == q.batch(), ConfigError,
                 "CudaFlashKernel::", what, ": k and v must have q's batch ", q.batch(), " and k q's head_dim ",
                 q.dim(), ", got k [", k.batch(), ", ", k.dim(), "], v batch ", v.batch());
    SEQPAR_CHECK(v.seq() == k.seq() && v.heads() == k.heads(), ConfigError, "CudaFlashKernel::", what,
                 ": v: expected k's seq ", k.seq(), " and heads ", k.heads(), ", got ", v.seq(), " and ", v.heads());
    check_same("out", out, value_extent(q, v));
    // The kernels hold local key indices as int (KeySpan32).
    SEQPAR_CHECK(k.seq() <= std::numeric_limits<int>::max() - 1, ConfigError, "CudaFlashKernel::", what,
                 ": k.seq: expected <= ", std::numeric_limits<int>::max() - 1, ", got ", k.seq());
  }

  /// [B, S_q, H, D_v]: the extent of out and dout.
  template <class T>
  static std::array<std::int64_t, 4> value_extent(const TensorView<const T, CudaSpace>& q,
                                                  const TensorView<const T, CudaSpace>& v) {
    return {q.batch(), q.seq(), q.heads(), v.dim()};
  }

  /// Whether the prefill tensor-core kernels have an instance for head dims (D, D_v).
  static bool mma_dims(std::int64_t d, std::int64_t dv) {
    return (d == 64 && dv == 64) || (d == 128 && dv == 128) || (mla_kernels && d == 192 && dv == 128);
  }

  /// Whether a tensor-core kernel may run on these tensors at all: 16-bit elements, tensor
  /// cores allowed, 16-byte aligned rows, sm_80 or later.
  template <class T>
  bool tensor_core_ready(const TensorView<const T, CudaSpace>& q, const TensorView<const T, CudaSpace>& k,
                         const TensorView<const T, CudaSpace>& v) const {
    if constexpr (std::is_same_v<T, float>) {
      return false;
    } else {
      if (!tensor_cores_) return false;
      if (!cuda_detail::rows_aligned_16(q) || !cuda_detail::rows_aligned_16(k) || !cuda_detail::rows_aligned_16(v))
        return false;
      return device_major() >= 8;
    }
  }

  /// The prefill tensor-core kernels (forward and backward) apply.
  template <class T>
  bool uses_mma(const TensorView<const T, CudaSpace>& q, const TensorView<const T, CudaSpace>& k,
                const TensorView<const T, CudaSpace>& v) const {
    return mma_dims(q.dim(), v.dim()) && tensor_core_ready(q, k, v);
  }

  /// The MLA decode kernel applies (forward only).
  template <class T>
  bool uses_decode_mma(const TensorView<const T, CudaSpace>& q, const TensorView<const T, CudaSpace>& k,
                       const TensorView<const T, CudaSpace>& v) const {
    return mla_kernels && q.dim() == cuda_detail::decode_dim && v.dim() == cuda_detail::decode_dim_v &&
           tensor_core_ready(q, k, v);
  }

  template <class T>
  bool uses_mma_backward(const TensorView<const T, CudaSpace>& dout, const TensorView<const T, CudaSpace>& q,
                         const TensorView<const T, CudaSpace>& k, const TensorView<const T, CudaSpace>& v) const {
    return cuda_detail::rows_aligned_16(dout) && uses_mma(q, k, v);  // uses_mma: false for float
  }

  /// Compute capability (major) of the current device, remembered per device.
  int device_major() const {
    int dev = 0;
    SEQPAR_CUDA_CHECK(cudaGetDevice(&dev));
    if (dev != cached_device_) {
      int major = 0;
      SEQPAR_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
      cached_major_ = major;
      cached_device_ = dev;
    }
    return cached_major_;
  }

  /// The prefill forward at (D, D) in the variant set_query_tile and set_ldmatrix chose.
  template <class T, class O, int D>
  void launch_mma(const cuda_detail::FwdArgs<T, O>& a, const TensorView<const T, CudaSpace>& q) const {
    if (query_tile_ == 128)
      ldmatrix_ ? launch_mma_tiles<T, O, D, D, true, 2>(a, q) : launch_mma_tiles<T, O, D, D, false, 2>(a, q);
    else
      ldmatrix_ ? launch_mma_tiles<T, O, D, D, true, 1>(a, q) : launch_mma_tiles<T, O, D, D, false, 1>(a, q);
  }

  template <class T, class O, int D, int DV, bool ldsm, int MT>
  void launch_mma_tiles(const cuda_detail::FwdArgs<T, O>& a, const TensorView<const T, CudaSpace>& q) const {
    auto* kernel = cuda_detail::flash_fwd_mma<T, O, D, DV, ldsm, MT>;
    constexpr std::size_t smem = cuda_detail::mma_fwd_smem<T, D, DV, MT>();
    cuda_detail::allow_smem(kernel, smem);
    cuda_detail::launch(kernel, grid_of(q, cuda_detail::mma_block_rows<MT>), cuda_detail::mma_threads, smem, stream_, a);
  }

  template <class T, class O>
  void launch_decode_mma(const cuda_detail::FwdArgs<T, O>& a, const TensorView<const T, CudaSpace>& q,
                         const TensorView<const T, CudaSpace>& k, const KernelParams& p) const {
    auto* kernel = cuda_detail::flash_decode_mma<T, O>;
    constexpr std::size_t smem = cuda_detail::decode_smem<T>();
    cuda_detail::allow_smem(kernel, smem);
    // Packed rows of the largest head group: S_q tokens times the query heads of one K/V head.
    const std::int64_t rows = q.seq() * std::min(p.group_size, q.heads());
    const std::int64_t blocks = (rows + cuda_detail::decode_rows - 1) / cuda_detail::decode_rows;
    SEQPAR_CHECK(blocks <= 0x7fffffff && k.heads() <= 65535 && q.batch() <= 65535, ConfigError,
                 "CudaFlashKernel: the MLA decode kernel takes at most 2^31 - 1 blocks of 32 rows, 65535 K/V heads "
                 "and 65535 batch elements, got ", blocks, ", ", k.heads(), " and ", q.batch());
    cuda_detail::launch(kernel,
                        dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(k.heads()),
                             static_cast<unsigned>(q.batch())),
                        cuda_detail::mma_threads, smem, stream_, a);
  }

  template <class T, class O, int DC>
  void launch_simt(const cuda_detail::FwdArgs<T, O>& a, const TensorView<const T, CudaSpace>& q) const {
    const std::size_t smem = cuda_detail::simt_fwd_smem(a.dim, DC);
    cuda_detail::allow_smem(cuda_detail::flash_fwd_simt<T, O, DC>, smem);
    cuda_detail::launch(cuda_detail::flash_fwd_simt<T, O, DC>,
                        grid_of(q, cuda_detail::simt_bq, cuda_detail::simt_slices(a.dim_v, 32 * DC)),
                        cuda_detail::simt_threads, smem, stream_, a);
  }

  /// Launches a backward kernel: one block per `key_tile` keys and column slice, per query
  /// head (it reads K/V head kv_head(h)), per batch.
  template <class T>
  void launch_bwd(void (*kernel)(cuda_detail::BwdArgs<T>), const cuda_detail::BwdArgs<T>& a, int key_tile,
                  int slices, int threads, std::size_t smem, const TensorView<const T, CudaSpace>& k,
                  const TensorView<const T, CudaSpace>& q) const {
    cuda_detail::allow_smem(kernel, smem);
    const dim3 grid = grid_of(k, key_tile, slices);
    cuda_detail::launch(kernel, dim3(grid.x, static_cast<unsigned>(q.heads()), grid.z), threads, smem, stream_, a);
  }
  template <class T, int DC>
  void launch_bwd_simt(const cuda_detail::BwdArgs<T>& a, const TensorView<const T, CudaSpace>& k,
                       const TensorView<const T, CudaSpace>& q) const {
    launch_bwd<T>(cuda_detail::flash_bwd_simt<T, DC>, a, cuda_detail::bwd_bk,
                  cuda_detail::simt_slices(std::max(a.dim, a.dim_v), 32 * DC), cuda_detail::bwd_threads,
                  cuda_detail::simt_bwd_smem(cuda_detail::simt_bwd_width(a.dim, a.dim_v, DC)), k, q);
  }
  template <class T, int D, int DV>
  void launch_bwd_mma(const cuda_detail::BwdArgs<T>& a, const TensorView<const T, CudaSpace>& k,
                      const TensorView<const T, CudaSpace>& q) const {
    launch_bwd<T>(cuda_detail::flash_bwd_mma<T, D, DV>, a, cuda_detail::mma_bwd_bk, 1, cuda_detail::mma_threads,
                  cuda_detail::mma_bwd_smem<T, D, DV>(), k, q);
  }

  cudaStream_t stream_ = nullptr;
  bool tensor_cores_ = true;
  bool ldmatrix_ = true;
  int query_tile_ = 64;
  mutable int cached_device_ = -1;
  mutable int cached_major_ = 0;
  mutable cuda_detail::DeviceMaskTables masks_;  // the device copy of the mask tables
};

// forward and backward are defined outside the class so that they are not inline: a program can
// then compile them once (explicit instantiation) and declare them `extern template` elsewhere.
template <class T, class O>
void CudaFlashKernel::forward(TensorView<const T, CudaSpace> q, TensorView<const T, CudaSpace> k,
                              TensorView<const T, CudaSpace> v, TensorView<O, CudaSpace> out,
                              TensorView<acc_t<T>, CudaSpace> lse, const KernelParams& p) const {
  static_assert(is_element<T>, "CudaFlashKernel: the element type must be __half, __nv_bfloat16 or float");
  static_assert(std::is_same_v<O, T> || std::is_same_v<O, float>, "CudaFlashKernel: out must have the input type or float");
  check_shapes(q, k, v, out.extent, "forward");
  p.check_positions(q.seq(), k.seq(), "CudaFlashKernel::forward");
  SEQPAR_CHECK(lse.absent() || (lse.batch() == q.batch() && lse.seq() == q.seq() && lse.heads() == q.heads()),
               ConfigError, "CudaFlashKernel::forward: lse: expected [", q.batch(), ", ", q.seq(), ", ", q.heads(),
               ", 1], got [", lse.batch(), ", ", lse.seq(), ", ", lse.heads(), ", ", lse.dim(), "]");
  if (q.numel() == 0) return;
  cuda_detail::FwdArgs<T, O> a{cuda_detail::device_view(q), cuda_detail::device_view(k), cuda_detail::device_view(v),
                               cuda_detail::device_view(out), cuda_detail::device_view(lse),
                               q.seq(), k.seq(), static_cast<int>(q.dim()), static_cast<int>(v.dim()),
                               cuda_detail::ScoreMap::from(p.scale, p.softcap), masks_.view(p, q.batch(), stream_),
                               p.q_positions, p.k_positions, tile::HeadMap::from(p)};
  if (lse.absent()) a.lse.data = nullptr;
  if constexpr (!std::is_same_v<T, float>) {
    if (uses_mma(q, k, v)) {
      if (q.dim() == 64)
        launch_mma<T, O, 64>(a, q);
      else if (q.dim() == 128)
        launch_mma<T, O, 128>(a, q);
      else if constexpr (mla_kernels)
        launch_mma_tiles<T, O, 192, 128, true, 1>(a, q);
      return;
    }
    if constexpr (mla_kernels)
      if (uses_decode_mma(q, k, v)) return launch_decode_mma(a, q, k, p);
  }
  switch (cuda_detail::simt_columns_per_lane(a.dim_v)) {
    case 2: return launch_simt<T, O, 2>(a, q);
    case 4: return launch_simt<T, O, 4>(a, q);
    default: return launch_simt<T, O, 8>(a, q);
  }
}

template <class T>
void CudaFlashKernel::backward(TensorView<const T, CudaSpace> dout, TensorView<const T, CudaSpace> q,
                               TensorView<const T, CudaSpace> k, TensorView<const T, CudaSpace> v,
                               TensorView<const T, CudaSpace> out, TensorView<const acc_t<T>, CudaSpace> lse,
                               TensorView<acc_t<T>, CudaSpace> dq, TensorView<acc_t<T>, CudaSpace> dk,
                               TensorView<acc_t<T>, CudaSpace> dv, const KernelParams& p) const {
  static_assert(is_element<T>, "CudaFlashKernel: the element type must be __half, __nv_bfloat16 or float");
  check_shapes(q, k, v, out.extent, "backward");
  p.check_positions(q.seq(), k.seq(), "CudaFlashKernel::backward");
  check_same("dout", dout.extent, value_extent(q, v));
  check_same("dq", dq.extent, q.extent);
  check_same("dk", dk.extent, k.extent);
  check_same("dv", dv.extent, v.extent);
  SEQPAR_CHECK(lse.batch() == q.batch() && lse.seq() == q.seq() && lse.heads() == q.heads(), ConfigError,
               "CudaFlashKernel::backward: lse: expected [", q.batch(), ", ", q.seq(), ", ", q.heads(), ", 1], got [",
               lse.batch(), ", ", lse.seq(), ", ", lse.heads(), ", ", lse.dim(), "]");
  if (q.numel() == 0 || k.seq() == 0) return;
  cuda_detail::BwdArgs<T> a{cuda_detail::device_view(dout), cuda_detail::device_view(q), cuda_detail::device_view(k),
                            cuda_detail::device_view(v), cuda_detail::device_view(out), cuda_detail::device_view(lse),
                            cuda_detail::device_view(dq), cuda_detail::device_view(dk), cuda_detail::device_view(dv),
                            q.seq(), k.seq(), static_cast<int>(q.dim()), static_cast<int>(v.dim()),
                            static_cast<float>(p.scale), cuda_detail::ScoreMap::from(p.scale, p.softcap),
                            masks_.view(p, q.batch(), stream_), p.q_positions, p.k_positions, tile::HeadMap::from(p)};
  if constexpr (!std::is_same_v<T, float>) {
    if (uses_mma_backward(dout, q, k, v)) {
      if (q.dim() == 64)
        launch_bwd_mma<T, 64, 64>(a, k, q);
      else if (q.dim() == 128)
        launch_bwd_mma<T, 128, 128>(a, k, q);
      else if constexpr (mla_kernels)
        launch_bwd_mma<T, 192, 128>(a, k, q);
      return;
    }
  }
  switch (cuda_detail::simt_columns_per_lane(std::max(a.dim, a.dim_v))) {
    case 2: return launch_bwd_simt<T, 2>(a, k, q);
    case 4: return launch_bwd_simt<T, 4>(a, k, q);
    default: return launch_bwd_simt<T, 8>(a, k, q);
  }
}

/// Puts every launch and copy of `attn` (a SequenceParallelAttention over CUDA) on `stream`:
/// its kernel, its tensor operations and, when they have one, its communicators.
template <class Attention>
void use_stream(Attention& attn, cudaStream_t stream) {
  attn.kernel().set_stream(stream);
  attn.ops().set_stream(stream);
  if constexpr (requires { attn.world().set_stream(stream); }) {
    attn.world().set_stream(stream);
    attn.ulysses_comm().set_stream(stream);
    attn.ring_comm().set_stream(stream);
  }
}

}  // namespace seqpar
