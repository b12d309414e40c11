#pragma once
/// \file
/// MpiCommunicator: the Communicator concept over an `MPI_Comm` (multi-process and multi-node
/// through mpirun). Needs MPI: link `seqpar::mpi`. Not part of the umbrella header.

#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/core/checked.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/poll.hpp"
#include "seqpar/core/types.hpp"

#include "seqpar/comm/detail/mpi_state.hpp"

namespace seqpar {

/// The Communicator concept over an MPI communicator, moving buffers in memory space `Space`.
///
/// A handle: cheap to copy, every copy is the same communicator (and shares the stats). Made
/// from a user's `MPI_Comm` it does not own it; communicators made by split() own theirs and
/// free it when the last copy goes (unless MPI is already finalized). It sets the error
/// handler of its communicator to MPI_ERRORS_RETURN, so that every MPI failure becomes a
/// seqpar::MpiError instead of an abort; use duplicate() to leave the user's handle untouched.
///
/// With `Space = CudaSpace` it passes device pointers straight to MPI, which needs a CUDA-aware
/// MPI build (Open MPI with UCX or `--with-cuda`); the metadata all-gather stays on the host.
///
/// Counts and displacements are bytes (size_t). MPI counts are int, so transfers go in units of
/// a contiguous datatype: the largest power of two <= 256 dividing every count and
/// displacement of the call. A transfer that still needs more than INT_MAX units throws MpiError.
///
/// Time-out (off by default, as in MPI): set_timeout(), or the environment variable
/// SEQPAR_COMM_TIMEOUT_MS read when the communicator is made (splits inherit their parent's).
/// With one, every wait (all_to_all_v, wait, all_gather_host, barrier) uses MPI's nonblocking
/// call (MPI_Ialltoallv, MPI_Isend/Irecv, MPI_Iallgather, MPI_Ibarrier) and polls it
/// (poll_until, core/poll.hpp: yielding, then sleeping between polls); when it makes no
/// progress for that long it throws CommError naming the operation and, for an exchange, the
/// peer (a peer that failed but stays alive, finalized, or waits in another operation). MPI
/// cannot cancel a collective, so after a time-out the communicator and the buffers of that
/// operation still belong to MPI: end the job (MPI_Abort). split() and duplicate() stay
/// blocking. Without a time-out the blocking calls are used, unchanged.
///
/// Calls never mix their messages. MPI matches a receive to the first message of its source,
/// communicator and tag, so exchanges carry a tag: the seven-argument start_exchange maps its
/// call tag (call_tag: the call's kind and number) into MPI tags [2048, MPI_TAG_UB] (call
/// numbers modulo (MPI_TAG_UB - 2047) / 4: at least 7680 calls apart before two collide), and
/// the plain one uses 0x5eb. A message of another call thus never lands in this call's
/// receive. With a time-out, wait() also probes (MPI_Iprobe) for a message from its source
/// that carries another exchange tag; one that stays in front of the awaited message for a
/// quarter of the time-out (at most 500 ms) throws CommError naming "a message of another
/// call", rather than waiting out the whole time-out. Do not send your own messages with tags >= 2048 on a communicator wrapped
/// without duplicate(). Collectives have no tags (MPI matches them by order): the failure
/// latch below keeps them apart.
///
/// Failure latch (FailureLatch, shared by copies and splits): when a call fails part-way on
/// this rank (the engine's guard, through fail()) or one of this communicator's own operations
/// fails (time-out, MpiError, a size mismatch, a message of another call), every later
/// operation on this rank throws CommError at once: "a previous call failed part-way on this
/// rank (<first error>): its peers may still wait in it; end the job (MPI_Abort) or make new
/// communicators on every rank". The peers see a time-out or an error, never the bytes of
/// another call. A request destroyed unwaited (its rank unwinds) withdraws its receive
/// (MPI_Cancel), so a peer's message of the abandoned call does not land in a buffer that is
/// being freed; its send is left to MPI (MPI_Request_free), which may still read the buffer
/// until the message is received or the job ends.
///
/// Thread safety: one thread at a time per communicator (and MPI must be initialised with
/// MPI_THREAD_MULTIPLE for different communicators on different threads); no call is safe
/// concurrently with another on the same communicator or its copies. The traffic counters
/// (stats(), shared with splits) are updated atomically; see CommStats for reading them.
template <class Space = HostSpace>
class BasicMpiCommunicator {
 public:
  static constexpr bool is_seqpar_communicator = true;  ///< opts in to the Communicator concept
  using memory_space = Space;                           ///< buffers live here

  /// A started exchange: the receive and the send, completed together by wait(). Move-only:
  /// one destroyed before it completed withdraws its receive and lets go of its send (see
  /// the class comment and detail::MpiExchangeRequests).
  struct request_type {
    detail::MpiExchangeRequests requests;  ///< {receive, send}
    MPI_Datatype recv_type = MPI_BYTE;  ///< unit the receive was posted in
    std::size_t recv_bytes = 0;  ///< bytes expected from `source`
    int source = -1;             ///< rank we receive from
    int dest = -1;               ///< rank we send to
    int tag = 0;                 ///< the MPI tag of both messages
    bool complete = false;       ///< test() saw both halves done and checked them
  };

  /// Wraps `comm` without owning it and sets its error handler to MPI_ERRORS_RETURN.
  /// MPI must be initialised; `comm` must outlive every copy.
  explicit BasicMpiCommunicator(MPI_Comm comm)
      : BasicMpiCommunicator(std::make_shared<detail::MpiCommState>(comm, false, comm_timeout_from_env()),
                             std::make_shared<CommStats>(), std::make_shared<FailureLatch>()) {}

  /// An owning communicator over a duplicate of `comm` (collective): its traffic cannot match
  /// the caller's messages, and `comm`'s error handler is left as it was.
  static BasicMpiCommunicator duplicate(MPI_Comm comm) {
    MPI_Comm dup = MPI_COMM_NULL;
    // The user's handler decides what a failure here does: we have not touched it.
    detail::mpi_check(MPI_Comm_dup(comm, &dup), "MPI_Comm_dup", __FILE__, __LINE__);
    return BasicMpiCommunicator(std::make_shared<detail::MpiCommState>(dup, true, comm_timeout_from_env()),
                                std::make_shared<CommStats>(), std::make_shared<FailureLatch>());
  }

  /// The wrapped MPI communicator (e.g. for the user's own collectives).
  MPI_Comm native() const { return state_->comm(); }
  /// This rank.
  int rank() const { return rank_; }
  /// Ranks in the group.
  int size() const { return size_; }
  /// Counters (shared with communicators split from this one).
  const CommStats& stats() const { return *stats_; }
  /// Counters, mutable (to reset them).
  CommStats& stats() { return *stats_; }
  /// The time-out of every wait; zero: none (see the class comment).
  std::chrono::milliseconds timeout() const { return state_->timeout(); }
  /// Sets the time-out of every wait, for every copy of this communicator; zero: none.
  void set_timeout(std::chrono::milliseconds t) {
    SEQPAR_CHECK(t.count() >= 0, ConfigError, "MpiCommunicator: set_timeout: expected >= 0 ms, got ", t.count());
    state_->set_timeout(t);
  }
  /// Sets this rank's failure latch (shared with copies and splits; the first reason stays):
  /// every later operation throws CommError (see the class comment).
  void fail(std::string_view reason) noexcept { latch_->set(reason); }
  /// True once the failure latch is set.
  bool failed() const noexcept { return latch_->failed(); }
  /// The reason the latch was set with first ("" while it is not set).
  std::string failure_reason() const { return latch_->reason(); }

  /// Variable-count all-to-all over MPI_Alltoallv (see the Communicator concept).
  void all_to_all_v(const std::byte* send, std::span<const std::size_t> send_counts,
                    std::span<const std::size_t> send_displs, std::byte* recv,
                    std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    refuse_if_failed("all_to_all_v");
    const auto n = static_cast<std::size_t>(size_);
    detail::check_all_to_all_spans("MpiCommunicator", n, send_counts.size(), send_displs.size(), recv_counts.size(),
                                   recv_displs.size());
    // Each side picks its own unit: MPI matches type signatures, which for contiguous bytes
    // only means equal byte totals per pair.
    const std::size_t su = detail::mpi_unit_bytes(send_counts, send_displs);
    const std::size_t ru = detail::mpi_unit_bytes(recv_counts, recv_displs);
    std::vector<int>& ints = ints_;
    ints.resize(4 * n);
    for (std::size_t j = 0; j < n; ++j) {
      ints[j] = detail::mpi_count(send_counts[j], su, "all_to_all_v send count");
      ints[n + j] = detail::mpi_count(send_displs[j], su, "all_to_all_v send displacement");
      ints[2 * n + j] = detail::mpi_count(recv_counts[j], ru, "all_to_all_v receive count");
      ints[3 * n + j] = detail::mpi_count(recv_displs[j], ru, "all_to_all_v receive displacement");
    }
    latch_->latch_on_failure([&] {
      if (timeout().count() > 0) {
        MPI_Request req = MPI_REQUEST_NULL;
        SEQPAR_MPI_CHECK(MPI_Ialltoallv(send, ints.data(), ints.data() + n, state_->unit_type(su), recv,
                                        ints.data() + 2 * n, ints.data() + 3 * n, state_->unit_type(ru), native(),
                                        &req));
        poll_collective(req, "all_to_all_v", "MPI_Ialltoallv");
      } else {
        SEQPAR_MPI_CHECK(MPI_Alltoallv(send, ints.data(), ints.data() + n, state_->unit_type(su), recv,
                                       ints.data() + 2 * n, ints.data() + 3 * n, state_->unit_type(ru), native()));
      }
    });
    stats_->count_all_to_all(send_counts, rank_);
  }

  /// Starts receiving `recv_bytes` from `source` and sending `send_bytes` to `dest`
  /// (MPI_Irecv + MPI_Isend), both with the MPI tag of call tag `tag` (see the class
  /// comment; untagged_exchange: 0x5eb). The buffers must stay untouched until wait() returns.
  request_type start_exchange(const std::byte* send, std::size_t send_bytes, int dest, std::byte* recv,
                              std::size_t recv_bytes, int source, std::uint64_t tag = untagged_exchange) {
    refuse_if_failed("exchange");
    check_rank(dest, "dest");
    check_rank(source, "source");
    request_type req;
    req.recv_bytes = recv_bytes;
    req.source = source;
    req.dest = dest;
    req.tag = mpi_tag(tag);
    const std::size_t ru = detail::mpi_unit_bytes(std::span<const std::size_t>(&recv_bytes, 1));
    const std::size_t su = detail::mpi_unit_bytes(std::span<const std::size_t>(&send_bytes, 1));
    const int rn = detail::mpi_count(recv_bytes, ru, "exchange receive");
    const int sn = detail::mpi_count(send_bytes, su, "exchange send");
    latch_->latch_on_failure([&] {
      req.recv_type = state_->unit_type(ru);
      SEQPAR_MPI_CHECK(MPI_Irecv(recv, rn, req.recv_type, source, req.tag, native(), &req.requests[0]));
      // On failure the request's destructor withdraws the receive from the caller's buffer.
      SEQPAR_MPI_CHECK(MPI_Isend(send, sn, state_->unit_type(su), dest, req.tag, native(), &req.requests[1]));
    });
    stats_->count_exchange(send_bytes, dest != rank_);
    return req;
  }

  /// Completes both halves of an exchange (MPI_Waitall; with a time-out, MPI_Testall polled).
  /// Throws MpiError if MPI reports a failure (e.g. the peer sent more than expected),
  /// CommError if it sent fewer bytes, CommError naming the peer on a time-out, and, with a
  /// time-out, CommError naming "a message of another call" when one stands in front of ours.
  void wait(request_type& req) {
    refuse_if_failed("exchange");
    if (req.complete) return;  // test() finished and checked it
    latch_->latch_on_failure([&] {
      std::array<MPI_Status, 2> status{};
      if (timeout().count() == 0) {
        finish(req, MPI_Waitall(2, req.requests.data(), status.data()), status, "MPI_Waitall");
        return;
      }
      int flag = 0, rc = MPI_SUCCESS;
      StrayWatch stray;
      if (poll([&] {
            return (rc = MPI_Testall(2, req.requests.data(), &flag, status.data())) != MPI_SUCCESS || flag ||
                   stray.seen(*this, req);
          }) &&
          (rc != MPI_SUCCESS || flag)) {
        finish(req, rc, status, "MPI_Testall");
        return;
      }
      // Which half is stuck: the receive (the source never sent) or the send (dest never received).
      int received = 0;
      MPI_Request_get_status(req.requests[0], &received, MPI_STATUS_IGNORE);
      // The receive can still be withdrawn; the send stays with MPI (see the class comment).
      if (!received) {
        MPI_Cancel(&req.requests[0]);
        MPI_Request_free(&req.requests[0]);
      }
      if (stray.found)
        detail::throw_error<CommError>(__FILE__, __LINE__, "MpiCommunicator: exchange: rank ", req.source,
                                       " sent a message of another call (", describe_mpi_tag(stray.tag), ") to rank ",
                                       rank_, ", which waits for one of ", describe_mpi_tag(req.tag),
                                       ": a rank went on after a call failed on it, or the ranks' calls differ; the "
                                       "operation cannot be cancelled: end the job (MPI_Abort)");
      const std::string peer = received ? "for rank " + std::to_string(req.dest) + " to receive our message"
                                        : "for rank " + std::to_string(req.source) + " to send";
      timed_out("exchange", " (waiting " + peer + ")");
    });
  }

  /// Lets MPI move the exchange's bytes without blocking (MPI_Testall) and returns true once
  /// both halves are done; wait() must still be called, and returns at once then. Open MPI
  /// moves a large (rendezvous) message only inside MPI calls, so the ring calls this
  /// between chunks of its compute: without it the whole transfer happens in wait().
  bool test(request_type& req) {
    refuse_if_failed("exchange (test)");
    if (req.complete) return true;
    return latch_->latch_on_failure([&] {
      int flag = 0;
      std::array<MPI_Status, 2> status{};
      const int rc = MPI_Testall(2, req.requests.data(), &flag, status.data());
      if (rc == MPI_SUCCESS && !flag) return false;
      finish(req, rc, status, "MPI_Testall");
      return true;
    });
  }
  /// Metadata all-gather of host integers (MPI_Allgather of int64; every rank gives the same count).
  void all_gather_host(std::span<const std::int64_t> mine, std::span<std::int64_t> all) {
    refuse_if_failed("all_gather_host");
    SEQPAR_CHECK(all.size() == mine.size() * static_cast<std::size_t>(size_), ConfigError,
                 "MpiCommunicator: all_gather_host: output size: expected ", mine.size() * size_, ", got ",
                 all.size());
    const int n = detail::mpi_count(mine.size() * sizeof(std::int64_t), sizeof(std::int64_t), "all_gather_host");
    latch_->latch_on_failure([&] {
      if (timeout().count() > 0) {
        MPI_Request req = MPI_REQUEST_NULL;
        SEQPAR_MPI_CHECK(MPI_Iallgather(mine.data(), n, MPI_INT64_T, all.data(), n, MPI_INT64_T, native(), &req));
        poll_collective(req, "all_gather_host", "MPI_Iallgather");
      } else {
        SEQPAR_MPI_CHECK(MPI_Allgather(mine.data(), n, MPI_INT64_T, all.data(), n, MPI_INT64_T, native()));
      }
    });
    stats_->count_host_gather();
  }

  /// Blocks until every rank of the group arrives (MPI_Barrier; with a time-out, MPI_Ibarrier polled).
  void barrier() {
    refuse_if_failed("barrier");
    latch_->latch_on_failure([&] {
      if (timeout().count() == 0) {
        SEQPAR_MPI_CHECK(MPI_Barrier(native()));
        return;
      }
      MPI_Request req = MPI_REQUEST_NULL;
      SEQPAR_MPI_CHECK(MPI_Ibarrier(native(), &req));
      poll_collective(req, "barrier", "MPI_Ibarrier");
    });
  }

  /// Splits into one communicator per color, ranked by key (MPI_Comm_split; collective).
  /// The result owns its MPI communicator and shares this one's stats and failure latch.
  BasicMpiCommunicator split(int color, int key) {
    refuse_if_failed("split");
    SEQPAR_CHECK(color >= 0, ConfigError, "MpiCommunicator: split: color: expected >= 0, got ", color);
    MPI_Comm out = MPI_COMM_NULL;
    latch_->latch_on_failure([&] { SEQPAR_MPI_CHECK(MPI_Comm_split(native(), color, key, &out)); });
    return BasicMpiCommunicator(std::make_shared<detail::MpiCommState>(out, true, timeout()), stats_, latch_);
  }

 private:
  /// The MPI tag of untagged exchanges (the six-argument start_exchange).
  static constexpr int untagged_mpi_tag = 0x5eb;
  /// The first MPI tag of tagged exchanges; they use [first_call_mpi_tag, MPI_TAG_UB].
  static constexpr int first_call_mpi_tag = 0x800;
  /// How long a message of another call may stand in front of the awaited one before wait()
  /// names it: a quarter of the time-out, at most 500 ms. A later call's message can stand
  /// there legitimately for a moment: once MPI has matched ours to its receive (a large message
  /// still arriving), a probe sees the next one.
  std::chrono::milliseconds stray_grace() const {
    return std::min(std::chrono::milliseconds(500), timeout() / 4);
  }

  /// How many call tags MPI tags can tell apart: a multiple of 4, so the kind survives.
  std::uint64_t call_tag_span() const {
    return (static_cast<std::uint64_t>(state_->tag_ub()) - first_call_mpi_tag + 1) / 4 * 4;
  }
  /// The MPI tag of call tag `tag`.
  int mpi_tag(std::uint64_t tag) const {
    if (tag == untagged_exchange) return untagged_mpi_tag;
    return first_call_mpi_tag + static_cast<int>(tag % call_tag_span());
  }
  /// True for the MPI tags exchanges use (messages of users' own tags are not ours to judge).
  static bool is_exchange_tag(int t) { return t == untagged_mpi_tag || t >= first_call_mpi_tag; }
  /// An MPI exchange tag as the call it stands for.
  std::string describe_mpi_tag(int t) const {
    if (t == untagged_mpi_tag) return describe_call_tag(untagged_exchange);
    return describe_call_tag(static_cast<std::uint64_t>(t - first_call_mpi_tag), call_tag_span() / 4);
  }

  /// Watches, while wait() polls, for a message from the request's source that carries
  /// another exchange tag and stays in front of the awaited one (MPI_Iprobe).
  struct StrayWatch {
    bool found = false;     ///< seen for stray_grace(): wait() throws
    int tag = 0;            ///< its MPI tag
    bool watching = false;  ///< one is in front now
    std::chrono::steady_clock::time_point since{};  ///< when it was first seen there
    /// True once such a message has stood there for stray_grace().
    bool seen(const BasicMpiCommunicator& c, request_type& req) {
      int received = 0, there = 0;
      MPI_Status st{};
      if (MPI_Request_get_status(req.requests[0], &received, MPI_STATUS_IGNORE) != MPI_SUCCESS || received ||
          MPI_Iprobe(req.source, MPI_ANY_TAG, c.native(), &there, &st) != MPI_SUCCESS || !there ||
          st.MPI_TAG == req.tag || !is_exchange_tag(st.MPI_TAG)) {
        watching = false;
        return false;
      }
      const auto now = std::chrono::steady_clock::now();
      if (!watching || st.MPI_TAG != tag) {
        watching = true;
        tag = st.MPI_TAG;
        since = now;
      }
      found = now - since >= c.stray_grace();
      return found;
    }
  };

  BasicMpiCommunicator(std::shared_ptr<detail::MpiCommState> state, std::shared_ptr<CommStats> stats,
                       std::shared_ptr<FailureLatch> latch)
      : state_(std::move(state)), stats_(std::move(stats)), latch_(std::move(latch)) {
    SEQPAR_CHECK(state_->comm() != MPI_COMM_NULL, ConfigError, "MpiCommunicator: comm: expected a communicator, got MPI_COMM_NULL");
    SEQPAR_MPI_CHECK(MPI_Comm_set_errhandler(state_->comm(), MPI_ERRORS_RETURN));
    SEQPAR_MPI_CHECK(MPI_Comm_rank(state_->comm(), &rank_));
    SEQPAR_MPI_CHECK(MPI_Comm_size(state_->comm(), &size_));
    ints_.reserve(4 * static_cast<std::size_t>(size_));  // so that no all-to-all allocates, not even the first
  }

  /// Checks a completed exchange's status (the return code of MPI_Waitall or MPI_Testall) and
  /// the received byte count, then marks it complete.
  void finish(request_type& req, int rc, std::array<MPI_Status, 2>& status, const char* call) const {
    if (rc == MPI_ERR_IN_STATUS) {
      for (int i = 0; i < 2; ++i)
        if (status[static_cast<std::size_t>(i)].MPI_ERROR != MPI_SUCCESS &&
            status[static_cast<std::size_t>(i)].MPI_ERROR != MPI_ERR_PENDING)
          detail::mpi_check(status[static_cast<std::size_t>(i)].MPI_ERROR,
                            (std::string(call) + (i == 0 ? "(receive from source)" : "(send to dest)")).c_str(),
                            __FILE__, __LINE__);
    }
    detail::mpi_check(rc, call, __FILE__, __LINE__);
    MPI_Count got = 0;
    SEQPAR_MPI_CHECK(MPI_Get_elements_x(&status[0], req.recv_type, &got));
    SEQPAR_CHECK(got == static_cast<MPI_Count>(req.recv_bytes), CommError, "MpiCommunicator: exchange: rank ",
                 req.source, " sent ", got, " bytes to rank ", rank_, ", which expects ", req.recv_bytes);
    req.complete = true;
  }

  /// Calls `done()` (true: finished, or an MPI error to report) until it says so or the
  /// time-out passes, with poll_until's back-off (core/poll.hpp); returns whether it finished.
  template <class Done>
  bool poll(Done done) const {
    using Clock = std::chrono::steady_clock;
    return poll_until(done, saturating_deadline<Clock>(Clock::now(), timeout()));  // huge time-out: never
  }

  /// Completes a nonblocking collective `call` by polling it; on time-out throws CommError.
  void poll_collective(MPI_Request& req, const char* what, const char* call) const {
    int flag = 0, rc = MPI_SUCCESS;
    if (poll([&] { return (rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE)) != MPI_SUCCESS || flag; })) {
      detail::mpi_check(rc, call, __FILE__, __LINE__);
      return;
    }
    timed_out(what, " (a peer has not joined it: it failed, finalized, or waits in another operation)");
  }

  /// Throws the time-out CommError of operation `what`; `peer` says whom it waited for.
  [[noreturn]] void timed_out(const char* what, const std::string& peer) const {
    detail::throw_error<CommError>(__FILE__, __LINE__, "MpiCommunicator: ", what, ": no progress for ", timeout().count(),
                           " ms", peer, " on rank ", rank_, " of ", size_,
                           "; the operation cannot be cancelled: end the job (MPI_Abort)");
  }

  void check_rank(int r, const char* name) const {
    SEQPAR_CHECK(r >= 0 && r < size_, ConfigError, "MpiCommunicator: ", name, ": expected a rank in [0, ", size_,
                 "), got ", r);
  }

  /// Throws the latch's CommError for operation `what` once the latch is set.
  void refuse_if_failed(const char* what) const {
    if (latch_->failed())
      latch_->refuse("MpiCommunicator", what,
                     "its peers may still wait in it; end the job (MPI_Abort) or make new communicators on every rank");
  }

  std::shared_ptr<detail::MpiCommState> state_;
  std::shared_ptr<CommStats> stats_;
  std::shared_ptr<FailureLatch> latch_;
  std::vector<int> ints_;  // MPI int counts of an all-to-all, sized when the communicator is made
  int rank_ = 0;
  int size_ = 1;
};

/// MPI over host memory.
using MpiCommunicator = BasicMpiCommunicator<HostSpace>;

static_assert(Communicator<MpiCommunicator>);

/// RAII for MPI_Init_thread / MPI_Finalize, for programs that own MPI's lifetime. If MPI is
/// already initialised it does nothing, and it finalises only what it initialised. Destroy
/// every MpiCommunicator first (declare the session before them).
class MpiSession {
 public:
  /// Initialises MPI with at least MPI_THREAD_FUNNELED (only the main thread calls MPI).
  MpiSession(int& argc, char**& argv) {
    int ready = 0;
    MPI_Initialized(&ready);
    if (ready) return;
    int provided = 0;
    const int rc = MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    SEQPAR_CHECK(rc == MPI_SUCCESS, MpiError, "MPI_Init_thread failed with error ", rc);
    owner_ = true;
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  /// Finalises MPI if this session initialised it.
  ~MpiSession() {
    if (owner_ && !detail::mpi_finalized()) MPI_Finalize();
  }

 private:
  bool owner_ = false;
};

}  // namespace seqpar
