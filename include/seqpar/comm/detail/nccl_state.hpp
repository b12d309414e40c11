#pragma once
/// \file
/// The NCCL plumbing under NcclCommunicator: the error check (SEQPAR_NCCL_CHECK), the handle
/// state shared by copies of one communicator, and a group that always ends. Needs NCCL.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <string>

#include "seqpar/cuda/error.hpp"
#include "seqpar/core/error.hpp"

namespace seqpar {
namespace detail {

/// Throws NcclError for a failed NCCL call `what`, with NCCL's own explanation.
[[noreturn]] inline void throw_nccl_error(ncclResult_t rc, const char* what, const char* file, int line) {
  const char* last = nullptr;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
  last = ncclGetLastError(nullptr);
#endif
  throw_error<NcclError>(file, line, what, " failed: ", ncclGetErrorString(rc), " (ncclResult_t ", static_cast<int>(rc),
                         ")", last && *last ? std::string(": ") + last : std::string());
}

}  // namespace detail
}  // namespace seqpar

/// Evaluates an NCCL call and throws seqpar::NcclError unless it returns ncclSuccess.
#define SEQPAR_NCCL_CHECK(call)                                                         \
  do {                                                                                  \
    const ncclResult_t seqpar_nccl_rc_ = (call);                                        \
    if (seqpar_nccl_rc_ != ncclSuccess)                                                 \
      ::seqpar::detail::throw_nccl_error(seqpar_nccl_rc_, #call, __FILE__, __LINE__);   \
  } while (0)

namespace seqpar {
namespace detail {

/// What every copy of one NcclCommunicator shares: the NCCL communicator, the communication
/// stream and the events of the exchanges. Destroyed with the last copy.
struct NcclState {
  /// Exchanges that may be in flight at once (ring steps start one and wait for it; backward
  /// moves K/V and their gradients together).
  static constexpr std::size_t max_in_flight = 8;

  ncclComm_t comm = nullptr;
  bool owned = false;
  bool aborted = false;  // ncclCommAbort freed `comm` after a time-out
  std::chrono::milliseconds timeout{0};
  cudaStream_t comm_stream = nullptr;
  cudaEvent_t ready = nullptr;
  std::array<cudaEvent_t, max_in_flight> done{};
  std::size_t next_done = 0;

  NcclState(ncclComm_t c, bool own, std::chrono::milliseconds t) : comm(c), owned(own), timeout(t) {
    try {
      SEQPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream, cudaStreamNonBlocking));
      SEQPAR_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
      for (auto& e : done) SEQPAR_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    } catch (...) {
      release();
      throw;
    }
  }
  NcclState(const NcclState&) = delete;
  NcclState& operator=(const NcclState&) = delete;
  ~NcclState() { release(); }

 private:
  // A destructor cannot report failures; the handles are released on a best-effort basis.
  void release() noexcept {
    for (auto& e : done)
      if (e) cudaEventDestroy(e);
    if (ready) cudaEventDestroy(ready);
    if (comm_stream) cudaStreamDestroy(comm_stream);
    if (owned && comm && !aborted) ncclCommDestroy(comm);
  }
};

/// Ends an NCCL group even when a call inside it failed (an open group would capture later
/// calls), then reports the first failure.
class NcclGroup {
 public:
  NcclGroup() { SEQPAR_NCCL_CHECK(ncclGroupStart()); }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  /// Records the result of a call made inside the group.
  void add(ncclResult_t rc, const char* what) {
    if (rc != ncclSuccess && first_ == ncclSuccess) {
      first_ = rc;
      what_ = what;
    }
  }
  /// Ends the group; throws for the first failure inside it or for the group end itself.
  void end() {
    open_ = false;
    const ncclResult_t rc = ncclGroupEnd();
    if (first_ != ncclSuccess) throw_nccl_error(first_, what_, __FILE__, __LINE__);
    SEQPAR_NCCL_CHECK(rc);
  }
  ~NcclGroup() {
    if (open_) ncclGroupEnd();
  }

 private:
  ncclResult_t first_ = ncclSuccess;
  const char* what_ = "";
  bool open_ = true;
};

}  // namespace detail
}  // namespace seqpar
