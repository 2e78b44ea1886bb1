// The kernel thread pool (parallel.h) on its own, with no MLX:
//  - every task of every job runs exactly once, at 1-4 threads, for jobs of
//    0 to 1000 tasks, including jobs posted after the workers fell asleep
//    (a job is done when its tasks are; a worker that wakes late claims
//    nothing of a finished job, or a task of the current one);
//  - jobs posted from several threads at once each run whole;
//  - an exception from a task is rethrown by parallel_for once no task of
//    the job is running (the thrower ran once, no task twice), and the
//    next job runs whole;
//  - on Linux, every task runs with its thread's own CPU affinity (a worker
//    keeps off the posting thread's CPU only while it sleeps).
// The random job sizes come from a fixed seed, printed with each failure.
// tools/sanitizers.sh runs this test under ASan and TSan.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "parallel.h"

namespace {

constexpr uint32_t kSeed = 35;
std::atomic<int> failures{0};

void fail(const std::string& what) {
  ++failures;
  std::printf("FAIL (seed %u): %s\n", kSeed, what.c_str());
}

// Runs one job of n tasks; every task must run exactly once.
void check_job(int64_t n, const std::string& label) {
  std::vector<std::atomic<int>> runs(static_cast<size_t>(std::max<int64_t>(n, 1)));
  for (auto& r : runs) r.store(0);
  mlx_lattice::parallel_for(n, [&](int64_t t) {
    if (t < 0 || t >= n) {
      fail(label + ": task " + std::to_string(t) + " out of range");
      return;
    }
    runs[static_cast<size_t>(t)].fetch_add(1);
  });
  for (int64_t t = 0; t < n; ++t) {
    const int count = runs[static_cast<size_t>(t)].load();
    if (count != 1) {
      fail(label + ": task " + std::to_string(t) + " of " + std::to_string(n) + " ran " +
           std::to_string(count) + " times");
      return;
    }
  }
}

void every_task_once(std::mt19937& rng) {
  std::uniform_int_distribution<int64_t> size(0, 1000);
  for (int threads = 1; threads <= 4; ++threads) {
    mlx_lattice::set_num_threads(threads);
    for (int job = 0; job < 300; ++job) {
      // Every 25th job after a pause past the workers' spin, so they sleep
      // and are woken (or wake late).
      if (job % 25 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      const int64_t n = job < 8 ? job : size(rng);
      check_job(n, std::to_string(threads) + " threads, job " + std::to_string(job));
    }
  }
}

void jobs_from_several_threads() {
  mlx_lattice::set_num_threads(3);
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c) {
    callers.emplace_back([c] {
      for (int job = 0; job < 100; ++job) {
        check_job(1 + (job * 7 + c * 13) % 200,
                  "caller " + std::to_string(c) + ", job " + std::to_string(job));
      }
    });
  }
  for (auto& t : callers) t.join();
}

void exceptions_are_rethrown() {
  mlx_lattice::set_num_threads(2);
  for (int round = 0; round < 20; ++round) {
    if (round % 5 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    const std::string label = "round " + std::to_string(round);
    std::vector<std::atomic<int>> runs(100);
    for (auto& r : runs) r.store(0);
    std::atomic<int> running{0};
    bool caught = false;
    int running_at_catch = -1;
    try {
      mlx_lattice::parallel_for(100, [&](int64_t t) {
        running.fetch_add(1);
        runs[static_cast<size_t>(t)].fetch_add(1);
        std::this_thread::sleep_for(std::chrono::microseconds(t % 3 == 0 ? 50 : 0));
        running.fetch_sub(1);
        if (t == 37) throw std::runtime_error("task 37");
      });
    } catch (const std::runtime_error& e) {
      caught = std::string(e.what()) == "task 37";
      running_at_catch = running.load();
    }
    if (!caught) fail(label + ": task 37's exception not rethrown");
    if (running_at_catch != 0) {
      fail(label + ": rethrown with " + std::to_string(running_at_catch) + " tasks running");
    }
    if (runs[37].load() != 1) fail(label + ": task 37 ran " + std::to_string(runs[37].load()));
    for (int t = 0; t < 100; ++t) {
      if (runs[static_cast<size_t>(t)].load() > 1) {
        fail(label + ": task " + std::to_string(t) + " ran twice");
      }
    }
    check_job(64, "the job after an exception, " + label);
  }
}

void tasks_keep_their_affinity() {
#if defined(__linux__)
  cpu_set_t own;
  if (sched_getaffinity(0, sizeof(own), &own) != 0 || CPU_COUNT(&own) < 2) {
    std::printf("affinity check skipped: fewer than 2 CPUs allowed\n");
    return;
  }
  // Workers are created by the pool with the creating thread's affinity.
  mlx_lattice::set_num_threads(1);
  mlx_lattice::set_num_threads(std::min(4, std::max(2, CPU_COUNT(&own))));
  std::atomic<int> wrong{0};
  for (int job = 0; job < 40; ++job) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    mlx_lattice::parallel_for(32, [&](int64_t) {
      cpu_set_t now;
      if (sched_getaffinity(0, sizeof(now), &now) != 0 || !CPU_EQUAL(&now, &own)) {
        wrong.fetch_add(1);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    });
  }
  if (wrong.load() != 0) {
    fail(std::to_string(wrong.load()) + " tasks ran with an affinity other than the thread's own");
  }
#endif
}

}  // namespace

int main() {
  std::mt19937 rng(kSeed);
  every_task_once(rng);
  jobs_from_several_threads();
  exceptions_are_rethrown();
  tasks_keep_their_affinity();
  mlx_lattice::set_num_threads(2);
  if (failures != 0) {
    std::printf("%d failures\n", failures.load());
    return 1;
  }
  std::printf("parallel_test: ok\n");
  return 0;
}
