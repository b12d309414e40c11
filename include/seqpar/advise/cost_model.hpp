#pragma once
/// \file
/// A cost model of a policy's forward and backward, from the same plan the engine runs: the
/// visible score pairs of every rank and ring step (Plan::work, step by step), the exact bytes
/// of every message (the phases' own byte counts), and a Machine of plain numbers (kernel
/// rates, local copy bandwidth, two link kinds: inside a node and between nodes). Nothing is
/// communicated and nothing runs: `estimate` builds the plan every rank would build and walks
/// its phases.
///
/// The model, phase by phase (PhaseProfile's phases, so an estimate reads like a profile):
///  - pack / unpack / finish / merge: bytes copied over `copy_gbytes_per_s`;
///  - all_to_all_in / _out (Ulysses degree > 1): each rank's bytes to the members of its group
///    on its node over `intra` and to those on other nodes over `inter`, both links at once,
///    plus one latency; the phase lasts as long as its slowest rank;
///  - compute: per ring step, the rank's visible pairs x FLOPs per pair over the kernel rate
///    (forward 2 (D + D_v) per pair; backward 2.5x that, the FlashAttention-2 count);
///  - wait: a ring hop starts before the step's compute and must land before the next step,
///    so a step lasts max(compute + merge, hop) on its slowest rank (ranks move in lockstep:
///    each waits for its neighbour's block). In backward the K/V block and the dK/dV
///    accumulators both travel during the step.
/// Ranks of a node that share fewer cores than ranks (a CPU host: `cores_per_node`) get that
/// share of the copy bandwidth (a link's figure is already per rank with every rank moving
/// bytes at once, as calibrate measures it); their kernels share the node's cores step by
/// step, evenly among the ranks still computing (a rank with nothing to compute in a ring step
/// leaves its core to the others).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/core/key_span.hpp"
#include "seqpar/core/mesh.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/problem.hpp"
#include "seqpar/core/profile.hpp"
#include "seqpar/policy/plan_builder.hpp"
#include "seqpar/policy/policies.hpp"
#include "seqpar/policy/ring_loop.hpp"
#include "seqpar/policy/ulysses_exchange.hpp"

namespace seqpar {

/// One kind of link between two ranks: sustained bandwidth each way and the time a message
/// takes before its first byte arrives.
struct Link {
  double gbytes_per_s = 1;  ///< 1e9 bytes per second, each way, per rank while every rank sends at once
  double latency_us = 0;    ///< per message
};

/// A machine as the cost model sees it: plain numbers, per rank. Presets (machines.hpp) say
/// where each number comes from; `calibrate` measures them here.
struct Machine {
  std::string name = "custom";  ///< for tables
  int ranks_per_node = 1;       ///< world ranks w and v share a node when w / ranks_per_node == v / ranks_per_node
  int cores_per_node = 0;       ///< > 0: a node's ranks share this many cores (CPU hosts); 0: one device per rank
  Link intra;                   ///< between ranks of one node (NVLink, PCIe, shared memory)
  Link inter;                   ///< between nodes (InfiniBand, Ethernet)
  double forward_gflops = 1;    ///< one rank's attention forward, 1e9 FLOP/s at 2 (D + D_v) FLOPs per visible pair
  double backward_gflops = 1;   ///< one rank's backward, at 5 (D + D_v) FLOPs per visible pair
  double copy_gbytes_per_s = 10;  ///< one rank's local copies (bytes read + written once)
  /// Fixed cost (us) of one forward ring step beyond its compute, merge and hop: the ranks'
  /// handshake and a kernel call. calibrate measures it (it shows on small blocks and shared
  /// cores); presets leave it 0, inside the link's latency.
  double ring_step_us = 0;
  double backward_ring_step_us = 0;  ///< the same for a backward ring step
  std::string source;           ///< where the numbers come from
};

/// Why `m` cannot be costed ("" when it can): every rate (GFLOP/s, GB/s) must be a positive
/// finite number and every fixed cost (latency, step time) finite and not negative, so that
/// an estimate is a finite time. (A rate of 0 made every estimate NaN, and the advisor sorted
/// NaNs; calibrate on a problem with nothing to time returned such a machine.)
inline std::string machine_reason(const Machine& m) {
  const std::pair<const char*, double> rates[] = {{"forward_gflops", m.forward_gflops},
                                                  {"backward_gflops", m.backward_gflops},
                                                  {"copy_gbytes_per_s", m.copy_gbytes_per_s},
                                                  {"intra.gbytes_per_s", m.intra.gbytes_per_s},
                                                  {"inter.gbytes_per_s", m.inter.gbytes_per_s}};
  const std::pair<const char*, double> costs[] = {{"intra.latency_us", m.intra.latency_us},
                                                  {"inter.latency_us", m.inter.latency_us},
                                                  {"ring_step_us", m.ring_step_us},
                                                  {"backward_ring_step_us", m.backward_ring_step_us}};
  std::ostringstream why;
  for (const auto& [name, v] : rates)
    if (!(std::isfinite(v) && v > 0)) {
      why << "machine '" << m.name << "': " << name << ": expected a positive finite rate, got " << v;
      return why.str();
    }
  for (const auto& [name, v] : costs)
    if (!(std::isfinite(v) && v >= 0)) {
      why << "machine '" << m.name << "': " << name << ": expected a finite time >= 0, got " << v;
      return why.str();
    }
  if (m.ranks_per_node < 1 || m.cores_per_node < 0)
    why << "machine '" << m.name << "': expected ranks_per_node >= 1 and cores_per_node >= 0, got " << m.ranks_per_node
        << " and " << m.cores_per_node;
  return why.str();
}

/// What a policy costs on a machine: per phase, the slowest rank's time (ranks move in
/// lockstep from one collective step to the next), summed over the ring steps.
struct Estimate {
  /// Milliseconds, one entry per Phase.
  using PhaseMs = std::array<double, static_cast<int>(Phase::count)>;
  MeshConfig mesh;                 ///< the resolved mesh
  PhaseMs forward{};               ///< ms per phase of one forward
  PhaseMs backward{};              ///< ms per phase of one backward
  std::size_t forward_bytes = 0;   ///< the busiest rank's bytes sent in one forward
  std::size_t backward_bytes = 0;  ///< ... in one backward
  std::int64_t max_work = 0;       ///< visible pairs of the busiest rank (Plan::work)
  std::int64_t total_work = 0;     ///< visible pairs of all ranks

  /// One forward, in ms.
  double forward_ms() const { return sum(forward); }
  /// One backward, in ms.
  double backward_ms() const { return sum(backward); }
  /// Forward, plus backward when `training`.
  double ms(bool training) const { return forward_ms() + (training ? backward_ms() : 0.0); }
  /// Busiest rank's pairs over the mean: 1 is perfect balance.
  double imbalance() const {
    const double mean = static_cast<double>(total_work) / std::max(1, mesh.world());
    return mean > 0 ? static_cast<double>(max_work) / mean : 1.0;
  }

 private:
  static double sum(const PhaseMs& t) {
    double s = 0;
    for (double x : t) s += x;
    return s;
  }
};

namespace detail {

/// Milliseconds to move `bytes` at `gbytes_per_s`.
inline double transfer_ms(double bytes, double gbytes_per_s) { return bytes / (gbytes_per_s * 1e6); }

/// The machine seen by one world rank of a `world`-rank job: its node, and its share of the
/// node's cores.
struct RankSeat {
  const Machine& m;
  int world;

  int node(int w) const { return w / std::max(1, m.ranks_per_node); }
  /// Share of a core's (or device's) rate rank w gets: 1 unless the node's ranks outnumber its cores.
  double share(int w) const {
    if (m.cores_per_node <= 0) return 1.0;
    const int rpn = std::max(1, m.ranks_per_node);
    const int on_node = std::min(rpn, world - node(w) * rpn);
    return std::min(1.0, static_cast<double>(m.cores_per_node) / on_node);
  }
  /// Kernel times (ms, one per world rank, each at a whole core's rate) as they stretch when
  /// a node's ranks share its cores: the scheduler shares the cores evenly among the ranks
  /// still computing (each at min(1, cores / busy ranks) of a core), so a rank with nothing
  /// to compute in a step leaves its core to the others and the longest finishes last.
  void share_cores(std::span<double> ms) const {
    if (m.cores_per_node <= 0) return;
    const int rpn = std::max(1, m.ranks_per_node);
    std::vector<int> order;
    for (int first = 0; first < world; first += rpn) {
      order.clear();
      for (int w = first; w < std::min(world, first + rpn); ++w)
        if (ms[static_cast<std::size_t>(w)] > 0) order.push_back(w);
      std::sort(order.begin(), order.end(),
                [&](int a, int b) { return ms[static_cast<std::size_t>(a)] < ms[static_cast<std::size_t>(b)]; });
      double clock = 0, done = 0;  // wall time, and the work each rank still busy has done
      for (std::size_t i = 0; i < order.size(); ++i) {
        double& t = ms[static_cast<std::size_t>(order[i])];
        const double rate = std::min(1.0, static_cast<double>(m.cores_per_node) / static_cast<double>(order.size() - i));
        clock += (t - done) / rate;
        done = t;
        t = clock;
      }
    }
  }
  const Link& link(int a, int b) const { return node(a) == node(b) ? m.intra : m.inter; }
  double copy_ms(int w, double bytes) const { return transfer_ms(bytes, m.copy_gbytes_per_s * share(w)); }
};

/// Visible pairs rank w computes at ring step s (against ring rank r - s's block), times
/// batch and its query heads: Plan::work, one step at a time.
inline std::int64_t step_pairs(const Plan& p, int w, int s) {
  const MeshConfig& mesh = p.mesh();
  const int R = mesh.ring, r = mesh.ring_rank(w), u = mesh.ulysses_rank(w), src = (r - s + R) % R;
  const MaskView m = p.mask();
  const bool per_batch = m.kv_valid != nullptr || m.doc_batch_stride > 0;
  const std::int64_t B = p.problem().batch;
  std::int64_t pairs = 0;
  for (std::int64_t b = 0; b < (per_batch ? B : std::min<std::int64_t>(B, 1)); ++b)
    pairs += visible_pairs(m, b, p.q_diagonals(r), p.kv_layout().block(src));
  return pairs * (per_batch ? 1 : B) * p.q_heads(u).count;
}

/// One all-to-all among rank w's Ulysses group, `bytes` of it spread evenly over the other
/// members: the node's link and the network's run at once.
inline double all_to_all_ms(const Plan& p, const RankSeat& seat, int w, double bytes) {
  const MeshConfig& mesh = p.mesh();
  const int U = mesh.ulysses, r = mesh.ring_rank(w), u = mesh.ulysses_rank(w);
  if (U <= 1 || bytes <= 0) return 0.0;
  double intra = 0, inter = 0, latency = 0;
  for (int v = 0; v < U; ++v) {
    if (v == u) continue;
    const int peer = mesh.world_rank(r, v);
    (seat.node(w) == seat.node(peer) ? intra : inter) += bytes / (U - 1);
    latency = std::max(latency, seat.link(w, peer).latency_us / 1e3);
  }
  return latency + std::max(transfer_ms(intra, seat.m.intra.gbytes_per_s), transfer_ms(inter, seat.m.inter.gbytes_per_s));
}

/// Every world rank's lengths for global lengths seq_q and seq_kv (-1: the same), split as
/// evenly as the mesh allows.
inline std::vector<LocalLengths> even_lengths(std::int64_t seq_q, std::int64_t seq_kv, const MeshConfig& mesh) {
  SEQPAR_CHECK(seq_kv >= -1, ConfigError, "seq_kv: expected a length, or -1 for the same as seq_q, got ", seq_kv);
  const std::vector<std::int64_t> q = split_sequence(seq_q, mesh), kv = split_sequence(seq_kv < 0 ? seq_q : seq_kv, mesh);
  std::vector<LocalLengths> lengths(q.size());
  for (std::size_t w = 0; w < q.size(); ++w) lengths[w] = {q[w], kv[w]};
  return lengths;
}

/// Builds the plan every rank would build for these lengths (one per world rank), as world
/// rank 0; throws ConfigError with plan's reason when the policy refuses them.
template <class Policy>
Plan offline_plan(const Policy& policy, const AttentionProblem& problem, std::span<const LocalLengths> lengths) {
  const Implementable ok = can_implement(policy, problem, lengths);
  SEQPAR_CHECK(ok.ok, ConfigError, ok.reason);
  const MeshConfig mesh = mesh_config(policy, static_cast<int>(lengths.size()));
  std::vector<std::int64_t> all;
  all.reserve(lengths.size() * f_count);
  for (const LocalLengths& l : lengths) {
    const auto f = plan_fields(problem, mesh, l);
    all.insert(all.end(), f.begin(), f.end());
  }
  return build_plan<policy_phases_of<Policy>>(all, problem, mesh, 0, 0);
}

}  // namespace detail

/// Estimated forward and backward of `policy` for `problem` with these local lengths (one per
/// world rank) on machine `m`. Throws ConfigError when the policy refuses the lengths (the
/// reason `plan` would give) or the machine cannot be costed (machine_reason). No
/// communication; cost: one plan and a pass over the ring steps.
template <class Policy>
Estimate estimate(const Policy& policy, const AttentionProblem& problem, std::span<const LocalLengths> lengths,
                  const Machine& m) {
  const std::string bad_machine = machine_reason(m);
  SEQPAR_CHECK(bad_machine.empty(), ConfigError, bad_machine);
  const Plan p = detail::offline_plan(policy, problem, lengths);
  const MeshConfig& mesh = p.mesh();
  const int W = mesh.world(), U = mesh.ulysses, R = mesh.ring;
  const detail::RankSeat seat{m, W};
  const double elem = static_cast<double>(p.elem_bytes()), acc = static_cast<double>(p.acc_bytes());
  const double D = static_cast<double>(problem.head_dim), Dv = static_cast<double>(problem.value_dim());
  const double fwd_flops = 2.0 * (D + Dv), bwd_flops = 2.5 * fwd_flops;

  Estimate e;
  e.mesh = mesh;
  auto at = [](Estimate::PhaseMs& t, Phase ph) -> double& { return t[static_cast<int>(ph)]; };
  // Each phase lasts as long as its slowest rank.
  auto slowest = [&](Estimate::PhaseMs& t, Phase ph, auto&& per_rank) {
    double worst = 0;
    for (int w = 0; w < W; ++w) worst = std::max(worst, static_cast<double>(per_rank(w)));
    at(t, ph) += worst;
  };
  for (int w = 0; w < W; ++w) {
    e.forward_bytes = std::max(e.forward_bytes, p.forward_bytes(w));
    e.backward_bytes = std::max(e.backward_bytes, p.backward_bytes(w));
    const std::int64_t work = p.work(w);
    e.max_work = std::max(e.max_work, work);
    e.total_work += work;
  }

  // Rows a rank computes after the Ulysses exchange: its ring block's queries, its query heads.
  auto rows = [&](int w) {
    return static_cast<double>(p.q_layout().block(mesh.ring_rank(w)).size()) * static_cast<double>(problem.batch) *
           static_cast<double>(p.q_heads(mesh.ulysses_rank(w)).count);
  };
  auto kv_block_bytes = [&](int w, int s, double per_elem) {
    const int r = mesh.ring_rank(w), src = (r - s + R) % R;
    return static_cast<double>(detail::ring_block_elems(p, src, mesh.ulysses_rank(w))) * per_elem;
  };

  for (int pass = 0; pass < 2; ++pass) {
    const bool bwd = pass == 1;
    Estimate::PhaseMs& t = bwd ? e.backward : e.forward;
    // The Ulysses exchange in and out (bytes from the phase's own tables).
    if (U > 1) {
      auto in_out = [&](int w) {
        const auto tb = detail::UlyssesExchange::tables(p, mesh.ring_rank(w), mesh.ulysses_rank(w));
        const int u = mesh.ulysses_rank(w);
        if (!bwd) {  // Q, K, V out; O (and the LSE when asked for) back
          const double lse = problem.with_lse ? static_cast<double>(tb.lse.bytes_returned(u)) : 0.0;
          return std::array<double, 2>{static_cast<double>(tb.q.bytes_sent(u) + tb.k.bytes_sent(u) + tb.v.bytes_sent(u)),
                                       static_cast<double>(tb.o.bytes_returned(u)) + lse};
        }
        // Q, O, dO, the LSE, K and V out; dQ, dK, dV back
        return std::array<double, 2>{static_cast<double>(tb.q.bytes_sent(u) + 2 * tb.o.bytes_sent(u) + tb.lse.bytes_sent(u) +
                                                         tb.k.bytes_sent(u) + tb.v.bytes_sent(u)),
                                     static_cast<double>(tb.q.bytes_returned(u) + tb.k.bytes_returned(u) +
                                                         tb.v.bytes_returned(u))};
      };
      const double whole = static_cast<double>(U) / (U - 1);  // a rank packs its own piece too
      slowest(t, Phase::pack, [&](int w) { return seat.copy_ms(w, in_out(w)[0] * whole); });
      slowest(t, Phase::all_to_all_in, [&](int w) { return detail::all_to_all_ms(p, seat, w, in_out(w)[0]); });
      slowest(t, Phase::all_to_all_out, [&](int w) { return detail::all_to_all_ms(p, seat, w, in_out(w)[1]); });
      slowest(t, Phase::unpack, [&](int w) { return seat.copy_ms(w, in_out(w)[1] * whole); });
    }
    // The ring (one step without one): compute, merge and the hop in flight, in lockstep.
    std::vector<double> kernel(static_cast<std::size_t>(W));
    for (int s = 0; s < R; ++s) {
      for (int w = 0; w < W; ++w)
        kernel[static_cast<std::size_t>(w)] = static_cast<double>(detail::step_pairs(p, w, s)) * (bwd ? bwd_flops : fwd_flops) /
                                              ((bwd ? m.backward_gflops : m.forward_gflops) * 1e6);
      seat.share_cores(kernel);
      double compute = 0, busy = 0, step = 0;
      for (int w = 0; w < W; ++w) {
        const double c = kernel[static_cast<std::size_t>(w)];
        // A step's partial output merges into the running one (forward; backward sums dQ).
        const double mg = s > 0 && c > 0 ? seat.copy_ms(w, rows(w) * (bwd ? D : Dv + 1) * acc * 3) : 0.0;
        double hop = 0;
        if (R > 1) {
          const int next = mesh.world_rank((mesh.ring_rank(w) + 1) % R, mesh.ulysses_rank(w));
          const double bytes = (s < R - 1 ? kv_block_bytes(w, s, elem) : 0.0) + (bwd ? kv_block_bytes(w, s, acc) : 0.0);
          if (bytes > 0) hop = seat.link(w, next).latency_us / 1e3 + detail::transfer_ms(bytes, seat.link(w, next).gbytes_per_s);
        }
        compute = std::max(compute, c);
        busy = std::max(busy, c + mg);
        step = std::max(step, std::max(c + mg, hop));
      }
      at(t, Phase::compute) += compute;
      at(t, Phase::merge) += busy - compute;
      at(t, Phase::wait) += step - busy + (R > 1 ? (bwd ? m.backward_ring_step_us : m.ring_step_us) / 1e3 : 0.0);
    }
    // Copies around the ring: the first block into the ring buffer, the result out of the
    // accumulation type (backward: dK/dV too).
    if (R > 1) slowest(t, Phase::pack, [&](int w) { return seat.copy_ms(w, kv_block_bytes(w, 0, elem)); });
    slowest(t, Phase::finish, [&](int w) {
      const double out = rows(w) * (bwd ? D : Dv) * (elem + acc);
      return seat.copy_ms(w, out + (bwd && R > 1 ? kv_block_bytes(w, 0, elem + acc) : 0.0));
    });
  }
  return e;
}

/// estimate() for a global length `seq_q` (and `seq_kv`, -1: the same) split as evenly as the
/// mesh allows (split_sequence), the way the demo and most users split.
template <class Policy>
Estimate estimate(const Policy& policy, const AttentionProblem& problem, std::int64_t seq_q, std::int64_t seq_kv,
                  int world, const Machine& m) {
  const std::vector<LocalLengths> lengths = detail::even_lengths(seq_q, seq_kv, mesh_config(policy, world));
  return estimate(policy, problem, std::span<const LocalLengths>(lengths), m);
}

}  // namespace seqpar
