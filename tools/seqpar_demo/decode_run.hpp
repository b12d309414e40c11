#pragma once
/// \file
/// One rank's --decode run of seqpar_demo: a context-parallel prefill of the prompts with the
/// options' policy, the hand-off of its K/V rows to the decode cache, then checked and timed
/// SequenceParallelDecode steps, and rank 0's report of them.

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attention.hpp"
#include "common.hpp"
#include "decode_handoff.hpp"
#include "report.hpp"

namespace seqpar_demo {

/// The prompts' rows of the decode run's global inputs: `full` holds each sequence whole
/// (prompt, then the decode steps' tokens) as documents of one sequence; the prefill sees the
/// prompts alone, packed the same way.
inline ex::GlobalInputs prompt_inputs(const ex::GlobalInputs& full, const std::vector<std::int64_t>& prompts) {
  ex::GlobalInputs p;
  p.shape = full.shape;
  p.shape.seq_q = 0;
  p.shape.documents = {prompts};
  const std::int64_t q_row = full.shape.heads * full.shape.head_dim, kv_row = full.shape.kv_head_count() * full.shape.head_dim,
                     v_row = full.shape.kv_head_count() * full.shape.value_dim();
  std::int64_t at = 0;  // the sequence's first row in `full`
  for (std::size_t b = 0; b < prompts.size(); ++b) {
    auto copy = [&](const std::vector<double>& from, std::vector<double>& to, std::int64_t row) {
      to.insert(to.end(), from.begin() + at * row, from.begin() + (at + prompts[b]) * row);
    };
    copy(full.q, p.q, q_row);
    copy(full.k, p.k, kv_row);
    copy(full.v, p.v, v_row);
    p.shape.seq_q += prompts[b];
    at += full.shape.documents.front()[b];
  }
  return p;
}

/// What one rank's prefill left: its K/V rows (for the hand-off) and its figures.
template <class T>
struct Prefilled {
  std::vector<T> k, v;                                   ///< this rank's K/V rows, [lkv, K, D] and [lkv, K, D_v]
  std::vector<std::vector<ex::CacheToken>> tokens;       ///< every rank's rows' tokens, in row order
  ex::ErrorStats err;                                    ///< the prefill's output error (all ranks)
  std::uint64_t bytes = 0;                               ///< bytes this rank sent
  double ms = 0;                                         ///< this rank's time of the one forward
  int ulysses = 1, ring = 1;                             ///< the prefill's mesh
};

/// A prefill of the decode and serve runs: one forward of the options' policy over the prompts,
/// packed as the documents of `prompts` (one sequence).
template <class T, class Comm>
Prefilled<T> prefill_rank(Comm& comm, const Options& o, const ex::GlobalInputs& prompts) {
  const int me = comm.rank();
  const std::unique_ptr<DemoAttention<T>> attn_ptr = make_attention<T>(comm, o);
  DemoAttention<T>& attn = *attn_ptr;
  const ex::GlobalShape& s = prompts.shape;
  const Plan plan = attn.plan(s.problem<T>(), {split_sequence(s.seq_q, attn.mesh())[static_cast<std::size_t>(me)]});
  g_planned = true;
  const PositionMap qpos = plan.q_positions(me), kvpos = plan.kv_positions(me);
  ex::LocalSlices<T> l = ex::local_slices<T>(prompts, qpos, kvpos);
  std::vector<std::byte> workspace(plan.workspace_bytes());
  using CV = TensorView<const T>;
  const auto K = s.kv_head_count(), D = s.head_dim, Dv = s.value_dim();
  comm.stats().reset();
  const auto t0 = std::chrono::steady_clock::now();
  attn.forward(plan, CV::bshd(l.q.data(), 1, l.lq, s.heads, D), CV::bshd(l.k.data(), 1, l.lkv, K, D),
               CV::bshd(l.v.data(), 1, l.lkv, K, Dv), TensorView<T>::bshd(l.out.data(), 1, l.lq, s.heads, Dv), {},
               workspace);
  Prefilled<T> r;
  r.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  r.bytes = comm.stats().bytes_sent;
  if (o.check) r.err = ex::reduce_errors(comm, ex::compare(l.out, ex::reference_rows(prompts, qpos)));
  for (int w = 0; w < comm.size(); ++w) r.tokens.push_back(ex::packed_tokens(plan.kv_positions(w), s.documents.front()));
  r.k = std::move(l.k);
  r.v = std::move(l.v);
  r.ulysses = attn.mesh().ulysses;
  r.ring = attn.mesh().ring;
  return r;
}

/// The median of `x` (not empty): a decode step's time without the first step's warm-up.
inline double median(std::vector<double> x) {
  const auto mid = x.begin() + static_cast<std::ptrdiff_t>(x.size() / 2);
  std::nth_element(x.begin(), mid, x.end());
  return *mid;
}

/// One rank's decode run with element type T: the decode plan, the prefill (any policy), the
/// hand-off of the prefilled K/V to the decode cache, then --steps checked and timed steps.
template <class T, class Comm>
int decode_rank(Comm& comm, const Options& o, const ex::GlobalInputs& full) {
  const int me = comm.rank(), world = comm.size();
  const ex::GlobalShape& fs = full.shape;
  const std::int64_t B = o.batch, Tn = o.new_tokens, H = fs.heads, K = fs.kv_head_count(), D = fs.head_dim,
                     Dv = fs.value_dim();
  // The decode plan first: it is collective too, so a wrong shape fails on every rank alike.
  SequenceParallelDecode<Comm, CpuFlashKernel> decode(comm, make_kernel<CpuFlashKernel>(o, false));
  DecodeProblem problem{.batch = B, .heads = H, .kv_heads = K, .head_dim = D, .scale = fs.scale, .dtype = dtype_v<T>,
                        .new_tokens = Tn, .kv_len = o.kv_len,
                        .capacity = *std::max_element(o.kv_len.begin(), o.kv_len.end()) + o.steps * Tn,
                        .page = o.page, .exchange = o.exchange};
  problem.head_dim_v = fs.head_dim_v;
  problem.softcap = fs.softcap;
  problem.sinks = fs.sinks.empty() ? nullptr : fs.sinks.data();
  DecodePlan dp = decode.plan(problem);
  const ex::GlobalInputs prompts = prompt_inputs(full, o.kv_len);
  Prefilled<T> pre = prefill_rank<T>(comm, o, prompts);

  // The hand-off: every prefilled K/V row to the rank and slot the decode cache gives it. With
  // V in K's rows (MLA's latent cache) there is one cache, and V is a column view of it.
  const std::int64_t C = dp.shard_capacity();
  std::vector<T> k_cache(static_cast<std::size_t>(B * C * K * D)), v_cache(o.v_in_k ? 0 : static_cast<std::size_t>(B * C * K * Dv));
  const std::size_t handoff_bytes = ex::hand_off_kv<T>(comm, pre.tokens, dp, pre.k.data(), o.v_in_k ? nullptr : pre.v.data(),
                                                       k_cache.data(), o.v_in_k ? nullptr : v_cache.data());
  const TensorView<const T> k_view = TensorView<const T>::bshd(k_cache.data(), B, C, K, D);
  TensorView<const T> v_view = o.v_in_k ? k_view : TensorView<const T>::bshd(v_cache.data(), B, C, K, Dv);
  if (o.v_in_k) v_view.extent[3] = Dv;  // the first D_v columns of each K row: K's pointer and strides

  // The steps. Sequence b is document b of `full`: its prompt, then the steps' tokens.
  std::vector<std::int64_t> first(static_cast<std::size_t>(B));  // the sequence's first row in `full`
  for (std::size_t b = 1; b < first.size(); ++b) first[b] = first[b - 1] + fs.documents.front()[b - 1];
  const HeadRange qh = dp.q_heads(), oh = dp.out_heads();
  std::vector<T> q(static_cast<std::size_t>(B * Tn * qh.count * D)), out(static_cast<std::size_t>(B * Tn * oh.count * Dv));
  std::vector<std::byte> workspace(dp.workspace_bytes());
  ex::ErrorStats err;
  double pairs = 0;
  std::vector<double> step_ms;  // each step's time; the median is reported (the first step warms up)
  step_ms.reserve(static_cast<std::size_t>(o.steps));
  comm.stats().reset();
  for (std::int64_t step = 0; step < o.steps; ++step) {
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < Tn; ++t) {
        const std::int64_t pos = dp.kv_len(b) + t, row = first[static_cast<std::size_t>(b)] + pos;
        if (dp.owner(b, pos) == me) {  // the new token's K/V go to its owner's slot
          const std::int64_t slot = b * C + dp.slot(b, pos);
          for (std::int64_t e = 0; e < K * D; ++e)
            k_cache[static_cast<std::size_t>(slot * K * D + e)] = static_cast<T>(full.k[static_cast<std::size_t>(row * K * D + e)]);
          for (std::int64_t e = 0; !o.v_in_k && e < K * Dv; ++e)
            v_cache[static_cast<std::size_t>(slot * K * Dv + e)] = static_cast<T>(full.v[static_cast<std::size_t>(row * K * Dv + e)]);
        }
        for (std::int64_t e = 0; e < qh.count * D; ++e)  // my query heads
          q[static_cast<std::size_t>((b * Tn + t) * qh.count * D + e)] =
              static_cast<T>(full.q[static_cast<std::size_t>((row * H + qh.begin) * D + e)]);
        pairs += static_cast<double>(pos + 1);
      }
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    decode.template step<T>(dp, TensorView<const T>::bshd(q.data(), B, Tn, qh.count, D),
                            k_view, v_view, TensorView<T>::bshd(out.data(), B, Tn, oh.count, Dv), workspace);
    step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (o.check)  // the step's rows of each whole sequence, causal over the prompt and the tokens so far
      for (std::int64_t b = 0; b < B; ++b) {
        const std::vector<double> want =
            ex::reference_rows(full, PositionMap::run(Tn, first[static_cast<std::size_t>(b)] + dp.kv_len(b)));
        for (std::int64_t t = 0; t < Tn; ++t)
          for (std::int64_t e = 0; e < oh.count * Dv; ++e)
            err.add_out(static_cast<double>(out[static_cast<std::size_t>((b * Tn + t) * oh.count * Dv + e)]),
                        want[static_cast<std::size_t>((t * H + oh.begin) * Dv + e)]);
      }
    dp.advance(Tn);
  }
  const std::uint64_t bytes = comm.stats().bytes_sent;
  err = ex::reduce_errors(comm, err);
  std::int64_t cached = 0;  // tokens of every sequence this rank stores at the end
  for (std::int64_t b = 0; b < B; ++b) cached += dp.layout().count(me, b, dp.kv_len(b));
  const auto rows = ex::gather_rows(
      comm, {cached, static_cast<std::int64_t>(bytes), static_cast<std::int64_t>(dp.step_bytes()),
             std::bit_cast<std::int64_t>(median(step_ms)), static_cast<std::int64_t>(pre.bytes),
             std::bit_cast<std::int64_t>(pre.ms), static_cast<std::int64_t>(handoff_bytes)});
  if (me != 0) return 0;

  std::uint64_t max_step_bytes = 0, max_pre_bytes = 0, max_handoff = 0;
  double max_ms = 0, max_pre_ms = 0;
  bool bytes_match = true;
  const std::string lens = comma_list(o.kv_len);
  std::printf("seqpar_demo  decode after a %s prefill  mesh %d (ulysses) x %d (ring)  comm=%s  ranks=%d\n",
              policy_type_name(o).c_str(), pre.ulysses, pre.ring, o.comm.c_str(), world);
  std::printf("problem      prompts=%s heads=%lld kv_heads=%lld head_dim=%lld head_dim_v=%lld dtype=%s new_tokens=%lld steps=%lld "
              "cache=%s exchange=%s\n",
              lens.c_str(), static_cast<long long>(H), static_cast<long long>(K), static_cast<long long>(D),
              static_cast<long long>(Dv), dtype_name(o.dtype), static_cast<long long>(Tn), static_cast<long long>(o.steps),
              o.page > 0 ? ("pages of " + std::to_string(o.page) + " round-robin").c_str() : "contiguous",
              o.exchange == DecodeExchange::heads ? "heads" : "all-gather");
  if (!o.model.empty()) std::printf("model        %s, layer kind %s\n", o.model.c_str(), o.layer.c_str());
  if (features_name(fs) != "none") std::printf("features     %s%s\n", features_name(fs).c_str(),
                                               o.v_in_k ? " (V: the first D_v columns of the cached K rows)" : "");
  print_kernel(o);
  std::printf("prefill      the prompts packed as causal documents of one sequence of %lld tokens, one forward\n",
              static_cast<long long>(prompts.shape.seq_q));
  std::printf("%6s %12s %14s %12s %14s %14s %10s\n", "rank", "cache_tokens", "prefill_bytes", "prefill_ms",
              "handoff_bytes", "bytes/step", "ms/step(med)");
  for (int w = 0; w < world; ++w) {
    const auto& r = rows[static_cast<std::size_t>(w)];
    const auto per_step = static_cast<std::uint64_t>(r[1]) / static_cast<std::uint64_t>(o.steps);
    bytes_match = bytes_match && static_cast<std::uint64_t>(r[1]) == static_cast<std::uint64_t>(r[2] * o.steps);
    max_step_bytes = std::max(max_step_bytes, per_step);
    max_ms = std::max(max_ms, std::bit_cast<double>(r[3]));
    max_pre_bytes = std::max(max_pre_bytes, static_cast<std::uint64_t>(r[4]));
    max_pre_ms = std::max(max_pre_ms, std::bit_cast<double>(r[5]));
    max_handoff = std::max(max_handoff, static_cast<std::uint64_t>(r[6]));
    std::printf("%6d %12lld %14lld %12.3f %14lld %14llu %10.3f\n", w, static_cast<long long>(r[0]),
                static_cast<long long>(r[4]), std::bit_cast<double>(r[5]), static_cast<long long>(r[6]),
                static_cast<unsigned long long>(per_step), std::bit_cast<double>(r[3]));
  }
  // FLOPs: 2 x (D + D_v) per visible (query, key) pair, every query head.
  const double gflops = 2.0 * static_cast<double>((D + Dv) * H) * pairs / (max_ms * static_cast<double>(o.steps) * 1e6);
  std::printf("traffic      bytes sent per step %s plan.step_bytes() on every rank\n", bytes_match ? "equal" : "DIFFER FROM");
  const double tol = o.dtype == DType::f64 ? 1e-12 : 1e-5;
  bool ok = true;
  if (o.check) {
    ok = print_check("prefill: ", pre.err, tol, "exact double reference") && ok;
    const char* how = "every step, exact double reference over the whole sequence";
    ok = print_check("decode steps: ", err, tol, how) && ok;
  }
  char tail[512];
  std::snprintf(tail, sizeof tail,
                " cpu_isa=%s layout=%s mode=decode kv_len=%s new_tokens=%lld steps=%lld page=%lld exchange=%s "
                "mesh=%dx%d dtype=%s gflops=%.2f prefill_max_rel_err=%s prefill_bytes_sent_per_rank=%llu prefill_ms=%.3f "
                "handoff_bytes_sent_per_rank=%llu features=%s%s",
                cpu_isa_name(default_cpu_isa()),
                o.policy == PolicyKind::ulysses ? "none" : layout_names[static_cast<int>(o.layout)], lens.c_str(),
                static_cast<long long>(Tn), static_cast<long long>(o.steps), static_cast<long long>(o.page),
                o.exchange == DecodeExchange::heads ? "heads" : "all-gather", pre.ulysses, pre.ring,
                dtype_name(o.dtype), gflops, error_text(o.check, pre.err.rel()).c_str(),
                static_cast<unsigned long long>(max_pre_bytes), max_pre_ms, static_cast<unsigned long long>(max_handoff),
                features_name(fs).c_str(), model_keys(o).c_str());
  g_results.push_back(result_head(o, world, prompts.shape.seq_q, err, max_step_bytes, max_ms) + tail);
  std::fflush(stdout);
  return ok && bytes_match ? 0 : 1;
}

}  // namespace seqpar_demo
