// Measured peak arithmetic rate of this machine's vector units: a loop of
// independent multiply-accumulates per instruction set, on one thread and on
// every core. Prints one JSON object; benchmarks use it as the roofline.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kIters = 20'000'000;

// Each loop keeps 12 independent accumulators: enough to cover FMA latency
// (4-5 cycles) times two ports. Returns a value so the work is not elided.
__attribute__((target("avx2,fma"))) double fma_avx2(int64_t iters) {
  __m256 acc[12];
  for (auto& a : acc) a = _mm256_set1_ps(0.f);
  const __m256 x = _mm256_set1_ps(1.0000001f), y = _mm256_set1_ps(0.9999999f);
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
    for (auto& a : acc) a = _mm256_fmadd_ps(x, y, a);
  float s = 0;
  for (auto& a : acc) s += _mm256_cvtss_f32(a);
  return s;
}

__attribute__((target("avx512f"))) double fma_avx512(int64_t iters) {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_set1_ps(0.f);
  const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
    for (auto& a : acc) a = _mm512_fmadd_ps(x, y, a);
  float s = 0;
  for (auto& a : acc) s += _mm512_reduce_add_ps(a);
  return s;
}

__attribute__((target("avx512f,avx512vnni"))) double vnni_avx512(int64_t iters) {
  __m512i acc[12];
  for (auto& a : acc) a = _mm512_setzero_si512();
  const __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(-2);
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
    for (auto& a : acc) a = _mm512_dpbusd_epi32(a, x, y);
  int64_t s = 0;
  for (auto& a : acc) s += _mm512_reduce_add_epi32(a);
  return static_cast<double>(s);
}

__attribute__((target("avx2,avxvnni"))) double vnni_avx2(int64_t iters) {
  __m256i acc[12];
  for (auto& a : acc) a = _mm256_setzero_si256();
  const __m256i x = _mm256_set1_epi8(3), y = _mm256_set1_epi8(-2);
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
    for (auto& a : acc) a = _mm256_dpbusd_avx_epi32(a, x, y);
  int64_t s = 0;
  for (auto& a : acc) s += _mm256_extract_epi32(a, 0);
  return static_cast<double>(s);
}

__attribute__((target("avx512f,avx512bf16"))) double bf16_avx512(int64_t iters) {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_set1_ps(0.f);
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3f80);
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
    for (auto& a : acc) a = _mm512_dpbf16_ps(a, x, y);
  float s = 0;
  for (auto& a : acc) s += _mm512_reduce_add_ps(a);
  return s;
}

struct Loop {
  const char* name;
  const char* unit;       // "GFLOP/s" or "GOP/s" (int8 multiply-adds count 2 ops)
  double ops_per_iter;    // arithmetic operations per loop iteration (12 instructions)
  bool supported;
  double (*fn)(int64_t);
};

double rate(const Loop& loop, int threads) {
  const int64_t iters = kIters / 4;
  std::vector<std::thread> pool;
  std::vector<double> sink(threads);
  auto start = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { sink[t] = loop.fn(iters); });
  for (auto& th : pool) th.join();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile double keep = sink[0];
  (void)keep;
  return loop.ops_per_iter * static_cast<double>(iters) * threads / seconds / 1e9;
}

double best_rate(const Loop& loop, int threads) {
  double best = 0;
  for (int r = 0; r < 3; ++r) best = std::max(best, rate(loop, threads));
  return best;
}

}  // namespace

int main() {
  __builtin_cpu_init();
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const Loop loops[] = {
      {"fp32_fma_avx2", "GFLOP/s", 12 * 8 * 2, __builtin_cpu_supports("fma") != 0, fma_avx2},
      {"fp32_fma_avx512", "GFLOP/s", 12 * 16 * 2, __builtin_cpu_supports("avx512f") != 0,
       fma_avx512},
      {"int8_vnni_avx2", "GOP/s", 12 * 32 * 2, __builtin_cpu_supports("avxvnni") != 0, vnni_avx2},
      {"int8_vnni_avx512", "GOP/s", 12 * 64 * 2, __builtin_cpu_supports("avx512vnni") != 0,
       vnni_avx512},
      {"bf16_dot_avx512", "GFLOP/s", 12 * 32 * 2, __builtin_cpu_supports("avx512bf16") != 0,
       bf16_avx512},
  };
  std::string out = "{\"cores\": " + std::to_string(cores) + ", \"loops\": {";
  bool first = true;
  for (const auto& loop : loops) {
    if (!loop.supported) continue;
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s\"%s\": {\"unit\": \"%s\", \"one_thread\": %.1f, \"all_cores\": %.1f}",
                  first ? "" : ", ", loop.name, loop.unit, best_rate(loop, 1), best_rate(loop, cores));
    out += buf;
    first = false;
  }
  out += "}}";
  std::puts(out.c_str());
  return 0;
}
