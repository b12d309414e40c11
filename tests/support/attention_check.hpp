#pragma once
// Test support on top of examples/common.hpp, which holds the global problem (GlobalShape),
// its random inputs, a rank's rows of them, the examples' reference and the error metric.
// Added here, for tests only: the exact answer over the whole sequence by brute force from the
// mask's definitions (mask_brute.hpp: no MaskView, so a fault in the library's masks cannot
// hide in the reference too), the LSE check, a policy run on threads in named steps (run the
// ranks, gather, compare, count the traffic), the traffic formula from first principles, and
// a watchdog so that a regression that hangs fails instead.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <future>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../../examples/common.hpp"
#include "seqpar/seqpar.hpp"
#include "support/mask_brute.hpp"

namespace seqpar::test {

using examples::compare;
using examples::ErrorStats;
using examples::GlobalInputs;
using examples::GlobalShape;
using examples::local_slices;
using examples::LocalSlices;
using examples::make_case;
using examples::make_inputs;
using examples::place_rows;
using examples::random_tensor;
using examples::reference_rows;
using examples::rounded;
using examples::take_rows;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SEQPAR_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define SEQPAR_TEST_SANITIZED 1
#endif
#endif
#ifdef SEQPAR_TEST_SANITIZED
/// Built with ASan or TSan (tests/sanitizers.sh): code runs 5-20x slower, so the longest cases
/// shorten their sequences there. The plain build runs them at full length.
inline constexpr bool sanitized_build = true;
#else
inline constexpr bool sanitized_build = false;
#endif
/// Whether a case instantiated for float and double skips its double run here: under a
/// sanitizer the threads and memory it exercises are the same code for both types, so the
/// double run only doubles the sanitizer stage's time.
template <class T>
inline constexpr bool sanitized_skips = sanitized_build && std::is_same_v<T, double>;

/// A global output [B, S, H, D_v] and its LSE [B, S, H], in double.
struct GlobalOutput {
  std::vector<double> out, lse;
};

/// Global inputs and the exact answer on them over the whole sequence.
struct GlobalData : GlobalInputs, GlobalOutput {};

/// A global problem's inputs in double, Q [B, S_q, H, D], K [B, S_kv, K, D] and V
/// [B, S_kv, K, D_v], with the problem that gives their shape, mask and features (all held by
/// reference).
struct BruteProblem {
  const AttentionProblem& pr;       ///< shape, scale and mask
  std::int64_t sq, skv;             ///< S_q and S_kv
  const std::vector<double>&q, &k, &v;  ///< the inputs
  /// Row (b, s, h) of a [B, S, heads, D] tensor.
  static const double* row(const std::vector<double>& x, std::int64_t seq, std::int64_t heads, std::int64_t dim,
                           std::int64_t b, std::int64_t s, std::int64_t h) {
    return x.data() + ((b * seq + s) * heads + h) * dim;
  }
};

/// Score of query q against key k by the definitions: scaled, then soft-capped when the
/// problem has a cap (c tanh(s / c)).
inline double brute_score(const AttentionProblem& pr, const double* q, const double* k) {
  const double s = pr.softmax_scale() * detail::dot_in_double(q, k, pr.head_dim);
  return pr.softcap > 0 ? pr.softcap * std::tanh(s / pr.softcap) : s;
}

/// The exact output [B, S_q, H, D_v] and LSE [B, S_q, H] of every query row by brute force:
/// the visible pairs straight from the mask's definitions (DefinitionMask), scores (soft-capped
/// when asked) and softmax in double, a sink joining the denominator as one more term with no
/// value. A row that sees no key gets O = 0 and LSE = -inf (its sink's logit with a sink); a
/// NaN score makes its row NaN.
inline GlobalOutput brute_force_forward(const BruteProblem& x) {
  const AttentionProblem& pr = x.pr;
  const std::int64_t B = pr.batch, H = pr.heads, K = pr.kv_head_count(), D = pr.head_dim, Dv = pr.value_dim();
  const double inf = std::numeric_limits<double>::infinity();
  const DefinitionMask mask(pr, x.sq, x.skv);
  GlobalOutput r{std::vector<double>(static_cast<std::size_t>(B * x.sq * H * Dv), 0.0),
                 std::vector<double>(static_cast<std::size_t>(B * x.sq * H), -inf)};
  std::vector<double> score(static_cast<std::size_t>(x.skv));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < x.sq; ++i)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t kh = h / (H / K);
        const double* q = BruteProblem::row(x.q, x.sq, H, D, b, i, h);
        double top = -inf;
        for (std::int64_t j = 0; j < x.skv; ++j) {
          double& sc = score[static_cast<std::size_t>(j)];
          sc = mask.visible(b, i, j) ? brute_score(pr, q, BruteProblem::row(x.k, x.skv, K, D, b, j, kh)) : -inf;
          if (!(sc <= top)) top = std::isnan(top) ? top : sc;  // NaN wins and stays
        }
        const double sink = pr.sinks ? double(pr.sinks[h]) : -inf;
        if (sink > top) top = sink;
        if (top == -inf) continue;  // no visible key, no sink
        double sum = pr.sinks ? std::exp(sink - top) : 0.0;
        double* o = r.out.data() + ((b * x.sq + i) * H + h) * Dv;
        for (std::int64_t j = 0; j < x.skv; ++j) {
          if (score[static_cast<std::size_t>(j)] == -inf) continue;
          const double w = std::exp(score[static_cast<std::size_t>(j)] - top);
          sum += w;
          const double* v = BruteProblem::row(x.v, x.skv, K, Dv, b, j, kh);
          for (std::int64_t e = 0; e < Dv; ++e) o[e] += w * v[e];
        }
        for (std::int64_t e = 0; e < Dv; ++e) o[e] /= sum;
        r.lse[static_cast<std::size_t>((b * x.sq + i) * H + h)] = top + std::log(sum);
      }
  return r;
}

/// The exact answer on inputs `in` by brute force (brute_force_forward of their shape).
inline GlobalData with_exact_answer(GlobalInputs in) {
  const GlobalShape& s = in.shape;
  const AttentionProblem pr = s.problem<double>();
  GlobalOutput answer = brute_force_forward({pr, s.seq_q, s.kv_len(), in.q, in.k, in.v});
  return GlobalData{std::move(in), std::move(answer)};
}

/// Random inputs of case `c`, rounded to T, and the exact double answer on them.
template <class T = double>
GlobalData make_global_as(const GlobalShape& c) {
  return with_exact_answer(make_inputs<T>(c));
}

/// Inputs and answer in double. A float run converts the inputs when it takes its rows, so
/// its reference is off by the rounding of the inputs (~1e-7); make_global_as<float> removes it.
inline GlobalData make_global(const GlobalShape& c) { return make_global_as<double>(c); }

/// ErrorStats of the output plus the LSE's. An LSE of -inf must be matched exactly; anything
/// else there counts as an infinite error.
struct Errors : ErrorStats {
  double lse_max_abs = 0, lse_max_ref = 0;
  double lse_rel() const { return lse_max_ref > 0 ? lse_max_abs / lse_max_ref : lse_max_abs; }
  using ErrorStats::merge;
  void merge(const Errors& o) {
    ErrorStats::merge(o);
    lse_max_abs = std::max(lse_max_abs, o.lse_max_abs);
    lse_max_ref = std::max(lse_max_ref, o.lse_max_ref);
  }
  void add_lse(double got, double want) {
    if (std::isnan(got)) nan = true;
    if (std::isinf(want)) {
      if (got != want) lse_max_abs = std::numeric_limits<double>::infinity();
    } else {
      lse_max_abs = std::max(lse_max_abs, std::abs(got - want));
      lse_max_ref = std::max(lse_max_ref, std::abs(want));
    }
  }
  /// True when output and LSE are within `tol` and nothing is NaN.
  bool within(double tol) const { return !nan && rel() <= tol && lse_rel() <= tol; }
};

/// One rank's output rows ([B, L, H, D_v]) and, unless `lse` is empty, its LSE ([B, H, L], as
/// TensorView::lse_bhs) against the exact answer in `g` at query positions `qpos`.
template <class O, class A>
Errors compare_rows(const std::vector<O>& out, const std::vector<A>& lse, const GlobalData& g, const PositionMap& qpos) {
  const GlobalShape& s = g.shape;
  Errors e;
  e.merge(compare(out, take_rows<double>(g.out, s.batch, s.seq_q, s.heads, s.value_dim(), qpos)));
  if (lse.empty()) return e;
  std::vector<double> want(lse.size());
  scatter_sequence(TensorView<const double>::bshd(g.lse.data(), s.batch, s.seq_q, s.heads, 1), qpos,
                   TensorView<double>::lse_bhs(want.data(), s.batch, qpos.size(), s.heads));
  for (std::size_t i = 0; i < want.size(); ++i) e.add_lse(static_cast<double>(lse[i]), want[i]);
  return e;
}

/// Every CPU instruction set of the kernels (kernel/cpu/isa.hpp) that this machine runs,
/// narrowest first. The first call prints them (so the test log says which paths ran) and
/// which were left out because the CPU lacks them.
inline const std::vector<CpuIsa>& cpu_isas() {
  static const std::vector<CpuIsa> isas = [] {
    std::vector<CpuIsa> run;
    std::string ran, skipped;
    for (CpuIsa isa : {CpuIsa::vec128, CpuIsa::avx2, CpuIsa::avx512}) {
      (cpu_isa_supported(isa) ? ran : skipped) += std::string(" ") + cpu_isa_name(isa);
      if (cpu_isa_supported(isa)) run.push_back(isa);
    }
    std::printf("CPU kernel paths tested:%s%s%s\n", ran.c_str(), skipped.empty() ? "" : "; not on this CPU:",
                skipped.c_str());
    return run;
  }();
  return isas;
}

/// Tolerance of the library against the exact reference: float 1e-5, double 1e-12.
template <class T>
inline constexpr double tolerance = std::is_same_v<T, double> ? 1e-12 : 1e-5;

/// How a policy runs on threads.
struct RunOptions {
  /// Every world rank's local lengths; empty: split as evenly as the mesh allows.
  std::vector<std::int64_t> lengths_q, lengths_kv;
  bool with_lse = true;           ///< ask for the LSE (changes the traffic)
  bool gather = false;            ///< assemble every rank's O and LSE into RunResult::out/lse
  int forward_calls = 1;          ///< forward calls on one plan and workspace (the last is checked)
  std::chrono::milliseconds timeout{120000};  ///< ThreadRunOptions::timeout: a hang fails
};

/// Every world rank's share of `total` tokens, as even as `mesh` allows (split_mesh, mapped
/// from mesh coordinates to world ranks).
inline std::vector<std::int64_t> even_lengths(const MeshConfig& mesh, std::int64_t total) {
  const auto per_mesh = split_mesh(total, mesh.ring, mesh.ulysses);
  std::vector<std::int64_t> out(static_cast<std::size_t>(mesh.world()));
  for (int w = 0; w < mesh.world(); ++w) out[w] = per_mesh[mesh.ring_rank(w) * mesh.ulysses + mesh.ulysses_rank(w)];
  return out;
}

/// `opt` (RunOptions or alike) with empty lengths filled in by even_lengths for `ranks` ranks
/// of `policy`.
template <class Options, class Policy>
Options with_lengths(Options opt, const Policy& policy, int ranks, const GlobalShape& c) {
  const MeshConfig mesh = mesh_config(policy, ranks);
  if (opt.lengths_q.empty()) opt.lengths_q = even_lengths(mesh, c.seq_q);
  if (opt.lengths_kv.empty()) opt.lengths_kv = even_lengths(mesh, c.kv_len());
  return opt;
}

/// What one rank's forward calls left behind.
template <class T>
struct RankRun {
  Plan plan;
  LocalLengths lengths;            ///< what the rank gave to plan()
  std::vector<T> out;              ///< [B, L, H, D_v], from the last call
  std::vector<acc_t<T>> lse;       ///< [B, H, L] from the last call; empty without the LSE
  CommStats stats;                 ///< traffic of the last call
  std::uint64_t host_gathers = 0;  ///< metadata all-gathers over every call, besides the call agreement's
};

/// No per-rank hook.
struct NoHook {
  template <class... Args>
  void operator()(Args&&...) const {}
};

/// Step 1: runs `Policy` with `ranks` threads on g's inputs (as T). Each rank plans, takes its
/// rows and calls forward opt.forward_calls times, its output set to a sentinel before each
/// call (a row the library forgets to write cannot pass). `hook(w, attn, plan)` runs on each
/// rank afterwards (serialised).
template <class T, class Policy, class Kernel = CpuFlashKernel, class Hook = NoHook>
std::vector<RankRun<T>> run_forward_ranks(int ranks, Policy policy, const GlobalInputs& g, RunOptions opt = {},
                                          Hook hook = {}) {
  const GlobalShape& s = g.shape;
  opt = with_lengths(std::move(opt), policy, ranks, s);
  std::vector<RankRun<T>> runs(static_cast<std::size_t>(ranks));
  std::mutex mu;
  run_ranks(
      ranks,
      [&](ThreadCommunicator& comm) {
        const int w = comm.rank();
        RankRun<T>& r = runs[static_cast<std::size_t>(w)];
        SequenceParallelAttention<Policy, ThreadCommunicator, Kernel> attn(comm, policy);
        r.lengths = {opt.lengths_q[w], opt.lengths_kv[w]};
        r.plan = attn.plan(s.problem<T>(opt.with_lse), r.lengths);
        const LocalSlices<T> x = local_slices<T>(g, r.plan.q_positions(w), r.plan.kv_positions(w));
        const std::int64_t B = s.batch, H = s.heads, K = s.kv_head_count(), D = s.head_dim, Dv = s.value_dim();
        r.out.resize(x.out.size());
        r.lse.resize(opt.with_lse ? static_cast<std::size_t>(B * x.lq * H) : 0);
        std::vector<std::byte> ws(r.plan.workspace_bytes());
        using CV = TensorView<const T>;
        for (int call = 0; call < opt.forward_calls; ++call) {
          std::fill(r.out.begin(), r.out.end(), T(12345));
          std::fill(r.lse.begin(), r.lse.end(), acc_t<T>(12345));
          comm.stats().reset();
          attn.template forward<T>(r.plan, CV::bshd(x.q.data(), B, x.lq, H, D), CV::bshd(x.k.data(), B, x.lkv, K, D),
                                   CV::bshd(x.v.data(), B, x.lkv, K, Dv),
                                   TensorView<T>::bshd(r.out.data(), B, x.lq, H, Dv),
                                   opt.with_lse ? TensorView<acc_t<T>>::lse_bhs(r.lse.data(), B, x.lq, H)
                                                : TensorView<acc_t<T>>{},
                                   ws);
          // Under SEQPAR_CHECK_CALLS=1 each call agrees in exactly one gather: not counted, so
          // "no metadata" holds in both modes (one gather fewer wraps the count: it fails too).
          r.host_gathers += comm.stats().host_gathers - (attn.checks_calls() ? 1u : 0u);
        }
        r.stats = comm.stats();
        std::lock_guard lock(mu);
        hook(w, attn, r.plan);
      },
      ThreadRunOptions{opt.timeout});
  return runs;
}

/// Step 2: every rank's output and LSE placed at their global positions; rows no rank wrote
/// stay NaN (and all of the LSE does when the run had none).
template <class T>
GlobalOutput gather_output(const std::vector<RankRun<T>>& runs, const GlobalShape& s) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  GlobalOutput g{std::vector<double>(static_cast<std::size_t>(s.batch * s.seq_q * s.heads * s.value_dim()), nan),
                 std::vector<double>(static_cast<std::size_t>(s.batch * s.seq_q * s.heads), nan)};
  for (const RankRun<T>& r : runs) {
    const PositionMap qpos = r.plan.q_positions(r.plan.world_rank());
    place_rows(r.out, s.batch, s.seq_q, s.heads, s.value_dim(), qpos, g.out);
    if (!r.lse.empty())
      gather_sequence(TensorView<const acc_t<T>>::lse_bhs(r.lse.data(), s.batch, qpos.size(), s.heads), qpos,
                      TensorView<double>::bshd(g.lse.data(), s.batch, s.seq_q, s.heads, 1));
  }
  return g;
}

/// Step 3: every rank's rows against the exact answer in `g`, merged.
template <class T>
Errors compare_with_reference(const std::vector<RankRun<T>>& runs, const GlobalData& g) {
  Errors e;
  for (const RankRun<T>& r : runs) e.merge(compare_rows(r.out, r.lse, g, r.plan.q_positions(r.plan.world_rank())));
  return e;
}

/// Per world rank: what its forward sent, what its plan says it sends, and its lengths.
struct Traffic {
  std::vector<std::uint64_t> bytes_sent;               ///< in the last forward call
  std::vector<std::uint64_t> expected_bytes;           ///< plan.forward_bytes
  std::vector<std::uint64_t> host_gathers_in_forward;  ///< over every forward call
  std::vector<std::int64_t> work;                      ///< plan.work
  std::vector<std::int64_t> lengths_q, lengths_kv;     ///< the lengths the ranks gave
};

/// Step 4: the traffic of every rank, indexed by world rank.
template <class T>
Traffic count_traffic(const std::vector<RankRun<T>>& runs) {
  Traffic t;
  for (const RankRun<T>& r : runs) {
    const int w = r.plan.world_rank();
    t.bytes_sent.push_back(r.stats.bytes_sent);
    t.expected_bytes.push_back(r.plan.forward_bytes(w));
    t.host_gathers_in_forward.push_back(r.host_gathers);
    t.work.push_back(r.plan.work(w));
    t.lengths_q.push_back(r.lengths.q);
    t.lengths_kv.push_back(r.lengths.kv);
  }
  return t;
}

/// Result of run_policy: traffic per world rank, the gathered output when asked, the errors.
struct RunResult : Traffic, GlobalOutput {
  Errors err;
};

/// Runs `Policy` with `ranks` threads on g's inputs (rounded to T) and checks every rank's
/// rows against the reference in `g`: the four steps above in one call.
template <class T, class Policy, class Kernel = CpuFlashKernel, class Hook = NoHook>
RunResult run_policy(int ranks, Policy policy, const GlobalData& g, RunOptions opt = {}, Hook hook = {}) {
  const bool gather = opt.gather;
  const auto runs = run_forward_ranks<T, Policy, Kernel>(ranks, policy, g, std::move(opt), hook);
  return {count_traffic(runs), gather ? gather_output(runs, g.shape) : GlobalOutput{},
          compare_with_reference(runs, g)};
}

/// How a world of ulysses * ring ranks is arranged, written out for the traffic formula
/// (independent of MeshConfig, so that the test does not trust the code it checks).
struct MeshShape {
  int ulysses = 1, ring = 1;
  bool ring_adjacent = false;  ///< MeshPlacement::ring_adjacent
  int ring_rank(int w) const { return ring_adjacent ? w % ring : w / ulysses; }
  int ulysses_rank(int w) const { return ring_adjacent ? w / ring : w % ulysses; }
};

/// Bytes every world rank sends in one forward, from first principles: the real tokens and
/// heads, nothing padded. Query heads are split over the Ulysses group with the first
/// H mod U members taking one more; a member needs the K/V heads its query heads read
/// (h / (H / K)). Ulysses (U > 1): my tokens of the other members' query heads and of the
/// K/V heads they need go out; the other members' tokens of my heads come back as O (and
/// the LSE). Ring (R > 1): R - 1 steps forward every K/V block but the one of ring rank
/// r + 1, with the K/V heads this member needs. Q and K rows have D elements, V and O rows D_v.
inline std::vector<std::uint64_t> analytic_forward_bytes(const GlobalShape& c, const MeshShape& m,
                                                         const std::vector<std::int64_t>& lengths_q,
                                                         const std::vector<std::int64_t>& lengths_kv,
                                                         std::uint64_t elem, std::uint64_t acc, bool with_lse) {
  const int U = m.ulysses, R = m.ring, P = U * R;
  const std::int64_t H = c.heads, K = c.kv_head_count(), G = H / K;
  std::vector<std::int64_t> hq(U), kv_need(U);
  for (int v = 0, begin = 0; v < U; ++v) {
    hq[v] = H / U + (v < H % U ? 1 : 0);
    std::vector<bool> used(static_cast<std::size_t>(K), false);
    for (std::int64_t h = begin; h < begin + hq[v]; ++h) used[static_cast<std::size_t>(h / G)] = true;
    kv_need[v] = std::count(used.begin(), used.end(), true);
    begin += static_cast<int>(hq[v]);
  }
  std::vector<std::int64_t> block_q(R, 0), block_kv(R, 0);
  std::int64_t total_kv = 0;
  for (int w = 0; w < P; ++w) {
    block_q[m.ring_rank(w)] += lengths_q[w];
    block_kv[m.ring_rank(w)] += lengths_kv[w];
    total_kv += lengths_kv[w];
  }
  const auto B = static_cast<std::uint64_t>(c.batch), D = static_cast<std::uint64_t>(c.head_dim),
             Dv = static_cast<std::uint64_t>(c.value_dim());
  std::vector<std::uint64_t> out(static_cast<std::size_t>(P), 0);
  for (int w = 0; w < P; ++w) {
    const int r = m.ring_rank(w), u = m.ulysses_rank(w);
    std::uint64_t bytes = 0;
    if (U > 1) {
      std::int64_t kv_others = 0;
      for (int v = 0; v < U; ++v) kv_others += v == u ? 0 : kv_need[v];
      const auto others_q = static_cast<std::uint64_t>(block_q[r] - lengths_q[w]);  // O and LSE back
      bytes += static_cast<std::uint64_t>(lengths_q[w] * (H - hq[u])) * B * D * elem;
      bytes += static_cast<std::uint64_t>(lengths_kv[w] * kv_others) * B * (D + Dv) * elem;
      bytes += others_q * static_cast<std::uint64_t>(hq[u]) * B * Dv * elem;
      if (with_lse) bytes += others_q * static_cast<std::uint64_t>(hq[u]) * B * acc;
    }
    if (R > 1)
      bytes += static_cast<std::uint64_t>((total_kv - block_kv[(r + 1) % R]) * kv_need[u]) * B * (D + Dv) * elem;
    out[w] = bytes;
  }
  return out;
}

/// The MeshShape of a policy's resolved mesh.
inline MeshShape mesh_shape(const MeshConfig& m) {
  return {m.ulysses, m.ring, m.placement == MeshPlacement::ring_adjacent};
}

/// Runs `fn` on its own thread and waits at most `limit`. If it has not returned by then the
/// process exits with a message (the blocked threads cannot be unwound safely): a hang
/// becomes a failure. Otherwise rethrows what `fn` threw.
template <class Fn>
void within(std::chrono::milliseconds limit, Fn&& fn, const char* what = "a test step") {
  std::promise<void> done;
  auto fut = done.get_future();
  std::thread t([&] {
    try {
      fn();
      done.set_value();
    } catch (...) {
      done.set_exception(std::current_exception());
    }
  });
  if (fut.wait_for(limit) != std::future_status::ready) {
    std::fprintf(stderr, "FATAL: %s did not finish within %lld ms (a hang)\n", what,
                 static_cast<long long>(limit.count()));
    std::fflush(stderr);
    std::_Exit(3);
  }
  t.join();
  fut.get();
}

}  // namespace seqpar::test
