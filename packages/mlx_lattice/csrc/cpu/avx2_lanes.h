// Partial AVX2 vector stores without vmaskmovps, whose store form is
// microcoded on AMD Zen cores (a C64 -> C14 head's masked column strip ran
// at half the speed of the same head padded to 16 columns on a Zen 3 host).
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

}  // namespace mlx_lattice::kernels

#endif
