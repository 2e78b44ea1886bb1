// The AMX-BF16 output-stationary driver of the bf16 sparse convolution
// (cpu/gemm_bf16.h's half_conv at ISA level amx-bf16), a template on its
// tile policy (cpu/amx_tiles.h: TileHw, or the test model TileModel), with
// no MLX dependency. The same driver runs the feature gradient: the
// transposed convolution over the input CSR of the same relation with each
// offset's weight transposed (K, cout, cin).
//
// Dataflow, per window of output rows [g0, g1) (CSR groups; the caller's
// tile of kAmxTileRows, whose float32 rows stay in cache):
// 1. Buckets: the window's edges grouped by kernel offset (tiles.h's
//    bucket_tile_edges, as the int8 driver does): input row and
//    window-local output row per edge, CSR order inside an offset (a row
//    has at most one edge per offset, a second one raises InputError, as
//    does an offset or input row out of range).
// 2. For k ascending, the offset's edges 16 at a time (a batch fills every
//    row of the A tile but the last batch's tail, so no product multiplies
//    an absent row, as it would in blocks of 16 output rows, whose offsets
//    are the union of their rows'): the batch's input rows are loaded
//    straight from the features when they are 16 consecutive rows and cin
//    fills whole chunks, else gathered into a tile-strided buffer of `pairs`
//    bf16 pairs per row (channels past cin zero).
// 3. For each strip of up to 64 output columns: C tiles (16 rows x 16 fp32
//    columns each, up to 4) are zeroed; for each chunk of 16 pairs (32
//    channels) the A tile is loaded once and TDPBF16PS runs against each
//    column tile's B tile (16 pairs x 16 columns x 2 bf16: the packed
//    weight's own layout); the C tiles are stored and each edge's row is
//    added into its output row's float32 sum, which is rounded to bf16
//    (nearest even) once, after the last offset.
// Only rows with an edge of k take k's products (a tail batch's unused tile
// rows are not read back), so a weight with infinities or NaN needs no
// other path.
//
// Accumulation order, per output element: offsets ascending; per offset a
// fresh float32 sum over channel pairs ascending, TDPBF16PS's two products
// of a pair added into it (the tile model: even channel, then odd, one
// rounding per addition; the hardware may fuse or reorder inside an
// instruction), then added into the row's float32 sum (an ordinary
// addition, subnormals kept). Products of two bf16 values are exact in
// float32; subnormal inputs and results of TDPBF16PS are flushed to zero
// (the instruction ignores MXCSR). Error bound against the exact sum S of
// the bf16 inputs' products (n = K * 2 * pairs additions, u = 2^-24):
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
#include "line_vector.h"
#include "parallel.h"
#include "tiles.h"

namespace mlx_lattice::kernels::amx_bf16 {

constexpr int kBlockRows = 16;      // edges per batch = rows of a tile
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
};

// The packed weight's storage (one per calling thread, repacked per call).
struct PackedWeight {
  LineVector<uint16_t> w;
  int64_t pairs = 0;
  int64_t cout_pad = 0;
};

// Packs W (K, cin, cout) bf16 into the B layout. transpose: W is (K, cout,
// cin) and the packed weight is that of its per-offset transpose (K, cin',
// cout') with cin' = cout, cout' = cin (the feature gradient's weight).
inline void pack_weight(const uint16_t* weight, int64_t n_kernels, int64_t cin, int64_t cout,
                        bool transpose, PackedWeight& p) {
  p.pairs = ceil_div(ceil_div(cin, 2), kChunkPairs) * kChunkPairs;
  p.cout_pad = ceil_div(cout, 16) * 16;
  p.w.assign(n_kernels * p.pairs * p.cout_pad * 2, 0);
  for (int64_t k = 0; k < n_kernels; ++k) {
    for (int64_t c = 0; c < cin; ++c) {
      for (int64_t x = 0; x < cout; ++x) {
        const uint16_t v = transpose ? weight[(k * cout + x) * cin + c]
                                     : weight[(k * cin + c) * cout + x];
        p.w[((k * p.pairs + c / 2) * p.cout_pad + x) * 2 + c % 2] = v;
      }
    }
  }
}

inline Weights view(const PackedWeight& p, int64_t n_kernels, int64_t cout) {
  return {p.w.data(), p.pairs, p.cout_pad, n_kernels, cout};
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
  std::vector<int32_t> rows;       // [k][cap]: input row of each bucketed edge
  std::vector<int32_t> outs;       // [k][cap]: its window-local output row
  std::vector<int32_t> count;      // [k]: edges of offset k in the window
  LineVector<uint16_t> gathered;  // 16 rows x 2 * pairs
  LineVector<float> window;       // cap x cout_pad float32 sums
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
  const int64_t cap = g1 - g0;
  s.count.resize(nk);
  fit_buckets(nk * cap, s.rows, s.outs);
  int32_t* count = s.count.data();
  int32_t* bucket_rows = s.rows.data();
  int32_t* bucket_outs = s.outs.data();
  // A row's edges come together (CSR order), so a second edge of one offset
  // in a row finds that row at the end of the offset's bucket.
  bucket_tile_edges(csr, g0, g1, kernel_ids, nk, count,
                    [bucket_rows, bucket_outs, cap, a_index, n_rows = a.n](
                        int32_t k, int32_t n, int32_t local, int32_t e) {
                      const int32_t i = a_index[e];
                      if (i < 0 || i >= n_rows) {
                        throw InputError("relation: a row index is out of range");
                      }
                      if (n > 0 && bucket_outs[k * cap + n - 1] == local) {
                        throw_repeated_offset();
                      }
                      bucket_rows[k * cap + n] = i;
                      bucket_outs[k * cap + n] = local;
                    });
  s.window.assign(cap * w.cout_pad, 0.0f);
  s.gathered.resize(kBlockRows * row_len);
  float* window = s.window.data();
  uint16_t* gathered = s.gathered.data();
  const int64_t pitch = w.cout_pad;
  // Rows read in place need no padding: cin fills whole chunks.
  const bool in_place = a.cin == row_len;
  amx::TileScope<Tiles> scope(bf16_tile_config());
  for (int64_t k = 0; k < nk; ++k) {
    const auto* wk = reinterpret_cast<const uint8_t*>(w.w + k * w.pairs * w.cout_pad * 2);
    for (int64_t i0 = 0; i0 < count[k]; i0 += kBlockRows) {
      const int m = static_cast<int>(std::min<int64_t>(kBlockRows, count[k] - i0));
      const int32_t* rows = bucket_rows + k * cap + i0;
      const int32_t* outs = bucket_outs + k * cap + i0;
      // The next batch's rows are requested behind this batch's work.
      const int next = static_cast<int>(std::min<int64_t>(kBlockRows, count[k] - i0 - m));
      for (int r = 0; r < next; ++r) {
        prefetch_lines(a.f + static_cast<int64_t>(rows[m + r]) * a.cin, a.cin * 2);
      }
      bool consecutive = in_place && m == kBlockRows;
      for (int r = 1; consecutive && r < kBlockRows; ++r) consecutive = rows[r] == rows[0] + r;
      const uint8_t* ga;
      if (consecutive) {
        ga = reinterpret_cast<const uint8_t*>(a.f + static_cast<int64_t>(rows[0]) * a.cin);
      } else {
        for (int r = 0; r < m; ++r) {
          uint16_t* d = gathered + r * row_len;
          std::memcpy(d, a.f + static_cast<int64_t>(rows[r]) * a.cin, sizeof(uint16_t) * a.cin);
          if (row_len > a.cin) std::memset(d + a.cin, 0, sizeof(uint16_t) * (row_len - a.cin));
        }
        ga = reinterpret_cast<const uint8_t*>(gathered);
      }
      for (int64_t n0 = 0; n0 < w.cout_pad; n0 += kStripCols) {
        const int nc = static_cast<int>(std::min<int64_t>(4, (w.cout_pad - n0) / 16));
        amx::zero_strip<Tiles>(nc);
        for (int64_t p0 = 0; p0 < w.pairs; p0 += kChunkPairs) {
          Tiles::template load<4>(ga + p0 * 4, row_bytes);
          amx::multiply_strip<Tiles, amx::Dot::kBf16ps>(nc, wk + p0 * bstride + n0 * 4, bstride);
        }
        amx::store_strip<Tiles>(nc, s.tile, kStripCols * 4);
        const int64_t width = 16 * nc;
        for (int r = 0; r < m; ++r) {
          float* __restrict dst = window + outs[r] * pitch + n0;
          const float* __restrict src = s.tile + r * kStripCols;
          for (int64_t x = 0; x < width; ++x) dst[x] = dst[x] + src[x];
        }
      }
    }
  }
  // One rounding per output value.
  for (int64_t r = 0; r < cap; ++r) {
    const float* src = window + r * pitch;
    uint16_t* dst = out + (g0 + r) * cout;
    for (int64_t x = 0; x < cout; ++x) dst[x] = round_bf16(src[x]);
  }
}

}  // namespace mlx_lattice::kernels::amx_bf16
