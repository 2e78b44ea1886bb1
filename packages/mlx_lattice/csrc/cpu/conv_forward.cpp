// The output-stationary float convolutions: stationary_conv (float32 rows
// gathered by pointer) and forward_conv (half-precision rows through
// cpu/conv_forward_half.cpp).
#include "conv_forward.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "conv_forward_half.h"
#include "gemm.h"
#include "line_vector.h"
#include "output_window.h"
#include "parallel.h"
#include "tiles.h"

namespace mlx_lattice::kernels {

namespace {

// Output rows per tile for rows `width` values wide, over `groups` rows.
// The base: kTileRows from 64 up; narrower rows take more (up to
// 4 x kTileRows at 32 and below), so an offset gets more rows per tile:
// fewer partial register blocks and less per-tile work per edge where each
// edge's arithmetic is smallest. With 2 MiB of L2 or more the tile's float32
// rows fill a quarter of it (l2_tile_rows; C64: 2048 rows): on the Intel AMX
// host the C64 forward 11% faster, C128 11%, the feature gradient 17%
// (benchmarks/LOG.md).
int64_t tile_rows_for(int64_t width, int64_t groups) {
  width = std::max<int64_t>(width, 1);
  const int64_t base =
      width >= 64 ? kTileRows : std::min<int64_t>(4 * kTileRows, kTileRows * 128 / width);
  return l2_tile_rows(width * 4, base, groups, 4);
}

// Per-thread buckets of stationary_conv's tiles: offset k's rows are
// a_ptrs / c_ptrs[k * cap, k * cap + count[k]) for tiles of cap rows.
struct Buckets {
  std::vector<const float*> a_ptrs;
  std::vector<float*> c_ptrs;
  std::vector<int32_t> count;
  LineVector<float> window;  // the tile's sums where the output is streamed
};

thread_local Buckets buckets;

// The calling thread's copy of a B that MLX's allocator put off a line.
thread_local LineVector<float> b_copy;

}  // namespace

void stationary_conv(const float* a, int64_t a_width, const float* b, int64_t n_kernels,
                     float* c, int64_t c_width, const Csr& csr, const int32_t* a_index,
                     const int32_t* /*c_index: each group's own row*/, const int32_t* kernel_ids) {
  const int64_t tile_rows = tile_rows_for(c_width, csr.groups);
  const int64_t b_stride = a_width * c_width;
  // Each register block of an offset's rows reads that offset's whole B.
  const double b_reads = static_cast<double>(csr.offsets[csr.groups]) /
                         static_cast<double>(kGemmBlockRows * std::max<int64_t>(n_kernels, 1));
  b = line_aligned(b, static_cast<size_t>(n_kernels * b_stride), this_thread(b_copy), b_reads);
  const bool stream = stream_output(csr.groups * c_width * int64_t{4}, c_width * int64_t{4});
  parallel_for_windows(csr.groups, tile_rows, [&](int64_t g0, int64_t g1) {
    const int64_t cap = g1 - g0;
    if (csr.offsets[g1] == csr.offsets[g0]) {
      std::memset(c + g0 * c_width, 0, sizeof(float) * cap * c_width);
      return;
    }
    auto& s = this_thread(buckets);
    // Summed in place, or in the thread's buffer and streamed out
    // (output_window.h).
    float* const c_tile = stream ? window_buffer(s.window, cap * c_width) : c + g0 * c_width;
    std::memset(c_tile, 0, sizeof(float) * cap * c_width);
    // One bucket of g1 - g0 pointer pairs per offset (an offset has at most
    // one edge per output row), filled in one pass over the tile's edges:
    // no counting pass and no slot indirection (bucket_row_pointers).
    fit_buckets(n_kernels * cap, s.a_ptrs, s.c_ptrs);
    s.count.resize(n_kernels);
    const float** a_ptrs = s.a_ptrs.data();
    float** c_ptrs = s.c_ptrs.data();
    int32_t* count = s.count.data();
    bucket_row_pointers(csr, g0, g1, kernel_ids, n_kernels, count, a, a_index, a_width, c_tile,
                        c_width, a_ptrs, c_ptrs);
    for (int64_t k = 0; k < n_kernels; ++k) {
      if (count[k] > 0) {
        gemm_rows(count[k], a_ptrs + k * cap, b + k * b_stride, a_width, c_width,
                  c_ptrs + k * cap);
      }
    }
    if (stream) stream_rows(c + g0 * c_width, c_tile, sizeof(float) * cap * c_width);
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
                    csr, a_index, kernel_ids, static_cast<uint16_t*>(out),
                    tile_rows_for(cout, csr.groups));
}

}  // namespace mlx_lattice::kernels
