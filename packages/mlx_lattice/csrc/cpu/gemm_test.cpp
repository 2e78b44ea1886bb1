// Tests of the GEMM micro-kernels (gemm.h) with no MLX: every path the CPU
// has, against an independent reference.
//
//   gemm_test            runs itself once per path of gemm_isas() (native only)
//   gemm_test ISA        forces ISA through MLX_LATTICE_GEMM_ISA and checks it
//                        (the form used under qemu, which cannot re-exec);
//                        avx512f runs twice, its blocks' broadcasts in
//                        registers and in the FMA's operand
//                        (MLX_LATTICE_GEMM_SPLAT=1 and 0)
//   gemm_test --features prints the CPU features the ARM dispatch reads
//
// References: a std::fma chain in the documented order (C loaded, then j
// ascending), which every FMA path must match bit for bit, and a double
// accumulation that every path (scalar included) must match to rounding.
// gemm_rows_half (float16 and bfloat16 rows of A, widened inside the
// AVX-512 blocks) is held to the same references on A's values, and must
// decline, leaving C alone, under every other path.
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gemm.h"
#include "gemm_arm.h"

extern char** environ;

namespace {

using mlx_lattice::gemm_isa;
using mlx_lattice::gemm_isas;
using mlx_lattice::gemm_outer;
using mlx_lattice::gemm_rows;
using mlx_lattice::gemm_rows_half;

int failures = 0;

void fail(const char* what, int64_t m, int64_t k, int64_t n, int64_t r, int64_t x, float got,
          double want) {
  if (++failures <= 10) {
    std::fprintf(stderr, "FAIL %s m=%lld k=%lld n=%lld at [%lld,%lld]: got %.9g want %.9g\n", what,
                 (long long)m, (long long)k, (long long)n, (long long)r, (long long)x, got, want);
  }
}

// Checks one output value against both references: the fused paths give the
// fma chain's bits; every path is within the float32 summation bound of the
// exact sum, (terms + 1) u sum|terms| for the products and the initial value
// in any order (u = 2^-24; x 1.01: the first-order term of (1 + u)^n - 1).
void check(const char* what, bool fused, int64_t m, int64_t k, int64_t n, int64_t r, int64_t x,
           float got, float fma_chain, double exact, double scale, int64_t terms) {
  if (fused && std::memcmp(&got, &fma_chain, sizeof(float)) != 0) {
    fail(what, m, k, n, r, x, got, fma_chain);
  } else if (!(std::fabs(got - exact) <= 1.01 * double(terms + 1) * 0x1p-24 * scale + 1e-30)) {
    fail(what, m, k, n, r, x, got, exact);
  }
}

// C rows live at shuffled places in one buffer with guard values between
// them, so a kernel that writes outside a row's n values is caught.
constexpr float kGuard = -7.25f;

// A random float16 (bf16 false) or bfloat16 value's bits: fp16 normals of
// magnitude 2^-5 to 2^6 and some subnormals; bf16 a normal float truncated.
uint16_t random_half(std::mt19937& gen, bool bf16) {
  if (bf16) {
    const float f = std::normal_distribution<float>()(gen);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>(u >> 16);
  }
  const int sign = std::uniform_int_distribution<int>(0, 1)(gen);
  const int e = std::uniform_int_distribution<int>(9, 21)(gen);
  const int exp = e == 9 ? 0 : e;  // 0: a subnormal
  const int man = std::uniform_int_distribution<int>(0, 1023)(gen);
  return static_cast<uint16_t>(sign << 15 | exp << 10 | man);
}

// The value of half bits (finite), computed arithmetically.
float half_value(uint16_t bits, bool bf16) {
  if (bf16) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const int exp = (bits >> 10) & 0x1f;
  const int man = bits & 0x3ff;
  const float mag = exp ? std::ldexp(1.0f + man / 1024.0f, exp - 15) : std::ldexp(man, -24);
  return bits & 0x8000 ? -mag : mag;
}

// gemm_rows (half 0), or gemm_rows_half over float16 (1) or bfloat16 (2)
// rows of A, against the references on A's values.
void test_rows(std::mt19937& gen, bool fused, int64_t m, int64_t k, int64_t n, int half = 0) {
  std::normal_distribution<float> normal;
  const int64_t stride = n + 3;
  std::vector<float> a_store(m * k), b(k * n), c_store(m * stride + 3, kGuard);
  std::vector<uint16_t> h_store(half ? m * k : 0);
  for (int64_t i = 0; i < m * k; ++i) {
    if (half) {
      h_store[i] = random_half(gen, half == 2);
      a_store[i] = half_value(h_store[i], half == 2);
    } else {
      a_store[i] = normal(gen);
    }
  }
  for (float& v : b) v = normal(gen);
  std::vector<int64_t> order(m);
  for (int64_t i = 0; i < m; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), gen);
  std::vector<const float*> a(m);
  std::vector<const uint16_t*> ah(m);
  std::vector<float*> c(m);
  for (int64_t r = 0; r < m; ++r) {
    a[r] = a_store.data() + order[r] * k;
    if (half) ah[r] = h_store.data() + order[r] * k;
    c[r] = c_store.data() + 3 + order[(r + 1) % m] * stride;
    for (int64_t x = 0; x < n; ++x) c[r][x] = normal(gen);
  }
  std::vector<float> c0 = c_store;
  const char* what = half ? "gemm_rows_half" : "gemm_rows";
  const char* guard = half ? "gemm_rows_half guard" : "gemm_rows guard";
  if (half) {
    // The fused path runs where gemm_rows runs AVX-512, and only there.
    const bool want = std::strcmp(gemm_isa(), "avx512f") == 0;
    if (gemm_rows_half(m, ah.data(), half == 2, b.data(), k, n, c.data()) != want) {
      fail("gemm_rows_half ran where it should not, or not where it should", m, k, n, -1, -1,
           want ? 0.0f : 1.0f, want ? 1.0 : 0.0);
      return;
    }
    if (!want) {
      if (std::memcmp(c0.data(), c_store.data(), sizeof(float) * c0.size()) != 0) {
        fail("gemm_rows_half wrote where it did not run", m, k, n, -1, -1, 0.0f, 0.0);
      }
      return;
    }
  } else {
    gemm_rows(m, a.data(), b.data(), k, n, c.data());
  }
  for (int64_t r = 0; r < m; ++r) {
    const float* init = c0.data() + (c[r] - c_store.data());
    for (int64_t x = 0; x < n; ++x) {
      float chain = init[x];
      double exact = init[x], scale = std::fabs(init[x]);
      for (int64_t j = 0; j < k; ++j) {
        chain = std::fma(a[r][j], b[j * n + x], chain);
        exact += double(a[r][j]) * b[j * n + x];
        scale += std::fabs(double(a[r][j]) * b[j * n + x]);
      }
      check(what, fused, m, k, n, r, x, c[r][x], chain, exact, scale, k);
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t x = n; x < stride; ++x) {
      float* g = c_store.data() + 3 + i * stride + x;
      if (*g != kGuard) fail(guard, m, k, n, i, x, *g, kGuard);
    }
  }
  for (int64_t x = 0; x < 3; ++x) {
    if (c_store[x] != kGuard) fail(guard, m, k, n, -1, x, c_store[x], kGuard);
  }
}

void test_outer(std::mt19937& gen, bool fused, int64_t m, int64_t rows, int64_t n) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int64_t> pick(0, rows);
  int64_t r0 = pick(gen), r1 = pick(gen);
  if (r0 > r1) std::swap(r0, r1);
  std::vector<float> f_store(m * rows), g_store(m * n), c(rows * n);
  for (float& v : f_store) v = normal(gen);
  for (float& v : g_store) v = normal(gen);
  for (float& v : c) v = normal(gen);
  std::vector<const float*> f(m), g(m);
  for (int64_t j = 0; j < m; ++j) {
    f[j] = f_store.data() + ((j * 7) % m) * rows;
    g[j] = g_store.data() + ((j * 5 + 1) % m) * n;
  }
  const std::vector<float> c0 = c;
  gemm_outer(m, f.data(), g.data(), r0, r1, c.data(), n);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t x = 0; x < n; ++x) {
      const float init = c0[r * n + x];
      if (r < r0 || r >= r1) {
        if (std::memcmp(&c[r * n + x], &init, sizeof(float)) != 0) {
          fail("gemm_outer untouched row", m, rows, n, r, x, c[r * n + x], init);
        }
        continue;
      }
      float chain = init;
      double exact = init, scale = std::fabs(init);
      for (int64_t j = 0; j < m; ++j) {
        chain = std::fma(f[j][r], g[j][x], chain);
        exact += double(f[j][r]) * g[j][x];
        scale += std::fabs(double(f[j][r]) * g[j][x]);
      }
      check("gemm_outer", fused, m, rows, n, r, x, c[r * n + x], chain, exact, scale, m);
    }
  }
}

int run_one(const char* isa) {
  setenv("MLX_LATTICE_GEMM_ISA", isa, 1);
  if (std::strcmp(gemm_isa(), isa) != 0) {
    std::fprintf(stderr, "FAIL asked for %s, the dispatch chose %s\n", isa, gemm_isa());
    return 1;
  }
  const bool fused = std::strcmp(isa, "scalar") != 0;
  const unsigned seed = 20261202u;
  std::mt19937 gen(seed);
  const int64_t ms[] = {1, 2, 5, 6, 7, 12, 13, 37};
  const int64_t ks[] = {1, 3, 17, 40, 64};
  // Widths 16, 32, 48, 64, 96, 112 take the unmasked AVX-512 strips, the
  // others a masked last vector.
  const int64_t ns[] = {1, 3, 4, 5, 8, 11, 12, 15, 16, 17, 31, 32, 33, 48, 64, 70, 96, 112};
  int cases = 0;
  for (int64_t m : ms) {
    for (int64_t k : ks) {
      for (int64_t n : ns) {
        test_rows(gen, fused, m, k, n);
        test_outer(gen, fused, k, m, n);
        test_rows(gen, fused, m, k, n, 1);
        test_rows(gen, fused, m, k, n, 2);
        cases += 4;
      }
    }
  }
  // Empty shapes leave C alone.
  float one = 1.0f;
  float* c1 = &one;
  const float* a1 = &one;
  gemm_rows(0, &a1, &one, 1, 1, &c1);
  gemm_rows(1, &a1, &one, 0, 1, &c1);
  gemm_outer(0, &a1, &a1, 0, 1, &one, 1);
  if (one != 1.0f) fail("empty shape", 0, 0, 0, 0, 0, one, 1.0);
  const char* splat = std::getenv("MLX_LATTICE_GEMM_SPLAT");
  std::printf("%s%s%s: %d cases, seed %u, %s\n", isa, splat ? " splat=" : "", splat ? splat : "",
              cases, seed, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}

int print_features() {
  const auto f = mlx_lattice::arm::cpu_features();
  std::printf("neon=%d fp16=%d fhm=%d dotprod=%d bf16=%d i8mm=%d\n", f.neon, f.fp16, f.fhm,
              f.dotprod, f.bf16, f.i8mm);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--features") == 0) return print_features();
  if (argc > 1) return run_one(argv[1]);
  // One child per path: the path is chosen once per process.
  int status_all = 0;
  std::vector<std::pair<std::string, const char*>> runs;
  for (const std::string& isa : gemm_isas()) {
    if (isa == "avx512f") {
      runs.emplace_back(isa, "1");
      runs.emplace_back(isa, "0");
    } else {
      runs.emplace_back(isa, nullptr);
    }
  }
  for (const auto& [isa, splat] : runs) {
    if (splat) {
      setenv("MLX_LATTICE_GEMM_SPLAT", splat, 1);
    } else {
      unsetenv("MLX_LATTICE_GEMM_SPLAT");
    }
    char* child_argv[] = {argv[0], const_cast<char*>(isa.c_str()), nullptr};
    pid_t pid;
#if defined(__linux__)
    const char* self = "/proc/self/exe";
#else
    const char* self = argv[0];
#endif
    if (posix_spawn(&pid, self, nullptr, nullptr, child_argv, environ) != 0) {
      std::perror("posix_spawn");
      return 1;
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) status_all = 1;
  }
  return status_all;
}
