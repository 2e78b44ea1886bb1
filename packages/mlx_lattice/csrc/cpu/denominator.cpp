#include "denominator.h"

#include <algorithm>
#include <vector>

#include "group_by.h"
#include "parallel.h"

namespace mlx_lattice::kernels {

void normalization_denominator(const float* weight, int64_t n_kernels, int64_t cin,
                               int64_t cout, const int32_t* kernel_ids, const int32_t* out_offsets,
                               int64_t n_out, float* out) {
  std::vector<float> colsum(n_kernels * cout, 0.0f);
  for (int64_t k = 0; k < n_kernels; ++k) {
    for (int64_t i = 0; i < cin; ++i) {
      for (int64_t x = 0; x < cout; ++x) colsum[k * cout + x] += weight[(k * cin + i) * cout + x];
    }
  }
  parallel_for(ceil_div(n_out, kTileRows), [&](int64_t tile) {
    const int64_t o1 = std::min(n_out, (tile + 1) * kTileRows);
    for (int64_t o = tile * kTileRows; o < o1; ++o) {
      float* row = out + o * cout;
      std::fill(row, row + cout, 0.0f);
      for (int64_t e = out_offsets[o]; e < out_offsets[o + 1]; ++e) {
        const float* s = colsum.data() + static_cast<int64_t>(kernel_ids[e]) * cout;
        for (int64_t x = 0; x < cout; ++x) row[x] += s[x];
      }
    }
  });
}

void denominator_gradient(const float* grad, int64_t cout, const int32_t* kernel_ids,
                          const int32_t* out_offsets, int64_t n_out, int64_t n_kernels,
                          float* out) {
  std::fill(out, out + n_kernels * cout, 0.0f);
  parallel_for(ceil_div(cout, kChannelBlock), [&](int64_t block) {
    const int64_t x0 = block * kChannelBlock;
    const int64_t x1 = std::min(cout, x0 + kChannelBlock);
    for (int64_t o = 0; o < n_out; ++o) {
      for (int64_t e = out_offsets[o]; e < out_offsets[o + 1]; ++e) {
        float* dst = out + static_cast<int64_t>(kernel_ids[e]) * cout;
        for (int64_t x = x0; x < x1; ++x) dst[x] += grad[o * cout + x];
      }
    }
  });
}

}  // namespace mlx_lattice::kernels
