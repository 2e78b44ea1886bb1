// The half-precision forward tile driver: see conv_forward_half.h.
#include "conv_forward_half.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_LATTICE_X86 1
#endif

#include "gemm.h"
#include "isa.h"
#include "line_vector.h"
#include "output_window.h"
#include "parallel.h"
#include "float_formats.h"
#include "tiles.h"

namespace mlx_lattice::kernels {

namespace {

// Per-thread scratch of the tile loop, reused across tiles and calls: one
// bucket of tile_rows (A row, C row) pointer pairs per offset (offset k's
// edges are [k * cap, k * cap + count[k]), in CSR order), and the tile's
// float32 output rows.
struct Scratch {
  std::vector<const uint16_t*> a_ptrs;
  std::vector<float*> c_ptrs;
  std::vector<int32_t> count;
  LineVector<float> tile;
};

thread_local Scratch scratch;

using RoundFn = void (*)(const float* src, int64_t n, uint16_t* dst);

#ifdef MLX_LATTICE_X86
// All 16 lanes. The zero-masked forms of the conversions give the same
// values as the plain ones, whose undefined pass-through operand GCC 12
// reports as "may be used uninitialized".
constexpr __mmask16 kAll = 0xffff;

// float32 -> float16, nearest even (vcvtps2ph, the F16C rounding of
// from_float32), 16 values at a time.
__attribute__((target("avx512f"))) void round_f16_avx512(const float* src, int64_t n,
                                                         uint16_t* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h =
        _mm512_maskz_cvtps_ph(kAll, _mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
  if (i < n) convert_from_float32(src + i, n - i, FloatFormat::kF16, dst + i);
}

// float16 -> float32 of n values (exact), 16 per vcvtph2ps, the tail
// through a zero-padded copy and a masked store.
__attribute__((target("avx512f"))) void widen_f16_avx512(const uint16_t* src, int64_t n,
                                                         float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_maskz_cvtph_ps(kAll, h));
  }
  if (i < n) {
    alignas(32) uint16_t rest[16] = {};
    std::memcpy(rest, src + i, sizeof(uint16_t) * (n - i));
    const __m512 v =
        _mm512_maskz_cvtph_ps(kAll, _mm256_load_si256(reinterpret_cast<const __m256i*>(rest)));
    _mm512_mask_storeu_ps(dst + i, static_cast<__mmask16>((1u << (n - i)) - 1u), v);
  }
}

#endif

}  // namespace

WidenRow row_widener(FloatFormat format) {
#ifdef MLX_LATTICE_X86
  if (format == FloatFormat::kF16 && isa::isa_usable(isa::Isa::kAvx512)) return widen_f16_avx512;
#endif
  // The converter itself, chosen once per call (not per row).
  return row_to_float32(format);
}

void half_rows_forward(const uint16_t* feats, FloatFormat format, int64_t cin,
                       const float* weight, int64_t n_kernels, int64_t cout, const Csr& csr,
                       const int32_t* a_index, const int32_t* kernel_ids, uint16_t* out,
                       int64_t tile_rows) {
  const WidenRow widen = row_widener(format);
  RoundFn round = nullptr;
#ifdef MLX_LATTICE_X86
  if (format == FloatFormat::kF16 && isa::isa_usable(isa::Isa::kAvx512)) round = round_f16_avx512;
#endif
  const int64_t w_stride = cin * cout;
  parallel_for_windows(csr.groups, tile_rows, [&](int64_t g0, int64_t g1) {
    const int64_t cap = g1 - g0;
    auto& s = this_thread(scratch);
    float* const c = window_buffer(s.tile, cap * cout);
    std::memset(c, 0, sizeof(float) * cap * cout);
    // The tile's output lines, requested a share per offset while its GEMMs
    // run, so that the rounding below does not wait on them.
    uint16_t* const out_tile = out + g0 * cout;
    const int64_t out_bytes = cap * cout * 2;
    const int64_t out_step = ceil_div(ceil_div(out_bytes, 64), n_kernels) * 64;
    if (csr.offsets[g1] > csr.offsets[g0]) {
      fit_buckets(n_kernels * cap, s.a_ptrs, s.c_ptrs);
      s.count.resize(n_kernels);
      const uint16_t** a_ptrs = s.a_ptrs.data();
      float** c_ptrs = s.c_ptrs.data();
      int32_t* count = s.count.data();
      bucket_row_pointers(csr, g0, g1, kernel_ids, n_kernels, count, feats, a_index, cin, c, cout,
                          a_ptrs, c_ptrs);
      const char* out_lines = reinterpret_cast<const char*>(out_tile);
      for (int64_t k = 0; k < n_kernels; ++k) {
        const int64_t b1 = std::min(out_bytes, (k + 1) * out_step);
        for (int64_t b = k * out_step; b < b1; b += 64) __builtin_prefetch(out_lines + b, 1);
        if (count[k] > 0) {
          if (!gemm_rows_half(count[k], a_ptrs + k * cap, format == FloatFormat::kBF16,
                              weight + k * w_stride, cin, cout, c_ptrs + k * cap)) {
            gemm_rows_widened(count[k], a_ptrs + k * cap, widen, weight + k * w_stride, cin,
                              cout, c_ptrs + k * cap);
          }
        }
      }
    }
    if (round) {
      round(c, cap * cout, out_tile);
    } else {
      convert_from_float32(c, cap * cout, format, out_tile);
    }
  });
}

}  // namespace mlx_lattice::kernels
