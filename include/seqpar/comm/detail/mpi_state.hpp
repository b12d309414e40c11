#pragma once
/// \file
/// The MPI plumbing under MpiCommunicator: error checks, count units for messages above 2 GiB,
/// and the handle state shared by copies of one communicator. Needs MPI.

#include <mpi.h>

#include <array>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "seqpar/core/error.hpp"

/// Calls an MPI function and throws seqpar::MpiError naming the call and MPI's error string
/// when it does not return MPI_SUCCESS. Only meaningful on communicators whose error handler
/// is MPI_ERRORS_RETURN (MpiCommunicator sets it on its own).
#define SEQPAR_MPI_CHECK(call) ::seqpar::detail::mpi_check((call), #call, __FILE__, __LINE__)

namespace seqpar {

namespace detail {

/// Throws MpiError for an MPI error code; the message names the call and MPI_Error_string.
inline void mpi_check(int rc, const char* call, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  const std::string text_call(call);
  const std::string name = text_call.substr(0, text_call.find('('));
  int error_class = MPI_SUCCESS;
  if (MPI_Error_class(rc, &error_class) != MPI_SUCCESS) error_class = MPI_SUCCESS;
  // A message longer than its receive: in seqpar, ranks whose calls move different sizes.
  const char* hint = error_class == MPI_ERR_TRUNCATE
                         ? " (a message longer than its receive: the ranks' calls move different sizes: different "
                           "calls, different plans in one call, or different decode batches in one step? With "
                           "SEQPAR_CHECK_CALLS=1 attention calls check their plans before any data moves)"
                         : "";
  throw_error<MpiError>(file, line, name, " failed with error ", rc, ": ",
                        len > 0 ? std::string(text, static_cast<std::size_t>(len)) : std::string("(no MPI error string)"),
                        hint);
}

/// The largest power of two <= 256 that divides every value: MPI counts are `int`, so
/// byte counts above 2 GiB are sent in units of a contiguous datatype of this many bytes.
template <class... Spans>
std::size_t mpi_unit_bytes(const Spans&... spans) {
  std::size_t unit = 256;
  auto shrink = [&](std::size_t v) {
    while (unit > 1 && v % unit != 0) unit /= 2;
  };
  (..., [&] {
    for (std::size_t v : spans) shrink(v);
  }());
  return unit;
}

/// `bytes / unit` as an MPI int count; throws MpiError naming `what` when it does not fit.
inline int mpi_count(std::size_t bytes, std::size_t unit, const char* what) {
  const std::size_t n = bytes / unit;
  SEQPAR_CHECK(n <= static_cast<std::size_t>(INT_MAX), MpiError, "MpiCommunicator: ", what, ": ", bytes,
               " bytes in units of ", unit, " bytes is ", n, " elements, more than an MPI int count (", INT_MAX,
               ") can express; send smaller pieces or sizes divisible by a larger power of two");
  return static_cast<int>(n);
}

/// True once MPI_Finalize has run: handles freed after it would be an error, so destructors
/// check this first.
inline bool mpi_finalized() {
  int done = 0;
  MPI_Finalized(&done);
  return done != 0;
}

/// The receive and the send request of one exchange, owned. Moving one leaves the source
/// empty. Destroying one still active (its rank unwinds from a failed call) withdraws the
/// receive (MPI_Cancel), so that a peer's message of the abandoned call does not land in a
/// buffer being freed, and lets go of the send (MPI_Request_free: MPI completes it on its own,
/// and may read its buffer until then).
class MpiExchangeRequests {
 public:
  /// No requests.
  MpiExchangeRequests() = default;
  /// Takes over `o`'s requests.
  MpiExchangeRequests(MpiExchangeRequests&& o) noexcept : r_(std::exchange(o.r_, none())) {}
  /// Trades requests with `o`: ours are let go of when `o` is destroyed.
  MpiExchangeRequests& operator=(MpiExchangeRequests&& o) noexcept {
    std::swap(r_, o.r_);
    return *this;
  }
  /// Withdraws an active receive and lets go of an active send (see the class comment).
  ~MpiExchangeRequests() { release(); }

  /// Request i: 0 the receive, 1 the send.
  MPI_Request& operator[](std::size_t i) { return r_[i]; }
  /// Both, for MPI_Waitall and MPI_Testall.
  MPI_Request* data() { return r_.data(); }

 private:
  static std::array<MPI_Request, 2> none() { return {MPI_REQUEST_NULL, MPI_REQUEST_NULL}; }
  void release() noexcept {
    if (r_ == none() || mpi_finalized()) return;  // nothing active, or MPI released it all
    if (r_[0] != MPI_REQUEST_NULL) {
      MPI_Cancel(&r_[0]);
      MPI_Request_free(&r_[0]);
    }
    if (r_[1] != MPI_REQUEST_NULL) MPI_Request_free(&r_[1]);
  }
  std::array<MPI_Request, 2> r_ = none();
};

/// The communicator handle, the datatypes made for it and the time-out, shared by every copy
/// of one MpiCommunicator (not by its splits, which own their own handle).
class MpiCommState {
 public:
  /// Holds `comm`; frees it at the end when `owned`.
  MpiCommState(MPI_Comm comm, bool owned, std::chrono::milliseconds timeout)
      : comm_(comm), owned_(owned), timeout_(timeout) {
    if (comm_ == MPI_COMM_NULL) return;  // refused by the communicator's constructor
    // MPI_TAG_UB is at least 32767; MPI attaches it to MPI_COMM_WORLD (most also to every
    // communicator).
    for (MPI_Comm c : {comm_, MPI_COMM_WORLD}) {
      int* value = nullptr;
      int found = 0;
      if (MPI_Comm_get_attr(c, MPI_TAG_UB, &value, &found) == MPI_SUCCESS && found && value && *value >= 32767) {
        tag_ub_ = *value;
        break;
      }
    }
  }
  MpiCommState(const MpiCommState&) = delete;
  MpiCommState& operator=(const MpiCommState&) = delete;
  /// Frees the datatypes and, if owned, the communicator.
  ~MpiCommState() {
    if (mpi_finalized()) return;  // too late to free anything; MPI has released it all
    for (MPI_Datatype& t : types_)
      if (t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
    if (owned_ && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  /// The MPI communicator.
  MPI_Comm comm() const { return comm_; }
  /// The time-out of every wait (zero: none).
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// Sets the time-out of every wait (zero: none).
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }
  /// The largest tag MPI accepts on this communicator (MPI_TAG_UB, at least 32767).
  int tag_ub() const { return tag_ub_; }

  /// A committed contiguous datatype of `unit` bytes (a power of two <= 256), made on first use.
  MPI_Datatype unit_type(std::size_t unit) {
    if (unit == 1) return MPI_BYTE;
    int slot = 0;
    while ((std::size_t{1} << slot) < unit) ++slot;
    MPI_Datatype& t = types_[static_cast<std::size_t>(slot)];
    if (t == MPI_DATATYPE_NULL) {
      MPI_Datatype made = MPI_DATATYPE_NULL;
      SEQPAR_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(unit), MPI_BYTE, &made));
      const int rc = MPI_Type_commit(&made);
      if (rc != MPI_SUCCESS) MPI_Type_free(&made);
      mpi_check(rc, "MPI_Type_commit", __FILE__, __LINE__);
      t = made;
    }
    return t;
  }

 private:
  MPI_Comm comm_;
  bool owned_;
  std::chrono::milliseconds timeout_;
  int tag_ub_ = 32767;
  std::array<MPI_Datatype, 9> types_{MPI_DATATYPE_NULL, MPI_DATATYPE_NULL, MPI_DATATYPE_NULL,
                                     MPI_DATATYPE_NULL, MPI_DATATYPE_NULL, MPI_DATATYPE_NULL,
                                     MPI_DATATYPE_NULL, MPI_DATATYPE_NULL, MPI_DATATYPE_NULL};
};

}  // namespace detail

}  // namespace seqpar
