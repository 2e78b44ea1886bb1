#include "gemm.h"

#include <algorithm>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_LATTICE_X86 1
#endif

namespace mlx_lattice {

namespace {

constexpr int kRows = 6;  // rows per register block

// Pads a partial block: extra rows read zeros and write to scratch.
struct Padding {
  std::vector<float> zeros;
  std::vector<float> sink;
  void fit(int64_t kdim, int64_t n) {
    if (static_cast<int64_t>(zeros.size()) < kdim) zeros.assign(kdim, 0.0f);
    if (static_cast<int64_t>(sink.size()) < n) sink.assign(n, 0.0f);
  }
};

thread_local Padding padding;

template <typename Block>
void for_each_block(int64_t m, const float* const* a_rows, int64_t kdim, int64_t n,
                    float* const* c_rows, Block&& block) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) block(a_rows + r, c_rows + r);
  if (r < m) {
    padding.fit(kdim, n);
    const float* a[kRows];
    float* c[kRows];
    for (int i = 0; i < kRows; ++i) {
      bool real = r + i < m;
      a[i] = real ? a_rows[r + i] : padding.zeros.data();
      c[i] = real ? c_rows[r + i] : padding.sink.data();
    }
    block(a, c);
  }
}

void block_scalar(const float* const* a, const float* b, int64_t kdim, int64_t n,
                  float* const* c) {
  for (int64_t n0 = 0; n0 < n; n0 += 16) {
    int64_t w = std::min<int64_t>(16, n - n0);
    float acc[kRows][16];
    for (int r = 0; r < kRows; ++r) {
      for (int64_t x = 0; x < w; ++x) acc[r][x] = c[r][n0 + x];
    }
    for (int64_t j = 0; j < kdim; ++j) {
      const float* bj = b + j * n + n0;
      for (int r = 0; r < kRows; ++r) {
        float av = a[r][j];
        for (int64_t x = 0; x < w; ++x) acc[r][x] += av * bj[x];
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int64_t x = 0; x < w; ++x) c[r][n0 + x] = acc[r][x];
    }
  }
}

#ifdef MLX_LATTICE_X86

__attribute__((target("avx2,fma"))) inline __m256i lane_mask(int64_t width) {
  alignas(32) static const int32_t ramp[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  __m256i idx = _mm256_load_si256(reinterpret_cast<const __m256i*>(ramp));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(width)), idx);
}

// One 6 x (8*V) block; MASKED handles a last column strip narrower than 8*V.
// Accumulators are named variables (an array of __m256 gets spilled to the
// stack on every iteration by GCC).
template <int V, bool MASKED>
__attribute__((target("avx2,fma"))) inline void strip_avx2(const float* const* a,
                                                            const float* b, int64_t kdim,
                                                            int64_t n, float* const* c,
                                                            int64_t n0, int64_t width) {
  const __m256i m0 = lane_mask(width);
  const __m256i m1 = lane_mask(width - 8);
  // (Macros, not lambdas: lambdas do not inherit the target attribute.)
#define load(p, v) (MASKED ? _mm256_maskload_ps((p), (v) == 0 ? m0 : m1) : _mm256_loadu_ps(p))
#define store(p, v, x)                                   \
  (MASKED ? _mm256_maskstore_ps((p), (v) == 0 ? m0 : m1, (x)) \
          : _mm256_storeu_ps((p), (x)))
  float* c0 = c[0] + n0;
  float* c1 = c[1] + n0;
  float* c2 = c[2] + n0;
  float* c3 = c[3] + n0;
  float* c4 = c[4] + n0;
  float* c5 = c[5] + n0;
  __m256 x00 = load(c0, 0), x10 = load(c1, 0), x20 = load(c2, 0);
  __m256 x30 = load(c3, 0), x40 = load(c4, 0), x50 = load(c5, 0);
  __m256 x01 = _mm256_setzero_ps(), x11 = x01, x21 = x01, x31 = x01, x41 = x01, x51 = x01;
  if constexpr (V == 2) {
    x01 = load(c0 + 8, 1), x11 = load(c1 + 8, 1), x21 = load(c2 + 8, 1);
    x31 = load(c3 + 8, 1), x41 = load(c4 + 8, 1), x51 = load(c5 + 8, 1);
  }
  const float* a0 = a[0];
  const float* a1 = a[1];
  const float* a2 = a[2];
  const float* a3 = a[3];
  const float* a4 = a[4];
  const float* a5 = a[5];
  const float* bj = b + n0;
  for (int64_t j = 0; j < kdim; ++j, bj += n) {
    const __m256 b0 = load(bj, 0);
    __m256 b1 = b0;
    if constexpr (V == 2) b1 = load(bj + 8, 1);
    __m256 s = _mm256_broadcast_ss(a0 + j);
    x00 = _mm256_fmadd_ps(s, b0, x00);
    if constexpr (V == 2) x01 = _mm256_fmadd_ps(s, b1, x01);
    s = _mm256_broadcast_ss(a1 + j);
    x10 = _mm256_fmadd_ps(s, b0, x10);
    if constexpr (V == 2) x11 = _mm256_fmadd_ps(s, b1, x11);
    s = _mm256_broadcast_ss(a2 + j);
    x20 = _mm256_fmadd_ps(s, b0, x20);
    if constexpr (V == 2) x21 = _mm256_fmadd_ps(s, b1, x21);
    s = _mm256_broadcast_ss(a3 + j);
    x30 = _mm256_fmadd_ps(s, b0, x30);
    if constexpr (V == 2) x31 = _mm256_fmadd_ps(s, b1, x31);
    s = _mm256_broadcast_ss(a4 + j);
    x40 = _mm256_fmadd_ps(s, b0, x40);
    if constexpr (V == 2) x41 = _mm256_fmadd_ps(s, b1, x41);
    s = _mm256_broadcast_ss(a5 + j);
    x50 = _mm256_fmadd_ps(s, b0, x50);
    if constexpr (V == 2) x51 = _mm256_fmadd_ps(s, b1, x51);
  }
  store(c0, 0, x00), store(c1, 0, x10), store(c2, 0, x20);
  store(c3, 0, x30), store(c4, 0, x40), store(c5, 0, x50);
  if constexpr (V == 2) {
    store(c0 + 8, 1, x01), store(c1 + 8, 1, x11), store(c2 + 8, 1, x21);
    store(c3 + 8, 1, x31), store(c4 + 8, 1, x41), store(c5 + 8, 1, x51);
  }
#undef load
#undef store
}

__attribute__((target("avx2,fma"))) void block_avx2(const float* const* a, const float* b,
                                                     int64_t kdim, int64_t n, float* const* c) {
  int64_t n0 = 0;
  for (; n0 + 16 <= n; n0 += 16) strip_avx2<2, false>(a, b, kdim, n, c, n0, 16);
  int64_t rest = n - n0;
  if (rest == 8) {
    strip_avx2<1, false>(a, b, kdim, n, c, n0, 8);
  } else if (rest > 8) {
    strip_avx2<2, true>(a, b, kdim, n, c, n0, rest);
  } else if (rest > 0) {
    strip_avx2<1, true>(a, b, kdim, n, c, n0, rest);
  }
}

// Outer-product accumulation over gathered rows, one R x (8*V) block of C
// (R <= 6): C[r0 + r][n0:] += sum_j f[j][r0 + r] * g[j][n0:].
template <int R, int V, bool MASKED>
__attribute__((target("avx2,fma"))) inline void outer_strip_avx2(
    int64_t m, const float* const* f, const float* const* g, int64_t r0, float* c, int64_t n,
    int64_t n0, int64_t width) {
  const __m256i m0 = lane_mask(width);
  const __m256i m1 = lane_mask(width - 8);
#define load(p, v) (MASKED ? _mm256_maskload_ps((p), (v) == 0 ? m0 : m1) : _mm256_loadu_ps(p))
#define store(p, v, x)                                        \
  (MASKED ? _mm256_maskstore_ps((p), (v) == 0 ? m0 : m1, (x)) \
          : _mm256_storeu_ps((p), (x)))
  float* cr[6];
  for (int r = 0; r < 6; ++r) cr[r] = c + (r0 + (r < R ? r : 0)) * n + n0;
  const __m256 zero = _mm256_setzero_ps();
  __m256 x00 = zero, x10 = zero, x20 = zero, x30 = zero, x40 = zero, x50 = zero;
  __m256 x01 = zero, x11 = zero, x21 = zero, x31 = zero, x41 = zero, x51 = zero;
#define ROW(i)                                               \
  if constexpr (R > i) {                                     \
    x##i##0 = load(cr[i], 0);                                \
    if constexpr (V == 2) x##i##1 = load(cr[i] + 8, 1);      \
  }
  ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
  for (int64_t j = 0; j < m; ++j) {
    const float* fj = f[j] + r0;
    const float* gj = g[j] + n0;
    const __m256 b0 = load(gj, 0);
    __m256 b1 = b0;
    if constexpr (V == 2) b1 = load(gj + 8, 1);
#define ROW(i)                                                          \
  if constexpr (R > i) {                                                \
    const __m256 s = _mm256_broadcast_ss(fj + i);                       \
    x##i##0 = _mm256_fmadd_ps(s, b0, x##i##0);                          \
    if constexpr (V == 2) x##i##1 = _mm256_fmadd_ps(s, b1, x##i##1);    \
  }
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
  }
#define ROW(i)                                               \
  if constexpr (R > i) {                                     \
    store(cr[i], 0, x##i##0);                                \
    if constexpr (V == 2) store(cr[i] + 8, 1, x##i##1);      \
  }
  ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
#undef load
#undef store
}

template <int R>
__attribute__((target("avx2,fma"))) void outer_avx2(int64_t m, const float* const* f,
                                                     const float* const* g, int64_t r0,
                                                     float* c, int64_t n) {
  int64_t n0 = 0;
  for (; n0 + 16 <= n; n0 += 16) outer_strip_avx2<R, 2, false>(m, f, g, r0, c, n, n0, 16);
  int64_t rest = n - n0;
  if (rest == 8) {
    outer_strip_avx2<R, 1, false>(m, f, g, r0, c, n, n0, 8);
  } else if (rest > 8) {
    outer_strip_avx2<R, 2, true>(m, f, g, r0, c, n, n0, rest);
  } else if (rest > 0) {
    outer_strip_avx2<R, 1, true>(m, f, g, r0, c, n, n0, rest);
  }
}

bool has_avx2() {
  static const bool value = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return value;
}

#endif

}  // namespace

void gemm_rows(int64_t m, const float* const* a_rows, const float* b, int64_t kdim, int64_t n,
               float* const* c_rows) {
  if (m <= 0 || n <= 0 || kdim <= 0) return;
#ifdef MLX_LATTICE_X86
  if (has_avx2()) {
    for_each_block(m, a_rows, kdim, n, c_rows,
                   [&](const float* const* a, float* const* c) { block_avx2(a, b, kdim, n, c); });
    return;
  }
#endif
  for_each_block(m, a_rows, kdim, n, c_rows,
                 [&](const float* const* a, float* const* c) { block_scalar(a, b, kdim, n, c); });
}

void gemm_outer(int64_t m, const float* const* f, const float* const* g, int64_t r0, int64_t r1,
                float* c, int64_t n) {
  if (m <= 0 || n <= 0) return;
  int64_t r = r0;
#ifdef MLX_LATTICE_X86
  if (has_avx2()) {
    for (; r + kRows <= r1; r += kRows) outer_avx2<6>(m, f, g, r, c, n);
    switch (r1 - r) {
      case 5: outer_avx2<5>(m, f, g, r, c, n); break;
      case 4: outer_avx2<4>(m, f, g, r, c, n); break;
      case 3: outer_avx2<3>(m, f, g, r, c, n); break;
      case 2: outer_avx2<2>(m, f, g, r, c, n); break;
      case 1: outer_avx2<1>(m, f, g, r, c, n); break;
      default: break;
    }
    return;
  }
#endif
  // Machines without AVX2: plain loops, same order.
  for (; r < r1; ++r) {
    float* cr = c + r * n;
    for (int64_t j = 0; j < m; ++j) {
      const float a = f[j][r];
      const float* gj = g[j];
      for (int64_t x = 0; x < n; ++x) cr[x] += a * gj[x];
    }
  }
}

const char* gemm_isa() {
#ifdef MLX_LATTICE_X86
  if (has_avx2()) return "avx2-fma";
#endif
  return "scalar";
}

}  // namespace mlx_lattice
