#pragma once
/// \file
/// What every phase of the engine shares: the world and the mesh's two sub-communicators, the
/// tensor operations between kernel calls (on CUDA they carry the stream) and the phase clock
/// of an optional PhaseProfile.

#include <utility>

#include "seqpar/core/mesh.hpp"
#include "seqpar/core/profile.hpp"
#include "seqpar/kernel/host_ops.hpp"

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
  Pass pass = Pass::forward;                      ///< the call being timed
  PhaseClock::time_point call_start{}, mark{};    ///< start of the call, end of the last lap

  /// Starts timing a call of `p` (a no-op without a profile).
  void start_call(Pass p) {
    pass = p;
    mark = call_start = clock.now();
  }
  /// Charges the time since the last lap to `phase` at ring step `step`.
  void lap(Phase phase, int step = 0) { mark = clock.lap(mark, pass, phase, step); }
  /// Ends the call's timing.
  void end_call() { clock.call(call_start, pass); }
};

}  // namespace seqpar::detail
