// The integer convolution's fused epilogue (gemm_int8.h: Int8Epilogue) and
// the loading of int8 input rows: the scalar definition and its AVX-512
// form, the same values on both.
#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_LATTICE_X86 1
#endif

#include "avx2_lanes.h"
#include "gemm_int8.h"
#include "isa.h"
#include "parallel.h"

// GCC 12 reports the undefined pass-through operands of some AVX-512
// builtins as "maybe uninitialized"; they are not read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace mlx_lattice::kernels {

namespace {

// A value the compiler may not fuse with the next operation (no FMA): every
// path rounds after each product and each sum, as the documented math.
#if defined(__aarch64__)
#define MLX_LATTICE_EPI_ROUNDED(v) asm("" : "+w"(v))
#elif defined(MLX_LATTICE_X86)
#define MLX_LATTICE_EPI_ROUNDED(v) asm("" : "+x"(v))
#else
#define MLX_LATTICE_EPI_ROUNDED(v) static_cast<void>(v)
#endif

// y = acc + bias; + residual; relu, on one row of n values (the scalar
// definition). bias: ep.bias from the row's first column on; res: the
// row's float32 residual, rq: its int8 residual.
void epilogue_row_scalar(float* y, int64_t n, const Int8Epilogue& ep, const float* bias,
                         const float* res, const int8_t* rq) {
  for (int64_t x = 0; x < n; ++x) {
    float v = y[x];
    if (bias != nullptr) v = v + bias[x];
    if (res != nullptr) v = v + res[x];
    if (rq != nullptr) {
      float r = static_cast<float>(rq[x]) * ep.residual_scale;
      MLX_LATTICE_EPI_ROUNDED(r);
      v = v + r;
    }
    if (ep.relu && v < 0.0f) v = 0.0f;
    y[x] = v;
  }
}

// q = clamp(rint(y / s), -127, 127), NaN -> 0 (rint: nearest even, the
// default rounding mode, as quantize_rows_int8).
void requantize_row_scalar(const float* y, int64_t n, float s, int8_t* q) {
  for (int64_t x = 0; x < n; ++x) {
    const float v = y[x] / s;
    q[x] = std::isnan(v) ? int8_t{0}
                         : static_cast<int8_t>(std::nearbyint(std::clamp(v, -127.0f, 127.0f)));
  }
}

// One int8 row of load_rows_int8 (the scalar definition): codes with -128
// read as -127, and their sums per group (gr zeroed by the caller).
void load_row_scalar(const int8_t* xr, int64_t c, int64_t group, int8_t* qr, int32_t* gr) {
  for (int64_t i = 0; i < c; ++i) {
    const int8_t v = std::max<int8_t>(xr[i], -127);
    qr[i] = v;
    gr[i / group] += v;
  }
}

#ifdef MLX_LATTICE_X86
// The same row, 16 codes per step (c and group multiples of 16): exact
// integer sums in another order, the same values.
__attribute__((target("avx512f"))) void load_row_avx512(const int8_t* xr, int64_t c,
                                                        int64_t group, int8_t* qr, int32_t* gr) {
  const __m512i lo = _mm512_set1_epi32(-127);
  for (int64_t g0 = 0; g0 < c; g0 += group) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = g0; i < std::min(c, g0 + group); i += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xr + i));
      const __m512i v = _mm512_max_epi32(_mm512_cvtepi8_epi32(b), lo);
      sum = _mm512_add_epi32(sum, v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + i), _mm512_cvtepi32_epi8(v));
    }
    gr[g0 / group] = _mm512_reduce_add_epi32(sum);
  }
}

__attribute__((target("avx512f"))) void epilogue_row_avx512(float* y, int64_t n,
                                                            const Int8Epilogue& ep,
                                                            const float* bias, const float* res,
                                                            const int8_t* rq) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512 rs = _mm512_set1_ps(ep.residual_scale);
  for (int64_t x = 0; x < n; x += 16) {
    const __mmask16 m = n - x >= 16 ? static_cast<__mmask16>(0xffff)
                                    : static_cast<__mmask16>((1u << (n - x)) - 1u);
    __m512 v = _mm512_maskz_loadu_ps(m, y + x);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + x));
    if (res != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, res + x));
    if (rq != nullptr) {
      // (A tail's bytes through a local: byte-masked loads need AVX-512BW.)
      alignas(16) int8_t tail[16] = {};
      const int8_t* src = rq + x;
      if (n - x < 16) {
        std::memcpy(tail, src, static_cast<size_t>(n - x));
        src = tail;
      }
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      __m512 r = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), rs);
      MLX_LATTICE_EPI_ROUNDED(r);
      v = _mm512_add_ps(v, r);
    }
    if (ep.relu) v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ), zero);
    _mm512_mask_storeu_ps(y + x, m, v);
  }
}

__attribute__((target("avx512f"))) void requantize_row_avx512(const float* y, int64_t n, float s,
                                                              int8_t* q) {
  const __m512 vs = _mm512_set1_ps(s);
  const __m512 lo = _mm512_set1_ps(-127.0f);
  const __m512 hi = _mm512_set1_ps(127.0f);
  for (int64_t x = 0; x < n; x += 16) {
    const __mmask16 m = n - x >= 16 ? static_cast<__mmask16>(0xffff)
                                    : static_cast<__mmask16>((1u << (n - x)) - 1u);
    const __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(m, y + x), vs);
    const __mmask16 number = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
    // max/min return the bound for NaN; NaN lanes are then zeroed.
    const __m512 c = _mm512_maskz_mov_ps(number, _mm512_min_ps(_mm512_max_ps(v, lo), hi));
    _mm512_mask_cvtepi32_storeu_epi8(q + x, m, _mm512_cvtps_epi32(c));
  }
}

// AVX2 (8 lanes per step) with the same operations; a row's last n % 8
// values go through the scalar definition (no masked stores: microcoded
// on AMD Zen cores, avx2_lanes.h).
__attribute__((target("avx2"))) void load_row_avx2(const int8_t* xr, int64_t c, int64_t group,
                                                   int8_t* qr, int32_t* gr) {
  const __m128i lo = _mm_set1_epi8(-127);
  for (int64_t g0 = 0; g0 < c; g0 += group) {
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = g0; i < std::min(c, g0 + group); i += 8) {
      const __m128i v = _mm_max_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(xr + i)), lo);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(qr + i), v);
      sum = _mm256_add_epi32(sum, _mm256_cvtepi8_epi32(v));
    }
    gr[g0 / group] = sum_lanes(sum);
  }
}

__attribute__((target("avx2"))) void epilogue_row_avx2(float* y, int64_t n,
                                                       const Int8Epilogue& ep, const float* bias,
                                                       const float* res, const int8_t* rq) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 rs = _mm256_set1_ps(ep.residual_scale);
  int64_t x = 0;
  for (; x + 8 <= n; x += 8) {
    __m256 v = _mm256_loadu_ps(y + x);
    if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + x));
    if (res != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(res + x));
    if (rq != nullptr) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rq + x));
      __m256 r = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), rs);
      MLX_LATTICE_EPI_ROUNDED(r);
      v = _mm256_add_ps(v, r);
    }
    // -0 and NaN stay, as v < 0 is false for them.
    if (ep.relu) v = _mm256_andnot_ps(_mm256_cmp_ps(v, zero, _CMP_LT_OQ), v);
    _mm256_storeu_ps(y + x, v);
  }
  if (x < n) {
    epilogue_row_scalar(y + x, n - x, ep, bias != nullptr ? bias + x : nullptr,
                        res != nullptr ? res + x : nullptr, rq != nullptr ? rq + x : nullptr);
  }
}

__attribute__((target("avx2"))) void requantize_row_avx2(const float* y, int64_t n, float s,
                                                         int8_t* q) {
  const __m256 vs = _mm256_set1_ps(s);
  const __m256 lo = _mm256_set1_ps(-127.0f);
  const __m256 hi = _mm256_set1_ps(127.0f);
  int64_t x = 0;
  for (; x + 8 <= n; x += 8) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(y + x), vs);
    const __m256 number = _mm256_cmp_ps(v, v, _CMP_ORD_Q);
    // max/min return the bound for NaN; NaN lanes are then zeroed. The
    // conversion rounds to nearest even (the default MXCSR mode, as rint).
    const __m256 c = _mm256_and_ps(number, _mm256_min_ps(_mm256_max_ps(v, lo), hi));
    store_bytes8(q + x, _mm256_cvtps_epi32(c));
  }
  if (x < n) requantize_row_scalar(y + x, n - x, s, q + x);
}
#endif

}  // namespace

void load_rows_int8(const int8_t* x, int64_t n, int64_t c, int64_t stride, int64_t group,
                    int8_t* q, float* scale, int32_t* gsum, uint8_t* nonneg) {
  const int64_t groups = stride / group;
  auto row = load_row_scalar;
#ifdef MLX_LATTICE_X86
  if (c % 16 == 0 && group % 16 == 0 && isa::isa_usable(isa::Isa::kAvx512)) {
    row = load_row_avx512;
  } else if (c % 8 == 0 && group % 8 == 0 && isa::isa_usable(isa::Isa::kAvx2)) {
    row = load_row_avx2;
  }
#endif
  constexpr int64_t kChunk = 1024;
  parallel_for(ceil_div(n, kChunk), [&](int64_t chunk) {
    const int64_t r1 = std::min(n, (chunk + 1) * kChunk);
    for (int64_t r = chunk * kChunk; r < r1; ++r) {
      int8_t* qr = q + r * stride;
      int32_t* gr = gsum + r * groups;
      std::fill(gr, gr + groups, 0);
      row(x + r * c, c, group, qr, gr);
      if (stride > c) std::memset(qr + c, 0, stride - c);
      scale[r] = 1.0f;
      if (nonneg != nullptr) nonneg[r] = codes_nonneg(qr, c);
    }
  });
}

void int8_epilogue_rows(float* acc, int64_t r0, int64_t r1, int64_t cout, const Int8Epilogue& ep,
                        void* out) {
  auto row_fn = epilogue_row_scalar;
  auto requantize = requantize_row_scalar;
#ifdef MLX_LATTICE_X86
  if (isa::isa_usable(isa::Isa::kAvx512)) {
    row_fn = epilogue_row_avx512;
    requantize = requantize_row_avx512;
  } else if (isa::isa_usable(isa::Isa::kAvx2)) {
    row_fn = epilogue_row_avx2;
    requantize = requantize_row_avx2;
  }
#endif
  const auto* res = ep.residual_int8 ? nullptr : static_cast<const float*>(ep.residual);
  const auto* rq = ep.residual_int8 ? static_cast<const int8_t*>(ep.residual) : nullptr;
  for (int64_t r = r0; r < r1; ++r) {
    float* y = acc + (r - r0) * cout;
    row_fn(y, cout, ep, ep.bias, res != nullptr ? res + r * cout : nullptr,
           rq != nullptr ? rq + r * cout : nullptr);
    if (out == nullptr) continue;  // a float32 output finished in place
    if (ep.out_scale > 0.0f) {
      requantize(y, cout, ep.out_scale, static_cast<int8_t*>(out) + r * cout);
    } else if (ep.out_format == FloatFormat::kF32) {
      std::memcpy(static_cast<float*>(out) + r * cout, y, sizeof(float) * cout);
    } else {
      convert_from_float32(y, cout, ep.out_format, static_cast<uint16_t*>(out) + r * cout);
    }
  }
}

}  // namespace mlx_lattice::kernels
