#pragma once
// Test support for faults in the middle of a call: a kernel whose next backward call throws
// when asked to (tests/test_call_isolation.cpp on threads, tests/mpi_faults under MPI).

#include <stdexcept>

#include "seqpar/seqpar.hpp"

namespace seqpar::test {

/// `Base` (a host kernel) whose next backward call throws once `fail_backward` is set: a fault
/// while the ring or the all-to-alls of backward are under way.
template <class Base>
struct BackwardFaultKernel : Base {
  bool fail_backward = false;  ///< the next backward kernel call throws (once)
  /// Base::backward, or the fault.
  template <class T>
  void backward(TensorView<const T> dout, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                TensorView<const T> out, TensorView<const acc_t<T>> lse, TensorView<acc_t<T>> dq,
                TensorView<acc_t<T>> dk, TensorView<acc_t<T>> dv, const KernelParams& p) {
    if (fail_backward) {
      fail_backward = false;
      throw std::runtime_error("backward kernel fault on purpose");
    }
    Base::backward(dout, q, k, v, out, lse, dq, dk, dv, p);
  }
};

}  // namespace seqpar::test
