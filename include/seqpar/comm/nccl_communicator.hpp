#pragma once
/// \file
/// NcclCommunicator: the Communicator over NCCL (one GPU per rank, any number of nodes).
///
/// Data moves on GPU streams, never through the host:
/// - all_to_all_v is one NCCL group of ncclSend/ncclRecv pairs on the compute stream (the
///   stream the kernel and TensorOps use), so it is ordered after the packing that fills the
///   send buffer and before the kernel that reads the result, without any host wait;
/// - start_exchange records an event on the compute stream, makes the communication stream
///   wait for it (the send buffer is complete, and earlier kernels are done with the receive
///   buffer), posts the paired send/recv there and records a "done" event; wait() makes the
///   compute stream wait for "done". Between the two, the compute stream runs the current ring
///   step's kernel while the next K/V block is in flight: compute and transfer overlap.
/// Metadata (all_gather_host, used only when a plan is made) goes over a host communicator
/// (MpiCommunicator, or ThreadCommunicator for ranks as threads), so a forward never copies
/// device memory to the host. split() is ncclCommSplit (NCCL >= 2.18) plus the host split.
///
/// Every NCCL and CUDA return code is checked: failures throw NcclError / CudaError.
///
/// Time-out (off by default): set_timeout(), or SEQPAR_COMM_TIMEOUT_MS read when the
/// communicator is made. all_to_all_v, start_exchange and wait only enqueue work, so the host
/// never blocks in them; a peer that never joins leaves the GPU streams waiting, and the host
/// sees it where it synchronises. barrier() is where this communicator does: with a time-out it
/// polls cudaStreamQuery and ncclCommGetAsyncError instead of cudaStreamSynchronize, and when
/// the stream makes no progress for that long it calls ncclCommAbort (which releases the
/// stuck kernels) and throws CommError; an asynchronous NCCL error throws NcclError. The host
/// communicator's waits (all_gather_host, the host barrier) are bounded by its own time-out
/// (SEQPAR_COMM_TIMEOUT_MS sets both; set_timeout() sets the host one too where it has one).
/// The user's own stream synchronisations are not covered (NCCL has no such time-out of its
/// own; PyTorch's ProcessGroupNCCL watchdog, the `timeout` of init_process_group, plays that
/// part there). Under the CPU emulation of the device (SEQPAR_CUDA_EMULATION) barrier()
/// synchronises as without a time-out: the emulated receive has its own time-out
/// (SEQPAR_EMU_NCCL_TIMEOUT_S).
///
/// What NCCL guarantees, and what that asks of a caller: NCCL has no tags. Operations on one
/// communicator match by issue order: the n-th collective on each rank, and the n-th ncclSend
/// from a rank to a peer with the peer's n-th ncclRecv from it. So a rank that skips an
/// operation its peers issue (an exception between two enqueues, a call abandoned half-way)
/// desynchronises every later one: each then meets the peers' previous operation, which, at
/// equal sizes, silently hands over the bytes of another call, and otherwise hangs or fails.
/// Nothing on the wire can tell; there is no tagged start_exchange here (a tag could not
/// travel). The protection is the failure latch (FailureLatch, shared by copies and splits;
/// fail() also sets the host communicator's): once a call failed part-way on this rank (the
/// engine's guard) or one of this communicator's operations failed (NcclError, CudaError, the
/// barrier's time-out), every later operation on this rank throws CommError at once and
/// enqueues nothing. What the caller must then do: NCCL cannot resynchronise a communicator,
/// only abort it. Call ncclCommAbort on native() (it also releases this rank's kernels still
/// waiting for peers), and end the job, or make new communicators on every rank (the peers
/// need ncclCommAbort too: their kernels may wait for this rank, and only their own time-out,
/// or a watchdog such as PyTorch's, notices).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/comm/detail/nccl_state.hpp"
#include "seqpar/core/checked.hpp"
#include "seqpar/cuda/error.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/poll.hpp"
#include "seqpar/core/types.hpp"

namespace seqpar {

/// A Communicator over NCCL with its metadata on `HostComm` (see the file comment). A handle:
/// copies are the same rank and share the NCCL communicator, which the last copy destroys
/// when this object created it. Buffers are device memory of the communicator's device.
///
/// Thread safety: one thread at a time per communicator (copies included), as NCCL requires
/// for one ncclComm_t; no call is safe concurrently with another on it. The traffic counters
/// (stats(), shared with splits) are updated atomically; see CommStats for reading them.
template <class HostComm>
class NcclCommunicator {
  static_assert(Communicator<HostComm>, "NcclCommunicator<HostComm>: HostComm must model seqpar::Communicator");
  static_assert(std::is_same_v<typename HostComm::memory_space, HostSpace>,
                "NcclCommunicator<HostComm>: the metadata communicator must work in HostSpace");

 public:
  static constexpr bool is_seqpar_communicator = true;  ///< opts in to the Communicator concept
  using memory_space = CudaSpace;                       ///< buffers are device memory
  using host_communicator = HostComm;                   ///< the metadata channel

  /// A started exchange: the event the compute stream waits for.
  struct request_type {
    cudaEvent_t done = nullptr;  ///< recorded on the communication stream after the send/recv
  };

  /// Creates an NCCL communicator over the ranks of `host` on the current CUDA device
  /// (collective over `host`): rank 0 makes the unique id, the host channel hands it out. Work
  /// is enqueued on `stream` (the compute stream; set_stream changes it).
  static NcclCommunicator create(HostComm host, cudaStream_t stream = nullptr) {
    ncclComm_t comm = init_over(host);
    return NcclCommunicator(std::make_shared<detail::NcclState>(comm, true, comm_timeout_from_env()), std::move(host),
                            stream, std::make_shared<CommStats>(), std::make_shared<FailureLatch>());
  }

  /// Wraps an existing NCCL communicator whose ranks match `host`'s. It is not destroyed here
  /// unless `take_ownership`.
  NcclCommunicator(ncclComm_t comm, HostComm host, cudaStream_t stream = nullptr, bool take_ownership = false)
      : NcclCommunicator(std::make_shared<detail::NcclState>(comm, take_ownership, comm_timeout_from_env()),
                         std::move(host), stream, std::make_shared<CommStats>(), std::make_shared<FailureLatch>()) {}

  /// This rank.
  int rank() const { return rank_; }
  /// Ranks in the group.
  int size() const { return size_; }
  /// The NCCL communicator.
  ncclComm_t native() const { return state_->comm; }
  /// The host (metadata) communicator.
  HostComm& host() { return host_; }
  /// The compute stream: collectives run on it, exchanges synchronise with it.
  cudaStream_t stream() const { return stream_; }
  /// Sets the compute stream (use the one the kernel and TensorOps use; see use_stream()).
  void set_stream(cudaStream_t s) { stream_ = s; }
  /// The stream ring exchanges run on.
  cudaStream_t comm_stream() const { return state_->comm_stream; }
  /// Counters (shared with communicators split from this one).
  const CommStats& stats() const { return *stats_; }
  /// Counters, mutable (to reset them).
  CommStats& stats() { return *stats_; }
  /// The time-out of barrier()'s device wait; zero: none (see the file comment).
  std::chrono::milliseconds timeout() const { return state_->timeout; }
  /// Sets the time-out of barrier()'s device wait for every copy, and the host
  /// communicator's when it has set_timeout(); zero: none.
  void set_timeout(std::chrono::milliseconds t) {
    SEQPAR_CHECK(t.count() >= 0, ConfigError, "NcclCommunicator: set_timeout: expected >= 0 ms, got ", t.count());
    state_->timeout = t;
    if constexpr (requires { host_.set_timeout(t); }) host_.set_timeout(t);
  }
  /// Sets this rank's failure latch (shared with copies and splits; the first reason stays)
  /// and the host communicator's: every later operation throws CommError (see the file comment).
  void fail(std::string_view reason) noexcept {
    latch_->set(reason);
    detail::fail_communicator(host_, reason);
  }
  /// True once the failure latch is set.
  bool failed() const noexcept { return latch_->failed(); }

  /// Variable-count all-to-all (see the Communicator concept) as one group of ncclSend/ncclRecv
  /// on the compute stream; the piece to itself is a device copy. Returns once enqueued.
  void all_to_all_v(const std::byte* send, std::span<const std::size_t> send_counts,
                    std::span<const std::size_t> send_displs, std::byte* recv,
                    std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    refuse_if_failed("all_to_all_v");
    const auto n = static_cast<std::size_t>(size_);
    detail::check_all_to_all_spans("NcclCommunicator", n, send_counts.size(), send_displs.size(), recv_counts.size(),
                                   recv_displs.size());
    const auto me = static_cast<std::size_t>(rank_);
    SEQPAR_CHECK(send_counts[me] == recv_counts[me], ConfigError, "NcclCommunicator: all_to_all_v: rank ", rank_,
                 " sends itself ", send_counts[me], " bytes but expects ", recv_counts[me]);
    latch_->latch_on_failure([&] {
      {
        detail::NcclGroup group;
        for (int j = 0; j < size_; ++j) {
          const auto k = static_cast<std::size_t>(j);
          if (j == rank_) continue;
          if (send_counts[k] > 0)
            group.add(ncclSend(send + send_displs[k], send_counts[k], ncclUint8, j, state_->comm, stream_), "ncclSend");
          if (recv_counts[k] > 0)
            group.add(ncclRecv(recv + recv_displs[k], recv_counts[k], ncclUint8, j, state_->comm, stream_), "ncclRecv");
        }
        group.end();
      }
      if (send_counts[me] > 0)
        SEQPAR_CUDA_CHECK(cudaMemcpyAsync(recv + recv_displs[me], send + send_displs[me], send_counts[me],
                                          cudaMemcpyDeviceToDevice, stream_));
    });
    stats_->count_all_to_all(send_counts, rank_);
  }

  /// Starts sending `send_bytes` to `dest` and receiving `recv_bytes` from `source` on the
  /// communication stream, after everything enqueued on the compute stream so far. The send
  /// buffer must stay untouched, and the receive buffer unread, until wait().
  request_type start_exchange(const std::byte* send, std::size_t send_bytes, int dest, std::byte* recv,
                              std::size_t recv_bytes, int source) {
    refuse_if_failed("exchange");
    check_rank(dest, "dest");
    check_rank(source, "source");
    SEQPAR_CHECK(dest != rank_ || source != rank_ || send_bytes == recv_bytes, ConfigError,
                 "NcclCommunicator: exchange with itself: sends ", send_bytes, " bytes, expects ", recv_bytes);
    detail::NcclState& st = *state_;
    request_type req = latch_->latch_on_failure([&] {
      SEQPAR_CUDA_CHECK(cudaEventRecord(st.ready, stream_));
      SEQPAR_CUDA_CHECK(cudaStreamWaitEvent(st.comm_stream, st.ready, 0));
      if (dest == rank_ && source == rank_) {
        if (send_bytes > 0)
          SEQPAR_CUDA_CHECK(cudaMemcpyAsync(recv, send, send_bytes, cudaMemcpyDeviceToDevice, st.comm_stream));
      } else {
        detail::NcclGroup group;
        if (send_bytes > 0) group.add(ncclSend(send, send_bytes, ncclUint8, dest, st.comm, st.comm_stream), "ncclSend");
        if (recv_bytes > 0) group.add(ncclRecv(recv, recv_bytes, ncclUint8, source, st.comm, st.comm_stream), "ncclRecv");
        group.end();
      }
      request_type r{st.done[st.next_done]};
      st.next_done = (st.next_done + 1) % detail::NcclState::max_in_flight;
      SEQPAR_CUDA_CHECK(cudaEventRecord(r.done, st.comm_stream));
      return r;
    });
    stats_->count_exchange(send_bytes, dest != rank_);
    return req;
  }

  /// Completes an exchange for the compute stream: work enqueued on it from now on runs after
  /// the transfer. The host does not wait.
  void wait(request_type& req) {
    refuse_if_failed("exchange");
    SEQPAR_CHECK(req.done != nullptr, ConfigError, "NcclCommunicator: wait: the request was not started");
    latch_->latch_on_failure([&] { SEQPAR_CUDA_CHECK(cudaStreamWaitEvent(stream_, req.done, 0)); });
    req.done = nullptr;
  }

  /// Metadata all-gather of host integers over the host communicator.
  void all_gather_host(std::span<const std::int64_t> mine, std::span<std::int64_t> all) {
    refuse_if_failed("all_gather_host");
    latch_->latch_on_failure([&] { host_.all_gather_host(mine, all); });
    stats_->count_host_gather();
  }

  /// Waits for this rank's compute stream (bounded by the time-out, see the file comment),
  /// then for every rank (host barrier).
  void barrier() {
    refuse_if_failed("barrier");
    latch_->latch_on_failure([&] {
      sync_stream("barrier");
      host_.barrier();
    });
  }

  /// Splits into one communicator per color, ranked by key (collective): the host communicator
  /// splits, and so does the NCCL one. The result shares this one's stats, compute stream and
  /// failure latch.
  NcclCommunicator split(int color, int key) {
    refuse_if_failed("split");
    SEQPAR_CHECK(color >= 0, ConfigError, "NcclCommunicator: split: color: expected >= 0, got ", color);
    return latch_->latch_on_failure([&] {
      HostComm child_host = host_.split(color, key);
      ncclComm_t child = nullptr;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
      SEQPAR_NCCL_CHECK(ncclCommSplit(state_->comm, color, key, &child, nullptr));
#else
      child = init_over(child_host);
#endif
      return NcclCommunicator(std::make_shared<detail::NcclState>(child, true, timeout()), std::move(child_host),
                              stream_, stats_, latch_);
    });
  }

 private:
  NcclCommunicator(std::shared_ptr<detail::NcclState> state, HostComm host, cudaStream_t stream,
                   std::shared_ptr<CommStats> stats, std::shared_ptr<FailureLatch> latch)
      : state_(std::move(state)), host_(std::move(host)), stream_(stream), stats_(std::move(stats)),
        latch_(std::move(latch)) {
    SEQPAR_CHECK(state_->comm != nullptr, ConfigError, "NcclCommunicator: comm: expected an NCCL communicator, got null");
    SEQPAR_NCCL_CHECK(ncclCommUserRank(state_->comm, &rank_));
    SEQPAR_NCCL_CHECK(ncclCommCount(state_->comm, &size_));
    SEQPAR_CHECK(rank_ == host_.rank() && size_ == host_.size(), ConfigError,
                 "NcclCommunicator: the NCCL communicator (rank ", rank_, " of ", size_,
                 ") does not match the host communicator (rank ", host_.rank(), " of ", host_.size(), ")");
  }

  /// ncclCommInitRank over the ranks of `host`. The unique id travels in the host all-gather
  /// with a status word first, so that if rank 0 cannot make it every rank throws (none waits).
  static ncclComm_t init_over(HostComm& host) {
    constexpr std::size_t words = (sizeof(ncclUniqueId) + sizeof(std::int64_t) - 1) / sizeof(std::int64_t);
    std::array<std::int64_t, words + 1> mine{};
    ncclResult_t made = ncclSuccess;
    if (host.rank() == 0) {
      ncclUniqueId id{};
      made = ncclGetUniqueId(&id);
      mine[0] = static_cast<std::int64_t>(made);
      std::memcpy(mine.data() + 1, &id, sizeof(id));
    }
    std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(host.size()));
    host.all_gather_host(mine, all);
    host.stats().uncount_host_gather();  // set-up, not per-call metadata
    if (all[0] != ncclSuccess)
      detail::throw_nccl_error(static_cast<ncclResult_t>(all[0]), "ncclGetUniqueId (on rank 0)", __FILE__, __LINE__);
    ncclUniqueId id{};
    std::memcpy(&id, all.data() + 1, sizeof(id));
    ncclComm_t comm = nullptr;
    SEQPAR_NCCL_CHECK(ncclCommInitRank(&comm, host.size(), id, host.rank()));
    return comm;
  }

  /// cudaStreamSynchronize(stream_), or with a time-out a poll of cudaStreamQuery and
  /// ncclCommGetAsyncError that aborts the NCCL communicator when the deadline passes.
  void sync_stream(const char* what) {
#if defined(SEQPAR_CUDA_EMULATION)
    (void)what;
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(stream_));
#else
    detail::NcclState& st = *state_;
    SEQPAR_CHECK(!st.aborted, CommError, "NcclCommunicator: ", what,
                 ": the NCCL communicator was aborted after a time-out; end the job");
    if (st.timeout.count() == 0) {
      SEQPAR_CUDA_CHECK(cudaStreamSynchronize(stream_));
      return;
    }
    using Clock = std::chrono::steady_clock;
    const auto stream_done = [&] {  // throws the stream's or NCCL's error
      const cudaError_t rc = cudaStreamQuery(stream_);
      if (rc == cudaSuccess) return true;
      if (rc != cudaErrorNotReady) SEQPAR_CUDA_CHECK(rc);
      ncclResult_t async = ncclSuccess;
      SEQPAR_NCCL_CHECK(ncclCommGetAsyncError(st.comm, &async));
      bool failed = async != ncclSuccess;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
      failed = failed && async != ncclInProgress;  // a nonblocking communicator still working
#endif
      if (failed) detail::throw_nccl_error(async, "ncclCommGetAsyncError", __FILE__, __LINE__);
      return false;
    };
    // poll_until's back-off (core/poll.hpp); a huge time-out saturates: never.
    if (poll_until(stream_done, saturating_deadline<Clock>(Clock::now(), st.timeout))) return;
    // The stream waits for transfers a peer never joined: aborting the communicator ends the
    // kernels that wait for them (every later call on it fails).
    ncclCommAbort(st.comm);
    st.aborted = true;
    detail::throw_error<CommError>(__FILE__, __LINE__, "NcclCommunicator: ", what, ": no progress for ",
                                   st.timeout.count(), " ms on rank ", rank_, " of ", size_,
                                   " (the compute stream waits for NCCL transfers a peer has not joined); "
                                   "the NCCL communicator was aborted: end the job");
#endif
  }

  void check_rank(int r, const char* name) const {
    SEQPAR_CHECK(r >= 0 && r < size_, ConfigError, "NcclCommunicator: ", name, ": expected a rank in [0, ", size_,
                 "), got ", r);
  }

  /// Throws the latch's CommError for operation `what` once the latch is set.
  void refuse_if_failed(const char* what) const {
    if (latch_->failed())
      latch_->refuse("NcclCommunicator", what,
                     "its peers may still wait in it, and NCCL matches operations by order: abort the NCCL "
                     "communicator (ncclCommAbort on native()) and end the job, or make new communicators on every "
                     "rank");
  }

  std::shared_ptr<detail::NcclState> state_;
  HostComm host_;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<CommStats> stats_;
  std::shared_ptr<FailureLatch> latch_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace seqpar
