// The output-stationary tile drivers of the float convolutions:
// stationary_conv (float32 rows gathered by pointer) and forward_conv
// (half-precision rows converted per tile).
#include <algorithm>
#include <cstring>

#include "gemm.h"
#include "kernels.h"
#include "parallel.h"
#include "tiles.h"

namespace mlx_lattice::kernels {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Per-thread scratch of the tile loops, reused across calls.
struct Scratch {
  TileEdges edges;
  std::vector<const float*> a_ptrs;
  std::vector<float*> c_ptrs;
  std::vector<int32_t> in_rows;
  std::vector<float> rows;  // a tile's converted input rows
  std::vector<float> tile;  // a tile's float32 output rows
};

thread_local Scratch scratch;

// gemm_rows over every offset of a tile whose pointer lists are filled.
void tile_gemm(Scratch& s, const float* b, int64_t n_kernels, int64_t a_width, int64_t c_width) {
  const int64_t b_stride = a_width * c_width;
  for (int64_t k = 0; k < n_kernels; ++k) {
    const int64_t begin = s.edges.counts[k];
    const int64_t rows = s.edges.counts[k + 1] - begin;
    if (rows > 0) {
      gemm_rows(rows, s.a_ptrs.data() + begin, b + k * b_stride, a_width, c_width,
                s.c_ptrs.data() + begin);
    }
  }
}

}  // namespace

void stationary_conv(const float* a, int64_t a_width, const float* b, int64_t n_kernels,
                     float* c, int64_t c_width, const Csr& csr, const int32_t* a_index,
                     const int32_t* c_index, const int32_t* kernel_ids) {
  const int64_t tiles = ceil_div(csr.groups, kTileRows);
  parallel_for(tiles, [&](int64_t tile) {
    const int64_t g0 = tile * kTileRows;
    const int64_t g1 = std::min(csr.groups, g0 + kTileRows);
    std::memset(c + g0 * c_width, 0, sizeof(float) * (g1 - g0) * c_width);
    if (csr.offsets[g1] == csr.offsets[g0]) return;
    auto& s = scratch;
    const int64_t n_tile = csr.offsets[g1] - csr.offsets[g0];
    s.a_ptrs.resize(n_tile);
    s.c_ptrs.resize(n_tile);
    sort_tile_edges(csr, g0, g1, kernel_ids, n_kernels, s.edges, [&](int32_t slot, int32_t e) {
      s.a_ptrs[slot] = a + static_cast<int64_t>(a_index[e]) * a_width;
      s.c_ptrs[slot] = c + static_cast<int64_t>(c_index[e]) * c_width;
    });
    tile_gemm(s, b, n_kernels, a_width, c_width);
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
  const uint16_t* f = static_cast<const uint16_t*>(feats);
  uint16_t* o = static_cast<uint16_t*>(out);
  const int64_t tiles = ceil_div(csr.groups, kTileRows);
  parallel_for(tiles, [&](int64_t tile) {
    const int64_t g0 = tile * kTileRows;
    const int64_t g1 = std::min(csr.groups, g0 + kTileRows);
    auto& s = scratch;
    s.tile.assign((g1 - g0) * cout, 0.0f);
    if (csr.offsets[g1] > csr.offsets[g0]) {
      const int64_t n_tile = csr.offsets[g1] - csr.offsets[g0];
      s.a_ptrs.resize(n_tile);
      s.c_ptrs.resize(n_tile);
      s.in_rows.resize(n_tile);
      sort_tile_edges(csr, g0, g1, kernel_ids, n_kernels, s.edges, [&](int32_t slot, int32_t e) {
        s.in_rows[slot] = a_index[e];
        s.c_ptrs[slot] = s.tile.data() + (static_cast<int64_t>(c_index[e]) - g0) * cout;
      });
      if (static_cast<int64_t>(s.rows.size()) < n_tile * cin) s.rows.resize(n_tile * cin);
      // Rows kAhead slots ahead are requested while this one converts (the
      // gathered rows are otherwise fetched one latency at a time).
      constexpr int64_t kAhead = 8;
      const int64_t row_bytes = cin * 2;
      auto prefetch = [&](int64_t slot) {
        if (slot >= n_tile) return;
        const char* p =
            reinterpret_cast<const char*>(f + static_cast<int64_t>(s.in_rows[slot]) * cin);
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b);
      };
      for (int64_t slot = 0; slot < kAhead; ++slot) prefetch(slot);
      for (int64_t slot = 0; slot < n_tile; ++slot) {
        prefetch(slot + kAhead);
        float* row = s.rows.data() + slot * cin;
        convert_to_float32(f + static_cast<int64_t>(s.in_rows[slot]) * cin, format, cin, row);
        s.a_ptrs[slot] = row;
      }
      tile_gemm(s, weight, n_kernels, cin, cout);
    }
    convert_from_float32(s.tile.data(), (g1 - g0) * cout, format, o + g0 * cout);
  });
}

}  // namespace mlx_lattice::kernels
