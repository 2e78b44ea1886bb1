// The AMX-INT8 output-stationary driver of the integer sparse convolution
// (cpu/gemm_int8.h's math, the same bits), a template on its tile policy
// (cpu/amx_tiles.h: TileHw, or the test model TileModel) and on its
// epilogue (portable C++ or AVX-512), with no MLX dependency.
//
// Dataflow, per block of 16 consecutive output rows (CSR groups):
// 1. Mask: for each kernel offset k, which of the 16 rows has an edge of k
//    and its input row (an output row has at most one edge per offset).
// 2. For k ascending with any edge in the block: gather the 16 quantized
//    input rows (absent rows zero) into one tile-strided buffer; for each
//    strip of up to 64 output columns and each weight group g: C tiles
//    (16 rows x 16 int32 columns each, up to 4) are zeroed, then for each
//    chunk of the group (kc <= 64 bytes) the A tile is loaded once and
//    TDPBSUD (signed activations x unsigned weight codes) runs against each
//    strip's B tile (kc / 4 rows of 16 columns x 4 codes: the packed weight's
//    own layout, so no repacking); the C tiles are stored and the epilogue
//    adds float(acc) * s + float(asum) * b (times the row's scale) to the
//    block's output rows where the mask is set.
// The float epilogue per (offset, group) is what the documented math asks
// (each edge's integer sum is scaled by its input row's scale and its
// offset's group scale before the float sum), so int32 cannot accumulate
// across offsets; the output rows stay resident (no scatter) and every
// element's additions come in the reference order (offsets, then groups,
// ascending).
//
// Tile configuration (one place: int8_tile_config): tiles 0-3 C (16 x 64
// bytes), tile 4 A (16 x kc), tiles 5 and 6 B (kc / 4 x 64), alternating so
// a B load can overlap the previous product.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "amx_tiles.h"
#include "group_by.h"
#include "quantized_weight.h"
#include "tiles.h"

namespace mlx_lattice::kernels::amx_int8 {

constexpr int kBlockRows = 16;  // output rows per block = rows of a tile

// The weight in gemm_int8.cpp's packed layout: codes[k][quad][cout_pad][4],
// scales and biases [k][group][cout_pad]; cout_pad a multiple of 16.
struct Weights {
  const uint8_t* codes;
  const float* scales;
  const float* biases;
  int64_t quads;     // storage_in / 4
  int64_t groups;    // storage_in / group
  int64_t cout_pad;  // columns, a multiple of 16
  int64_t n_kernels;
  int64_t cout;
};

// Quantized rows (quantize_rows_int8): q (n, stride) int8, scale (n),
// gsum (n, groups). static_scale: every finite row's scale is 1.
struct Rows {
  const int8_t* q;
  const float* scale;
  const int32_t* gsum;
  int64_t stride;  // storage_in bytes
  bool static_scale;
};

// The largest chunk of a group one A tile holds: 64, 32, 16, 8 or 4 bytes
// dividing the group (group % 4 == 0).
inline int chunk_bytes(int64_t group_bytes) {
  for (int kc = amx::kMaxColsb; kc > 4; kc /= 2) {
    if (group_bytes % kc == 0) return kc;
  }
  return 4;
}

inline amx::TileConfig int8_tile_config(int kc) {
  amx::TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.set(t, kBlockRows, amx::kMaxColsb);
  cfg.set(4, kBlockRows, kc);
  cfg.set(5, kc / 4, amx::kMaxColsb);
  cfg.set(6, kc / 4, amx::kMaxColsb);
  return cfg;
}

// What the epilogue of one stored strip needs.
struct EpiArgs {
  const int32_t* acc;   // 16 rows x 64 int32 (row stride 64)
  const float* s;       // group scales of the strip's columns
  const float* b;       // group biases
  int64_t width;        // real columns of the strip (<= 64)
};

// Portable epilogue: one rounding per operation, as the documented math.
struct EpiScalar {
  static constexpr const char* kName = "scalar";
  template <bool Unit>
  MLX_LATTICE_NO_CONTRACT static void row(const EpiArgs& e, int r, float asum, float sa,
                                          float* out) {
    MLX_LATTICE_NO_CONTRACT_BODY
    const int32_t* acc = e.acc + r * 64;
    for (int64_t x = 0; x < e.width; ++x) {
      float t = static_cast<float>(acc[x]) * e.s[x];
      const float u = asum * e.b[x];
      t = t + u;
      if constexpr (!Unit) t = t * sa;
      out[x] = out[x] + t;
    }
  }
};

#if defined(__x86_64__) || defined(_M_X64)
// AVX-512 epilogue: the same operations, 16 columns per vector, each
// product kept rounded on its own (no contraction into an FMA).
struct EpiAvx512 {
  static constexpr const char* kName = "avx512";
  template <bool Unit>
  __attribute__((target("avx512f"))) static void row(const EpiArgs& e, int r, float asum,
                                                     float sa, float* out) {
    const int32_t* acc = e.acc + r * 64;
    const __m512 vasum = _mm512_set1_ps(asum);
    [[maybe_unused]] const __m512 vsa = _mm512_set1_ps(sa);
    for (int64_t x = 0; x < e.width; x += 16) {
      const int64_t rem = e.width - x;
      const __mmask16 m = rem >= 16 ? static_cast<__mmask16>(0xffff)
                                    : static_cast<__mmask16>((1u << rem) - 1u);
      __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(acc + x)),
                               _mm512_loadu_ps(e.s + x));
      __m512 u = _mm512_mul_ps(vasum, _mm512_loadu_ps(e.b + x));
      asm("" : "+v"(t));
      asm("" : "+v"(u));
      t = _mm512_add_ps(t, u);
      if constexpr (!Unit) t = _mm512_mul_ps(t, vsa);
      asm("" : "+v"(t));
      _mm512_mask_storeu_ps(out + x, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, out + x), t));
    }
  }
};
#endif

// Per-thread scratch of the driver.
struct Scratch {
  std::vector<int32_t> slot;      // [k][16]: input row, or -1
  std::vector<uint8_t> present;   // [k]: any edge of k in the block
  std::vector<int8_t> gathered;   // 16 rows x stride
  alignas(64) int32_t acc[kBlockRows * 64];
};

// Output rows [g0, g1) of the output CSR `csr`; out points at row 0 of the
// whole output (cout floats per row) and rows [g0, g1) are overwritten.
template <class Tiles, class Epi>
inline void run_rows(const Rows& a, const Weights& w, int64_t group_bytes, const Csr& csr,
                     const int32_t* a_index, const int32_t* kernel_ids, int64_t g0, int64_t g1,
                     float* out, Scratch& s) {
  const int64_t cout = w.cout;
  const int64_t nk = w.n_kernels;
  const int kc = chunk_bytes(group_bytes);
  const int64_t chunks = group_bytes / kc;
  const int64_t stride = a.stride;
  const int64_t bstride = w.cout_pad * 4;
  s.slot.resize(nk * kBlockRows);
  s.present.resize(nk);
  s.gathered.resize(kBlockRows * stride);
  std::memset(out + g0 * cout, 0, sizeof(float) * (g1 - g0) * cout);
  if (g1 <= g0) return;
  amx::TileScope<Tiles> scope(int8_tile_config(kc));
  int8_t* gathered = s.gathered.data();
  for (int64_t b0 = g0; b0 < g1; b0 += kBlockRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, g1 - b0));
    std::fill(s.slot.begin(), s.slot.end(), -1);
    std::fill(s.present.begin(), s.present.end(), 0);
    for (int r = 0; r < rows; ++r) {
      const int64_t end = csr.offsets[b0 + r + 1];
      for (int64_t j = csr.offsets[b0 + r]; j < end; ++j) {
        const int32_t e = csr.edge_ids ? csr.edge_ids[j] : static_cast<int32_t>(j);
        const int32_t k = kernel_ids[e];
        int32_t& slot = s.slot[k * kBlockRows + r];
        if (slot >= 0) throw_repeated_offset();
        slot = a_index[e];
        s.present[k] = 1;
      }
    }
    float* block_out = out + b0 * cout;
    for (int64_t k = 0; k < nk; ++k) {
      if (!s.present[k]) continue;
      const int32_t* slot = s.slot.data() + k * kBlockRows;
      bool unit = a.static_scale;
      for (int r = 0; r < kBlockRows; ++r) {
        int8_t* dst = gathered + r * stride;
        if (slot[r] >= 0) {
          std::memcpy(dst, a.q + static_cast<int64_t>(slot[r]) * stride, stride);
          unit = unit && a.scale[slot[r]] == 1.0f;
        } else {
          std::memset(dst, 0, stride);
        }
      }
      const uint8_t* codes_k = w.codes + k * w.quads * bstride;
      for (int64_t n0 = 0; n0 < w.cout_pad; n0 += 64) {
        const int nc = static_cast<int>(std::min<int64_t>(4, (w.cout_pad - n0) / 16));
        const int64_t width = std::min<int64_t>(64, cout - n0);
        for (int64_t g = 0; g < w.groups; ++g) {
          amx::zero_strip<Tiles>(nc);
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t byte0 = g * group_bytes + c * kc;
            Tiles::template load<4>(gathered + byte0, stride);
            amx::multiply_strip<Tiles, amx::Dot::kBsud>(
                nc, codes_k + (byte0 / 4) * bstride + n0 * 4, bstride);
          }
          amx::store_strip<Tiles>(nc, s.acc, 256);
          const int64_t wofs = (k * w.groups + g) * w.cout_pad + n0;
          const EpiArgs e{s.acc, w.scales + wofs, w.biases + wofs, width};
          for (int r = 0; r < rows; ++r) {
            if (slot[r] < 0) continue;
            const float asum = static_cast<float>(a.gsum[slot[r] * w.groups + g]);
            float* o = block_out + r * cout + n0;
            if (unit) {
              Epi::template row<true>(e, r, asum, 1.0f, o);
            } else {
              Epi::template row<false>(e, r, asum, a.scale[slot[r]], o);
            }
          }
        }
      }
    }
  }
}

}  // namespace mlx_lattice::kernels::amx_int8
