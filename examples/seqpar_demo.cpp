/// \file
/// seqpar_demo: runs one policy on a random attention problem over MPI processes or threads,
/// checks it against the exact reference, and reports the error, the traffic and the time.
/// Its command line is a stable interface (scripts and tests parse the last line, RESULT).
///
/// Built as two objects so that two cores compile it in half the time (examples/CMakeLists.txt):
/// with SEQPAR_DEMO_SPLIT, the one compiled with SEQPAR_DEMO_F64_PART holds only the f64 runs;
/// the other holds the rest and the f32 runs. Without SEQPAR_DEMO_SPLIT it is one program.

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "common.hpp"
#include "seqpar/seqpar.hpp"
#ifdef SEQPAR_HAS_MPI
#include "seqpar/comm/mpi_communicator.hpp"
#endif

namespace seqpar_demo {

using namespace seqpar;
namespace ex = seqpar::examples;

constexpr const char* usage_text =
    "usage: seqpar_demo --policy ulysses|ring|unified [--anything] [--layout contiguous|zigzag|stripe]\n"
    "                   [--ulysses-degree U] [--ring-degree R] [--batch B] [--seq S] [--heads H]\n"
    "                   [--kv-heads K] [--head-dim D] [--causal] [--dtype f32|f64] [--comm mpi|threads]\n"
    "                   [--ranks N] [--iters I] [--check] [--threads N] [--seed N] [--backward] [--profile]\n"
    "                   [--verbose]\n"
    "  --seq is the global length, split over the ranks as evenly as the mesh allows; plain policies\n"
    "  need it to divide evenly (use --anything otherwise). Defaults: --batch 1 --seq 2048 --heads 8\n"
    "  --kv-heads H --head-dim 64 --dtype f32 --iters 2; --comm mpi under an MPI launcher (when built\n"
    "  with MPI), else threads with --ranks 4. The last line printed is\n"
    "  RESULT policy=... ranks=... seq=... heads=... max_abs_err=... max_rel_err=... bytes_sent_per_rank=... "
    "time_ms_per_iter=... cpu_isa=... layout=... causal=... mesh=UxR dtype=... backward=... gflops=...\n"
    "  GFLOP/s counts 4 x head_dim x visible score pairs per forward (x3.5 with --backward);\n"
    "  --verbose adds where in the library an error was raised.\n"
    "  --backward also runs backward after each forward (time and bytes cover both) and, with --check,\n"
    "  appends grad_max_rel_err=... (dq, dk, dv against the exact double reference).\n"
    "  --profile prints, per rank, the time of each phase of the timed calls (pack, all-to-alls, each\n"
    "  ring step's compute, merge and wait, unpack) and the share of ring transfer time hidden by compute.\n";

/// A wrong option or a combination the demo does not run. Every rank sees the same options,
/// so every rank throws it alike: the demo prints one line and exits with status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class PolicyKind { ulysses, ring, unified };

/// The parsed command line.
struct Options {
  PolicyKind policy = PolicyKind::ulysses;
  std::string policy_name;
  bool anything = false;
  LayoutKind layout = LayoutKind::contiguous;
  bool layout_given = false;
  int ulysses_degree = 0, ring_degree = 0;
  std::int64_t batch = 1, seq = 2048, heads = 8, kv_heads = 0, head_dim = 64;
  bool causal = false;
  bool f64 = false;
  std::string comm;  // "" = choose
  int ranks = 0;     // 0 = world size (mpi) or 4 (threads)
  int iters = 2;
  bool check = false;
  int threads = 0;  // 0 = the kernel's default
  std::uint64_t seed = 2024;
  bool backward = false;
  bool profile = false;
  bool verbose = false;
};

/// Set once this process's plan is made: from then on a ConfigError (from forward or backward)
/// is this rank's alone, not collective.
inline std::atomic<bool> g_planned{false};

/// An error message for a command-line user: the library's " (at file:line)" suffix dropped
/// unless --verbose, and the flag that fixes a plain policy's uneven split named.
inline std::string user_message(const std::exception& e, bool verbose) {
  std::string m = e.what();
  if (!verbose)
    if (const auto at = m.rfind(" (at "); at != std::string::npos && m.back() == ')') m.erase(at);
  if (m.find("AnythingPolicy<") != std::string::npos)
    m += "\n  (on the command line: add --anything)";
  else if (m.find("ulysses_degree x ring_degree") != std::string::npos)
    m += "\n  (on the command line: --ulysses-degree U --ring-degree R with U x R = the number of ranks)";
  return m;
}

#ifndef SEQPAR_DEMO_F64_PART
/// An integer option's value; `max` keeps products of shape options far from overflow.
std::int64_t parse_int(std::string_view name, const char* text, std::int64_t min, std::int64_t max = 1 << 30) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || v < min || errno == ERANGE || v > max)
    throw UsageError(std::string(name) + ": expected an integer from " + std::to_string(min) + " to " +
                     std::to_string(max) + ", got '" + text + "'");
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  bool policy_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(usage_text, stdout);
      std::exit(0);
    }
    if (a == "--anything") { o.anything = true; continue; }
    if (a == "--causal") { o.causal = true; continue; }
    if (a == "--check") { o.check = true; continue; }
    if (a == "--backward") { o.backward = true; continue; }
    if (a == "--profile") { o.profile = true; continue; }
    if (a == "--verbose") { o.verbose = true; continue; }
    if (a.substr(0, 2) != "--") throw UsageError("'" + std::string(a) + "': expected an option such as --seq (see --help)");
    if (i + 1 >= argc) throw UsageError(std::string(a) + ": unknown option or missing value (see --help)");
    const char* v = argv[++i];
    const std::string_view s = v;
    if (a == "--policy") {
      policy_given = true;
      o.policy_name = s;
      if (s == "ulysses") o.policy = PolicyKind::ulysses;
      else if (s == "ring") o.policy = PolicyKind::ring;
      else if (s == "unified") o.policy = PolicyKind::unified;
      else throw UsageError("--policy: expected ulysses, ring or unified, got '" + std::string(s) + "'");
    } else if (a == "--layout") {
      o.layout_given = true;
      if (s == "contiguous") o.layout = LayoutKind::contiguous;
      else if (s == "zigzag") o.layout = LayoutKind::zigzag;
      else if (s == "stripe") o.layout = LayoutKind::stripe;
      else throw UsageError("--layout: expected contiguous, zigzag or stripe, got '" + std::string(s) + "'");
    } else if (a == "--dtype") {
      if (s != "f32" && s != "f64")
        throw UsageError("--dtype: expected f32 or f64 (the CPU kernel's types), got '" + std::string(s) + "'");
      o.f64 = s == "f64";
    } else if (a == "--comm") {
      if (s != "mpi" && s != "threads") throw UsageError("--comm: expected mpi or threads, got '" + std::string(s) + "'");
      o.comm = s;
    } else if (a == "--ulysses-degree") o.ulysses_degree = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--ring-degree") o.ring_degree = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--batch") o.batch = parse_int(a, v, 1);
    else if (a == "--seq") o.seq = parse_int(a, v, 1);
    else if (a == "--heads") o.heads = parse_int(a, v, 1);
    else if (a == "--kv-heads") o.kv_heads = parse_int(a, v, 1);
    else if (a == "--head-dim") o.head_dim = parse_int(a, v, 1);
    else if (a == "--ranks") o.ranks = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--iters") o.iters = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--threads") o.threads = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--seed") o.seed = static_cast<std::uint64_t>(parse_int(a, v, 0, std::numeric_limits<std::int64_t>::max()));
    else throw UsageError(std::string(a) + ": unknown option (see --help)");
  }
  if (!policy_given) throw UsageError("--policy: required (ulysses, ring or unified)");
  // The global inputs are made on every rank: keep them within what a vector can hold.
  const double elems = static_cast<double>(o.batch) * static_cast<double>(o.seq) * static_cast<double>(o.heads) *
                       static_cast<double>(o.head_dim);
  if (elems > 1e10)
    throw UsageError("--batch x --seq x --heads x --head-dim = " + std::to_string(elems) +
                     " elements: too large for this demo (which holds the global inputs on every rank)");
  if (o.kv_heads != 0 && o.heads % o.kv_heads != 0)
    throw UsageError("--kv-heads: expected a divisor of --heads " + std::to_string(o.heads) + ", got " +
                     std::to_string(o.kv_heads));
  if (o.policy == PolicyKind::ulysses && o.layout != LayoutKind::contiguous)
    throw UsageError("--layout: --policy ulysses has no ring, so no layout; use --policy unified --ring-degree R");
  return o;
}

#endif  // SEQPAR_DEMO_F64_PART

/// The world size and degrees the options ask for, checked against the world.
inline void check_degrees(const Options& o, int world) {
  if (o.ranks != 0 && o.ranks != world)
    throw UsageError("--ranks " + std::to_string(o.ranks) + " but the MPI world has " + std::to_string(world) +
                     " ranks (use mpirun -np " + std::to_string(o.ranks) + ")");
  if (o.policy == PolicyKind::ulysses && ((o.ring_degree > 1) || (o.ulysses_degree && o.ulysses_degree != world)))
    throw UsageError("--policy ulysses uses all " + std::to_string(world) +
                     " ranks as its Ulysses degree; use --policy unified for a mesh");
  if (o.policy == PolicyKind::ring && ((o.ulysses_degree > 1) || (o.ring_degree && o.ring_degree != world)))
    throw UsageError("--policy ring uses all " + std::to_string(world) +
                     " ranks as its ring degree; use --policy unified for a mesh");
}

/// Readable type name of the policy the options select.
/// --layout's values, by LayoutKind.
constexpr const char* layout_names[] = {"contiguous", "zigzag", "stripe"};

inline std::string policy_type_name(const Options& o) {
  static constexpr const char* layouts[] = {"Contiguous", "Zigzag", "Stripe"};
  std::string n = o.policy == PolicyKind::ulysses ? "UlyssesPolicy"
                  : std::string(o.policy == PolicyKind::ring ? "RingPolicy<" : "UnifiedPolicy<") +
                        layouts[static_cast<int>(o.layout)] + ">";
  return o.anything ? "AnythingPolicy<" + n + ">" : n;
}

/// Calls `run(policy)` with `base` or AnythingPolicy<base>, as the options say.
template <class Base, class F>
int with_anything(const Options& o, Base base, F& run) {
  if (o.anything) return run(AnythingPolicy<Base>{base});
  return run(base);
}

/// Calls `run(policy)` with P<layout> for the layout the options name, configured by `configure`.
template <template <class> class P, class Configure, class F>
int with_layout(const Options& o, Configure configure, F& run) {
  switch (o.layout) {
    case LayoutKind::contiguous: return with_anything(o, configure(P<Contiguous>{}), run);
    case LayoutKind::zigzag: return with_anything(o, configure(P<Zigzag>{}), run);
    case LayoutKind::stripe: return with_anything(o, configure(P<Stripe>{}), run);
  }
  throw UsageError("--layout: unknown layout");
}

/// The one switch from the command line to the compile-time policy types.
template <class F>
int with_policy(const Options& o, int world, F run) {
  switch (o.policy) {
    case PolicyKind::ulysses: return with_anything(o, UlyssesPolicy{}, run);
    case PolicyKind::ring: return with_layout<RingPolicy>(o, [](auto p) { return p; }, run);
    case PolicyKind::unified:
      return with_layout<UnifiedPolicy>(o, [&](auto p) {
        p.ulysses_degree = o.ulysses_degree;
        p.ring_degree = o.ring_degree;
        if (!p.ulysses_degree && !p.ring_degree)  // default: the squarest mesh, Ulysses side smaller
          for (int d = 1; d * d <= world; ++d)
            if (world % d == 0) p.ulysses_degree = d;
        return p;
      }, run);
  }
  throw UsageError("--policy: unknown policy");
}

/// Builds the kernel with the requested thread count when the kernel can use one.
template <class Kernel>
Kernel make_kernel(const Options& o, bool print) {
  if constexpr (std::is_constructible_v<Kernel, int>) {
    if (o.threads > 0) return Kernel(o.threads);
  } else {
    if (o.threads > 1 && print) std::fprintf(stderr, "seqpar_demo: --threads: this kernel is single-threaded; ignored\n");
  }
  return Kernel{};
}

/// One rank's run of `Policy` with element type T: plan, a checked forward, timed forwards,
/// and (rank 0) the report. Returns the exit status.
template <class T, class Policy, class Comm>
int run_rank(Comm& comm, const Options& o, const ex::GlobalInputs& g, Policy policy) {
  const int me = comm.rank(), world = comm.size();
  const bool print = me == 0;
  SequenceParallelAttention<Policy, Comm, CpuFlashKernel> attn(comm, policy, make_kernel<CpuFlashKernel>(o, print));
  const MeshConfig& mesh = attn.mesh();
  const Plan plan =
      attn.plan(g.shape.problem<T>(o.backward), {split_sequence(o.seq, mesh)[static_cast<std::size_t>(me)]});
  g_planned = true;

  const ex::GlobalShape& s = g.shape;
  const auto B = s.batch, H = s.heads, K = s.kv_head_count(), D = s.head_dim;
  const PositionMap qpos = plan.q_positions(me), kvpos = plan.kv_positions(me);
  ex::LocalSlices<T> l = ex::local_slices<T>(g, qpos, kvpos);
  std::vector<std::byte> workspace(std::max(plan.workspace_bytes(), o.backward ? plan.backward_workspace_bytes() : 0));
  using CV = TensorView<const T>;
  using V = TensorView<T>;
  const CV q = CV::bshd(l.q.data(), B, l.lq, H, D), k = CV::bshd(l.k.data(), B, l.lkv, K, D),
           v = CV::bshd(l.v.data(), B, l.lkv, K, D);
  const V out = V::bshd(l.out.data(), B, l.lq, H, D);
  // Backward state: the LSE kept from forward, the upstream gradient and the three gradients.
  std::vector<acc_t<T>> lse(o.backward ? static_cast<std::size_t>(B * l.lq * H) : 0);
  const std::vector<T> dout = o.backward ? ex::take_rows<T>(g.dout, B, s.seq_q, H, D, qpos) : std::vector<T>{};
  std::vector<T> dq(o.backward ? l.q.size() : 0), dk(o.backward ? l.k.size() : 0), dv(dk.size());
  const auto lse_view = o.backward ? TensorView<acc_t<T>>::lse_bhs(lse.data(), B, l.lq, H) : TensorView<acc_t<T>>{};
  auto step = [&] {
    attn.template forward<T>(plan, q, k, v, out, lse_view, workspace);
    if (o.backward)
      attn.template backward<T>(plan, CV::bshd(dout.data(), B, l.lq, H, D), q, k, v, out, lse_view,
                                V::bshd(dq.data(), B, l.lq, H, D), V::bshd(dk.data(), B, l.lkv, K, D),
                                V::bshd(dv.data(), B, l.lkv, K, D), workspace);
  };

  // The first step is the one measured for traffic and checked; it also warms up.
  comm.stats().reset();
  step();
  const std::uint64_t bytes = comm.stats().bytes_sent;
  ex::ErrorStats err, grad_err;
  const auto check_start = std::chrono::steady_clock::now();
  if (o.check) {
    if (print)
      std::printf("check        computing the exact double-precision reference for every rank's rows%s...\n",
                  o.backward ? " and the gradients" : "");
    std::fflush(stdout);
    err = ex::reduce_errors(comm, ex::compare(l.out, ex::reference_rows(g, qpos)));
    if (o.backward) {
      const ex::ReferenceGrads want = ex::reference_grads(g, qpos, kvpos);
      ex::ErrorStats e = ex::compare(dq, want.dq);
      for (const ex::ErrorStats& x : {ex::compare(dk, want.dk), ex::compare(dv, want.dv)})
        e.max_abs = std::max(e.max_abs, x.max_abs), e.max_ref = std::max(e.max_ref, x.max_ref), e.nan |= x.nan;
      grad_err = ex::reduce_errors(comm, e);
    }
  }
  const double check_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - check_start).count();

  PhaseProfile profile;  // only the timed calls
  if (o.profile) attn.set_profile(&profile);
  comm.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < o.iters; ++i) step();
  comm.barrier();  // the time of the slowest rank
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / o.iters;
  attn.set_profile(nullptr);
  std::vector<PhaseProfile> profiles;
  if (o.profile)
    for (const auto& row : ex::gather_rows(comm, ex::profile_row(profile))) profiles.push_back(ex::profile_from_row(row));
  const std::uint64_t formula = plan.forward_bytes(me) + (o.backward ? plan.backward_bytes(me) : 0);

  const auto rows = ex::gather_rows(comm, {plan.local_q(), plan.local_kv(), plan.work(me), static_cast<std::int64_t>(bytes),
                                           static_cast<std::int64_t>(formula),
                                           std::bit_cast<std::int64_t>(ms)});
  if (!print) return 0;
  std::printf("seqpar_demo  %s  mesh %d (ulysses) x %d (ring)  comm=%s  ranks=%d\n", policy_type_name(o).c_str(),
              mesh.ulysses, mesh.ring, o.comm.c_str(), world);
  std::printf("problem      batch=%lld seq=%lld heads=%lld kv_heads=%lld head_dim=%lld causal=%s dtype=%s\n",
              static_cast<long long>(s.batch), static_cast<long long>(s.seq_q), static_cast<long long>(s.heads),
              static_cast<long long>(s.kv_head_count()), static_cast<long long>(s.head_dim), s.causal ? "yes" : "no",
              o.f64 ? "f64" : "f32");
  std::printf("kernel       CpuFlashKernel on %d thread(s) per rank, %s (%d-bit vectors, chosen at run time; this CPU's "
              "widest: %s; SEQPAR_CPU_ISA caps it)\n",
              o.threads > 0 ? o.threads : 1, cpu_isa_name(default_cpu_isa()), cpu_isa_vector_bits(default_cpu_isa()),
              cpu_isa_name(widest_cpu_isa()));
  // FLOPs: 4 x D per visible score pair in forward (QK^T and PV), 2.5 times that in backward.
  const double flops_per_pair = 4.0 * static_cast<double>(D) * (o.backward ? 3.5 : 1.0);
  std::printf("%6s %5s %8s %9s %10s %14s %14s %14s %10s %9s %8s\n", "rank", "ring", "ulysses", "q_tokens", "kv_tokens",
              "score_pairs", "bytes_sent", "bytes_formula", "ms/iter", "GFLOP/s", "GB/s");
  std::uint64_t max_bytes = 0;
  double max_ms = 0, total_work = 0, max_work = 0;
  bool bytes_match = true;
  for (int w = 0; w < world; ++w) {
    const auto& r = rows[static_cast<std::size_t>(w)];
    const double rank_ms = std::bit_cast<double>(r[5]);
    max_bytes = std::max(max_bytes, static_cast<std::uint64_t>(r[3]));
    max_ms = std::max(max_ms, rank_ms);
    total_work += static_cast<double>(r[2]);
    max_work = std::max(max_work, static_cast<double>(r[2]));
    bytes_match = bytes_match && r[3] == r[4];
    std::printf("%6d %5d %8d %9lld %10lld %14lld %14lld %14lld %10.3f %9.2f %8.3f\n", w, mesh.ring_rank(w),
                mesh.ulysses_rank(w), static_cast<long long>(r[0]), static_cast<long long>(r[1]),
                static_cast<long long>(r[2]), static_cast<long long>(r[3]), static_cast<long long>(r[4]), rank_ms,
                flops_per_pair * static_cast<double>(r[2]) / (rank_ms * 1e6), static_cast<double>(r[3]) / (rank_ms * 1e6));
  }
  // The whole run: every rank's FLOPs over the slowest rank's time; bytes of the busiest sender.
  const double gflops = flops_per_pair * total_work / (max_ms * 1e6);
  const double imbalance = total_work > 0 ? max_work / (total_work / world) : 1.0;
  std::printf("throughput   %.2f GFLOP/s in all (4 x head_dim x score pairs%s over the slowest rank's time), "
              "%.3f GB/s sent by the busiest rank\n",
              gflops, o.backward ? " x 3.5 for forward + backward" : "", static_cast<double>(max_bytes) / (max_ms * 1e6));
  std::printf("balance      max/mean score pairs per rank = %.2f%s\n", imbalance,
              imbalance > 1.2 && s.causal && o.layout == LayoutKind::contiguous && mesh.ring > 1
                  ? " (causal with a contiguous split: --layout zigzag balances this)"
                  : "");
  std::printf("traffic      bytes sent %s the plan's analytic count\n", bytes_match ? "equal" : "DIFFER FROM");
  if (o.profile) ex::print_profile(profiles);
  const double tol = o.f64 ? 1e-12 : 1e-5, grad_tol = o.f64 ? 1e-11 : 1e-4;
  const bool fwd_ok = err.rel() <= tol, grad_ok = !o.backward || grad_err.rel() <= grad_tol;
  const bool ok = !o.check || (fwd_ok && grad_ok);
  char abs_text[32] = "n/a", rel_text[32] = "n/a", grad_text[32] = "n/a";
  if (o.check) {
    std::snprintf(abs_text, sizeof abs_text, "%.3e", err.max_abs);
    std::snprintf(rel_text, sizeof rel_text, "%.3e", err.rel());
    std::printf("check        max|err| / max|ref| = %s (tolerance %.0e, exact double reference, %.1f s): %s\n",
                rel_text, tol, check_s, fwd_ok ? "PASS" : "FAIL");
    if (o.backward) {
      std::snprintf(grad_text, sizeof grad_text, "%.3e", grad_err.rel());
      std::printf("check        gradients dq, dk, dv: max|err| / max|ref| = %s (tolerance %.0e): %s\n", grad_text,
                  grad_tol, grad_ok ? "PASS" : "FAIL");
    }
  }
  // With --backward, time and bytes cover forward + backward and the gradient error comes last.
  std::printf("RESULT policy=%s ranks=%d seq=%lld heads=%lld max_abs_err=%s max_rel_err=%s bytes_sent_per_rank=%llu "
              "time_ms_per_iter=%.3f%s%s cpu_isa=%s layout=%s causal=%d mesh=%dx%d dtype=%s backward=%d gflops=%.2f "
              "imbalance=%.2f\n",
              o.policy_name.c_str(), world, static_cast<long long>(o.seq), static_cast<long long>(o.heads), abs_text,
              rel_text, static_cast<unsigned long long>(max_bytes), max_ms, o.backward ? " grad_max_rel_err=" : "",
              o.backward ? grad_text : "", cpu_isa_name(default_cpu_isa()),
              o.policy == PolicyKind::ulysses ? "none" : layout_names[static_cast<int>(o.layout)], s.causal ? 1 : 0,
              mesh.ulysses, mesh.ring, o.f64 ? "f64" : "f32", o.backward ? 1 : 0, gflops, imbalance);
  std::fflush(stdout);
  return ok ? 0 : 1;
}

/// Runs the options' policy with element type T on one rank.
template <class T, class Comm>
int run_typed(Comm& comm, const Options& o, const ex::GlobalInputs& g) {
  return with_policy(o, comm.size(), [&](auto policy) { return run_rank<T>(comm, o, g, policy); });
}

#ifdef SEQPAR_DEMO_SPLIT
// The f64 runs: compiled in the SEQPAR_DEMO_F64_PART object, used from the other.
#ifdef SEQPAR_DEMO_F64_PART
#define SEQPAR_DEMO_F64_INSTANCE(Comm) template int run_typed<double, Comm>(Comm&, const Options&, const ex::GlobalInputs&);
#else
#define SEQPAR_DEMO_F64_INSTANCE(Comm) \
  extern template int run_typed<double, Comm>(Comm&, const Options&, const ex::GlobalInputs&);
#endif
SEQPAR_DEMO_F64_INSTANCE(ThreadCommunicator)
#ifdef SEQPAR_HAS_MPI
SEQPAR_DEMO_F64_INSTANCE(MpiCommunicator)
#endif
#endif  // SEQPAR_DEMO_SPLIT

#ifndef SEQPAR_DEMO_F64_PART
/// Runs the options' dtype and policy on one rank.
template <class Comm>
int run_options(Comm& comm, const Options& o, const ex::GlobalInputs& g) {
  check_degrees(o, comm.size());
  return o.f64 ? run_typed<double>(comm, o, g) : run_typed<float>(comm, o, g);
}

/// True when an MPI launcher started this process (mpirun, mpiexec, srun).
bool under_mpi_launcher() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "SLURM_STEP_NUM_TASKS"})
    if (std::getenv(v)) return true;
  return false;
}

int report(const std::exception& e, const char* kind, bool verbose) {
  std::fprintf(stderr, "seqpar_demo: %s%s\n", kind, user_message(e, verbose).c_str());
  return 2;
}

int run_threads(Options& o, const ex::GlobalInputs& g) {
  o.comm = "threads";
  const int ranks = o.ranks ? o.ranks : 4;
  std::vector<int> status(static_cast<std::size_t>(ranks), 0);
  run_ranks(ranks, [&](ThreadCommunicator& comm) { status[static_cast<std::size_t>(comm.rank())] = run_options(comm, o, g); });
  return *std::max_element(status.begin(), status.end());
}

#ifdef SEQPAR_HAS_MPI
int run_mpi(int& argc, char**& argv, Options& o, const ex::GlobalInputs& g) {
  o.comm = "mpi";
  MpiSession session(argc, argv);
  int status = 0, rank = 0;
  {
    MpiCommunicator world(MPI_COMM_WORLD);
    rank = world.rank();
    try {
      status = run_options(world, o, g);
    } catch (const UsageError& e) {
      status = rank == 0 ? report(e, "", o.verbose) : 2;  // every rank failed alike; one reports
      MPI_Barrier(MPI_COMM_WORLD);  // no rank exits (and gets the job killed) before it has
    } catch (const std::exception& e) {
      // plan's checks are collective (every rank throws the same ConfigError); after the plan,
      // forward's and backward's are local: the others may be waiting on this rank, so end the job.
      if (!g_planned && dynamic_cast<const ConfigError*>(&e)) {
        status = rank == 0 ? report(e, "", o.verbose) : 2;
        MPI_Barrier(MPI_COMM_WORLD);
      } else {
        std::fprintf(stderr, "seqpar_demo: rank %d: %s\n", rank, user_message(e, o.verbose).c_str());
        MPI_Abort(MPI_COMM_WORLD, 3);
      }
    }
  }
  return status;
}
#endif
#endif  // SEQPAR_DEMO_F64_PART

}  // namespace seqpar_demo

#ifndef SEQPAR_DEMO_F64_PART
int main(int argc, char** argv) {
  using namespace seqpar_demo;
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const UsageError& e) {
    // Parsed identically on every rank; under mpirun only the first process should speak,
    // but MPI is not initialised yet, so use the launcher's rank variable when it has one.
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (!rank) rank = std::getenv("PMI_RANK");
    if (!rank || std::string_view(rank) == "0") report(e, "", false);
    return 2;
  }
  if (o.comm.empty()) {
#ifdef SEQPAR_HAS_MPI
    o.comm = under_mpi_launcher() ? "mpi" : "threads";
#else
    o.comm = "threads";
#endif
  }
  ex::GlobalShape shape;
  shape.batch = o.batch;
  shape.seq_q = o.seq;
  shape.heads = o.heads;
  shape.kv_heads = o.kv_heads;
  shape.head_dim = o.head_dim;
  shape.causal = o.causal;
  shape.seed = o.seed;
  try {
    // Inputs come from the seed alone, so every process makes the same global tensors.
    const ex::GlobalInputs g = ex::make_inputs(shape);
    if (o.comm == "mpi") {
#ifdef SEQPAR_HAS_MPI
      return run_mpi(argc, argv, o, g);
#else
      throw UsageError("--comm mpi: this seqpar_demo was built without MPI (configure with SEQPAR_ENABLE_MPI=ON)");
#endif
    }
    return run_threads(o, g);
  } catch (const UsageError& e) {
    return report(e, "", o.verbose);
  } catch (const ConfigError& e) {
    return report(e, "", o.verbose);
  } catch (const std::exception& e) {
    return report(e, "error: ", o.verbose);
  }
}
#endif  // SEQPAR_DEMO_F64_PART
