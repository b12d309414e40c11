// The attention case's inputs and reference (prepare_attention) and its contract checks
// (analyse_attention): construction and plan refuse alike on every rank or on none; the free
// and the member can_implement say what plan does, in its words; plan accepts exactly what
// the documented rules accept; the ranks' positions partition the sequences; plan.work is
// the visible pair count; forward (O and LSE) and backward equal the reference.
#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "fuzz/fuzz_runners.hpp"

namespace seqpar::fuzz {
namespace {

using i128 = __int128;

std::string str(i128 v) {
  if (v == 0) return "0";
  std::string s;
  const bool neg = v < 0;
  for (; v != 0; v /= 10) s += static_cast<char>('0' + static_cast<int>(neg ? -(v % 10) : v % 10));
  if (neg) s += '-';
  return {s.rbegin(), s.rend()};
}

/// "" when every rank ended `field` alike (all returned, or all threw the same kind and
/// message), else one line per rank.
std::string mixed(const AttentionRun& run, Outcome RankResult::*field) {
  const Outcome& first = run.ranks.front().*field;
  bool same = true;
  for (const RankResult& r : run.ranks) same = same && (r.*field).kind == first.kind && (r.*field).what == first.what;
  if (same) return "";
  std::string s;
  for (std::size_t w = 0; w < run.ranks.size(); ++w) s += " | rank " + std::to_string(w) + ": " + (run.ranks[w].*field).text();
  return s;
}

/// Checks that a verdict (of can_implement) says what plan did.
void check_verdict(const Implementable& v, const Outcome& plan, const char* property, const std::string& who,
                   Report& rep) {
  if (v.ok != plan.ok())
    rep.fail(property, who + " says " + (v.ok ? "ok" : "\"" + v.reason + "\"") + ", plan " + plan.text());
  else if (!v.ok && v.reason != strip_location(plan.what))
    rep.fail(property, who + " refuses with \"" + v.reason + "\", plan with \"" + strip_location(plan.what) + "\"");
}

/// Every position of [0, total) held by exactly one rank, and each rank holding its own length.
void check_partition(const AttentionRun& run, bool kv, i64 total, const std::vector<i64>& given, Report& rep) {
  const char* what = kv ? "key" : "query";
  std::vector<int> holders(static_cast<std::size_t>(total), 0);
  for (std::size_t w = 0; w < run.ranks.size(); ++w) {
    const PositionMap& pos = kv ? run.ranks[w].kvpos : run.ranks[w].qpos;
    if (pos.size() != given[w])
      rep.fail(prop::layout, "rank " + std::to_string(w) + " holds " + std::to_string(pos.size()) + " " + what +
                                 " positions, it gave the length " + std::to_string(given[w]));
    for (i64 i = 0; i < pos.size(); ++i) {
      const i64 at = pos(i);
      if (at < 0 || at >= total) {
        rep.fail(prop::layout, "rank " + std::to_string(w) + " holds " + what + " position " + std::to_string(at) +
                                   " outside [0, " + std::to_string(total) + ")");
        return;
      }
      ++holders[static_cast<std::size_t>(at)];
    }
  }
  for (i64 i = 0; i < total; ++i)
    if (holders[static_cast<std::size_t>(i)] != 1) {
      rep.fail(prop::layout, std::string(what) + " position " + std::to_string(i) + " is held by " +
                                 std::to_string(holders[static_cast<std::size_t>(i)]) + " ranks");
      return;
    }
}

/// The mesh and head split of the plan against the model, and plan.work(w) against the
/// visible pairs of rank w's ring block times its query heads.
void check_work(const AttentionCase& c, const CaseData& d, const AttentionRun& run, Report& rep) {
  const auto [U, R] = model_mesh(c.policy, c.world);
  const Plan& p0 = run.ranks.front().plan;
  if (p0.mesh().ulysses != U || p0.mesh().ring != R) {
    rep.fail(prop::layout, "the plan's mesh is " + std::to_string(p0.mesh().ulysses) + " x " +
                               std::to_string(p0.mesh().ring) + ", the rules give " + std::to_string(U) + " x " +
                               std::to_string(R));
    return;
  }
  for (int u = 0, begin = 0; u < U; ++u) {
    const i64 want = d.H / U + (u < d.H % U ? 1 : 0);
    const HeadRange h = p0.q_heads(u);
    if (h.begin != begin || h.count != want)
      rep.fail(prop::work, "q_heads(" + std::to_string(u) + ") = {" + std::to_string(h.begin) + ", " +
                               std::to_string(h.count) + "}, an even split gives {" + std::to_string(begin) + ", " +
                               std::to_string(want) + "}");
    begin += static_cast<int>(want);
  }
  std::vector<i128> block_pairs(static_cast<std::size_t>(R), 0);
  i128 all_pairs = 0;
  for (int w = 0; w < c.world; ++w) {
    const int r = model_coords(c.policy, U, R, w).first;
    const PositionMap& q = run.ranks[static_cast<std::size_t>(w)].qpos;
    for (i64 b = 0; b < d.B; ++b)
      for (i64 i = 0; i < q.size(); ++i) block_pairs[static_cast<std::size_t>(r)] += d.vis.keys(b, q(i));
  }
  for (i128 n : block_pairs) all_pairs += n;
  i128 sum = 0;
  for (int w = 0; w < c.world; ++w) {
    const auto [r, u] = model_coords(c.policy, U, R, w);
    const i128 want = block_pairs[static_cast<std::size_t>(r)] * p0.q_heads(u).count;
    for (int v = 0; v < c.world; ++v) {  // every rank's plan says the same of rank w
      const i64 got = run.ranks[static_cast<std::size_t>(v)].plan.work(w);
      if (got != want) {
        rep.fail(prop::work, "rank " + std::to_string(v) + "'s plan.work(" + std::to_string(w) + ") = " +
                                 std::to_string(got) + ", visible pairs of its ring block x its " +
                                 std::to_string(p0.q_heads(u).count) + " query heads = " + str(want));
        return;
      }
    }
    sum += want;
  }
  if (sum != all_pairs * d.H)
    rep.fail(prop::work, "the ranks' work sums to " + str(sum) + ", batch x heads x visible pairs = " +
                             str(all_pairs * d.H));
}

/// `want` as the element type holds it: a float result can be no closer than that.
double as_element(double want, bool f64) { return f64 ? want : static_cast<double>(static_cast<float>(want)); }

std::string at_text(const char* tensor, i64 index, i64 S, i64 heads, i64 D) {
  if (index < 0) return "";
  const i64 e = index % D, h = index / D % heads, s = index / D / heads % S, b = index / D / heads / S;
  std::ostringstream os;
  os << " (worst at " << tensor << "[b " << b << ", pos " << s << ", head " << h << ", d " << e << "])";
  return os.str();
}

void report_error(Report& rep, const char* property, const char* tensor, const NormError& e, double tol, i64 S,
                  i64 heads, i64 D) {
  if (e.value() <= tol) return;
  std::ostringstream os;
  os << tensor << ": normwise error " << e.value() << " > " << tol << "; got " << e.worst_got << ", want "
     << e.worst_want << at_text(tensor, e.worst, S, heads, D);
  rep.fail(property, os.str());
}

/// Forward rows against the reference: exactly (tame scale) or within the visible V values (and
/// 0, with sinks). A head whose sink is not finite may give NaN where the reference's limit is
/// finite (fuzz_case.hpp's model_words says the contract).
void check_forward(const AttentionCase& c, const CaseData& d, const AttentionRun& run, Report& rep) {
  const double tol = c.f64 ? 1e-12 : 1e-5, slack = c.f64 ? 1e-12 : 1e-5;
  const i64 H = d.H, D = d.Dv;
  NormError out, lse;
  std::string bound;
  for (const RankResult& r : run.ranks) {
    const i64 L = r.qpos.size();
    for (i64 b = 0; b < d.B; ++b)
      for (i64 li = 0; li < L; ++li)
        for (i64 h = 0; h < H; ++h) {
          const i64 i = r.qpos(li), g = ((b * d.Sq + i) * H + h), l = ((b * L + li) * H + h);
          const bool wild = d.wild_sink[static_cast<std::size_t>(h)] != 0;
          for (i64 e = 0; e < D; ++e) {
            const double got = r.out[static_cast<std::size_t>(l * D + e)];
            const double want = as_element(d.ref.out[static_cast<std::size_t>(g * D + e)], c.f64);
            if (wild && std::isnan(got)) continue;
            if (d.exact) {
              out.add(got, want, g * D + e, d.ref.mag[static_cast<std::size_t>(g * D + e)]);
            } else if (bound.empty()) {
              const bool keys = d.vis.keys(b, i) > 0;
              const double lo = d.ref.lo[static_cast<std::size_t>(g * D + e)], hi = d.ref.hi[static_cast<std::size_t>(g * D + e)];
              if (keys ? !(got >= lo - slack && got <= hi + slack) : got != 0.0)
                bound = "O[b " + std::to_string(b) + ", pos " + std::to_string(i) + ", head " + std::to_string(h) +
                        "] = " + std::to_string(got) + (keys ? " outside the visible V values [" + std::to_string(lo) + ", " +
                                                                   std::to_string(hi) + "]" : " for a row that sees no key");
            }
          }
          if (!c.problem.with_lse) continue;
          const double got = r.lse[static_cast<std::size_t>(l)];
          const double want = as_element(d.ref.lse[static_cast<std::size_t>(g)], c.f64);
          if (wild && (std::isnan(got) || got == want)) continue;
          if (d.exact) lse.add(got, want, g);
          else if (bound.empty() && (d.vis.keys(b, i) > 0 && std::isfinite(want) ? !std::isfinite(got) : got != want))
            bound = "LSE[b " + std::to_string(b) + ", pos " + std::to_string(i) + ", head " + std::to_string(h) + "] = " +
                    std::to_string(got) + (d.vis.keys(b, i) > 0 ? " (not finite)" : ", want -inf");
        }
  }
  report_error(rep, prop::forward, "O", out, tol, d.Sq, H, D);
  // An LSE is a logarithm: its error is absolute below 1 (relative to max|LSE| above).
  lse.max_ref = std::max(lse.max_ref, 1.0);
  report_error(rep, prop::lse, "LSE", lse, tol, d.Sq, H, 1);
  if (!bound.empty()) rep.fail(prop::forward, "scale " + std::to_string(c.problem.scale) + ": " + bound);
}

/// Every rank's bytes against the plan's count, and no metadata exchanged by a call.
void check_traffic(const AttentionRun& run, bool backward, Report& rep) {
  std::uint64_t total = 0;
  for (const RankResult& r : run.ranks) total += (backward ? r.backward_traffic : r.forward_traffic).sent;
  if (total > 0) rep.note(backward ? "attention: backward bytes counted" : "attention: forward bytes counted");
  for (std::size_t w = 0; w < run.ranks.size(); ++w) {
    const Traffic& t = backward ? run.ranks[w].backward_traffic : run.ranks[w].forward_traffic;
    const char* call = backward ? "backward" : "forward";
    if (t.sent != t.planned || t.gathers != 0) {
      rep.fail(prop::traffic, "rank " + std::to_string(w) + "'s " + call + " sent " + std::to_string(t.sent) + " bytes and " +
                                  std::to_string(t.gathers) + " metadata gathers, plan." + call + "_bytes says " +
                                  std::to_string(t.planned) + " bytes");
      return;
    }
  }
}

/// Gradients against the reference (tame scales only), and the sinks' gradient summed over the
/// ranks' shares (float: its error bound is the float one in both element types). Rows of a
/// head whose sink is not finite, and K/V rows of its group, may be NaN.
void check_backward(const AttentionCase& c, const CaseData& d, const AttentionRun& run, Report& rep) {
  const double tol = c.f64 ? 1e-10 : 1e-4;
  const i64 G = d.H / d.K;
  auto wild_kv = [&](i64 kh) {
    return std::any_of(d.wild_sink.begin() + kh * G, d.wild_sink.begin() + (kh + 1) * G, [](unsigned char w) { return w != 0; });
  };
  NormError dq, dk, dv, ds;
  // A float gradient element is a sum of up to Sq + Skv terms (and one partial sum per rank),
  // each of which the float path may round in the subnormal range: a tiny scale, or a sink that
  // takes nearly all of a row's probability, puts whole gradients there (scale 1e-30 and a
  // sink of 30: dQ ~ 1e-43), where no float result is closer than such roundings, however
  // computed. Each is at most half of float's smallest subnormal, 2^-149 (inputs lie in
  // [-1, 1]): four such roundings a term are allowed.
  if (!c.f64)
    dq.floor = dk.floor = dv.floor = 4 * 0.5 * static_cast<double>(d.Sq + d.Skv + c.world) * std::ldexp(1.0, -149);
  for (const RankResult& r : run.ranks) {
    auto add = [&](NormError& err, const std::vector<double>& got, const std::vector<double>& want,
                   const std::vector<double>& mag, const PositionMap& pos, i64 S, i64 heads, i64 D) {
      const i64 L = pos.size();
      for (i64 b = 0; b < d.B; ++b)
        for (i64 li = 0; li < L; ++li)
          for (i64 h = 0; h < heads; ++h) {
            const bool wild = heads == d.H ? d.wild_sink[static_cast<std::size_t>(h)] != 0 : wild_kv(h);
            for (i64 e = 0; e < D; ++e) {
              const i64 g = ((b * S + pos(li)) * heads + h) * D + e;
              const double x = got[static_cast<std::size_t>(((b * L + li) * heads + h) * D + e)];
              if (!(wild && std::isnan(x)))
                err.add(x, as_element(want[static_cast<std::size_t>(g)], c.f64), g, mag[static_cast<std::size_t>(g)]);
            }
          }
    };
    add(dq, r.dq, d.ref.dq, d.ref.dq_mag, r.qpos, d.Sq, d.H, d.D);
    add(dk, r.dk, d.ref.dk, d.ref.dk_mag, r.kvpos, d.Skv, d.K, d.D);
    add(dv, r.dv, d.ref.dv, d.ref.dv_mag, r.kvpos, d.Skv, d.K, d.Dv);
  }
  report_error(rep, prop::backward, "dQ", dq, tol, d.Sq, d.H, d.D);
  report_error(rep, prop::backward, "dK", dk, tol, d.Skv, d.K, d.D);
  report_error(rep, prop::backward, "dV", dv, tol, d.Skv, d.K, d.Dv);
  if (run.ranks.front().d_sinks.empty()) return;
  for (i64 h = 0; h < d.H; ++h) {
    double sum = 0;
    for (const RankResult& r : run.ranks) sum += r.d_sinks[static_cast<std::size_t>(h)];
    if (d.wild_sink[static_cast<std::size_t>(h)] != 0 && std::isnan(sum)) continue;
    ds.add(sum, d.ref.d_sinks[static_cast<std::size_t>(h)], h, d.ref.d_sinks_mag[static_cast<std::size_t>(h)]);
  }
  report_error(rep, prop::backward, "d_sinks", ds, c.f64 ? 1e-6 : 1e-4, 1, d.H, 1);
  rep.note("attention: sinks' gradient checked");
}

}  // namespace

std::string strip_location(const std::string& message) {
  const std::size_t at = message.rfind(" (at ");
  return at != std::string::npos && !message.empty() && message.back() == ')' ? message.substr(0, at) : message;
}

CaseData prepare_attention(const AttentionCase& c) {
  CaseData d;
  const AttentionProblem& p = c.problem;
  const i128 sq = total_q(c), skv = total_kv(c);
  const i64 K = p.kv_heads == 0 ? p.heads : p.kv_heads, Dv = p.head_dim_v == 0 ? p.head_dim : p.head_dim_v;
  bool lengths_ok = true;
  for (const LocalLengths& l : c.lengths) lengths_ok = lengths_ok && l.q >= 0 && l.q <= 4096 && l.kv >= -1 && l.kv <= 4096;
  const bool small = lengths_ok && p.batch >= 0 && p.batch <= 16 && sq <= 4096 && skv <= 4096 && p.heads >= 1 &&
                     p.heads <= 64 && K >= 1 && K <= p.heads && p.heads % K == 0 && p.head_dim >= 1 && p.head_dim <= 512 &&
                     Dv >= 1 && Dv <= 512 && p.batch * sq * skv <= 4'000'000 &&
                     p.batch * std::max(sq, skv) * p.heads * std::max(p.head_dim, Dv) <= 4'000'000;
  if (!small) return d;
  d.B = p.batch, d.Sq = static_cast<i64>(sq), d.Skv = static_cast<i64>(skv), d.H = p.heads, d.K = K, d.D = p.head_dim;
  d.Dv = Dv;
  for (i64 h = 0; h < d.H; ++h)
    d.wild_sink.push_back(!c.sinks.empty() && !std::isfinite(c.sinks[static_cast<std::size_t>(h)]));
  d.vis = visibility(p, d.Sq, d.Skv);
  Rng rng(c.data_seed);
  auto fill = [&](std::vector<double>& x, i64 n) {  // uniform in [-1, 1], never 0, rounded to T
    x.resize(static_cast<std::size_t>(n));
    for (double& e : x) {
      const double u = (0.001 + 0.999 * rng.unit()) * (rng.chance(0.5) ? 1 : -1);
      e = c.f64 ? u : static_cast<double>(static_cast<float>(u));
    }
  };
  const i64 nq = d.B * d.Sq * d.H * d.D, nkv = d.B * d.Skv * d.K * d.D;
  fill(d.x.q, nq);
  fill(d.x.k, nkv);
  fill(d.x.v, d.B * d.Skv * d.K * d.Dv);
  fill(d.x.dout, d.B * d.Sq * d.H * d.Dv);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (i64 b = 0; b < d.B; ++b) {
    if (c.nan_hidden_kv)
      for (i64 j = 0; j < d.Skv; ++j)
        if (!d.vis.key_seen(b, j)) {
          const auto at = static_cast<std::size_t>((b * d.Skv + j) * d.K);
          std::fill(d.x.k.begin() + at * d.D, d.x.k.begin() + (at + d.K) * d.D, nan);
          std::fill(d.x.v.begin() + at * d.Dv, d.x.v.begin() + (at + d.K) * d.Dv, nan);
        }
    if (c.nan_hidden_q)
      for (i64 i = 0; i < d.Sq; ++i)
        if (d.vis.keys(b, i) == 0) {
          const auto at = static_cast<std::size_t>((b * d.Sq + i) * d.H * d.D);
          std::fill(d.x.q.begin() + at, d.x.q.begin() + at + d.H * d.D, nan);
        }
  }
  const double scale = p.scale != 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(d.D));
  d.exact = std::abs(scale) * std::sqrt(static_cast<double>(d.D)) <= 4.0;
  d.ref = reference_attention(p, d.vis, d.x, c.backward, c.sinks);
  d.ready = true;
  return d;
}

void analyse_attention(const AttentionCase& c, const CaseData& d, const AttentionRun& run, Report& rep) {
  const bool problem_differs = c.disagree_rank >= 0, mesh_differs = c.mesh_disagree_rank >= 0;
  const std::string rules = attention_model_reason(c);
  // Construction: collective over the mesh request.
  if (const std::string m = mixed(run, &RankResult::construct); !m.empty()) {
    rep.fail(prop::same_refusal, "construction:" + m);
    return;
  }
  const Outcome& made = run.ranks.front().construct;
  if (!made.ok()) {
    if (made.kind != "ConfigError") rep.fail(prop::refusal_type, "construction: " + made.text());
    if (mesh_differs) {
      if (made.what.find("disagree") == std::string::npos)
        rep.fail(prop::disagreement, "a rank constructed other degrees; construction: " + made.text());
      return;
    }
    check_verdict(run.free_verdict, made, prop::can_implement, "can_implement", rep);
    if (rules.empty()) rep.fail(prop::rules, "construction refuses what the rules accept: " + made.text());
    return;
  }
  if (mesh_differs) {
    rep.fail(prop::disagreement, "a rank constructed other degrees, and construction succeeded");
    return;
  }
  if (rules == "the degrees do not fit the world size")
    rep.fail(prop::rules, "construction accepts " + policy_name(c.policy) + " on " + std::to_string(c.world) + " ranks");
  // Plan: every rank alike.
  if (const std::string m = mixed(run, &RankResult::plan_call); !m.empty()) {
    rep.fail(prop::same_refusal, "plan:" + m);
    return;
  }
  const Outcome& planned = run.ranks.front().plan_call;
  if (!planned.ok() && planned.kind != "ConfigError") rep.fail(prop::refusal_type, "plan: " + planned.text());
  if (problem_differs) {
    if (planned.ok())
      rep.fail(prop::same_refusal, "rank " + std::to_string(c.disagree_rank) + " planned another " + c.disagree_field +
                                       ", and every plan succeeded");
    else if (planned.what.find("disagree on") == std::string::npos)
      rep.fail(prop::disagreement, "rank " + std::to_string(c.disagree_rank) + " planned another " + c.disagree_field +
                                       ": " + planned.text());
    else if (planned.what.find("hash") != std::string::npos)
      rep.fail(prop::disagreement, planned.what);
    else if (const std::string name = library_field_name(c.disagree_field);
             planned.what.find("disagree on " + name) == std::string::npos)
      rep.fail(prop::disagreement, "rank " + std::to_string(c.disagree_rank) + " planned another " + name +
                                       ", the refusal names another field: " + planned.what);
    return;
  }
  // A kernel that cannot allocate its scratch (head_dim 2^20 under the case's 4 GiB cap) is
  // refused by plan alone: no pure function can know. The free function knows the policy, not
  // the kernel: a refusal for the kernel's masks is the member's to predict.
  if (planned.what.find("could not allocate") != std::string::npos) return;
  const bool for_kernel = planned.what.find("a kernel declares supports_") != std::string::npos;
  if (!(for_kernel && run.free_verdict.ok)) check_verdict(run.free_verdict, planned, prop::can_implement, "can_implement", rep);
  for (std::size_t w = 0; w < run.ranks.size(); ++w)
    if (run.ranks[w].member_asked) {
      Report one;
      check_verdict(run.ranks[w].member, planned, prop::member_can_implement,
                    "rank " + std::to_string(w) + "'s member can_implement", one);
      for (const Failure& f : one.failures) rep.fail(f.property, f.detail);
      if (!one.failures.empty()) break;
    }
  if (planned.ok() && !rules.empty()) rep.fail(prop::rules, "plan accepts what the rules refuse: " + rules);
  if (!planned.ok() && rules.empty()) rep.fail(prop::rules, "plan refuses what the rules accept: " + planned.text());
  if (const std::string words = model_words(rules);
      !planned.ok() && !words.empty() && planned.what.find(words) == std::string::npos)
    rep.fail(prop::reason_words, "the rules refuse for " + rules + ", the refusal (no \"" + words + "\") says: " + planned.what);
  if (const std::size_t at = planned.what.find("x global length "); at != std::string::npos) {
    const i128 longest = std::max(total_q(c), total_kv(c));
    const std::string printed = planned.what.substr(at + 16, planned.what.find(' ', at + 16) - at - 16);
    if (printed != str(longest))
      rep.fail(prop::message, "the lengths sum to " + str(longest) + ", the refusal says: " + planned.what);
  }
  if (!planned.ok()) rep.note("attention: refused");
  if (!planned.ok() || !d.ready) return;

  // The plan holds: positions, work, then the data.
  for (const RankResult& r : run.ranks)
    if (!r.forwarded && r.forward.ok()) return;  // a rank stopped before forward (recorded elsewhere)
  std::vector<i64> gq, gkv;
  for (const LocalLengths& l : c.lengths) gq.push_back(l.q), gkv.push_back(l.kv_count());
  const std::size_t before = rep.failures.size();
  check_partition(run, false, d.Sq, gq, rep);
  check_partition(run, true, d.Skv, gkv, rep);
  if (rep.failures.size() != before) return;
  check_work(c, d, run, rep);

  const bool wrong_dtype = !c.typed_plan && c.problem.dtype != (c.f64 ? DType::f64 : DType::f32);
  if (const std::string m = mixed(run, &RankResult::forward); !m.empty()) {
    rep.fail(prop::forward, "forward ended differently on the ranks:" + m);
    return;
  }
  const Outcome& fwd = run.ranks.front().forward;
  if (wrong_dtype) {
    if (fwd.ok() || fwd.what.find("element type") == std::string::npos)
      rep.fail(prop::forward, "a plan for dtype " + std::to_string(static_cast<int>(c.problem.dtype)) +
                                  " and forward<" + (c.f64 ? "double" : "float") + ">: forward " + fwd.text());
    return;
  }
  if (!fwd.ok()) {
    rep.fail(fwd.kind == "bounded" ? prop::bounded : prop::forward, "the plan accepted, forward " + fwd.text());
    return;
  }
  check_forward(c, d, run, rep);
  check_traffic(run, false, rep);
  rep.note(d.exact ? "attention: forward checked exactly" : "attention: forward checked within bounds (huge scale)");
  const bool cap = c.problem.softcap > 0, dv = d.Dv != d.D, sinks = !c.sinks.empty();
  if (cap) rep.note("attention: forward checked with a soft-cap");
  if (dv) rep.note("attention: forward checked with D_v != D");
  if (sinks) rep.note("attention: forward checked with sinks");
  if (cap + dv + sinks > 1) rep.note("attention: forward checked with 2-3 features combined");
  if (!c.backward) return;
  if (const std::string m = mixed(run, &RankResult::backward); !m.empty()) {
    rep.fail(prop::backward, "backward ended differently on the ranks:" + m);
    return;
  }
  if (!run.ranks.front().backward.ok()) {
    rep.fail(prop::backward, "the plan accepted, backward " + run.ranks.front().backward.text());
    return;
  }
  check_traffic(run, true, rep);
  if (!d.exact) return;
  check_backward(c, d, run, rep);
  rep.note("attention: backward checked");
  if (cap || dv || sinks) rep.note("attention: backward checked with a feature");
}

}  // namespace seqpar::fuzz
