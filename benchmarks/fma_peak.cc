// Measured peak arithmetic rate of this machine's vector units: a loop of
// independent multiply-accumulates per instruction set, on one thread and on
// every core. Prints one JSON object; benchmarks use it as the roofline.
// AMX tile loops (TDPBSSD, TDPBF16PS on 16 x 64-byte tiles) run where the
// CPU has AMX, the OS enables its state (XCR0) and grants the process the
// tile permission; otherwise one line on stderr says they were skipped.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <type_traits>
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

// AVX2 without VNNI: the step of the int8 kernel there (rows_avx2 in
// gemm_int8_x86.inc), 32 multiply-adds: vpsignb, vpmaddubsw, vpmaddwd
// against ones, vpaddd. In one asm statement tied to its accumulator so that
// nothing is hoisted; 8 accumulators (only the add is carried).
__attribute__((target("avx2"))) double maddubs_avx2(int64_t iters) {
  __m256i acc[8];
  for (auto& a : acc) a = _mm256_setzero_si256();
  const __m256i u = _mm256_set1_epi8(3), c = _mm256_set1_epi8(-2), s = _mm256_set1_epi8(5);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 8
    for (auto& a : acc) {
      __m256i t;
      asm("vpsignb %[c], %[s], %[t]\n\t"
          "vpmaddubsw %[t], %[u], %[t]\n\t"
          "vpmaddwd %[ones], %[t], %[t]\n\t"
          "vpaddd %[t], %[a], %[a]"
          : [a] "+x"(a), [t] "=&x"(t)
          : [c] "x"(c), [s] "x"(s), [u] "x"(u), [ones] "x"(ones));
    }
  }
  int64_t sum = 0;
  for (auto& a : acc) sum += _mm256_extract_epi32(a, 0);
  return static_cast<double>(sum);
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

// AMX: CPUID.(7,0):EDX bits 24 (AMX-TILE), 25 (AMX-INT8), 22 (AMX-BF16);
// XCR0 bits 17 and 18; arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
// Returns "" when usable, else why not.
const char* amx_missing(int feature_bit) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1u) || !((d >> feature_bit) & 1u)) {
    return "the CPU has no AMX (CPUID)";
  }
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return "no OSXSAVE";
  unsigned lo = 0, hi = 0;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return "the OS does not enable the tile state (XCR0)";
  static const bool granted = syscall(SYS_arch_prctl, 0x1023L, 18L) == 0;
  if (!granted) return "the OS refused the tile permission (ARCH_REQ_XCOMP_PERM)";
  return "";
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Six 16 x 64-byte tiles: four accumulators, A and B; four independent
// products per iteration.
__attribute__((target("amx-tile"))) void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  asm volatile("ldtilecfg %0" ::"m"(cfg));
  alignas(64) static const uint8_t ones[16 * 64] = {1};
  asm volatile("tileloadd (%0,%1,1), %%tmm4" ::"r"(ones), "r"(64L));
  asm volatile("tileloadd (%0,%1,1), %%tmm5" ::"r"(ones), "r"(64L));
  asm volatile("tilezero %tmm0\n\ttilezero %tmm1\n\ttilezero %tmm2\n\ttilezero %tmm3");
}

// Four independent tile products (accumulators tmm0..tmm3, A = tmm4,
// B = tmm5) of one instruction, as the text of one asm statement.
#define AMX_FOUR_PRODUCTS(insn)                                                  \
  insn " %tmm5, %tmm4, %tmm0\n\t" insn " %tmm5, %tmm4, %tmm1\n\t" insn          \
       " %tmm5, %tmm4, %tmm2\n\t" insn " %tmm5, %tmm4, %tmm3"

// The AMX loop of one instruction: TDPBSSD (int32 accumulators) or
// TDPBF16PS (float32 accumulators).
template <bool kInt8>
__attribute__((target("amx-tile,amx-int8,amx-bf16"))) double amx_loop(int64_t iters) {
  amx_configure();
  for (int64_t i = 0; i < iters; ++i) {
    if constexpr (kInt8)
      asm volatile(AMX_FOUR_PRODUCTS("tdpbssd"));
    else
      asm volatile(AMX_FOUR_PRODUCTS("tdpbf16ps"));
  }
  alignas(64) std::conditional_t<kInt8, int32_t, float> c[16 * 16];
  asm volatile("tilestored %%tmm0, (%0,%1,1)" ::"r"(c), "r"(64L) : "memory");
  asm volatile("tilerelease");
  return c[0];
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
      {"int8_maddubs_avx2", "GOP/s", 8 * 32 * 2, __builtin_cpu_supports("avx2") != 0, maddubs_avx2},
      {"int8_vnni_avx512", "GOP/s", 12 * 64 * 2, __builtin_cpu_supports("avx512vnni") != 0,
       vnni_avx512},
      {"bf16_dot_avx512", "GFLOP/s", 12 * 32 * 2, __builtin_cpu_supports("avx512bf16") != 0,
       bf16_avx512},
      // Per iteration 4 tile products: int8 16 x 16 x 64 multiply-adds each,
      // bf16 16 x 16 x 32.
      {"int8_amx_tdpbssd", "GOP/s", 4 * 16 * 16 * 64 * 2, *amx_missing(25) == 0, amx_loop<true>},
      {"bf16_amx_tdpbf16ps", "GFLOP/s", 4 * 16 * 16 * 32 * 2, *amx_missing(22) == 0, amx_loop<false>},
  };
  if (*amx_missing(25) || *amx_missing(22)) {
    std::fprintf(stderr, "fma_peak: AMX tile loops skipped: %s\n",
                 *amx_missing(25) ? amx_missing(25) : amx_missing(22));
  }
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
