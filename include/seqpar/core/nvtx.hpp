#pragma once
/// \file
/// NVTX ranges of the engine's calls and phases, for Nsight Systems: the same names as the
/// PhaseProfile ("seqpar forward", then "compute" and so on, the ring step as the payload),
/// so the kernels and copies a phase launched line up under it on the timeline.
///
/// When: SEQPAR_NVTX decides, and without NVTX everything here compiles to nothing.
///  - undefined (the default): on in CUDA builds (SEQPAR_HAS_CUDA, or nvcc) whose toolkit has
///    the header-only NVTX 3 (<nvtx3/nvToolsExt.h>), and then only in calls made while a
///    PhaseProfile is set. set_profile is the one switch for looking inside a call; a call
///    without one pays a flag test per phase, as it does for the clock.
///  - 1: on wherever <nvtx3/nvToolsExt.h> is found, in every call, profile or not: for running
///    a whole program under nsys without touching its code.
///  - 0: off.
/// NVTX itself costs a few nanoseconds per range when no tool is attached.

#if defined(SEQPAR_NVTX)
#if SEQPAR_NVTX && __has_include(<nvtx3/nvToolsExt.h>)
/// 1 when the engine emits NVTX ranges (see the file comment).
#define SEQPAR_HAS_NVTX 1
/// 1 when the ranges are emitted in every call, not only while a profile is set.
#define SEQPAR_NVTX_ALWAYS 1
#endif
#elif (defined(SEQPAR_HAS_CUDA) || defined(__CUDACC__)) && __has_include(<nvtx3/nvToolsExt.h>)
/// 1 when the engine emits NVTX ranges (see the file comment).
#define SEQPAR_HAS_NVTX 1
/// 1 when the ranges are emitted in every call, not only while a profile is set.
#define SEQPAR_NVTX_ALWAYS 0
#endif
#ifndef SEQPAR_HAS_NVTX
/// 1 when the engine emits NVTX ranges (see the file comment).
#define SEQPAR_HAS_NVTX 0
/// 1 when the ranges are emitted in every call, not only while a profile is set.
#define SEQPAR_NVTX_ALWAYS 0
#endif

#if SEQPAR_HAS_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

#include <cstdint>

#include "seqpar/core/profile.hpp"

namespace seqpar::detail {

/// One engine's NVTX ranges: a range per call, and inside it a range per phase, opened by
/// enter() where the phase's work begins and closed by the lap that charges the phase.
/// Ranges are per host thread, as NVTX's push/pop are: one engine is used by one thread at a time.
class NvtxRanges {
 public:
#if SEQPAR_HAS_NVTX
  /// Opens the call's range; `profiled`: a profile is set (the default mode needs one).
  void begin_call(Pass pass, bool profiled) {
    close_all();  // what an exception left open
    on_ = SEQPAR_NVTX_ALWAYS || profiled;
    if (!on_) return;
    nvtxRangePushA(pass == Pass::forward ? "seqpar forward" : "seqpar backward");
    call_open_ = true;
  }
  /// Opens the range of `phase` at ring step `step` (the step is the range's payload).
  void enter(Phase phase, int step) {
    if (!on_) return;
    leave();
    nvtxEventAttributes_t a{};
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.colorType = NVTX_COLOR_ARGB;
    a.color = colour(phase);
    a.payloadType = NVTX_PAYLOAD_TYPE_INT32;
    a.payload.iValue = step;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = phase_name(phase);
    nvtxRangePushEx(&a);
    phase_open_ = true;
  }
  /// Closes the phase's range, if one is open.
  void leave() {
    if (!phase_open_) return;
    nvtxRangePop();
    phase_open_ = false;
  }
  /// Closes the call's range.
  void end_call() { close_all(); }

 private:
  void close_all() {
    leave();
    if (call_open_) nvtxRangePop();
    call_open_ = false;
  }
  /// The colours of tools/trace_svg.py, so both timelines read alike.
  static std::uint32_t colour(Phase p) {
    constexpr std::uint32_t c[] = {0xff9ecae1, 0xfffd8d3c, 0xff3182bd, 0xff31a354,
                                   0xffe6550d, 0xffa1d99b, 0xfffdae6b, 0xffbdbdbd};
    return p < Phase::count ? c[static_cast<int>(p)] : 0xff888888;
  }
  bool on_ = false, call_open_ = false, phase_open_ = false;
#else
  /// Without NVTX: nothing.
  void begin_call(Pass, bool) {}
  /// Without NVTX: nothing.
  void enter(Phase, int) {}
  /// Without NVTX: nothing.
  void leave() {}
  /// Without NVTX: nothing.
  void end_call() {}
#endif
};

}  // namespace seqpar::detail
