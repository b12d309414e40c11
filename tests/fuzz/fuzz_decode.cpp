// The decode runner and its checks: plan refuses alike on every rank (and exactly what the
// documented rules refuse), or every step equals attention over the whole cache in double
// with NaN in every cache slot no token was written to; the layout puts each token in one
// slot of one rank; advance(k) applies in whole or not at all; owner and slot refuse
// positions outside the cache.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>

#include "fuzz/fuzz_attention.hpp"

namespace seqpar::fuzz {
namespace {

using i128 = __int128;

/// The whole truth of a decode case: K and V of every position the steps reach, every step's
/// queries [B, T, H, D], all uniform in [-1, 1] (never 0) and rounded to the element type; with
/// V in K's rows, V is the first D_v columns of K. The soft-cap and the sinks of the problem.
struct DecodeTruth {
  i64 B = 0, cap = 0, H = 0, K = 0, D = 0, Dv = 0, T = 0;
  double softcap = 0;
  std::vector<float> sinks;             // [H] or empty
  std::vector<double> k, v;             // [B, cap, K, D], [B, cap, K, D_v]
  std::vector<std::vector<double>> q;   // per step
  const double* krow(i64 b, i64 pos, i64 h) const { return &k[static_cast<std::size_t>(((b * cap + pos) * K + h) * D)]; }
  const double* vrow(i64 b, i64 pos, i64 h) const { return &v[static_cast<std::size_t>(((b * cap + pos) * K + h) * Dv)]; }
};

/// What one rank left behind.
struct DecodeRank {
  Outcome plan, step, advance;
  bool planned = false;
  HeadRange out_heads;
  std::vector<std::vector<double>> out;  // per step, [B, T, out_heads, D]
  std::vector<Failure> found;            // checks the rank made itself
  bool traffic_reported = false;         // a step's bytes differed from plan.step_bytes() (once)
};

/// Attention of one query row in double, and the bounds of each output element (min and max
/// of the visible V values: a softmax is a convex combination of them).
struct RowAnswer {
  std::vector<double> o, lo, hi;
  std::vector<double> mag;  // sum_j p_j |v_j| per element (NormError's magnitude)
};

/// Step s's query (b, t, h) over cache positions 0..len + t (soft-capped scores; the head's sink
/// one more term of the denominator: +inf takes the row, O = 0; NaN makes it NaN).
RowAnswer decode_reference(const DecodeTruth& tr, double scale, int s, i64 b, i64 t, i64 h, i64 len) {
  const double* q = &tr.q[static_cast<std::size_t>(s)][static_cast<std::size_t>(((b * tr.T + t) * tr.H + h) * tr.D)];
  const i64 kh = h / (tr.H / tr.K), n = len + t + 1;
  const auto D = static_cast<std::size_t>(tr.Dv);
  const double inf = std::numeric_limits<double>::infinity();
  const double z = tr.sinks.empty() ? -inf : static_cast<double>(tr.sinks[static_cast<std::size_t>(h)]);
  std::vector<double> sc(static_cast<std::size_t>(n));
  RowAnswer a{std::vector<double>(D, 0.0), std::vector<double>(D, tr.sinks.empty() ? inf : 0.0),
              std::vector<double>(D, tr.sinks.empty() ? -inf : 0.0), std::vector<double>(D, 0.0)};
  if (std::isnan(z)) std::fill(a.o.begin(), a.o.end(), z);
  if (std::isnan(z) || z == inf) return a;
  double mx = z, sum = 0;
  for (i64 j = 0; j < n; ++j) {
    double dot = 0;
    for (i64 e = 0; e < tr.D; ++e) dot += q[e] * tr.krow(b, j, kh)[e];
    sc[static_cast<std::size_t>(j)] = softcapped(dot * scale, tr.softcap);
    mx = std::max(mx, sc[static_cast<std::size_t>(j)]);
  }
  if (z != -inf) sum += std::exp(z - mx);
  for (i64 j = 0; j < n; ++j) sum += std::exp(sc[static_cast<std::size_t>(j)] - mx);
  for (i64 j = 0; j < n; ++j)
    for (std::size_t e = 0; e < D; ++e) {
      const double v = tr.vrow(b, j, kh)[e];
      a.o[e] += std::exp(sc[static_cast<std::size_t>(j)] - mx) / sum * v;
      a.mag[e] += std::exp(sc[static_cast<std::size_t>(j)] - mx) / sum * std::abs(v);
      a.lo[e] = std::min(a.lo[e], v);
      a.hi[e] = std::max(a.hi[e], v);
    }
  return a;
}

/// Each position of [0, min(capacity, 4096)) on one rank, in increasing slots below the shard capacity.
void check_slots(const DecodeCase& c, const DecodePlan& plan, std::vector<Failure>& found) {
  const DecodeProblem& p = c.problem;
  const i64 upto = std::min<i64>(p.capacity, 4096);
  for (i64 b = 0; b < p.batch; ++b) {
    i64 next = 0;
    for (i64 pos = 0; pos < upto; ++pos) {
      const int o = plan.owner(b, pos);
      if (o < 0 || o >= c.world) {
        found.push_back({prop::decode_layout, "owner(" + std::to_string(b) + ", " + std::to_string(pos) + ") = " + std::to_string(o)});
        return;
      }
      if (o != plan.rank()) continue;
      const i64 s = plan.slot(b, pos);
      if (s != next || s >= plan.shard_capacity()) {
        found.push_back({prop::decode_layout, "rank " + std::to_string(o) + ": slot(" + std::to_string(b) + ", " +
                                                  std::to_string(pos) + ") = " + std::to_string(s) + ", want " +
                                                  std::to_string(next) + " (shard capacity " +
                                                  std::to_string(plan.shard_capacity()) + ")"});
        return;
      }
      ++next;
    }
  }
}

/// advance(k) on a copy of the plan: accepted exactly when every sequence stays within the
/// capacity; a refusal changes nothing, an acceptance moves every sequence by k and counts a step.
void probe_advance(const DecodeCase& c, const DecodePlan& plan, i64 k, std::vector<Failure>& found) {
  const DecodeProblem& p = c.problem;
  DecodePlan copy = plan;
  std::vector<i64> before;
  bool fits = k >= 0;
  for (i64 b = 0; b < p.batch; ++b) {
    before.push_back(copy.kv_len(b));
    fits = fits && static_cast<i128>(copy.kv_len(b)) + k <= p.capacity;
  }
  const i64 steps = copy.steps();
  Outcome o;
  try {
    record(o, [&] { copy.advance(k); });
  } catch (const std::exception&) {
  }
  std::ostringstream lens;
  for (i64 b = 0; b < p.batch; ++b) lens << (b ? "," : "") << before[static_cast<std::size_t>(b)] << "->" << copy.kv_len(b);
  const std::string what = "advance(" + std::to_string(k) + ") with capacity " + std::to_string(p.capacity) +
                           ", lengths " + lens.str() + ", steps " + std::to_string(steps) + "->" +
                           std::to_string(copy.steps()) + ": " + o.text();
  if (o.ok() != fits) {
    found.push_back({prop::advance, (fits ? "refused " : "accepted ") + what});
    return;
  }
  if (!o.ok() && o.kind != "ConfigError") found.push_back({prop::refusal_type, what});
  bool same = copy.steps() == steps + (o.ok() ? 1 : 0);
  for (i64 b = 0; b < p.batch; ++b) same = same && copy.kv_len(b) == before[static_cast<std::size_t>(b)] + (o.ok() ? k : 0);
  if (!same) found.push_back({prop::advance, (o.ok() ? "accepted, but " : "refused, but changed: ") + what});
}

/// owner and slot of (b, pos) outside the cache must throw ConfigError.
void probe_position(const DecodePlan& plan, i64 b, i64 pos, std::vector<Failure>& found) {
  for (int which = 0; which < 2; ++which) {
    Outcome o;
    i64 got = 0;
    try {
      record(o, [&] { got = which == 0 ? plan.owner(b, pos) : plan.slot(b, pos); });
    } catch (const std::exception&) {
    }
    if (o.kind != "ConfigError")
      found.push_back({prop::position, std::string(which == 0 ? "owner(" : "slot(") + std::to_string(b) + ", " +
                                           std::to_string(pos) + ") with capacity " + std::to_string(plan.problem().capacity) +
                                           ": " + (o.ok() ? "returned " + std::to_string(got) : o.text())});
  }
}

template <class Kernel, class T>
std::vector<DecodeRank> run_decode_ranks(const DecodeCase& c, const std::optional<DecodeTruth>& truth) {
  const DecodeProblem& p = c.problem;
  std::vector<DecodeRank> ranks(static_cast<std::size_t>(c.world));
  try {
    run_ranks(
        c.world,
        [&](ThreadCommunicator& world) {
          const int me = world.rank();
          DecodeRank& r = ranks[static_cast<std::size_t>(me)];
          SequenceParallelDecode<ThreadCommunicator, Kernel> dec(world, make_kernel<Kernel>(c.kernel, c.isa));
          DecodePlan plan;
          record(r.plan, [&] { plan = dec.plan(problem_of(c, me)); });
          r.planned = true;
          check_slots(c, plan, r.found);
          const i64 B = p.batch, Tn = p.new_tokens, K = p.kv_head_count(), D = p.head_dim, Dv = p.value_dim(),
                    C = plan.shard_capacity();
          // Every rank decides alike whether the steps run: on the largest shard of any rank.
          i128 largest = 0;
          for (int r = 0; truth && r < c.world; ++r)
            for (i64 b = 0; b < B; ++b) largest = std::max<i128>(largest, plan.layout().count(r, b, p.capacity));
          const bool fits = truth && C >= 0 && largest * B * K * std::max(D, Dv) <= 20'000'000 &&
                            plan.workspace_bytes() <= workspace_limit;
          if (fits) {
            const double nan = std::numeric_limits<double>::quiet_NaN();
            const T unwritten = static_cast<T>(c.nan_unwritten ? nan : 0.0);
            std::vector<T> kc(static_cast<std::size_t>(B * C * K * D), unwritten);
            std::vector<T> vc(c.v_in_k ? 0 : static_cast<std::size_t>(B * C * K * Dv), unwritten);
            auto put = [&](i64 b, i64 pos) {
              if (plan.owner(b, pos) != me) return;
              const i64 s = plan.slot(b, pos);
              if (s < 0 || s >= C) throw std::runtime_error("slot " + std::to_string(s) + " outside the shard");
              for (i64 e = 0; e < K * D; ++e)
                kc[static_cast<std::size_t>((b * C + s) * K * D + e)] = static_cast<T>(truth->krow(b, pos, 0)[e]);
              for (i64 e = 0; e < K * Dv && !c.v_in_k; ++e)
                vc[static_cast<std::size_t>((b * C + s) * K * Dv + e)] = static_cast<T>(truth->vrow(b, pos, 0)[e]);
            };
            for (i64 b = 0; b < B; ++b)
              for (i64 pos = 0; pos < p.kv_len[static_cast<std::size_t>(b)]; ++pos) put(b, pos);
            const HeadRange qh = plan.q_heads(), oh = plan.out_heads();
            r.out_heads = oh;
            std::vector<T> q(static_cast<std::size_t>(B * Tn * qh.count * D)), out(static_cast<std::size_t>(B * Tn * oh.count * Dv));
            const auto k_view = TensorView<const T>::bshd(kc.data(), B, C, K, D);
            TensorView<const T> v_view = TensorView<const T>::bshd(vc.data(), B, C, K, Dv);
            if (c.v_in_k) {  // MLA's latent cache: V is the first D_v columns of K's rows, the same memory
              v_view = k_view;
              v_view.extent[3] = Dv;
            }
            std::vector<std::byte> ws(plan.workspace_bytes());
            for (int s = 0; s < c.steps; ++s) {
              if (static_cast<std::size_t>(s) < c.advance_probes.size())
                probe_advance(c, plan, c.advance_probes[static_cast<std::size_t>(s)], r.found);
              for (i64 b = 0; b < B; ++b)
                for (i64 t = 0; t < Tn; ++t) put(b, p.kv_len[static_cast<std::size_t>(b)] + s * Tn + t);
              for (i64 b = 0; b < B; ++b)
                for (i64 t = 0; t < Tn; ++t)
                  for (i64 h = 0; h < qh.count; ++h)
                    for (i64 e = 0; e < D; ++e)
                      q[static_cast<std::size_t>(((b * Tn + t) * qh.count + h) * D + e)] = static_cast<T>(
                          truth->q[static_cast<std::size_t>(s)][static_cast<std::size_t>(((b * Tn + t) * p.heads + qh.begin + h) * D + e)]);
              std::fill(out.begin(), out.end(), T(12345));
              const std::uint64_t bytes = world.stats().bytes_sent;
              record(r.step, [&] {
                dec.template step<T>(plan, TensorView<const T>::bshd(q.data(), B, Tn, qh.count, D), k_view, v_view,
                                     TensorView<T>::bshd(out.data(), B, Tn, oh.count, Dv), ws);
              });
              r.out.push_back(as_double(out));
              if (world.stats().bytes_sent - bytes != plan.step_bytes() && !r.traffic_reported) {
                r.traffic_reported = true;
                r.found.push_back({prop::traffic, "rank " + std::to_string(me) + "'s step " + std::to_string(s) + " sent " +
                                                      std::to_string(world.stats().bytes_sent - bytes) +
                                                      " bytes, plan.step_bytes() says " + std::to_string(plan.step_bytes())});
              }
              record(r.advance, [&] { plan.advance(Tn); });
            }
          }
          for (const auto& [b, pos] : c.position_probes) probe_position(plan, b, pos, r.found);
        },
        ThreadRunOptions{rank_timeout});
  } catch (const std::exception&) {
    // recorded per rank
  }
  return ranks;
}

/// "" when every rank ended `field` alike, else one line per rank.
std::string mixed(const std::vector<DecodeRank>& ranks, Outcome DecodeRank::*field) {
  for (const DecodeRank& r : ranks)
    if ((r.*field).kind != (ranks[0].*field).kind || (r.*field).what != (ranks[0].*field).what) {
      std::string s;
      for (std::size_t w = 0; w < ranks.size(); ++w) s += " | rank " + std::to_string(w) + ": " + (ranks[w].*field).text();
      return s;
    }
  return "";
}

std::optional<DecodeTruth> make_truth(const DecodeCase& c) {
  const DecodeProblem& p = c.problem;
  const i64 K = p.kv_head_count();
  if (p.batch < 1 || p.batch > 16 || p.heads < 1 || p.heads > 64 || K < 1 || p.heads % K != 0 || p.head_dim < 1 ||
      p.head_dim > 512 || p.new_tokens < 1 || p.new_tokens > 16 || static_cast<i64>(p.kv_len.size()) != p.batch)
    return std::nullopt;
  i64 longest = 0;
  for (i64 l : p.kv_len) {
    if (l < 0 || l > 100000) return std::nullopt;
    longest = std::max(longest, l);
  }
  if (p.value_dim() < 1 || p.value_dim() > 512 || (c.v_in_k && p.value_dim() > p.head_dim)) return std::nullopt;
  DecodeTruth tr;
  tr.B = p.batch, tr.H = p.heads, tr.K = K, tr.D = p.head_dim, tr.Dv = p.value_dim(), tr.T = p.new_tokens;
  tr.softcap = p.softcap;
  tr.sinks = c.sinks;
  tr.cap = longest + tr.T * c.steps;
  if (tr.B * tr.cap * tr.K * std::max(tr.D, tr.Dv) > 4'000'000) return std::nullopt;
  Rng rng(c.data_seed);
  auto value = [&] {
    const double u = (0.001 + 0.999 * rng.unit()) * (rng.chance(0.5) ? 1 : -1);
    return c.f64 ? u : static_cast<double>(static_cast<float>(u));
  };
  tr.k.resize(static_cast<std::size_t>(tr.B * tr.cap * tr.K * tr.D));
  tr.v.resize(static_cast<std::size_t>(tr.B * tr.cap * tr.K * tr.Dv));
  for (double& x : tr.k) x = value();
  for (std::size_t i = 0; i < tr.v.size(); ++i)
    tr.v[i] = c.v_in_k ? tr.k[i / static_cast<std::size_t>(tr.Dv) * static_cast<std::size_t>(tr.D) + i % static_cast<std::size_t>(tr.Dv)]
                       : value();
  for (int s = 0; s < c.steps; ++s) {
    tr.q.emplace_back(static_cast<std::size_t>(tr.B * tr.T * tr.H * tr.D));
    for (double& x : tr.q.back()) x = value();
  }
  return tr;
}

template <class Kernel, class T>
void decode_with(const DecodeCase& c, Report& rep) {
  const DecodeProblem& p = c.problem;
  const std::optional<DecodeTruth> truth = make_truth(c);
  const std::vector<DecodeRank> ranks = run_decode_ranks<Kernel, T>(c, truth);
  const std::string rules = decode_model_reason(c);
  if (const std::string m = mixed(ranks, &DecodeRank::plan); !m.empty()) {
    rep.fail(prop::same_refusal, "decode plan:" + m);
    return;
  }
  const Outcome& planned = ranks[0].plan;
  if (!planned.ok() && planned.kind != "ConfigError") rep.fail(prop::refusal_type, "decode plan: " + planned.text());
  if (c.disagree_rank >= 0) {
    const std::string name = library_field_name(c.disagree_field);
    if (planned.ok())
      rep.fail(prop::same_refusal, "rank " + std::to_string(c.disagree_rank) + " planned another " + name +
                                       ", and every decode plan succeeded");
    else if (planned.what.find("ranks disagree on " + name) == std::string::npos)
      rep.fail(prop::disagreement, "rank " + std::to_string(c.disagree_rank) + " planned another " + name + ": " +
                                       planned.text());
    return;
  }
  if (planned.ok() && !rules.empty()) rep.fail(prop::rules, "decode plan accepts what the rules refuse: " + rules);
  // A kernel that cannot allocate its scratch (a huge D_v under the case's 4 GiB cap) is refused
  // by plan alone, on every rank: no pure rule can know.
  const bool no_scratch = planned.what.find("could not allocate its scratch") != std::string::npos;
  if (!planned.ok() && rules.empty() && !no_scratch)
    rep.fail(prop::rules, "decode plan refuses what the rules accept: " + planned.text());
  if (const std::string words = model_words(rules);
      !planned.ok() && !words.empty() && planned.what.find(words) == std::string::npos)
    rep.fail(prop::reason_words, "the rules refuse for " + rules + ", the refusal (no \"" + words + "\") says: " + planned.what);
  if (!planned.ok()) {
    rep.note("decode: refused");
    return;
  }
  for (const DecodeRank& r : ranks)  // rank-local checks: the first rank that found something
    if (!r.found.empty()) {
      for (const Failure& f : r.found) rep.fail(f.property, f.detail);
      break;
    }
  if (!truth || (ranks[0].out.empty() && ranks[0].step.ok())) return;
  if (const std::string m = mixed(ranks, &DecodeRank::step); !m.empty()) {
    rep.fail(prop::decode_step, "the step ended differently on the ranks:" + m);
    return;
  }
  const Outcome& step = ranks[0].step;
  if (p.dtype != dtype_v<T>) {
    if (step.ok() || step.kind != "ConfigError")
      rep.fail(prop::decode_step, "a plan for dtype " + std::to_string(static_cast<int>(p.dtype)) + " and step<" +
                                      (c.f64 ? "double" : "float") + ">: step " + step.text());
    return;
  }
  if (!step.ok()) {
    rep.fail(prop::decode_step, "the plan accepted, the step " + step.text());
    return;
  }
  if (const std::string m = mixed(ranks, &DecodeRank::advance); !m.empty() || !ranks[0].advance.ok())
    rep.fail(prop::advance, "advance(new_tokens) after a step:" + (m.empty() ? " " + ranks[0].advance.text() : m));
  const double scale = p.scale != 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  // A tame scale is checked to the tolerance; any other only within the visible V values.
  const bool exact = std::abs(scale) * std::sqrt(static_cast<double>(p.head_dim)) <= 4.0;
  const double tol = c.f64 ? 1e-12 : 1e-5;
  for (int s = 0; s < c.steps; ++s) {
    NormError err;
    std::string bound;
    for (std::size_t w = 0; w < ranks.size(); ++w) {
      const DecodeRank& r = ranks[w];
      const HeadRange oh = r.out_heads;
      for (i64 b = 0; b < truth->B; ++b)
        for (i64 t = 0; t < truth->T; ++t)
          for (i64 h = 0; h < oh.count; ++h) {
            const RowAnswer want = decode_reference(*truth, scale, s, b, t, oh.begin + h,
                                                    p.kv_len[static_cast<std::size_t>(b)] + s * truth->T);
            const bool wild = !truth->sinks.empty() && !std::isfinite(truth->sinks[static_cast<std::size_t>(oh.begin + h)]);
            for (i64 e = 0; e < truth->Dv; ++e) {
              const auto ue = static_cast<std::size_t>(e);
              const double got = r.out[static_cast<std::size_t>(s)][static_cast<std::size_t>(((b * truth->T + t) * oh.count + h) * truth->Dv + e)];
              if (wild && std::isnan(got)) continue;  // a head whose sink is not finite may be NaN (model_words)
              if (exact)
                err.add(got, c.f64 ? want.o[ue] : static_cast<double>(static_cast<float>(want.o[ue])),
                        ((static_cast<i64>(w) * truth->B + b) * truth->T + t) * 64 + oh.begin + h, want.mag[ue]);
              else if (bound.empty() && !(got >= want.lo[ue] - tol && got <= want.hi[ue] + tol))
                bound = "step " + std::to_string(s) + ": scale " + std::to_string(scale) + ", rank " + std::to_string(w) +
                        " (b " + std::to_string(b) + ", t " + std::to_string(t) + ", head " + std::to_string(oh.begin + h) +
                        ") = " + std::to_string(got) + " outside the visible V values [" + std::to_string(want.lo[ue]) +
                        ", " + std::to_string(want.hi[ue]) + "]";
            }
          }
    }
    if (!bound.empty()) {
      rep.fail(prop::decode_step, bound);
      return;
    }
    if (err.value() > tol) {
      std::ostringstream os;
      const i64 at = err.worst;
      os << "step " << s << ": normwise error " << err.value() << " > " << tol << "; got " << err.worst_got << ", want "
         << err.worst_want << " (rank " << at / 64 / truth->T / truth->B << ", b " << at / 64 / truth->T % truth->B
         << ", t " << at / 64 % truth->T << ", head " << at % 64 << ")";
      rep.fail(prop::decode_step, os.str());
      return;
    }
  }
  rep.note(exact ? "decode: steps checked exactly" : "decode: steps checked within bounds (huge scale)");
  if (p.softcap > 0) rep.note("decode: steps checked with a soft-cap");
  if (p.value_dim() != p.head_dim) rep.note(c.v_in_k ? "decode: steps checked with D_v < D, V in K's rows" : "decode: steps checked with D_v != D");
  if (!c.sinks.empty()) rep.note("decode: steps checked with sinks");
}

}  // namespace

void run_decode(const DecodeCase& c, Report& report) {
  if (c.kernel == KernelKind::reference) c.f64 ? decode_with<ReferenceKernel, double>(c, report) : decode_with<ReferenceKernel, float>(c, report);
  else c.f64 ? decode_with<CpuFlashKernel, double>(c, report) : decode_with<CpuFlashKernel, float>(c, report);
}

}  // namespace seqpar::fuzz
