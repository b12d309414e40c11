#pragma once
/// \file
/// What every phase of the engine shares: the world and the mesh's two sub-communicators, the
/// tensor operations between kernel calls (on CUDA they carry the stream), the phase clock
/// of an optional PhaseProfile, and the call counter whose tag every ring exchange carries.

#include <cstdint>
#include <utility>

#include "seqpar/comm/communicator.hpp"
#include "seqpar/core/mesh.hpp"
#include "seqpar/core/nvtx.hpp"
#include "seqpar/core/profile.hpp"
#include "seqpar/ops/host_ops.hpp"

namespace seqpar::detail {

/// The communicators, operations and clock of one engine; the phase headers take it by reference.
template <class Comm>
struct EngineContext {
  using Space = typename Comm::memory_space;  ///< where tensors live

  /// Collective: splits `world` into Ulysses groups and rings of the resolved `mesh`.
  EngineContext(Comm& w, const MeshConfig& m)
      : world(w), mesh(m), ulysses(w.split(m.ring_rank(w.rank()), m.ulysses_rank(w.rank()))),
        ring(w.split(m.ulysses_rank(w.rank()), m.ring_rank(w.rank()))) {}

  Comm& world;            ///< the world communicator
  MeshConfig mesh;        ///< the resolved mesh
  Comm ulysses;           ///< this rank's Ulysses group
  Comm ring;              ///< this rank's ring
  TensorOps<Space> ops;   ///< packing, merge, fill
  PhaseClock clock;       ///< times phases when a profile is set
  NvtxRanges nvtx;        ///< NVTX ranges of the call and its phases (nothing without NVTX)
  Pass pass = Pass::forward;                      ///< the call being timed
  PhaseClock::time_point call_start{}, mark{};    ///< start of the call, end of the last lap
  std::uint64_t calls = 0;                        ///< calls committed so far (alike on every rank)
  std::uint64_t tag = untagged_exchange;          ///< the tag of this call's exchanges (call_tag)

  /// The guard start_call returns: it latches the world, the Ulysses group and the ring.
  using Guard = CallGuard<Comm, Comm, Comm>;

  /// Commits a call of `p`, once its local checks passed: numbers it (the tag of its
  /// exchanges), starts its timing (a no-op without a profile) and returns the guard that
  /// latches the communicators if an exception leaves the call from here on (CallGuard).
  [[nodiscard]] Guard start_call(Pass p) {
    pass = p;
    tag = call_tag(p == Pass::forward ? CallKind::forward : CallKind::backward, calls++);
    mark = call_start = clock.now();
    nvtx.begin_call(p, clock.get() != nullptr);
    return Guard(p == Pass::forward ? "an exception left forward after its communication began"
                                    : "an exception left backward after its communication began",
                 world, ulysses, ring);
  }
  /// Marks where the work of `phase` begins, for its NVTX range (the clock needs no start:
  /// a phase runs from the last lap). Without NVTX a no-op.
  void enter(Phase phase, int step = 0) { nvtx.enter(phase, step); }
  /// Charges the time since the last lap to `phase` at ring step `step`.
  void lap(Phase phase, int step = 0) {
    mark = clock.lap(mark, pass, phase, step);
    nvtx.leave();
  }
  /// Ends the call's timing.
  void end_call() {
    clock.call(call_start, pass);
    nvtx.end_call();
  }
};

}  // namespace seqpar::detail
