#pragma once
/// \file
/// Helpers shared by the examples, the demo and the tests (tests/support builds on them): a
/// global problem with the same random inputs on every rank, a rank's rows of them by the
/// plan's positions (and back), the exact reference for a rank's query rows, and the normwise
/// error reduced over the ranks. Only the checking lives here; each example shows the library
/// calls themselves.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "seqpar/seqpar.hpp"

namespace seqpar::examples {

/// The global attention problem of an example or a test, with the seed of its inputs.
struct GlobalShape {
  std::int64_t batch = 1;     ///< B
  std::int64_t seq_q = 256;   ///< global query length
  std::int64_t seq_kv = -1;   ///< global K/V length; -1 means seq_q
  std::int64_t heads = 4;     ///< H
  std::int64_t kv_heads = 0;  ///< K; 0 means H
  std::int64_t head_dim = 64; ///< D (of Q and K)
  std::int64_t head_dim_v = 0; ///< D_v (of V and O); 0 means D
  bool causal = false;        ///< causal mask over global positions
  CausalAlign causal_align = CausalAlign::top_left;  ///< where the diagonal sits when seq_kv != seq_q
  Window window{};            ///< sliding window ({-1, -1}: none)
  std::vector<std::vector<std::int64_t>> documents{};  ///< packed documents (AttentionProblem::documents)
  std::vector<std::int64_t> kv_valid{};                ///< key padding per batch element (empty: none)
  double scale = 0.0;         ///< softmax scale; 0 means 1/sqrt(head_dim), as AttentionProblem
  double softcap = 0.0;       ///< logit soft-cap (0: off), as AttentionProblem
  std::vector<float> sinks{}; ///< one sink logit per query head (empty: none), as AttentionProblem
  std::uint64_t seed = 2024;  ///< seed of the random inputs

  /// Global K/V length.
  std::int64_t kv_len() const { return seq_kv < 0 ? seq_q : seq_kv; }
  /// K with 0 resolved.
  std::int64_t kv_head_count() const { return kv_heads == 0 ? heads : kv_heads; }
  /// D_v with 0 resolved.
  std::int64_t value_dim() const { return head_dim_v == 0 ? head_dim : head_dim_v; }
  /// The library's problem for element type T (with the LSE when backward will follow). Its
  /// sinks point into this shape, which must outlive the problem's plans.
  template <class T>
  AttentionProblem problem(bool with_lse = false) const {
    AttentionProblem p;
    p.with_lse = with_lse;
    p.batch = batch;
    p.heads = heads;
    p.kv_heads = kv_head_count();
    p.head_dim = head_dim;
    p.head_dim_v = head_dim_v;
    p.softcap = softcap;
    p.sinks = sinks.empty() ? nullptr : sinks.data();
    p.causal = causal;
    p.causal_align = causal_align;
    p.window = window;
    p.documents = documents;
    p.kv_valid = kv_valid;
    p.scale = scale;
    p.dtype = dtype_v<T>;
    return p;
  }
  /// The mask's tables (documents, key padding) for the reference kernel.
  MaskTables mask_tables() const { return MaskTables(documents, kv_valid); }
  /// The scale the softmax uses (scale with 0 resolved).
  double softmax_scale() const {
    AttentionProblem p;  // only the two fields the scale depends on (no copy of the mask lists)
    p.head_dim = head_dim;
    p.scale = scale;
    return p.softmax_scale();
  }
};

/// A self-attention problem (seq_kv = seq_q) in one line.
inline GlobalShape make_case(std::int64_t seq, std::int64_t heads, std::int64_t kv_heads, std::int64_t dim, bool causal,
                             std::uint64_t seed, std::int64_t batch = 1) {
  GlobalShape c;
  c.batch = batch;
  c.seq_q = seq;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.head_dim = dim;
  c.causal = causal;
  c.seed = seed;
  return c;
}

/// n random values uniform in [-1, 1] (never zeros).
inline std::vector<double> random_tensor(std::int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> x(static_cast<std::size_t>(n));
  for (double& e : x) e = dist(rng);
  return x;
}

/// Every element rounded to T and back: the reference of a float run must see the float inputs.
template <class T>
std::vector<double> rounded(std::vector<double> x) {
  for (double& e : x) e = static_cast<double>(static_cast<T>(e));
  return x;
}

/// Global Q, K ([B, S, heads, D]) and V ([B, S, K, D_v]) contiguous in double, identical on
/// every rank: they come from the seed alone, so no rank needs to send inputs to another.
struct GlobalInputs {
  GlobalShape shape;           ///< the shape they were made for
  std::vector<double> q, k, v; ///< uniform in [-1, 1]
  std::vector<double> dout;    ///< upstream gradient of the output [B, S_q, H, D_v]
};

/// Makes the global inputs of `shape`, rounded to T (the default, double, rounds nothing).
/// Q, K and V come from the seed, in that order; dout from a stream of its own.
template <class T = double>
GlobalInputs make_inputs(const GlobalShape& shape) {
  const std::int64_t q_elems = shape.batch * shape.seq_q * shape.heads * shape.head_dim;
  const std::int64_t kv_rows = shape.batch * shape.kv_len() * shape.kv_head_count();
  std::mt19937_64 rng(shape.seed), grad_rng(shape.seed * 7919 + 17);
  GlobalInputs g;
  g.shape = shape;
  g.q = rounded<T>(random_tensor(q_elems, rng));
  g.k = rounded<T>(random_tensor(kv_rows * shape.head_dim, rng));
  g.v = rounded<T>(random_tensor(kv_rows * shape.value_dim(), rng));
  g.dout = rounded<T>(random_tensor(q_elems / shape.head_dim * shape.value_dim(), grad_rng));
  return g;
}

/// The rows of a global [B, seq, heads, D] tensor at positions `pos`, as T
/// ([B, pos.size(), heads, D]): what a rank holds under a plan (scatter_sequence).
template <class T>
std::vector<T> take_rows(const std::vector<double>& global, std::int64_t batch, std::int64_t seq, std::int64_t heads,
                         std::int64_t dim, const PositionMap& pos) {
  std::vector<T> local(static_cast<std::size_t>(batch * pos.size() * heads * dim));
  scatter_sequence(TensorView<const double>::bshd(global.data(), batch, seq, heads, dim), pos,
                   TensorView<T>::bshd(local.data(), batch, pos.size(), heads, dim));
  return local;
}

/// The inverse of take_rows: writes a rank's rows ([B, pos.size(), heads, D]) into a global
/// [B, seq, heads, D] tensor at positions `pos` (gather_sequence).
template <class T>
void place_rows(const std::vector<T>& local, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t dim,
                const PositionMap& pos, std::vector<double>& global) {
  gather_sequence(TensorView<const T>::bshd(local.data(), batch, pos.size(), heads, dim), pos,
                  TensorView<double>::bshd(global.data(), batch, seq, heads, dim));
}

/// One rank's input slices and output buffer, [B, L, heads, D or D_v] contiguous.
template <class T>
struct LocalSlices {
  std::vector<T> q, k, v, out;  ///< this rank's rows
  std::int64_t lq = 0, lkv = 0; ///< local lengths
};

/// Takes a rank's query rows at `qpos` and K/V rows at `kvpos` out of the global inputs.
template <class T>
LocalSlices<T> local_slices(const GlobalInputs& g, const PositionMap& qpos, const PositionMap& kvpos) {
  const GlobalShape& s = g.shape;
  LocalSlices<T> l;
  l.lq = qpos.size();
  l.lkv = kvpos.size();
  l.q = take_rows<T>(g.q, s.batch, s.seq_q, s.heads, s.head_dim, qpos);
  l.k = take_rows<T>(g.k, s.batch, s.kv_len(), s.kv_head_count(), s.head_dim, kvpos);
  l.v = take_rows<T>(g.v, s.batch, s.kv_len(), s.kv_head_count(), s.value_dim(), kvpos);
  l.out.assign(static_cast<std::size_t>(s.batch * l.lq * s.heads * s.value_dim()), T(0));
  return l;
}

/// Kernel parameters of the global problem for query rows at `qpos` against keys at `kpos`,
/// with the shape's mask (`tables` from shape.mask_tables(), kept alive by the caller).
inline KernelParams reference_params(const GlobalShape& s, const MaskTables& tables, PositionMap qpos,
                                     const PositionMap& kpos) {
  KernelParams p;
  p.scale = s.softmax_scale();
  p.softcap = s.softcap;
  p.causal = s.causal;
  p.mask = tables.view(s.causal, s.window);
  if (s.causal_align == CausalAlign::bottom_right)  // the kernel compares keys with diagonals
    for (int g = 0; g < qpos.segments; ++g) qpos.seg[g].start += s.kv_len() - s.seq_q;
  p.q_positions = qpos;
  p.k_positions = kpos;
  p.group_size = s.heads / s.kv_head_count();
  return p;
}

/// Joins each row's sink to its result over the keys: L' = log(exp(L) + exp(sink_h)),
/// O' = O exp(L - L') (out [rows, heads, D_v] and lse [rows, heads], row-major; heads from
/// `first_head`).
inline void apply_sinks(std::vector<double>& out, std::vector<double>& lse, const std::vector<float>& sinks,
                        std::int64_t heads, std::int64_t dim_v, std::int64_t first_head = 0) {
  for (std::size_t r = 0; r < lse.size(); ++r) {
    const double sink = sinks[static_cast<std::size_t>(first_head + static_cast<std::int64_t>(r) % heads)];
    const double l = lse[r], top = std::max(l, sink);
    const double joined = top + std::log(std::exp(l - top) + std::exp(sink - top));
    const double factor = std::exp(l - joined);  // 0 for a row that saw no key
    for (std::int64_t e = 0; e < dim_v; ++e) out[r * static_cast<std::size_t>(dim_v) + static_cast<std::size_t>(e)] *= factor;
    lse[r] = joined;
  }
}

/// The exact output (ReferenceKernel, double, then the sinks) of the query rows at `qpos`
/// against the whole global K/V: [B, qpos.size(), H, D_v], and their LSE ([B, qpos.size(), H])
/// when `lse` is given. Each rank checks its own rows, so the reference work is spread like the
/// real work.
inline std::vector<double> reference_rows(const GlobalInputs& g, const PositionMap& qpos,
                                          std::vector<double>* lse = nullptr) {
  const GlobalShape& s = g.shape;
  const std::int64_t n = qpos.size(), dv = s.value_dim();
  const std::vector<double> q = take_rows<double>(g.q, s.batch, s.seq_q, s.heads, s.head_dim, qpos);
  std::vector<double> out(static_cast<std::size_t>(s.batch * n * s.heads * dv)), own_lse;
  if (!lse && !s.sinks.empty()) lse = &own_lse;  // the sinks join through the LSE
  if (lse) lse->assign(static_cast<std::size_t>(s.batch * n * s.heads), 0.0);
  using CV = TensorView<const double>;
  ReferenceKernel{}.forward(CV::bshd(q.data(), s.batch, n, s.heads, s.head_dim),
                            CV::bshd(g.k.data(), s.batch, s.kv_len(), s.kv_head_count(), s.head_dim),
                            CV::bshd(g.v.data(), s.batch, s.kv_len(), s.kv_head_count(), dv),
                            TensorView<double>::bshd(out.data(), s.batch, n, s.heads, dv),
                            lse ? TensorView<double>::bshd(lse->data(), s.batch, n, s.heads, 1) : TensorView<double>{},
                            reference_params(s, s.mask_tables(), qpos, PositionMap::run(s.kv_len(), 0)));
  if (!s.sinks.empty()) apply_sinks(out, *lse, s.sinks, s.heads, dv);
  return out;
}

/// Exact gradients of one rank's slices: dq of its query rows, dk and dv of its K/V rows, and
/// with sinks, the sinks' gradient from those query rows.
struct ReferenceGrads {
  std::vector<double> dq, dk, dv;  ///< [B, L, heads, D] ([B, L, K, D_v] for dv)
  std::vector<double> dsinks{};    ///< [H]: -sum over the rows of exp(sink_h - L) (dO . O); empty without sinks
};

/// The sinks' gradient from rows [rows, heads] of dO and O ([rows, heads, D_v]) with their
/// final LSE: d sink_h = -sum_rows exp(sink_h - L) (dO . O).
inline std::vector<double> sink_grads(const std::vector<double>& dout, const std::vector<double>& out,
                                      const std::vector<double>& lse, const std::vector<float>& sinks,
                                      std::int64_t heads, std::int64_t dim_v) {
  std::vector<double> d(sinks.size(), 0.0);
  for (std::size_t r = 0; r < lse.size(); ++r) {
    const auto h = static_cast<std::size_t>(static_cast<std::int64_t>(r) % heads);
    const double* o = out.data() + r * static_cast<std::size_t>(dim_v);
    const double* d_o = dout.data() + r * static_cast<std::size_t>(dim_v);
    d[h] -= std::exp(double(sinks[h]) - lse[r]) * detail::dot_in_double(d_o, o, dim_v);
  }
  return d;
}

/// The exact gradients (ReferenceKernel::backward, double) of the rows at `qpos` and `kvpos`
/// for upstream gradient g.dout. dK/dV of a key need every query row's output and LSE, so the
/// whole forward reference runs here; the backward work is this rank's share only.
inline ReferenceGrads reference_grads(const GlobalInputs& g, const PositionMap& qpos, const PositionMap& kvpos) {
  const GlobalShape& s = g.shape;
  const auto B = s.batch, H = s.heads, K = s.kv_head_count(), D = s.head_dim, Dv = s.value_dim(), Sq = s.seq_q,
             Sk = s.kv_len();
  const PositionMap all_q = PositionMap::run(Sq, 0), all_k = PositionMap::run(Sk, 0);
  const MaskTables tables = s.mask_tables();
  std::vector<double> lse;
  const std::vector<double> out = reference_rows(g, all_q, &lse);
  using CV = TensorView<const double>;
  using V = TensorView<double>;
  ReferenceGrads r;
  const std::int64_t lq = qpos.size(), lk = kvpos.size();
  r.dq.assign(static_cast<std::size_t>(B * lq * H * D), 0.0);
  r.dk.assign(static_cast<std::size_t>(B * lk * K * D), 0.0);
  r.dv.assign(static_cast<std::size_t>(B * lk * K * Dv), 0.0);
  std::vector<double> unused_q(g.q.size(), 0.0), unused_k(g.k.size(), 0.0), unused_v(g.v.size(), 0.0);
  // dq of my rows: my query rows against every key. With sinks the final O and LSE already
  // hold them: the gradients of Q, K and V follow from those as without sinks.
  const auto q_mine = take_rows<double>(g.q, B, Sq, H, D, qpos), do_mine = take_rows<double>(g.dout, B, Sq, H, Dv, qpos);
  const auto o_mine = take_rows<double>(out, B, Sq, H, Dv, qpos), l_mine = take_rows<double>(lse, B, Sq, H, 1, qpos);
  ReferenceKernel{}.backward(CV::bshd(do_mine.data(), B, lq, H, Dv), CV::bshd(q_mine.data(), B, lq, H, D),
                             CV::bshd(g.k.data(), B, Sk, K, D), CV::bshd(g.v.data(), B, Sk, K, Dv),
                             CV::bshd(o_mine.data(), B, lq, H, Dv), CV::bshd(l_mine.data(), B, lq, H, 1),
                             V::bshd(r.dq.data(), B, lq, H, D), V::bshd(unused_k.data(), B, Sk, K, D),
                             V::bshd(unused_v.data(), B, Sk, K, Dv), reference_params(s, tables, qpos, all_k));
  if (!s.sinks.empty()) r.dsinks = sink_grads(do_mine, o_mine, l_mine, s.sinks, H, Dv);
  // dk, dv of my K/V rows: every query row against my keys.
  const auto k_mine = take_rows<double>(g.k, B, Sk, K, D, kvpos), v_mine = take_rows<double>(g.v, B, Sk, K, Dv, kvpos);
  ReferenceKernel{}.backward(CV::bshd(g.dout.data(), B, Sq, H, Dv), CV::bshd(g.q.data(), B, Sq, H, D),
                             CV::bshd(k_mine.data(), B, lk, K, D), CV::bshd(v_mine.data(), B, lk, K, Dv),
                             CV::bshd(out.data(), B, Sq, H, Dv), CV::bshd(lse.data(), B, Sq, H, 1),
                             V::bshd(unused_q.data(), B, Sq, H, D), V::bshd(r.dk.data(), B, lk, K, D),
                             V::bshd(r.dv.data(), B, lk, K, Dv), reference_params(s, tables, all_q, kvpos));
  return r;
}

/// Normwise error: max |got - want| and max |want|, so that rel() = max|err| / max|ref|.
struct ErrorStats {
  double max_abs = 0;  ///< max |got - want|
  double max_ref = 0;  ///< max |want|
  bool nan = false;    ///< a NaN was produced

  /// max|err| / max|ref| (the project's forward tolerance metric); infinite after a NaN.
  double rel() const {
    if (nan) return std::numeric_limits<double>::infinity();
    return max_ref > 0 ? max_abs / max_ref : max_abs;
  }
  /// Combines the errors of two disjoint sets of rows.
  void merge(const ErrorStats& o) {
    max_abs = std::max(max_abs, o.max_abs);
    max_ref = std::max(max_ref, o.max_ref);
    nan = nan || o.nan;
  }
  /// Counts one element of an output (or a gradient) against the reference.
  void add_out(double got, double want) {
    if (std::isnan(got)) nan = true;
    max_abs = std::max(max_abs, std::abs(got - want));
    max_ref = std::max(max_ref, std::abs(want));
  }
};

/// Error of `got` against `want`, element by element.
template <class T>
ErrorStats compare(const std::vector<T>& got, const std::vector<double>& want) {
  ErrorStats e;
  for (std::size_t i = 0; i < want.size(); ++i) e.add_out(static_cast<double>(got[i]), want[i]);
  return e;
}

/// Every rank's row of `mine`, gathered over the communicator's host channel: row w of the
/// result is rank w's. Doubles travel bit-cast in int64.
template <class Comm>
std::vector<std::vector<std::int64_t>> gather_rows(Comm& comm, const std::vector<std::int64_t>& mine) {
  std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(comm.size()));
  comm.all_gather_host(mine, all);
  std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>(comm.size()));
  for (std::size_t w = 0; w < rows.size(); ++w)
    rows[w].assign(all.begin() + static_cast<std::ptrdiff_t>(w * mine.size()),
                   all.begin() + static_cast<std::ptrdiff_t>((w + 1) * mine.size()));
  return rows;
}

/// The errors of all ranks merged (collective; every rank gets the same answer).
template <class Comm>
ErrorStats reduce_errors(Comm& comm, const ErrorStats& mine) {
  ErrorStats all;
  for (const auto& row : gather_rows(comm, {std::bit_cast<std::int64_t>(mine.max_abs),
                                            std::bit_cast<std::int64_t>(mine.max_ref), mine.nan}))
    all.merge({std::bit_cast<double>(row[0]), std::bit_cast<double>(row[1]), row[2] != 0});
  return all;
}

/// Runs one forward of `attn` on this rank's slice of `g` with `plan` and returns the error of
/// its rows against the exact reference (this rank's only: merge with reduce_errors). For
/// tests and short examples; ulysses_mpi.cpp spells the same calls out.
template <class T, class Attention>
ErrorStats forward_error(Attention& attn, const Plan& plan, const GlobalInputs& g) {
  const GlobalShape& s = g.shape;
  const int me = plan.world_rank();
  const PositionMap qpos = plan.q_positions(me);
  LocalSlices<T> l = local_slices<T>(g, qpos, plan.kv_positions(me));
  std::vector<std::byte> workspace(plan.workspace_bytes());
  using CV = TensorView<const T>;
  attn.template forward<T>(plan, CV::bshd(l.q.data(), s.batch, l.lq, s.heads, s.head_dim),
                           CV::bshd(l.k.data(), s.batch, l.lkv, s.kv_head_count(), s.head_dim),
                           CV::bshd(l.v.data(), s.batch, l.lkv, s.kv_head_count(), s.value_dim()),
                           TensorView<T>::bshd(l.out.data(), s.batch, l.lq, s.heads, s.value_dim()), workspace);
  return compare(l.out, reference_rows(g, qpos));
}

/// One rank's profile as integers for gather_rows (times as bit-cast doubles): per pass the
/// call count, the total, then every (phase, step) and every step's hop time in flight.
inline std::vector<std::int64_t> profile_row(const PhaseProfile& p) {
  std::vector<std::int64_t> row;
  auto put = [&](double x) { row.push_back(std::bit_cast<std::int64_t>(x)); };
  for (Pass pass : {Pass::forward, Pass::backward}) {
    row.push_back(p.calls(pass));
    put(p.total_ms(pass));
    for (int ph = 0; ph < static_cast<int>(Phase::count); ++ph)
      for (int s = 0; s < PhaseProfile::max_steps; ++s) put(p.ms(pass, static_cast<Phase>(ph), s));
    for (int s = 0; s < PhaseProfile::max_steps; ++s) put(p.hop_ms(pass, s));
  }
  return row;
}

/// The profile profile_row() wrote (steps with no time at all read back as not run).
inline PhaseProfile profile_from_row(const std::vector<std::int64_t>& row) {
  PhaseProfile p;
  std::size_t i = 0;
  auto get = [&] { return std::bit_cast<double>(row[i++]); };
  for (Pass pass : {Pass::forward, Pass::backward}) {
    const auto calls = row[i++];
    const double total = get();
    for (std::int64_t c = 0; c < calls; ++c) p.add_call(pass, total / static_cast<double>(calls));
    for (int ph = 0; ph < static_cast<int>(Phase::count); ++ph)
      for (int s = 0; s < PhaseProfile::max_steps; ++s)
        if (const double ms = get(); ms != 0) p.add(pass, static_cast<Phase>(ph), s, ms);
    for (int s = 0; s < PhaseProfile::max_steps; ++s) p.add_hop(pass, s, get());
  }
  return p;
}

/// Prints, per pass that ran, one line per rank with each phase's time per call (ms), the
/// rest of the call ("other": checks and set-up), and the share of the ring hops' time in
/// flight that compute hid; then, with a ring, each step's compute, merge and wait.
inline void print_profile(const std::vector<PhaseProfile>& ranks) {
  constexpr int phases = static_cast<int>(Phase::count);
  for (Pass pass : {Pass::forward, Pass::backward}) {
    if (ranks.empty() || ranks[0].calls(pass) == 0) continue;
    std::printf("profile      %s, ms per call (mean of %d calls)\n", pass == Pass::forward ? "forward" : "backward",
                ranks[0].calls(pass));
    std::printf("%6s %9s", "rank", "total");
    for (int ph = 0; ph < phases; ++ph) std::printf(" %8s", phase_name(static_cast<Phase>(ph)));
    std::printf(" %8s %7s\n", "other", "hidden");
    int steps = 1;
    for (std::size_t w = 0; w < ranks.size(); ++w) {
      const PhaseProfile& p = ranks[w];
      const double n = std::max(1, p.calls(pass));
      std::printf("%6zu %9.3f", w, p.total_ms(pass) / n);
      for (int ph = 0; ph < phases; ++ph) std::printf(" %8.3f", p.ms(pass, static_cast<Phase>(ph)) / n);
      std::printf(" %8.3f %6.1f%%\n", (p.total_ms(pass) - p.phases_ms(pass)) / n, 100 * p.hidden_share(pass));
      steps = std::max(steps, p.steps(pass));
    }
    if (steps < 2) continue;
    std::printf("ring steps   compute / merge / wait, ms per call\n%6s", "rank");
    for (int s = 0; s < steps; ++s) std::printf("  %22s", ("step " + std::to_string(s)).c_str());
    std::printf("\n");
    for (std::size_t w = 0; w < ranks.size(); ++w) {
      const PhaseProfile& p = ranks[w];
      const double n = std::max(1, p.calls(pass));
      std::printf("%6zu", w);
      for (int s = 0; s < steps; ++s)
        std::printf("  %8.2f/%6.2f/%6.2f", p.ms(pass, Phase::compute, s) / n, p.ms(pass, Phase::merge, s) / n,
                    p.ms(pass, Phase::wait, s) / n);
      std::printf("\n");
    }
  }
}

}  // namespace seqpar::examples
