#pragma once
/// \file
/// --estimate and --policy auto: the cost model (seqpar/advise) on this machine's calibrated
/// figures, for the run's own policy or to choose one.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "attention.hpp"
#include "common.hpp"
#include "options.hpp"
#include "report.hpp"
#include "seqpar/advise/advisor.hpp"
#include "seqpar/advise/calibrate.hpp"

namespace seqpar_demo {

/// This host as the cost model sees it: calibrate's figures (the same on every rank) over one
/// node of all the ranks (--ranks-per-node overrides) sharing its cores.
/// Collective.
template <class T, class Comm>
Machine measured_machine(Comm& comm, const Options& o, const ex::GlobalShape& s) {
  Machine base;
  base.name = "measured";
  base.ranks_per_node = o.ranks_per_node ? o.ranks_per_node : comm.size();
  // Cores in kernel-sized slots: a rank's kernel runs --threads threads (default one).
  base.cores_per_node = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, o.threads));
  CalibrationOptions c;
  c.tokens = std::clamp<std::int64_t>(s.seq_q / 2, 256, 2048);  // blocks as long as the run's, within reason
  c.backward = o.backward;
  return calibrate<T>(comm, make_kernel<CpuFlashKernel>(o, false), s.problem<T>(o.backward), base, c);
}

/// The cost model's time (ms; forward, plus backward with --backward) of the options' policy.
template <class T>
double estimate_run(const Options& o, const ex::GlobalShape& s, int world, const Machine& m) {
  return with_policy(o, world, [&](auto policy) {
    return estimate(policy, s.problem<T>(o.backward), s.seq_q, s.kv_len(), world, m).ms(o.backward);
  });
}

/// --policy auto: the options of the advisor's first choice on calibrated figures, with its
/// estimate (rank 0 prints the first few). Collective; every rank chooses alike.
template <class T, class Comm>
Options choose_policy(Comm& comm, const Options& o, const ex::GlobalShape& s) {
  const Machine m = measured_machine<T>(comm, o, s);
  const std::vector<Choice> cs = advise(s.problem<T>(o.backward), s.seq_q, s.kv_len(), comm.size(), m, o.backward);
  if (cs.empty() || !cs.front().runs)
    throw UsageError("--policy auto: no policy runs this shape" + (cs.empty() ? std::string() : ": " + cs.front().reason));
  if (comm.rank() == 0) {
    // The backward figures only when they were measured (--backward): else the base's stand-ins.
    std::printf("auto         calibrated: kernel %.1f GFLOP/s forward", m.forward_gflops);
    if (o.backward) std::printf(", %.1f backward", m.backward_gflops);
    std::printf("; copies %.1f GB/s; exchange %.2f GB/s, %.1f us; a ring step %.0f us forward", m.copy_gbytes_per_s,
                m.intra.gbytes_per_s, m.intra.latency_us, m.ring_step_us);
    if (o.backward) std::printf(", %.0f backward", m.backward_ring_step_us);
    std::printf("\n");
    for (std::size_t i = 0; i < std::min<std::size_t>(cs.size(), 5) && cs[i].runs; ++i)
      std::printf("auto         %s %-36s estimate %.3f ms\n", i == 0 ? "->" : "  ", cs[i].name.c_str(), cs[i].ms);
  }
  const MeshConfig& mesh = cs.front().mesh;
  Options c = o;
  c.policy = mesh.ring == 1 ? PolicyKind::ulysses : mesh.ulysses == 1 ? PolicyKind::ring : PolicyKind::unified;
  c.policy_name = c.policy == PolicyKind::ulysses ? "ulysses" : c.policy == PolicyKind::ring ? "ring" : "unified";
  c.layout = mesh.layout;
  c.anything = mesh.anything;
  c.ulysses_degree = mesh.ulysses;
  c.ring_degree = mesh.ring;
  c.placement = mesh.placement;
  c.policy_auto = false;
  c.estimate_ms = cs.front().ms;
  return c;
}

}  // namespace seqpar_demo
