#pragma once
/// \file
/// The device side of seqpar's CPU emulation of CUDA: what a kernel body calls (threadIdx,
/// __syncthreads, __shfl_xor_sync, atomicAdd, ...), the warp-wide instructions the tensor-core
/// kernel issues (mma.sync m16n8k16, ldmatrix, cp.async), and launch().
///
/// How it runs: a launch executes its blocks one after another on the calling thread; inside
/// a block every CUDA thread is a fiber, switched only where CUDA threads synchronise (block
/// barriers, warp collectives). That is enough to run the real kernels and to catch what
/// breaks them most often on hardware, with a diagnosis instead of a hang:
/// - deadlock (a barrier some threads never reach, a warp collective half the warp skips);
/// - divergence (lanes of one warp at different collectives);
/// - missing cp.async waits: copies land only when their group is waited for, the latest a
///   GPU may deliver them (or, with SEQPAR_EMU_CP_ASYNC=eager, as soon as they are issued:
///   a prefetch that overwrites a tile other warps still read);
/// - missing __syncthreads: warps run one at a time, each until it waits at a block barrier,
///   in ascending or descending order (SEQPAR_EMU_ORDER), so a warp that reads or overwrites
///   shared memory without the barrier it needs sees, or leaves, the wrong data;
/// - bad launches (block size, dynamic shared memory over the kernel's limit) and device
///   copies outside an allocation (runtime.cpp).
/// - stream-ordering mistakes: launches and copies are queued and run only when something
///   synchronises with them, so a missing synchronisation reads data that is not there yet
///   (streams.hpp).
/// What it cannot see: memory-model races between blocks, and speed.
///
/// The fragment layouts of mma and ldmatrix are written here from the PTX ISA, independently
/// of the library's kernel/tile_math.hpp, so that the emulation checks the library's layouts
/// rather than repeating them.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

namespace seqpar_emu {

/// Where the running CUDA thread is: the four built-in index variables.
struct Coords {
  uint3 thread_idx;  ///< threadIdx
  uint3 block_idx;   ///< blockIdx
  dim3 block_dim;    ///< blockDim
  dim3 grid_dim;     ///< gridDim
};

/// The running CUDA thread's coordinates (only inside a kernel).
const Coords& coords();
/// The running thread's lane in its warp.
int lane_id();

/// Every lane of the running thread's warp contributes `bytes` (<= 64) bytes; returns the 32
/// lanes' contributions, 64 bytes apart, valid until this lane's next collective. All lanes
/// named in `mask` must reach a collective of the same `op` (else the launch fails). With
/// `combine`, the last lane to arrive first rewrites the 32 slots in place (once per warp,
/// where a per-lane computation would repeat the same work 32 times).
const std::byte* warp_exchange(const void* mine, std::size_t bytes, const char* op, unsigned mask,
                               void (*combine)(std::byte* slots) = nullptr);
/// __syncthreads().
void sync_threads();
/// Fails the launch with `why` (the emulation of a device-side trap or assert).
[[noreturn]] void trap(const char* why);
/// The block's dynamic shared memory (the launch's `smem` bytes, 16-byte aligned).
void* dynamic_shared_memory();
/// cp.async.cg of 16 bytes (zeros when !valid), delivered when its group is waited for.
void cp_async_16(void* dst, const void* src, bool valid);
/// cp.async.commit_group.
void cp_async_commit();
/// cp.async.wait_group n: delivers every committed group but the newest n.
void cp_async_wait(int n);

/// Queues a launch on `stream` (see streams.hpp): when it runs, body() runs as every thread of
/// the grid (see the file comment). A bad configuration fails at once, through
/// cudaGetLastError; a kernel that fails when run fails the synchronisation that ran it.
void launch_grid(const void* kernel, dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                 std::function<void()> body);

/// kernel<<<grid, block, smem, stream>>>(args...): the arguments are copied once, as CUDA
/// copies them to the parameter space, and every thread calls the kernel with them.
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
            Args&&... args) {
  launch_grid(reinterpret_cast<const void*>(kernel), grid, block, smem, stream,
              [kernel, params = std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)] {
                std::apply(kernel, params);
              });
}

/// One 16-bit element of a packed register as float.
template <class T>
float element(std::uint32_t reg, int half) {
  const auto bits = static_cast<unsigned short>(reg >> (16 * half));
  if constexpr (std::is_same_v<T, __half>) {
    __half_raw r;
    r.x = bits;
    return __half2float(__half(r));
  } else {
    __nv_bfloat16_raw r;
    r.x = bits;
    return __bfloat162float(__nv_bfloat16(r));
  }
}

/// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16} of a whole warp, in place over the 32
/// lanes' fragments (see mma_16816). PTX ISA fragment layout, with g = lane / 4 and
/// t = lane % 4: A register r holds A[g + 8 (r % 2)][2 t + 8 (r / 2) + {0, 1}]; B register r
/// holds B[2 t + 8 r + {0, 1}][g]; C element i holds C[g + 8 (i / 2)][2 t + i % 2].
struct MmaFragment {
  std::uint32_t a[4], b[2];
  float c[4];
};
template <class T>
void mma_warp(std::byte* slots) {
  float A[16][16], B[16][8];
  MmaFragment f[32];
  for (int lane = 0; lane < 32; ++lane) {
    std::memcpy(&f[lane], slots + 64 * lane, sizeof(MmaFragment));
    const int g = lane / 4, t = lane % 4;
    for (int r = 0; r < 4; ++r)
      for (int e = 0; e < 2; ++e) A[g + 8 * (r % 2)][2 * t + 8 * (r / 2) + e] = element<T>(f[lane].a[r], e);
    for (int r = 0; r < 2; ++r)
      for (int e = 0; e < 2; ++e) B[2 * t + 8 * r + e][g] = element<T>(f[lane].b[r], e);
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
      double acc = 0.0;  // products of 16-bit values are exact; one rounding, like the hardware
      for (int k = 0; k < 16; ++k) acc += static_cast<double>(A[row][k]) * B[k][col];
      f[lane].c[i] = static_cast<float>(static_cast<double>(f[lane].c[i]) + acc);
    }
    std::memcpy(slots + 64 * lane, &f[lane], sizeof(MmaFragment));
  }
}

/// c += A B for the warp's 16 x 8 tile (the library's mma_16816 under emulation).
template <class T>
void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  const MmaFragment mine{{a[0], a[1], a[2], a[3]}, {b0, b1}, {c[0], c[1], c[2], c[3]}};
  const std::byte* all = warp_exchange(&mine, sizeof mine, "mma.sync.m16n8k16", 0xffffffffu, &mma_warp<T>);
  MmaFragment out;
  std::memcpy(&out, all + 64 * lane_id(), sizeof out);
  for (int i = 0; i < 4; ++i) c[i] = out.c[i];
}

/// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8 i .. 8 i + 7 give the row addresses
/// (16 bytes each, 16-byte aligned) of matrix i; register i of lane L receives row L / 4,
/// columns 2 (L % 4) + {0, 1} of matrix i, or with .trans column L / 4, rows 2 (L % 4) + {0, 1}.
template <bool trans>
void ldmatrix_x4(std::uint32_t (&r)[4], const void* smem) {
  if (reinterpret_cast<std::uintptr_t>(smem) % 16 != 0) trap("ldmatrix: row address not 16-byte aligned");
  const std::byte* all = warp_exchange(&smem, sizeof smem, trans ? "ldmatrix.x4.trans" : "ldmatrix.x4", 0xffffffffu);
  const int lane = lane_id();
  for (int i = 0; i < 4; ++i) {
    std::uint16_t e[2];
    for (int k = 0; k < 2; ++k) {
      const int row = trans ? 2 * (lane % 4) + k : lane / 4;
      const int col = trans ? lane / 4 : 2 * (lane % 4) + k;
      const std::uint16_t* base;
      std::memcpy(&base, all + 64 * (8 * i + row), sizeof base);
      e[k] = base[col];
    }
    r[i] = static_cast<std::uint32_t>(e[0]) | (static_cast<std::uint32_t>(e[1]) << 16);
  }
}

}  // namespace seqpar_emu

// The CUDA built-in variables and device functions the library's kernels use.
#define threadIdx (::seqpar_emu::coords().thread_idx)
#define blockIdx (::seqpar_emu::coords().block_idx)
#define blockDim (::seqpar_emu::coords().block_dim)
#define gridDim (::seqpar_emu::coords().grid_dim)
#define __trap() ::seqpar_emu::trap("__trap()")

/// __syncthreads().
inline void __syncthreads() { ::seqpar_emu::sync_threads(); }
/// __syncwarp(mask): a barrier of the lanes in `mask`.
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  const char none = 0;
  (void)::seqpar_emu::warp_exchange(&none, 1, "__syncwarp", mask);
}
/// __shfl_xor_sync: the value of lane (lane ^ lane_mask) within groups of `width` lanes.
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 64 && std::is_trivially_copyable_v<T>, "__shfl_xor_sync: T too large");
  const std::byte* all = ::seqpar_emu::warp_exchange(&var, sizeof var, "__shfl_xor_sync", mask);
  const int lane = ::seqpar_emu::lane_id();
  int src = lane ^ lane_mask;
  if (src / width != lane / width) src = lane;  // outside the lane's group: its own value
  T out;
  std::memcpy(&out, all + 64 * src, sizeof out);
  return out;
}
/// atomicAdd on float; returns the old value. The fibers of a block share one OS thread, but
/// ranks' launches run concurrently on theirs, so it is a real atomic.
inline float atomicAdd(float* address, float value) {
  return std::atomic_ref<float>(*address).fetch_add(value, std::memory_order_relaxed);
}
