// Geometry kernels between points and voxels: quantization, the trilinear
// point-voxel map, voxel reductions, devoxelization and its transpose.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "geometry_detail.h"
#include "geometry_kernels.h"
#include "isa.h"
#include "parallel.h"

namespace mlx_lattice::geometry {

using detail::check_batch;
using detail::check_finite;
using detail::fail;

// ---- points <-> voxels --------------------------------------------------------------------

namespace {

inline bool fits_int32(double v) { return v >= -2147483648.0 && v <= 2147483647.0; }

// The entries e of rows (-1 = none) grouped by voxel, ascending in e: a
// counting sort, each task counting its own slice of the entries (one
// histogram per slice), the slices' counts turned into each slice's start
// within every voxel, then each task placing its slice. The slices change
// speed, never the arrays.
void group_entries(const int32_t* rows, int64_t n_entries, int64_t n_voxels,
                   std::vector<int32_t>& offsets, std::vector<int32_t>& entries) {
  // Histograms cost n_voxels ints each: no more slices than the entries
  // justify (and at most one per thread).
  const int64_t n_slices = std::max<int64_t>(
      1, std::min<int64_t>({static_cast<int64_t>(std::max(1, get_num_threads())),
                            n_entries / 65536, 4 * n_entries / std::max<int64_t>(n_voxels, 1)}));
  std::vector<int32_t> counts(n_slices * n_voxels, 0);
  auto slice_of = [&](int64_t t) {
    return std::make_pair(n_entries * t / n_slices, n_entries * (t + 1) / n_slices);
  };
  const uint32_t span = static_cast<uint32_t>(n_voxels);
  parallel_for(n_slices, [&](int64_t t) {
    const auto [lo, hi] = slice_of(t);
    int32_t* c = counts.data() + t * n_voxels;
    for (int64_t e = lo; e < hi; ++e) {
      const uint32_t v = static_cast<uint32_t>(rows[e]);  // -1 wraps: skipped
      if (v < span) ++c[v];
    }
  });
  offsets.assign(n_voxels + 1, 0);
  for (int64_t v = 0; v < n_voxels; ++v) {
    int32_t at = offsets[v];
    for (int64_t t = 0; t < n_slices; ++t) {
      const int32_t k = counts[t * n_voxels + v];
      counts[t * n_voxels + v] = at;  // slice t's first slot in voxel v
      at += k;
    }
    offsets[v + 1] = at;
  }
  entries.resize(offsets[n_voxels]);
  parallel_for(n_slices, [&](int64_t t) {
    const auto [lo, hi] = slice_of(t);
    int32_t* cursor = counts.data() + t * n_voxels;
    for (int64_t e = lo; e < hi; ++e) {
      const uint32_t v = static_cast<uint32_t>(rows[e]);
      if (v < span) entries[cursor[v]++] = static_cast<int32_t>(e);
    }
  });
}

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
        for (int c = 0; c < 8; c += 2) {
          int32_t key[4] = {static_cast<int32_t>(b), static_cast<int32_t>(base[0] + ((c >> 2) & 1)),
                            static_cast<int32_t>(base[1] + ((c >> 1) & 1)),
                            static_cast<int32_t>(base[2])};
          rows[c] = index.find(key);
          key[3] += 1;
          // Corner c + 1 is corner c one step along z: in coordinates
          // sorted like the tensors' (batch, x, y, z), usually the next row.
          // The rows are distinct, so a match there is the row; else search.
          const int64_t next = static_cast<int64_t>(rows[c]) + 1;
          const bool adjacent = rows[c] >= 0 && next < n_voxels &&
                                std::memcmp(coords + 4 * next, key, sizeof(key)) == 0;
          rows[c + 1] = adjacent ? static_cast<int32_t>(next) : index.find(key);
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
  group_entries(m.rows.data(), 8 * n, n_voxels, m.offsets, m.entries);
  return m;
}

namespace {

// The channel loops below run on 8-float vectors (GCC/Clang vector
// extensions: two SSE registers by default, one AVX register in the avx2
// builds). Each output element is still the scalar loop's chain of separate
// multiplies and adds in the same order (no FMA contraction), so every ISA
// gives the same bits.
using V8 = float __attribute__((vector_size(32)));
// The same vector at any float's address (unaligned, may alias floats).
using V8u = float __attribute__((vector_size(32), aligned(4), may_alias));

// 8 unsigned ints (unaligned), and 4 64-bit lanes to test a comparison mask.
using V8ui = uint32_t __attribute__((vector_size(32)));
using V8uiu = uint32_t __attribute__((vector_size(32), aligned(4), may_alias));
using V4ull = unsigned long long __attribute__((vector_size(32)));

#define load8(p) (*reinterpret_cast<const V8u*>(p))
#define load8ui(p) (*reinterpret_cast<const V8uiu*>(p))
#define store8(p, v) (*reinterpret_cast<V8u*>(p) = (v))

// o[k] += w * f[k] for k < n.
__attribute__((always_inline)) inline void add_scaled(float* __restrict o, float w,
                                                      const float* __restrict f, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) store8(o + k, load8(o + k) + w * load8(f + k));
  for (; k < n; ++k) o[k] += w * f[k];
}

// o[k] += f[k] for k < n.
__attribute__((always_inline)) inline void add_row(float* __restrict o, const float* __restrict f,
                                                   int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) store8(o + k, load8(o + k) + load8(f + k));
  for (; k < n; ++k) o[k] += f[k];
}

// Linear devoxelization of points [p0, p1): the 8 corners summed in a
// register per 8 channels (0 + w0 f0 + w1 f1 + ..., corners in order).
__attribute__((always_inline)) inline void devoxelize_linear_rows(
    const float* vf, int64_t channels, const int32_t* rows, const float* weights, int64_t p0,
    int64_t p1, float* out) {
  for (int64_t p = p0; p < p1; ++p) {
    float* o = out + p * channels;
    const int32_t* r = rows + 8 * p;
    const float* w = weights + 8 * p;
    int64_t k = 0;
    for (; k + 16 <= channels; k += 16) {
      V8 a = {}, b = {};
      for (int c = 0; c < 8; ++c) {
        if (r[c] < 0) continue;
        const float* f = vf + static_cast<int64_t>(r[c]) * channels + k;
        a = a + w[c] * load8(f);
        b = b + w[c] * load8(f + 8);
      }
      store8(o + k, a);
      store8(o + k + 8, b);
    }
    for (; k + 8 <= channels; k += 8) {
      V8 a = {};
      for (int c = 0; c < 8; ++c) {
        if (r[c] >= 0) a = a + w[c] * load8(vf + static_cast<int64_t>(r[c]) * channels + k);
      }
      store8(o + k, a);
    }
    for (; k < channels; ++k) {
      float a = 0.0f;
      for (int c = 0; c < 8; ++c) {
        if (r[c] >= 0) a += w[c] * vf[static_cast<int64_t>(r[c]) * channels + k];
      }
      o[k] = a;
    }
  }
}

// The transpose for voxels [v0, v1), point-major: the points in ascending
// order add into the rows of their corners inside the range, so each voxel
// still sums its entries in ascending (point, corner) order, while every
// point's gradient row is read once (not once per corner, at random).
__attribute__((always_inline)) inline void devoxelize_transpose_range(
    const float* g, int64_t channels, const int32_t* rows, const float* weights,
    const int32_t* nearest, int64_t n_points, bool nearest_mode, int64_t v0, int64_t v1,
    float* out) {
  std::fill(out + v0 * channels, out + v1 * channels, 0.0f);
  const uint32_t span = static_cast<uint32_t>(v1 - v0);
  const V8ui v0u = V8ui{} + static_cast<uint32_t>(v0);
  const V8ui spanu = V8ui{} + span;
  for (int64_t p = 0; p < n_points; ++p) {
    const float* gp = g + p * channels;
    if (nearest_mode) {
      const uint32_t v = static_cast<uint32_t>(nearest[p] - v0);  // -1 wraps: skipped
      if (v < span) add_row(out + (v0 + v) * channels, gp, channels);
      continue;
    }
    // The 8 corners tested at once: most points have none in the range.
    const V8ui d = load8ui(rows + 8 * p) - v0u;  // -1 wraps: outside
    const V4ull in = __builtin_bit_cast(V4ull, d < spanu);
    if ((in[0] | in[1] | in[2] | in[3]) == 0) continue;
    for (int c = 0; c < 8; ++c) {
      const uint32_t v = static_cast<uint32_t>(rows[8 * p + c] - v0);
      if (v < span) add_scaled(out + (v0 + v) * channels, weights[8 * p + c], gp, channels);
    }
  }
}

// Sum of a voxel's member rows (ascending), times inv when mean.
__attribute__((always_inline)) inline void voxel_sum_rows(const float* feats, int64_t channels,
                                                          const int32_t* members, int32_t b,
                                                          int32_t e, bool mean, float* o) {
  int64_t k = 0;
  const float inv = 1.0f / static_cast<float>(e - b);
  for (; k + 8 <= channels; k += 8) {
    V8 a = {};
    for (int32_t i = b; i < e; ++i) {
      a = a + load8(feats + static_cast<int64_t>(members[i]) * channels + k);
    }
    store8(o + k, mean ? a * inv : a);
  }
  for (; k < channels; ++k) {
    float a = 0.0f;
    for (int32_t i = b; i < e; ++i) a += feats[static_cast<int64_t>(members[i]) * channels + k];
    o[k] = mean ? a * inv : a;
  }
}

// Each kernel body twice on x86-64: the default target and AVX2, picked at
// run time; once elsewhere.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MLX_LATTICE_TWO_ISAS(name, params, args) \
  void name##_base params { name##_body args; } \
  __attribute__((target("avx2"))) void name##_avx2 params { name##_body args; }
// The AVX2 body where cpu/isa.h allows it (MLX_LATTICE_GEMM_ISA caps it).
#define MLX_LATTICE_PICK(name) \
  (isa::isa_usable(isa::Isa::kAvx2) ? name##_avx2 : name##_base)
#else
#define MLX_LATTICE_TWO_ISAS(name, params, args) \
  void name##_base params { name##_body args; }
#define MLX_LATTICE_PICK(name) name##_base
#endif

#define devoxelize_rows_body devoxelize_linear_rows
MLX_LATTICE_TWO_ISAS(devoxelize_rows,
                     (const float* vf, int64_t ch, const int32_t* rows, const float* w, int64_t p0,
                      int64_t p1, float* out),
                     (vf, ch, rows, w, p0, p1, out))
#define transpose_range_body devoxelize_transpose_range
MLX_LATTICE_TWO_ISAS(transpose_range,
                     (const float* g, int64_t ch, const int32_t* rows, const float* w,
                      const int32_t* nearest, int64_t n, bool nm, int64_t v0, int64_t v1,
                      float* out),
                     (g, ch, rows, w, nearest, n, nm, v0, v1, out))
#define sum_rows_body voxel_sum_rows
MLX_LATTICE_TWO_ISAS(sum_rows,
                     (const float* f, int64_t ch, const int32_t* m, int32_t b, int32_t e, bool mean,
                      float* o),
                     (f, ch, m, b, e, mean, o))

}  // namespace

void voxel_reduce(const float* feats, int64_t channels, const int32_t* offsets,
                  const int32_t* members, int64_t n_voxels, Reduce mode, float* out, int32_t* arg) {
  const auto sum_rows = MLX_LATTICE_PICK(sum_rows);
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
      sum_rows(feats, channels, members, b, e, mode == Reduce::kMean, o);
    }
  });
}

void devoxelize(const float* vf, int64_t channels, const int32_t* rows, const float* weights,
                const int32_t* nearest, int64_t n_points, bool nearest_mode, float* out) {
  const auto linear_rows = MLX_LATTICE_PICK(devoxelize_rows);
  parallel_for((n_points + 1023) / 1024, [&](int64_t t) {
    const int64_t begin = t * 1024, end = std::min(n_points, (t + 1) * 1024);
    if (!nearest_mode) {
      linear_rows(vf, channels, rows, weights, begin, end, out);
      return;
    }
    for (int64_t p = begin; p < end; ++p) {
      float* o = out + p * channels;
      const int32_t r = nearest[p];
      if (r < 0) {
        std::fill(o, o + channels, 0.0f);
      } else {
        std::copy(vf + r * channels, vf + (r + 1) * channels, o);
      }
    }
  });
}

void devoxelize_transpose(const float* g, int64_t channels, const int32_t* rows,
                          const float* weights, const int32_t* nearest, const int32_t* offsets,
                          int64_t n_voxels, int64_t n_points, bool nearest_mode, float* out) {
  // Voxel ranges of about equal entry counts, a few per thread; each task
  // scans every point's corners (cheap next to the channel work) and owns
  // its range's output rows. The range bounds change speed, never bits.
  const int64_t total = offsets[n_voxels];
  const int64_t n_tasks = std::max<int64_t>(
      1, std::min<int64_t>({n_voxels, 4 * static_cast<int64_t>(std::max(1, get_num_threads())),
                            total / 4096 + 1}));
  std::vector<int64_t> bounds(n_tasks + 1, n_voxels);
  bounds[0] = 0;
  for (int64_t t = 1; t < n_tasks; ++t) {
    const int64_t want = total * t / n_tasks;
    bounds[t] = std::max<int64_t>(
        bounds[t - 1], std::lower_bound(offsets, offsets + n_voxels + 1, want) - offsets);
    bounds[t] = std::min(bounds[t], n_voxels);
  }
  const auto range = MLX_LATTICE_PICK(transpose_range);
  parallel_for(n_tasks, [&](int64_t t) {
    if (bounds[t] < bounds[t + 1]) {
      range(g, channels, rows, weights, nearest, n_points, nearest_mode, bounds[t], bounds[t + 1],
            out);
    }
  });
}

#undef load8
#undef load8ui
#undef store8

}  // namespace mlx_lattice::geometry
