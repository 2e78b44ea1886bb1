// Partial AVX2 vector stores without vmaskmovps, whose store form is
// microcoded on AMD Zen cores (a C64 -> C14 head's masked column strip ran
// at half the speed of the same head padded to 16 columns on a Zen 3 host),
// and the int8 kernels' lane narrowing and lane sum.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <cstdint>

namespace mlx_lattice::kernels {

// Stores lanes [0, width) of x at p: all 8 where width >= 8, none where
// width <= 0; else at most one 4-, one 2- and one 1-lane store.
__attribute__((target("avx2"))) inline void store_lanes(float* p, __m256 x, int64_t width) {
  if (width >= 8) {
    _mm256_storeu_ps(p, x);
    return;
  }
  __m128 part = _mm256_castps256_ps128(x);
  if (width >= 4) {
    _mm_storeu_ps(p, part);
    part = _mm256_extractf128_ps(x, 1);
    p += 4;
    width -= 4;
  }
  if (width >= 2) {
    _mm_storel_pi(reinterpret_cast<__m64*>(p), part);
    part = _mm_movehl_ps(part, part);
    p += 2;
    width -= 2;
  }
  if (width >= 1) _mm_store_ss(p, part);
}

// Stores the 8 int32 lanes of q, each in [-128, 127], as 8 bytes at p (no
// saturation needed: byte 0 of each lane, in lane order).
__attribute__((target("avx2"))) inline void store_bytes8(int8_t* p, __m256i q) {
  const __m256i bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         -1, -1);
  const __m256i halves = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
  const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(q, bytes), halves);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// The sum of the 8 int32 lanes of x (wrapping, as int32 adds).
__attribute__((target("avx2"))) inline int32_t sum_lanes(__m256i x) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 1));
  return _mm_cvtsi128_si32(t);
}

}  // namespace mlx_lattice::kernels

#endif
