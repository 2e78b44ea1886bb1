// Geometry kernels between points and voxels: quantization, the trilinear
// point-voxel map, voxel reductions, devoxelization and its transpose.
#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "geometry_detail.h"
#include "geometry_kernels.h"
#include "parallel.h"

namespace mlx_lattice::geometry {

using detail::check_batch;
using detail::check_finite;
using detail::fail;

// ---- points <-> voxels --------------------------------------------------------------------

namespace {

inline bool fits_int32(double v) { return v >= -2147483648.0 && v <= 2147483647.0; }

}  // namespace

Quantized quantize_points(const double* points, const int32_t* batch, int64_t n,
                          const double size[3], const double origin[3]) {
  for (int a = 0; a < 3; ++a) {
    if (!(size[a] > 0) || !std::isfinite(size[a])) fail("voxel_size must be positive and finite.");
    if (!std::isfinite(origin[a])) fail("origin must be finite.");
  }
  check_finite(points, n, "points");
  check_batch(batch, n, "batch");
  std::vector<int32_t> keys(4 * n);
  for (int64_t i = 0; i < n; ++i) {
    keys[4 * i] = batch[i];
    for (int a = 0; a < 3; ++a) {
      const double g = std::floor((points[3 * i + a] - origin[a]) / size[a]);
      if (!fits_int32(g)) {
        std::ostringstream msg;
        msg << "points row " << i << " falls in voxel index " << g
            << ", outside the int32 coordinate range.";
        fail(msg.str());
      }
      keys[4 * i + a + 1] = static_cast<int32_t>(g);
    }
  }
  return {unique_rows(keys.data(), n)};
}

PointVoxel point_voxel_map(const double* points, const int32_t* batch, int64_t n,
                           const int32_t* coords, int64_t n_voxels, const double size[3],
                           const double origin[3]) {
  for (int a = 0; a < 3; ++a) {
    if (!(size[a] > 0) || !std::isfinite(size[a])) fail("voxel_size must be positive and finite.");
    if (!std::isfinite(origin[a])) fail("origin must be finite.");
  }
  check_finite(points, n, "points");
  check_batch(batch, n, "batch");
  if (n > std::numeric_limits<int32_t>::max() / 8) fail("points has too many rows.");
  const CoordIndex index(coords, n_voxels, "coords");
  PointVoxel m;
  m.rows.resize(8 * n);
  m.weights.resize(8 * n);
  m.nearest.resize(n);
  constexpr int64_t kChunk = 2048;  // points per task
  const int64_t n_tasks = (n + kChunk - 1) / kChunk;
  // A point whose voxel indices leave int32 is skipped and reported after the
  // parallel part (the lowest such row), so the tasks never throw.
  std::vector<int64_t> bad(n_tasks, -1);
  parallel_for(n_tasks, [&](int64_t t) {
    const int64_t end = std::min(n, (t + 1) * kChunk);
    // The corner rows of the previous point's cell: consecutive points often
    // share a cell, and the rows are a function of the cell alone.
    int64_t last[4] = {-1, 0, 0, 0};
    int32_t rows[8];
    for (int64_t p = t * kChunk; p < end; ++p) {
      int64_t base[3];
      double frac[3];
      bool ok = true;
      for (int a = 0; a < 3; ++a) {
        const double u = (points[3 * p + a] - origin[a]) / size[a] - 0.5;
        const double f = std::floor(u);
        if (!fits_int32(f) || !fits_int32(f + 1)) {
          ok = false;
          break;
        }
        base[a] = static_cast<int64_t>(f);
        frac[a] = u - f;
      }
      if (!ok) {
        if (bad[t] < 0) bad[t] = p;
        continue;
      }
      const int64_t b = batch[p];
      if (!(b == last[0] && base[0] == last[1] && base[1] == last[2] && base[2] == last[3])) {
        last[0] = b, last[1] = base[0], last[2] = base[1], last[3] = base[2];
        for (int c = 0; c < 8; ++c) {
          const int32_t key[4] = {static_cast<int32_t>(b),
                                  static_cast<int32_t>(base[0] + ((c >> 2) & 1)),
                                  static_cast<int32_t>(base[1] + ((c >> 1) & 1)),
                                  static_cast<int32_t>(base[2] + (c & 1))};
          rows[c] = index.find(key);
        }
      }
      double w[8], total = 0.0;
      for (int c = 0; c < 8; ++c) {
        const int d[3] = {(c >> 2) & 1, (c >> 1) & 1, c & 1};
        double wc = 1.0;
        for (int a = 0; a < 3; ++a) wc *= d[a] ? frac[a] : 1.0 - frac[a];
        w[c] = rows[c] >= 0 ? wc : 0.0;
        total += w[c];
      }
      int best = -1;
      for (int c = 0; c < 8; ++c) {
        m.rows[8 * p + c] = rows[c];
        m.weights[8 * p + c] = total > 0 ? static_cast<float>(w[c] / total) : 0.0f;
        if (rows[c] >= 0 && (best < 0 || w[c] > w[best])) best = c;
      }
      m.nearest[p] = best < 0 ? -1 : rows[best];
    }
  });
  for (int64_t t = 0; t < n_tasks; ++t) {
    if (bad[t] >= 0) {
      std::ostringstream msg;
      msg << "points row " << bad[t] << " is outside the int32 voxel coordinate range.";
      fail(msg.str());
    }
  }
  // Entries grouped by voxel, ascending (counting sort).
  m.offsets.assign(n_voxels + 1, 0);
  for (int64_t e = 0; e < 8 * n; ++e) {
    if (m.rows[e] >= 0) ++m.offsets[m.rows[e] + 1];
  }
  for (int64_t v = 0; v < n_voxels; ++v) m.offsets[v + 1] += m.offsets[v];
  m.entries.resize(m.offsets[n_voxels]);
  std::vector<int32_t> cursor(m.offsets.begin(), m.offsets.end() - 1);
  for (int64_t e = 0; e < 8 * n; ++e) {
    if (m.rows[e] >= 0) m.entries[cursor[m.rows[e]]++] = static_cast<int32_t>(e);
  }
  return m;
}

void voxel_reduce(const float* feats, int64_t channels, const int32_t* offsets,
                  const int32_t* members, int64_t n_voxels, Reduce mode, float* out, int32_t* arg) {
  parallel_for((n_voxels + 511) / 512, [&](int64_t t) {
    const int64_t end = std::min(n_voxels, (t + 1) * 512);
    for (int64_t v = t * 512; v < end; ++v) {
      float* o = out + v * channels;
      int32_t* a = arg ? arg + v * channels : nullptr;
      const int32_t b = offsets[v], e = offsets[v + 1];
      if (b == e) {  // an empty voxel reduces to 0
        std::fill(o, o + channels, 0.0f);
        if (a) std::fill(a, a + channels, -1);
        continue;
      }
      if (mode == Reduce::kFirst || mode == Reduce::kMax) {
        const int32_t p0 = members[b];
        std::copy(feats + p0 * channels, feats + (p0 + 1) * channels, o);
        if (a) std::fill(a, a + channels, p0);
        if (mode == Reduce::kMax) {
          for (int32_t i = b + 1; i < e; ++i) {
            const float* f = feats + static_cast<int64_t>(members[i]) * channels;
            for (int64_t c = 0; c < channels; ++c) {
              if (f[c] > o[c] || (std::isnan(f[c]) && !std::isnan(o[c]))) {
                o[c] = f[c];
                if (a) a[c] = members[i];
              }
            }
          }
        }
        continue;
      }
      std::fill(o, o + channels, 0.0f);
      for (int32_t i = b; i < e; ++i) {
        const float* f = feats + static_cast<int64_t>(members[i]) * channels;
        for (int64_t c = 0; c < channels; ++c) o[c] += f[c];
      }
      if (mode == Reduce::kMean) {
        const float inv = 1.0f / static_cast<float>(e - b);
        for (int64_t c = 0; c < channels; ++c) o[c] *= inv;
      }
    }
  });
}

void devoxelize(const float* vf, int64_t channels, const int32_t* rows, const float* weights,
                const int32_t* nearest, int64_t n_points, bool nearest_mode, float* out) {
  parallel_for((n_points + 1023) / 1024, [&](int64_t t) {
    const int64_t end = std::min(n_points, (t + 1) * 1024);
    for (int64_t p = t * 1024; p < end; ++p) {
      float* o = out + p * channels;
      if (nearest_mode) {
        const int32_t r = nearest[p];
        if (r < 0) {
          std::fill(o, o + channels, 0.0f);
        } else {
          std::copy(vf + r * channels, vf + (r + 1) * channels, o);
        }
        continue;
      }
      std::fill(o, o + channels, 0.0f);
      for (int c = 0; c < 8; ++c) {
        const int32_t r = rows[8 * p + c];
        if (r < 0) continue;
        const float w = weights[8 * p + c];
        const float* f = vf + static_cast<int64_t>(r) * channels;
        for (int64_t k = 0; k < channels; ++k) o[k] += w * f[k];
      }
    }
  });
}

void devoxelize_transpose(const float* g, int64_t channels, const int32_t* rows,
                          const float* weights, const int32_t* nearest, const int32_t* offsets,
                          const int32_t* entries, int64_t n_voxels, bool nearest_mode, float* out) {
  parallel_for((n_voxels + 1023) / 1024, [&](int64_t t) {
    const int64_t end = std::min(n_voxels, (t + 1) * 1024);
    for (int64_t v = t * 1024; v < end; ++v) {
      float* o = out + v * channels;
      std::fill(o, o + channels, 0.0f);
      for (int32_t i = offsets[v]; i < offsets[v + 1]; ++i) {
        const int64_t e = entries[i];
        const int64_t p = e / 8;
        float w;
        if (nearest_mode) {
          if (nearest[p] != v) continue;
          w = 1.0f;
        } else {
          w = weights[e];
        }
        (void)rows;
        const float* gp = g + p * channels;
        for (int64_t k = 0; k < channels; ++k) o[k] += w * gp[k];
      }
    }
  });
}

}  // namespace mlx_lattice::geometry
