// AnythingPolicy: a seeded sweep of random cases on ThreadCommunicator against the exact
// reference. Every factorisation U x R of 1..8 ranks, both placements, every layout; any local
// length (0..5000, zero-token ranks, lengths that differ by more than one), any head count
// with any divisor as kv_heads (also fewer than U), head_dim 1..160, causal or not, Q and K/V
// of different lengths. Each case also checks the bytes sent against the real-token formula
// and that forward did no host all-gather. Silent on success; a failure prints the case.
// Compute is kept small: long cases get tiny heads.
#include <doctest/doctest.h>

#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/attention_check.hpp"

using namespace seqpar;

namespace {

enum class Kind { ulysses, ring, unified };

struct SweepCase {
  int ranks = 1, U = 1, R = 1;
  bool ring_adjacent = false;
  Kind kind = Kind::unified;
  LayoutKind layout = LayoutKind::contiguous;
  bool f64 = false, with_lse = true;
  test::GlobalShape c;
  std::vector<std::int64_t> lq, lk;  // per world rank

  std::string describe() const {
    std::ostringstream os;
    os << (kind == Kind::ulysses ? "Anything<Ulysses>" : kind == Kind::ring ? "Anything<Ring<" : "Anything<Unified<")
       << (kind == Kind::ulysses ? "" : layout_name(layout)) << (kind == Kind::ulysses ? "" : ">>") << " P=" << ranks
       << " U=" << U << " R=" << R << (ring_adjacent ? " ring_adjacent" : " ulysses_adjacent") << " B=" << c.batch
       << " H=" << c.heads << " K=" << c.kv_heads << " D=" << c.head_dim << (c.causal ? " causal" : " full")
       << (f64 ? " f64" : " f32") << (with_lse ? "" : " no-lse") << " seed=" << c.seed << " lq={";
    for (auto x : lq) os << x << ' ';
    os << "} lk={";
    for (auto x : lk) os << x << ' ';
    os << '}';
    return os.str();
  }
};

/// Every factorisation (U, R) of 1..8 ranks.
std::vector<std::pair<int, int>> factorisations() {
  std::vector<std::pair<int, int>> out;
  for (int P = 1; P <= 8; ++P)
    for (int U = 1; U <= P; ++U)
      if (P % U == 0) out.emplace_back(U, P / U);
  return out;
}

/// Per-world-rank lengths whose ring blocks obey the stripe rule for `total` tokens (block r
/// holds ceil((total - r) / R)); inside a block the pieces are random.
std::vector<std::int64_t> stripe_lengths(std::int64_t total, const test::MeshShape& m, std::mt19937_64& rng) {
  const int P = m.ulysses * m.ring;
  std::vector<std::int64_t> out(static_cast<std::size_t>(P), 0);
  const auto blocks = split_evenly(total, m.ring);
  for (int r = 0; r < m.ring; ++r) {
    std::int64_t left = blocks[r];
    for (int u = 0; u < m.ulysses; ++u) {
      int w = 0;
      while (m.ring_rank(w) != r || m.ulysses_rank(w) != u) ++w;
      const std::int64_t take = u + 1 == m.ulysses ? left : static_cast<std::int64_t>(rng() % (left + 1));
      out[w] = take;
      left -= take;
    }
  }
  return out;
}

/// Random per-rank lengths: short ones with zeros, or one rank with up to 5000 tokens.
std::vector<std::int64_t> random_lengths(int P, bool long_case, std::mt19937_64& rng) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(P));
  const std::int64_t cap = std::vector<std::int64_t>{3, 17, 64, 130}[rng() % 4];
  for (auto& x : out) x = rng() % 5 == 0 ? 0 : 1 + static_cast<std::int64_t>(rng() % cap);
  if (long_case) {
    for (auto& x : out) x = rng() % 3 == 0 ? 0 : static_cast<std::int64_t>(rng() % 200);
    out[rng() % P] = 1000 + static_cast<std::int64_t>(rng() % 4001);
  }
  return out;
}

std::int64_t sum(const std::vector<std::int64_t>& v) { return std::accumulate(v.begin(), v.end(), std::int64_t{0}); }

/// Shrinks head_dim, then heads, until the reference's work fits `cap` score-element MACs.
void fit_budget(test::GlobalShape& c, double cap) {
  auto cost = [&] {
    return double(c.batch) * double(c.seq_q) * double(c.kv_len()) * double(c.heads) * double(c.head_dim) *
           (c.causal ? 0.5 : 1.0);
  };
  while (cost() > cap && c.head_dim > 1) c.head_dim = std::max<std::int64_t>(1, c.head_dim / 2);
  while (cost() > cap && c.heads > 1) {
    c.heads = std::max<std::int64_t>(1, c.heads / 2);
    c.kv_heads = std::gcd(c.heads, c.kv_heads);
  }
}

SweepCase random_case(int index, std::mt19937_64& rng) {
  static const auto facts = factorisations();
  SweepCase s;
  std::tie(s.U, s.R) = facts[static_cast<std::size_t>(index) % facts.size()];
  s.ranks = s.U * s.R;
  s.ring_adjacent = rng() % 2;
  s.layout = static_cast<LayoutKind>(rng() % 3);
  // The one-dimensional meshes run as Ulysses / Ring half of the time, as Unified otherwise.
  s.kind = s.R == 1 && rng() % 2 ? Kind::ulysses : s.U == 1 && rng() % 2 ? Kind::ring : Kind::unified;
  if (s.kind == Kind::ulysses) s.layout = LayoutKind::contiguous;
  if (s.kind != Kind::unified) s.ring_adjacent = false;
  s.f64 = rng() % 5 == 0;
  s.with_lse = rng() % 8 != 0;
  s.c.seed = 9000 + static_cast<std::uint64_t>(index);
  s.c.causal = rng() % 2;
  s.c.batch = rng() % 6 == 0 ? 2 : 1;
  s.c.heads = 1 + static_cast<std::int64_t>(rng() % 40);
  std::vector<std::int64_t> divisors;
  for (std::int64_t k = 1; k <= s.c.heads; ++k)
    if (s.c.heads % k == 0) divisors.push_back(k);
  s.c.kv_heads = divisors[rng() % divisors.size()];
  s.c.head_dim = 1 + static_cast<std::int64_t>(rng() % 160);

  const bool long_case = index % 7 == 3;
  const test::MeshShape mesh{s.U, s.R, s.ring_adjacent};
  const bool cross = rng() % 5 < 2;
  if (s.layout == LayoutKind::stripe) {
    const std::int64_t total = sum(random_lengths(s.ranks, long_case, rng));
    s.lq = stripe_lengths(total, mesh, rng);
    s.lk = stripe_lengths(cross ? sum(random_lengths(s.ranks, false, rng)) : total, mesh, rng);
  } else {
    s.lq = random_lengths(s.ranks, long_case, rng);
    s.lk = cross ? random_lengths(s.ranks, long_case && rng() % 2, rng) : s.lq;
  }
  s.c.seq_q = sum(s.lq);
  s.c.seq_kv = sum(s.lk);
  fit_budget(s.c, long_case ? 2.5e7 : 1.5e6);
  return s;
}

/// Inputs and answer shared by cases that differ only in the arrangement (null: make them).
const test::GlobalData* shared_data = nullptr;

template <class T, class Policy>
void run_checked(const SweepCase& s, Policy policy) {
  const auto g = shared_data ? *shared_data : test::make_global_as<T>(s.c);
  test::RunOptions opt;
  opt.lengths_q = s.lq;
  opt.lengths_kv = s.lk;
  opt.with_lse = s.with_lse;
  const auto r = test::run_policy<T>(s.ranks, policy, g, opt);
  CHECK(!r.err.nan);
  CHECK(r.err.rel() <= test::tolerance<T>);
  if (s.with_lse) CHECK(r.err.lse_rel() <= test::tolerance<T>);
  const auto want = test::analytic_forward_bytes(s.c, test::MeshShape{s.U, s.R, s.ring_adjacent}, s.lq, s.lk, sizeof(T),
                                                 sizeof(acc_t<T>), s.with_lse);
  for (int w = 0; w < s.ranks; ++w) {
    CAPTURE(w);
    CHECK(r.bytes_sent[w] == want[w]);
    CHECK(r.expected_bytes[w] == want[w]);
    CHECK(r.host_gathers_in_forward[w] == 0);
  }
}

template <class T, class L>
void run_layout(const SweepCase& s) {
  const auto placement = s.ring_adjacent ? MeshPlacement::ring_adjacent : MeshPlacement::ulysses_adjacent;
  if (s.kind == Kind::ulysses) run_checked<T>(s, AnythingPolicy<UlyssesPolicy>{});
  else if (s.kind == Kind::ring) run_checked<T>(s, AnythingPolicy<RingPolicy<L>>{});
  else run_checked<T>(s, AnythingPolicy<UnifiedPolicy<L>>{{s.U, s.R, placement}});
}

template <class T>
void run_case(const SweepCase& s) {
  switch (s.layout) {
    case LayoutKind::contiguous: return run_layout<T, Contiguous>(s);
    case LayoutKind::zigzag: return run_layout<T, Zigzag>(s);
    case LayoutKind::stripe: return run_layout<T, Stripe>(s);
  }
}

void run_case(const SweepCase& s) {
  const std::string what = s.describe();
  CAPTURE(what);
  if (s.f64) run_case<double>(s);
  else run_case<float>(s);
}

}  // namespace

// 160 cases: each of the 20 factorisations of 1..8 ranks 8 times (the suite's longest test on
// 2 cores; the fuzzer and the policy tests cover the same rules with other draws).
TEST_CASE("anything: seeded sweep of 160 random cases over every U x R, layout and placement") {
  std::mt19937_64 rng(20240601);
  for (int i = 0; i < 160; ++i) run_case(random_case(i, rng));
}

TEST_CASE("anything: the lengths of real inputs, 4099 and 3969 tokens, on 3 and 4 ranks") {
  // 3969 = 63 x 63 patches (1008 x 1008 at 16 x 16); 4099 does not divide by 2, 3 or 4.
  // The first case has 10 heads on 2 K/V heads (over 4 Ulysses ranks: 3, 3, 2, 2 heads, and
  // member 1 reads both K/V heads); the rest have 3 and 1 to stay cheap.
  bool first = true;
  for (std::int64_t total : {4099, 3969}) {
    // The global problem is the same for every arrangement: one reference per shape.
    const test::GlobalShape shape = test::make_case(total, 3, 1, 2, true, 7000 + total);
    const test::GlobalData g = test::make_global_as<float>(shape);
    for (int P : {4, 3}) {
      std::vector<std::pair<int, int>> meshes{{P, 1}, {1, P}};
      if (P == 4) meshes.emplace_back(2, 2);
      for (auto [U, R] : meshes)
        for (auto layout : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::stripe}) {
          if (R == 1 && layout != LayoutKind::contiguous) continue;
          SweepCase s;
          s.ranks = P;
          s.U = U;
          s.R = R;
          s.kind = R == 1 ? Kind::ulysses : U == 1 ? Kind::ring : Kind::unified;
          s.layout = layout;
          s.c = shape;
          if (first) {
            s.c.heads = 10;
            s.c.kv_heads = 2;
          }
          s.lq = s.lk = test::even_lengths(MeshConfig{U, R}, total);
          shared_data = first ? nullptr : &g;
          run_case(s);
          shared_data = nullptr;
          first = false;
        }
    }
  }
}

TEST_CASE("anything: ranks holding zero tokens, an empty K/V, a single token") {
  auto base = [](int U, int R, std::vector<std::int64_t> lq, std::vector<std::int64_t> lk, bool causal) {
    SweepCase s;
    s.U = U;
    s.R = R;
    s.ranks = U * R;
    s.kind = Kind::unified;
    s.layout = LayoutKind::zigzag;
    s.lq = std::move(lq);
    s.lk = std::move(lk);
    s.c = test::make_case(sum(s.lq), 6, 2, 12, causal, 8000 + s.ranks);
    s.c.seq_kv = sum(s.lk);
    return s;
  };
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    run_case(base(2, 2, {0, 5, 0, 9}, {0, 5, 0, 9}, causal));         // empty ranks in both groups
    run_case(base(4, 2, {0, 0, 0, 0, 0, 0, 0, 13}, {0, 0, 0, 0, 0, 0, 0, 13}, causal));  // one rank holds all
    run_case(base(2, 3, {1, 0, 0, 0, 0, 0}, {1, 0, 0, 0, 0, 0}, causal));  // one token in all
    run_case(base(2, 2, {3, 4, 5, 6}, {0, 0, 0, 0}, causal));          // no key anywhere: O = 0, LSE = -inf
    run_case(base(1, 4, {0, 0, 0, 0}, {2, 3, 0, 1}, causal));          // no query anywhere
    run_case(base(4, 1, {0, 7, 0, 0}, {9, 0, 0, 3}, causal));          // cross attention, Ulysses mesh
    SweepCase r = base(1, 3, {0, 11, 0}, {5, 0, 6}, causal);           // Ring, empty blocks in the ring
    r.kind = Kind::ring;
    run_case(r);
  }
}
