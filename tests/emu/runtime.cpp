// The CPU emulation of the CUDA device (see include/seqpar_emu/device.hpp): the block
// scheduler, one ucontext fiber per CUDA thread, and the subset of the CUDA runtime API that
// seqpar and its tests call, defined here against the toolkit's own declarations so that the
// emulated programs link without libcudart.
//
// Runtime model: SEQPAR_EMU_DEVICES devices (default 1) of compute capability 9.0
// (SEQPAR_EMU_CC=80 makes it 8.0); device memory is host memory from aligned_alloc, filled
// with 0xff on allocation so that a kernel reading what nobody wrote sees NaN; launches,
// asynchronous copies and memsets are queued on their stream and run when something
// synchronises with them (streams.hpp). Copies are checked against the allocations they name
// (a copy past the end of a buffer fails with cudaErrorInvalidValue, as an out-of-bounds
// access on a GPU would fault).

#include <ucontext.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "seqpar_emu/prelude.hpp"
#include "streams.hpp"

// Fiber switch. On x86-64 a minimal switch of the callee-saved registers (a few ns; ucontext's
// swapcontext also saves the signal mask with a system call, which made the emulation spend
// half its time in the kernel); elsewhere ucontext.
#if defined(__x86_64__)
extern "C" void seqpar_emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl seqpar_emu_switch
.type seqpar_emu_switch, @function
seqpar_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size seqpar_emu_switch, .-seqpar_emu_switch
.section .note.GNU-stack,"",@progbits
.text
)");
#endif

#if defined(__SANITIZE_ADDRESS__)
#define SEQPAR_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SEQPAR_EMU_ASAN 1
#endif
#endif
#if SEQPAR_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace seqpar_emu {
namespace {

/// A saved execution context: where a fiber (or the scheduler) resumes, and its stack (for
/// AddressSanitizer, which must be told about every stack switch).
struct Context {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc{};
#endif
  const void* stack = nullptr;
  std::size_t stack_size = 0;
};

#if SEQPAR_EMU_ASAN
/// Called first thing on the stack just switched to: completes ASan's switch and learns the
/// bounds of the stack switched from (so the scheduler's own stack becomes known).
inline void asan_arrived(void* fake_stack, Context* from) {
  const void* bottom = nullptr;
  std::size_t size = 0;
  __sanitizer_finish_switch_fiber(fake_stack, &bottom, &size);
  if (from) {
    from->stack = bottom;
    from->stack_size = size;
  }
}
#endif

/// Saves the running context into `from` and resumes `to`. `leaving`: `from` will never be
/// resumed (a finished fiber), so ASan may drop its fake stack.
inline void switch_to(Context& from, Context& to, bool leaving = false) {
#if SEQPAR_EMU_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(leaving ? nullptr : &fake_stack, to.stack, to.stack_size);
#else
  (void)leaving;
#endif
#if defined(__x86_64__)
  seqpar_emu_switch(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
#if SEQPAR_EMU_ASAN
  asan_arrived(fake_stack, nullptr);
#endif
}

/// Clears AddressSanitizer's shadow of a fiber stack. A fiber never returns from its first
/// frames (it ends by switching away, or is abandoned when its launch fails), so its stack keeps
/// their redzones: cleared before the stack is reused, and before it is unmapped. libasan
/// clears neither the shadow of memory unmapped nor (GCC 12, glibc 2.36) that of a new
/// thread's static TLS: when glibc maps a new thread's stack and TLS where the fiber stacks of
/// a thread that ended were, its `__shared__` arrays (thread_local) start out inside stale
/// redzones, and the kernel's first write there (a cp.async) is reported as a
/// stack-buffer-overflow.
inline void clear_stack_shadow(const void* base, std::size_t size) {
#if SEQPAR_EMU_ASAN
  __asan_unpoison_memory_region(base, size);
#else
  (void)base;
  (void)size;
#endif
}

/// Prepares `c` to start `entry` (which must never return) on the stack [base, base + size).
inline void start_context(Context& c, char* base, std::size_t size, void (*entry)()) {
  c.stack = base;
  c.stack_size = size;
  clear_stack_shadow(base, size);  // a reused stack: the redzones its last fiber left
#if defined(__x86_64__)
  auto top = reinterpret_cast<std::uintptr_t>(base + size) & ~std::uintptr_t{15};
  auto* sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                           // entry's return address: it never returns
  *--sp = reinterpret_cast<void*>(entry);    // popped by `ret` in seqpar_emu_switch
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp, rbx, r12-r15
  c.sp = sp;
#else
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = base;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
#endif
}

constexpr int warp_size = 32;
constexpr std::size_t slot_bytes = 64;
constexpr std::size_t default_smem = 48 * 1024;
constexpr std::size_t max_smem_optin = 232448;  // sm_90 (227 KiB)

/// Thrown inside a fiber to unwind it after the launch has failed.
struct Abort {};

struct PendingCopy {
  void* dst;
  const void* src;
  bool valid;
  int group;  // -1 until committed
};

/// One CUDA thread.
struct Fiber {
  Context ctx;
  Coords coords{};
  int linear = 0, warp = 0, lane = 0;
  bool done = false;
  const char* waiting = nullptr;  // what it waits on, for the deadlock report
  std::vector<PendingCopy> copies;
  int next_group = 0;
};

/// A warp's collective in progress: arrivals, the op they are at, double-buffered slots.
struct Warp {
  std::uint64_t gen = 0;
  int arrived = 0;
  int lanes = 0;  // threads of the block in this warp
  int live = 0;   // of which not yet exited
  const char* op = nullptr;
  unsigned mask = 0;
  alignas(16) std::byte slots[2][warp_size][slot_bytes];
};

/// A fiber stack with a guard page below it (a kernel overflowing its stack faults at once).
class Stack {
 public:
  explicit Stack(std::size_t bytes) : bytes_(bytes + page()) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("seqpar_emu: mmap of a fiber stack failed");
    mprotect(p, page(), PROT_NONE);
    base_ = static_cast<char*>(p);
  }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  ~Stack() {
    clear_stack_shadow(base(), size());  // else memory mapped here later inherits it
    munmap(base_, bytes_);
  }
  char* base() const { return base_ + page(); }
  std::size_t size() const { return bytes_ - page(); }

 private:
  static std::size_t page() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }
  char* base_;
  std::size_t bytes_;
};

/// The launch running on this OS thread.
struct Grid {
  std::function<void()> body;
  dim3 grid, block;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::uint64_t barrier_gen = 0;
  int barrier_arrived = 0, live = 0;
  std::byte* smem = nullptr;
  Context scheduler;
  Fiber* current = nullptr;
  bool progress = false;
  std::string error;
};

thread_local Grid* tls_grid = nullptr;
thread_local cudaError_t tls_last_error = cudaSuccess;
thread_local int tls_device = 0;

/// Fiber stacks of this OS thread, reused across launches.
std::vector<std::unique_ptr<Stack>>& stacks() {
  thread_local std::vector<std::unique_ptr<Stack>> s;
  return s;
}

Grid& grid() {
  if (!tls_grid || !tls_grid->current) {
    std::fprintf(stderr, "seqpar_emu: a device function was called outside a kernel\n");
    std::abort();
  }
  return *tls_grid;
}

/// Back to the scheduler; `what` names the wait (nullptr: a plain yield after progress).
void yield(const char* what) {
  Grid& g = grid();
  Fiber* f = g.current;
  f->waiting = what;
  switch_to(f->ctx, g.scheduler);
  f->waiting = nullptr;
  if (!g.error.empty()) throw Abort{};
}

[[noreturn]] void fail(std::string why) {
  Grid& g = grid();
  const Fiber& f = *g.current;
  if (g.error.empty())
    g.error = "block (" + std::to_string(f.coords.block_idx.x) + "," + std::to_string(f.coords.block_idx.y) + "," +
              std::to_string(f.coords.block_idx.z) + ") thread " + std::to_string(f.linear) + ": " + why;
  throw Abort{};
}

void deliver_copies(Fiber& f, int up_to_group) {
  auto keep = f.copies.begin();
  for (auto& c : f.copies) {
    if (c.group >= 0 && c.group <= up_to_group) {
      if (c.valid)
        std::memcpy(c.dst, c.src, 16);
      else
        std::memset(c.dst, 0, 16);
    } else {
      *keep++ = c;
    }
  }
  f.copies.erase(keep, f.copies.end());
}

void release_barrier_if_complete(Grid& g) {
  if (g.barrier_arrived > 0 && g.barrier_arrived == g.live) {
    g.barrier_arrived = 0;
    ++g.barrier_gen;
  }
}

void release_warp_if_complete(Warp& w) {
  if (w.arrived > 0 && w.arrived == w.live) {
    w.arrived = 0;
    w.op = nullptr;
    ++w.gen;
  }
}

void fiber_main() {
  Grid& g = *tls_grid;
  Fiber& f = *g.current;
#if SEQPAR_EMU_ASAN
  asan_arrived(nullptr, &g.scheduler);
#endif
  try {
    g.body();
    for (auto& c : f.copies) c.group = std::max(c.group, 0);
    deliver_copies(f, f.next_group);  // copies still in flight land when the thread ends
  } catch (const Abort&) {
  } catch (const std::exception& e) {
    if (g.error.empty()) g.error = std::string("exception in a kernel: ") + e.what();
  }
  f.done = true;
  --g.live;
  Warp& w = g.warps[static_cast<std::size_t>(f.warp)];
  --w.live;
  g.progress = true;
  if (g.error.empty()) {
    // A thread that leaves while others wait for it: at a collective of its warp that names
    // it, or at a block barrier (CUDA requires every thread of the block to reach it).
    if (w.arrived > 0 && (w.mask >> f.lane & 1u))
      g.error = std::string("thread ") + std::to_string(f.linear) + " exited while its warp waits at " + w.op;
    else if (g.barrier_arrived > 0)
      g.error = std::string("thread ") + std::to_string(f.linear) + " exited while other threads wait at __syncthreads";
    release_warp_if_complete(w);
  }
  switch_to(f.ctx, g.scheduler, true);  // never resumed
  std::abort();
}

/// SEQPAR_EMU_CP_ASYNC=eager delivers each cp.async when it is issued (the earliest a GPU may),
/// which exposes a copy that overwrites shared memory other warps still read; the default
/// delivers at the wait (the latest), which exposes a missing wait.
bool eager_copies() {
  static const bool e = [] {
    const char* v = std::getenv("SEQPAR_EMU_CP_ASYNC");
    return v && std::strcmp(v, "eager") == 0;
  }();
  return e;
}

/// SEQPAR_EMU_ORDER=descending runs the warps of a block, and the lanes of a warp, last-first.
bool descending_order() {
  static const bool d = [] {
    const char* e = std::getenv("SEQPAR_EMU_ORDER");
    return e && std::strcmp(e, "descending") == 0;
  }();
  return d;
}

std::string deadlock_report(const Grid& g, const dim3& b) {
  std::map<std::string, std::vector<int>> at;
  for (const Fiber& f : g.fibers)
    if (!f.done) at[f.waiting ? f.waiting : "?"].push_back(f.linear);
  std::ostringstream s;  // (string operator+ chains trip GCC 12's -Wrestrict false positive)
  s << "deadlock in block (" << b.x << "," << b.y << "," << b.z << "):";
  for (const auto& [what, who] : at) s << " " << who.size() << " thread(s) (first " << who.front() << ") at " << what << ";";
  return s.str();
}

/// Runs one block to completion; returns false (with g.error set) when it fails.
bool run_block(Grid& g, const dim3& b, std::size_t smem_bytes) {
  const int n = static_cast<int>(g.block.x * g.block.y * g.block.z);
  const int nwarps = (n + warp_size - 1) / warp_size;
  g.fibers.assign(static_cast<std::size_t>(n), Fiber{});
  g.warps.assign(static_cast<std::size_t>(nwarps), Warp{});
  for (int w = 0; w < nwarps; ++w) g.warps[w].lanes = g.warps[w].live = std::min(warp_size, n - w * warp_size);
  g.barrier_gen = 0;
  g.barrier_arrived = 0;
  g.live = n;
  if (smem_bytes) std::memset(g.smem, 0xff, smem_bytes);  // stale garbage, as on a GPU
  auto& st = stacks();
  constexpr std::size_t stack_bytes = 256 * 1024;
  while (st.size() < static_cast<std::size_t>(n)) st.push_back(std::make_unique<Stack>(stack_bytes));
  for (int i = 0; i < n; ++i) {
    Fiber& f = g.fibers[static_cast<std::size_t>(i)];
    f.linear = i;
    f.warp = i / warp_size;
    f.lane = i % warp_size;
    f.coords.thread_idx = {static_cast<unsigned>(i) % g.block.x, static_cast<unsigned>(i) / g.block.x % g.block.y,
                           static_cast<unsigned>(i) / (g.block.x * g.block.y)};
    f.coords.block_idx = {b.x, b.y, b.z};
    f.coords.block_dim = g.block;
    f.coords.grid_dim = g.grid;
    start_context(f.ctx, st[static_cast<std::size_t>(i)]->base(), st[static_cast<std::size_t>(i)]->size(), fiber_main);
  }
  // Warp-serial: each warp runs until all its threads wait at a block barrier (or end), then
  // the next one. Warps drift as far apart as the barriers allow, so a missing barrier shows.
  const bool down = descending_order();
  while (g.live > 0 && g.error.empty()) {
    bool any = false;
    for (int k = 0; k < nwarps && g.error.empty(); ++k) {
      const int w = down ? nwarps - 1 - k : k;
      const int first = w * warp_size, last = std::min(n, first + warp_size);
      do {
        g.progress = false;
        for (int i = first; i < last && g.error.empty(); ++i) {
          Fiber& f = g.fibers[static_cast<std::size_t>(down ? last - 1 - (i - first) : i)];
          if (f.done) continue;
          g.current = &f;
          switch_to(g.scheduler, f.ctx);
        }
        any = any || g.progress;
      } while (g.progress && g.error.empty());
    }
    if (!any && g.live > 0 && g.error.empty()) g.error = deadlock_report(g, b);
  }
  g.current = nullptr;
  return g.error.empty();
}

/// Device allocations: base -> size.
struct Allocations {
  std::mutex mu;
  std::map<std::uintptr_t, std::size_t> blocks;

  /// Whether [p, p + n) lies inside one allocation.
  bool contains(const void* p, std::size_t n) {
    std::lock_guard lock(mu);
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = blocks.upper_bound(a);
    if (it == blocks.begin()) return false;
    --it;
    return a >= it->first && a + n <= it->first + it->second;
  }
};
Allocations& allocations() {
  static Allocations a;
  return a;
}

/// Per-kernel dynamic shared memory limits set with cudaFuncSetAttribute.
struct KernelLimits {
  std::mutex mu;
  std::map<const void*, std::size_t> max_dynamic_smem;
};
KernelLimits& kernel_limits() {
  static KernelLimits k;
  return k;
}

cudaError_t set_error(cudaError_t rc) {
  if (rc != cudaSuccess) tls_last_error = rc;
  return rc;
}

/// Emulated devices: SEQPAR_EMU_DEVICES (default 1), all sharing host memory, so that tests
/// with one rank per device (NCCL) can run several ranks.
int device_count() {
  static const int n = [] {
    const char* e = std::getenv("SEQPAR_EMU_DEVICES");
    return e ? std::max(1, std::atoi(e)) : 1;
  }();
  return n;
}

int compute_capability() {
  static const int cc = [] {
    const char* e = std::getenv("SEQPAR_EMU_CC");
    return e ? std::atoi(e) : 90;
  }();
  return cc;
}

struct Event {
  std::chrono::steady_clock::time_point t;  // when its work ran
  Stream* stream = nullptr;                 // recorded on (null: never recorded)
  std::uint64_t count = 0;                  // complete once `stream` has run this much
};

/// Checks a copy's ranges against the allocations its kind names.
cudaError_t check_copy(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind) {
  if (n == 0) return cudaSuccess;
  Allocations& a = allocations();
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if ((dst_dev && !a.contains(dst, n)) || (src_dev && !a.contains(src, n))) return cudaErrorInvalidValue;
  if (kind == cudaMemcpyDefault) {
    // Unified addressing: a pointer into an allocation must not run past its end.
    if ((a.contains(dst, 1) && !a.contains(dst, n)) || (a.contains(src, 1) && !a.contains(src, n)))
      return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // namespace

const Coords& coords() { return grid().current->coords; }
int lane_id() { return grid().current->lane; }

const std::byte* warp_exchange(const void* mine, std::size_t bytes, const char* op, unsigned mask,
                               void (*combine)(std::byte* slots)) {
  Grid& g = grid();
  Fiber& f = *g.current;
  Warp& w = g.warps[static_cast<std::size_t>(f.warp)];
  if (bytes > slot_bytes) fail(std::string(op) + ": operand too large for the emulation");
  if (!(mask >> f.lane & 1u)) fail(std::string(op) + ": the calling lane is not in the mask");
  const unsigned present = w.lanes == warp_size ? 0xffffffffu : ((1u << w.lanes) - 1u);
  if (mask & ~present) fail(std::string(op) + ": the mask names lanes the block does not have");
  if (w.live != w.lanes || static_cast<int>(__builtin_popcount(mask)) != w.live)
    fail(std::string(op) + ": not every lane of the warp takes part (partial masks are not emulated)");
  if (w.arrived == 0) {
    w.op = op;
    w.mask = mask;
  } else if (std::strcmp(w.op, op) != 0 || w.mask != mask) {
    fail(std::string("warp divergence: lane ") + std::to_string(f.lane) + " at " + op + " while its warp-mates are at " +
         w.op);
  }
  const std::uint64_t gen = w.gen;
  std::byte* slots = &w.slots[gen & 1][0][0];
  std::memcpy(slots + slot_bytes * static_cast<std::size_t>(f.lane), mine, bytes);
  ++w.arrived;
  g.progress = true;
  if (combine && w.arrived == w.live) combine(slots);
  release_warp_if_complete(w);
  while (w.gen == gen) yield(op);
  g.progress = true;
  return slots;
}

void sync_threads() {
  Grid& g = grid();
  Warp& w = g.warps[static_cast<std::size_t>(g.current->warp)];
  if (w.arrived > 0) fail(std::string("__syncthreads while warp-mates are at ") + w.op);
  if (g.live < static_cast<int>(g.fibers.size()))
    fail("__syncthreads after some threads of the block exited (divergent barrier)");
  const std::uint64_t gen = g.barrier_gen;
  ++g.barrier_arrived;
  g.progress = true;
  release_barrier_if_complete(g);
  while (g.barrier_gen == gen) yield("__syncthreads");
  g.progress = true;
}

void trap(const char* why) { fail(why); }

void* dynamic_shared_memory() { return grid().smem; }

void cp_async_16(void* dst, const void* src, bool valid) {
  if (reinterpret_cast<std::uintptr_t>(dst) % 16 || (valid && reinterpret_cast<std::uintptr_t>(src) % 16))
    fail("cp.async: 16-byte copy with an address not 16-byte aligned");
  if (valid && !allocations().contains(src, 16)) fail("cp.async: source outside every device allocation");
  if (eager_copies()) {
    if (valid)
      std::memcpy(dst, src, 16);
    else
      std::memset(dst, 0, 16);
    return;
  }
  grid().current->copies.push_back({dst, src, valid, -1});
}

void cp_async_commit() {
  Fiber& f = *grid().current;
  for (auto& c : f.copies)
    if (c.group < 0) c.group = f.next_group;
  ++f.next_group;
}

void cp_async_wait(int n) {
  Fiber& f = *grid().current;
  deliver_copies(f, f.next_group - 1 - n);
}

namespace {

/// Runs every block of a launch on this thread; the failure, or "".
std::string run_grid(dim3 grid_dim, dim3 block, std::size_t smem, const std::function<void()>& body) {
  if (tls_grid) {
    std::fprintf(stderr, "seqpar_emu: a kernel launched another kernel (not emulated)\n");
    std::abort();
  }
  Grid g;
  g.body = body;
  g.grid = grid_dim;
  g.block = block;
  std::unique_ptr<std::byte[], void (*)(void*)> smem_buf(
      smem ? static_cast<std::byte*>(std::aligned_alloc(16, (smem + 15) / 16 * 16)) : nullptr, std::free);
  g.smem = smem_buf.get();
  tls_grid = &g;
  bool ok = true;
  for (unsigned z = 0; z < grid_dim.z && ok; ++z)
    for (unsigned y = 0; y < grid_dim.y && ok; ++y)
      for (unsigned x = 0; x < grid_dim.x && ok; ++x) ok = run_block(g, dim3(x, y, z), smem);
  tls_grid = nullptr;
  return g.error;
}

/// The launch checks a GPU makes before it starts anything.
cudaError_t check_launch(const void* kernel, dim3 grid_dim, dim3 block, std::size_t smem) {
  const std::uint64_t threads = std::uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid_dim.x == 0 || grid_dim.y == 0 || grid_dim.z == 0 ||
      grid_dim.y > 65535 || grid_dim.z > 65535)
    return cudaErrorInvalidConfiguration;
  std::size_t limit = default_smem;
  KernelLimits& k = kernel_limits();
  std::lock_guard lock(k.mu);
  if (auto it = k.max_dynamic_smem.find(kernel); it != k.max_dynamic_smem.end()) limit = it->second;
  return smem > limit ? cudaErrorInvalidValue : cudaSuccess;
}

}  // namespace

void launch_grid(const void* kernel, dim3 grid_dim, dim3 block, std::size_t smem, cudaStream_t stream,
                 std::function<void()> body) {
  if (const cudaError_t rc = check_launch(kernel, grid_dim, block, smem); rc != cudaSuccess) {
    set_error(rc);
    return;
  }
  enqueue(stream_of(stream), [grid_dim, block, smem, body = std::move(body)]() -> cudaError_t {
    const std::string error = run_grid(grid_dim, block, smem, body);
    if (error.empty()) return cudaSuccess;
    std::fprintf(stderr, "seqpar_emu: kernel failed: %s\n", error.c_str());
    return cudaErrorLaunchFailure;
  });
}

// ---------------------------------------------------------------------------------------
// Streams (streams.hpp).

struct Stream {
  int device = 0;
  bool blocking = true;  // waits for, and is waited for by, the device's legacy stream
  struct Item {
    Work work;
    std::vector<Dep> deps;
  };
  std::deque<Item> queue;
  std::uint64_t queued = 0, done = 0;
  bool busy = false;  // a thread is running the front item
};

namespace {

std::mutex g_queue_mutex;
std::condition_variable g_queue_cv;
std::vector<Stream*> g_streams;                     // every stream, under g_queue_mutex
std::map<int, Stream*> g_legacy;                    // per device
thread_local std::map<int, Stream*> tls_per_thread;  // per device

/// A fault in queued work that no synchronisation has reported yet (CUDA's errors from
/// asynchronous work are sticky too); cudaGetLastError reads and clears it.
std::atomic<int> g_pending_fault{cudaSuccess};

Stream* new_stream(int device, bool blocking) {
  // Owned until exit, also once destroyed: queued work elsewhere may still name it in a Dep.
  static std::deque<std::unique_ptr<Stream>> owned;
  auto* s = owned.emplace_back(std::make_unique<Stream>()).get();
  s->device = device;
  s->blocking = blocking;
  g_streams.push_back(s);
  return s;
}

std::chrono::steady_clock::time_point wait_deadline() {
  return std::chrono::steady_clock::now() + std::chrono::seconds(120);
}

/// Runs all queued work of `device`'s streams; the first error.
cudaError_t run_device(int device) {
  std::vector<std::pair<Stream*, std::uint64_t>> todo;
  {
    std::lock_guard lock(g_queue_mutex);
    for (Stream* s : g_streams)
      if (s->device == device) todo.emplace_back(s, s->queued);
  }
  cudaError_t first = cudaSuccess;
  for (auto [s, n] : todo)
    if (const cudaError_t rc = run_until(s, n); first == cudaSuccess) first = rc;
  return first;
}

/// The result of a synchronisation: its own error, or a fault still unreported.
cudaError_t synced(cudaError_t rc) {
  if (rc == cudaSuccess) rc = static_cast<cudaError_t>(g_pending_fault.load());
  return set_error(rc);
}

}  // namespace

std::mutex& queue_mutex() { return g_queue_mutex; }
std::condition_variable& queue_cv() { return g_queue_cv; }

Stream* stream_of(cudaStream_t handle) {
  const int dev = tls_device;
  std::lock_guard lock(g_queue_mutex);
  if (handle == nullptr || handle == cudaStreamLegacy) {
    Stream*& s = g_legacy[dev];
    if (!s) s = new_stream(dev, true);
    return s;
  }
  if (handle == cudaStreamPerThread) {
    Stream*& s = tls_per_thread[dev];
    if (!s) s = new_stream(dev, true);
    return s;
  }
  return reinterpret_cast<Stream*>(handle);
}

std::uint64_t enqueue(Stream* s, Work work, std::vector<Dep> deps) {
  std::lock_guard lock(g_queue_mutex);
  // The legacy stream and a device's blocking streams wait for each other's earlier work.
  Stream* legacy = g_legacy.count(s->device) ? g_legacy[s->device] : nullptr;
  if (s == legacy) {
    for (Stream* o : g_streams)
      if (o != s && o->device == s->device && o->blocking && o->queued > o->done) deps.push_back({o, o->queued});
  } else if (s->blocking && legacy && legacy->queued > legacy->done) {
    deps.push_back({legacy, legacy->queued});
  }
  s->queue.push_back({std::move(work), std::move(deps)});
  return ++s->queued;
}

cudaError_t run_until(Stream* s, std::uint64_t count) {
  cudaError_t first = cudaSuccess;
  std::unique_lock lock(g_queue_mutex);
  const auto deadline = wait_deadline();
  while (s->done < count) {
    if (s->busy) {  // another thread runs the front item: wait for it
      if (g_queue_cv.wait_until(lock, deadline) == std::cv_status::timeout) return cudaErrorLaunchTimeout;
      continue;
    }
    Stream::Item& item = s->queue.front();
    bool waited = false;
    for (const Dep d : item.deps)  // a copy: once unlocked, another thread may pop `item`
      if (d.stream->done < d.count) {
        lock.unlock();
        const cudaError_t rc = run_until(d.stream, d.count);
        if (first == cudaSuccess) first = rc;
        lock.lock();
        waited = true;
        break;
      }
    if (waited) continue;  // the queue may have moved meanwhile: look again
    s->busy = true;
    Work work = std::move(item.work);
    lock.unlock();
    const cudaError_t rc = work();
    lock.lock();
    s->queue.pop_front();
    ++s->done;
    s->busy = false;
    g_queue_cv.notify_all();
    if (rc != cudaSuccess) {
      int none = cudaSuccess;
      g_pending_fault.compare_exchange_strong(none, rc);
      if (first == cudaSuccess) first = rc;
    }
  }
  return first;
}

}  // namespace seqpar_emu

using seqpar_emu::allocations;
using seqpar_emu::set_error;

// ---------------------------------------------------------------------------------------
// The CUDA runtime API subset (declarations from the toolkit's cuda_runtime_api.h).

extern "C" {

cudaError_t cudaGetLastError() {
  cudaError_t rc = seqpar_emu::tls_last_error;
  seqpar_emu::tls_last_error = cudaSuccess;
  const int fault = seqpar_emu::g_pending_fault.exchange(cudaSuccess);
  if (rc == cudaSuccess) rc = static_cast<cudaError_t>(fault);
  return rc;
}
cudaError_t cudaPeekAtLastError() { return seqpar_emu::tls_last_error; }

const char* cudaGetErrorName(cudaError_t rc) {
  switch (rc) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    default: return "cudaError (emulated)";
  }
}
const char* cudaGetErrorString(cudaError_t rc) {
  switch (rc) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument (emulation: out-of-range copy or launch parameter)";
    case cudaErrorLaunchFailure: return "kernel failed in the CPU emulation (details on stderr)";
    case cudaErrorInvalidConfiguration: return "invalid launch configuration";
    default: return cudaGetErrorName(rc);
  }
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = seqpar_emu::device_count();
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = seqpar_emu::tls_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= seqpar_emu::device_count()) return set_error(cudaErrorInvalidDevice);
  seqpar_emu::tls_device = device;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= seqpar_emu::device_count()) return set_error(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor: *value = seqpar_emu::compute_capability() / 10; break;
    case cudaDevAttrComputeCapabilityMinor: *value = seqpar_emu::compute_capability() % 10; break;
    case cudaDevAttrMultiProcessorCount: *value = 132; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = static_cast<int>(seqpar_emu::max_smem_optin); break;
    case cudaDevAttrWarpSize: *value = 32; break;
    default: return set_error(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= seqpar_emu::device_count()) return set_error(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "seqpar CPU emulation (sm_%d)", seqpar_emu::compute_capability());
  prop->major = seqpar_emu::compute_capability() / 10;
  prop->minor = seqpar_emu::compute_capability() % 10;
  prop->multiProcessorCount = 132;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->sharedMemPerBlock = seqpar_emu::default_smem;
  prop->sharedMemPerBlockOptin = seqpar_emu::max_smem_optin;
  prop->totalGlobalMem = std::size_t{1} << 34;
  prop->unifiedAddressing = 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() { return seqpar_emu::synced(seqpar_emu::run_device(seqpar_emu::tls_device)); }

cudaError_t cudaMalloc(void** ptr, std::size_t bytes) {
  *ptr = nullptr;
  if (bytes == 0) return cudaSuccess;
  void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (!p) return set_error(cudaErrorMemoryAllocation);
  std::memset(p, 0xff, bytes);  // unwritten device memory reads as NaN
  auto& a = allocations();
  std::lock_guard lock(a.mu);
  a.blocks[reinterpret_cast<std::uintptr_t>(p)] = bytes;
  *ptr = p;
  return cudaSuccess;
}
cudaError_t cudaFree(void* ptr) {
  if (!ptr) return cudaSuccess;
  (void)seqpar_emu::run_device(seqpar_emu::tls_device);  // cudaFree synchronises the device
  auto& a = allocations();
  {
    std::lock_guard lock(a.mu);
    if (a.blocks.erase(reinterpret_cast<std::uintptr_t>(ptr)) == 0) return set_error(cudaErrorInvalidValue);
  }
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  if (const cudaError_t rc = seqpar_emu::check_copy(dst, src, bytes, kind); rc != cudaSuccess) return set_error(rc);
  if (bytes == 0) return cudaSuccess;
  seqpar_emu::enqueue(seqpar_emu::stream_of(stream), [dst, src, bytes] {
    std::memmove(dst, src, bytes);
    return cudaSuccess;
  });
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  // On the legacy stream; returns when the bytes have landed (device-to-device copies are
  // asynchronous in CUDA, and stay queued here).
  if (const cudaError_t rc = cudaMemcpyAsync(dst, src, bytes, kind, nullptr); rc != cudaSuccess || bytes == 0 ||
                                                                            kind == cudaMemcpyDeviceToDevice)
    return rc;
  return cudaStreamSynchronize(nullptr);
}
cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t bytes, cudaStream_t stream) {
  if (bytes && !allocations().contains(dst, bytes)) return set_error(cudaErrorInvalidValue);
  if (bytes == 0) return cudaSuccess;
  seqpar_emu::enqueue(seqpar_emu::stream_of(stream), [dst, value, bytes] {
    std::memset(dst, value, bytes);
    return cudaSuccess;
  });
  return cudaSuccess;
}
cudaError_t cudaMemset(void* dst, int value, std::size_t bytes) { return cudaMemsetAsync(dst, value, bytes, nullptr); }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  std::lock_guard lock(seqpar_emu::queue_mutex());
  *stream = reinterpret_cast<cudaStream_t>(
      seqpar_emu::new_stream(seqpar_emu::tls_device, (flags & cudaStreamNonBlocking) == 0));
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  // CUDA lets queued work finish first; here it runs now.
  seqpar_emu::Stream* s = seqpar_emu::stream_of(stream);
  const cudaError_t rc = seqpar_emu::run_until(s, s->queued);
  std::lock_guard lock(seqpar_emu::queue_mutex());
  auto& all = seqpar_emu::g_streams;
  all.erase(std::remove(all.begin(), all.end(), s), all.end());
  return set_error(rc);
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  seqpar_emu::Stream* s = seqpar_emu::stream_of(stream);
  std::uint64_t n;
  {
    std::lock_guard lock(seqpar_emu::queue_mutex());
    n = s->queued;
  }
  return seqpar_emu::synced(seqpar_emu::run_until(s, n));
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  auto* e = reinterpret_cast<seqpar_emu::Event*>(event);
  std::vector<seqpar_emu::Dep> deps;
  {
    std::lock_guard lock(seqpar_emu::queue_mutex());
    if (e->stream) deps.push_back({e->stream, e->count});  // the event as recorded now
  }
  seqpar_emu::enqueue(seqpar_emu::stream_of(stream), [] { return cudaSuccess; }, std::move(deps));
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  *event = reinterpret_cast<cudaEvent_t>(new seqpar_emu::Event{std::chrono::steady_clock::now()});
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<seqpar_emu::Event*>(event);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  auto* e = reinterpret_cast<seqpar_emu::Event*>(event);
  seqpar_emu::Stream* s = seqpar_emu::stream_of(stream);
  const std::uint64_t n = seqpar_emu::enqueue(s, [e] {
    e->t = std::chrono::steady_clock::now();
    return cudaSuccess;
  });
  std::lock_guard lock(seqpar_emu::queue_mutex());
  e->stream = s;
  e->count = n;
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  auto* e = reinterpret_cast<seqpar_emu::Event*>(event);
  return e->stream ? seqpar_emu::synced(seqpar_emu::run_until(e->stream, e->count)) : cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(reinterpret_cast<seqpar_emu::Event*>(end)->t -
                                                 reinterpret_cast<seqpar_emu::Event*>(start)->t)
            .count();
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || static_cast<std::size_t>(value) > seqpar_emu::max_smem_optin) return set_error(cudaErrorInvalidValue);
  auto& k = seqpar_emu::kernel_limits();
  std::lock_guard lock(k.mu);
  k.max_dynamic_smem[func] = static_cast<std::size_t>(value);
  return cudaSuccess;
}

}  // extern "C"
