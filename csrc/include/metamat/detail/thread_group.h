// Worker threads that are joined on every path. A std::thread destroyed while joinable calls
// std::terminate ("terminate called without an active exception"): a vector<std::thread> that
// unwinds because starting the k-th thread threw (std::system_error EAGAIN when the process is
// at its thread limit: cgroup pids.max, RLIMIT_NPROC, no memory for a stack) aborts the whole
// process. ThreadGroup never lets that happen: spawn() reports failure instead of throwing,
// the destructor joins, and an exception escaping a thread's function is kept, not fatal.
//
// Fault injection (tests only): METAMAT_THREAD_FAULT=<k> makes every k-th spawn() of the
// process fail as a real thread-start failure would (std::system_error inside the start).
#pragma once
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace metamat {

class ThreadGroup {
 public:
  ThreadGroup() = default;
  ~ThreadGroup() { join(); }
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;

  // Runs fn() on a new thread. Returns false, with nothing started, when the thread cannot be
  // started (the caller then does that share of the work itself). Never throws.
  template <class F>
  bool spawn(F fn) noexcept {
    try {
      if (injected_failure())
        throw std::system_error(EAGAIN, std::generic_category(), "injected thread-start failure");
      threads_.reserve(threads_.size() + 1);  // may throw: before any thread exists
      threads_.emplace_back([this, fn = std::move(fn)]() mutable {
        try {
          fn();
        } catch (...) {
          keep(std::current_exception());
        }
      });
      return true;
    } catch (...) {
      return false;
    }
  }

  // Joins every started thread (idempotent).
  void join() noexcept {
    for (auto& t : threads_)
      if (t.joinable()) t.join();
    threads_.clear();
  }

  size_t started() const { return threads_.size(); }

  // The first exception that escaped a thread's function (after join()), or null.
  std::exception_ptr error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  void keep(std::exception_ptr e) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_) error_ = e;
  }

  static bool injected_failure() {
    static const long every = [] {
      const char* v = std::getenv("METAMAT_THREAD_FAULT");
      const long k = v != nullptr ? std::strtol(v, nullptr, 10) : 0;
      return k > 0 ? k : 0;
    }();
    static std::atomic<long> count{0};
    return every > 0 && (count.fetch_add(1) + 1) % every == 0;
  }

  std::vector<std::thread> threads_;
  mutable std::mutex mu_;
  std::exception_ptr error_;
};

}  // namespace metamat
