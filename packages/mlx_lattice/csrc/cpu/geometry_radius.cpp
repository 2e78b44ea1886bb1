// All support points within a radius over the grid of cpu/geometry_grid.h,
// nearest first, ties broken by support row.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "geometry_grid.h"
#include "parallel.h"

namespace mlx_lattice::geometry {

using detail::Cand;
using detail::check_points;
using detail::dist2;
using detail::fail;
using detail::Grid;
using detail::pick_cell;

Neighbors radius_search(const double* query, const int32_t* qbatch, int64_t nq,
                        const double* support, const int32_t* sbatch, int64_t ns, double r,
                        int64_t max_neighbors) {
  if (!(r > 0) || !std::isfinite(r)) fail("r must be positive and finite.");
  check_points(query, qbatch, nq, "query", "query_batch");
  check_points(support, sbatch, ns, "support", "support_batch");
  Neighbors out;
  out.offsets.assign(nq + 1, 0);
  if (ns == 0 || nq == 0) return out;
  // Cells no smaller than r (so 27 cells cover the ball) unless r is huge
  // compared to the spacing of the points.
  const double cell = std::max(r, pick_cell(support, sbatch, ns, 4.0));
  const Grid grid(support, sbatch, ns, cell);
  const double r2 = r * r;
  std::vector<std::vector<Cand>> found(nq);
  parallel_for((nq + 255) / 256, [&](int64_t t) {
    const int64_t end = std::min(nq, (t + 1) * 256);
    for (int64_t q = t * 256; q < end; ++q) {
      auto& hits = found[q];
      const double* qp = query + 3 * q;
      if (!grid.in_range(qp)) {  // far outside the support: scan its batch
        for (int64_t s = 0; s < ns; ++s) {
          if (sbatch[s] != qbatch[q]) continue;
          const double d = dist2(qp, support + 3 * s);
          if (d <= r2) hits.push_back({d, static_cast<int32_t>(s)});
        }
        std::sort(hits.begin(), hits.end());
        if (max_neighbors > 0 && static_cast<int64_t>(hits.size()) > max_neighbors) {
          hits.resize(max_neighbors);
        }
        continue;
      }
      int32_t lo[3], hi[3];
      for (int a = 0; a < 3; ++a) {
        lo[a] = grid.cell_of(qp[a] - r, a);
        hi[a] = grid.cell_of(qp[a] + r, a);
      }
      for (int64_t x = lo[0]; x <= hi[0]; ++x) {
        for (int64_t y = lo[1]; y <= hi[1]; ++y) {
          for (int64_t z = lo[2]; z <= hi[2]; ++z) {
            const int32_t key[4] = {qbatch[q], static_cast<int32_t>(x), static_cast<int32_t>(y),
                                    static_cast<int32_t>(z)};
            grid.visit(key, [&](int32_t row) {
              const double d = dist2(qp, support + 3 * static_cast<int64_t>(row));
              if (d <= r2) hits.push_back({d, row});
            });
          }
        }
      }
      std::sort(hits.begin(), hits.end());
      if (max_neighbors > 0 && static_cast<int64_t>(hits.size()) > max_neighbors) {
        hits.resize(max_neighbors);
      }
    }
  });
  int64_t total = 0;
  for (int64_t q = 0; q < nq; ++q) {
    total += static_cast<int64_t>(found[q].size());
    if (total > std::numeric_limits<int32_t>::max())
      fail("radius search found more than 2^31 - 1 pairs.");
    out.offsets[q + 1] = static_cast<int32_t>(total);
  }
  out.rows.resize(total);
  out.dist2.resize(total);
  for (int64_t q = 0; q < nq; ++q) {
    for (size_t i = 0; i < found[q].size(); ++i) {
      out.rows[out.offsets[q] + i] = found[q][i].row;
      out.dist2[out.offsets[q] + i] = found[q][i].d2;
    }
  }
  return out;
}

}  // namespace mlx_lattice::geometry
