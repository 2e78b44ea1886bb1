// Geometry kernels: points <-> voxels (geometry_voxels.cpp), exact neighbour
// search (geometry_knn.cpp, geometry_radius.cpp over the grid of
// geometry_grid.h), coordinate sets (geometry_coords.cpp).
//
// Plain C++ over pointers (no MLX include). Every routine is deterministic:
// results never depend on the thread count, and ties are broken by index.
// Errors are std::invalid_argument with a message naming the argument; every
// index read from an input is validated before memory is touched.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mlx_lattice::geometry {

// ---- coordinate sets ----------------------------------------------------------------------

// Stable order of n (batch, x, y, z) rows sorted lexicographically; ties keep
// input order. keys is n x 4 int32.
std::vector<int32_t> sort_rows(const int32_t* keys, int64_t n);

// Unique rows of keys (sorted) with the inverse map and the rows grouped per
// unique row (ascending input index inside a group).
struct UniqueRows {
  std::vector<int32_t> coords;   // n_unique x 4
  std::vector<int32_t> inverse;  // n
  std::vector<int32_t> offsets;  // n_unique + 1
  std::vector<int32_t> members;  // n, grouped by unique row
};
UniqueRows unique_rows(const int32_t* keys, int64_t n);

// Exact hash index of a coordinate set (full-key comparison; no collisions
// can alias). Raises on duplicate rows, naming `name` and both rows.
class CoordIndex {
 public:
  CoordIndex(const int32_t* coords, int64_t n, const std::string& name);
  // Row of coordinate c (4 int32) or -1.
  int32_t find(const int32_t* c) const;

 private:
  const int32_t* coords_;
  uint64_t mask_ = 0;
  std::vector<int32_t> slots_;
};

// For each query row: its row in coords or -1.
std::vector<int32_t> lookup(const int32_t* coords, int64_t n, const int32_t* queries, int64_t q,
                            const std::string& name);

// Merge of two duplicate-free sets in sorted order: rows of the union (or the
// intersection) with the row of each in a and in b (-1 where absent).
struct Merged {
  std::vector<int32_t> coords;
  std::vector<int32_t> a_rows;
  std::vector<int32_t> b_rows;
};
Merged merge_sets(const int32_t* a, int64_t na, const int32_t* b, int64_t nb, bool intersection);

// Morton code of each row's (x, y, z): each coordinate biased by 2^20 must
// lie in [0, 2^21); bit 3i+2 holds bit i of x, 3i+1 of y, 3i of z.
std::vector<int64_t> morton_codes(const int32_t* coords, int64_t n);
// Raises unless every row's (x, y, z) is in the Morton range.
void check_morton_range(const int32_t* coords, int64_t n);

// ---- points <-> voxels --------------------------------------------------------------------

struct Quantized {
  UniqueRows voxels;
};
// grid = floor((p - origin) / size) in float64; raises on non-finite points or
// voxel indices outside int32.
Quantized quantize_points(const double* points, const int32_t* batch, int64_t n,
                          const double size[3], const double origin[3]);

struct PointVoxel {
  std::vector<int32_t> rows;     // n x 8
  std::vector<float> weights;    // n x 8
  std::vector<int32_t> nearest;  // n
  std::vector<int32_t> offsets;  // n_voxels + 1: entries grouped by voxel
  std::vector<int32_t> entries;  // 8p + c, ascending inside a voxel
};
PointVoxel point_voxel_map(const double* points, const int32_t* batch, int64_t n,
                           const int32_t* coords, int64_t n_voxels, const double size[3],
                           const double origin[3]);

// Reductions of float32 point features onto voxels given the voxel grouping
// (other dtypes are cast by the graph code). arg (n_voxels x channels) gets
// the point chosen by max/first (the first maximum in point order).
enum class Reduce { kSum = 0, kMean = 1, kMax = 2, kFirst = 3 };
void voxel_reduce(const float* feats, int64_t channels, const int32_t* offsets,
                  const int32_t* members, int64_t n_voxels, Reduce mode, float* out, int32_t* arg);

// out[p] = sum_c w[p, c] * vf[rows[p, c]] (linear) or vf[nearest[p]] (nearest).
void devoxelize(const float* vf, int64_t channels, const int32_t* rows, const float* weights,
                const int32_t* nearest, int64_t n_points, bool nearest_mode, float* out);

// The transpose: out[v] = sum over entries (p, c) of v of w[p, c] * g[p] (or g[p]
// where nearest[p] == v), in ascending entry order. offsets (n_voxels + 1)
// count each voxel's entries (they balance the work).
void devoxelize_transpose(const float* g, int64_t channels, const int32_t* rows, const float* weights,
                          const int32_t* nearest, const int32_t* offsets, int64_t n_voxels,
                          int64_t n_points, bool nearest_mode, float* out);

// ---- neighbours ---------------------------------------------------------------------------

// Neighbours of every query among support points of the same batch, ordered
// by (squared distance, support row); grouped by query.
struct Neighbors {
  std::vector<int32_t> offsets;  // q + 1
  std::vector<int32_t> rows;     // support rows
  std::vector<double> dist2;
};
// kNN as a table: row q of rows / dist2 (nq x width, width >= min(k, ns))
// holds q's neighbours nearest first, then -1 / +inf.
void knn(const double* query, const int32_t* qbatch, int64_t nq, const double* support,
         const int32_t* sbatch, int64_t ns, int64_t k, int64_t width, int32_t* rows,
         float* dist2);
// All support points with distance <= r (at most max_neighbors nearest when > 0).
Neighbors radius_search(const double* query, const int32_t* qbatch, int64_t nq,
                        const double* support, const int32_t* sbatch, int64_t ns, double r,
                        int64_t max_neighbors);

}  // namespace mlx_lattice::geometry
