// Tests of the MSL CPU harness on its own kernels (harness_kernels.metal).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "msl_runtime.h"

namespace {

int failures = 0;

#define CHECK(cond, ...)                                 \
  do {                                                   \
    if (!(cond)) {                                       \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                 \
      std::fprintf(stderr, "\n");                        \
      ++failures;                                        \
    }                                                    \
  } while (0)

const msl::Schedule kSchedules[] = {msl::Schedule::kForward, msl::Schedule::kReverse,
                                    msl::Schedule::kSimdgroupFirst};

std::vector<float> random_floats(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> d(-8, 8);  // small integers: sums are exact
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(d(gen));
  return v;
}

std::vector<float> group_sums(const std::vector<float>& in, uint32_t groups, uint32_t size) {
  std::vector<float> out(groups, 0.0f);
  for (uint32_t g = 0; g < groups; ++g) {
    for (uint32_t i = 0; i < size; ++i) out[g] += in[g * size + i];
  }
  return out;
}

std::vector<float> run_group_sum(const char* kernel, const std::vector<float>& in, uint32_t groups,
                                 uint32_t size, msl::Schedule schedule, msl::Mode mode) {
  std::vector<float> out(groups, -1.0f);
  msl::Launch launch;
  launch.groups = {groups, 1, 1};
  launch.group_size = {size, 1, 1};
  launch.buffers = {const_cast<float*>(in.data()), out.data()};
  launch.schedule = schedule;
  launch.mode = mode;
  msl::dispatch(kernel, launch);
  return out;
}

void test_group_sum_all_schedules(msl::Mode mode) {
  const uint32_t groups = 3, size = 128;
  auto in = random_floats(groups * size, 1);
  auto want = group_sums(in, groups, size);
  for (auto s : kSchedules) {
    if (mode == msl::Mode::kThreads && s != msl::Schedule::kForward) continue;
    auto got = run_group_sum("group_sum", in, groups, size, s, mode);
    CHECK(got == want, "group_sum differs from the reference (schedule %d)", static_cast<int>(s));
  }
}

void test_missing_barrier_is_caught() {
  const uint32_t groups = 2, size = 64;
  auto in = random_floats(groups * size, 2);
  auto want = group_sums(in, groups, size);
  int caught = 0;
  for (auto s : kSchedules) {
    auto got = run_group_sum("group_sum_missing_barrier", in, groups, size, s, msl::Mode::kFibers);
    caught += got != want;
  }
  CHECK(caught > 0, "a kernel with a missing barrier gave the right answer in every schedule");
}

void test_divergent_barrier_is_reported() {
  std::vector<float> out(32);
  msl::Launch launch;
  launch.group_size = {32, 1, 1};
  launch.buffers = {out.data()};
  std::string message;
  try {
    msl::dispatch("divergent_barrier", launch);
  } catch (const msl::HarnessError& e) {
    message = e.what();
  }
  CHECK(message.find("divergent") != std::string::npos && message.find("16 at") != std::string::npos,
        "divergent barrier not reported; got '%s'", message.c_str());
}

void test_simd_collectives(uint32_t threads) {
  auto in = random_floats(threads, 3);
  std::vector<float> out(4 * threads);
  for (auto s : kSchedules) {
    msl::Launch launch;
    launch.group_size = {threads, 1, 1};
    launch.buffers = {in.data(), out.data()};
    launch.schedule = s;
    msl::dispatch("simd_ops", launch);
    for (uint32_t g = 0; g < threads; ++g) {
      uint32_t base = g / 32 * 32, n = std::min(32u, threads - base), lane = g % 32;
      float sum = 0, max = in[base], prefix = 0;
      for (uint32_t i = 0; i < n; ++i) {
        sum += in[base + i];
        max = std::max(max, in[base + i]);
        if (i < lane) prefix += in[base + i];
      }
      uint32_t src = 31 - lane;
      float shuffled = src < n ? in[base + src] : in[g];
      CHECK(out[4 * g] == sum && out[4 * g + 1] == max && out[4 * g + 2] == prefix &&
                out[4 * g + 3] == shuffled,
            "simd ops wrong at thread %u of %u", g, threads);
    }
  }
}

void test_mma8() {
  auto a = random_floats(64, 4), bf = random_floats(64, 5), c = random_floats(64, 6);
  std::vector<_Float16> b(64);
  for (int i = 0; i < 64; ++i) b[i] = static_cast<_Float16>(bf[i]);
  std::vector<float> want(64);
  for (int r = 0; r < 8; ++r) {
    for (int col = 0; col < 8; ++col) {
      float acc = c[r * 8 + col];
      for (int k = 0; k < 8; ++k) acc += a[r * 8 + k] * bf[k * 8 + col];
      want[r * 8 + col] = acc;
    }
  }
  msl::Launch launch;
  launch.group_size = {32, 1, 1};
  launch.buffers = {a.data(), b.data(), c.data()};
  msl::dispatch("mma8", launch);
  CHECK(c == want, "simdgroup 8x8 multiply-accumulate differs from the reference");
}

void test_bad_launches() {
  std::string message;
  try {
    msl::dispatch("no_such_kernel", msl::Launch{});
  } catch (const msl::HarnessError& e) {
    message = e.what();
  }
  CHECK(message.find("no kernel named") != std::string::npos, "unknown kernel not reported");
  message.clear();
  msl::Launch launch;
  launch.group_size = {32, 1, 1};  // no buffers bound
  try {
    msl::dispatch("divergent_barrier", launch);
  } catch (const msl::HarnessError& e) {
    message = e.what();
  }
  CHECK(message.find("[[buffer(0)]]") != std::string::npos, "unbound buffer not reported: '%s'",
        message.c_str());
}

// Atomic counters, min/max/exchange and a threadgroup atomic, under every
// schedule (threads mode: real atomics, under TSan in the tsan target).
void test_atomic_counter(msl::Mode mode) {
  const uint32_t groups = 3, size = 96, n = groups * size;
  for (auto s : kSchedules) {
    if (mode == msl::Mode::kThreads && s != msl::Schedule::kForward) continue;
    std::vector<uint32_t> counters = {0, 0, 0xffffffffu, 12345};
    std::vector<uint32_t> order(n, 0xffffffffu), group_counts(groups, 0);
    msl::Launch launch;
    launch.groups = {groups, 1, 1};
    launch.group_size = {size, 1, 1};
    launch.buffers = {counters.data(), order.data(), group_counts.data()};
    launch.schedule = s;
    launch.mode = mode;
    msl::dispatch("atomic_counter", launch);
    std::vector<uint32_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    bool permutation = true;
    for (uint32_t i = 0; i < n; ++i) permutation &= sorted[i] == i;
    CHECK(counters[0] == n && permutation, "atomic_fetch_add: count %u of %u, old values %s",
          counters[0], n, permutation ? "a permutation" : "not a permutation");
    CHECK(counters[1] == n - 1 && counters[2] == 0 && counters[3] < n,
          "atomic max/min/exchange: %u %u %u", counters[1], counters[2], counters[3]);
    CHECK(std::all_of(group_counts.begin(), group_counts.end(), [&](uint32_t c) { return c == size; }),
          "threadgroup atomic counts wrong (schedule %d)", static_cast<int>(s));
  }
}

// Compare-exchange insertion into an open-addressing table, duplicates
// resolved to their first row with atomic_fetch_min.
void test_atomic_hash(msl::Mode mode) {
  const uint32_t n = 200, slots = 97, size = 64;
  std::mt19937 gen(11);
  std::uniform_int_distribution<int> d(-30, 30);  // many duplicates
  std::vector<int> keys(n);
  for (auto& k : keys) k = d(gen);
  for (auto s : kSchedules) {
    if (mode == msl::Mode::kThreads && s != msl::Schedule::kForward) continue;
    std::vector<int> table(slots, -1), first(slots, 0x7fffffff), slot_of(n, -2);
    uint32_t count = n, table_slots = slots;
    msl::Launch launch;
    launch.groups = {(n + size - 1) / size, 1, 1};
    launch.group_size = {size, 1, 1};
    launch.buffers = {keys.data(), table.data(), first.data(), slot_of.data(), &count, &table_slots};
    launch.schedule = s;
    launch.mode = mode;
    msl::dispatch("atomic_hash_insert", launch);
    int wrong = 0;
    for (uint32_t i = 0; i < n; ++i) {
      const int want = static_cast<int>(std::find(keys.begin(), keys.end(), keys[i]) - keys.begin());
      wrong += slot_of[i] < 0 || first[slot_of[i]] != want || keys[table[slot_of[i]]] != keys[i];
    }
    std::vector<int> distinct = keys;
    std::sort(distinct.begin(), distinct.end());
    const auto used = std::count_if(table.begin(), table.end(), [](int r) { return r >= 0; });
    const auto want_used = std::unique(distinct.begin(), distinct.end()) - distinct.begin();
    CHECK(wrong == 0 && used == want_used,
          "CAS hash: %d rows with a wrong first occurrence, %ld slots used for %ld keys (schedule %d)",
          wrong, static_cast<long>(used), static_cast<long>(want_used), static_cast<int>(s));
  }
}

// A load-then-store increment must lose updates in the harness (lanes
// interleave at atomics), so a kernel relying on it fails its test.
void test_lost_update_is_caught() {
  int caught = 0;
  for (auto s : kSchedules) {
    uint32_t counter = 0;
    msl::Launch launch;
    launch.group_size = {64, 1, 1};
    launch.buffers = {&counter};
    launch.schedule = s;
    msl::dispatch("atomic_lost_update", launch);
    caught += counter != 64;
  }
  CHECK(caught > 0, "a non-atomic increment gave the right count in every schedule");
}

}  // namespace

int main(int argc, char** argv) {
  const bool threads_only = argc > 1 && std::strcmp(argv[1], "--threads-only") == 0;
  if (argc > 1 && std::strcmp(argv[1], "--race") == 0) {
    // For the TSan target: a planted race that ThreadSanitizer must report.
    auto in = random_floats(64, 7);
    run_group_sum("group_sum_missing_barrier", in, 1, 64, msl::Schedule::kForward,
                  msl::Mode::kThreads);
    return 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "--race-counter") == 0) {
    // For the TSan target: a plain increment from every lane must be reported.
    uint32_t counter = 0;
    msl::Launch launch;
    launch.group_size = {32, 1, 1};
    launch.buffers = {&counter};
    launch.mode = msl::Mode::kThreads;
    msl::dispatch("plain_counter", launch);
    return 0;
  }
  int tests = 0;
  auto run = [&](auto&& test) {
    const int before = failures;
    test();
    ++tests;
    return failures == before;
  };
  int passed = run([] { test_group_sum_all_schedules(msl::Mode::kThreads); });
  passed += run([] { test_atomic_counter(msl::Mode::kThreads); });
  passed += run([] { test_atomic_hash(msl::Mode::kThreads); });
  if (!threads_only) {
    passed += run([] { test_group_sum_all_schedules(msl::Mode::kFibers); });
    passed += run(test_missing_barrier_is_caught);
    passed += run(test_divergent_barrier_is_reported);
    passed += run([] { test_simd_collectives(64); });
    passed += run([] { test_simd_collectives(48); });
    passed += run(test_mma8);
    passed += run(test_bad_launches);
    passed += run([] { test_atomic_counter(msl::Mode::kFibers); });
    passed += run([] { test_atomic_hash(msl::Mode::kFibers); });
    passed += run(test_lost_update_is_caught);
  }
  std::printf("%d passed, %d failed\n", passed, tests - passed);
  return passed == tests ? 0 : 1;
}
