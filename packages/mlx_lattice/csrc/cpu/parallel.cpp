#include "parallel.h"
#include "input_error.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
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

#if defined(__linux__)
#include <sched.h>
#endif

namespace mlx_lattice {

namespace {

// MLX_LATTICE_NUM_THREADS where set, else the CPUs this process may run on
// (its affinity mask on Linux, as a container's CPU set limits it; the
// machine's logical CPUs elsewhere), at most the pool's 1024 threads.
int default_threads() {
  int n = 0;
  if (threads_from_text(std::getenv("MLX_LATTICE_NUM_THREADS"), n)) return n;
  long cpus = static_cast<long>(std::thread::hardware_concurrency());
#if defined(__linux__)
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0 && CPU_COUNT(&allowed) > 0) {
    cpus = CPU_COUNT(&allowed);
  }
#endif
  return static_cast<int>(std::clamp<long>(cpus, 1, 1024));
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

// The calling CPU, or -1 where unknown.
int current_cpu() {
#if defined(__linux__)
  return sched_getcpu();
#else
  return -1;
#endif
}

// While it lives, keeps the calling thread off `cpu` (when its affinity
// allows another CPU), then gives the thread its affinity back unless
// someone else changed it meanwhile. A worker sleeps under one, away from
// the CPU of the thread that posts jobs: Linux wakes a sleeping thread onto
// its waker's CPU when it sees no idle CPU that it deems available, and a
// small virtual machine's halted vCPU is not available to it (the worker
// then waits behind the posting thread, for milliseconds).
class AvoidCpu {
 public:
  explicit AvoidCpu(int cpu) {
#if defined(__linux__)
    cpu_ = cpu;
    if (cpu < 0 || cpu >= CPU_SETSIZE) return;
    if (sched_getaffinity(0, sizeof(allowed_), &allowed_) != 0) return;
    if (!CPU_ISSET(cpu, &allowed_) || CPU_COUNT(&allowed_) < 2) return;
    others_ = allowed_;
    CPU_CLR(cpu, &others_);
    set_ = sched_setaffinity(0, sizeof(others_), &others_) == 0;
#else
    (void)cpu;
#endif
  }
  ~AvoidCpu() {
#if defined(__linux__)
    cpu_set_t now;
    if (!set_ || sched_getaffinity(0, sizeof(now), &now) != 0) return;
    if (CPU_EQUAL(&now, &others_)) {
      sched_setaffinity(0, sizeof(allowed_), &allowed_);
    } else if (!CPU_ISSET(cpu_, &now)) {
      // Narrowed meanwhile (a cpuset change keeps what was asked, less what
      // it removes): give back the CPU this object took away; the kernel
      // keeps it out if the new set does not allow it.
      CPU_SET(cpu_, &now);
      sched_setaffinity(0, sizeof(now), &now);
    }
#endif
  }
  AvoidCpu(const AvoidCpu&) = delete;
  AvoidCpu& operator=(const AvoidCpu&) = delete;

 private:
#if defined(__linux__)
  int cpu_ = -1;
  cpu_set_t allowed_{}, others_{};
  bool set_ = false;
#endif
};

// The pool: workers spin briefly, then sleep until a job is posted, then
// claim tasks from a shared counter. One job runs at a time (jobs are
// serialized by job_mutex). A job is done when its tasks are, not when every
// worker has looked at it: a worker still asleep (its core halted, which a
// virtual machine takes up to milliseconds to wake) is not waited for, and
// the threads that are awake run the tasks.
//
// Claims: one 64-bit word holds the job's next task (high half) and its
// task count (low half), set for each job. A claim is a fetch_add of the
// high half, and the word it returns says whether it got a task: a worker
// that wakes late either finds the last job's tasks exhausted or claims a
// task of the current one. The job's function is read after a successful
// claim: it is written before the word, and the next job's only after all
// the tasks of this one (the claimed one too) finished.
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
    if (size_.load(std::memory_order_relaxed) <= 1 || n_tasks == 1 ||
        n_tasks > kMaxTasks) {
      for (int64_t t = 0; t < n_tasks; ++t) fn(t);
      return;
    }
    fn_.store(&fn, std::memory_order_relaxed);
    poster_cpu_.store(current_cpu(), std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
    failed_.store(false, std::memory_order_relaxed);
    error_ = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++generation_;
      claims_.store(static_cast<uint64_t>(n_tasks), std::memory_order_release);
      posted_.store(generation_, std::memory_order_release);
    }
    wake_.notify_all();
    work();
    auto finished = [this, n_tasks] {
      return finished_.load(std::memory_order_acquire) == n_tasks;
    };
    if (!spin_until(finished)) {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, finished);
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  // Larger jobs run on the calling thread: the claims word's halves stay
  // below 2^32. Past the count, a thread claims at most twice per job (a
  // worker that woke late, once for the job before and once for this one),
  // and the pool has at most 1024 threads.
  static constexpr int64_t kMaxTasks = (int64_t{1} << 31) - 1;
  static_assert(kMaxTasks + 2 * 1024 < (int64_t{1} << 32));

  // Claims and runs tasks until the current job has none left.
  void work() {
    for (;;) {
      const uint64_t claim = claims_.fetch_add(uint64_t{1} << 32, std::memory_order_acq_rel);
      const auto t = static_cast<int64_t>(claim >> 32);
      const auto n = static_cast<int64_t>(claim & 0xffffffffu);
      if (t >= n) return;
      if (!failed_.load(std::memory_order_relaxed)) {
        try {
          (*fn_.load(std::memory_order_relaxed))(t);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mutex_);
          if (!error_) error_ = std::current_exception();
          failed_.store(true, std::memory_order_relaxed);  // later tasks are skipped
        }
      }
      if (finished_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
        std::lock_guard<std::mutex> lock(mutex_);
        done_.notify_one();
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
        const AvoidCpu away(poster_cpu_.load(std::memory_order_relaxed));
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work();
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
  // The current job: written by run() before its claims word, read by the
  // threads that claimed one of its tasks.
  std::atomic<const std::function<void(int64_t)>*> fn_{nullptr};
  std::atomic<uint64_t> claims_{0};  // (next task << 32) | task count
  std::atomic<int64_t> finished_{0};
  std::atomic<bool> failed_{false};
  std::atomic<int> poster_cpu_{-1};  // where run() posted the job
  std::exception_ptr error_;  // under mutex_
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

bool decimal_from_text(const char* text, long long max, long long& value) {
  if (text == nullptr || *text < '0' || *text > '9') return false;
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(text, &end, 10);
  if (errno != 0 || *end != '\0' || parsed > max) return false;
  value = parsed;
  return true;
}

bool threads_from_text(const char* text, int& n) {
  long long value = 0;
  if (!decimal_from_text(text, 1024, value) || value < 1) return false;
  n = static_cast<int>(value);
  return true;
}

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
