/// \file
/// seqpar_demo's usage text, and the reading and checking of its options (options.hpp).

#include "options.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>

#include "cli.hpp"

namespace seqpar_demo {

namespace ex = seqpar::examples;

namespace {

constexpr const char* usage_text =
    "usage: seqpar_demo --policy ulysses|ring|unified [--anything] [--layout contiguous|zigzag|stripe]\n"
    "                   [--ulysses-degree U] [--ring-degree R] [--batch B] [--seq S | --sweep S1,S2,...]\n"
    "                   [--kv-seq S] [--heads H] [--kv-heads K] [--head-dim D] [--causal]\n"
    "                   [--causal-align top-left|bottom-right] [--window L,R] [--docs N1,N2,...]\n"
    "                   [--kv-valid N1,N2,...] [--dtype f32|f64|bf16] [--comm mpi|threads] [--ranks N] [--iters I]\n"
    "                   [--check] [--threads N] [--seed N] [--backward] [--profile] [--trace FILE] [--verbose]\n"
    "                   [--head-dim-v D] [--softcap C] [--sinks] [--scale X]\n"
    "       seqpar_demo --policy auto [shape and run options]: calibrates, then runs the advisor's first choice;\n"
    "                   --estimate on any run prints the cost model's time on calibrated figures beside the measured one\n"
    "       seqpar_demo --advise [--ranks N] [--machine h100-sxm-ib|l20-pcie|ci-xeon-2core] [--ranks-per-node N]\n"
    "                   [--backward] [shape options]: every policy and mesh ranked by the cost model\n"
    "       seqpar_demo --model NAME|list [--local N] [--seq S] [--decode ...] [--policy ... and run options]\n"
    "       seqpar_demo --decode --kv-len N1,N2,... [--new-tokens T] [--page N] [--steps S]\n"
    "                   [--exchange all-gather|heads] [the prefill's --policy ... and shape options]\n"
    "       seqpar_demo --serve [--requests N] [--prompt-len MIN,MAX] [--gen-len MIN,MAX] [--arrive R]\n"
    "                   [--max-batch B] [--page N] [--spec-every N] [--interleave N] [--pool-pages N]\n"
    "                   [--check] [--heads H] [--kv-heads K] [--head-dim D] [--dtype f32|f64] [--seed N]\n"
    "  --seq is the global length, split over the ranks as evenly as the mesh allows; plain policies\n"
    "  need it to divide evenly (use --anything otherwise). Defaults: --batch 1 --seq 2048 --heads 8\n"
    "  --kv-heads H --head-dim 64 --dtype f32 --iters 2 (bf16: inputs and outputs in bf16, float accumulation;\n"
    "  the reference sees the bf16-rounded inputs); --comm mpi under an MPI launcher (when built\n"
    "  with MPI), else threads with --ranks 4. The last line printed is\n"
    "  RESULT policy=... ranks=... seq=... heads=... max_abs_err=... max_rel_err=... bytes_sent_per_rank=... "
    "time_ms_per_iter=... cpu_isa=... layout=... causal=... mesh=UxR dtype=... backward=... gflops=...\n"
    "  imbalance=... mask=... features=... [model=... layer=...]\n"
    "  GFLOP/s counts 4 x head_dim x visible score pairs per forward (x3.5 with --backward);\n"
    "  --verbose adds where in the library an error was raised.\n"
    "  --backward also runs backward after each forward (time and bytes cover both) and, with --check,\n"
    "  appends grad_max_rel_err=... (dq, dk, dv against the exact double reference).\n"
    "  --profile prints, per rank, the time of each phase of the timed calls (pack, all-to-alls, each\n"
    "  ring step's compute, merge and wait, unpack) and the share of ring transfer time hidden by compute.\n"
    "  --sweep runs each length in turn: one table row per length, then one RESULT line per length.\n"
    "Today's models' features: --head-dim-v D: V's and O's head dim (default --head-dim; MLA: 192 / 128);\n"
    "  --softcap C: scores become C tanh(s / C) before the mask (Gemma 2: 50); --sinks: one sink logit per\n"
    "  query head (random, from --seed) joins every row's softmax denominator (GPT-OSS); --scale X: the\n"
    "  softmax scale (default 1/sqrt(head_dim)).\n"
    "Models (--model NAME; --model list prints them with their published settings): llama-3-8b,\n"
    "  llama-4-scout, gpt-oss-20b, gemma-2-9b, gemma-3-27b, deepseek-v3, qwen3-32b, flux-dev. Runs every\n"
    "  attention layer kind of the model in turn (e.g. gpt-oss-20b: sliding window 128, then full causal)\n"
    "  with its heads, dims, scale, soft-cap and sinks as published; --seq sets the sequence (flux-dev: the\n"
    "  image tokens, after 512 text tokens); --local N shrinks the sliding windows and chunks so that a\n"
    "  short --seq still sees them cut. With --decode: the model's decode layer (deepseek-v3: MLA's MQA\n"
    "  over the latent cache, D 576 / D_v 512, V inside K's rows). RESULT gains model=... layer=....\n"
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
    "  prefill_max_rel_err=...\n"
    "Serve (--serve): a simulated serving engine over the ranks, continuous batching over a paged KV pool\n"
    "  per rank (PagedDecode). --requests N (default 12) requests, each with a prompt of --prompt-len MIN,MAX\n"
    "  (default 64,512) tokens and --gen-len MIN,MAX (default 16,48) tokens to generate, both drawn from --seed;\n"
    "  --arrive R (default 2) are admitted per step and prefilled together as packed causal documents\n"
    "  (AnythingPolicy<RingPolicy<Stripe>>), their K/V rows handed to the pages of the rank and slot the\n"
    "  placement gives them. Each step decodes the oldest --max-batch B (default 8) running sequences, one\n"
    "  token each (0 in the step that admits them); a sequence's every --spec-every N-th step (default 4,\n"
    "  0: off) verifies 4 speculated tokens, of which 1-4 are accepted. Placement: --interleave N (default\n"
    "  1) tokens per run round-robin over the ranks, 0: contiguous (a prompt split evenly, later tokens on\n"
    "  the last rank). Pools: --page N (default 16) tokens per page, --pool-pages N (default: the workload's\n"
    "  peak on the busiest rank); free pages hold NaN, pages are freed when a request finishes and reused\n"
    "  last-freed first; block tables go to the steps as CSR and dense by turns. --check compares every\n"
    "  prefill and every 5th step (and the last) with a double reference (tolerance 1e-4 for f32, 1e-12 for\n"
    "  f64). RESULT: bytes_sent_per_rank is the busiest rank's mean per decode step, time_ms_per_iter the mean\n"
    "  step time (the slowest rank's), then mode=serve requests=... generated=... steps=... tokens_per_s=...\n"
    "  p50_ms=... p99_ms=... prefill_ms=... prefill_max_rel_err=... page=... interleave=... spec_every=...\n"
    "  max_batch=... pool_pages=... pages_peak=... pages_max_over_mean=... dtype=...\n";

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

/// A range option's values "MIN,MAX", 1 <= MIN <= MAX <= 2^20.
std::vector<std::int64_t> parse_range(std::string_view name, std::string_view text) {
  const std::vector<std::int64_t> r = parse_list(name, text, 1, 1 << 20);
  if (r.size() != 2 || r[0] > r[1])
    throw UsageError(std::string(name) + ": expected MIN,MAX with 1 <= MIN <= MAX, got '" + std::string(text) + "'");
  return r;
}

/// A real option's value, finite and from `min` to `max`.
double parse_real(std::string_view name, const char* text, double min, double max) {
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(v) || v < min || v > max)
    throw UsageError(std::string(name) + ": expected a number from " + std::to_string(min) + " to " +
                     std::to_string(max) + ", got '" + text + "'");
  return v;
}

/// Sum of a list (its values are at most 2^30 each, so no overflow for any command line).
std::int64_t sum(const std::vector<std::int64_t>& v) {
  std::int64_t n = 0;
  for (std::int64_t x : v) n += x;
  return n;
}

}  // namespace

void check_combinations(Options& o) {
  auto refuse_with = [&](std::initializer_list<const char*> names, const char* mode, const char* why) {
    for (const char* n : names)
      if (o.has(n)) throw UsageError(std::string(n) + ": not used with " + mode + " (" + why + ")");
  };
  if (o.policy_auto)
    refuse_with({"--layout", "--anything", "--ulysses-degree", "--ring-degree", "--decode", "--serve", "--model", "--sweep",
                 "--advise"},
                "--policy auto", "the advisor chooses the policy");
  if ((o.decode || o.serve) && o.dtype == DType::bf16)
    throw UsageError("--dtype bf16: forward and --backward runs only (--decode and --serve run f32 or f64)");
  if (!o.serve)
    refuse_with({"--requests", "--prompt-len", "--gen-len", "--arrive", "--max-batch", "--spec-every", "--interleave",
                 "--pool-pages"},
                "a forward or --decode run", "add --serve");
  if (o.serve) {
    refuse_with({"--decode", "--model", "--policy", "--layout", "--anything", "--ulysses-degree", "--ring-degree",
                 "--seq", "--sweep", "--kv-seq", "--batch", "--docs", "--window", "--kv-valid", "--causal-align",
                 "--backward", "--profile", "--iters", "--kv-len", "--new-tokens", "--steps", "--exchange",
                 "--head-dim-v", "--softcap", "--sinks", "--scale", "--trace", "--estimate"},
                "--serve",
                "the workload comes from --requests, --prompt-len and --gen-len, prefilled with ring stripe; the "
                "simulated engine models no other features");
    if (!o.has("--page")) o.page = 16;
    if (o.page < 1) throw UsageError("--page: expected a page size of 1 or more with --serve, got " + std::to_string(o.page));
    o.causal = true;
    // Every rank keeps each request's K/V versions and regenerates rows for the reference; a
    // verify step may write 3 tokens past a request's end.
    const double elems = static_cast<double>(o.requests) * static_cast<double>(o.prompt_len[1] + o.gen_len[1] + 3) *
                         static_cast<double>(o.heads) * static_cast<double>(o.head_dim);
    if (elems > 1e10) {
      char text[160];
      std::snprintf(text, sizeof text, "--requests x (--prompt-len MAX + --gen-len MAX) x --heads x --head-dim = %.3g "
                    "elements: too large for this demo", elems);
      throw UsageError(text);
    }
  } else if (o.decode) {
    refuse_with({"--seq", "--sweep", "--kv-seq", "--batch", "--docs", "--window", "--kv-valid", "--causal-align",
                 "--backward", "--profile", "--iters", "--trace", "--estimate"},
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
  if (o.local && o.model.empty()) throw UsageError("--local: sizes a --model's sliding windows or chunks; add --model");
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
    if (a == "--serve") { o.serve = true; continue; }
    if (a == "--advise") { o.advise = true; continue; }
    if (a == "--estimate") { o.estimate = true; continue; }
    if (a == "--sinks") { o.sinks = true; continue; }
    if (a.substr(0, 2) != "--") throw UsageError("'" + std::string(a) + "': expected an option such as --seq (see --help)");
    if (i + 1 >= argc) throw UsageError(std::string(a) + ": unknown option or missing value (see --help)");
    const char* v = argv[++i];
    const std::string_view s = v;
    if (a == "--policy") {
      o.policy_name = s;
      if (s == "ulysses") o.policy = PolicyKind::ulysses;
      else if (s == "ring") o.policy = PolicyKind::ring;
      else if (s == "unified") o.policy = PolicyKind::unified;
      else if (s == "auto") o.policy_auto = o.estimate = true;
      else throw UsageError("--policy: expected ulysses, ring, unified or auto, got '" + std::string(s) + "'");
    } else if (a == "--layout") {
      o.layout_given = true;
      if (s == "contiguous") o.layout = LayoutKind::contiguous;
      else if (s == "zigzag") o.layout = LayoutKind::zigzag;
      else if (s == "stripe") o.layout = LayoutKind::stripe;
      else throw UsageError("--layout: expected contiguous, zigzag or stripe, got '" + std::string(s) + "'");
    } else if (a == "--dtype") {
      if (s == "f32") o.dtype = DType::f32;
      else if (s == "f64") o.dtype = DType::f64;
      else if (s == "bf16") o.dtype = DType::bf16;
      else throw UsageError("--dtype: expected f32, f64 or bf16, got '" + std::string(s) + "'");
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
    else if (a == "--requests") o.requests = parse_int(a, v, 1, 1 << 20);
    else if (a == "--prompt-len") o.prompt_len = parse_range(a, s);
    else if (a == "--gen-len") o.gen_len = parse_range(a, s);
    else if (a == "--arrive") o.arrive = parse_int(a, v, 1, 1 << 20);
    else if (a == "--max-batch") o.max_batch = parse_int(a, v, 1, 1 << 16);
    else if (a == "--spec-every") o.spec_every = parse_int(a, v, 0);
    else if (a == "--interleave") o.interleave = parse_int(a, v, 0);
    else if (a == "--pool-pages") o.pool_pages = parse_int(a, v, 1);
    else if (a == "--ulysses-degree") o.ulysses_degree = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--ring-degree") o.ring_degree = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--batch") o.batch = parse_int(a, v, 1);
    else if (a == "--seq") o.seq = parse_int(a, v, 1);
    else if (a == "--kv-seq") o.kv_seq = parse_int(a, v, 1);
    else if (a == "--heads") o.heads = parse_int(a, v, 1);
    else if (a == "--kv-heads") o.kv_heads = parse_int(a, v, 1);
    else if (a == "--head-dim") o.head_dim = parse_int(a, v, 1);
    else if (a == "--head-dim-v") o.head_dim_v = parse_int(a, v, 1);
    else if (a == "--scale") o.scale = parse_real(a, v, 1e-6, 1e6);
    else if (a == "--softcap") o.softcap = parse_real(a, v, 0, 1e6);
    else if (a == "--model") o.model = s;
    else if (a == "--machine") o.machine = s;
    else if (a == "--trace") o.trace = s;
    else if (a == "--ranks-per-node") o.ranks_per_node = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--local") o.local = parse_int(a, v, 1);
    else if (a == "--ranks") o.ranks = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--iters") o.iters = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--threads") o.threads = static_cast<int>(parse_int(a, v, 1));
    else if (a == "--seed") o.seed = static_cast<std::uint64_t>(parse_int(a, v, 0, std::numeric_limits<std::int64_t>::max()));
    else throw UsageError(std::string(a) + ": unknown option (see --help)");
  }
  if (o.model == "list") return o;  // main prints the list
  if (o.advise) {
    if (o.decode || o.serve) throw UsageError("--advise: not used with --decode or --serve (it advises on attention)");
    if (o.ranks > most_advised_ranks)
      throw UsageError("--ranks: --advise models at most " + std::to_string(most_advised_ranks) + " ranks, got " +
                       std::to_string(o.ranks));
  }
  if (!o.has("--policy")) {
    if (o.advise) return o;  // the advisor tries every policy
    if (!o.decode && !o.serve) throw UsageError("--policy: required (ulysses, ring, unified or auto)");
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

void check_degrees(const Options& o, int world) {
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

std::string policy_type_name(const Options& o) {
  static constexpr const char* layouts[] = {"Contiguous", "Zigzag", "Stripe"};
  std::string n = o.policy == PolicyKind::ulysses ? "UlyssesPolicy"
                  : std::string(o.policy == PolicyKind::ring ? "RingPolicy<" : "UnifiedPolicy<") +
                        layouts[static_cast<int>(o.layout)] + ">";
  return o.anything ? "AnythingPolicy<" + n + ">" : n;
}

std::string user_message(const std::exception& e, bool verbose) {
  std::string m = e.what();
  if (!verbose)
    if (const auto at = m.rfind(" (at "); at != std::string::npos && m.back() == ')') m.erase(at);
  if (m.find("AnythingPolicy<") != std::string::npos)
    m += "\n  (on the command line: add --anything)";
  else if (m.find("ulysses_degree x ring_degree") != std::string::npos || m.find("does not divide the world size") != std::string::npos)
    m += "\n  (on the command line: --ulysses-degree U --ring-degree R with U x R = the number of ranks)";
  return m;
}

}  // namespace seqpar_demo
