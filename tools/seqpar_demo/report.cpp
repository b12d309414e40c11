/// \file
/// seqpar_demo's report (report.hpp): the tables, the check lines and the RESULT line.

#include "report.hpp"

#include "seqpar/advise/advisor.hpp"
#include "seqpar/advise/machines.hpp"

#include <algorithm>
#include <cstdio>

namespace seqpar_demo {

std::string comma_list(const std::vector<std::int64_t>& v) {
  std::string text;
  for (std::int64_t n : v) text.append(text.empty() ? "" : ",").append(std::to_string(n));
  return text;
}

std::string mask_name(const ex::GlobalShape& s) {
  std::string m;
  auto add = [&](const std::string& part) { m.append(m.empty() ? "" : "+").append(part); };
  if (s.causal) add("causal");
  if (s.causal_align == CausalAlign::bottom_right) add("bottom-right");
  if (s.window.active()) add("window(" + std::to_string(s.window.left) + "," + std::to_string(s.window.right) + ")");
  if (!s.documents.empty()) add("docs(" + std::to_string(s.documents.front().size()) + ")");
  if (!s.kv_valid.empty()) add("kv_valid(" + comma_list(s.kv_valid) + ")");
  return m.empty() ? "none" : m;
}

std::string features_name(const ex::GlobalShape& s) {
  std::string m;
  auto add = [&](const std::string& part) { m.append(m.empty() ? "" : "+").append(part); };
  char text[64];
  if (s.value_dim() != s.head_dim) add("head_dim_v(" + std::to_string(s.value_dim()) + ")");
  if (s.softcap > 0) {
    std::snprintf(text, sizeof text, "softcap(%g)", s.softcap);
    add(text);
  }
  if (!s.sinks.empty()) add("sinks");
  if (s.scale != 0) {
    std::snprintf(text, sizeof text, "scale(%.6g)", s.scale);
    add(text);
  }
  return m.empty() ? "none" : m;
}

std::string model_keys(const Options& o) {
  return o.model.empty() ? "" : " model=" + o.model + " layer=" + o.layer;
}

void print_kernel(const Options& o) {
  std::printf("kernel       CpuFlashKernel on %d thread(s) per rank, %s (%d-bit vectors, chosen at run time; this CPU's "
              "widest: %s; SEQPAR_CPU_ISA caps it)\n",
              o.threads > 0 ? o.threads : 1, cpu_isa_name(default_cpu_isa()), cpu_isa_vector_bits(default_cpu_isa()),
              cpu_isa_name(widest_cpu_isa()));
}

std::string error_text(bool checked, double x) {
  char text[32] = "n/a";
  if (checked) std::snprintf(text, sizeof text, "%.3e", x);
  return text;
}

bool print_check(const char* what, const ex::ErrorStats& e, double tol, const char* how) {
  const bool ok = e.rel() <= tol;
  std::printf("check        %smax|err| / max|ref| = %.3e (tolerance %.0e, %s): %s\n", what, e.rel(), tol, how,
              ok ? "PASS" : "FAIL");
  return ok;
}

std::string result_head(const Options& o, int world, std::int64_t seq, const ex::ErrorStats& err, std::uint64_t bytes,
                        double ms) {
  char head[512];
  std::snprintf(head, sizeof head,
                "RESULT policy=%s ranks=%d seq=%lld heads=%lld max_abs_err=%s max_rel_err=%s bytes_sent_per_rank=%llu "
                "time_ms_per_iter=%.3f",
                o.policy_name.c_str(), world, static_cast<long long>(seq), static_cast<long long>(o.heads),
                error_text(o.check, err.max_abs).c_str(), error_text(o.check, err.rel()).c_str(),
                static_cast<unsigned long long>(bytes), ms);
  return head;
}

namespace {

/// The hint after the balance figure: which layout balances this mask's work.
const char* balance_hint(const Options& o, const ex::GlobalShape& s, const MeshConfig& mesh, double imbalance) {
  if (imbalance <= 1.2 || mesh.ring < 2) return "";
  if (!s.documents.empty() && o.layout != LayoutKind::stripe)
    return " (packed documents: --layout stripe gives every rank a share of each)";
  if (s.causal && !s.window.active() && o.layout == LayoutKind::contiguous)
    return " (causal with a contiguous split: --layout zigzag balances this)";
  return "";
}

}  // namespace

bool report_run(const Options& o, const ex::GlobalShape& s, const MeshConfig& mesh, const RunFigures& f,
                const ex::ErrorStats& err, const ex::ErrorStats& grad_err, double check_s, int sweep_at,
                const std::vector<PhaseProfile>& profiles, double est_ms) {
  const int world = static_cast<int>(f.rows.size());
  const bool sweeping = sweep_at >= 0;
  // FLOPs: 2 x (D + D_v) per visible score pair in forward (QK^T and PV), 2.5 times that in backward.
  const double flops_per_pair =
      2.0 * static_cast<double>(s.head_dim + s.value_dim()) * (o.backward ? 3.5 : 1.0);
  // bf16: the output's own rounding is up to 2^-9 of its largest value, and the kernels round
  // the probabilities to bf16 before P V, as GPU kernels do.
  const double tol = o.dtype == DType::f64 ? 1e-12 : o.dtype == DType::bf16 ? 1e-2 : 1e-5;
  // The sinks' gradients are float in every element type (backward's d_sinks): with them, an
  // f64 run's gradients are held to float's rounding.
  const double f64_grad_tol = o.sinks ? 1e-6 : 1e-11;
  const double grad_tol = o.dtype == DType::f64 ? f64_grad_tol : o.dtype == DType::bf16 ? 2e-2 : 1e-4;
  const bool fwd_ok = err.rel() <= tol, grad_ok = !o.backward || grad_err.rel() <= grad_tol;
  const std::string mask = mask_name(s);
  if (sweep_at <= 0) {
    std::printf("seqpar_demo  %s  mesh %d (ulysses) x %d (ring)  comm=%s  ranks=%d\n", policy_type_name(o).c_str(),
                mesh.ulysses, mesh.ring, o.comm.c_str(), world);
    std::printf("problem      batch=%lld seq=%s kv_seq=%s heads=%lld kv_heads=%lld head_dim=%lld mask=%s dtype=%s\n",
                static_cast<long long>(s.batch), sweeping ? "sweep" : std::to_string(s.seq_q).c_str(),
                sweeping ? "sweep" : std::to_string(s.kv_len()).c_str(), static_cast<long long>(s.heads),
                static_cast<long long>(s.kv_head_count()), static_cast<long long>(s.head_dim), mask.c_str(),
                dtype_name(o.dtype));
    if (!o.model.empty()) std::printf("model        %s, layer kind %s\n", o.model.c_str(), o.layer.c_str());
    if (features_name(s) != "none") std::printf("features     %s\n", features_name(s).c_str());
    print_kernel(o);
  }
  if (sweeping) {
    if (sweep_at == 0)
      std::printf("sweep        one row per length: bytes of the busiest rank, time of the slowest, score pairs of all\n"
                  "%10s %14s %14s %14s %10s %9s %8s %9s %11s\n",
                  "seq", "score_pairs", "bytes_sent", "bytes_formula", "ms/iter", "GFLOP/s", "GB/s", "imbalance",
                  o.check ? "max_rel_err" : "");
    std::uint64_t max_formula = 0;
    for (const auto& r : f.rows) max_formula = std::max(max_formula, static_cast<std::uint64_t>(r[RunFigures::formula]));
    std::printf("%10lld %14.0f %14llu %14llu %10.3f %9.2f %8.3f %9.2f %11s%s\n", static_cast<long long>(s.seq_q),
                f.total_work, static_cast<unsigned long long>(f.max_bytes), static_cast<unsigned long long>(max_formula),
                f.max_ms, f.gflops(flops_per_pair), f.gbps(), f.imbalance(), error_text(o.check, err.rel()).c_str(),
                f.bytes_match ? "" : "  bytes DIFFER from the plan's count");
  } else {
    std::printf("%6s %5s %8s %9s %10s %14s %14s %14s %10s %9s %8s\n", "rank", "ring", "ulysses", "q_tokens",
                "kv_tokens", "score_pairs", "bytes_sent", "bytes_formula", "ms/iter", "GFLOP/s", "GB/s");
    for (int w = 0; w < world; ++w) {
      const auto& r = f.rows[static_cast<std::size_t>(w)];
      const double rank_ms = RunFigures::rank_ms(r);
      std::printf("%6d %5d %8d %9lld %10lld %14lld %14lld %14lld %10.3f %9.2f %8.3f\n", w, mesh.ring_rank(w),
                  mesh.ulysses_rank(w), static_cast<long long>(r[RunFigures::q_tokens]),
                  static_cast<long long>(r[RunFigures::kv_tokens]), static_cast<long long>(r[RunFigures::work]),
                  static_cast<long long>(r[RunFigures::bytes]), static_cast<long long>(r[RunFigures::formula]), rank_ms,
                  flops_per_pair * static_cast<double>(r[RunFigures::work]) / (rank_ms * 1e6),
                  static_cast<double>(r[RunFigures::bytes]) / (rank_ms * 1e6));
    }
    std::printf("throughput   %.2f GFLOP/s in all (4 x head_dim x visible score pairs%s over the slowest rank's time), "
                "%.3f GB/s sent by the busiest rank\n",
                f.gflops(flops_per_pair), o.backward ? " x 3.5 for forward + backward" : "", f.gbps());
    std::printf("balance      max/mean visible score pairs per rank = %.2f%s\n", f.imbalance(),
                balance_hint(o, s, mesh, f.imbalance()));
    std::printf("traffic      bytes sent %s the plan's analytic count\n", f.bytes_match ? "equal" : "DIFFER FROM");
    if (est_ms >= 0)
      std::printf("estimate     %.3f ms per iteration by the cost model on this machine's calibrated figures "
                  "(measured %.3f: model %+.0f%%)\n",
                  est_ms, f.max_ms, 100.0 * (est_ms - f.max_ms) / f.max_ms);
    if (o.profile) ex::print_profile(profiles);
    if (o.check) {
      char how[96];
      std::snprintf(how, sizeof how, "exact double reference, %.1f s", check_s);
      print_check("", err, tol, how);
      if (o.backward)
        print_check(o.sinks ? "gradients dq, dk, dv, d_sinks: " : "gradients dq, dk, dv: ", grad_err, grad_tol,
                    "exact double reference");
    }
  }
  // With --backward, time and bytes cover forward + backward and the gradient error comes last.
  char tail[512];
  std::snprintf(tail, sizeof tail,
                "%s%s cpu_isa=%s layout=%s causal=%d mesh=%dx%d dtype=%s backward=%d gflops=%.2f imbalance=%.2f mask=%s "
                "features=%s%s%s",
                o.backward ? " grad_max_rel_err=" : "", o.backward ? error_text(o.check, grad_err.rel()).c_str() : "",
                cpu_isa_name(default_cpu_isa()),
                o.policy == PolicyKind::ulysses ? "none" : layout_names[static_cast<int>(o.layout)], s.causal ? 1 : 0,
                mesh.ulysses, mesh.ring, dtype_name(o.dtype), o.backward ? 1 : 0, f.gflops(flops_per_pair),
                f.imbalance(), mask.c_str(), features_name(s).c_str(), model_keys(o).c_str(),
                est_ms >= 0 ? (" est_ms=" + std::to_string(est_ms)).c_str() : "");
  g_results.push_back(result_head(o, world, s.seq_q, err, f.max_bytes, f.max_ms) + tail);
  std::fflush(stdout);
  return !o.check || (fwd_ok && grad_ok);
}

void print_results() {
  for (const std::string& line : g_results) std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

int print_advice(const Options& o, const ex::GlobalShape& s) {
  Machine m = machines::by_name(o.machine);
  if (o.ranks_per_node) m.ranks_per_node = o.ranks_per_node;
  const int world = o.ranks ? o.ranks : 4;
  AttentionProblem pr = s.problem<float>(o.backward);
  pr.dtype = o.dtype;
  const std::vector<Choice> choices = advise(pr, s.seq_q, s.kv_len(), world, m, o.backward);
  std::printf("advise       %d ranks of %s (%d per node), %s\n", world, m.name.c_str(), std::min(m.ranks_per_node, world),
              o.backward ? "forward + backward" : "forward");
  std::printf("problem      batch=%lld seq=%lld kv_seq=%lld heads=%lld kv_heads=%lld head_dim=%lld mask=%s dtype=%s\n",
              static_cast<long long>(s.batch), static_cast<long long>(s.seq_q), static_cast<long long>(s.kv_len()),
              static_cast<long long>(s.heads), static_cast<long long>(s.kv_head_count()),
              static_cast<long long>(s.head_dim), mask_name(s).c_str(), dtype_name(o.dtype));
  std::printf("machine      %s\n", m.source.c_str());
  std::printf("%-36s %10s %10s %10s %10s %9s %14s\n", "choice", "est ms", "fwd ms", "bwd ms", "comm ms", "imbalance",
              "bytes/rank");
  for (const Choice& c : choices) {
    if (!c.runs) continue;
    const Estimate& e = c.estimate;
    double comm = 0;
    for (const Estimate::PhaseMs* t : {&e.forward, &e.backward})
      if (t == &e.forward || o.backward)
        for (Phase p : {Phase::all_to_all_in, Phase::all_to_all_out, Phase::wait}) comm += (*t)[static_cast<int>(p)];
    char bwd[32] = "-";
    if (o.backward) std::snprintf(bwd, sizeof bwd, "%.3f", e.backward_ms());
    std::printf("%-36s %10.3f %10.3f %10s %10.3f %9.2f %14llu\n", c.name.c_str(), c.ms, e.forward_ms(), bwd, comm,
                e.imbalance(),
                static_cast<unsigned long long>(e.forward_bytes + (o.backward ? e.backward_bytes : 0)));
  }
  for (const Choice& c : choices)
    if (!c.runs) std::printf("%-36s refused: %s\n", c.name.c_str(), c.reason.c_str());
  if (choices.empty() || !choices.front().runs) {
    std::printf("RESULT advise=none\n");
    return 1;
  }
  std::printf("RESULT advise=%s est_ms=%.3f world=%d machine=%s\n", choices.front().name.c_str(), choices.front().ms,
              world, m.name.c_str());
  return 0;
}

}  // namespace seqpar_demo
