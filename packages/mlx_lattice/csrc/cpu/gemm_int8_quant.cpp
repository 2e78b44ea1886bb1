// Per-row symmetric int8 quantization of activations (gemm_int8.h): the
// scalar definition and its AVX-512 and AVX2 forms, same values on all.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_LATTICE_X86 1
#endif

#include "avx2_lanes.h"
#include "gemm_int8.h"
#include "isa.h"
#include "parallel.h"

// GCC 12 reports the undefined pass-through operand of _mm512_max_ps /
// _mm512_min_ps's own builtins as "maybe uninitialized"; it is not read.
#if defined(__GNUC__) && !defined(__clang__)  // clang has no such group (macOS check)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace mlx_lattice::kernels {

namespace {

// One row of quantize_rows_int8; the scalar definition of the math.
// fixed > 0: the static scale (the row's reported scale is then 1).
void quantize_row_scalar(const float* xr, int64_t c, int64_t stride, int64_t group, int8_t* qr,
                         float* scale, int32_t* gr, float fixed) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < c; ++i) {
    finite = finite && std::isfinite(xr[i]);
    amax = std::max(amax, std::fabs(xr[i]));
  }
  std::memset(qr, 0, stride);
  std::fill(gr, gr + stride / group, 0);
  if (!finite) {
    *scale = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float s = fixed > 0.0f ? fixed : amax / 127.0f;
  *scale = fixed > 0.0f ? 1.0f : s;
  if (s == 0.0f) return;  // all zero (or a scale below the float range): q = 0
  for (int64_t i = 0; i < c; ++i) {
    // Clamped before converting (|x / s| may exceed 127: rounding, or a
    // static scale); rint and clamping to integers commute.
    const float v = std::nearbyint(std::clamp(xr[i] / s, -127.0f, 127.0f));
    qr[i] = static_cast<int8_t>(v);
    gr[i / group] += qr[i];
  }
}

#ifdef MLX_LATTICE_X86
// A row of whole vectors with a static scale in one pass (no maximum to
// find first): the codes and sums as quantize_row_avx512 computes them,
// non-finite values noted on the way; such a row is then cleared (its
// codes 0, scale NaN), as the scalar path leaves it.
__attribute__((target("avx512f"))) void quantize_row_static_avx512(
    const float* xr, int64_t c, int64_t stride, int64_t group, int8_t* qr, float* scale,
    int32_t* gr, float fixed) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512 vs = _mm512_set1_ps(fixed);
  const __m512 lo = _mm512_set1_ps(-127.0f);
  const __m512 hi = _mm512_set1_ps(127.0f);
  __mmask16 bad = 0;
  if (stride > c) std::memset(qr + c, 0, stride - c);
  std::fill(gr, gr + stride / group, 0);
  for (int64_t g0 = 0; g0 < c; g0 += group) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = g0; i < std::min(c, g0 + group); i += 16) {
      const __m512 x = _mm512_loadu_ps(xr + i);
      bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), zero, _CMP_UNORD_Q);
      // max/min return the bound for a NaN quotient: no conversion of NaN.
      const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(x, vs), lo), hi);
      const __m512i q = _mm512_cvtps_epi32(v);
      sum = _mm512_add_epi32(sum, q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + i), _mm512_cvtepi32_epi8(q));
    }
    gr[g0 / group] = _mm512_reduce_add_epi32(sum);
  }
  *scale = 1.0f;
  if (bad) {
    std::memset(qr, 0, c);
    std::fill(gr, gr + stride / group, 0);
    *scale = std::numeric_limits<float>::quiet_NaN();
  }
}

// The same row with AVX-512 (16 channels per step; group is a multiple of 16
// on this path, so a step never straddles two groups). Division, rounding
// to nearest even (the default MXCSR mode, as nearbyint) and clamping give
// the scalar path's values; the group sums are exact integer sums in any
// order.
__attribute__((target("avx512f"))) void quantize_row_avx512(
    const float* xr, int64_t c, int64_t stride, int64_t group, int8_t* qr, float* scale,
    int32_t* gr, float fixed) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 vmax = zero;
  __mmask16 bad = 0;
  auto mask = [c](int64_t i) {
    return c - i >= 16 ? static_cast<__mmask16>(0xffff)
                       : static_cast<__mmask16>((1u << (c - i)) - 1u);
  };
  if (fixed > 0.0f && c % 16 == 0) {
    quantize_row_static_avx512(xr, c, stride, group, qr, scale, gr, fixed);
    return;
  }
  for (int64_t i = 0; i < c; i += 16) {
    const __m512 x = _mm512_maskz_loadu_ps(mask(i), xr + i);
    bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), zero, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(x));
  }
  if (stride > c) std::memset(qr + c, 0, stride - c);
  std::fill(gr, gr + stride / group, 0);
  const float s = fixed > 0.0f ? fixed : _mm512_reduce_max_ps(vmax) / 127.0f;
  if (bad || s == 0.0f) {
    std::memset(qr, 0, c);
    *scale = bad ? std::numeric_limits<float>::quiet_NaN() : s;
    return;
  }
  *scale = fixed > 0.0f ? 1.0f : s;
  const __m512 vs = _mm512_set1_ps(s);
  const __m512 lo = _mm512_set1_ps(-127.0f);
  const __m512 hi = _mm512_set1_ps(127.0f);
  if (c % 16 == 0) {
    // Whole vectors: no masks, and each vector's 16 codes narrowed in a
    // register and stored as 16 bytes (not a masked narrowing store).
    for (int64_t g0 = 0; g0 < c; g0 += group) {
      __m512i sum = _mm512_setzero_si512();
      for (int64_t i = g0; i < std::min(c, g0 + group); i += 16) {
        const __m512 x = _mm512_loadu_ps(xr + i);
        const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(x, vs), lo), hi);
        const __m512i q = _mm512_cvtps_epi32(v);
        sum = _mm512_add_epi32(sum, q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + i), _mm512_cvtepi32_epi8(q));
      }
      gr[g0 / group] = _mm512_reduce_add_epi32(sum);
    }
    return;
  }
  for (int64_t g0 = 0; g0 < c; g0 += group) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = g0; i < std::min(c, g0 + group); i += 16) {
      const __mmask16 m = mask(i);
      const __m512 x = _mm512_maskz_loadu_ps(m, xr + i);
      // Clamped in float first: a quotient beyond the int32 range would
      // convert to INT_MIN.
      const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(x, vs), lo), hi);
      const __m512i q = _mm512_maskz_mov_epi32(m, _mm512_cvtps_epi32(v));
      sum = _mm512_add_epi32(sum, q);
      _mm512_mask_cvtepi32_storeu_epi8(qr + i, m, q);
    }
    gr[g0 / group] = _mm512_reduce_add_epi32(sum);
  }
}

// The same row with AVX2 (8 channels per step; c and group are multiples of
// 8 on this path): the values of quantize_row_avx512, by the same
// operations. With a static scale, one pass that notes non-finite values on
// the way (such a row is then cleared, as the scalar path leaves it).
__attribute__((target("avx2,fma"))) void quantize_row_avx2(const float* xr, int64_t c,
                                                           int64_t stride, int64_t group,
                                                           int8_t* qr, float* scale, int32_t* gr,
                                                           float fixed) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 bad = zero;  // lanes that saw a non-finite value (all bits set)
  float s = fixed;
  if (!(fixed > 0.0f)) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = zero;
    for (int64_t i = 0; i < c; i += 8) {
      const __m256 x = _mm256_loadu_ps(xr + i);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(x, x), zero, _CMP_UNORD_Q));
      vmax = _mm256_max_ps(vmax, _mm256_and_ps(x, magnitude));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    s = _mm_cvtss_f32(m) / 127.0f;
  }
  if (stride > c) std::memset(qr + c, 0, stride - c);
  std::fill(gr, gr + stride / group, 0);
  if (_mm256_movemask_ps(bad) != 0 || s == 0.0f) {
    std::memset(qr, 0, c);
    *scale = _mm256_movemask_ps(bad) != 0 ? std::numeric_limits<float>::quiet_NaN() : s;
    return;
  }
  *scale = fixed > 0.0f ? 1.0f : s;
  const __m256 vs = _mm256_set1_ps(s);
  const __m256 lo = _mm256_set1_ps(-127.0f);
  const __m256 hi = _mm256_set1_ps(127.0f);
  for (int64_t g0 = 0; g0 < c; g0 += group) {
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = g0; i < std::min(c, g0 + group); i += 8) {
      const __m256 x = _mm256_loadu_ps(xr + i);
      if (fixed > 0.0f) {
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(x, x), zero, _CMP_UNORD_Q));
      }
      // max/min return the bound for a NaN quotient: no conversion of NaN.
      const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(x, vs), lo), hi);
      const __m256i q = _mm256_cvtps_epi32(v);
      sum = _mm256_add_epi32(sum, q);
      store_bytes8(qr + i, q);
    }
    gr[g0 / group] = sum_lanes(sum);
  }
  if (_mm256_movemask_ps(bad) != 0) {  // static scale: a non-finite value seen
    std::memset(qr, 0, c);
    std::fill(gr, gr + stride / group, 0);
    *scale = std::numeric_limits<float>::quiet_NaN();
  }
}
#endif

}  // namespace

void quantize_rows_int8(const float* x, int64_t n, int64_t c, int64_t stride, int64_t group,
                        int8_t* q, float* scale, int32_t* gsum, float static_scale,
                        uint8_t* nonneg) {
  constexpr int64_t kChunk = 1024;
  const int64_t groups = stride / group;
  auto row = quantize_row_scalar;
#ifdef MLX_LATTICE_X86
  if (group % 16 == 0 && isa::isa_usable(isa::Isa::kAvx512)) {
    row = quantize_row_avx512;
  } else if (group % 8 == 0 && c % 8 == 0 && isa::isa_usable(isa::Isa::kAvx2)) {
    row = quantize_row_avx2;
  }
#endif
  parallel_for(ceil_div(n, kChunk), [&](int64_t chunk) {
    const int64_t r1 = std::min(n, (chunk + 1) * kChunk);
    // One streaming pass over the features: rows kAhead ahead are requested
    // now (the pass is otherwise bound by the latency of each row's first
    // load, far below the memory bandwidth).
    constexpr int64_t kAhead = 8;
    const int64_t r0 = chunk * kChunk;
    auto prefetch_row = [&](int64_t r) {
      if (r < r1) prefetch_lines(x + r * c, c * 4);
    };
    for (int64_t r = r0; r < r0 + kAhead; ++r) prefetch_row(r);
    for (int64_t r = r0; r < r1; ++r) {
      prefetch_row(r + kAhead);
      row(x + r * c, c, stride, group, q + r * stride, scale + r, gsum + r * groups,
          static_scale);
      if (nonneg != nullptr) nonneg[r] = codes_nonneg(q + r * stride, c);
    }
  });
}

}  // namespace mlx_lattice::kernels
