// Numerics at the edges, for the two host kernels and for distributed policies (whose ring
// merge and all-to-all must not break what the kernel got right): huge logits, NaN and Inf in
// one query row, fully masked rows, and degenerate shapes (seq 1, head_dim 1, batch 0, ranks
// holding no token). Everything is held against ReferenceKernel in double, row by row, so a
// NaN that leaks into a neighbouring row or a masked row that turns NaN cannot hide in a
// norm.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "support/attention_check.hpp"

using namespace seqpar;
using test::GlobalShape;
using test::GlobalData;

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();
constexpr double nan_v = std::numeric_limits<double>::quiet_NaN();

/// Output [B, S, H, D] and LSE [B, S, H] of one run, in double.
using Answer = test::GlobalOutput;

/// Runs `Kernel` once over the whole sequence of case `c` with inputs `g` (converted to T):
/// query row i sits at global position qp(i), key j at kp(j).
template <class T, class Kernel>
Answer run_kernel(const GlobalShape& c, const GlobalData& g, PositionMap qp, PositionMap kp) {
  const std::int64_t B = c.batch, S = c.seq_q, SK = c.kv_len(), H = c.heads, K = c.kv_heads, D = c.head_dim;
  const std::vector<T> q(g.q.begin(), g.q.end()), k(g.k.begin(), g.k.end()), v(g.v.begin(), g.v.end());
  std::vector<T> out(q.size(), T(12345));  // a sentinel: an unwritten row cannot pass
  std::vector<acc_t<T>> lse(static_cast<std::size_t>(B * S * H), acc_t<T>(12345));
  KernelParams p;
  p.scale = c.softmax_scale();
  p.causal = c.causal;
  p.q_positions = qp;
  p.k_positions = kp;
  p.group_size = K > 0 ? H / K : 1;
  Kernel kernel;
  if constexpr (requires { kernel.prepare(D); }) kernel.prepare(D);
  using CV = TensorView<const T>;
  kernel.forward(CV::bshd(q.data(), B, S, H, D), CV::bshd(k.data(), B, SK, K, D), CV::bshd(v.data(), B, SK, K, D),
                 TensorView<T>::bshd(out.data(), B, S, H, D), TensorView<acc_t<T>>::bshd(lse.data(), B, S, H, 1), p);
  return {std::vector<double>(out.begin(), out.end()), std::vector<double>(lse.begin(), lse.end())};
}

/// The exact answer on inputs `g` (which may hold NaN, Inf or huge values).
Answer reference(const GlobalShape& c, const GlobalData& g, PositionMap qp, PositionMap kp) {
  return run_kernel<double, ReferenceKernel>(c, g, qp, kp);
}
Answer reference(const GlobalShape& c, const GlobalData& g) {
  return reference(c, g, PositionMap::run(c.seq_q, 0), PositionMap::run(c.kv_len(), 0));
}

/// Row-by-row comparison. A row is one (b, s, h): D outputs and one LSE.
struct RowReport {
  double max_abs = 0, max_ref = 0, lse_abs = 0, lse_ref = 0;
  std::vector<std::int64_t> nan_got, nan_want;  ///< rows with a NaN output
  std::int64_t lse_inf_mismatch = 0;            ///< rows where exactly one side has LSE -inf
  std::int64_t lse_nan_mismatch = 0;            ///< rows where exactly one side has LSE NaN
  std::int64_t masked_not_zero = 0;             ///< rows with LSE -inf but an output != 0
  double rel() const { return max_ref > 0 ? max_abs / max_ref : max_abs; }
  double lse_rel() const { return lse_ref > 0 ? lse_abs / lse_ref : lse_abs; }
  bool within(double tol) const {
    return rel() <= tol && lse_rel() <= tol && nan_got == nan_want && lse_inf_mismatch == 0 && lse_nan_mismatch == 0 &&
           masked_not_zero == 0;
  }
};

RowReport compare(const Answer& got, const Answer& want, std::int64_t D) {
  RowReport r;
  const auto rows = static_cast<std::int64_t>(want.lse.size());
  for (std::int64_t row = 0; row < rows; ++row) {
    bool got_nan = false, want_nan = false;
    for (std::int64_t d = 0; d < D; ++d) {
      const double a = got.out[row * D + d], b = want.out[row * D + d];
      got_nan |= std::isnan(a);
      want_nan |= std::isnan(b);
      if (!std::isnan(a) && !std::isnan(b)) {
        r.max_abs = std::max(r.max_abs, std::abs(a - b));
        r.max_ref = std::max(r.max_ref, std::abs(b));
      }
      if (got.lse[row] == -inf && a != 0.0) ++r.masked_not_zero;
    }
    if (got_nan) r.nan_got.push_back(row);
    if (want_nan) r.nan_want.push_back(row);
    const double la = got.lse[row], lb = want.lse[row];
    if (std::isnan(la) != std::isnan(lb)) ++r.lse_nan_mismatch;
    if ((la == -inf) != (lb == -inf)) ++r.lse_inf_mismatch;
    else if (std::isfinite(la) && std::isfinite(lb)) {
      r.lse_abs = std::max(r.lse_abs, std::abs(la - lb));
      r.lse_ref = std::max(r.lse_ref, std::abs(lb));
    }
  }
  return r;
}

std::string show(const RowReport& r) {
  std::string s = "rel " + std::to_string(r.rel()) + " lse_rel " + std::to_string(r.lse_rel()) + " nan rows got {";
  for (auto x : r.nan_got) s += std::to_string(x) + " ";
  s += "} want {";
  for (auto x : r.nan_want) s += std::to_string(x) + " ";
  return s + "} lse -inf mismatches " + std::to_string(r.lse_inf_mismatch) + ", NaN mismatches " +
         std::to_string(r.lse_nan_mismatch) + ", masked rows not zero " +
         std::to_string(r.masked_not_zero);
}

/// Runs a policy on threads and gathers its global output and LSE.
template <class T, class Policy>
Answer run_policy_gathered(int ranks, Policy policy, const GlobalData& g, std::vector<std::int64_t> lengths_q = {},
                           std::vector<std::int64_t> lengths_kv = {}) {
  test::RunOptions opt;
  opt.lengths_q = std::move(lengths_q);
  opt.lengths_kv = std::move(lengths_kv);
  opt.timeout = std::chrono::milliseconds(60000);
  return test::gather_output(test::run_forward_ranks<T>(ranks, policy, g, opt), g.shape);
}

/// Three distributed arrangements (Ulysses, zigzag Ring, a 2 x 2 Unified mesh; Anything, so
/// that any length works) against the reference, each rank giving `lens` tokens if set.
template <class T>
void check_policies(const GlobalShape& c, const GlobalData& g, double tol, const std::vector<std::int64_t>& lens = {}) {
  const Answer want = reference(c, g);
  auto one = [&](const char* name, int ranks, auto policy) {
    const std::size_t n = lens.empty() ? 0 : static_cast<std::size_t>(ranks);
    const std::vector<std::int64_t> l(lens.begin(), lens.begin() + static_cast<std::ptrdiff_t>(n));
    const auto r = compare(run_policy_gathered<T>(ranks, policy, g, l, l), want, c.head_dim);
    INFO(name, ": ", show(r));
    CHECK(r.within(tol));
  };
  one("Anything<Ulysses>", lens.empty() ? 3 : 4, AnythingPolicy<UlyssesPolicy>{});
  one("Anything<Ring<Zigzag>>", lens.empty() ? 3 : 4, AnythingPolicy<RingPolicy<Zigzag>>{});
  one("Anything<Unified 2x2>", 4, AnythingPolicy<UnifiedPolicy<>>{{2, 2}});
}

/// Every check of a case: both kernels on the whole sequence, then the policies.
template <class T>
void check_everywhere(const GlobalShape& c, const GlobalData& g, double tol_kernel, double tol_policy) {
  const Answer want = reference(c, g);
  const PositionMap qp = PositionMap::run(c.seq_q, 0), kp = PositionMap::run(c.kv_len(), 0);
  const auto flash = compare(run_kernel<T, CpuFlashKernel>(c, g, qp, kp), want, c.head_dim);
  INFO("CpuFlashKernel: ", show(flash));
  CHECK(flash.within(tol_kernel));
  const auto ref = compare(run_kernel<T, ReferenceKernel>(c, g, qp, kp), want, c.head_dim);
  INFO("ReferenceKernel: ", show(ref));
  CHECK(ref.within(tol_kernel));
  check_policies<T>(c, g, tol_policy);
}

/// Float and double at the library's tolerances (inputs rounded to float for both).
void check_both(const GlobalShape& c, const GlobalData& g) {
  check_everywhere<float>(c, g, test::tolerance<float>, test::tolerance<float>);
  check_everywhere<double>(c, g, test::tolerance<double>, test::tolerance<double>);
}

/// A case of the given shape (kv_heads = heads / 2: GQA everywhere).
GlobalShape shape(std::int64_t batch, std::int64_t heads, std::int64_t head_dim, std::int64_t seq, bool causal) {
  return test::make_case(seq, heads, heads > 1 ? heads / 2 : 1, head_dim, causal, 1, batch);
}

/// Integer inputs whose logits are +-1e4 plus a small integer spread: every logit is exact in
/// float (integers below 2^24, scale 1), so the float paths are held to the usual tolerance
/// and any overflow or cancellation shows. Rows alternate between +1e4 and -1e4.
GlobalData huge_logits(const GlobalShape& c) {
  std::mt19937_64 rng(c.seed);
  std::uniform_int_distribution<int> small(-3, 3);
  auto nonzero = [&] {
    int x = 0;
    while (x == 0) x = small(rng);
    return double(x);
  };
  GlobalData g;
  g.shape = c;
  const std::int64_t rows_q = c.batch * c.seq_q * c.heads, rows_k = c.batch * c.kv_len() * c.kv_heads, D = c.head_dim;
  g.q.resize(static_cast<std::size_t>(rows_q * D));
  g.k.resize(static_cast<std::size_t>(rows_k * D));
  g.v.resize(g.k.size());
  for (std::int64_t r = 0; r < rows_q; ++r) {
    g.q[r * D] = (r % 2 == 0 ? 1.0 : -1.0) * 625.0;  // x 16 in k: logit +-1e4
    for (std::int64_t d = 1; d < D; ++d) g.q[r * D + d] = nonzero();
  }
  for (std::int64_t r = 0; r < rows_k; ++r) {
    g.k[r * D] = 16.0;
    for (std::int64_t d = 1; d < D; ++d) g.k[r * D + d] = nonzero();
  }
  g.v = test::random_tensor(rows_k * D, rng);
  for (auto& x : g.v) x = double(float(x));
  return g;
}

/// Inputs whose first `low_keys` keys score about `low` (scale 1) against every query while
/// the others score within +-10: the ring's first block then leaves a partial LSE near `low`
/// that later blocks exceed by ~|low|. Every input is exact in float.
GlobalData far_apart_blocks(const GlobalShape& c, std::int64_t low_keys, double low) {
  GlobalData g;
  g.shape = c;
  std::mt19937_64 rng(c.seed);
  const std::int64_t H = c.heads, K = c.kv_heads, D = c.head_dim;
  g.q = test::rounded<float>(test::random_tensor(c.batch * c.seq_q * H * D, rng));
  g.k = test::rounded<float>(test::random_tensor(c.batch * c.kv_len() * K * D, rng));
  g.v = test::rounded<float>(test::random_tensor(g.k.size(), rng));
  for (std::size_t r = 0; r < g.q.size(); r += static_cast<std::size_t>(D)) g.q[r] = 4.0;
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t j = 0; j < low_keys; ++j)
      for (std::int64_t h = 0; h < K; ++h) g.k[static_cast<std::size_t>(((b * c.kv_len() + j) * K + h) * D)] = low / 4;
  return test::with_exact_answer(std::move(g));
}

/// Smallest gap, over every query row, between the lowest score of a key past `low_keys` and
/// the highest of a key before it.
double score_gap(const GlobalData& g, std::int64_t low_keys) {
  const GlobalShape& c = g.shape;
  const std::int64_t H = c.heads, K = c.kv_heads, D = c.head_dim;
  double gap = inf;
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t i = 0; i < c.seq_q; ++i)
      for (std::int64_t h = 0; h < H; ++h) {
        double low_max = -inf, high_min = inf;
        for (std::int64_t j = 0; j < c.kv_len(); ++j) {
          double s = 0;
          for (std::int64_t e = 0; e < D; ++e)
            s += g.q[static_cast<std::size_t>(((b * c.seq_q + i) * H + h) * D + e)] *
                 g.k[static_cast<std::size_t>(((b * c.kv_len() + j) * K + h / (H / K)) * D + e)];
          if (j < low_keys)
            low_max = std::max(low_max, s);
          else
            high_min = std::min(high_min, s);
        }
        gap = std::min(gap, high_min - low_max);
      }
  return gap * c.softmax_scale();
}

}  // namespace

TEST_CASE("numerics: logits of +-1e4 neither overflow nor lose the softmax") {
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    GlobalShape c = shape(2, 4, 16, 45, causal);
    c.scale = 1.0;
    const GlobalData g = huge_logits(c);
    const Answer want = reference(c, g);
    // The case really has logits of 1e4: the LSE of a row is its largest logit plus O(10).
    double max_lse = 0;
    for (double l : want.lse) max_lse = std::max(max_lse, std::abs(l));
    CHECK(max_lse > 9.9e3);
    check_everywhere<double>(c, g, 1e-12, 1e-12);
    // A float LSE of magnitude 1e4 is exact to 2^-24 * 1e4 ~ 6e-4 only, and the ring merge
    // weights sigmoid(L2 - L1) inherit that absolute error: the merged output's error is
    // bounded by it (not by 1e-5; measured: 3.4e-4 for ring and 2 x 2 meshes). The kernels
    // alone are held to 1e-5.
    check_everywhere<float>(c, g, 1e-5, 1e4 * 0x1p-24 * 4);
  }
}

TEST_CASE_TEMPLATE("numerics: ring partials whose LSEs lie past exp's range apart merge exactly", T, float, double) {
  // The first 16 keys (ring rank 0's block) score ~-200 (float) or ~-1000 (double) against
  // every query, the rest within +-10: rank 0's running LSE after its own block sits that far
  // below the next block's, past exp's range (88.7 in float, 709.8 in double). A merge that
  // forms exp(l2 - l1) without taking the larger out first overflows there, turns the LSE
  // into +inf and drops every later block.
  GlobalShape c = shape(2, 4, 16, 48, false);
  c.scale = 1.0;
  const double low = std::is_same_v<T, float> ? -200.0 : -1000.0;
  const GlobalData g = far_apart_blocks(c, 16, low);
  CHECK(score_gap(g, 16) > (std::is_same_v<T, float> ? 150.0 : 900.0));
  const auto even = test::run_policy<T>(3, RingPolicy<Contiguous>{}, g);
  CHECK(even.err.within(test::tolerance<T>));
  test::RunOptions uneven;
  uneven.lengths_q = uneven.lengths_kv = {16, 5, 27};
  const auto anything = test::run_policy<T>(3, AnythingPolicy<RingPolicy<Contiguous>>{}, g, uneven);
  CHECK(anything.err.within(test::tolerance<T>));
  // A 2 x 3 mesh: ring blocks of 16 tokens again, each the union of two ranks' rows.
  const auto unified = test::run_policy<T>(6, UnifiedPolicy<Contiguous>{2, 3}, g);
  CHECK(unified.err.within(test::tolerance<T>));
}

TEST_CASE("numerics: NaN or Inf in one query row makes only that row NaN") {
  for (double poison : {nan_v, inf, -inf}) {
    for (bool causal : {false, true}) {
      CAPTURE(poison);
      CAPTURE(causal);
      const GlobalShape c = shape(2, 4, 8, 23, causal);
      GlobalData g = test::make_global_as<float>(c);
      // Row (b = 1, s = 17, h = 2): late enough that causal rows see many keys, of either sign.
      const std::int64_t row = (1 * c.seq_q + 17) * c.heads + 2;
      g.q[static_cast<std::size_t>(row * c.head_dim + 3)] = poison;
      // The reference itself: exactly the poisoned row is NaN.
      const Answer want = reference(c, g);
      REQUIRE(compare(want, want, c.head_dim).nan_want == std::vector<std::int64_t>{row});
      check_both(c, g);
    }
  }
}

TEST_CASE("numerics: fully masked rows give O = 0 and LSE = -inf, never NaN") {
  GlobalShape c = shape(2, 2, 8, 70, true);  // 70: more than one query block of the flash kernel
  const GlobalData g = test::make_global_as<float>(c);
  // Keys start at position 20: queries 0..19 see none of them.
  const PositionMap qp = PositionMap::run(c.seq_q, 0), kp = PositionMap::run(c.kv_len(), 20);
  const Answer want = reference(c, g, qp, kp);
  std::int64_t masked = 0;
  for (double l : want.lse) masked += l == -inf;
  CHECK(masked == c.batch * 20 * c.heads);
  const std::pair<Answer, double> runs[] = {{run_kernel<float, CpuFlashKernel>(c, g, qp, kp), test::tolerance<float>},
                                            {run_kernel<float, ReferenceKernel>(c, g, qp, kp), test::tolerance<float>},
                                            {run_kernel<double, CpuFlashKernel>(c, g, qp, kp), test::tolerance<double>}};
  for (const auto& [got, tol] : runs) {
    const auto r = compare(got, want, c.head_dim);
    INFO(show(r));
    CHECK(r.within(tol));
    CHECK(r.nan_got.empty());
  }
  // Distributed: no key at all (joint attention with an empty K/V on every rank).
  c.seq_kv = 0;
  const GlobalData empty_kv = test::make_global_as<float>(c);
  const Answer zero = reference(c, empty_kv);
  for (double l : zero.lse) REQUIRE(l == -inf);
  for (double o : zero.out) REQUIRE(o == 0.0);
  check_both(c, empty_kv);
}

TEST_CASE("numerics: sequence of one token, head_dim of one, ranks that hold no token") {
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    const GlobalShape one_token = shape(2, 4, 8, 1, causal);  // most ranks below hold nothing
    check_both(one_token, test::make_global_as<float>(one_token));
    const GlobalShape dim_one = shape(2, 4, 1, 29, causal);
    check_both(dim_one, test::make_global_as<float>(dim_one));
  }
  // Uneven lengths with empty ranks in the middle of the ring and of a Ulysses group.
  const GlobalShape c = shape(2, 4, 8, 12, true);
  check_policies<float>(c, test::make_global_as<float>(c), 1e-5, {0, 7, 0, 5});
}

TEST_CASE("numerics: batch 0 plans and runs without touching memory") {
  const GlobalShape c = shape(0, 4, 8, 10, false);
  const GlobalData g = test::make_global_as<float>(c);
  CHECK(g.q.empty());
  const PositionMap qp = PositionMap::run(c.seq_q, 0);
  CHECK(run_kernel<float, CpuFlashKernel>(c, g, qp, qp).out.empty());
  CHECK(run_kernel<float, ReferenceKernel>(c, g, qp, qp).out.empty());
  // Null data pointers are fine for empty tensors; every policy plans and runs.
  auto run = [&](auto policy, int ranks) {
    std::vector<std::size_t> ws_bytes(static_cast<std::size_t>(ranks));
    run_ranks(
        ranks,
        [&](ThreadCommunicator& comm) {
          SequenceParallelAttention<decltype(policy), ThreadCommunicator, CpuFlashKernel> attn(comm, policy);
          const AttentionProblem p{.batch = 0, .heads = 4, .kv_heads = 2, .head_dim = 8, .causal = true, .with_lse = true};
          const Plan plan = attn.plan(p, {6, -1});
          std::vector<std::byte> ws(plan.workspace_bytes());
          using CV = TensorView<const float>;
          attn.template forward<float>(plan, CV::bshd(nullptr, 0, 6, 4, 8), CV::bshd(nullptr, 0, 6, 2, 8),
                                       CV::bshd(nullptr, 0, 6, 2, 8), TensorView<float>::bshd(nullptr, 0, 6, 4, 8),
                                       TensorView<float>::lse_bhs(nullptr, 0, 6, 4), ws);
          ws_bytes[static_cast<std::size_t>(comm.rank())] = plan.workspace_bytes();
        },
        ThreadRunOptions{std::chrono::milliseconds(60000)});
    return ws_bytes;
  };
  CHECK_NOTHROW(run(UlyssesPolicy{}, 2));
  CHECK_NOTHROW(run(RingPolicy<Zigzag>{}, 2));
  // Nothing to hold: the workspace is only the alignment slack.
  for (auto b : run(UnifiedPolicy<>{2, 2}, 4)) CHECK(b <= workspace_alignment);
}
