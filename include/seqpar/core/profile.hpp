#pragma once
/// \file
/// PhaseProfile: where a forward or backward call spends its time outside the local kernel.
/// Off by default; SequenceParallelAttention::set_profile turns it on. Storage is fixed-size
/// (no allocation while recording) and the clock is read only while a profile is set, so a
/// build that never sets one pays a pointer test per phase.
///
/// Times are host wall-clock (steady_clock). On a device communicator they measure what the
/// host waits for, not what the device runs: the engine adds no synchronisation to time a phase.
///
/// Sums say how much; an event log (PhaseProfile::keep_events, opt-in) says when: one event
/// per phase lap, ring hop and call, for a timeline (seqpar/core/trace.hpp writes one).

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

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

/// One timed interval of a call, for a timeline. Times are microseconds since the profile's
/// epoch (keep_events or reset), so that doubles keep sub-nanosecond resolution for hours.
/// Trivially copyable: MPI ranks can gather their events as bytes to write one trace.
struct ProfileEvent {
  /// What the interval is.
  enum class Kind : std::uint8_t {
    phase,  ///< one lap of a phase (its sum is in PhaseProfile::ms)
    hop,    ///< a ring hop in flight, start to completion seen (overlaps the phases; PhaseProfile::hop_ms)
    call    ///< a whole forward or backward call (PhaseProfile::total_ms)
  };
  Kind kind = Kind::phase;      ///< what the interval is
  Pass pass = Pass::forward;    ///< the call it belongs to
  Phase phase = Phase::count;   ///< the phase (Kind::phase only; Phase::count otherwise)
  int step = 0;                 ///< ring step, as the engine gave it (not clamped to max_steps)
  double start_us = 0;          ///< start, in us since the epoch
  double end_us = 0;            ///< end, in us since the epoch
};
static_assert(std::is_trivially_copyable_v<ProfileEvent>);

namespace detail {

/// A fixed-capacity event buffer: reserved once, never grown, so recording never allocates.
/// Copies reserve the same capacity (a plain vector copy would reserve only its size).
class EventBuffer {
 public:
  /// Off: capacity 0.
  EventBuffer() = default;
  /// Same events, same capacity reserved.
  EventBuffer(const EventBuffer& o) : cap_(o.cap_), dropped_(o.dropped_) {
    v_.reserve(cap_);
    v_.assign(o.v_.begin(), o.v_.end());
  }
  /// Takes the buffer; `o` is left off.
  EventBuffer(EventBuffer&& o) noexcept
      : v_(std::move(o.v_)), cap_(std::exchange(o.cap_, 0)), dropped_(std::exchange(o.dropped_, 0)) {}
  /// As the copy constructor.
  EventBuffer& operator=(const EventBuffer& o) {
    if (this != &o) *this = EventBuffer(o);
    return *this;
  }
  /// As the move constructor.
  EventBuffer& operator=(EventBuffer&& o) noexcept {
    v_ = std::move(o.v_);
    cap_ = std::exchange(o.cap_, 0);
    dropped_ = std::exchange(o.dropped_, 0);
    return *this;
  }

  /// Forgets the events and reserves room for `capacity` (0: off, and frees the buffer).
  void set_capacity(std::size_t capacity) {
    if (capacity == 0) v_ = {};
    v_.clear();
    v_.reserve(capacity);
    cap_ = capacity;
    dropped_ = 0;
  }
  /// Forgets the events; keeps the buffer.
  void clear() {
    v_.clear();
    dropped_ = 0;
  }
  /// Keeps `e`, or counts it as dropped when full (never when off).
  void push(const ProfileEvent& e) {
    if (v_.size() < cap_) v_.push_back(e);  // within the reserve: no allocation
    else if (cap_ > 0) ++dropped_;
  }
  /// The most events kept.
  std::size_t capacity() const { return cap_; }
  /// Events not kept for want of room.
  std::uint64_t dropped() const { return dropped_; }
  /// The events kept.
  std::span<const ProfileEvent> events() const { return {v_.data(), v_.size()}; }

 private:
  std::vector<ProfileEvent> v_;
  std::size_t cap_ = 0;
  std::uint64_t dropped_ = 0;
};

}  // namespace detail

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
  /// The clock of the event log and of the engine's laps.
  using clock = std::chrono::steady_clock;

  /// Forgets everything recorded. The event log keeps its capacity (no new allocation) and
  /// restarts its epoch, so a warm-up call can be reset away before the calls to look at.
  void reset() {
    detail::EventBuffer keep = std::move(events_);
    *this = PhaseProfile{};
    keep.clear();
    events_ = std::move(keep);
    epoch_ = clock::now();
  }

  /// Keeps an event per lap, hop and call from now on, up to `capacity` events, in a buffer
  /// reserved here: recording never allocates, and events past a full buffer are counted in
  /// dropped_events(). 0 turns the log off. Forgets earlier events and restarts the epoch.
  /// Budget about 4R + 8 events per forward and 8R + 8 per backward on a ring of R steps
  /// (hops, the call and a Ulysses exchange's phases included).
  void keep_events(std::size_t capacity) {
    events_.set_capacity(capacity);
    epoch_ = clock::now();
  }
  /// The most events kept (0: the log is off).
  std::size_t event_capacity() const { return events_.capacity(); }
  /// The events kept since keep_events or reset, in the order they ended.
  std::span<const ProfileEvent> events() const { return events_.events(); }
  /// Events not kept because the buffer was full.
  std::uint64_t dropped_events() const { return events_.dropped(); }
  /// Time zero of the events' times.
  clock::time_point epoch() const { return epoch_; }

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
  /// add() of the time from `start` to `end`, and its event when the log is on.
  void add(Pass pass, Phase phase, int step, clock::time_point start, clock::time_point end) {
    add(pass, phase, step, ms_between(start, end));
    log(ProfileEvent::Kind::phase, pass, phase, step, start, end);
  }
  /// add_hop() of a hop in flight from `start` to `end`, and its event when the log is on.
  void add_hop(Pass pass, int step, clock::time_point start, clock::time_point end) {
    add_hop(pass, step, ms_between(start, end));
    log(ProfileEvent::Kind::hop, pass, Phase::count, step, start, end);
  }
  /// add_call() of a call from `start` to `end`, and its event when the log is on.
  void add_call(Pass pass, clock::time_point start, clock::time_point end) {
    add_call(pass, ms_between(start, end));
    log(ProfileEvent::Kind::call, pass, Phase::count, 0, start, end);
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
  static double ms_between(clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  }
  void log(ProfileEvent::Kind kind, Pass pass, Phase phase, int step, clock::time_point start,
           clock::time_point end) {
    if (events_.capacity() == 0) return;
    auto us = [&](clock::time_point t) { return std::chrono::duration<double, std::micro>(t - epoch_).count(); };
    events_.push({kind, pass, phase, step, us(start), us(end)});
  }

  using Steps = std::array<double, max_steps>;
  std::array<std::array<Steps, static_cast<int>(Phase::count)>, static_cast<int>(Pass::count)> ms_{};
  std::array<Steps, static_cast<int>(Pass::count)> hop_ms_{};
  std::array<double, static_cast<int>(Pass::count)> total_ms_{};
  std::array<int, static_cast<int>(Pass::count)> calls_{};
  std::array<int, static_cast<int>(Pass::count)> steps_{};
  detail::EventBuffer events_;
  clock::time_point epoch_{};
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
    profile_->add(pass, phase, step, since, t);
    return t;
  }
  /// Adds a ring hop's time in flight, from `started` to `done`.
  void hop(Pass pass, int step, time_point started, time_point done) const {
    if (profile_) profile_->add_hop(pass, step, started, done);
  }
  /// Counts a call that started at `since`.
  void call(time_point since, Pass pass) const {
    if (profile_) profile_->add_call(pass, since, std::chrono::steady_clock::now());
  }

 private:
  PhaseProfile* profile_ = nullptr;
};

}  // namespace detail

}  // namespace seqpar
