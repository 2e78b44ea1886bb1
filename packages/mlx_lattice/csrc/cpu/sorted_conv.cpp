#include "sorted_conv.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "group_by.h"
#include "line_vector.h"
#include "parallel.h"

namespace mlx_lattice::kernels {

void sorted_conv(const float* feats, int64_t cin, const float* weight, int64_t n_kernels,
                 int64_t cout, const int32_t* sorted_map, const int32_t* reorder, int64_t n_out,
                 bool store_sorted, float* out) {
  // A weight off a cache line copied onto one (line_vector.h): each
  // register block of a tile's rows reads an offset's whole B.
  thread_local LineVector<float> weight_copy;
  weight = line_aligned(weight, static_cast<size_t>(n_kernels * cin * cout),
                        this_thread(weight_copy),
                        static_cast<double>(n_out) / kGemmBlockRows);
  const int64_t tiles = ceil_div(n_out, kTileRows);
  parallel_for(tiles, [&](int64_t tile) {
    const int64_t r0 = tile * kTileRows;
    const int64_t r1 = std::min(n_out, r0 + kTileRows);
    // Per-thread scratch, reused across calls: the tile accumulates in a
    // local buffer (its rows are scattered in the output), then each row is
    // written once.
    thread_local struct {
      std::vector<const float*> a_ptrs;
      std::vector<float*> c_ptrs;
      LineVector<float> tile;
    } s_tls;
    auto& s = this_thread(s_tls);
    s.tile.assign((r1 - r0) * cout, 0.0f);
    s.a_ptrs.resize(r1 - r0);
    s.c_ptrs.resize(r1 - r0);
    for (int64_t k = 0; k < n_kernels; ++k) {
      int64_t rows = 0;
      for (int64_t r = r0; r < r1; ++r) {
        int32_t in = sorted_map[r * n_kernels + k];
        if (in < 0) continue;
        s.a_ptrs[rows] = feats + static_cast<int64_t>(in) * cin;
        s.c_ptrs[rows] = s.tile.data() + (r - r0) * cout;
        ++rows;
      }
      if (rows > 0) {
        gemm_rows(rows, s.a_ptrs.data(), weight + k * cin * cout, cin, cout, s.c_ptrs.data());
      }
    }
    for (int64_t r = r0; r < r1; ++r) {
      int64_t row = store_sorted ? r : reorder[r];
      std::memcpy(out + row * cout, s.tile.data() + (r - r0) * cout, sizeof(float) * cout);
    }
  });
}

}  // namespace mlx_lattice::kernels
