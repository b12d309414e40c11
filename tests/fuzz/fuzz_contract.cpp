// fuzz_contract: a seeded contract fuzzer that holds seqpar to "exact or refused, never
// silently wrong". Each case is generated from (seed, case number) alone, biased toward edge
// values (0, 1, -1, S +- 1, INT64_MAX, INT64_MIN, sums past 2^63, every mask family, batch 0,
// odd head dims, NaN/inf/denormal scales, enums out of range, worlds of 1-8 ranks, ranks with
// no tokens, S_q != S_kv, GQA/MQA; today's models' D_v, soft-cap and sinks, alone and combined,
// with their illegal values, sinks of NaN and +-inf, and V as a column view of K's rows in
// decode) and checked against an independent brute-force reference:
// can_implement says what plan does, plan refuses alike on every rank or runs exactly,
// plan.work counts the visible pairs, decode steps equal attention over the whole cache,
// advance is all or nothing, owner/slot refuse positions outside the cache, and a huge
// time-out means never. fuzz_report.hpp names every property, fuzz_known.hpp the known
// defect classes.
//
// Every case runs in a child process (fork), so a crash, an abort or a hang (killed after
// --case-seconds) is a failure of that case and the run goes on; the child's address space is
// capped (4 GiB), so unbounded allocation fails too.
//
// Usage:
//   fuzz_contract [--seed N] [--cases N] [--seconds N | --minutes N] [--skip LETTERS]
//                 [--ignore-known] [--only attention|decode|timeout] [--case-seconds N]
//                 [--no-fork] [--verbose] [--list-known]
//   fuzz_contract --seed S --case K [--skip LETTERS]   reproduces case K of seed S in this process
// --skip LETTERS keeps the triggers of those known classes out of the cases where that can be
// done without losing coverage, and counts (without printing or failing) any failure of them.
// Each failing case prints one line: "FAIL --seed S --case K [known x] <property>: <detail> |
// <case>", which is its own reproducer. The exit status is 1 when a case failed (with
// --ignore-known: a failure of no known class), else 0.
//
// The long run, by hand (e.g. after a change to plan building, masks or a kernel):
//   build/tests/fuzz/fuzz_contract --seed $RANDOM --minutes 15
// and, while known defects are being fixed, to look only for new ones, skipping the classes
// still open (SEQPAR_FUZZ_OPEN_CLASSES in tests/fuzz/CMakeLists.txt):
//   build/tests/fuzz/fuzz_contract --seed $RANDOM --minutes 15 --skip abcdefghijklmnop
// A failing line reruns with a debugger as: gdb --args fuzz_contract --seed S --case K.
// ctest runs a short fixed-seed run (fuzz_contract_short, tests/fuzz/CMakeLists.txt).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "fuzz/fuzz_known.hpp"
#include "fuzz/fuzz_isolate.hpp"

namespace {

using namespace seqpar::fuzz;
using Clock = std::chrono::steady_clock;

struct Options {
  std::uint64_t seed = 1;
  long long cases = -1;     // -1: unbounded (time decides) or 1000
  double seconds = -1;      // -1: no time limit
  long long one_case = -1;  // >= 0: run only this case, in this process
  GenOptions gen;
  bool ignore_known = false, fork = true, verbose = false;
  double case_seconds = 120;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "fuzz_contract: %s\nusage: fuzz_contract [--seed N] [--cases N] [--seconds N | --minutes N] "
               "[--case K] [--skip LETTERS] [--ignore-known] [--only attention|decode|timeout] [--case-seconds N] "
               "[--no-fork] [--verbose] [--list-known]\n",
               why);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    if (a == "--seed") o.seed = std::stoull(value());
    else if (a == "--cases") o.cases = std::stoll(value());
    else if (a == "--seconds") o.seconds = std::stod(value());
    else if (a == "--minutes") o.seconds = 60 * std::stod(value());
    else if (a == "--case") o.one_case = std::stoll(value());
    else if (a == "--skip") o.gen.skip = value();
    else if (a == "--ignore-known") o.ignore_known = true;
    else if (a == "--case-seconds") o.case_seconds = std::stod(value());
    else if (a == "--no-fork") o.fork = false;
    else if (a == "--verbose") o.verbose = true;
    else if (a == "--only") {
      const std::string k = value();
      o.gen.only = k == "attention" ? 0 : k == "decode" ? 1 : k == "timeout" ? 2 : -2;
      if (o.gen.only == -2) usage("--only takes attention, decode or timeout");
    } else if (a == "--list-known") {
      std::printf("known defect classes (fuzz_report.hpp has the list): %s\n", known_letters);
      std::exit(0);
    } else {
      usage(("unknown argument " + a).c_str());
    }
  }
  if (o.cases < 0 && o.seconds < 0) o.cases = 1000;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::printf("fuzz_contract: seed %llu", static_cast<unsigned long long>(o.seed));
  if (o.one_case >= 0) std::printf(", case %lld", o.one_case);
  else if (o.cases >= 0) std::printf(", %lld cases", o.cases);
  if (o.one_case < 0 && o.seconds >= 0) std::printf(", at most %.0f s", o.seconds);
  if (!o.gen.skip.empty()) std::printf(", skipping known classes %s", o.gen.skip.c_str());
  std::printf("\n");
  const std::string skip_arg = o.gen.skip.empty() ? "" : " --skip " + o.gen.skip;
  std::map<std::string, long long> classes;  // "property [known x]" -> failing cases
  std::map<std::string, long long> notes;    // what the cases checked -> cases
  long long ran = 0, failed = 0, failed_new = 0;
  const auto start = Clock::now();
  const long long first = o.one_case >= 0 ? o.one_case : 0;
  for (long long k = first;; ++k) {
    if (o.one_case >= 0 ? k > o.one_case : (o.cases >= 0 && k >= o.cases)) break;
    if (o.one_case < 0 && o.seconds >= 0 && std::chrono::duration<double>(Clock::now() - start).count() > o.seconds) break;
    const FuzzCase c = make_case(o.seed, static_cast<std::uint64_t>(k), o.gen);
    if (o.verbose || o.one_case >= 0) std::printf("case %lld: %s\n", k, describe(c).c_str());
    const Report result = o.fork && o.one_case < 0 ? run_isolated(c, o.case_seconds) : run_here(c, o.case_seconds);
    const std::vector<Failure>& fails = result.failures;
    ++ran;
    for (const std::string& n : result.notes) ++notes[n];
    if (fails.empty()) continue;
    bool any = false, any_new = false;
    for (const Failure& f : fails) {
      const std::string known = known_class(c, f);
      if (!known.empty() && o.gen.skips(known[0])) {  // a skipped class: counted, not printed
        ++classes[f.property + " [known " + known + ", skipped]"];
        continue;
      }
      any = true;
      any_new = any_new || known.empty();
      ++classes[f.property + (known.empty() ? " [new]" : " [known " + known + "]")];
      std::printf("FAIL --seed %llu --case %lld%s%s %s: %s | %s\n", static_cast<unsigned long long>(o.seed), k,
                  skip_arg.c_str(), known.empty() ? "" : (" [known " + known + "]").c_str(), f.property.c_str(),
                  f.detail.substr(0, 600).c_str(), describe(c).c_str());
    }
    failed += any;
    failed_new += any_new;
    std::fflush(stdout);
  }
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("fuzz_contract: %lld cases in %.1f s, %lld failed (%lld with a failure of no known class)\n", ran, took,
              failed, failed_new);
  std::printf("what the cases reached:\n");
  for (const auto& [name, n] : notes) std::printf("  %6lld  %s\n", n, name.c_str());
  if (!classes.empty()) std::printf("failures by property and class:\n");
  for (const auto& [name, n] : classes) std::printf("  %6lld  %s\n", n, name.c_str());
  return (o.ignore_known ? failed_new : failed) > 0 ? 1 : 0;
}
