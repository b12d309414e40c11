// The reference of brute_force.hpp.
#include "fuzz/brute_force.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace seqpar::fuzz {

using i64 = std::int64_t;
using i128 = __int128;

bool Visibility::key_seen(i64 b, i64 j) const {
  for (i64 i = 0; i < sq; ++i)
    if ((*this)(b, i, j)) return true;
  return false;
}

Visibility visibility(const AttentionProblem& p, i64 sq, i64 skv) {
  Visibility v;
  v.batch = std::max<i64>(p.batch, 0);
  v.sq = sq;
  v.skv = skv;
  v.seen.assign(static_cast<std::size_t>(v.batch * sq * skv), 0);
  v.row_keys.assign(static_cast<std::size_t>(v.batch * sq), 0);
  const i128 shift = p.causal_align == CausalAlign::bottom_right ? static_cast<i128>(skv) - sq : 0;
  std::vector<i64> doc(static_cast<std::size_t>(std::max(sq, skv)));
  for (i64 b = 0; b < v.batch; ++b) {
    // (a plan that accepts a wrong number of lists or counts is reported by the rules check;
    // the reference then reads no list for the batch elements past them)
    const std::size_t list_at = p.documents.size() == 1 ? 0 : static_cast<std::size_t>(b);
    const bool docs = list_at < p.documents.size();
    const bool padded = static_cast<std::size_t>(b) < p.kv_valid.size();
    if (docs) {  // the document of every position, by walking the cumulative lengths in 128 bits
      const auto& list = p.documents[list_at];
      i128 end = 0;
      std::size_t n = 0;
      for (i64 pos = 0; pos < static_cast<i64>(doc.size()); ++pos) {
        while (n < list.size() && pos >= end + list[n]) end += list[n++];
        // positions past every document get their own id (no pair across them is visible)
        doc[static_cast<std::size_t>(pos)] = n < list.size() ? static_cast<i64>(n) : -1 - pos;
      }
    }
    for (i64 i = 0; i < sq; ++i) {
      const i128 d = i + shift;
      i64 count = 0;
      for (i64 j = 0; j < skv; ++j) {
        bool s = true;
        if (p.causal && j > d) s = false;
        if (p.window.left >= 0 && j < d - p.window.left) s = false;
        if (p.window.right >= 0 && j > d + p.window.right) s = false;
        if (padded && j >= p.kv_valid[static_cast<std::size_t>(b)]) s = false;
        if (docs && doc[static_cast<std::size_t>(i)] != doc[static_cast<std::size_t>(j)]) s = false;
        v.seen[static_cast<std::size_t>((b * sq + i) * skv + j)] = s;
        count += s;
      }
      v.row_keys[static_cast<std::size_t>(b * sq + i)] = count;
    }
  }
  return v;
}

double softcapped(double s, double cap) { return cap > 0 ? cap * std::tanh(s / cap) : s; }

ReferenceResult reference_attention(const AttentionProblem& p, const Visibility& vis, const GlobalTensors& x,
                                    bool backward, const std::vector<float>& sinks) {
  const i64 B = vis.batch, Sq = vis.sq, Skv = vis.skv, H = p.heads, K = p.kv_heads == 0 ? p.heads : p.kv_heads;
  const i64 D = p.head_dim, Dv = p.head_dim_v == 0 ? D : p.head_dim_v, G = H / K;
  const double scale = p.scale != 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(D));
  const double ninf = -std::numeric_limits<double>::infinity(), inf = std::numeric_limits<double>::infinity();
  auto qi = [&](i64 b, i64 i, i64 h) { return static_cast<std::size_t>(((b * Sq + i) * H + h) * D); };
  auto oi = [&](i64 b, i64 i, i64 h) { return static_cast<std::size_t>(((b * Sq + i) * H + h) * Dv); };
  auto ki = [&](i64 b, i64 j, i64 h) { return static_cast<std::size_t>(((b * Skv + j) * K + h) * D); };
  auto vi = [&](i64 b, i64 j, i64 h) { return static_cast<std::size_t>(((b * Skv + j) * K + h) * Dv); };
  const bool with_sinks = !sinks.empty();
  ReferenceResult r;
  r.out.assign(static_cast<std::size_t>(B * Sq * H * Dv), 0.0);
  r.lo.assign(r.out.size(), 0.0);
  r.hi.assign(r.out.size(), 0.0);
  r.mag.assign(r.out.size(), 0.0);
  r.lse.assign(static_cast<std::size_t>(B * Sq * H), ninf);
  if (backward) {
    r.dq.assign(static_cast<std::size_t>(B * Sq * H * D), 0.0);
    r.dk.assign(static_cast<std::size_t>(B * Skv * K * D), 0.0);
    r.dv.assign(static_cast<std::size_t>(B * Skv * K * Dv), 0.0);
    r.dq_mag.assign(r.dq.size(), 0.0), r.dk_mag.assign(r.dk.size(), 0.0), r.dv_mag.assign(r.dv.size(), 0.0);
    if (with_sinks) r.d_sinks.assign(static_cast<std::size_t>(H), 0.0), r.d_sinks_mag.assign(static_cast<std::size_t>(H), 0.0);
  }
  // capped and scaled-only scores, and exp(s - max) of each
  std::vector<double> s(static_cast<std::size_t>(Skv)), raw(s.size()), ws(s.size());
  for (i64 b = 0; b < B; ++b)
    for (i64 h = 0; h < H; ++h) {
      const i64 kh = h / G;
      const double z = with_sinks ? static_cast<double>(sinks[static_cast<std::size_t>(h)]) : ninf;
      for (i64 i = 0; i < Sq; ++i) {
        double* o = &r.out[oi(b, i, h)];
        double& row_lse = r.lse[static_cast<std::size_t>((b * Sq + i) * H + h)];
        if (std::isnan(z)) {  // NaN joins every row of its head
          std::fill(o, o + Dv, z);
          row_lse = z;
          if (backward) r.d_sinks[static_cast<std::size_t>(h)] = z;
          continue;
        }
        if (z == inf) {  // the sink takes the whole row: O = 0, L = +inf, no gradient flows
          row_lse = inf;
          continue;
        }
        if (vis.keys(b, i) == 0) {  // O = 0, LSE = the sink (-inf without); Q is never read
          row_lse = z;
          continue;
        }
        const double* q = &x.q[qi(b, i, h)];
        double mx = z;
        for (i64 j = 0; j < Skv; ++j) {
          if (!vis(b, i, j)) continue;
          const double* k = &x.k[ki(b, j, kh)];
          double dot = 0;
          for (i64 e = 0; e < D; ++e) dot += q[e] * k[e];
          raw[static_cast<std::size_t>(j)] = dot * scale;
          s[static_cast<std::size_t>(j)] = softcapped(dot * scale, p.softcap);
          mx = std::max(mx, s[static_cast<std::size_t>(j)]);
        }
        double sum = z == ninf ? 0.0 : std::exp(z - mx);
        double* lo = &r.lo[oi(b, i, h)];
        double* hi = &r.hi[oi(b, i, h)];
        double* mag = &r.mag[oi(b, i, h)];
        std::fill(lo, lo + Dv, with_sinks ? 0.0 : inf);  // a sink scales the combination toward 0
        std::fill(hi, hi + Dv, with_sinks ? 0.0 : ninf);
        for (i64 j = 0; j < Skv; ++j) {
          if (!vis(b, i, j)) continue;
          const double w = ws[static_cast<std::size_t>(j)] = std::exp(s[static_cast<std::size_t>(j)] - mx);
          sum += w;
          const double* v = &x.v[vi(b, j, kh)];
          for (i64 e = 0; e < Dv; ++e) {
            o[e] += w * v[e];
            mag[e] += w * std::abs(v[e]);
            lo[e] = std::min(lo[e], v[e]);
            hi[e] = std::max(hi[e], v[e]);
          }
        }
        for (i64 e = 0; e < Dv; ++e) o[e] /= sum, mag[e] /= sum;
        const double lse = mx + std::log(sum);
        row_lse = lse;
        if (!backward) continue;
        const double* dout = &x.dout[oi(b, i, h)];
        double delta = 0, delta_mag = 0;
        for (i64 e = 0; e < Dv; ++e) delta += dout[e] * o[e], delta_mag += std::abs(dout[e] * o[e]);
        if (with_sinks) {
          const double share = std::exp(z - lse);
          r.d_sinks[static_cast<std::size_t>(h)] -= share * delta;
          r.d_sinks_mag[static_cast<std::size_t>(h)] += share * delta_mag;
        }
        for (i64 j = 0; j < Skv; ++j) {
          if (!vis(b, i, j)) continue;
          const double* k = &x.k[ki(b, j, kh)];
          const double* v = &x.v[vi(b, j, kh)];
          const double pr = ws[static_cast<std::size_t>(j)] / sum;
          double dp = 0, dp_mag = 0;
          for (i64 e = 0; e < Dv; ++e) dp += dout[e] * v[e], dp_mag += std::abs(dout[e] * v[e]);
          const double th = p.softcap > 0 ? std::tanh(raw[static_cast<std::size_t>(j)] / p.softcap) : 0.0;
          const double ds = pr * (dp - delta) * scale * (1 - th * th);
          const double ds_mag = pr * (dp_mag + delta_mag) * std::abs(scale);
          double* dq = &r.dq[qi(b, i, h)];
          double* dk = &r.dk[ki(b, j, kh)];
          double* dv = &r.dv[vi(b, j, kh)];
          double* dq_mag = &r.dq_mag[qi(b, i, h)];
          double* dk_mag = &r.dk_mag[ki(b, j, kh)];
          double* dv_mag = &r.dv_mag[vi(b, j, kh)];
          for (i64 e = 0; e < D; ++e) {
            dq[e] += ds * k[e];
            dk[e] += ds * q[e];
            dq_mag[e] += ds_mag * std::abs(k[e]);
            dk_mag[e] += ds_mag * std::abs(q[e]);
          }
          for (i64 e = 0; e < Dv; ++e) dv[e] += pr * dout[e], dv_mag[e] += pr * std::abs(dout[e]);
        }
      }
    }
  return r;
}

void NormError::add(double got, double want, i64 where, double magnitude) {
  const bool was_bad = bad;
  if (std::isinf(want) || std::isnan(want)) {
    if (!(got == want)) bad = true;  // -inf must be matched exactly (a NaN want never is)
  } else if (!std::isfinite(got)) {
    bad = true;
  } else {
    max_ref = std::max({max_ref, std::abs(want), magnitude});
    const double err = std::max(0.0, std::abs(got - want) - floor);
    if (err > max_err && !bad) {
      max_err = err;
      worst = where, worst_got = got, worst_want = want;
    }
  }
  if (bad && !was_bad) worst = where, worst_got = got, worst_want = want;
}

double NormError::value() const {
  if (bad) return std::numeric_limits<double>::infinity();
  return max_ref > 0 ? max_err / max_ref : max_err;
}

}  // namespace seqpar::fuzz
