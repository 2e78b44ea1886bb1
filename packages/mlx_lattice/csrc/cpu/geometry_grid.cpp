// The neighbour search's grid: construction and the choice of cell size.
#include <algorithm>
#include <cmath>
#include <vector>

#include "geometry_grid.h"

namespace mlx_lattice::geometry::detail {

Grid::Grid(const double* pts, const int32_t* batch, int64_t n, double cell)
    : pts_(pts), inv_(1.0 / cell), cell_(cell) {
  // Cells are counted from the support's minimum corner, so indices stay
  // small wherever the points are.
  for (int a = 0; a < 3; ++a) origin_[a] = n ? pts[a] : 0.0;
  for (int64_t i = 0; i < n; ++i) {
    for (int a = 0; a < 3; ++a) origin_[a] = std::min(origin_[a], pts[3 * i + a]);
  }
  std::vector<int32_t> keys(4 * n);
  for (int64_t i = 0; i < n; ++i) {
    keys[4 * i] = batch[i];
    for (int a = 0; a < 3; ++a) keys[4 * i + a + 1] = cell_of(pts[3 * i + a], a);
  }
  cells_ = unique_rows(keys.data(), n);
  index_ = std::make_unique<CoordIndex>(cells_.coords.data(),
                                        static_cast<int64_t>(cells_.offsets.size()) - 1, "cells");
  // Cell bounds per batch, so a ring search knows when it has seen everything.
  for (size_t c = 0; c + 1 < cells_.offsets.size(); ++c) {
    const int32_t* k = cells_.coords.data() + 4 * c;
    auto& b = bounds_[k[0]];
    if (!b.set) {
      for (int a = 0; a < 3; ++a) b.lo[a] = b.hi[a] = k[a + 1];
      b.set = true;
    }
    for (int a = 0; a < 3; ++a) {
      b.lo[a] = std::min(b.lo[a], k[a + 1]);
      b.hi[a] = std::max(b.hi[a], k[a + 1]);
    }
  }
}

// A cell size giving a few points per occupied cell: the bounding-box
// estimate, halved while occupied cells hold many more points than wanted.
double pick_cell(const double* pts, const int32_t* batch, int64_t n, double per_cell) {
  double lo[3], hi[3];
  for (int a = 0; a < 3; ++a) lo[a] = hi[a] = n ? pts[a] : 0.0;
  for (int64_t i = 0; i < n; ++i) {
    for (int a = 0; a < 3; ++a) {
      lo[a] = std::min(lo[a], pts[3 * i + a]);
      hi[a] = std::max(hi[a], pts[3 * i + a]);
    }
  }
  double extent = 0;
  for (int a = 0; a < 3; ++a) extent = std::max(extent, hi[a] - lo[a]);
  if (!(extent > 0)) return 1.0;
  double vol = 1.0;
  for (int a = 0; a < 3; ++a) vol *= std::max(hi[a] - lo[a], extent * 1e-3);
  double cell = std::cbrt(vol * per_cell / std::max<int64_t>(n, 1));
  // Refine on the occupancy of the full set: points usually lie on surfaces,
  // far denser than the bounding box suggests. Counts scale roughly with the
  // cell area there, hence the square-root steps.
  std::vector<int32_t> keys(4 * n);
  for (int iter = 0; iter < 10; ++iter) {
    for (int64_t i = 0; i < n; ++i) {
      keys[4 * i] = batch[i];
      for (int a = 0; a < 3; ++a) {
        keys[4 * i + a + 1] = static_cast<int32_t>(
            std::clamp(std::floor((pts[3 * i + a] - lo[a]) / cell), -1e9, 1e9));
      }
    }
    // Points in the cell of an average point (sum of squared counts / n):
    // what a query pays, dominated by the dense regions.
    const auto order = sort_rows(keys.data(), n);
    double sum_sq = 0.0;
    int64_t run = n ? 1 : 0;
    for (int64_t i = 1; i <= n; ++i) {
      if (i < n && same_row(keys.data() + 4 * static_cast<int64_t>(order[i]),
                            keys.data() + 4 * static_cast<int64_t>(order[i - 1]))) {
        ++run;
      } else {
        sum_sq += static_cast<double>(run) * static_cast<double>(run);
        run = 1;
      }
    }
    const double per = n ? sum_sq / static_cast<double>(n) : 0.0;
    if (per <= 1.4 * per_cell && per >= 0.7 * per_cell) break;
    const double factor = std::clamp(std::sqrt(per_cell / per), 0.25, 4.0);
    if (per < 0.7 * per_cell && (factor <= 1.0 || cell >= extent)) break;
    cell *= factor;
  }
  return std::max(cell, extent * 1e-7);  // cell indices stay far from int32 limits
}

}  // namespace mlx_lattice::geometry::detail
