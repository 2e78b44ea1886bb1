#include "float_formats.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_LATTICE_X86 1
#endif

#include "parallel.h"

namespace mlx_lattice::kernels {

namespace {

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400u)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf / nan
    return sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf
  if (abs < 0x38800000u) {                          // subnormal or zero in half
    if (abs < 0x33000000u) return sign;
    const uint32_t exp = abs >> 23;
    const uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14..24
    uint32_t half_man = man >> shift;
    const uint32_t rest = man & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half_man & 1u))) ++half_man;
    return sign | static_cast<uint16_t>(half_man);
  }
  uint32_t bits = abs - 0x38000000u;  // rebias exponent
  const uint32_t rest = bits & 0x1fffu;
  uint32_t half = bits >> 13;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return sign | static_cast<uint16_t>(half);
}

float bfloat_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void half_row_to_float(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i]);
}

void bfloat_row_to_float(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bfloat_to_float(src[i]);
}

uint16_t float_to_bfloat(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

#ifdef MLX_LATTICE_X86
__attribute__((target("avx2,f16c"))) void half_block_to_float(const uint16_t* src, int64_t n,
                                                              float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

__attribute__((target("avx2,f16c"))) void float_block_to_half(const float* src, int64_t n,
                                                              uint16_t* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = float_to_half(src[i]);
}

// float32 -> bfloat16 as float_to_bfloat, 8 values at a time: nearest
// even by adding 0x7fff plus the kept part's lowest bit; a NaN keeps its
// upper 16 bits with the quiet bit set.
__attribute__((target("avx2"))) void float_block_to_bfloat(const float* src, int64_t n,
                                                           uint16_t* dst) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i bias = _mm256_set1_epi32(0x7fff);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i quiet = _mm256_set1_epi32(0x40);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i high = _mm256_srli_epi32(x, 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, magnitude), inf);
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(x, bias), _mm256_and_si256(high, one)), 16);
    const __m256i v = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, quiet), nan);
    // 8 x 32 -> 8 x 16 bits (values below 2^16: no saturation), in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
  }
  for (; i < n; ++i) dst[i] = float_to_bfloat(src[i]);
}

// bfloat16 -> float32, 8 values at a time: the 16 bits above 16 zero bits.
__attribute__((target("avx2"))) void bfloat_block_to_float(const uint16_t* src, int64_t n,
                                                           float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i x = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), x);
  }
  for (; i < n; ++i) dst[i] = bfloat_to_float(src[i]);
}

bool has_f16c() {
  static const bool value = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return value;
}

bool has_avx2() {
  static const bool value = __builtin_cpu_supports("avx2");
  return value;
}
#endif

constexpr int64_t kConvertChunk = 1 << 16;

}  // namespace

void convert_to_float32(const void* src, FloatFormat format, int64_t n, float* dst) {
  if (format == FloatFormat::kF32) {
    std::memcpy(dst, src, sizeof(float) * n);
    return;
  }
  row_to_float32(format)(static_cast<const uint16_t*>(src), n, dst);
}

RowToFloat32 row_to_float32(FloatFormat format) {
  if (format == FloatFormat::kBF16) {
#ifdef MLX_LATTICE_X86
    if (has_avx2()) return bfloat_block_to_float;
#endif
    return bfloat_row_to_float;
  }
#ifdef MLX_LATTICE_X86
  if (has_f16c()) return half_block_to_float;
#endif
  return half_row_to_float;
}

void convert_from_float32(const float* src, int64_t n, FloatFormat format, void* dst) {
  if (format == FloatFormat::kF32) {
    std::memcpy(dst, src, sizeof(float) * n);
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst);
  if (format == FloatFormat::kBF16) {
#ifdef MLX_LATTICE_X86
    if (has_avx2()) {
      float_block_to_bfloat(src, n, d);
      return;
    }
#endif
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_bfloat(src[i]);
    return;
  }
#ifdef MLX_LATTICE_X86
  if (has_f16c()) {
    float_block_to_half(src, n, d);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) d[i] = float_to_half(src[i]);
}

void to_float32(const void* src, FloatFormat format, int64_t n, float* dst) {
  const int64_t width = format == FloatFormat::kF32 ? 4 : 2;
  parallel_for(ceil_div(n, kConvertChunk), [&](int64_t chunk) {
    const int64_t i0 = chunk * kConvertChunk;
    const int64_t i1 = std::min(n, i0 + kConvertChunk);
    convert_to_float32(static_cast<const char*>(src) + i0 * width, format, i1 - i0, dst + i0);
  });
}

void from_float32(const float* src, int64_t n, FloatFormat format, void* dst) {
  const int64_t width = format == FloatFormat::kF32 ? 4 : 2;
  parallel_for(ceil_div(n, kConvertChunk), [&](int64_t chunk) {
    const int64_t i0 = chunk * kConvertChunk;
    const int64_t i1 = std::min(n, i0 + kConvertChunk);
    convert_from_float32(src + i0, i1 - i0, format, static_cast<char*>(dst) + i0 * width);
  });
}

}  // namespace mlx_lattice::kernels
