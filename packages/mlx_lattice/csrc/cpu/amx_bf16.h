// The AMX-BF16 output-stationary driver of the bf16 sparse convolution
// (cpu/gemm_bf16.h's half_conv at ISA level amx-bf16), a template on its
// tile policy (cpu/amx_tiles.h: TileHw, or the test model TileModel), with
// no MLX dependency. The same driver runs the feature gradient: the
// transposed convolution over the input CSR of the same relation with each
// offset's weight transposed (K, cout, cin).
//
// Dataflow, per block of 16 consecutive output rows (CSR groups):
// 1. Slots: for each kernel offset k, which of the 16 rows has an edge of k
//    and its input row (a row has at most one edge per offset; a second one
//    raises InputError, as does an offset or input row out of range).
// 2. For each offset with an edge in the block (ascending), the 16 input
//    rows are gathered into a tile-strided buffer of `pairs` bf16 pairs per
//    row (channels past cin and rows without an edge of k are zero).
// 3. For each strip of up to 64 output columns: C tiles (16 rows x 16 fp32
//    columns each, up to 4) are zeroed once; for each present offset k and
//    each chunk of 16 pairs (32 channels; the tail chunk zero-padded) the A
//    tile is loaded once and TDPBF16PS runs against each column tile's B
//    tile (16 pairs x 16 columns x 2 bf16: the packed weight's own layout);
//    the C tiles accumulate ACROSS offsets and are stored once per strip
//    into the block's float32 rows, which are rounded to bf16 (nearest
//    even) once.
// A row without an edge of k still takes k's products with its zero
// gathered row: + 0 * w, exact, unless the weight holds an infinity or NaN
// (0 * inf = NaN). A weight that is not all finite therefore runs per
// offset instead: the C tiles are zeroed and stored per offset and only the
// rows with an edge of k are added into the float32 rows.
//
// Accumulation order, per output element (finite weight): offsets
// ascending, then channel pairs ascending, TDPBF16PS's two products of a
// pair into the running float32 sum (the tile model: even channel, then
// odd, one rounding per addition; the hardware may fuse or reorder inside
// an instruction). Products of two bf16 values are exact in float32;
// subnormal inputs and results are flushed to zero (the instruction ignores
// MXCSR). Error bound against the exact sum S of the bf16 inputs' products
// (n = K * 2 * pairs additions, u = 2^-24):
//   |out - S| <= 2^-8 |S| + (1 + 2^-8) n u sum |products| (+ flushed
//   subnormals, below 2^-126 per term),
// i.e. the float32 path's bound on the same inputs plus bf16's rounding of
// the result. Tests (amx_bf16_test) check it against a float64 reference.
//
// Tile configuration (one place: bf16_tile_config): tiles 0-3 C (16 x 64
// bytes), tile 4 A (16 x 64), tiles 5 and 6 B (16 x 64), alternating so a
// B load can overlap the previous product.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "group_by.h"
#include "input_error.h"
#include "parallel.h"
#include "tiles.h"

namespace mlx_lattice::kernels::amx_bf16 {

constexpr int kBlockRows = 16;      // output rows per block = rows of a tile
constexpr int kChunkPairs = 16;     // bf16 pairs per A tile row (64 bytes)
constexpr int kStripCols = 64;      // output columns per strip (4 C tiles)

// The weight in TDPBF16PS's B layout: w[k][pair p][cout_pad][2] bf16
// (channels 2p and 2p + 1 of one column per 32-bit element); pairs a
// multiple of 16, cout_pad of 16; padding zero.
struct Weights {
  const uint16_t* w;
  int64_t pairs;
  int64_t cout_pad;
  int64_t n_kernels;
  int64_t cout;
  bool finite;  // no infinity or NaN in the weight
};

// The packed weight's storage (one per calling thread, repacked per call).
struct PackedWeight {
  std::vector<uint16_t> w;
  int64_t pairs = 0;
  int64_t cout_pad = 0;
  bool finite = true;
};

// Packs W (K, cin, cout) bf16 into the B layout. transpose: W is (K, cout,
// cin) and the packed weight is that of its per-offset transpose (K, cin',
// cout') with cin' = cout, cout' = cin (the feature gradient's weight).
inline void pack_weight(const uint16_t* weight, int64_t n_kernels, int64_t cin, int64_t cout,
                        bool transpose, PackedWeight& p) {
  p.pairs = ceil_div(ceil_div(cin, 2), kChunkPairs) * kChunkPairs;
  p.cout_pad = ceil_div(cout, 16) * 16;
  p.w.assign(n_kernels * p.pairs * p.cout_pad * 2, 0);
  p.finite = true;
  for (int64_t k = 0; k < n_kernels; ++k) {
    for (int64_t c = 0; c < cin; ++c) {
      for (int64_t x = 0; x < cout; ++x) {
        const uint16_t v = transpose ? weight[(k * cout + x) * cin + c]
                                     : weight[(k * cin + c) * cout + x];
        if ((v & 0x7f80u) == 0x7f80u) p.finite = false;  // exponent all ones
        p.w[((k * p.pairs + c / 2) * p.cout_pad + x) * 2 + c % 2] = v;
      }
    }
  }
}

inline Weights view(const PackedWeight& p, int64_t n_kernels, int64_t cout) {
  return {p.w.data(), p.pairs, p.cout_pad, n_kernels, cout, p.finite};
}

// bf16 rows: f (n, cin).
struct Rows {
  const uint16_t* f;
  int64_t n;
  int64_t cin;
};

inline amx::TileConfig bf16_tile_config() {
  amx::TileConfig cfg;
  for (int t = 0; t < 7; ++t) cfg.set(t, kBlockRows, amx::kMaxColsb);
  return cfg;
}

// float32 to bf16, round to nearest even; NaN stays NaN (quieted).
inline uint16_t round_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Per-thread scratch of the driver.
struct Scratch {
  std::vector<int32_t> slot;       // [k][16]: input row, or -1
  std::vector<int32_t> present;    // offsets with an edge in the block, ascending
  std::vector<uint16_t> gathered;  // [present][16][2 * pairs]
  std::vector<float> block;        // 16 x cout_pad float32 rows
  alignas(64) float tile[kBlockRows * kStripCols];
};

// Output rows [g0, g1) of `csr` (edge e: input row a_index[e], offset
// kernel_ids[e]); out points at row 0 of the whole output (cout bf16 per
// row) and rows [g0, g1) are overwritten.
template <class Tiles>
inline void run_rows(const Rows& a, const Weights& w, const Csr& csr, const int32_t* a_index,
                     const int32_t* kernel_ids, int64_t g0, int64_t g1, uint16_t* out,
                     Scratch& s) {
  const int64_t cout = w.cout;
  const int64_t nk = w.n_kernels;
  const int64_t row_len = 2 * w.pairs;  // bf16 per gathered row
  const int64_t row_bytes = row_len * 2;
  const int64_t bstride = w.cout_pad * 4;  // bytes per pair row of B
  if (g1 <= g0) return;
  s.slot.resize(nk * kBlockRows);
  s.block.resize(kBlockRows * w.cout_pad);
  amx::TileScope<Tiles> scope(bf16_tile_config());
  for (int64_t b0 = g0; b0 < g1; b0 += kBlockRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, g1 - b0));
    std::fill(s.slot.begin(), s.slot.end(), -1);
    s.present.clear();
    for (int r = 0; r < rows; ++r) {
      const int64_t end = csr.offsets[b0 + r + 1];
      for (int64_t j = csr.offsets[b0 + r]; j < end; ++j) {
        const int32_t e = csr.edge_ids ? csr.edge_ids[j] : static_cast<int32_t>(j);
        const int32_t k = kernel_ids[e];
        const int32_t i = a_index[e];
        if (k < 0 || k >= nk || i < 0 || i >= a.n) {
          throw InputError("relation: a kernel offset or row index is out of range");
        }
        int32_t& slot = s.slot[k * kBlockRows + r];
        if (slot >= 0) throw_repeated_offset();
        slot = i;
      }
    }
    for (int64_t k = 0; k < nk; ++k) {
      for (int r = 0; r < rows; ++r) {
        if (s.slot[k * kBlockRows + r] >= 0) {
          s.present.push_back(static_cast<int32_t>(k));
          break;
        }
      }
    }
    const int64_t np = static_cast<int64_t>(s.present.size());
    s.gathered.resize(std::max<int64_t>(1, np) * kBlockRows * row_len);
    for (int64_t pi = 0; pi < np; ++pi) {
      const int32_t* slot = s.slot.data() + s.present[pi] * kBlockRows;
      uint16_t* dst = s.gathered.data() + pi * kBlockRows * row_len;
      for (int r = 0; r < kBlockRows; ++r) {
        uint16_t* d = dst + r * row_len;
        if (slot[r] >= 0) {
          std::memcpy(d, a.f + static_cast<int64_t>(slot[r]) * a.cin, sizeof(uint16_t) * a.cin);
          std::memset(d + a.cin, 0, sizeof(uint16_t) * (row_len - a.cin));
        } else {
          std::memset(d, 0, sizeof(uint16_t) * row_len);
        }
      }
    }
    float* block = s.block.data();
    const int64_t bpitch = w.cout_pad;
    if (!w.finite) std::fill(s.block.begin(), s.block.end(), 0.0f);
    for (int64_t n0 = 0; n0 < w.cout_pad; n0 += kStripCols) {
      const int nc = static_cast<int>(std::min<int64_t>(4, (w.cout_pad - n0) / 16));
      amx::zero_strip<Tiles>(nc);
      for (int64_t pi = 0; pi < np; ++pi) {
        const int64_t k = s.present[pi];
        if (!w.finite) amx::zero_strip<Tiles>(nc);
        const auto* ga = reinterpret_cast<const uint8_t*>(s.gathered.data() +
                                                          pi * kBlockRows * row_len);
        const auto* wk = reinterpret_cast<const uint8_t*>(w.w + k * w.pairs * w.cout_pad * 2);
        for (int64_t p0 = 0; p0 < w.pairs; p0 += kChunkPairs) {
          Tiles::template load<4>(ga + p0 * 4, row_bytes);
          amx::multiply_strip<Tiles, amx::Dot::kBf16ps>(nc, wk + p0 * bstride + n0 * 4, bstride);
        }
        if (!w.finite) {
          // Per offset: only the rows with an edge of k take its products.
          amx::store_strip<Tiles>(nc, s.tile, kStripCols * 4);
          const int32_t* slot = s.slot.data() + k * kBlockRows;
          const int64_t width = 16 * nc;
          for (int r = 0; r < rows; ++r) {
            if (slot[r] < 0) continue;
            float* dst = block + r * bpitch + n0;
            const float* src = s.tile + r * kStripCols;
            for (int64_t x = 0; x < width; ++x) dst[x] = dst[x] + src[x];
          }
        }
      }
      if (w.finite) amx::store_strip<Tiles>(nc, block + n0, bpitch * 4);
    }
    // One rounding per output value.
    for (int r = 0; r < rows; ++r) {
      const float* src = block + r * bpitch;
      uint16_t* dst = out + (b0 + r) * cout;
      for (int64_t x = 0; x < cout; ++x) dst[x] = round_bf16(src[x]);
    }
  }
}

}  // namespace mlx_lattice::kernels::amx_bf16
