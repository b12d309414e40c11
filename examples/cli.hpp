#pragma once
/// \file
/// The examples' command line in and verdict out. Arguments are whole numbers checked against
/// their ranges before MPI starts: a mistake prints the usage and every rank exits with status 2
/// alike (they all parse the same arguments), so no rank runs with garbage or waits for one
/// that stopped. Every example ends with one line, `<program>: matches the reference: yes` or
/// `no`, and a non-zero exit status on no.

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace seqpar::examples {

/// The whole number `text` spells, if it is one within [lo, hi] (nothing before or after it).
inline std::optional<std::int64_t> parse_whole(std::string_view text, std::int64_t lo, std::int64_t hi) {
  std::int64_t v = 0;
  const char* end = text.data() + text.size();
  const auto [stop, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc{} || stop != end || v < lo || v > hi) return std::nullopt;
  return v;
}

/// True in the process that speaks for the job before MPI starts: world rank 0 under mpirun
/// (Open MPI, PMIx or MPICH set the variable), or a process started on its own.
inline bool first_process() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const char* rank = std::getenv(var)) return std::string_view(rank) == "0";
  return true;
}

/// An example's arguments: options `--name N` and positional numbers, each within a range.
/// Read the options first, then the positional arguments, then call finish().
class Args {
 public:
  /// `usage`: the synopsis and a line per argument, printed after a mistake or on --help.
  Args(int argc, char** argv, std::string usage) : usage_(std::move(usage)) {
    const std::string_view path = argc > 0 ? argv[0] : "example";
    program_ = std::string(path.substr(path.find_last_of('/') + 1));
    for (int i = 1; i < argc; ++i) args_.emplace_back(argv[i]);
    used_.assign(args_.size(), false);
  }

  /// The value of `--name N` (the last one given), a whole number in [lo, hi]; `fallback`
  /// when the option is absent.
  std::int64_t option(std::string_view name, std::int64_t lo, std::int64_t hi, std::int64_t fallback) {
    for (std::size_t i = 0; i < args_.size(); ++i) {
      if (args_[i] != name) continue;
      used_[i] = true;
      if (i + 1 == args_.size()) {
        reject(std::string(name) + " needs a value");
        break;
      }
      used_[i + 1] = true;
      fallback = number(args_[++i], lo, hi, std::string(name) + ": ");
    }
    return fallback;
  }

  /// The positional arguments in order (the ones that are not options), each a whole number
  /// in [lo, hi], at most `most` of them; empty when none are given.
  std::vector<std::int64_t> positional(std::int64_t lo, std::int64_t hi, std::size_t most) {
    std::vector<std::int64_t> values;
    for (std::size_t i = 0; i < args_.size(); ++i) {
      if (used_[i] || args_[i] == "-h" || args_[i].starts_with("--")) continue;
      used_[i] = true;
      values.push_back(number(args_[i], lo, hi, ""));
    }
    if (values.size() > most)
      reject("too many numbers: " + std::to_string(values.size()) + " given, at most " + std::to_string(most) +
             " expected");
    return values;
  }

  /// Records a mistake the example finds itself (values that do not fit together).
  void reject(const std::string& why) {
    if (error_.empty()) error_ = why;
  }

  /// Call once, after reading the arguments: nothing when the example should run, otherwise
  /// main's exit status (0 after --help, 2 after a mistake), the usage printed once.
  std::optional<int> finish() {
    bool help = false;
    for (std::size_t i = 0; i < args_.size(); ++i)
      if (args_[i] == "-h" || args_[i] == "--help") help = true;
      else if (!used_[i]) reject("unknown argument '" + std::string(args_[i]) + "'");
    if (help) {
      if (first_process()) std::printf("usage: %s\n", usage_.c_str());
      return 0;
    }
    if (error_.empty()) return std::nullopt;
    if (first_process()) std::fprintf(stderr, "%s: %s\nusage: %s\n", program_.c_str(), error_.c_str(), usage_.c_str());
    return 2;
  }

 private:
  // `text` as a number in [lo, hi]; a mistake (its message starting with `what`) otherwise.
  std::int64_t number(std::string_view text, std::int64_t lo, std::int64_t hi, const std::string& what) {
    if (const auto v = parse_whole(text, lo, hi)) return *v;
    reject(what + "'" + std::string(text) + "' is not a whole number from " + std::to_string(lo) + " to " +
           std::to_string(hi));
    return lo;
  }

  std::string usage_, program_, error_;
  std::vector<std::string_view> args_;
  std::vector<bool> used_;
};

/// Prints `<program>: matches the reference: yes` (or `no`) when `speak` (one rank speaks
/// for the job) and returns main's exit status: 0 on yes, 1 on no.
inline int verdict(const char* program, bool matches, bool speak = true) {
  if (speak) std::printf("%s: matches the reference: %s\n", program, matches ? "yes" : "no");
  return matches ? 0 : 1;
}

}  // namespace seqpar::examples
