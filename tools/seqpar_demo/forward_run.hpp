#pragma once
/// \file
/// One rank's forward (and --backward) run of seqpar_demo: plan, a checked first step, timed
/// steps, and the figures every rank gives rank 0's report.

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <span>
#include <string>
#include <memory>
#include <vector>

#include "attention.hpp"
#include "auto_policy.hpp"
#include "common.hpp"
#include "report.hpp"

namespace seqpar_demo {

/// --trace: gathers every rank's event log to rank 0, which writes them as one Chrome trace
/// (collective). Events travel as 6 integers each (kind, pass, phase, step, and the two times'
/// bits), padded to the longest log; the first integer of a row is its event count, the
/// second its dropped events. Returns false (on rank 0, having said why) when the file could
/// not be written: no throw after the collective, so no rank is left waiting.
template <class Comm>
bool write_trace(Comm& comm, const PhaseProfile& profile, const std::string& path) {
  constexpr std::size_t fields = 6;
  const std::span<const ProfileEvent> mine = profile.events();
  std::int64_t most = 0;
  for (const auto& row : ex::gather_rows(comm, {static_cast<std::int64_t>(mine.size())})) most = std::max(most, row[0]);
  std::vector<std::int64_t> row(2 + static_cast<std::size_t>(most) * fields, 0);
  row[0] = static_cast<std::int64_t>(mine.size());
  row[1] = static_cast<std::int64_t>(profile.dropped_events());
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const ProfileEvent& e = mine[i];
    std::int64_t* f = row.data() + 2 + i * fields;
    f[0] = static_cast<std::int64_t>(e.kind);
    f[1] = static_cast<std::int64_t>(e.pass);
    f[2] = static_cast<std::int64_t>(e.phase);
    f[3] = e.step;
    f[4] = std::bit_cast<std::int64_t>(e.start_us);
    f[5] = std::bit_cast<std::int64_t>(e.end_us);
  }
  const std::vector<std::vector<std::int64_t>> all = ex::gather_rows(comm, row);
  if (comm.rank() != 0) return true;
  ChromeTrace trace;
  for (std::size_t w = 0; w < all.size(); ++w) {
    std::vector<ProfileEvent> events(static_cast<std::size_t>(all[w][0]));
    for (std::size_t i = 0; i < events.size(); ++i) {
      const std::int64_t* f = all[w].data() + 2 + i * fields;
      events[i] = {static_cast<ProfileEvent::Kind>(f[0]), static_cast<Pass>(f[1]), static_cast<Phase>(f[2]),
                   static_cast<int>(f[3]), std::bit_cast<double>(f[4]), std::bit_cast<double>(f[5])};
    }
    trace.add_rank(static_cast<int>(w), events, static_cast<std::uint64_t>(all[w][1]));
  }
  std::ofstream out(path);
  trace.write(out);
  if (!out) {
    std::fprintf(stderr, "seqpar_demo: --trace: could not write '%s'\n", path.c_str());
    return false;
  }
  std::printf("trace        %s: every rank's phases of the timed calls (Chrome trace JSON; Perfetto opens it,\n"
              "             tools/trace_svg.py draws it)\n", path.c_str());
  return true;
}

/// One rank's run of the options' policy with element type T: plan, a checked forward, timed
/// forwards, and (rank 0) the report. `sweep_at`: the length's index in --sweep (-1: no sweep).
/// Returns the exit status.
template <class T, class Comm>
int run_rank(Comm& comm, const Options& o, const ex::GlobalInputs& g, int sweep_at) {
  const int me = comm.rank();
  const bool print = me == 0;
  const double est_ms =
      o.estimate && o.estimate_ms < 0 ? estimate_run<T>(o, g.shape, comm.size(), measured_machine<T>(comm, o, g.shape))
                                      : o.estimate_ms;
  const std::unique_ptr<DemoAttention<T>> attn_ptr = make_attention<T>(comm, o);
  DemoAttention<T>& attn = *attn_ptr;
  const MeshConfig& mesh = attn.mesh();
  const ex::GlobalShape& s = g.shape;
  const auto idx = static_cast<std::size_t>(me);
  const Plan plan = attn.plan(s.problem<T>(o.backward), {split_sequence(s.seq_q, mesh)[idx], split_sequence(s.kv_len(), mesh)[idx]});
  g_planned = true;

  const auto B = s.batch, H = s.heads, K = s.kv_head_count(), D = s.head_dim, Dv = s.value_dim();
  const PositionMap qpos = plan.q_positions(me), kvpos = plan.kv_positions(me);
  ex::LocalSlices<T> l = ex::local_slices<T>(g, qpos, kvpos);
  std::vector<std::byte> workspace(std::max(plan.workspace_bytes(), o.backward ? plan.backward_workspace_bytes() : 0));
  using CV = TensorView<const T>;
  using V = TensorView<T>;
  const CV q = CV::bshd(l.q.data(), B, l.lq, H, D), k = CV::bshd(l.k.data(), B, l.lkv, K, D),
           v = CV::bshd(l.v.data(), B, l.lkv, K, Dv);
  const V out = V::bshd(l.out.data(), B, l.lq, H, Dv);
  // Backward state: the LSE kept from forward, the upstream gradient and the three gradients.
  std::vector<acc_t<T>> lse(o.backward ? static_cast<std::size_t>(B * l.lq * H) : 0);
  const std::vector<T> dout = o.backward ? ex::take_rows<T>(g.dout, B, s.seq_q, H, Dv, qpos) : std::vector<T>{};
  std::vector<T> dq(o.backward ? l.q.size() : 0), dk(o.backward ? l.k.size() : 0), dv(o.backward ? l.v.size() : 0);
  std::vector<float> d_sinks(o.backward ? s.sinks.size() : 0);  // this rank's rows' share
  const auto lse_view = o.backward ? TensorView<acc_t<T>>::lse_bhs(lse.data(), B, l.lq, H) : TensorView<acc_t<T>>{};
  auto step = [&] {
    attn.forward(plan, q, k, v, out, lse_view, workspace);
    if (o.backward)
      attn.backward(plan, CV::bshd(dout.data(), B, l.lq, H, Dv), q, k, v, out, lse_view,
                    V::bshd(dq.data(), B, l.lq, H, D), V::bshd(dk.data(), B, l.lkv, K, D),
                    V::bshd(dv.data(), B, l.lkv, K, Dv), d_sinks.empty() ? nullptr : d_sinks.data(), workspace);
  };

  // The first step is the one measured for traffic and checked; it also warms up.
  comm.stats().reset();
  step();
  const std::uint64_t bytes = comm.stats().bytes_sent;
  ex::ErrorStats err, grad_err;
  const auto check_start = std::chrono::steady_clock::now();
  if (o.check) {
    if (print && sweep_at < 0)
      std::printf("check        computing the exact double-precision reference for every rank's rows%s...\n",
                  o.backward ? " and the gradients" : "");
    std::fflush(stdout);
    err = ex::reduce_errors(comm, ex::compare(l.out, ex::reference_rows(g, qpos)));
    if (o.backward) {
      const ex::ReferenceGrads want = ex::reference_grads(g, qpos, kvpos);
      ex::ErrorStats e = ex::compare(dq, want.dq);
      for (const ex::ErrorStats& x : {ex::compare(dk, want.dk), ex::compare(dv, want.dv)}) e.merge(x);
      if (!d_sinks.empty()) e.merge(ex::compare(d_sinks, want.dsinks));  // each rank's share against its rows'
      grad_err = ex::reduce_errors(comm, e);
    }
  }
  const double check_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - check_start).count();

  PhaseProfile profile;  // only the timed calls
  // --trace: an event per phase lap, hop and call of the timed calls (a ring of R steps lays
  // down about 4R + 8 per forward and 8R + 8 per backward), reserved before the first one.
  const auto R = static_cast<std::size_t>(mesh.ring);
  if (!o.trace.empty()) profile.keep_events(static_cast<std::size_t>(o.iters) * (12 * R + 32));
  if (o.profile || !o.trace.empty()) attn.set_profile(&profile);
  comm.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < o.iters; ++i) step();
  comm.barrier();  // the time of the slowest rank
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / o.iters;
  attn.set_profile(nullptr);
  std::vector<PhaseProfile> profiles;
  if (o.profile)
    for (const auto& row : ex::gather_rows(comm, ex::profile_row(profile))) profiles.push_back(ex::profile_from_row(row));
  const bool traced = o.trace.empty() || write_trace(comm, profile, o.trace);
  const std::uint64_t formula = plan.forward_bytes(me) + (o.backward ? plan.backward_bytes(me) : 0);

  const RunFigures figures(ex::gather_rows(comm, {plan.local_q(), plan.local_kv(), plan.work(me), static_cast<std::int64_t>(bytes),
                                                  static_cast<std::int64_t>(formula), std::bit_cast<std::int64_t>(ms)}));
  if (!print) return 0;
  return report_run(o, s, mesh, figures, err, grad_err, check_s, sweep_at, profiles, est_ms) && traced ? 0 : 1;
}

}  // namespace seqpar_demo
