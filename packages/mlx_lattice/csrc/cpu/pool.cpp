#include "pool.h"

#include <algorithm>

#include "group_by.h"
#include "parallel.h"

namespace mlx_lattice::kernels {

namespace {

// First edge (in CSR order) holding the maximum of channel x among o's edges.
inline int64_t argmax_edge(const float* feats, int64_t channels, const int32_t* in_rows,
                           int64_t e0, int64_t e1, int64_t x) {
  int64_t best = e0;
  float best_value = feats[static_cast<int64_t>(in_rows[e0]) * channels + x];
  for (int64_t e = e0 + 1; e < e1; ++e) {
    float v = feats[static_cast<int64_t>(in_rows[e]) * channels + x];
    if (v > best_value) {
      best_value = v;
      best = e;
    }
  }
  return best;
}

}  // namespace

void pool_forward(const float* feats, int64_t channels, const int32_t* in_rows,
                  const int32_t* out_offsets, int64_t n_out, PoolMode mode, float* out) {
  parallel_for(ceil_div(n_out, kTileRows), [&](int64_t tile) {
    const int64_t o1 = std::min(n_out, (tile + 1) * kTileRows);
    for (int64_t o = tile * kTileRows; o < o1; ++o) {
      float* row = out + o * channels;
      const int64_t e0 = out_offsets[o];
      const int64_t e1 = out_offsets[o + 1];
      if (e0 == e1) {
        std::fill(row, row + channels, 0.0f);
        continue;
      }
      const float* first = feats + static_cast<int64_t>(in_rows[e0]) * channels;
      std::copy(first, first + channels, row);
      for (int64_t e = e0 + 1; e < e1; ++e) {
        const float* f = feats + static_cast<int64_t>(in_rows[e]) * channels;
        if (mode == PoolMode::kMax) {
          for (int64_t x = 0; x < channels; ++x) row[x] = f[x] > row[x] ? f[x] : row[x];
        } else {
          for (int64_t x = 0; x < channels; ++x) row[x] += f[x];
        }
      }
      if (mode == PoolMode::kAvg) {
        const float inv = 1.0f / static_cast<float>(e1 - e0);
        for (int64_t x = 0; x < channels; ++x) row[x] *= inv;
      }
    }
  });
}

void pool_max_select(const float* feats, const float* tangent, int64_t channels,
                     const int32_t* in_rows, const int32_t* out_offsets, int64_t n_out,
                     float* out) {
  parallel_for(ceil_div(n_out, kTileRows), [&](int64_t tile) {
    const int64_t o1 = std::min(n_out, (tile + 1) * kTileRows);
    for (int64_t o = tile * kTileRows; o < o1; ++o) {
      const int64_t e0 = out_offsets[o];
      const int64_t e1 = out_offsets[o + 1];
      for (int64_t x = 0; x < channels; ++x) {
        float v = 0.0f;
        if (e1 > e0) {
          int64_t e = argmax_edge(feats, channels, in_rows, e0, e1, x);
          v = tangent[static_cast<int64_t>(in_rows[e]) * channels + x];
        }
        out[o * channels + x] = v;
      }
    }
  });
}

void pool_backward(const float* grad, const float* feats, int64_t channels,
                   const int32_t* in_rows, const int32_t* out_offsets, int64_t n_out,
                   int64_t n_in, PoolMode mode, float* dfeats) {
  std::fill(dfeats, dfeats + n_in * channels, 0.0f);
  parallel_for(ceil_div(channels, kChannelBlock), [&](int64_t block) {
    const int64_t x0 = block * kChannelBlock;
    const int64_t x1 = std::min(channels, x0 + kChannelBlock);
    for (int64_t o = 0; o < n_out; ++o) {
      const int64_t e0 = out_offsets[o];
      const int64_t e1 = out_offsets[o + 1];
      if (e0 == e1) continue;
      const float* g = grad + o * channels;
      if (mode == PoolMode::kMax) {
        for (int64_t x = x0; x < x1; ++x) {
          int64_t e = argmax_edge(feats, channels, in_rows, e0, e1, x);
          dfeats[static_cast<int64_t>(in_rows[e]) * channels + x] += g[x];
        }
        continue;
      }
      const float scale = mode == PoolMode::kAvg ? 1.0f / static_cast<float>(e1 - e0) : 1.0f;
      for (int64_t e = e0; e < e1; ++e) {
        float* d = dfeats + static_cast<int64_t>(in_rows[e]) * channels;
        for (int64_t x = x0; x < x1; ++x) d[x] += g[x] * scale;
      }
    }
  });
}

}  // namespace mlx_lattice::kernels
