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
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cli.hpp"
#include "common.hpp"
#include "decode_handoff.hpp"
#include "seqpar/seqpar.hpp"
#ifdef SEQPAR_HAS_MPI
#include "seqpar/comm/mpi_communicator.hpp"
#endif

namespace seqpar_demo {

using namespace seqpar;
namespace ex = seqpar::examples;

constexpr const char* usage_text =
    "usage: seqpar_demo --policy ulysses|ring|unified [--anything] [--layout contiguous|zigzag|stripe]\n"
    "                   [--ulysses-degree U] [--ring-degree R] [--batch B] [--seq S | --sweep S1,S2,...]\n"
    "                   [--kv-seq S] [--heads H] [--kv-heads K] [--head-dim D] [--causal]\n"
    "                   [--causal-align top-left|bottom-right] [--window L,R] [--docs N1,N2,...]\n"
    "                   [--kv-valid N1,N2,...] [--dtype f32|f64] [--comm mpi|threads] [--ranks N] [--iters I]\n"
    "                   [--check] [--threads N] [--seed N] [--backward] [--profile] [--verbose]\n"
    "       seqpar_demo --decode --kv-len N1,N2,... [--new-tokens T] [--page N] [--steps S]\n"
    "                   [--exchange all-gather|heads] [the prefill's --policy ... and shape options]\n"
    "  --seq is the global length, split over the ranks as evenly as the mesh allows; plain policies\n"
    "  need it to divide evenly (use --anything otherwise). Defaults: --batch 1 --seq 2048 --heads 8\n"
    "  --kv-heads H --head-dim 64 --dtype f32 --iters 2; --comm mpi under an MPI launcher (when built\n"
    "  with MPI), else threads with --ranks 4. The last line printed is\n"
    "  RESULT policy=... ranks=... seq=... heads=... max_abs_err=... max_rel_err=... bytes_sent_per_rank=... "
    "time_ms_per_iter=... cpu_isa=... layout=... causal=... mesh=UxR dtype=... backward=... gflops=...\n"
    "  imbalance=... mask=...\n"
    "  GFLOP/s counts 4 x head_dim x visible score pairs per forward (x3.5 with --backward);\n"
    "  --verbose adds where in the library an error was raised.\n"
    "  --backward also runs backward after each forward (time and bytes cover both) and, with --check,\n"
    "  appends grad_max_rel_err=... (dq, dk, dv against the exact double reference).\n"
    "  --profile prints, per rank, the time of each phase of the timed calls (pack, all-to-alls, each\n"
    "  ring step's compute, merge and wait, unpack) and the share of ring transfer time hidden by compute.\n"
    "  --sweep runs each length in turn: one table row per length, then one RESULT line per length.\n"
    "Masks (any combination; --check compares against the exact reference under the same mask):\n"
    "  --kv-seq S: global key/value length (default --seq; a different one needs --anything);\n"
    "  --causal-align: where the causal diagonal (and a window's centre) sits when --kv-seq differs:\n"
    "  top-left (query i sees keys up to i, the default) or bottom-right (the last query sees the last key);\n"
    "  --window L,R: query i sees keys i-L..i+R around its diagonal (-1: that side unbounded);\n"
    "  --docs N1,N2,...: packed documents (lengths summing to --seq, shared by the batch): attention stays\n"
    "  inside a document (--layout stripe balances them);\n"
    "  --kv-valid N1,N2,...: key padding, valid keys per batch element (one per --batch).\n"
    "Decode (--decode): the prompts (--kv-len, one per sequence) are packed one after another as causal\n"
    "  documents of one sequence and prefilled by one forward of the --policy (default: ring --anything\n"
    "  --layout stripe); each rank's K/V rows then move to the decode cache's owner rank and slot (contiguous,\n"
    "  or --page N tokens per page round-robin; default 0: contiguous), and --steps S (default 8) decode steps of\n"
    "  --new-tokens T (1..16, default 1) tokens per sequence run with SequenceParallelDecode. --check compares\n"
    "  the prefill and every step with the exact double reference; RESULT reports the steps' error, bytes\n"
    "  sent per step (= plan.step_bytes()) and the median step time (the slowest rank's), then\n"
    "  prefill_max_rel_err=...\n";

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
  std::int64_t kv_seq = 0;  // 0 = --seq
  bool causal = false;
  CausalAlign causal_align = CausalAlign::top_left;
  Window window{};
  std::vector<std::int64_t> docs, kv_valid;  // empty: none
  std::vector<std::int64_t> sweep;           // empty: the one --seq
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
  // --decode
  bool decode = false;
  std::vector<std::int64_t> kv_len;  // prompt lengths, one per sequence
  std::int64_t new_tokens = 1, page = 0, steps = 8;
  DecodeExchange exchange = DecodeExchange::all_gather;
  std::vector<std::string> given;  // the options on the command line, for the checks between them

  /// True when option `name` was on the command line.
  bool has(std::string_view name) const { return std::find(given.begin(), given.end(), name) != given.end(); }
  /// The global lengths to run: the sweep's, or the one --seq.
  std::vector<std::int64_t> lengths() const { return sweep.empty() ? std::vector<std::int64_t>{seq} : sweep; }
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
  else if (m.find("ulysses_degree x ring_degree") != std::string::npos || m.find("does not divide the world size") != std::string::npos)
    m += "\n  (on the command line: --ulysses-degree U --ring-degree R with U x R = the number of ranks)";
  return m;
}

#ifndef SEQPAR_DEMO_F64_PART
/// An integer option's value; `max` keeps products of shape options far from overflow.
std::int64_t parse_int(std::string_view name, std::string_view text, std::int64_t min, std::int64_t max = 1 << 30) {
  if (const auto v = ex::parse_whole(text, min, max)) return *v;
  throw UsageError(std::string(name) + ": expected an integer from " + std::to_string(min) + " to " +
                   std::to_string(max) + ", got '" + std::string(text) + "'");
}

/// A list option's values ("N1,N2,..."), each from `min` to `max`.
std::vector<std::int64_t> parse_list(std::string_view name, std::string_view text, std::int64_t min,
                                     std::int64_t max = 1 << 30) {
  std::vector<std::int64_t> values;
  for (std::size_t at = 0; at <= text.size();) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const auto v = ex::parse_whole(text.substr(at, comma - at), min, max);
    if (!v)
      throw UsageError(std::string(name) + ": expected comma-separated integers from " + std::to_string(min) + " to " +
                       std::to_string(max) + ", got '" + std::string(text) + "'");
    values.push_back(*v);
    at = comma + 1;
  }
  return values;
}

/// Sum of a list (its values are at most 2^30 each, so no overflow for any command line).
std::int64_t sum(const std::vector<std::int64_t>& v) {
  std::int64_t n = 0;
  for (std::int64_t x : v) n += x;
  return n;
}

/// The checks between options, after all are read (each error names the option to change).
void check_combinations(Options& o) {
  auto refuse_with = [&](std::initializer_list<const char*> names, const char* mode, const char* why) {
    for (const char* n : names)
      if (o.has(n)) throw UsageError(std::string(n) + ": not used with " + mode + " (" + why + ")");
  };
  if (o.decode) {
    refuse_with({"--seq", "--sweep", "--kv-seq", "--batch", "--docs", "--window", "--kv-valid", "--causal-align",
                 "--backward", "--profile", "--iters"},
                "--decode", "the prompts come from --kv-len, packed as causal documents; the steps from --steps");
    if (o.kv_len.empty()) throw UsageError("--kv-len: required with --decode (one prompt length per sequence)");
    o.causal = true;
    o.batch = static_cast<std::int64_t>(o.kv_len.size());
    o.seq = sum(o.kv_len);
  } else {
    refuse_with({"--kv-len", "--new-tokens", "--page", "--steps", "--exchange"}, "a forward run", "add --decode");
  }
  if (!o.sweep.empty())
    refuse_with({"--seq", "--kv-seq", "--docs", "--profile"}, "--sweep",
                "every length of the sweep is both the query and the key length; one run per --seq for these");
  const std::vector<std::int64_t> lengths = o.lengths();
  const std::int64_t shortest = *std::min_element(lengths.begin(), lengths.end());
  const std::int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  const std::int64_t kv_seq = o.kv_seq ? o.kv_seq : shortest;
  if (o.has("--causal-align") && !o.causal && !o.window.active())
    throw UsageError("--causal-align: places the causal diagonal or a window; add --causal or --window");
  if (!o.docs.empty() && sum(o.docs) != o.seq)
    throw UsageError("--docs: the document lengths sum to " + std::to_string(sum(o.docs)) + ", expected --seq " +
                     std::to_string(o.seq));
  if (!o.docs.empty() && kv_seq != o.seq)
    throw UsageError("--docs: packed documents need the key length (--kv-seq " + std::to_string(kv_seq) +
                     ") equal to --seq " + std::to_string(o.seq));
  if (!o.kv_valid.empty() && static_cast<std::int64_t>(o.kv_valid.size()) != o.batch)
    throw UsageError("--kv-valid: expected one count per batch element (--batch " + std::to_string(o.batch) + "), got " +
                     std::to_string(o.kv_valid.size()));
  for (std::int64_t n : o.kv_valid)
    if (n > kv_seq)
      throw UsageError("--kv-valid: expected counts from 0 to the key length " + std::to_string(kv_seq) + ", got " +
                       std::to_string(n));
  // The global inputs are made on every rank: keep them within what a vector can hold.
  const double rows = o.decode ? static_cast<double>(o.seq + o.batch * o.steps * o.new_tokens)
                               : static_cast<double>(o.batch) * static_cast<double>(std::max(longest, o.kv_seq));
  const double elems = rows * static_cast<double>(o.heads) * static_cast<double>(o.head_dim);
  if (elems > 1e10)
    throw UsageError("--batch x --seq x --heads x --head-dim = " + std::to_string(elems) +
                     " elements: too large for this demo (which holds the global inputs on every rank)");
  if (o.kv_heads != 0 && o.heads % o.kv_heads != 0)
    throw UsageError("--kv-heads: expected a divisor of --heads " + std::to_string(o.heads) + ", got " +
                     std::to_string(o.kv_heads));
  if (o.policy == PolicyKind::ulysses && o.layout != LayoutKind::contiguous)
    throw UsageError("--layout: --policy ulysses has no ring, so no layout; use --policy unified --ring-degree R");
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(usage_text, stdout);
      std::exit(0);
    }
    if (a.substr(0, 2) == "--") o.given.emplace_back(a);
    if (a == "--anything") { o.anything = true; continue; }
    if (a == "--causal") { o.causal = true; continue; }
    if (a == "--check") { o.check = true; continue; }
    if (a == "--backward") { o.backward = true; continue; }
    if (a == "--profile") { o.profile = true; continue; }
    if (a == "--verbose") { o.verbose = true; continue; }
    if (a == "--decode") { o.decode = true; continue; }
    if (a.substr(0, 2) != "--") throw UsageError("'" + std::string(a) + "': expected an option such as --seq (see --help)");
    if (i + 1 >= argc) throw UsageError(std::string(a) + ": unknown option or missing value (see --help)");
    const char* v = argv[++i];
    const std::string_view s = v;
    if (a == "--policy") {
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
    } else if (a == "--causal-align") {
      if (s == "top-left") o.causal_align = CausalAlign::top_left;
      else if (s == "bottom-right") o.causal_align = CausalAlign::bottom_right;
      else throw UsageError("--causal-align: expected top-left or bottom-right, got '" + std::string(s) + "'");
    } else if (a == "--exchange") {
      if (s == "all-gather") o.exchange = DecodeExchange::all_gather;
      else if (s == "heads") o.exchange = DecodeExchange::heads;
      else throw UsageError("--exchange: expected all-gather or heads, got '" + std::string(s) + "'");
    } else if (a == "--window") {
      const std::vector<std::int64_t> w = parse_list(a, s, -1);
      if (w.size() != 2) throw UsageError("--window: expected two sides L,R (-1: unbounded), got '" + std::string(s) + "'");
      o.window = {w[0], w[1]};
    } else if (a == "--docs") o.docs = parse_list(a, s, 1);
    else if (a == "--kv-valid") o.kv_valid = parse_list(a, s, 0);
    else if (a == "--sweep") o.sweep = parse_list(a, s, 1);
    else if (a == "--kv-len") o.kv_len = parse_list(a, s, 1);
    else if (a == "--new-tokens") o.new_tokens = parse_int(a, v, 1, 16);
    else if (a == "--page") o.page = parse_int(a, v, 0);
    else if (a == "--steps") o.steps = parse_int(a, v, 1, 1 << 20);
    else if (a == "--ulysses-degree") o.ulysses_degree = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--ring-degree") o.ring_degree = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--batch") o.batch = parse_int(a, v, 1);
    else if (a == "--seq") o.seq = parse_int(a, v, 1);
    else if (a == "--kv-seq") o.kv_seq = parse_int(a, v, 1);
    else if (a == "--heads") o.heads = parse_int(a, v, 1);
    else if (a == "--kv-heads") o.kv_heads = parse_int(a, v, 1);
    else if (a == "--head-dim") o.head_dim = parse_int(a, v, 1);
    else if (a == "--ranks") o.ranks = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--iters") o.iters = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--threads") o.threads = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--seed") o.seed = static_cast<std::uint64_t>(parse_int(a, v, 0, std::numeric_limits<std::int64_t>::max()));
    else throw UsageError(std::string(a) + ": unknown option (see --help)");
  }
  if (!o.has("--policy")) {
    if (!o.decode) throw UsageError("--policy: required (ulysses, ring or unified)");
    // The prompts' total rarely divides evenly, and stripe balances packed documents.
    o.policy = PolicyKind::ring;
    o.policy_name = "ring";
    o.anything = true;
    if (!o.layout_given) o.layout = LayoutKind::stripe;
  }
  if (!o.sweep.empty()) o.seq = o.sweep.front();
  check_combinations(o);
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
auto with_anything(const Options& o, Base base, F& run) {
  if (o.anything) return run(AnythingPolicy<Base>{base});
  return run(base);
}

/// Calls `run(policy)` with P<layout> for the layout the options name, configured by `configure`.
template <template <class> class P, class Configure, class F>
auto with_layout(const Options& o, Configure configure, F& run) {
  switch (o.layout) {
    case LayoutKind::contiguous: return with_anything(o, configure(P<Contiguous>{}), run);
    case LayoutKind::zigzag: return with_anything(o, configure(P<Zigzag>{}), run);
    case LayoutKind::stripe: return with_anything(o, configure(P<Stripe>{}), run);
  }
  throw UsageError("--layout: unknown layout");
}

/// The one switch from the command line to the compile-time policy types.
template <class F>
auto with_policy(const Options& o, int world, F run) {
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

/// "N1,N2,...".
inline std::string comma_list(const std::vector<std::int64_t>& v) {
  std::string text;
  for (std::int64_t n : v) text.append(text.empty() ? "" : ",").append(std::to_string(n));
  return text;
}

/// The mask as the table and RESULT show it: its families joined by '+' (no spaces), e.g.
/// causal+window(512,-1)+docs(8), or none.
inline std::string mask_name(const ex::GlobalShape& s) {
  std::string m;
  auto add = [&](const std::string& part) { m.append(m.empty() ? "" : "+").append(part); };
  if (s.causal) add("causal");
  if (s.causal_align == CausalAlign::bottom_right) add("bottom-right");
  if (s.window.active()) add("window(" + std::to_string(s.window.left) + "," + std::to_string(s.window.right) + ")");
  if (!s.documents.empty()) add("docs(" + std::to_string(s.documents.front().size()) + ")");
  if (!s.kv_valid.empty()) add("kv_valid(" + comma_list(s.kv_valid) + ")");
  return m.empty() ? "none" : m;
}

/// The kernel line of the report.
inline void print_kernel(const Options& o) {
  std::printf("kernel       CpuFlashKernel on %d thread(s) per rank, %s (%d-bit vectors, chosen at run time; this CPU's "
              "widest: %s; SEQPAR_CPU_ISA caps it)\n",
              o.threads > 0 ? o.threads : 1, cpu_isa_name(default_cpu_isa()), cpu_isa_vector_bits(default_cpu_isa()),
              cpu_isa_name(widest_cpu_isa()));
}

/// A checked error as RESULT writes it ("n/a" without --check).
inline std::string error_text(bool checked, double x) {
  char text[32] = "n/a";
  if (checked) std::snprintf(text, sizeof text, "%.3e", x);
  return text;
}

/// The check line: the error against the tolerance, and whether it passes.
inline bool print_check(const char* what, const ex::ErrorStats& e, double tol, const char* how) {
  const bool ok = e.rel() <= tol;
  std::printf("check        %smax|err| / max|ref| = %.3e (tolerance %.0e, %s): %s\n", what, e.rel(), tol, how,
              ok ? "PASS" : "FAIL");
  return ok;
}

/// The RESULT line's first keys, common to every mode (scripts parse them by name).
inline std::string result_head(const Options& o, int world, std::int64_t seq, const ex::ErrorStats& err,
                               std::uint64_t bytes, double ms) {
  char head[512];
  std::snprintf(head, sizeof head,
                "RESULT policy=%s ranks=%d seq=%lld heads=%lld max_abs_err=%s max_rel_err=%s bytes_sent_per_rank=%llu "
                "time_ms_per_iter=%.3f",
                o.policy_name.c_str(), world, static_cast<long long>(seq), static_cast<long long>(o.heads),
                error_text(o.check, err.max_abs).c_str(), error_text(o.check, err.rel()).c_str(),
                static_cast<unsigned long long>(bytes), ms);
  return head;
}

/// The RESULT lines of the runs so far (rank 0's); printed last, after every table row.
inline std::vector<std::string> g_results;

/// The per-rank figures of one run, as gathered on every rank, and their totals.
struct RunFigures {
  enum Column { q_tokens, kv_tokens, work, bytes, formula, ms, columns };
  std::vector<std::vector<std::int64_t>> rows;  // per rank, by Column (ms bit-cast)
  std::uint64_t max_bytes = 0;
  double max_ms = 0, total_work = 0, max_work = 0;
  bool bytes_match = true;

  RunFigures(std::vector<std::vector<std::int64_t>> r) : rows(std::move(r)) {
    for (const auto& x : rows) {
      max_bytes = std::max(max_bytes, static_cast<std::uint64_t>(x[bytes]));
      max_ms = std::max(max_ms, rank_ms(x));
      total_work += static_cast<double>(x[work]);
      max_work = std::max(max_work, static_cast<double>(x[work]));
      bytes_match = bytes_match && x[bytes] == x[formula];
    }
  }
  static double rank_ms(const std::vector<std::int64_t>& x) { return std::bit_cast<double>(x[ms]); }
  /// Every rank's FLOPs over the slowest rank's time.
  double gflops(double flops_per_pair) const { return flops_per_pair * total_work / (max_ms * 1e6); }
  /// Max over mean visible score pairs per rank.
  double imbalance() const { return total_work > 0 ? max_work / (total_work / static_cast<double>(rows.size())) : 1.0; }
  /// GB/s of the busiest sender.
  double gbps() const { return static_cast<double>(max_bytes) / (max_ms * 1e6); }
};

/// The hint after the balance figure: which layout balances this mask's work.
inline const char* balance_hint(const Options& o, const ex::GlobalShape& s, const MeshConfig& mesh, double imbalance) {
  if (imbalance <= 1.2 || mesh.ring < 2) return "";
  if (!s.documents.empty() && o.layout != LayoutKind::stripe)
    return " (packed documents: --layout stripe gives every rank a share of each)";
  if (s.causal && !s.window.active() && o.layout == LayoutKind::contiguous)
    return " (causal with a contiguous split: --layout zigzag balances this)";
  return "";
}

/// Rank 0's report of one run: the per-rank table (or, in a sweep, the length's row), and the
/// RESULT line into g_results. Returns whether the check passed (true without --check).
inline bool report_run(const Options& o, const ex::GlobalShape& s, const MeshConfig& mesh, const RunFigures& f,
                       const ex::ErrorStats& err, const ex::ErrorStats& grad_err, double check_s, int sweep_at,
                       const std::vector<PhaseProfile>& profiles) {
  const int world = static_cast<int>(f.rows.size());
  const bool sweeping = sweep_at >= 0;
  // FLOPs: 4 x D per visible score pair in forward (QK^T and PV), 2.5 times that in backward.
  const double flops_per_pair = 4.0 * static_cast<double>(s.head_dim) * (o.backward ? 3.5 : 1.0);
  const double tol = o.f64 ? 1e-12 : 1e-5, grad_tol = o.f64 ? 1e-11 : 1e-4;
  const bool fwd_ok = err.rel() <= tol, grad_ok = !o.backward || grad_err.rel() <= grad_tol;
  const std::string mask = mask_name(s);
  if (sweep_at <= 0) {
    std::printf("seqpar_demo  %s  mesh %d (ulysses) x %d (ring)  comm=%s  ranks=%d\n", policy_type_name(o).c_str(),
                mesh.ulysses, mesh.ring, o.comm.c_str(), world);
    std::printf("problem      batch=%lld seq=%s kv_seq=%s heads=%lld kv_heads=%lld head_dim=%lld mask=%s dtype=%s\n",
                static_cast<long long>(s.batch), sweeping ? "sweep" : std::to_string(s.seq_q).c_str(),
                sweeping ? "sweep" : std::to_string(s.kv_len()).c_str(), static_cast<long long>(s.heads),
                static_cast<long long>(s.kv_head_count()), static_cast<long long>(s.head_dim), mask.c_str(),
                o.f64 ? "f64" : "f32");
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
    if (o.profile) ex::print_profile(profiles);
    if (o.check) {
      char how[96];
      std::snprintf(how, sizeof how, "exact double reference, %.1f s", check_s);
      print_check("", err, tol, how);
      if (o.backward) print_check("gradients dq, dk, dv: ", grad_err, grad_tol, "exact double reference");
    }
  }
  // With --backward, time and bytes cover forward + backward and the gradient error comes last.
  char tail[512];
  std::snprintf(tail, sizeof tail,
                "%s%s cpu_isa=%s layout=%s causal=%d mesh=%dx%d dtype=%s backward=%d gflops=%.2f imbalance=%.2f mask=%s",
                o.backward ? " grad_max_rel_err=" : "", o.backward ? error_text(o.check, grad_err.rel()).c_str() : "",
                cpu_isa_name(default_cpu_isa()),
                o.policy == PolicyKind::ulysses ? "none" : layout_names[static_cast<int>(o.layout)], s.causal ? 1 : 0,
                mesh.ulysses, mesh.ring, o.f64 ? "f64" : "f32", o.backward ? 1 : 0, f.gflops(flops_per_pair),
                f.imbalance(), mask.c_str());
  g_results.push_back(result_head(o, world, s.seq_q, err, f.max_bytes, f.max_ms) + tail);
  std::fflush(stdout);
  return !o.check || (fwd_ok && grad_ok);
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

/// The calls the demo makes on its attention object, behind one interface: run_rank and
/// prefill_rank then compile once per element type and communicator instead of once per policy
/// (14 of them), which halves the demo's build, the README's first command. The library's own
/// engine is already shared between policies with the same phases (policy_phases_of).
template <class T>
class DemoAttention {
 public:
  using CV = TensorView<const T>;  ///< an input tensor
  using V = TensorView<T>;         ///< an output tensor
  virtual ~DemoAttention() = default;
  /// The resolved mesh.
  virtual const MeshConfig& mesh() const = 0;
  /// SequenceParallelAttention::plan.
  virtual Plan plan(const AttentionProblem& problem, LocalLengths lengths) = 0;
  /// SequenceParallelAttention::forward (lse may be absent).
  virtual void forward(const Plan& p, CV q, CV k, CV v, V out, TensorView<acc_t<T>> lse, std::span<std::byte> ws) = 0;
  /// SequenceParallelAttention::backward.
  virtual void backward(const Plan& p, CV dout, CV q, CV k, CV v, CV out, TensorView<const acc_t<T>> lse, V dq, V dk,
                        V dv, std::span<std::byte> ws) = 0;
  /// SequenceParallelAttention::set_profile.
  virtual void set_profile(PhaseProfile* profile) = 0;
};

/// DemoAttention over SequenceParallelAttention<Policy, Comm, CpuFlashKernel>.
template <class T, class Policy, class Comm>
class PolicyAttention final : public DemoAttention<T> {
  using typename DemoAttention<T>::CV;
  using typename DemoAttention<T>::V;

 public:
  PolicyAttention(Comm& comm, Policy policy, CpuFlashKernel kernel) : attn_(comm, policy, std::move(kernel)) {}
  const MeshConfig& mesh() const override { return attn_.mesh(); }
  Plan plan(const AttentionProblem& problem, LocalLengths lengths) override { return attn_.plan(problem, lengths); }
  void forward(const Plan& p, CV q, CV k, CV v, V out, TensorView<acc_t<T>> lse, std::span<std::byte> ws) override {
    attn_.template forward<T>(p, q, k, v, out, lse, ws);
  }
  void backward(const Plan& p, CV dout, CV q, CV k, CV v, CV out, TensorView<const acc_t<T>> lse, V dq, V dk, V dv,
                std::span<std::byte> ws) override {
    attn_.template backward<T>(p, dout, q, k, v, out, lse, dq, dk, dv, ws);
  }
  void set_profile(PhaseProfile* profile) override { attn_.set_profile(profile); }

 private:
  SequenceParallelAttention<Policy, Comm, CpuFlashKernel> attn_;
};

/// Collective: the options' policy on `comm`, with element type T.
template <class T, class Comm>
std::unique_ptr<DemoAttention<T>> make_attention(Comm& comm, const Options& o) {
  return with_policy(o, comm.size(), [&](auto policy) -> std::unique_ptr<DemoAttention<T>> {
    return std::make_unique<PolicyAttention<T, decltype(policy), Comm>>(comm, policy,
                                                                       make_kernel<CpuFlashKernel>(o, comm.rank() == 0));
  });
}

/// One rank's run of the options' policy with element type T: plan, a checked forward, timed
/// forwards, and (rank 0) the report. `sweep_at`: the length's index in --sweep (-1: no sweep).
/// Returns the exit status.
template <class T, class Comm>
int run_rank(Comm& comm, const Options& o, const ex::GlobalInputs& g, int sweep_at) {
  const int me = comm.rank();
  const bool print = me == 0;
  const std::unique_ptr<DemoAttention<T>> attn_ptr = make_attention<T>(comm, o);
  DemoAttention<T>& attn = *attn_ptr;
  const MeshConfig& mesh = attn.mesh();
  const ex::GlobalShape& s = g.shape;
  const auto idx = static_cast<std::size_t>(me);
  const Plan plan = attn.plan(s.problem<T>(o.backward), {split_sequence(s.seq_q, mesh)[idx], split_sequence(s.kv_len(), mesh)[idx]});
  g_planned = true;

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
    attn.forward(plan, q, k, v, out, lse_view, workspace);
    if (o.backward)
      attn.backward(plan, CV::bshd(dout.data(), B, l.lq, H, D), q, k, v, out, lse_view,
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
    if (print && sweep_at < 0)
      std::printf("check        computing the exact double-precision reference for every rank's rows%s...\n",
                  o.backward ? " and the gradients" : "");
    std::fflush(stdout);
    err = ex::reduce_errors(comm, ex::compare(l.out, ex::reference_rows(g, qpos)));
    if (o.backward) {
      const ex::ReferenceGrads want = ex::reference_grads(g, qpos, kvpos);
      ex::ErrorStats e = ex::compare(dq, want.dq);
      for (const ex::ErrorStats& x : {ex::compare(dk, want.dk), ex::compare(dv, want.dv)}) e.merge(x);
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

  const RunFigures figures(ex::gather_rows(comm, {plan.local_q(), plan.local_kv(), plan.work(me), static_cast<std::int64_t>(bytes),
                                                  static_cast<std::int64_t>(formula), std::bit_cast<std::int64_t>(ms)}));
  if (!print) return 0;
  return report_run(o, s, mesh, figures, err, grad_err, check_s, sweep_at, profiles) ? 0 : 1;
}

/// The prompts' rows of the decode run's global inputs: `full` holds each sequence whole
/// (prompt, then the decode steps' tokens) as documents of one sequence; the prefill sees the
/// prompts alone, packed the same way.
inline ex::GlobalInputs prompt_inputs(const ex::GlobalInputs& full, const std::vector<std::int64_t>& prompts) {
  ex::GlobalInputs p;
  p.shape = full.shape;
  p.shape.seq_q = 0;
  p.shape.documents = {prompts};
  const std::int64_t q_row = full.shape.heads * full.shape.head_dim, kv_row = full.shape.kv_head_count() * full.shape.head_dim;
  std::int64_t at = 0;  // the sequence's first row in `full`
  for (std::size_t b = 0; b < prompts.size(); ++b) {
    auto copy = [&](const std::vector<double>& from, std::vector<double>& to, std::int64_t row) {
      to.insert(to.end(), from.begin() + at * row, from.begin() + (at + prompts[b]) * row);
    };
    copy(full.q, p.q, q_row);
    copy(full.k, p.k, kv_row);
    copy(full.v, p.v, kv_row);
    p.shape.seq_q += prompts[b];
    at += full.shape.documents.front()[b];
  }
  return p;
}

/// What one rank's prefill left: its K/V rows (for the hand-off) and its figures.
template <class T>
struct Prefilled {
  std::vector<T> k, v;                                   ///< this rank's K/V rows, [lkv, K, D]
  std::vector<std::vector<ex::CacheToken>> tokens;       ///< every rank's rows' tokens, in row order
  ex::ErrorStats err;                                    ///< the prefill's output error (all ranks)
  std::uint64_t bytes = 0;                               ///< bytes this rank sent
  double ms = 0;                                         ///< this rank's time of the one forward
  int ulysses = 1, ring = 1;                             ///< the prefill's mesh
};

/// The prefill of the decode run: one forward of the options' policy over the packed prompts.
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
  const auto K = s.kv_head_count(), D = s.head_dim;
  comm.stats().reset();
  const auto t0 = std::chrono::steady_clock::now();
  attn.forward(plan, CV::bshd(l.q.data(), 1, l.lq, s.heads, D), CV::bshd(l.k.data(), 1, l.lkv, K, D),
                           CV::bshd(l.v.data(), 1, l.lkv, K, D), TensorView<T>::bshd(l.out.data(), 1, l.lq, s.heads, D),
               {}, workspace);
  Prefilled<T> r;
  r.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  r.bytes = comm.stats().bytes_sent;
  if (o.check) r.err = ex::reduce_errors(comm, ex::compare(l.out, ex::reference_rows(prompts, qpos)));
  for (int w = 0; w < comm.size(); ++w) r.tokens.push_back(ex::packed_tokens(plan.kv_positions(w), o.kv_len));
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
  const std::int64_t B = o.batch, Tn = o.new_tokens, H = fs.heads, K = fs.kv_head_count(), D = fs.head_dim;
  // The decode plan first: it is collective too, so a wrong shape fails on every rank alike.
  SequenceParallelDecode<Comm, CpuFlashKernel> decode(comm, make_kernel<CpuFlashKernel>(o, false));
  DecodePlan dp = decode.plan({.batch = B, .heads = H, .kv_heads = K, .head_dim = D, .dtype = dtype_v<T>,
                               .new_tokens = Tn, .kv_len = o.kv_len,
                               .capacity = *std::max_element(o.kv_len.begin(), o.kv_len.end()) + o.steps * Tn,
                               .page = o.page, .exchange = o.exchange});
  const ex::GlobalInputs prompts = prompt_inputs(full, o.kv_len);
  Prefilled<T> pre = prefill_rank<T>(comm, o, prompts);

  // The hand-off: every prefilled K/V row to the rank and slot the decode cache gives it.
  const std::int64_t C = dp.shard_capacity();
  std::vector<T> k_cache(static_cast<std::size_t>(B * C * K * D)), v_cache(k_cache.size());
  const std::size_t handoff_bytes =
      ex::hand_off_kv<T>(comm, pre.tokens, dp, pre.k.data(), pre.v.data(), k_cache.data(), v_cache.data());

  // The steps. Sequence b is document b of `full`: its prompt, then the steps' tokens.
  std::vector<std::int64_t> first(static_cast<std::size_t>(B));  // the sequence's first row in `full`
  for (std::size_t b = 1; b < first.size(); ++b) first[b] = first[b - 1] + fs.documents.front()[b - 1];
  const HeadRange qh = dp.q_heads(), oh = dp.out_heads();
  std::vector<T> q(static_cast<std::size_t>(B * Tn * qh.count * D)), out(static_cast<std::size_t>(B * Tn * oh.count * D));
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
        if (dp.owner(b, pos) == me)  // the new token's K/V go to its owner's slot
          for (std::int64_t e = 0; e < K * D; ++e) {
            const auto to = static_cast<std::size_t>((b * C + dp.slot(b, pos)) * K * D + e);
            k_cache[to] = static_cast<T>(full.k[static_cast<std::size_t>(row * K * D + e)]);
            v_cache[to] = static_cast<T>(full.v[static_cast<std::size_t>(row * K * D + e)]);
          }
        for (std::int64_t e = 0; e < qh.count * D; ++e)  // my query heads
          q[static_cast<std::size_t>((b * Tn + t) * qh.count * D + e)] =
              static_cast<T>(full.q[static_cast<std::size_t>((row * H + qh.begin) * D + e)]);
        pairs += static_cast<double>(pos + 1);
      }
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    decode.template step<T>(dp, TensorView<const T>::bshd(q.data(), B, Tn, qh.count, D),
                            TensorView<const T>::bshd(k_cache.data(), B, C, K, D),
                            TensorView<const T>::bshd(v_cache.data(), B, C, K, D),
                            TensorView<T>::bshd(out.data(), B, Tn, oh.count, D), workspace);
    step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (o.check)  // the step's rows of each whole sequence, causal over the prompt and the tokens so far
      for (std::int64_t b = 0; b < B; ++b) {
        const std::vector<double> want =
            ex::reference_rows(full, PositionMap::run(Tn, first[static_cast<std::size_t>(b)] + dp.kv_len(b)));
        for (std::int64_t t = 0; t < Tn; ++t)
          for (std::int64_t e = 0; e < oh.count * D; ++e)
            err.add_out(static_cast<double>(out[static_cast<std::size_t>((b * Tn + t) * oh.count * D + e)]),
                        want[static_cast<std::size_t>((t * H + oh.begin) * D + e)]);
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
  std::printf("problem      prompts=%s heads=%lld kv_heads=%lld head_dim=%lld dtype=%s new_tokens=%lld steps=%lld "
              "cache=%s exchange=%s\n",
              lens.c_str(), static_cast<long long>(H), static_cast<long long>(K), static_cast<long long>(D),
              o.f64 ? "f64" : "f32", static_cast<long long>(Tn), static_cast<long long>(o.steps),
              o.page > 0 ? ("pages of " + std::to_string(o.page) + " round-robin").c_str() : "contiguous",
              o.exchange == DecodeExchange::heads ? "heads" : "all-gather");
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
  // FLOPs: 4 x D per visible (query, key) pair, every query head.
  const double gflops = 4.0 * static_cast<double>(D * H) * pairs / (max_ms * static_cast<double>(o.steps) * 1e6);
  std::printf("traffic      bytes sent per step %s plan.step_bytes() on every rank\n", bytes_match ? "equal" : "DIFFER FROM");
  const double tol = o.f64 ? 1e-12 : 1e-5;
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
                "handoff_bytes_sent_per_rank=%llu",
                cpu_isa_name(default_cpu_isa()),
                o.policy == PolicyKind::ulysses ? "none" : layout_names[static_cast<int>(o.layout)], lens.c_str(),
                static_cast<long long>(Tn), static_cast<long long>(o.steps), static_cast<long long>(o.page),
                o.exchange == DecodeExchange::heads ? "heads" : "all-gather", pre.ulysses, pre.ring,
                o.f64 ? "f64" : "f32", gflops, error_text(o.check, pre.err.rel()).c_str(),
                static_cast<unsigned long long>(max_pre_bytes), max_pre_ms, static_cast<unsigned long long>(max_handoff));
  g_results.push_back(result_head(o, world, prompts.shape.seq_q, err, max_step_bytes, max_ms) + tail);
  std::fflush(stdout);
  return ok && bytes_match ? 0 : 1;
}

/// Runs the options' policy (or decode) with element type T on one rank.
template <class T, class Comm>
int run_typed(Comm& comm, const Options& o, const ex::GlobalInputs& g, int sweep_at) {
  if (o.decode) return decode_rank<T>(comm, o, g);
  return run_rank<T>(comm, o, g, sweep_at);
}

#ifdef SEQPAR_DEMO_SPLIT
// The f64 runs: compiled in the SEQPAR_DEMO_F64_PART object, used from the other.
#ifdef SEQPAR_DEMO_F64_PART
#define SEQPAR_DEMO_F64_INSTANCE(Comm) \
  template int run_typed<double, Comm>(Comm&, const Options&, const ex::GlobalInputs&, int);
#else
#define SEQPAR_DEMO_F64_INSTANCE(Comm) \
  extern template int run_typed<double, Comm>(Comm&, const Options&, const ex::GlobalInputs&, int);
#endif
SEQPAR_DEMO_F64_INSTANCE(ThreadCommunicator)
#ifdef SEQPAR_HAS_MPI
SEQPAR_DEMO_F64_INSTANCE(MpiCommunicator)
#endif
#endif  // SEQPAR_DEMO_SPLIT

#ifndef SEQPAR_DEMO_F64_PART
/// Runs the options' dtype and policy on one rank.
template <class Comm>
int run_options(Comm& comm, const Options& o, const ex::GlobalInputs& g, int sweep_at) {
  check_degrees(o, comm.size());
  return o.f64 ? run_typed<double>(comm, o, g, sweep_at) : run_typed<float>(comm, o, g, sweep_at);
}

/// The global inputs of run `at` (the sweep's length `at`, or the one run). Decode: one
/// sequence holding every prompt and its steps' tokens, as causal documents.
/// Inputs come from the seed alone, so every process makes the same global tensors.
ex::GlobalInputs inputs_for(const Options& o, std::size_t at) {
  ex::GlobalShape shape = ex::make_case(o.lengths()[at], o.heads, o.kv_heads, o.head_dim, o.causal, o.seed, o.batch);
  shape.seq_kv = o.kv_seq ? o.kv_seq : -1;
  shape.causal_align = o.causal_align;
  shape.window = o.window;
  if (!o.docs.empty()) shape.documents = {o.docs};
  shape.kv_valid = o.kv_valid;
  if (o.decode) {
    shape.batch = 1;
    shape.seq_q = 0;
    shape.documents = {{}};
    for (std::int64_t n : o.kv_len) {
      shape.documents.front().push_back(n + o.steps * o.new_tokens);
      shape.seq_q += n + o.steps * o.new_tokens;
    }
  }
  return ex::make_inputs(shape);
}

/// The runs' RESULT lines, last (rank 0 has them; the other ranks none).
void print_results() {
  for (const std::string& line : g_results) std::printf("%s\n", line.c_str());
  std::fflush(stdout);
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

int run_threads(Options& o) {
  o.comm = "threads";
  const int ranks = o.ranks ? o.ranks : 4;
  int worst = 0;
  for (std::size_t at = 0; at < o.lengths().size(); ++at) {  // a failed check goes on to the next length
    const ex::GlobalInputs g = inputs_for(o, at);
    const int sweep_at = o.sweep.empty() ? -1 : static_cast<int>(at);
    std::vector<int> status(static_cast<std::size_t>(ranks), 0);
    g_planned = false;
    run_ranks(ranks, [&](ThreadCommunicator& comm) {
      status[static_cast<std::size_t>(comm.rank())] = run_options(comm, o, g, sweep_at);
    });
    worst = std::max(worst, *std::max_element(status.begin(), status.end()));
  }
  print_results();
  return worst;
}

#ifdef SEQPAR_HAS_MPI
int run_mpi(int& argc, char**& argv, Options& o) {
  o.comm = "mpi";
  MpiSession session(argc, argv);
  int status = 0, rank = 0;
  {
    MpiCommunicator world(MPI_COMM_WORLD);
    rank = world.rank();
    try {
      // A failed check goes on to the next length; an error ends the sweep.
      for (std::size_t at = 0; at < o.lengths().size(); ++at) {
        g_planned = false;
        status = std::max(status, run_options(world, o, inputs_for(o, at), o.sweep.empty() ? -1 : static_cast<int>(at)));
      }
      print_results();
    } catch (const UsageError& e) {
      print_results();
      status = rank == 0 ? report(e, "", o.verbose) : 2;  // every rank failed alike; one reports
      MPI_Barrier(MPI_COMM_WORLD);  // no rank exits (and gets the job killed) before it has
    } catch (const std::exception& e) {
      // plan's checks are collective (every rank throws the same ConfigError); after the plan,
      // forward's and backward's are local: the others may be waiting on this rank, so end the job.
      if (!g_planned && dynamic_cast<const ConfigError*>(&e)) {
        print_results();
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
  try {
    if (o.comm == "mpi") {
#ifdef SEQPAR_HAS_MPI
      return run_mpi(argc, argv, o);
#else
      throw UsageError("--comm mpi: this seqpar_demo was built without MPI (configure with SEQPAR_ENABLE_MPI=ON)");
#endif
    }
    return run_threads(o);
  } catch (const UsageError& e) {
    print_results();
    return report(e, "", o.verbose);
  } catch (const ConfigError& e) {
    print_results();
    return report(e, "", o.verbose);
  } catch (const std::exception& e) {
    return report(e, "error: ", o.verbose);
  }
}
#endif  // SEQPAR_DEMO_F64_PART
