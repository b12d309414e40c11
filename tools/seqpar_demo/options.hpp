#pragma once
/// \file
/// seqpar_demo's command line: the options (Options), how they are read and checked against
/// each other and the world (parse, check_degrees), and the errors a command-line user sees
/// (UsageError, user_message). The options are a stable interface: scripts and tests give them
/// and parse the RESULT line (report.hpp).

#include <algorithm>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "seqpar/seqpar.hpp"

namespace seqpar_demo {

using namespace seqpar;

/// The most ranks --advise models: the cost model plans every rank of every candidate mesh
/// (1000 ranks took 5 s).
inline constexpr int most_advised_ranks = 1024;

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
  std::int64_t head_dim_v = 0;  // 0 = --head-dim
  double scale = 0, softcap = 0;  // 0: 1/sqrt(head_dim); no cap
  bool sinks = false;             // one random sink logit per query head (from --seed)
  std::string model, layer;       // --model, and the model's layer kind a run is ("" without --model)
  std::int64_t local = 0;         // --local: the size of the model's sliding windows or chunks (0: as published)
  bool v_in_k = false;            // decode: V is the first head_dim_v columns of the cached K rows
  bool causal = false;
  CausalAlign causal_align = CausalAlign::top_left;
  Window window{};
  std::vector<std::int64_t> docs, kv_valid;  // empty: none
  std::vector<std::int64_t> sweep;           // empty: the one --seq
  DType dtype = DType::f32;  // bf16: forward and backward runs only (the inputs rounded to bf16)
  std::string comm;  // "" = choose
  int ranks = 0;     // 0 = world size (mpi) or 4 (threads)
  int iters = 2;
  bool check = false;
  int threads = 0;  // 0 = the kernel's default
  std::uint64_t seed = 2024;
  bool backward = false;
  bool profile = false;
  std::string trace;                    // --trace FILE: the timed calls' phases per rank, Chrome trace JSON
  bool policy_auto = false;             // --policy auto: the advisor's first choice on calibrated figures
  bool estimate = false;                // --estimate: calibrate, and print the cost model's time beside the measured one
  double estimate_ms = -1;              // the estimate of this run when already made (--policy auto)
  MeshPlacement placement = MeshPlacement::ulysses_adjacent;  // Unified: which groups are consecutive ranks
  bool advise = false;                  // --advise: print the advisor's ranked choices, run nothing
  std::string machine = "ci-xeon-2core";  // --machine: the advisor's machine preset
  int ranks_per_node = 0;               // --ranks-per-node: overrides the preset's (0: keep it)
  bool verbose = false;
  // --decode
  bool decode = false;
  std::vector<std::int64_t> kv_len;  // prompt lengths, one per sequence
  std::int64_t new_tokens = 1, page = 0, steps = 8;
  DecodeExchange exchange = DecodeExchange::all_gather;
  /// --serve: a simulated serving engine (serve_run.hpp). Requests arrive --arrive per step and
  /// are prefilled on arrival; the decode batch takes the oldest --max-batch running ones. Lengths
  /// are drawn per request, uniform in [MIN, MAX], from --seed. --page (default 16 here) is the
  /// pool's page size; --interleave the placement's run of tokens per rank (0: contiguous).
  bool serve = false;
  std::int64_t requests = 12;                    ///< --requests: requests in the workload
  std::vector<std::int64_t> prompt_len{64, 512};  ///< --prompt-len MIN,MAX
  std::vector<std::int64_t> gen_len{16, 48};      ///< --gen-len MIN,MAX: tokens each request generates
  std::int64_t arrive = 2;                        ///< --arrive: requests admitted (and prefilled) per step
  std::int64_t max_batch = 8;                     ///< --max-batch: most sequences in a decode step
  std::int64_t spec_every = 4;                    ///< --spec-every: each N-th step of a sequence verifies 4 (0: off)
  std::int64_t interleave = 1;                    ///< --interleave: TokenPlacement's run (0: contiguous)
  std::int64_t pool_pages = 0;                    ///< --pool-pages: pages per rank's pool (0: the workload's peak)
  std::vector<std::string> given;  // the options on the command line, for the checks between them

  /// True when option `name` was on the command line.
  bool has(std::string_view name) const { return std::find(given.begin(), given.end(), name) != given.end(); }
  /// The global lengths to run: the sweep's, or the one --seq.
  std::vector<std::int64_t> lengths() const { return sweep.empty() ? std::vector<std::int64_t>{seq} : sweep; }
};

/// --layout's values, by LayoutKind.
inline constexpr const char* layout_names[] = {"contiguous", "zigzag", "stripe"};

/// Reads the command line (--help prints the usage and exits); throws UsageError naming the
/// option to change.
Options parse(int argc, char** argv);

/// The checks between options (each error names the option to change); parse applies them,
/// and again to each run a --model expands into. Completes the decode options (batch, seq).
void check_combinations(Options& o);

/// The world size and degrees the options ask for, checked against the world.
void check_degrees(const Options& o, int world);

/// Readable type name of the policy the options select.
std::string policy_type_name(const Options& o);

/// An error message for a command-line user: the library's " (at file:line)" suffix dropped
/// unless --verbose, and the flag that fixes a plain policy's uneven split named.
std::string user_message(const std::exception& e, bool verbose);

}  // namespace seqpar_demo
