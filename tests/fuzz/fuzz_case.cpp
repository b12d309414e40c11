// The seeded case generator, the case descriptions and the documented rules as a model
// (fuzz_case.hpp). The generator aims most cases at problems a plan must accept (so that the
// forward and backward get checked) and mutates the rest toward edge values.
#include "fuzz/fuzz_case.hpp"

#include <algorithm>
#include <initializer_list>
#include <cmath>
#include <limits>
#include <chrono>
#include <sstream>

namespace seqpar::fuzz {

std::pair<int, int> model_mesh(const PolicyChoice& p, int world) {
  if (p.kind == PolicyKind::ulysses) return {world, 1};
  if (p.kind == PolicyKind::ring) return {1, world};
  const int u = p.ulysses_degree, r = p.ring_degree;
  if (u < 0 || r < 0 || (u == 0 && r == 0)) return {0, 0};
  if (u == 0) return world % r == 0 ? std::pair{world / r, r} : std::pair{0, 0};
  if (r == 0) return world % u == 0 ? std::pair{u, world / u} : std::pair{0, 0};
  return static_cast<i64>(u) * r == world ? std::pair{u, r} : std::pair{0, 0};
}

std::pair<int, int> model_coords(const PolicyChoice& p, int U, int R, int w) {
  const bool ua = p.kind != PolicyKind::unified || p.placement == MeshPlacement::ulysses_adjacent;
  return ua ? std::pair{w / U, w % U} : std::pair{w % R, w / R};
}

namespace {

constexpr i64 kMax = std::numeric_limits<i64>::max();
constexpr i64 kMin = std::numeric_limits<i64>::min();
constexpr i64 kHuge = i64{1} << 61;  // sides and lengths above this are "huge" (known classes a and e)

/// Integers at the ends of the 64-bit range and around `s`.
i64 edge_value(Rng& r, i64 s) {
  const std::vector<i64> v{0, 1, -1, -2, s - 1, s, s + 1, kMax, kMin, kMax - 1, i64{1} << 62, kMax / 2 + 1};
  return r.pick(v);
}

/// A random split of `total` into `n` non-negative parts (zero_heavy: most parts 0).
std::vector<i64> random_split(Rng& r, i64 total, int n, bool zero_heavy) {
  std::vector<i64> parts(static_cast<std::size_t>(n), 0);
  if (n == 0) return parts;
  if (zero_heavy) {
    const int a = static_cast<int>(r.range(0, n - 1)), b = static_cast<int>(r.range(0, n - 1));
    const i64 cut = r.range(0, total);
    parts[static_cast<std::size_t>(a)] += cut;
    parts[static_cast<std::size_t>(b)] += total - cut;
    return parts;
  }
  for (i64 t = 0; t < total; ++t) ++parts[static_cast<std::size_t>(r.range(0, n - 1))];
  return parts;
}

/// `total` split into positive document lengths (1 to 6 documents; none when total is 0).
std::vector<i64> random_documents(Rng& r, i64 total) {
  std::vector<i64> docs;
  i64 left = total;
  const i64 count = std::min<i64>(total, r.range(1, 6));
  for (i64 d = 0; d + 1 < count; ++d) {
    const i64 n = r.range(1, left - (count - 1 - d));
    docs.push_back(n);
    left -= n;
  }
  if (left > 0) docs.push_back(left);
  return docs;
}

/// Splits `total` as evenly as possible into `parts` (the first total mod parts one more).
std::vector<i64> even(i64 total, i64 parts) {
  std::vector<i64> out(static_cast<std::size_t>(parts), total / parts);
  for (i64 i = 0; i < total % parts; ++i) ++out[static_cast<std::size_t>(i)];
  return out;
}

/// Per world rank: the lengths of mesh split `per_mesh` (indexed r * U + u).
std::vector<i64> to_world(const PolicyChoice& p, int U, int R, const std::vector<i64>& per_mesh) {
  std::vector<i64> out(per_mesh.size());
  for (int w = 0; w < U * R; ++w) {
    const auto [r, u] = model_coords(p, U, R, w);
    out[static_cast<std::size_t>(w)] = per_mesh[static_cast<std::size_t>(r * U + u)];
  }
  return out;
}

/// The layout's own split of `total`: ring blocks as even as possible, each block's pieces too.
std::vector<i64> mesh_split(i64 total, int U, int R) {
  std::vector<i64> out;
  for (i64 block : even(total, R))
    for (i64 piece : even(block, U)) out.push_back(piece);
  return out;
}

PolicyChoice random_policy(Rng& r, int world, const GenOptions& o) {
  PolicyChoice p;
  p.kind = static_cast<PolicyKind>(r.range(0, 2));
  p.layout = static_cast<LayoutKind>(r.range(0, 2));
  p.anything = r.chance(0.5);
  if (p.kind == PolicyKind::unified) {
    std::vector<int> divisors;
    for (int d = 1; d <= world; ++d)
      if (world % d == 0) divisors.push_back(d);
    if (r.chance(0.88)) {
      const int u = r.pick(divisors), form = static_cast<int>(r.range(0, 2));
      p.ulysses_degree = form == 1 ? 0 : u;
      p.ring_degree = form == 0 ? 0 : world / u;
    } else {
      std::vector<int> bad{-1, 0, 1, 2, 3, world, world + 1, std::numeric_limits<int>::max(), 65536};
      if (o.skips('p')) bad.resize(bad.size() - 2);  // degrees whose product passes 2^31
      p.ulysses_degree = r.pick(bad);
      p.ring_degree = r.pick(bad);
    }
    p.placement = r.chance(0.5) ? MeshPlacement::ulysses_adjacent : MeshPlacement::ring_adjacent;
    if (r.chance(0.03)) p.placement = static_cast<MeshPlacement>(r.range(2, 9));
  }
  return p;
}

/// A scale the float path computes exactly enough for the tolerances (0: the default).
double tame_scale(Rng& r, i64 D) {
  const double s = 1.0 / std::sqrt(static_cast<double>(std::max<i64>(D, 1)));
  const std::vector<double> v{0.0, 0.0, 0.0, s, 0.5 * s, 2.5 * s, -s, -0.3 * s, 5e-324, 1e-300, 1e-30, 0.01};
  return r.pick(v);
}

/// Edge scales: NaN, infinities, values past the float range, huge and denormal.
double edge_scale(Rng& r) {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> v{std::nan(""), inf, -inf, 1e300, -1e300, std::numeric_limits<double>::max(), 4e38,
                              1e38, 1e20, 1e5, -1e5, std::numeric_limits<double>::min(), 5e-324, -5e-324};
  return r.pick(v);
}

/// A legal value head dim D_v for head dim D: equal (0 or D), narrower, wider.
i64 value_dim(Rng& r, i64 D) {
  const std::vector<i64> v{0, D, 1, std::max<i64>(1, D / 2), std::max<i64>(1, D - 1), D + 1, 2 * D, 16, 33};
  return r.pick(v);
}

/// A soft-cap: ones that bite (the scores reach a few units), now and then the ends of the legal
/// range (0 off, 2^-32 and 2^32), and values past them the rules refuse (denormal, huge).
double softcap_value(Rng& r) {
  if (r.chance(0.8)) return r.pick(std::vector<double>{0.5, 1.0, 2.0, 5.0, 30.0, 50.0});
  return r.pick(std::vector<double>{-0.0, 0x1p-32, 1e-5, 1e5, 0x1p32, 5e-324, 1e-300, 1e-30, 1e30, 1e300,
                                    std::numeric_limits<double>::max()});
}

/// A value the rules refuse for a soft-cap.
double bad_softcap(Rng& r) {
  const double inf = std::numeric_limits<double>::infinity();
  return r.pick(std::vector<double>{std::nan(""), inf, -inf, -1.0, -5e-324, -std::numeric_limits<double>::max()});
}

/// A head dim of V that is refused: negative, or so wide that the sizes pass 2^58 bytes.
i64 bad_value_dim(Rng& r) {
  return r.pick(std::vector<i64>{-1, kMin, kMax, i64{1} << 40, i64{1} << 55, i64{1} << 62});
}

/// One sink logit per head: mostly moderate, some that dominate the row or vanish in it.
std::vector<float> sink_values(Rng& r, i64 heads) {
  std::vector<float> s(static_cast<std::size_t>(std::clamp<i64>(heads, 0, 4096)));
  for (float& x : s) x = r.chance(0.85) ? static_cast<float>(r.unit() * 8 - 4) : r.pick(std::vector<float>{30.0f, -30.0f, 0.0f});
  return s;
}

/// Sinks past the finite values (the plan cannot see them, a call reads them): one head or
/// every head NaN, +inf, -inf, or the float range's ends.
void poison_sinks(Rng& r, std::vector<float>& s) {
  if (s.empty()) return;
  const float inf = std::numeric_limits<float>::infinity(), big = std::numeric_limits<float>::max();
  const float v = r.pick(std::vector<float>{std::numeric_limits<float>::quiet_NaN(), inf, -inf, big, -big});
  if (r.chance(0.5)) s[static_cast<std::size_t>(r.range(0, static_cast<i64>(s.size()) - 1))] = v;
  else std::fill(s.begin(), s.end(), v);
}

/// Clamps what the skipped known classes need out of an attention case.
void apply_skips(AttentionCase& c, const GenOptions& o) {
  AttentionProblem* probs[2] = {&c.problem, &c.other_problem};
  for (AttentionProblem* p : probs) {
    if (o.skips('a')) {  // huge window sides: use a finite side past the sequence instead
      if (p->window.left > kHuge) p->window.left = 1000;
      if (p->window.right > kHuge) p->window.right = 1000;
    }
    if (o.skips('e'))  // documents whose lengths sum past 2^63: drop them
      for (auto& list : p->documents)
        if (std::any_of(list.begin(), list.end(), [](i64 n) { return n > kHuge; })) p->documents.clear();
  }
  for (AttentionProblem* p : probs) {
    if (o.skips('r') && p->softcap > 0 && (p->softcap < 0x1p-32 || p->softcap > 0x1p32)) p->softcap = 5.0;
    if (o.skips('s') && p->head_dim_v > (i64{1} << 40) && p->batch == 0) p->batch = 1;  // the size rules refuse it
  }
  if (o.skips('k'))  // scores past the float range
    for (AttentionProblem* p : probs)
      if (std::abs(p->scale) > 1e30) p->scale = std::copysign(1e5, p->scale);
  if (o.skips('l'))
    for (LocalLengths& l : c.lengths) l.kv = std::max<i64>(l.kv, -1);
  if (o.skips('m')) {
    if (static_cast<i64>(c.policy.placement) > 1) c.policy.placement = MeshPlacement::ring_adjacent;
    if (static_cast<int>(c.problem.dtype) > 3) c.problem.dtype = DType::f32;
  }
  if (o.skips('n') && c.kernel == KernelKind::cpu_flash_2 && (c.problem.batch == 0 || c.other_problem.batch == 0))
    c.kernel = KernelKind::cpu_flash_1;
  if (o.skips('c')) c.nan_hidden_q = false;
  if (o.skips('q') && c.problem.batch > (i64{1} << 30)) c.problem.batch = 2;  // scratch past memory
  if (o.skips('o') && total_q(c) == 0 && total_kv(c) == 0 && c.problem.batch > (i64{1} << 40)) c.problem.batch = 0;
  if (o.skips('f') && c.kernel == KernelKind::causal_only && c.problem.has_extra_mask()) c.kernel = KernelKind::reference;
  // last: the model names the first rule a case breaks
  if (o.skips('j') && attention_model_reason(c) == "stripe lengths that do not follow from the total")
    c.policy.layout = LayoutKind::contiguous;
  if (o.skips('i') && (c.disagree_field == "documents" || c.disagree_field == "kv_valid")) {
    c.disagree_rank = -1;
    c.disagree_field.clear();
  }
}

/// The problem's masks, valid for sequence lengths sq, skv and batch B.
void random_masks(Rng& r, AttentionProblem& p, i64 sq, i64 skv) {
  p.causal = r.chance(0.5);
  p.causal_align = r.chance(0.5) ? CausalAlign::top_left : CausalAlign::bottom_right;
  const i64 s = std::max(sq, skv);
  auto side = [&] {
    const std::vector<i64> v{-1, -1, -1, 0, 1, 2, r.range(0, s + 1), s - 1 < 0 ? 0 : s - 1, s, s + 1, kMax, kMax - 1,
                             i64{1} << 62, i64{1} << 40, kHuge - 1, std::numeric_limits<int>::max()};
    return r.pick(v);
  };
  if (r.chance(0.4)) p.window = {side(), side()};
  const i64 B = std::max<i64>(p.batch, 0);
  if (sq == skv && r.chance(0.3)) {
    const i64 lists = B > 1 && r.chance(0.5) ? B : 1;
    for (i64 b = 0; b < lists; ++b) p.documents.push_back(random_documents(r, sq));
  }
  if (r.chance(0.25))
    for (i64 b = 0; b < B; ++b) p.kv_valid.push_back(r.chance(0.3) ? r.pick(std::vector<i64>{0, skv}) : r.range(0, skv));
}

/// One edge mutation of an attention case (most of them make the plan refuse).
void mutate_attention(Rng& r, AttentionCase& c, i64 sq, i64 skv, const GenOptions& o) {
  AttentionProblem& p = c.problem;
  const i64 s = std::max(sq, skv);
  switch (r.range(0, 15)) {
    case 13: p.softcap = bad_softcap(r); break;
    case 14: p.head_dim_v = bad_value_dim(r); break;
    case 15:
      if (c.sinks.empty()) c.sinks = sink_values(r, p.heads);
      poison_sinks(r, c.sinks);
      break;
    case 0: p.batch = r.pick(std::vector<i64>{0, 0, -1, kMax, kMin, i64{1} << 40}); break;
    case 1:
      if (r.chance(0.5)) p.heads = r.pick(std::vector<i64>{0, -1, kMax, kMin, i64{1} << 40});
      else p.kv_heads = r.pick(std::vector<i64>{-1, p.heads + 1, p.heads > 2 ? p.heads - 1 : 3, kMin, kMax});
      break;
    case 2: p.head_dim = r.pick(std::vector<i64>{0, -1, kMax, kMin, i64{1} << 40, i64{1} << 20}); break;
    case 3: p.scale = edge_scale(r); break;
    case 4: p.causal_align = static_cast<CausalAlign>(r.range(2, 255)); break;
    case 5:
      (r.chance(0.5) ? p.window.left : p.window.right) =
          r.pick(std::vector<i64>{-2, kMin, kMax, kMax - 1, i64{1} << 62, s - 1, s, s + 1});
      break;
    case 6: {
      p.documents = {random_documents(r, sq)};
      auto& d = p.documents[0];
      switch (r.range(0, 5)) {
        case 0: d.push_back(0); break;
        case 1: d.insert(d.begin(), -1); d.push_back(1); break;
        case 2: d.push_back(1); break;  // sums to S + 1
        case 3: p.documents = {{kMax, kMax, 18}}; break;  // wraps to 16
        case 4: p.documents.assign(static_cast<std::size_t>(std::clamp<i64>(p.batch, 0, 4) + 1), d); break;
        default: p.documents.push_back({kMax}); break;
      }
      break;
    }
    case 7:
      p.kv_valid.assign(static_cast<std::size_t>(std::clamp<i64>(p.batch, 0, 4)), skv);
      if (p.kv_valid.empty() || r.chance(0.3)) p.kv_valid.push_back(1);
      else p.kv_valid[0] = r.pick(std::vector<i64>{-1, skv + 1, kMax, kMin});
      break;
    case 8: {
      const auto w = static_cast<std::size_t>(r.range(0, c.world - 1));
      if (r.chance(0.3) && c.world > 1 && !o.skips('o')) {  // two lengths whose sum passes 2^63
        c.lengths[0].q = kMax / 2 + 1;
        c.lengths[1].q = kMax / 2 + 1;
      } else if (r.chance(0.5)) {
        c.lengths[w].q = edge_value(r, c.lengths[w].q);
      } else {
        c.lengths[w].kv = r.pick(std::vector<i64>{-2, kMin, kMax, kMax - 1, 0});
      }
      if (r.chance(0.3)) p.batch = 0;  // an empty batch makes every size 0: only the lengths are left to check
      break;
    }
    case 9:
      c.typed_plan = false;
      p.dtype = r.chance(0.5) ? static_cast<DType>(r.range(4, 255))
                              : r.pick(std::vector<DType>{DType::f16, DType::bf16, DType::f32, DType::f64});
      break;
    case 10: {  // one rank plans another value of one field (made last, by disagree())
      if (c.world < 2) break;
      c.disagree_rank = static_cast<int>(r.range(1, c.world - 1));
      const std::vector<std::string> fields{"batch",        "heads",       "head_dim",     "causal",    "scale",
                                            "with_lse",     "causal_align", "window.left", "window.right", "documents",
                                            "kv_valid",     "head_dim_v",  "softcap",      "sinks"};
      c.disagree_field = r.pick(fields);
      break;
    }
    case 11: {
      if (c.policy.kind != PolicyKind::unified || c.world < 2) break;
      c.mesh_disagree_rank = static_cast<int>(r.range(1, c.world - 1));
      c.other_policy = c.policy;
      if (r.chance(0.5)) std::swap(c.other_policy.ulysses_degree, c.other_policy.ring_degree);
      if (c.other_policy.ulysses_degree == c.policy.ulysses_degree) c.other_policy.ulysses_degree += 1;
      break;
    }
    default:
      if (c.policy.kind == PolicyKind::unified) c.policy.placement = static_cast<MeshPlacement>(r.range(2, 9));
      break;
  }
}

/// The disagreeing rank's problem: the final problem with one field set to another value
/// (made after every other change, so that nothing can make the two equal again).
void disagree(AttentionCase& c) {
  if (c.disagree_rank < 0) return;
  const AttentionProblem& p = c.problem;
  AttentionProblem& o = c.other_problem = p;
  const std::string& f = c.disagree_field;
  if (f == "batch") o.batch = p.batch == 1 ? 2 : 1;
  else if (f == "heads") o.heads = p.heads == 2 ? 4 : 2;
  else if (f == "head_dim") o.head_dim = p.head_dim == 8 ? 16 : 8;
  else if (f == "causal") o.causal = !p.causal;
  else if (f == "scale") o.scale = p.softmax_scale() == 0.5 ? 0.25 : 0.5;
  else if (f == "with_lse") o.with_lse = !p.with_lse;
  else if (f == "causal_align")
    o.causal_align = p.causal_align == CausalAlign::top_left ? CausalAlign::bottom_right : CausalAlign::top_left;
  else if (f == "window.left") o.window.left = p.window.left == 3 ? 4 : 3;
  else if (f == "window.right") o.window.right = p.window.right == 3 ? 4 : 3;
  else if (f == "head_dim_v") o.head_dim_v = p.value_dim() == 8 ? 16 : 8;
  else if (f == "softcap") o.softcap = p.softcap == 1.0 ? 2.0 : 1.0;
  else if (f == "sinks") c.other_sinks = c.sinks.empty();
  else if (f == "documents") o.documents = p.documents == std::vector<std::vector<i64>>{{1}} ? std::vector<std::vector<i64>>{{2}} : std::vector<std::vector<i64>>{{1}};
  else o.kv_valid.push_back(3);
}

AttentionCase make_attention(Rng& r, const GenOptions& o) {
  AttentionCase c;
  c.world = r.pick(std::vector<int>{1, 1, 2, 2, 2, 3, 4, 4, 5, 6, 7, 8});
  c.policy = random_policy(r, c.world, o);
  c.kernel = static_cast<KernelKind>(r.pick(std::vector<int>{0, 0, 0, 1, 1, 1, 2, 2, 2, 3}));
  c.isa = r.range(-1, 2);
  c.f64 = r.chance(0.35);
  c.data_seed = r.next();
  AttentionProblem& p = c.problem;
  p.batch = r.pick(std::vector<i64>{1, 1, 1, 2, 2, 3, 0});
  // Plain ints, not a structured binding: the lambdas below capture them (Clang before 16
  // cannot capture a binding).
  const auto mesh = model_mesh(c.policy, c.world);
  const int U = mesh.first, R = mesh.second;
  const int Ug = std::max(U, 1), Rg = std::max(R, 1);
  const bool plain = !c.policy.anything;
  p.heads = r.pick(std::vector<i64>{1, 2, 3, 4, 6, 8});
  if (plain) p.heads = Ug * r.range(1, 2);
  std::vector<i64> divisors;
  for (i64 d = 1; d <= p.heads; ++d)
    if (p.heads % d == 0) divisors.push_back(d);
  const int kv_form = static_cast<int>(r.range(0, 3));
  p.kv_heads = kv_form == 0 ? 0 : kv_form == 1 ? p.heads : kv_form == 2 ? r.pick(divisors) : 1;
  p.head_dim = r.pick(std::vector<i64>{1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 79, 80});
  // Now and then a sequence of several key and query tiles (the CPU kernel's blocks are 64-128
  // rows), with few heads and a small head dim, so that the reference stays quick.
  const bool long_seq = r.chance(0.08);
  const i64 width = long_seq ? 64 : 256;
  if (p.heads * p.head_dim > width) p.head_dim = std::max<i64>(1, width / p.heads);
  p.scale = tame_scale(r, p.head_dim);
  p.with_lse = r.chance(0.7);
  // Today's models' features, each alone or with the others: D_v (as wide as the rows allow),
  // a soft-cap, sinks.
  if (r.chance(0.3)) p.head_dim_v = std::min(value_dim(r, p.head_dim), std::max<i64>(1, width / p.heads));
  if (r.chance(0.25)) p.softcap = softcap_value(r);
  if (r.chance(0.25)) c.sinks = sink_values(r, p.heads);

  // Lengths: plain policies need equal lengths (zigzag: even blocks); Anything takes any split.
  i64 sq, skv;
  std::vector<i64> q_world, kv_world;
  const int P = c.world;
  if (plain) {
    i64 local = long_seq ? r.range(100, 320) / P : r.pick(std::vector<i64>{0, 1, 2, 3, 4, 5, 8, 12, 16, 25});
    if (!long_seq)
      while (local * P > 100 && local > 1) local /= 2;
    if (c.policy.layout == LayoutKind::zigzag && (local * Ug) % 2 != 0) ++local;
    sq = skv = local * P;
    q_world.assign(static_cast<std::size_t>(P), local);
    kv_world = q_world;
  } else {
    auto one = [&](i64 total) {
      const int form = static_cast<int>(r.range(0, 9));
      if (form < 5 || U == 0) return U == 0 ? random_split(r, total, P, false) : to_world(c.policy, Ug, Rg, mesh_split(total, Ug, Rg));
      return random_split(r, total, P, form == 9);
    };
    sq = long_seq ? r.range(100, 320) : r.pick(std::vector<i64>{0, 1, 2, 3, 5, 7, 16, 17, 31, 33, 64, 100, r.range(0, 100)});
    skv = r.chance(0.3) ? (long_seq ? r.range(1, 320) : r.pick(std::vector<i64>{0, 1, 5, 16, 33, 80, r.range(0, 100)})) : sq;
    q_world = one(sq);
    kv_world = skv == sq && r.chance(0.6) ? q_world : one(skv);
  }
  for (int w = 0; w < P; ++w) {
    const i64 q = q_world[static_cast<std::size_t>(w)], kv = kv_world[static_cast<std::size_t>(w)];
    c.lengths.push_back({q, kv == q && r.chance(0.5) ? -1 : kv});
  }
  random_masks(r, p, sq, skv);
  c.backward = p.with_lse && r.chance(0.4);
  c.nan_hidden_kv = r.chance(0.4);
  c.nan_hidden_q = r.chance(0.2);
  if (r.chance(0.35)) {
    mutate_attention(r, c, sq, skv, o);
    if (r.chance(0.3)) mutate_attention(r, c, sq, skv, o);
  }
  apply_skips(c, o);
  disagree(c);
  return c;
}

DecodeCase make_decode(Rng& r, const GenOptions& o) {
  DecodeCase c;
  c.world = static_cast<int>(r.range(1, 8));
  c.kernel = static_cast<KernelKind>(r.pick(std::vector<int>{0, 0, 1, 1, 2}));
  c.isa = r.range(-1, 2);
  c.f64 = r.chance(0.3);
  c.data_seed = r.next();
  DecodeProblem& p = c.problem;
  p.batch = r.pick(std::vector<i64>{1, 1, 2, 3});
  p.heads = r.range(1, 8);
  std::vector<i64> divisors;
  for (i64 d = 1; d <= p.heads; ++d)
    if (p.heads % d == 0) divisors.push_back(d);
  const int kv_form = static_cast<int>(r.range(0, 3));
  p.kv_heads = kv_form == 0 ? 0 : kv_form == 1 ? p.heads : kv_form == 2 ? r.pick(divisors) : 1;
  p.head_dim = r.pick(std::vector<i64>{1, 2, 3, 8, 16, 17, 33, 64, 80});
  p.new_tokens = r.pick(std::vector<i64>{1, 1, 2, 3, 4, 8, 16});
  c.steps = static_cast<int>(r.range(1, 3));
  // Now and then a long cache (CpuFlashKernel splits a group's keys over its threads).
  const bool long_cache = r.chance(0.1);
  if (long_cache) p.head_dim = std::min<i64>(p.head_dim, 16);
  for (i64 b = 0; b < p.batch; ++b) p.kv_len.push_back(r.chance(0.2) ? 0 : r.range(0, long_cache ? 3000 : 120));
  const i64 longest = *std::max_element(p.kv_len.begin(), p.kv_len.end());
  p.capacity = longest + p.new_tokens * c.steps + r.pick(std::vector<i64>{0, 0, 1, 5});
  p.page = r.pick(std::vector<i64>{0, 0, 1, 2, 3, 16, 64, 1000});
  p.exchange = r.chance(0.5) ? DecodeExchange::all_gather : DecodeExchange::heads;
  p.scale = r.chance(0.6) ? 0.0 : tame_scale(r, p.head_dim);
  p.dtype = c.f64 ? DType::f64 : DType::f32;
  // Today's models' features: D_v (now and then V a column view of K's rows, MLA's latent
  // cache, which needs D_v <= D), a soft-cap, sinks.
  if (r.chance(0.3)) p.head_dim_v = value_dim(r, p.head_dim);
  c.v_in_k = p.head_dim_v <= p.head_dim && r.chance(0.4);
  if (r.chance(0.25)) p.softcap = softcap_value(r);
  if (r.chance(0.25)) c.sinks = sink_values(r, p.heads);
  if (r.chance(0.35)) {
    switch (r.range(0, 13)) {
      case 11: p.softcap = bad_softcap(r); break;
      case 12:
        p.head_dim_v = bad_value_dim(r);
        c.v_in_k = false;
        break;
      case 13:
        if (c.sinks.empty()) c.sinks = sink_values(r, p.heads);
        poison_sinks(r, c.sinks);
        break;
      case 0: p.batch = r.pick(std::vector<i64>{0, -1, kMin}); break;
      case 1: p.heads = r.pick(std::vector<i64>{0, -1}); break;
      case 2: p.kv_heads = r.pick(std::vector<i64>{-1, p.heads + 1, kMin}); break;
      case 3: p.head_dim = r.pick(std::vector<i64>{0, -1, kMin}); break;
      case 4: p.new_tokens = r.pick(std::vector<i64>{0, -1, 17, kMax, kMin}); break;
      case 5: p.page = r.pick(std::vector<i64>{-1, kMin, kMax, kMax - 1}); break;
      case 6:
        if (r.chance(0.3)) p.kv_len.push_back(1);
        else p.kv_len[0] = r.pick(std::vector<i64>{-1, kMin, p.capacity - p.new_tokens + 1, kMax, kMax - 1});
        break;
      case 7:
        if (r.chance(0.5)) p.capacity = r.pick(std::vector<i64>{0, -1, longest, kMin});
        else {  // a huge cache: kv_len + new_tokens may pass 2^63
          p.capacity = kMax;
          p.kv_len[0] = r.pick(std::vector<i64>{kMax - 1, kMax - p.new_tokens, kMax - p.new_tokens + 1});
          if (p.new_tokens == 1) p.new_tokens = 2;
        }
        break;
      case 8: p.scale = edge_scale(r); break;
      case 9: p.exchange = static_cast<DecodeExchange>(r.range(2, 255)); break;
      default: p.dtype = r.chance(0.5) ? static_cast<DType>(r.range(4, 255)) : DType::f16; break;
    }
  }
  if (o.skips('k') && std::abs(p.scale) > 1e30) p.scale = std::copysign(1e5, p.scale);
  if (o.skips('m') && static_cast<int>(p.dtype) > 3) p.dtype = DType::f32;
  if (o.skips('r') && p.softcap > 0 && (p.softcap < 0x1p-32 || p.softcap > 0x1p32)) p.softcap = 5.0;
  if (o.skips('h')) {
    if (!std::isfinite(p.scale)) p.scale = 0.0;
    if (static_cast<int>(p.exchange) > 1) p.exchange = DecodeExchange::all_gather;
  }
  if (o.skips('e'))  // kv_len + new_tokens past 2^63
    for (i64& l : p.kv_len)
      if (p.new_tokens > 0 && l > kMax - p.new_tokens) l = p.capacity > kHuge ? 0 : -1;
  if (c.world > 1 && r.chance(0.04)) {  // one rank plans another value of a feature
    c.disagree_rank = static_cast<int>(r.range(1, c.world - 1));
    c.disagree_field = r.pick(std::vector<std::string>{"head_dim_v", "softcap", "sinks", "scale"});
    DecodeProblem& other = c.other_problem = p;
    if (c.disagree_field == "head_dim_v") other.head_dim_v = p.value_dim() == 8 ? 16 : 8;
    else if (c.disagree_field == "softcap") other.softcap = p.softcap == 1.0 ? 2.0 : 1.0;
    else if (c.disagree_field == "scale") other.scale = p.scale == 0.5 ? 0.25 : 0.5;
  }

  // advance(k) probes, tried on a copy of the plan before each step.
  const i64 lo = p.kv_len.empty() ? 0 : *std::min_element(p.kv_len.begin(), p.kv_len.end());
  const i64 hi = p.kv_len.empty() ? 0 : *std::max_element(p.kv_len.begin(), p.kv_len.end());
  for (int s = 0; s < c.steps; ++s) {
    if (!r.chance(0.5)) continue;
    std::vector<i64> ks{0, 1, p.new_tokens, -1, kMin};
    const bool half = p.batch > 1 && lo < hi;  // fits the shorter sequences only
    if (!o.skips('b')) {
      ks.insert(ks.end(), {kMax, kMax - 1, p.capacity - lo, p.capacity - hi + 1});
      if (half && !p.kv_len.empty()) ks.push_back(p.capacity - p.kv_len[0]);
    }
    ks.push_back(std::max<i64>(0, p.capacity - hi - p.new_tokens * c.steps));  // fits every sequence
    c.advance_probes.push_back(r.pick(ks));
  }
  if (!o.skips('g')) {
    const i64 cap = p.capacity;
    for (int n = static_cast<int>(r.range(0, 3)); n > 0; --n) {
      const std::vector<i64> pos{-1, -2, cap, cap + 1 > cap ? cap + 1 : cap, kMax, kMin};
      c.position_probes.push_back({r.range(0, std::max<i64>(p.batch, 1) - 1), r.pick(pos)});
    }
    if (r.chance(0.15)) c.position_probes.push_back({r.pick(std::vector<i64>{-1, p.batch, kMax}), 0});
  }
  return c;
}

TimeoutCase make_timeout(Rng& r, const GenOptions& o) {
  TimeoutCase c;
  c.world = static_cast<int>(r.range(1, 4));
  const i64 above = 9'300'000'000'000;  // past the ~9.2e12 ms at which a steady_clock deadline wraps
  std::vector<i64> v{kMax, std::chrono::milliseconds::max().count(), above, i64{1} << 62, 1'000'000'000'000'000,
                     r.range(1'000'000'000'000, kMax), 5000, 60000, 9'000'000'000'000};
  if (o.skips('d')) v = {5000, 60000, 1'000'000'000, 9'000'000'000'000};
  c.timeout_ms = r.pick(v);
  if (r.chance(0.3)) {
    c.via_env = true;
    const std::vector<std::string> valid{std::to_string(c.timeout_ms), "0", "120000"};
    const std::vector<std::string> invalid{"-5", "abc", "99999999999999999999", "1e3", " 5", "5ms", "+7"};
    c.env_valid = r.chance(0.6);
    c.env_text = c.env_valid ? r.pick(valid) : r.pick(invalid);
  }
  return c;
}

std::string list(const std::vector<i64>& v) {
  std::string s = "{";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "}";
}

std::string problem_text(const AttentionProblem& p) {
  std::ostringstream os;
  os << "B=" << p.batch << " H=" << p.heads << " K=" << p.kv_heads << " D=" << p.head_dim << " causal=" << p.causal
     << " align=" << static_cast<int>(p.causal_align) << " window={" << p.window.left << "," << p.window.right
     << "} documents={";
  for (std::size_t i = 0; i < p.documents.size(); ++i) os << (i ? "," : "") << list(p.documents[i]);
  os << "} kv_valid=" << list(p.kv_valid) << " scale=" << p.scale << " dtype=" << static_cast<int>(p.dtype)
     << " with_lse=" << p.with_lse << " Dv=" << p.head_dim_v << " softcap=" << p.softcap;
  return os.str();
}

std::string floats(const std::vector<float>& v) {
  std::ostringstream os;
  os << "{";
  for (std::size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
  os << "}";
  return os.str();
}

}  // namespace

std::string policy_name(const PolicyChoice& p) {
  const std::string layout = p.layout == LayoutKind::contiguous ? "Contiguous" : p.layout == LayoutKind::zigzag ? "Zigzag" : "Stripe";
  std::string base = p.kind == PolicyKind::ulysses ? "UlyssesPolicy"
                     : p.kind == PolicyKind::ring  ? "RingPolicy<" + layout + ">"
                                                   : "UnifiedPolicy<" + layout + ">{" + std::to_string(p.ulysses_degree) +
                                                         "," + std::to_string(p.ring_degree) + ",placement " +
                                                         std::to_string(static_cast<i64>(p.placement)) + "}";
  return p.anything ? "AnythingPolicy<" + base + ">" : base;
}

std::string kernel_name(KernelKind k, int isa) {
  const std::string i = isa < 0 ? "auto" : isa == 0 ? "vec128" : isa == 1 ? "avx2" : "avx512";
  switch (k) {
    case KernelKind::reference: return "ReferenceKernel";
    case KernelKind::cpu_flash_1: return "CpuFlashKernel(1," + i + ")";
    case KernelKind::cpu_flash_2: return "CpuFlashKernel(2," + i + ")";
    default: return "CausalOnlyKernel";
  }
}

FuzzCase make_case(std::uint64_t seed, std::uint64_t index, const GenOptions& options) {
  Rng r(seed * 0x9E3779B97F4A7C15ull ^ (index + 1) * 0xD1B54A32D192ED03ull);
  FuzzCase c;
  const double u = r.unit();
  c.kind = options.only >= 0 ? static_cast<CaseKind>(options.only)
           : u < 0.72        ? CaseKind::attention
           : u < 0.96        ? CaseKind::decode
                             : CaseKind::timeout;
  if (c.kind == CaseKind::attention) c.attention = make_attention(r, options);
  else if (c.kind == CaseKind::decode) c.decode = make_decode(r, options);
  else c.timeout = make_timeout(r, options);
  return c;
}

std::string describe(const FuzzCase& fc) {
  std::ostringstream os;
  if (fc.kind == CaseKind::attention) {
    const AttentionCase& c = fc.attention;
    os << "attention world=" << c.world << " policy=" << policy_name(c.policy) << " kernel=" << kernel_name(c.kernel, c.isa)
       << " T=" << (c.f64 ? "double" : "float") << (c.typed_plan ? " plan<T>" : " plan(problem)") << " "
       << problem_text(c.problem) << " sinks=" << (c.sinks.empty() ? "none" : floats(c.sinks)) << " lengths(q/kv)=[";
    for (std::size_t w = 0; w < c.lengths.size(); ++w) os << (w ? " " : "") << c.lengths[w].q << "/" << c.lengths[w].kv;
    os << "] backward=" << c.backward << " nan_kv=" << c.nan_hidden_kv << " nan_q=" << c.nan_hidden_q;
    if (c.disagree_rank >= 0)
      os << " [rank " << c.disagree_rank << " plans " << c.disagree_field << " differently: " << problem_text(c.other_problem)
         << (c.disagree_field == "sinks" ? (c.other_sinks ? " with sinks" : " without sinks") : "") << "]";
    if (c.mesh_disagree_rank >= 0)
      os << " [rank " << c.mesh_disagree_rank << " constructs " << policy_name(c.other_policy) << "]";
  } else if (fc.kind == CaseKind::decode) {
    const DecodeCase& c = fc.decode;
    const DecodeProblem& p = c.problem;
    os << "decode world=" << c.world << " kernel=" << kernel_name(c.kernel, c.isa) << " T=" << (c.f64 ? "double" : "float")
       << " B=" << p.batch << " H=" << p.heads << " K=" << p.kv_heads << " D=" << p.head_dim << " Dv=" << p.head_dim_v
       << (c.v_in_k ? " (V in K's rows)" : "") << " softcap=" << p.softcap
       << " sinks=" << (c.sinks.empty() ? "none" : floats(c.sinks)) << " scale=" << p.scale
       << " dtype=" << static_cast<int>(p.dtype) << " new_tokens=" << p.new_tokens << " kv_len=" << list(p.kv_len)
       << " capacity=" << p.capacity << " page=" << p.page << " exchange=" << static_cast<int>(p.exchange)
       << " steps=" << c.steps << " advance_probes=" << list(c.advance_probes) << " position_probes={";
    for (std::size_t i = 0; i < c.position_probes.size(); ++i)
      os << (i ? "," : "") << "(" << c.position_probes[i].first << "," << c.position_probes[i].second << ")";
    os << "}";
    if (c.disagree_rank >= 0) os << " [rank " << c.disagree_rank << " plans another " << c.disagree_field << "]";
  } else {
    const TimeoutCase& c = fc.timeout;
    os << "timeout world=" << c.world;
    if (c.via_env) os << " SEQPAR_COMM_TIMEOUT_MS=\"" << c.env_text << "\"";
    else os << " ThreadRunOptions.timeout=" << c.timeout_ms << " ms";
  }
  return os.str();
}

namespace {
/// Sinks for a rank that gives some where the case has none (read only if a plan wrongly accepts).
const float* spare_sinks() {
  static const std::vector<float> zeros(4096, 0.0f);
  return zeros.data();
}
}  // namespace

AttentionProblem problem_of(const AttentionCase& c, int rank) {
  const bool other = rank == c.disagree_rank;
  AttentionProblem p = other ? c.other_problem : c.problem;
  const bool given = other && c.disagree_field == "sinks" ? c.other_sinks : !c.sinks.empty();
  p.sinks = !given ? nullptr : c.sinks.empty() ? spare_sinks() : c.sinks.data();
  return p;
}

DecodeProblem problem_of(const DecodeCase& c, int rank) {
  const bool other = rank == c.disagree_rank;
  DecodeProblem p = other ? c.other_problem : c.problem;
  const bool given = other && c.disagree_field == "sinks" ? c.sinks.empty() : !c.sinks.empty();
  p.sinks = !given ? nullptr : c.sinks.empty() ? spare_sinks() : c.sinks.data();
  return p;
}

__int128 total_q(const AttentionCase& c) {
  __int128 s = 0;
  for (const LocalLengths& l : c.lengths) s += l.q;
  return s;
}

__int128 total_kv(const AttentionCase& c) {
  __int128 s = 0;
  for (const LocalLengths& l : c.lengths) s += l.kv < 0 ? l.q : l.kv;
  return s;
}

namespace {
/// The value rules of today's models' features, shared by attention and decode: D_v >= 0
/// (0: D), a soft-cap 0 (off) or from 2^-32 to 2^32. Sinks have none the plan can check: their
/// values are read by each call (see fuzz_case.hpp's model_words).
template <class Problem>
std::string feature_rule(const Problem& p) {
  if (p.head_dim_v < 0) return "head_dim_v < 0";
  if (!(p.softcap == 0 || (p.softcap >= 0x1p-32 && p.softcap <= 0x1p32))) return "softcap outside 0, 2^-32..2^32";
  return "";
}
}  // namespace

std::string model_words(const std::string& reason) {
  if (reason == "head_dim_v < 0") return "head_dim_v: expected";
  if (reason == "softcap outside 0, 2^-32..2^32") return "softcap: expected";
  if (reason == "the kernel has no supports_softcap") return "supports_softcap";
  if (reason == "the kernel has no supports_value_dim") return "supports_value_dim";
  if (reason.ends_with("(D_v the widest)")) return " x head_dim_v ";
  if (reason == "more than 2^62 scores") return "(the number of scores) exceeds 2^62";
  return "";
}

std::string library_field_name(const std::string& field) {
  return field == "sinks" ? "sinks (given or not)" : field;
}

std::string attention_model_reason(const AttentionCase& c) {
  const AttentionProblem& p = c.problem;
  const auto [U, R] = model_mesh(c.policy, c.world);
  if (U == 0) return "the degrees do not fit the world size";
  if (c.policy.kind == PolicyKind::unified && static_cast<i64>(c.policy.placement) > 1) return "placement outside its enum";
  if (!c.typed_plan && static_cast<int>(p.dtype) > 3) return "dtype outside its enum";
  const i64 B = p.batch, H = p.heads, K = p.kv_heads == 0 ? p.heads : p.kv_heads, D = p.head_dim;
  if (B < 0) return "batch < 0";
  if (H < 1) return "heads < 1";
  if (K < 1 || H % K != 0) return "kv_heads does not divide heads";
  if (D < 1) return "head_dim < 1";
  if (const std::string f = feature_rule(p); !f.empty()) return f;
  const i64 Dv = p.head_dim_v == 0 ? D : p.head_dim_v, dim = std::max(D, Dv);
  const std::string widest = Dv > D ? " (D_v the widest)" : "";
  const double scale = p.scale != 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(D));
  if (!std::isfinite(scale)) return "scale not finite";
  if (std::abs(scale) > 4294967296.0) return "|scale| above 2^32";
  for (const LocalLengths& l : c.lengths) {
    if (l.q < 0) return "a negative local query length";
    if (l.kv < -1) return "a local K/V length below -1 (only -1 means \"same as q\")";
  }
  const __int128 sq = total_q(c), skv = total_kv(c), limit = static_cast<__int128>(1) << 58;
  if (sq > kMax || skv > kMax) return "global lengths past 2^63";
  // One token's rows, batch x max(H, K) x max(D, D_v) x 8 bytes, and batch x max(S) x max(H, K)
  // x max(D, D_v) x 8 bytes, both <= 2^58 (multiplied with saturation; the first bounds the loops
  // over batch and heads even for an empty sequence).
  __int128 bytes = 8;
  for (__int128 f : {static_cast<__int128>(B), static_cast<__int128>(std::max(H, K)), static_cast<__int128>(dim)})
    bytes = f == 0 || bytes == 0 ? 0 : bytes > limit / f ? limit + 1 : bytes * f;
  if (bytes > limit) return "one token's rows above 2^58 bytes" + widest;
  const __int128 s = std::max(sq, skv);
  if (s != 0 && bytes > limit / s) return "a tensor above 2^58 bytes" + widest;
  // The number of scores, batch x H x S_q x S_kv, <= 2^62 (multiplied with saturation).
  __int128 scores = 1;
  const __int128 score_limit = static_cast<__int128>(1) << 62;
  for (__int128 f : {static_cast<__int128>(B), static_cast<__int128>(H), sq, skv})
    scores = f == 0 || scores == 0 ? 0 : scores > score_limit / f ? score_limit + 1 : scores * f;
  if (scores > score_limit) return "more than 2^62 scores";
  if (p.causal_align != CausalAlign::top_left && p.causal_align != CausalAlign::bottom_right) return "causal_align outside its enum";
  if (p.window.left < -1 || p.window.right < -1) return "a window side below -1";
  if (!p.documents.empty()) {
    if (p.documents.size() != 1 && static_cast<i64>(p.documents.size()) != B) return "documents: neither one list nor one per batch element";
    if (sq != skv) return "documents with S_q != S_kv";
    for (const auto& docs : p.documents) {
      __int128 sum = 0;
      for (i64 n : docs) {
        if (n < 1) return "an empty or negative document";
        sum += n;
      }
      if (sum != sq) return "documents do not sum to the sequence";
    }
  }
  if (!p.kv_valid.empty()) {
    if (static_cast<i64>(p.kv_valid.size()) != B) return "kv_valid: not one count per batch element";
    for (i64 v : p.kv_valid)
      if (v < 0 || v > skv) return "kv_valid outside [0, S_kv]";
  }
  const bool extra = p.window.left >= 0 || p.window.right >= 0 || !p.documents.empty() || !p.kv_valid.empty();
  if (c.kernel == KernelKind::causal_only && extra) return "the kernel has no supports_masks";
  if (!c.policy.anything) {
    for (const LocalLengths& l : c.lengths)
      if (l.q != c.lengths[0].q || (l.kv < 0 ? l.q : l.kv) != l.q) return "a plain policy with uneven lengths";
    if (H % U != 0) return "heads not divisible by the Ulysses degree";
    if (c.policy.layout == LayoutKind::zigzag && c.policy.kind != PolicyKind::ulysses && (c.lengths[0].q * U) % 2 != 0)
      return "zigzag with an odd block";
  }
  if (c.policy.kind != PolicyKind::ulysses && c.policy.layout == LayoutKind::stripe) {
    // token t on ring rank t mod R: block r holds ceil((S - r) / R) tokens
    for (bool kv : {false, true}) {
      const __int128 total = kv ? skv : sq;
      std::vector<__int128> block(static_cast<std::size_t>(R), 0);
      for (int w = 0; w < c.world; ++w) {
        const LocalLengths& l = c.lengths[static_cast<std::size_t>(w)];
        block[static_cast<std::size_t>(model_coords(c.policy, U, R, w).first)] += kv && l.kv >= 0 ? l.kv : l.q;
      }
      for (int r = 0; r < R; ++r)
        if (block[static_cast<std::size_t>(r)] != (total > r ? (total - r + R - 1) / R : 0))
          return "stripe lengths that do not follow from the total";
    }
  }
  // The kernel's features come after every shape rule (sinks need nothing of a kernel).
  if (c.kernel == KernelKind::causal_only && p.softcap > 0) return "the kernel has no supports_softcap";
  if (c.kernel == KernelKind::causal_only && Dv != D) return "the kernel has no supports_value_dim";
  return "";
}

std::string decode_model_reason(const DecodeCase& c) {
  const DecodeProblem& p = c.problem;
  const i64 K = p.kv_heads == 0 ? p.heads : p.kv_heads;
  if (p.batch < 1) return "batch < 1";
  if (p.heads < 1) return "heads < 1";
  if (K < 1 || p.heads % K != 0) return "kv_heads does not divide heads";
  if (p.head_dim < 1) return "head_dim < 1";
  if (const std::string f = feature_rule(p); !f.empty()) return f;
  if (p.new_tokens < 1 || p.new_tokens > 16) return "new_tokens outside 1..16";
  if (p.page < 0) return "page < 0";
  if (static_cast<i64>(p.kv_len.size()) != p.batch) return "kv_len: not one length per sequence";
  for (i64 l : p.kv_len)
    if (l < 0 || static_cast<__int128>(l) + p.new_tokens > p.capacity) return "kv_len + new_tokens past the capacity";
  const double scale = p.scale != 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  if (!std::isfinite(scale)) return "scale not finite";
  if (std::abs(p.scale) > 4294967296.0) return "|scale| above 2^32";
  // The whole cache (batch x capacity x K x max(D, D_v)) and one step's rows (batch x T x H x
  // (max(D, D_v) + 1)), 8 bytes an element, each <= 2^58.
  const i64 Dv = p.head_dim_v == 0 ? p.head_dim : p.head_dim_v, dim = std::max(p.head_dim, Dv);
  const __int128 limit = static_cast<__int128>(1) << 58;
  auto bytes = [&](std::initializer_list<__int128> fs) {
    __int128 b = 8;
    for (__int128 f : fs) b = f == 0 || b == 0 ? 0 : b > limit / f ? limit + 1 : b * f;
    return b;
  };
  if (bytes({p.batch, p.capacity, K, dim}) > limit || bytes({p.batch, p.new_tokens, p.heads, dim + 1}) > limit)
    return std::string("a cache or step tensor above 2^58 bytes") + (Dv > p.head_dim ? " (D_v the widest)" : "");
  if (static_cast<int>(p.exchange) > 1) return "exchange outside its enum";
  if (static_cast<int>(p.dtype) > 3) return "dtype outside its enum";
  return "";
}

}  // namespace seqpar::fuzz
