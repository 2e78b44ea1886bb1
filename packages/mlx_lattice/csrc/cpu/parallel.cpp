#include "parallel.h"
#include "input_error.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace mlx_lattice {

namespace {

int default_threads() {
  if (const char* env = std::getenv("MLX_LATTICE_NUM_THREADS")) {
    char* end = nullptr;
    long value = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && value >= 1 && value <= 1024) {
      return static_cast<int>(value);
    }
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

// Spins for at most kSpin while ready() is false; returns ready(). Waking a
// sleeping thread costs tens of microseconds (more on a virtual machine
// whose idle core has halted), paid at every job of a short sequence of
// jobs, as a relation build or a small convolution posts them; a short spin
// before sleeping keeps that off the critical path.
template <class Ready>
bool spin_until(Ready&& ready) {
  constexpr auto kSpin = std::chrono::microseconds(50);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1;; ++i) {
    if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
    if (i % 64 == 0 && std::chrono::steady_clock::now() - start > kSpin) return ready();
  }
}

// The pool: workers spin briefly, then sleep until a job is posted, then
// claim tasks from a shared counter. One job runs at a time (jobs are
// serialized by job_mutex).
class Pool {
 public:
  explicit Pool(int threads) { resize(threads); }
  ~Pool() { stop_workers(); }

  // Read by any thread (kernels plan their tasks with it) while resize(),
  // under job_mutex_, writes it: atomic.
  int size() const { return size_.load(std::memory_order_acquire); }

  void resize(int threads) {
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    stop_workers();
    size_.store(threads, std::memory_order_release);
    stop_ = false;
    // Workers start from the current generation, so a job posted before a
    // worker first waits is still seen by it.
    const uint64_t start = generation_;
    for (int i = 1; i < threads; ++i) {
      workers_.emplace_back([this, start] { worker_loop(start); });
    }
  }

  void run(int64_t n_tasks, const std::function<void(int64_t)>& fn) {
    if (n_tasks <= 0) return;
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    if (size_.load(std::memory_order_relaxed) <= 1 || n_tasks == 1) {
      for (int64_t t = 0; t < n_tasks; ++t) fn(t);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      n_tasks_ = n_tasks;
      next_.store(0);
      error_ = nullptr;
      active_.store(static_cast<int>(workers_.size()));
      ++generation_;
      posted_.store(generation_, std::memory_order_release);
    }
    wake_.notify_all();
    work();
    spin_until([this] { return active_.load(std::memory_order_acquire) == 0; });
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return active_.load(std::memory_order_acquire) == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work() {
    for (;;) {
      int64_t t = next_.fetch_add(1);
      if (t >= n_tasks_) return;
      try {
        (*fn_)(t);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_tasks_);
      }
    }
  }

  void worker_loop(uint64_t seen) {
    for (;;) {
      // A job's fields are written before posted_ (release), so a worker
      // that sees it posted while spinning may run it without the lock.
      if (spin_until([&] { return posted_.load(std::memory_order_acquire) != seen; })) {
        seen = posted_.load(std::memory_order_acquire);
      } else {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work();
      if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mutex_);
        done_.notify_one();
      }
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
  }

  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
  std::atomic<int> active_{0};
  uint64_t generation_ = 0;
  std::atomic<uint64_t> posted_{0};  // generation_, read without the lock
  bool stop_ = false;
  std::atomic<int> size_{1};
};

// The pool is created on first use (not at import) and lives until exit.
Pool& pool() {
  static Pool* instance = new Pool(default_threads());  // never destroyed: workers may outlive statics
  return *instance;
}

}  // namespace

int get_num_threads() { return pool().size(); }

void set_num_threads(int n) {
  if (n < 1 || n > 1024) {
    throw ::mlx_lattice::InputError("set_num_threads: n must be in [1, 1024], got " +
                                std::to_string(n) + ".");
  }
  if (n != pool().size()) pool().resize(n);
}

void parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn) {
  pool().run(n_tasks, fn);
}

}  // namespace mlx_lattice
