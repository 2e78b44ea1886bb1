// The output-stationary float convolutions: stationary_conv (float32 rows
// gathered by pointer), forward_conv (half-precision rows through
// cpu/conv_forward_half.cpp) and the weight-only quantized forward.
#include <algorithm>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_LATTICE_X86 1
#endif

#include "conv_forward_half.h"
#include "gemm.h"
#include "isa.h"
#include "kernels.h"
#include "parallel.h"
#include "tiles.h"

namespace mlx_lattice::kernels {

namespace {

// Output rows per tile for rows `width` values wide: kTileRows from 64 up;
// narrower rows take more (up to 4 x kTileRows at 32 and below), so an
// offset gets more rows per tile: fewer partial register blocks and less
// per-tile work per edge where each edge's arithmetic is smallest.
int64_t tile_rows_for(int64_t width) {
  if (width >= 64) return kTileRows;
  return std::min<int64_t>(4 * kTileRows, kTileRows * 128 / std::max<int64_t>(width, 1));
}

// One offset's codes re-laid out as (cin, cout) bytes, its scales and
// biases as (groups, cout): its panel then dequantizes with contiguous
// vector loads. Per-thread scratch.
struct Codes {
  std::vector<uint8_t> q;
  std::vector<float> s;
  std::vector<float> b;
};

thread_local Codes offset_codes;

void unpack_offset(const QuantizedWeightView& w, int64_t k, int64_t cin, int64_t cout,
                   Codes& out) {
  const int64_t groups = w.storage_in / w.group_size;
  out.q.resize(cin * cout);
  out.s.resize(groups * cout);
  out.b.resize(groups * cout);
  for (int64_t o = 0; o < cout; ++o) {
    const int64_t row = k * cout + o;
    const uint8_t* p = w.packed + row * w.row_bytes;
    for (int64_t c = 0; c < cin; ++c) {
      out.q[c * cout + o] = static_cast<uint8_t>(unpack_code(p, w.row_bytes, c, w.bits));
    }
    for (int64_t g = 0; g < groups; ++g) {
      out.s[g * cout + o] = w.scales[row * groups + g];
      out.b[g * cout + o] = w.biases[row * groups + g];
    }
  }
}

// panel[c, x] = s[g, x] * q[c, x] + b[g, x] (g = c / group), rounded after
// the product and after the sum (no contraction into an FMA).
MLX_LATTICE_NO_CONTRACT void dequantize_panel_scalar(const uint8_t* q, const float* s,
                                                     const float* b, int64_t cin, int64_t cout,
                                                     int64_t group, float* panel) {
  MLX_LATTICE_NO_CONTRACT_BODY
  for (int64_t c = 0; c < cin; ++c) {
    const float* sg = s + (c / group) * cout;
    const float* bg = b + (c / group) * cout;
    for (int64_t x = 0; x < cout; ++x) {
      panel[c * cout + x] = sg[x] * static_cast<float>(q[c * cout + x]) + bg[x];
    }
  }
}

#ifdef MLX_LATTICE_X86
__attribute__((target("avx512f"))) void dequantize_panel_avx512(const uint8_t* q, const float* s,
                                                                const float* b, int64_t cin,
                                                                int64_t cout, int64_t group,
                                                                float* panel) {
  for (int64_t c = 0; c < cin; ++c) {
    const float* sg = s + (c / group) * cout;
    const float* bg = b + (c / group) * cout;
    const uint8_t* qc = q + c * cout;
    float* pc = panel + c * cout;
    int64_t x = 0;
    for (; x + 16 <= cout; x += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qc + x));
      // (Zero-masked forms, all lanes: GCC 12 reports the plain forms'
      // undefined pass-through operand as "may be used uninitialized".)
      const __m512 codes =
          _mm512_maskz_cvtepi32_ps(0xffff, _mm512_maskz_cvtepu8_epi32(0xffff, bytes));
      __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sg + x), codes);
      asm("" : "+v"(v));  // no fused multiply-add: the product rounds on its own
      _mm512_storeu_ps(pc + x, _mm512_add_ps(v, _mm512_loadu_ps(bg + x)));
    }
    for (; x < cout; ++x) pc[x] = sg[x] * static_cast<float>(qc[x]) + bg[x];
  }
}
#endif

// Per-thread buckets of stationary_conv's tiles: offset k's rows are
// a_ptrs / c_ptrs[k * cap, k * cap + count[k]) for tiles of cap rows.
struct Buckets {
  std::vector<const float*> a_ptrs;
  std::vector<float*> c_ptrs;
  std::vector<int32_t> count;
};

thread_local Buckets buckets;

}  // namespace

void stationary_conv(const float* a, int64_t a_width, const float* b, int64_t n_kernels,
                     float* c, int64_t c_width, const Csr& csr, const int32_t* a_index,
                     const int32_t* /*c_index: each group's own row*/, const int32_t* kernel_ids) {
  const int64_t tile_rows = tile_rows_for(c_width);
  const int64_t tiles = ceil_div(csr.groups, tile_rows);
  const int64_t b_stride = a_width * c_width;
  parallel_for(tiles, [&](int64_t tile) {
    const int64_t g0 = tile * tile_rows;
    const int64_t g1 = std::min(csr.groups, g0 + tile_rows);
    float* const c_tile = c + g0 * c_width;
    std::memset(c_tile, 0, sizeof(float) * (g1 - g0) * c_width);
    if (csr.offsets[g1] == csr.offsets[g0]) return;
    // One bucket of g1 - g0 pointer pairs per offset (an offset has at most
    // one edge per output row), filled in one pass over the tile's edges:
    // no counting pass and no slot indirection (bucket_tile_edges).
    auto& s = buckets;
    const int64_t cap = g1 - g0;
    if (static_cast<int64_t>(s.a_ptrs.size()) < n_kernels * cap) {
      s.a_ptrs.resize(n_kernels * cap);
      s.c_ptrs.resize(n_kernels * cap);
    }
    s.count.resize(n_kernels);
    const float** a_ptrs = s.a_ptrs.data();
    float** c_ptrs = s.c_ptrs.data();
    int32_t* count = s.count.data();
    // Captured by value: the library builds with -fno-strict-aliasing, so
    // through references every pointer store would reload them.
    bucket_tile_edges(csr, g0, g1, kernel_ids, n_kernels, count,
                      [=](int32_t k, int32_t n, int32_t local, int32_t e) {
                        const int64_t slot = k * cap + n;
                        a_ptrs[slot] = a + static_cast<int64_t>(a_index[e]) * a_width;
                        c_ptrs[slot] = c_tile + static_cast<int64_t>(local) * c_width;
                      });
    for (int64_t k = 0; k < n_kernels; ++k) {
      if (count[k] > 0) {
        gemm_rows(count[k], a_ptrs + k * cap, b + k * b_stride, a_width, c_width,
                  c_ptrs + k * cap);
      }
    }
  });
}

void forward_conv(const void* feats, FloatFormat format, int64_t cin, const float* weight,
                  int64_t n_kernels, int64_t cout, const Csr& csr, const int32_t* a_index,
                  const int32_t* c_index, const int32_t* kernel_ids, void* out) {
  if (format == FloatFormat::kF32) {
    stationary_conv(static_cast<const float*>(feats), cin, weight, n_kernels,
                    static_cast<float*>(out), cout, csr, a_index, c_index, kernel_ids);
    return;
  }
  half_rows_forward(static_cast<const uint16_t*>(feats), format, cin, weight, n_kernels, cout,
                    csr, a_index, kernel_ids, static_cast<uint16_t*>(out), tile_rows_for(cout));
}

void dequantize_weight_panels(const QuantizedWeightView& weight, int64_t n_kernels, int64_t cin,
                              int64_t cout, float* out) {
  auto dequantize = dequantize_panel_scalar;
#ifdef MLX_LATTICE_X86
  if (isa::isa_usable(isa::Isa::kAvx512)) dequantize = dequantize_panel_avx512;
#endif
  parallel_for(n_kernels, [&](int64_t k) {
    Codes& c = offset_codes;
    unpack_offset(weight, k, cin, cout, c);
    dequantize(c.q.data(), c.s.data(), c.b.data(), cin, cout, weight.group_size,
               out + k * cin * cout);
  });
}

}  // namespace mlx_lattice::kernels
