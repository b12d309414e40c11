#pragma once
/// \file
/// The advisor: every policy, mesh, layout and placement a world of ranks can run, each with
/// the cost model's estimate, or with the reason `plan` would refuse it, best first. Peers
/// make the user pick ulysses_degree and ring_degree by hand; this ranks the choices before
/// anything runs.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "seqpar/advise/cost_model.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/problem.hpp"
#include "seqpar/policy/policies.hpp"

namespace seqpar {

/// One candidate: a policy and its mesh, with its estimate or the reason it cannot run.
struct Choice {
  std::string name;    ///< e.g. "unified zigzag 2x4", "anything ring stripe"
  MeshConfig mesh;     ///< the resolved mesh (degrees, layout, placement, anything)
  bool runs = false;   ///< false: `reason` says why plan refuses it
  std::string reason;  ///< plan's message when it does not run
  Estimate estimate;   ///< when it runs
  double ms = 0;       ///< the estimate's forward (+ backward when training), in ms
};

namespace detail {

/// The readable name of a policy's resolved mesh.
inline std::string choice_name(const MeshConfig& m) {
  const char* layouts[] = {"contiguous", "zigzag", "stripe"};
  std::string n = m.anything ? "anything " : "";
  if (m.ring == 1) return n + "ulysses";
  n += (m.ulysses == 1 ? "ring " : "unified ") + std::string(layouts[static_cast<int>(m.layout)]);
  if (m.ulysses > 1) {
    n += " " + std::to_string(m.ulysses) + "x" + std::to_string(m.ring);
    if (m.placement == MeshPlacement::ring_adjacent) n += " ring-adjacent";
  }
  return n;
}

/// Calls f(policy) for every base policy a world of `world` ranks can form: Ulysses, Ring and
/// every Unified U x R (U, R > 1) in every layout, Unified in both placements.
template <class F>
void for_each_base_policy(int world, F&& f) {
  f(UlyssesPolicy{});
  if (world < 2) return;
  auto layouts = [&](auto make) {
    make(Contiguous{});
    make(Zigzag{});
    make(Stripe{});
  };
  layouts([&](auto layout) { f(RingPolicy<decltype(layout)>{}); });
  for (int u = 2; u < world; ++u) {
    if (world % u != 0) continue;
    for (MeshPlacement place : {MeshPlacement::ulysses_adjacent, MeshPlacement::ring_adjacent})
      layouts([&](auto layout) { f(UnifiedPolicy<decltype(layout)>{u, world / u, place}); });
  }
}

}  // namespace detail

/// Every choice for `problem` (global lengths seq_q and seq_kv, -1: the same, split as evenly
/// as each mesh allows) on `world` ranks of machine `m`: the ones that run sorted by estimated
/// time (forward, plus backward when `training`), then the refused ones with plan's reason. A
/// base policy the lengths or heads do not divide for is offered as AnythingPolicy of it.
/// Throws ConfigError when `m` cannot be costed (machine_reason). The first choice is the
/// simplest of those within `margin` of the fastest estimate: the fewest ring steps, then the
/// plainest layout (contiguous, zigzag, stripe). Every ring step
/// and every cut in a block costs fixed time the model only partly sees (on small blocks and
/// shared cores most), so near-ties go to the plan with fewer of them.
inline std::vector<Choice> advise(const AttentionProblem& problem, std::int64_t seq_q, std::int64_t seq_kv, int world,
                                  const Machine& m, bool training, double margin = 0.03) {
  const std::string bad_machine = machine_reason(m);
  SEQPAR_CHECK(bad_machine.empty(), ConfigError, bad_machine);
  std::vector<Choice> out;
  auto consider = [&](const auto& policy) {
    Choice c;
    c.mesh = mesh_config(policy, world);
    c.name = detail::choice_name(c.mesh);
    const std::vector<LocalLengths> lengths = detail::even_lengths(seq_q, seq_kv, c.mesh);
    const Implementable ok = can_implement(policy, problem, std::span<const LocalLengths>(lengths));
    c.runs = ok.ok;
    c.reason = ok.reason;
    if (c.runs) {
      c.estimate = estimate(policy, problem, std::span<const LocalLengths>(lengths), m);
      c.ms = c.estimate.ms(training);
    }
    out.push_back(std::move(c));
    return out.back().runs;
  };
  detail::for_each_base_policy(world, [&](auto base) {
    if (!consider(base)) consider(AnythingPolicy<decltype(base)>{base});
  });
  std::stable_sort(out.begin(), out.end(), [](const Choice& a, const Choice& b) {
    if (a.runs != b.runs) return a.runs;
    return a.runs && a.ms < b.ms;
  });
  if (!out.empty() && out.front().runs) {
    const double limit = out.front().ms * (1 + margin);
    auto simpler = [](const Choice& a, const Choice& b) {
      if (a.mesh.ring != b.mesh.ring) return a.mesh.ring < b.mesh.ring;
      return static_cast<int>(a.mesh.layout) < static_cast<int>(b.mesh.layout);
    };
    auto pick = out.begin();
    for (auto it = out.begin(); it != out.end() && it->runs && it->ms <= limit; ++it)
      if (simpler(*it, *pick)) pick = it;
    std::rotate(out.begin(), pick, pick + 1);
  }
  return out;
}

}  // namespace seqpar
