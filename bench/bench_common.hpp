#pragma once
/// \file
/// Helpers shared by the benchmark programs: random inputs, FLOP and traffic formulas, and
/// RankTeam, which keeps P ThreadCommunicator ranks alive across benchmark iterations so that
/// an iteration times one forward call and nothing else (no thread start, plan or allocation).

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "seqpar/seqpar.hpp"

namespace seqpar::bench {

/// Ends a benchmark program built only to check that it compiles (SEQPAR_BENCH_COMPILE_ONLY:
/// unoptimized, what scripts/setup.sh's test build makes), with a message saying where the
/// measuring build is, so that nobody quotes figures of an -O0 build.
inline void refuse_if_compile_only(const char* program) {
#if SEQPAR_BENCH_COMPILE_ONLY
  std::fprintf(stderr,
               "%s: this build's benchmarks are compile checks, unoptimized (SEQPAR_BENCH_COMPILE_ONLY=ON, as "
               "scripts/setup.sh configures build/): run bench/run.sh, which builds optimized ones in build-bench/, "
               "or configure with -DSEQPAR_BENCH_COMPILE_ONLY=OFF\n",
               program);
  std::exit(2);
#else
  (void)program;
#endif
}

/// Random values in [-1, 1): never zeros, so no shortcut makes a kernel look faster.
template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<T> x(n);
  for (auto& e : x) e = static_cast<T>(dist(rng));
  return x;
}

/// Attention FLOPs of a forward (two matrix products, FlashAttention-2's count): 4 B H Sq Sk D,
/// halved for causal.
inline double attention_flops(std::int64_t batch, std::int64_t heads, std::int64_t sq, std::int64_t sk,
                              std::int64_t dim, bool causal) {
  const double f = 4.0 * double(batch) * double(heads) * double(sq) * double(sk) * double(dim);
  return causal ? f / 2 : f;
}

/// The analytic minimum of forward bytes sent per rank (the USP paper's formula, Fang and Zhao
/// 2024; Ulysses
/// is U = P, Ring is R = P): s B (L/P) D [(2H + 2Hkv)(U-1)/U + 2 Hkv ], without LSE.
inline double min_forward_bytes(const AttentionProblem& pr, std::int64_t global_len, int ulysses, int ring) {
  const double s = pr.dtype == DType::f64 ? 8 : 4, P = double(ulysses) * ring;
  const double h = double(pr.heads), hk = double(pr.kv_head_count());
  return s * double(pr.batch) * (double(global_len) / P) * double(pr.head_dim) *
         ((2 * h + 2 * hk) * (ulysses - 1) / ulysses + 2 * hk * (ring - 1));
}

/// Median of a sample (by value: it sorts a copy).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Mean of the faster half of a sample: robust to the slow outliers other processes cause,
/// and steadier than the minimum alone (one lucky call decides a minimum).
inline double fast_half_mean(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = (v.size() + 1) / 2;
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i) sum += v[i];
  return sum / double(n);
}

/// P ranks on threads that outlive the benchmark loop. Each rank runs `setup(comm)` once,
/// which returns the rank's step function; `time_step(which)` then makes every rank call
/// step(which) between two barriers and returns rank 0's wall time for it in seconds.
class RankTeam {
 public:
  /// A rank's step: `which` selects the variant (e.g. plain or Anything engine).
  using Step = std::function<void(int which)>;
  /// Builds a rank's state (collective: may plan) and returns its step.
  using Setup = std::function<Step(ThreadCommunicator&)>;

  /// Starts `ranks` ranks and waits until every rank has run its setup; rethrows a setup error.
  RankTeam(int ranks, Setup setup) : ranks_(ranks) {
    runner_ = std::thread([this, setup = std::move(setup)] {
      try {
        run_ranks(ranks_, [&](ThreadCommunicator& comm) { rank_main(comm, setup); });
      } catch (...) {
        std::lock_guard lock(mu_);
        error_ = std::current_exception();
        failed_ = true;
      }
      {
        std::lock_guard lock(mu_);
        finished_ = true;
      }
      cv_.notify_all();
    });
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return (failed_ && finished_) || ready_ == ranks_; });
    if (failed_) {
      lock.unlock();
      runner_.join();
      std::rethrow_exception(error_);
    }
  }
  RankTeam(const RankTeam&) = delete;
  RankTeam& operator=(const RankTeam&) = delete;
  ~RankTeam() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
    runner_.join();
  }

  /// Every rank runs step(which); returns rank 0's time from the first barrier to the last.
  double time_step(int which) {
    std::unique_lock lock(mu_);
    which_ = which;
    done_ = 0;
    ++generation_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return (failed_ && finished_) || done_ == ranks_; });
    if (failed_) std::rethrow_exception(error_);
    return seconds_;
  }

 private:
  void rank_main(ThreadCommunicator& comm, const Setup& setup) {
    try {
      rank_loop(comm, setup);
    } catch (...) {
      {
        std::lock_guard lock(mu_);
        failed_ = true;  // wakes the ranks that wait for a command, so run_ranks can return
      }
      cv_.notify_all();
      throw;
    }
  }

  void rank_loop(ThreadCommunicator& comm, const Setup& setup) {
    Step step = setup(comm);
    std::uint64_t seen;
    {
      std::lock_guard lock(mu_);
      seen = generation_;
      ++ready_;
    }
    cv_.notify_all();
    for (;;) {
      int which;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return failed_ || generation_ != seen; });
        seen = generation_;
        if (stop_ || failed_) return;
        which = which_;
      }
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      step(which);
      comm.barrier();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::lock_guard lock(mu_);
      if (comm.rank() == 0) seconds_ = s;
      if (++done_ == ranks_) cv_.notify_all();
    }
  }

  int ranks_;
  std::thread runner_;
  std::mutex mu_;
  std::condition_variable cv_;
  int ready_ = 0, done_ = 0, which_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false, failed_ = false, finished_ = false;
  double seconds_ = 0;
  std::exception_ptr error_;
};

}  // namespace seqpar::bench
