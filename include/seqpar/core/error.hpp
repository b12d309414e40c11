#pragma once
/// \file
/// Error types and the host-side check macros. Every message names what was wrong, the
/// expected and the actual value where there is one, and the file:line of the check.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace seqpar {

/// Base of every exception seqpar throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Misuse: bad shapes, degrees, views, workspace, or ranks that disagree on a plan.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A communicator failed, timed out, or a peer rank failed.
class CommError : public Error {
 public:
  using Error::Error;
};

/// Thrown on a rank that was blocked in a communicator when another rank failed; the helper
/// that runs ranks prefers to rethrow the original failure over these.
class CommAborted : public CommError {
 public:
  using CommError::CommError;
};

/// An MPI call returned an error code.
class MpiError : public CommError {
 public:
  using CommError::CommError;
};

/// An NCCL call returned an error code.
class NcclError : public CommError {
 public:
  using CommError::CommError;
};

/// A CUDA runtime call returned an error code.
class CudaError : public Error {
 public:
  using Error::Error;
};

namespace detail {

/// Concatenates the parts with operator<< and appends " (at file:line)".
template <class... Parts>
std::string format_message(const char* file, int line, const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  os << " (at " << file << ':' << line << ')';
  return os.str();
}

template <class ErrorT, class... Parts>
[[noreturn]] void throw_error(const char* file, int line, const Parts&... parts) {
  throw ErrorT(format_message(file, line, parts...));
}

}  // namespace detail
}  // namespace seqpar

/// Throws `ErrorT` with the streamed message parts when `cond` is false.
#define SEQPAR_CHECK(cond, ErrorT, ...)                                   \
  do {                                                                    \
    if (!(cond)) ::seqpar::detail::throw_error<ErrorT>(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

/// Throws `ConfigError` naming the argument, the expected and the actual value.
#define SEQPAR_CHECK_ARG(cond, name, expected, actual)                                \
  SEQPAR_CHECK(cond, ::seqpar::ConfigError, name, ": expected ", expected, ", got ", actual)

/// Throws `ErrorT` unconditionally with the streamed message parts.
#define SEQPAR_THROW(ErrorT, ...) ::seqpar::detail::throw_error<ErrorT>(__FILE__, __LINE__, __VA_ARGS__)
