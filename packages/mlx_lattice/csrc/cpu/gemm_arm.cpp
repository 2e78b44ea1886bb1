#include "gemm_arm.h"

#include "isa.h"

#include <cmath>

#if defined(__aarch64__)
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif
#endif

namespace mlx_lattice::arm {

namespace {

#if defined(__aarch64__) && defined(__linux__)
// Bit numbers from the kernel's arch/arm64 uapi hwcap.h (stable ABI), spelled
// out so older libc headers still build.
constexpr unsigned long kHwcapAsimd = 1UL << 1;
constexpr unsigned long kHwcapAsimdhp = 1UL << 10;
constexpr unsigned long kHwcapAsimddp = 1UL << 20;
constexpr unsigned long kHwcapAsimdfhm = 1UL << 23;
constexpr unsigned long kHwcap2I8mm = 1UL << 13;
constexpr unsigned long kHwcap2Bf16 = 1UL << 14;
#endif

#if defined(__aarch64__) && defined(__APPLE__)
bool sysctl_flag(const char* name) {
  int value = 0;
  size_t size = sizeof(value);
  return sysctlbyname(name, &value, &size, nullptr, 0) == 0 && value != 0;
}
#endif

}  // namespace

Features cpu_features() {
  Features f;
#if defined(__aarch64__) && defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP);
  const unsigned long hw2 = getauxval(AT_HWCAP2);
  f.neon = (hw & kHwcapAsimd) != 0;
  f.fp16 = (hw & kHwcapAsimdhp) != 0;
  f.dotprod = (hw & kHwcapAsimddp) != 0;
  f.fhm = (hw & kHwcapAsimdfhm) != 0;
  f.bf16 = (hw2 & kHwcap2Bf16) != 0;
  f.i8mm = (hw2 & kHwcap2I8mm) != 0;
#elif defined(__aarch64__) && defined(__APPLE__)
  f.neon = true;  // every Apple arm64 CPU
  f.fp16 = sysctl_flag("hw.optional.arm.FEAT_FP16");
  f.dotprod = sysctl_flag("hw.optional.arm.FEAT_DotProd");
  f.fhm = sysctl_flag("hw.optional.arm.FEAT_FHM");
  f.bf16 = sysctl_flag("hw.optional.arm.FEAT_BF16");
  f.i8mm = sysctl_flag("hw.optional.arm.FEAT_I8MM");
#elif defined(__aarch64__)
  f.neon = true;
#endif
  return f;
}

const char* selected_isa() {
  // Usable: the CPU has it and MLX_LATTICE_GEMM_ISA's ceiling allows it.
  static const char* const name =
      isa::isa_usable(isa::Isa::kNeon) ? isa::isa_name(isa::Isa::kNeon) : nullptr;
  return name;
}

#if defined(__aarch64__)

namespace {

constexpr int kRows = 6;  // rows per register block: 6 x 16 fp32 = 24 of 32 q registers

// The multiplier of row r at step j: a[r][j] (rows) or f[j][r0 + r] (outer).
template <bool OUTER>
inline float lhs(const float* const* a, int64_t r0, int r, int64_t j) {
  return OUTER ? a[j][r0 + r] : a[r][j];
}

// One R x (4*V) block at column n0 (V <= 4). OUTER selects the addressing as
// in gemm.cpp's AVX-512 block: rows (b is (kdim, n)) or outer products over
// gathered rows g[j].
template <int R, int V, bool OUTER>
inline void block(const float* const* a, const float* b, const float* const* g, int64_t kdim,
                  int64_t n, int64_t r0, float* const* cr, int64_t n0) {
  float32x4_t acc[R][V];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = vld1q_f32(cr[r] + n0 + 4 * v);
  }
  for (int64_t j = 0; j < kdim; ++j) {
    const float* bj = OUTER ? g[j] + n0 : b + j * n + n0;
    float32x4_t bv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) bv[v] = vld1q_f32(bj + 4 * v);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const float s = lhs<OUTER>(a, r0, r, j);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = vfmaq_n_f32(acc[r][v], bv[v], s);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) vst1q_f32(cr[r] + n0 + 4 * v, acc[r][v]);
  }
}

// Columns [n0, n0 + width), width < 4: the same fused sequence in scalar FMAs.
template <int R, bool OUTER>
inline void tail(const float* const* a, const float* b, const float* const* g, int64_t kdim,
                 int64_t n, int64_t r0, float* const* cr, int64_t n0, int64_t width) {
  for (int r = 0; r < R; ++r) {
    for (int64_t x = n0; x < n0 + width; ++x) {
      float acc = cr[r][x];
      for (int64_t j = 0; j < kdim; ++j) {
        const float bx = OUTER ? g[j][x] : b[j * n + x];
        acc = std::fma(lhs<OUTER>(a, r0, r, j), bx, acc);
      }
      cr[r][x] = acc;
    }
  }
}

template <int R, bool OUTER>
void rows(const float* const* a, const float* b, const float* const* g, int64_t kdim, int64_t n,
          int64_t r0, float* const* cr) {
  int64_t n0 = 0;
  for (; n0 + 16 <= n; n0 += 16) block<R, 4, OUTER>(a, b, g, kdim, n, r0, cr, n0);
  const int64_t rest = n - n0;
  if (rest >= 12) {
    block<R, 3, OUTER>(a, b, g, kdim, n, r0, cr, n0);
    n0 += 12;
  } else if (rest >= 8) {
    block<R, 2, OUTER>(a, b, g, kdim, n, r0, cr, n0);
    n0 += 8;
  } else if (rest >= 4) {
    block<R, 1, OUTER>(a, b, g, kdim, n, r0, cr, n0);
    n0 += 4;
  }
  if (n0 < n) tail<R, OUTER>(a, b, g, kdim, n, r0, cr, n0, n - n0);
}

// Calls rows<R> for R = rows_left (1..6).
template <bool OUTER>
void rows_any(int rows_left, const float* const* a, const float* b, const float* const* g,
              int64_t kdim, int64_t n, int64_t r0, float* const* cr) {
  switch (rows_left) {
    case 6: rows<6, OUTER>(a, b, g, kdim, n, r0, cr); break;
    case 5: rows<5, OUTER>(a, b, g, kdim, n, r0, cr); break;
    case 4: rows<4, OUTER>(a, b, g, kdim, n, r0, cr); break;
    case 3: rows<3, OUTER>(a, b, g, kdim, n, r0, cr); break;
    case 2: rows<2, OUTER>(a, b, g, kdim, n, r0, cr); break;
    case 1: rows<1, OUTER>(a, b, g, kdim, n, r0, cr); break;
    default: break;
  }
}

}  // namespace

void gemm_rows(int64_t m, const float* const* a_rows, const float* b, int64_t kdim, int64_t n,
               float* const* c_rows) {
  if (m <= 0 || n <= 0 || kdim <= 0) return;
  for (int64_t r = 0; r < m; r += kRows) {
    const int left = static_cast<int>(m - r < kRows ? m - r : kRows);
    rows_any<false>(left, a_rows + r, b, nullptr, kdim, n, 0, c_rows + r);
  }
}

void gemm_outer(int64_t m, const float* const* f, const float* const* g, int64_t r0, int64_t r1,
                float* c, int64_t n) {
  if (m <= 0 || n <= 0) return;
  float* cr[kRows];
  for (int64_t r = r0; r < r1; r += kRows) {
    const int left = static_cast<int>(r1 - r < kRows ? r1 - r : kRows);
    for (int i = 0; i < left; ++i) cr[i] = c + (r + i) * n;
    rows_any<true>(left, f, nullptr, g, m, n, r, cr);
  }
}

#endif  // __aarch64__

}  // namespace mlx_lattice::arm
