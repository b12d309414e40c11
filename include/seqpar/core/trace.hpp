#pragma once
/// \file
/// Chrome trace-event JSON of PhaseProfile event logs: a timeline of every rank's calls that
/// Perfetto (ui.perfetto.dev) and chrome://tracing open, and tools/trace_svg.py draws.
///
/// Each rank is a process (pid = rank, named "rank N") with two kinds of track: "phases" holds
/// the whole calls ("forward call", "backward call") with their phase laps nested under them;
/// "hops" holds the ring hops in flight, so a transfer that ran under a compute shows as a bar
/// above that compute rather than as a wait. Hops of one rank can overlap (backward moves K/V
/// and the gradient at once), and a track must nest, so overlapping hops go to further tracks
/// ("hops 2"). Times are microseconds; each phase event's args give its ring step and pass.
///
/// Clocks: every rank's time 0 is its own first event, the start of its first call kept. MPI
/// processes' steady clocks share no origin, so only times within a rank are comparable; lining
/// ranks up at their first call shows the length of each rank's calls and phases side by side.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "seqpar/core/profile.hpp"

namespace seqpar {

/// Collects ranks' event logs and writes them as one Chrome trace-event JSON document.
/// Writing allocates; collect after the calls of interest, not between them.
class ChromeTrace {
 public:
  /// Adds rank `rank`'s events; `dropped` (events its log had no room for) is shown on its
  /// process label, so a truncated timeline says so. Under MPI, gather every rank's events()
  /// (ProfileEvent is trivially copyable) and add them here on one rank.
  void add_rank(int rank, std::span<const ProfileEvent> events, std::uint64_t dropped = 0) {
    ranks_.push_back({rank, {events.begin(), events.end()}, dropped});
  }
  /// Adds `profile`'s event log as rank `rank`.
  void add_rank(int rank, const PhaseProfile& profile) {
    add_rank(rank, profile.events(), profile.dropped_events());
  }

  /// Writes {"traceEvents":[...],"displayTimeUnit":"ms"}.
  void write(std::ostream& os) const {
    std::string out = "{\"traceEvents\":[";
    bool first = true;
    auto open = [&] {
      out += first ? "\n" : ",\n";
      first = false;
    };
    for (const Rank& r : ranks_) {
      const std::string pid = std::to_string(r.rank);
      auto meta = [&](std::string_view what, const std::string& tid, std::string_view key, const std::string& value) {
        open();
        out += "{\"ph\":\"M\",\"name\":\"";
        out += what;
        out += "\",\"pid\":" + pid + ",\"tid\":" + tid + ",\"args\":{\"";
        out += key;
        out += "\":" + value + "}}";
      };
      meta("process_name", "0", "name", quoted("rank " + pid));
      meta("process_sort_index", "0", "sort_index", pid);
      if (r.dropped > 0) meta("process_labels", "0", "labels", quoted(std::to_string(r.dropped) + " events dropped"));

      const Tracks t = arrange(r.events);
      meta("thread_name", "0", "name", quoted("phases"));
      meta("thread_sort_index", "0", "sort_index", "0");
      for (int lane = 1; lane <= t.hop_lanes; ++lane) {
        const std::string tid = std::to_string(lane);
        meta("thread_name", tid, "name", quoted(lane == 1 ? "hops" : "hops " + tid));
        meta("thread_sort_index", tid, "sort_index", tid);
      }
      int calls[static_cast<int>(Pass::count)] = {};
      for (const Placed& p : t.events) {
        const ProfileEvent& e = p.event;
        const char* pass = e.pass == Pass::forward ? "forward" : "backward";
        open();
        out += "{\"ph\":\"X\",\"name\":";
        if (e.kind == ProfileEvent::Kind::phase) out += quoted(phase_name(e.phase));
        else if (e.kind == ProfileEvent::Kind::hop) out += quoted("hop");
        else out += quoted(std::string(pass) + " call");
        out += ",\"cat\":" + quoted(pass) + ",\"pid\":" + pid + ",\"tid\":" + std::to_string(p.lane);
        out += ",\"ts\":" + micros(p.start_ns) + ",\"dur\":" + micros(p.end_ns - p.start_ns);
        out += ",\"args\":{\"pass\":" + quoted(pass);
        if (e.kind == ProfileEvent::Kind::call) out += ",\"call\":" + std::to_string(calls[static_cast<int>(e.pass)]++);
        else out += ",\"step\":" + std::to_string(e.step);
        out += "}}";
      }
    }
    out += "\n],\"displayTimeUnit\":\"ms\"}\n";
    os.write(out.data(), static_cast<std::streamsize>(out.size()));
  }

 private:
  struct Rank {
    int rank;
    std::vector<ProfileEvent> events;
    std::uint64_t dropped;
  };
  /// An event on its track, its times in whole nanoseconds since the rank's origin: rounding
  /// the ends (not the durations) keeps a child inside its parent, as the viewers require.
  struct Placed {
    ProfileEvent event;
    std::int64_t start_ns, end_ns;
    int lane;  // tid: 0 phases and calls, 1.. hops
  };
  struct Tracks {
    std::vector<Placed> events;  // by track, then start (a parent before its children)
    int hop_lanes = 0;
  };

  /// Aligns a rank's events to its first one and puts each on a track.
  static Tracks arrange(const std::vector<ProfileEvent>& events) {
    Tracks t;
    double origin = 0;
    bool any = false;
    for (const ProfileEvent& e : events)
      if (finite(e)) {
        origin = any ? std::min(origin, e.start_us) : e.start_us;
        any = true;
      }
    for (const ProfileEvent& e : events) {
      if (!finite(e)) continue;  // never from the engine's clock; kept out so the JSON stays valid
      const std::int64_t s = std::llround((e.start_us - origin) * 1e3);
      const std::int64_t end = std::llround((e.end_us - origin) * 1e3);
      t.events.push_back({e, s, std::max(s, end), 0});
    }
    auto by_start = [](const Placed& a, const Placed& b) {
      if (a.lane != b.lane) return a.lane < b.lane;
      if (a.start_ns != b.start_ns) return a.start_ns < b.start_ns;
      const bool ca = a.event.kind == ProfileEvent::Kind::call, cb = b.event.kind == ProfileEvent::Kind::call;
      if (ca != cb) return ca;      // the enclosing call first
      return a.end_ns < b.end_ns;  // an empty lap before the phase that starts where it ends
    };
    std::stable_sort(t.events.begin(), t.events.end(), by_start);
    // Hops: each on the first hop track free at its start.
    std::vector<std::int64_t> lane_end;
    for (Placed& p : t.events) {
      if (p.event.kind != ProfileEvent::Kind::hop) continue;
      std::size_t l = 0;
      while (l < lane_end.size() && lane_end[l] > p.start_ns) ++l;
      if (l == lane_end.size()) lane_end.push_back(0);
      lane_end[l] = p.end_ns;
      p.lane = static_cast<int>(l) + 1;
    }
    t.hop_lanes = static_cast<int>(lane_end.size());
    std::stable_sort(t.events.begin(), t.events.end(), by_start);
    return t;
  }
  static bool finite(const ProfileEvent& e) { return std::isfinite(e.start_us) && std::isfinite(e.end_us); }

  /// `ns` as microseconds with three decimals, written from the integer: no locale, no exponent.
  static std::string micros(std::int64_t ns) {
    std::string frac = std::to_string(ns % 1000);
    return std::to_string(ns / 1000) + "." + std::string(3 - frac.size(), '0') + frac;
  }
  /// A JSON string literal of `s`.
  static std::string quoted(std::string_view s) {
    std::string q = "\"";
    for (const char c : s) {
      const auto u = static_cast<unsigned char>(c);
      if (c == '"' || c == '\\') {
        q += '\\';
        q += c;
      } else if (u < 0x20) {
        const char hex[] = "0123456789abcdef";
        q += "\\u00";
        q += hex[u >> 4];
        q += hex[u & 15];
      } else {
        q += c;
      }
    }
    return q + "\"";
  }

  std::vector<Rank> ranks_;
};

/// Writes the event logs of `per_rank` (rank = index) as one Chrome trace; see ChromeTrace.
inline void write_chrome_trace(std::ostream& os, std::span<const PhaseProfile> per_rank) {
  ChromeTrace trace;
  for (std::size_t r = 0; r < per_rank.size(); ++r) trace.add_rank(static_cast<int>(r), per_rank[r]);
  trace.write(os);
}

}  // namespace seqpar
