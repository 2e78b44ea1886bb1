// Geometry kernels over coordinates and points: exact k nearest neighbours on
// a uniform grid of cells (optionally within a radius: radius search with
// max_neighbors), and Morton codes. Integer results match the CPU
// kernels (cpu/geometry_*.cpp) exactly; kNN distances are float32 here
// (float64 on the CPU), so rows agree wherever float32 squared distances are
// exact (lattice points such as voxel centres) and otherwise up to ties
// closer than float32 rounding.
#include <metal_stdlib>
using namespace metal;

#define MLXL_KNN_MAX_K 64

struct KnnParams {
  uint nq;
  uint ns;
  uint k;          // <= MLXL_KNN_MAX_K
  uint n_batches;  // support batches; keys = ((b * nx + x) * ny + y) * nz + z
  int nx;
  int ny;
  int nz;
  float ox;
  float oy;
  float oz;
  float inv;  // 1 / cell, as the graph computed the support's keys
  float cell;
  float max_d2;  // radius search: only distances <= this (+inf for kNN)
};

// First index in keys[lo, hi) not below key.
inline uint mlxl_lower_bound(device const int* keys, uint lo, uint hi, int key) {
  while (lo < hi) {
    const uint mid = lo + (hi - lo) / 2;
    if (keys[mid] < key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

inline int mlxl_cell(float x, float o, float inv) {
  const float c = floor((x - o) * inv);
  return int(clamp(c, -16777216.0f, 16777216.0f));
}

// One thread per query: rings of cells (Chebyshev distance R from the
// query's cell) are scanned outward, each cell's points found by binary
// search in the sorted keys, into a sorted list of the k best by (distance,
// row). After ring R every unseen point is at least R cells away along some
// axis, so the search stops once the k-th distance is below R * cell (less a
// rounding slack), or once the rings cover the whole grid.
kernel void mlxl_geo_knn(
    device const float* query [[buffer(0)]],
    device const int* qbatch [[buffer(1)]],
    device const float* support [[buffer(2)]],
    device const int* sorted_rows [[buffer(3)]],
    device const int* sorted_keys [[buffer(4)]],
    device int* out_rows [[buffer(5)]],
    device float* out_d2 [[buffer(6)]],
    constant KnnParams& p [[buffer(7)]],
    uint q [[thread_position_in_grid]]) {
  if (q >= p.nq) return;
  float hd[MLXL_KNN_MAX_K];
  int hr[MLXL_KNN_MAX_K];
  uint n = 0;
  const int b = qbatch[q];
  if (b >= 0 && uint(b) < p.n_batches && p.ns > 0) {
    const float qx = query[3 * q], qy = query[3 * q + 1], qz = query[3 * q + 2];
    const int hx = mlxl_cell(qx, p.ox, p.inv);
    const int hy = mlxl_cell(qy, p.oy, p.inv);
    const int hz = mlxl_cell(qz, p.oz, p.inv);
    // Cells far outside the grid were clamped: only the coverage test stops.
    const bool exact_cell = abs(hx) < 16000000 && abs(hy) < 16000000 && abs(hz) < 16000000;
    // Rounding of the cell assignment and of the float32 distances.
    const float reach = max(max(abs(qx - p.ox), abs(qy - p.oy)), abs(qz - p.oz)) +
                        p.cell * float(max(max(p.nx, p.ny), p.nz));
    const float slack = 1e-4f * p.cell + 4e-6f * reach;
    int first = max(max(0, max(-hx, hx - (p.nx - 1))), max(max(0, max(-hy, hy - (p.ny - 1))),
                                                            max(0, max(-hz, hz - (p.nz - 1)))));
    for (int ring = first;; ++ring) {
      const int lx = max(hx - ring, 0), ux = min(hx + ring, p.nx - 1);
      const int ly = max(hy - ring, 0), uy = min(hy + ring, p.ny - 1);
      const int lz = max(hz - ring, 0), uz = min(hz + ring, p.nz - 1);
      for (int x = lx; x <= ux; ++x) {
        const bool xe = x == hx - ring || x == hx + ring;
        for (int y = ly; y <= uy; ++y) {
          const bool shell = xe || y == hy - ring || y == hy + ring;
          // Inside the shell only the two z faces are new.
          const int zstep = shell ? 1 : max(2 * ring, 1);
          for (int z = shell ? lz : hz - ring; z <= (shell ? uz : hz + ring); z += zstep) {
            if (z < lz || z > uz) continue;
            const int key = ((b * p.nx + x) * p.ny + y) * p.nz + z;
            const uint lo = mlxl_lower_bound(sorted_keys, 0, p.ns, key);
            const uint hi = mlxl_lower_bound(sorted_keys, lo, p.ns, key + 1);
            for (uint j = lo; j < hi; ++j) {
              const float dx = qx - support[3 * j];
              const float dy = qy - support[3 * j + 1];
              const float dz = qz - support[3 * j + 2];
              const float d = dx * dx + dy * dy + dz * dz;
              if (d > p.max_d2) continue;
              const int row = sorted_rows[j];
              uint pos;
              if (n < p.k) {
                pos = n++;
              } else if (d < hd[p.k - 1] || (d == hd[p.k - 1] && row < hr[p.k - 1])) {
                pos = p.k - 1;
              } else {
                continue;
              }
              while (pos > 0 && (d < hd[pos - 1] || (d == hd[pos - 1] && row < hr[pos - 1]))) {
                hd[pos] = hd[pos - 1];
                hr[pos] = hr[pos - 1];
                --pos;
              }
              hd[pos] = d;
              hr[pos] = row;
            }
          }
        }
      }
      const bool covered = hx - ring <= 0 && hx + ring >= p.nx - 1 && hy - ring <= 0 &&
                           hy + ring >= p.ny - 1 && hz - ring <= 0 && hz + ring >= p.nz - 1;
      if (covered) break;
      if (exact_cell) {
        const float margin = float(ring) * p.cell - slack;
        if (margin > 0.0f && n == p.k && hd[p.k - 1] < margin * margin) break;
        if (margin > 0.0f && margin * margin > p.max_d2) break;  // the rest is beyond the radius
      }
    }
  }
  for (uint j = 0; j < p.k; ++j) {
    out_rows[size_t(q) * p.k + j] = j < n ? hr[j] : -1;
    out_d2[size_t(q) * p.k + j] = j < n ? hd[j] : INFINITY;
  }
}

// Morton code of each row's (x, y, z), biased by 2^20 (21 bits per axis;
// bit i of x at 3i + 2, of y at 3i + 1, of z at 3i). The range is validated
// before the kernel runs.
kernel void mlxl_geo_morton(
    device const int* coords [[buffer(0)]],
    device long* codes [[buffer(1)]],
    constant uint& n [[buffer(2)]],
    uint r [[thread_position_in_grid]]) {
  if (r >= n) return;
  ulong code = 0;
  for (uint a = 0; a < 3; ++a) {
    const ulong v = ulong(long(coords[4 * r + 1 + a]) + 1048576);
    const uint shift = 2 - a;
    for (uint bit = 0; bit < 21; ++bit) code |= ((v >> bit) & 1ul) << (3 * bit + shift);
  }
  codes[r] = long(code);
}

struct RadiusParams {
  uint nq;
  uint ns;
  uint n_batches;
  int nx;
  int ny;
  int nz;
  float ox;
  float oy;
  float oz;
  float inv;
  float cell;
  float max_d2;  // r^2
  int reach;     // cells scanned around the query's cell per axis
  uint fill;     // 0: count the neighbours; 1: write them at offsets[q]
};

// Radius search without a cap, in two passes over the same cells: one
// thread per query counts the support points within r (fill = 0); after a
// prefix sum of the counts (offsets), the second pass (fill = 1) writes them
// into [offsets[q], offsets[q + 1]) and sorts that range by (squared
// distance, row) with an insertion sort. Distances are float32, as in kNN.
kernel void mlxl_geo_radius(
    device const float* query [[buffer(0)]],
    device const int* qbatch [[buffer(1)]],
    device const float* support [[buffer(2)]],
    device const int* sorted_rows [[buffer(3)]],
    device const int* sorted_keys [[buffer(4)]],
    device const int* offsets [[buffer(5)]],
    device int* counts [[buffer(6)]],
    device int* out_rows [[buffer(7)]],
    device float* out_d2 [[buffer(8)]],
    constant RadiusParams& p [[buffer(9)]],
    uint q [[thread_position_in_grid]]) {
  if (q >= p.nq) return;
  const uint base = p.fill ? uint(offsets[q]) : 0u;
  uint n = 0;
  const int b = qbatch[q];
  if (b >= 0 && uint(b) < p.n_batches && p.ns > 0) {
    const float qx = query[3 * q], qy = query[3 * q + 1], qz = query[3 * q + 2];
    const int hx = mlxl_cell(qx, p.ox, p.inv);
    const int hy = mlxl_cell(qy, p.oy, p.inv);
    const int hz = mlxl_cell(qz, p.oz, p.inv);
    const int lx = max(hx - p.reach, 0), ux = min(hx + p.reach, p.nx - 1);
    const int ly = max(hy - p.reach, 0), uy = min(hy + p.reach, p.ny - 1);
    const int lz = max(hz - p.reach, 0), uz = min(hz + p.reach, p.nz - 1);
    for (int x = lx; x <= ux; ++x) {
      for (int y = ly; y <= uy; ++y) {
        const int key0 = ((b * p.nx + x) * p.ny + y) * p.nz;
        if (lz > uz) continue;
        // The cells z = lz..uz of this (x, y) are consecutive keys.
        const uint lo = mlxl_lower_bound(sorted_keys, 0, p.ns, key0 + lz);
        const uint hi = mlxl_lower_bound(sorted_keys, lo, p.ns, key0 + uz + 1);
        for (uint j = lo; j < hi; ++j) {
          const float dx = qx - support[3 * j];
          const float dy = qy - support[3 * j + 1];
          const float dz = qz - support[3 * j + 2];
          const float d = dx * dx + dy * dy + dz * dz;
          if (d > p.max_d2) continue;
          if (p.fill) {
            out_rows[base + n] = sorted_rows[j];
            out_d2[base + n] = d;
          }
          ++n;
        }
      }
    }
  }
  if (!p.fill) {
    counts[q] = int(n);
    return;
  }
  for (uint i = 1; i < n; ++i) {
    const float d = out_d2[base + i];
    const int row = out_rows[base + i];
    uint pos = i;
    while (pos > 0 && (d < out_d2[base + pos - 1] ||
                       (d == out_d2[base + pos - 1] && row < out_rows[base + pos - 1]))) {
      out_d2[base + pos] = out_d2[base + pos - 1];
      out_rows[base + pos] = out_rows[base + pos - 1];
      --pos;
    }
    out_d2[base + pos] = d;
    out_rows[base + pos] = row;
  }
}
