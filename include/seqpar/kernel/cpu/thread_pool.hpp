#pragma once
/// \file
/// ThreadPool: a small persistent fork-join pool for the CPU kernels. Threads are created once
/// (when a kernel is configured or prepared) so that a forward call starts no thread and
/// allocates nothing: it only wakes the workers, shares out task indices, and waits.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/core/error.hpp"

namespace seqpar::detail {

/// A fixed set of `size() - 1` worker threads plus the calling thread. `run(tasks, f)` calls
/// f(task, worker) for every task in [0, tasks) exactly once, worker in [0, size()) naming the
/// thread (0 is the caller) so each can use its own scratch; tasks are taken in increasing
/// order from a shared counter, which balances tasks of unequal cost. One `run` at a time.
class ThreadPool {
 public:
  /// Starts `threads - 1` workers; throws ConfigError unless threads >= 1.
  explicit ThreadPool(int threads) {
    SEQPAR_CHECK(threads >= 1, ConfigError, "ThreadPool threads: expected >= 1, got ", threads);
    workers_.reserve(static_cast<std::size_t>(threads - 1));
    for (int w = 1; w < threads; ++w) workers_.emplace_back([this, w] { work_loop(w); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  /// Threads that run tasks, the caller included.
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  /// Runs f(task, worker) for every task; returns when all are done. An exception thrown by a
  /// task stops the hand-out of further tasks and is rethrown here.
  template <class F>
  void run(std::int64_t tasks, F&& f) {
    using Fn = std::remove_reference_t<F>;
    if (tasks <= 0) return;
    if (workers_.empty() || tasks == 1) {
      for (std::int64_t t = 0; t < tasks; ++t) f(t, 0);
      return;
    }
    {
      std::lock_guard lock(mu_);
      job_ = [](void* ctx, std::int64_t t, int w) { (*static_cast<Fn*>(ctx))(t, w); };
      ctx_ = const_cast<void*>(static_cast<const void*>(&f));
      tasks_ = tasks;
      next_.store(0, std::memory_order_relaxed);
      busy_ = static_cast<int>(workers_.size());
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    drain(0);
    std::unique_lock lock(mu_);
    done_.wait(lock, [&] { return busy_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  /// Takes tasks until none is left.
  void drain(int worker) {
    try {
      for (std::int64_t t = next_.fetch_add(1, std::memory_order_relaxed); t < tasks_;
           t = next_.fetch_add(1, std::memory_order_relaxed))
        job_(ctx_, t, worker);
    } catch (...) {
      std::lock_guard lock(mu_);
      if (!error_) error_ = std::current_exception();
      next_.store(tasks_, std::memory_order_relaxed);  // the rest is pointless: stop handing out
    }
  }

  void work_loop(int worker) {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      drain(worker);
      std::lock_guard lock(mu_);
      if (--busy_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  bool stop_ = false;
  std::uint64_t generation_ = 0;
  int busy_ = 0;
  void (*job_)(void*, std::int64_t, int) = nullptr;
  void* ctx_ = nullptr;
  std::int64_t tasks_ = 0;
  std::atomic<std::int64_t> next_{0};
  std::exception_ptr error_;
};

}  // namespace seqpar::detail
