// Internal to the neighbour search (cpu/geometry_knn.cpp, cpu/geometry_radius.cpp):
// support points bucketed in a hashed uniform grid, exact squared distances
// and (distance, row) ordered candidates.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "geometry_detail.h"
#include "geometry_kernels.h"

namespace mlx_lattice::geometry::detail {

// Support points bucketed in a hashed uniform grid (per batch).
class Grid {
 public:
  Grid(const double* pts, const int32_t* batch, int64_t n, double cell);

  int32_t cell_of(double x, int axis) const {
    const double c = std::floor((x - origin_[axis]) * inv_);
    return static_cast<int32_t>(std::clamp(c, -kMaxCell, kMaxCell));
  }

  // Whether p's cell indices are exact (not clamped): only then do cell
  // boxes bound distances; other points are searched by brute force.
  bool in_range(const double* p) const {
    for (int a = 0; a < 3; ++a) {
      if (!(std::fabs(std::floor((p[a] - origin_[a]) * inv_)) < kMaxCell - 4)) return false;
    }
    return true;
  }

  // Lower edge of cell index i along an axis.
  double edge(int64_t i, int axis) const { return origin_[axis] + static_cast<double>(i) * cell_; }

  // Calls fn(support_row) for every point of cell key (batch, cx, cy, cz).
  template <typename F>
  void visit(const int32_t key[4], F&& fn) const {
    const int32_t c = index_->find(key);
    if (c < 0) return;
    for (int32_t i = cells_.offsets[c]; i < cells_.offsets[c + 1]; ++i) fn(cells_.members[i]);
  }

  struct Bounds {
    bool set = false;
    int32_t lo[3] = {0, 0, 0}, hi[3] = {0, 0, 0};
  };
  const Bounds* bounds(int32_t batch) const {
    auto it = bounds_.find(batch);
    return it == bounds_.end() ? nullptr : &it->second;
  }
  double cell() const { return cell_; }
  const double* pts() const { return pts_; }

 private:
  static constexpr double kMaxCell = 1.0e9;
  const double* pts_;
  double inv_, cell_;
  double origin_[3] = {0.0, 0.0, 0.0};
  UniqueRows cells_;
  std::unique_ptr<CoordIndex> index_;
  std::map<int32_t, Bounds> bounds_;
};

// Squared distance in this order of operations, without contraction: every
// search path computes it so, hence equal points give bitwise equal distances.
inline double dist2(const double* q, const double* s) {
  const double dx = q[0] - s[0], dy = q[1] - s[1], dz = q[2] - s[2];
  return dx * dx + dy * dy + dz * dz;
}

// A candidate, ordered by (squared distance, row). Distances are >= +0 (and
// never NaN: points are finite), so their bit patterns order as the values
// do: integer comparisons, without the branches of floating ones. The
// builtin rather than std::bit_cast: GCC 12's <bit> (the libstdc++ of the
// wheel's bookworm sysroot, tools/cc_flags.bzl) spells its constraint with a
// trait newer GCCs refuse to mangle.
struct Cand {
  double d2;
  int32_t row;
  bool operator<(const Cand& o) const {
    const auto a = __builtin_bit_cast(uint64_t, d2), b = __builtin_bit_cast(uint64_t, o.d2);
    return a < b || (a == b && row < o.row);
  }
};

inline void check_points(const double* pts, const int32_t* batch, int64_t n, const char* name,
                         const char* batch_name) {
  check_finite(pts, n, name);
  check_batch(batch, n, batch_name);
}

// A cell size giving about per_cell support points in the cell of an average
// support point (cpu/geometry_grid.cpp).
double pick_cell(const double* pts, const int32_t* batch, int64_t n, double per_cell);

}  // namespace mlx_lattice::geometry::detail
