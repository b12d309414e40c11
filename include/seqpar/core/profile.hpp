#pragma once
/// \file
/// PhaseProfile: where a forward or backward call spends its time outside the local kernel.
/// Off by default; SequenceParallelAttention::set_profile turns it on. Storage is fixed-size
/// (no allocation while recording) and the clock is read only while a profile is set, so a
/// build that never sets one pays a pointer test per phase.
///
/// Times are host wall-clock (steady_clock). On a device communicator they measure what the
/// host waits for, not what the device runs: the engine adds no synchronisation to time a phase.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>

namespace seqpar {

/// The phases of a call, in the order they run.
enum class Phase : std::uint8_t {
  pack,            ///< copies into send or ring buffers (and zeroing accumulators)
  all_to_all_in,   ///< Ulysses all-to-all of the inputs (Q, K, V; backward also dO, O, LSE)
  compute,         ///< the local kernel; per ring step
  merge,           ///< folding a step's partial result into the running one (LSE merge, dK/dV sum); per step
  wait,            ///< blocked on a ring hop after the step's compute: the transfer not hidden; per step
  finish,          ///< copying the running result (accumulation type) into the output or send buffer
  all_to_all_out,  ///< Ulysses all-to-all of the results (O and LSE; backward dQ, dK, dV)
  unpack,          ///< copies from receive buffers into the caller's tensors (and shared K/V heads' sums)
  count            ///< number of phases (not a phase)
};

/// Short name of a phase, for tables.
constexpr const char* phase_name(Phase p) {
  constexpr const char* names[] = {"pack", "a2a_in", "compute", "merge", "wait", "finish", "a2a_out", "unpack"};
  return p < Phase::count ? names[static_cast<int>(p)] : "?";
}

/// Which call a record belongs to.
enum class Pass : std::uint8_t {
  forward,   ///< SequenceParallelAttention::forward
  backward,  ///< SequenceParallelAttention::backward
  count      ///< number of passes (not a pass)
};

/// Time per (pass, phase, ring step), summed over every call since the last reset, plus each
/// call's total and each ring hop's time in flight. Set one on SequenceParallelAttention
/// (set_profile) to fill it; read it between calls.
///
/// Ring hops: a hop starts before a step's compute and must end before the next step. Its
/// time in flight runs from its start to the moment it was seen complete (by a progress
/// poll between compute chunks, or by the wait); the wait is the part the compute did not
/// hide. hidden_share() is (in flight - wait) / in flight over all hops: a transport that
/// only moves bytes inside the wait still shows a high share when its wait is short
/// against the compute, which is the cost that matters; compare the wait with bytes over
/// bandwidth to see whether the bytes moved during the compute.
class PhaseProfile {
 public:
  /// Ring steps kept apart; later steps add into the last slot.
  static constexpr int max_steps = 32;

  /// Forgets everything recorded.
  void reset() { *this = PhaseProfile{}; }

  /// Adds `ms` to (pass, phase, step); phases that are not per step use step 0.
  void add(Pass pass, Phase phase, int step, double ms) {
    const int s = slot(step);
    ms_[index(pass)][static_cast<int>(phase)][s] += ms;
    steps_[index(pass)] = std::max(steps_[index(pass)], s + 1);
  }
  /// Adds one ring hop's time in flight (start to completion seen) at `step`.
  void add_hop(Pass pass, int step, double in_flight_ms) { hop_ms_[index(pass)][slot(step)] += in_flight_ms; }
  /// Counts one whole call of `pass` that took `ms`.
  void add_call(Pass pass, double ms) {
    total_ms_[index(pass)] += ms;
    ++calls_[index(pass)];
  }

  /// Calls of `pass` recorded.
  int calls(Pass pass) const { return calls_[index(pass)]; }
  /// Ring steps recorded for `pass` (1 without a ring; at most max_steps).
  int steps(Pass pass) const { return steps_[index(pass)]; }
  /// Total time of the calls of `pass`, in ms.
  double total_ms(Pass pass) const { return total_ms_[index(pass)]; }
  /// Time of `phase` at ring step `step` (for phases that are not per step, step 0), in ms.
  double ms(Pass pass, Phase phase, int step) const { return ms_[index(pass)][static_cast<int>(phase)][slot(step)]; }
  /// Time of `phase` over every step, in ms.
  double ms(Pass pass, Phase phase) const {
    double t = 0;
    for (double x : ms_[index(pass)][static_cast<int>(phase)]) t += x;
    return t;
  }
  /// Time of all phases together, in ms; total_ms() minus this is argument checks and set-up.
  double phases_ms(Pass pass) const {
    double t = 0;
    for (int p = 0; p < static_cast<int>(Phase::count); ++p) t += ms(pass, static_cast<Phase>(p));
    return t;
  }
  /// Time in flight of the ring hops started at `step`, in ms.
  double hop_ms(Pass pass, int step) const { return hop_ms_[index(pass)][slot(step)]; }
  /// Share of the ring hops' time in flight that overlapped compute (see the class comment);
  /// 0 without ring hops.
  double hidden_share(Pass pass) const {
    double flight = 0;
    for (double x : hop_ms_[index(pass)]) flight += x;
    return flight > 0 ? std::clamp((flight - ms(pass, Phase::wait)) / flight, 0.0, 1.0) : 0.0;
  }

 private:
  static constexpr int index(Pass p) { return static_cast<int>(p); }
  static constexpr int slot(int step) { return std::clamp(step, 0, max_steps - 1); }

  using Steps = std::array<double, max_steps>;
  std::array<std::array<Steps, static_cast<int>(Phase::count)>, static_cast<int>(Pass::count)> ms_{};
  std::array<Steps, static_cast<int>(Pass::count)> hop_ms_{};
  std::array<double, static_cast<int>(Pass::count)> total_ms_{};
  std::array<int, static_cast<int>(Pass::count)> calls_{};
  std::array<int, static_cast<int>(Pass::count)> steps_{};
};

namespace detail {

/// The engine's stopwatch over an optional PhaseProfile: reads the clock only when one is set.
class PhaseClock {
 public:
  using time_point = std::chrono::steady_clock::time_point;

  /// Records into `profile` from now on (nullptr: off).
  void set(PhaseProfile* profile) { profile_ = profile; }
  /// The profile in use, or nullptr.
  PhaseProfile* get() const { return profile_; }

  /// Now, or a zero time point when off.
  time_point now() const { return profile_ ? std::chrono::steady_clock::now() : time_point{}; }
  /// Adds the time since `since` to (pass, phase, step) and returns now (the next phase's start).
  time_point lap(time_point since, Pass pass, Phase phase, int step = 0) const {
    if (!profile_) return since;
    const time_point t = std::chrono::steady_clock::now();
    profile_->add(pass, phase, step, ms(since, t));
    return t;
  }
  /// Adds a ring hop's time in flight, from `started` to `done`.
  void hop(Pass pass, int step, time_point started, time_point done) const {
    if (profile_) profile_->add_hop(pass, step, ms(started, done));
  }
  /// Counts a call that started at `since`.
  void call(time_point since, Pass pass) const {
    if (profile_) profile_->add_call(pass, ms(since, std::chrono::steady_clock::now()));
  }

  static double ms(time_point a, time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

 private:
  PhaseProfile* profile_ = nullptr;
};

}  // namespace detail

}  // namespace seqpar
