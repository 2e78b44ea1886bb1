// Geometry kernels for exact neighbour search: kNN and radius queries over a
// hashed uniform grid, ties broken by support row.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <map>
#include <memory>

#include "geometry_detail.h"
#include "geometry_kernels.h"
#include "parallel.h"

namespace mlx_lattice::geometry {

using detail::check_batch;
using detail::check_finite;
using detail::fail;
using detail::same_row;

// ---- neighbours ---------------------------------------------------------------------------

namespace {

// Support points bucketed in a hashed uniform grid (per batch).
class Grid {
 public:
  Grid(const double* pts, const int32_t* batch, int64_t n, double cell)
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

inline double dist2(const double* q, const double* s) {
  const double dx = q[0] - s[0], dy = q[1] - s[1], dz = q[2] - s[2];
  return dx * dx + dy * dy + dz * dz;
}

// A candidate, ordered by (squared distance, row). Distances are >= +0 (and
// never NaN: points are finite), so their bit patterns order as the values
// do: integer comparisons, without the branches of floating ones.
struct Cand {
  double d2;
  int32_t row;
  bool operator<(const Cand& o) const {
    const auto a = std::bit_cast<uint64_t>(d2), b = std::bit_cast<uint64_t>(o.d2);
    return a < b || (a == b && row < o.row);
  }
};

void check_points(const double* pts, const int32_t* batch, int64_t n, const char* name,
                  const char* batch_name) {
  check_finite(pts, n, name);
  check_batch(batch, n, batch_name);
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

}  // namespace

// Half-width in cells of the block of cells a query group shares.
constexpr int kBlock = 1;

// The cells of the (2 kBlock + 1)^3 block, nearest first (by |dx| + |dy| + |dz|).
static const std::vector<std::array<int, 3>> kBlockOrder = [] {
  std::vector<std::array<int, 3>> order;
  for (int dx = -kBlock; dx <= kBlock; ++dx) {
    for (int dy = -kBlock; dy <= kBlock; ++dy) {
      for (int dz = -kBlock; dz <= kBlock; ++dz) order.push_back({dx, dy, dz});
    }
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return std::abs(a[0]) + std::abs(a[1]) + std::abs(a[2]) <
           std::abs(b[0]) + std::abs(b[1]) + std::abs(b[2]);
  });
  return order;
}();

void knn(const double* query, const int32_t* qbatch, int64_t nq, const double* support,
         const int32_t* sbatch, int64_t ns, int64_t k, int64_t width, int32_t* rows,
         float* dist2_out) {
  if (k < 1) fail("k must be >= 1.");
  if (width < std::min(k, ns)) fail("the kNN table is narrower than min(k, support rows).");
  check_points(query, qbatch, nq, "query", "query_batch");
  check_points(support, sbatch, ns, "support", "support_batch");
  // Each query's row of the table: its neighbours ascending, then -1 / +inf.
  const auto store = [&](int64_t q, const Cand* c, size_t n) {
    for (int64_t i = 0; i < width; ++i) {
      const bool found = i < static_cast<int64_t>(n);
      rows[q * width + i] = found ? c[i].row : -1;
      dist2_out[q * width + i] =
          found ? static_cast<float>(c[i].d2) : std::numeric_limits<float>::infinity();
    }
  };
  // Queries of batches without support keep this.
  for (int64_t q = 0; q < nq; ++q) store(q, nullptr, 0);
  if (ns == 0 || nq == 0) return;

  // Exact search by growing rings of cells around the query's cell; stops
  // once the k-th distance is below the distance to the unvisited cells.
  const auto ring_search = [&](const Grid& grid, int64_t q, std::vector<Cand>& heap) {
    heap.clear();
    const double* qp = query + 3 * q;
    const auto* bounds = grid.bounds(qbatch[q]);
    if (!bounds) return;
    int32_t home[3];
    for (int a = 0; a < 3; ++a) home[a] = grid.cell_of(qp[a], a);
    // Rings nearer than the batch's occupied cells are empty: start there.
    int64_t first_ring = 0;
    for (int a = 0; a < 3; ++a) {
      first_ring =
          std::max<int64_t>(first_ring, std::max<int64_t>({0, int64_t{bounds->lo[a]} - home[a],
                                                           int64_t{home[a]} - bounds->hi[a]}));
    }
    const auto consider = [&](int32_t row) {
      const Cand c{dist2(qp, support + 3 * static_cast<int64_t>(row)), row};
      if (static_cast<int64_t>(heap.size()) < k) {
        heap.push_back(c);
        std::push_heap(heap.begin(), heap.end());
      } else if (c < heap.front()) {
        std::pop_heap(heap.begin(), heap.end());
        heap.back() = c;
        std::push_heap(heap.begin(), heap.end());
      }
    };
    for (int64_t ring = first_ring;; ++ring) {
      bool covered = true;  // the ring box contains every occupied cell of this batch
      int64_t lo[3], hi[3];
      for (int a = 0; a < 3; ++a) {
        lo[a] = std::max<int64_t>(home[a] - ring, bounds->lo[a]);
        hi[a] = std::min<int64_t>(home[a] + ring, bounds->hi[a]);
        covered = covered && home[a] - ring <= bounds->lo[a] && home[a] + ring >= bounds->hi[a];
      }
      for (int64_t x = lo[0]; x <= hi[0]; ++x) {
        const bool xe = x == home[0] - ring || x == home[0] + ring;
        for (int64_t y = lo[1]; y <= hi[1]; ++y) {
          const bool ye = xe || y == home[1] - ring || y == home[1] + ring;
          for (int64_t z = lo[2]; z <= hi[2]; ++z) {
            // Only the shell at Chebyshev distance `ring`: inner cells were seen.
            if (!ye && z != home[2] - ring && z != home[2] + ring) continue;
            const int32_t key[4] = {qbatch[q], static_cast<int32_t>(x), static_cast<int32_t>(y),
                                    static_cast<int32_t>(z)};
            grid.visit(key, consider);
          }
        }
      }
      if (covered) break;
      if (static_cast<int64_t>(heap.size()) == k) {
        double margin = std::numeric_limits<double>::infinity();
        for (int a = 0; a < 3; ++a) {
          const double lo_edge = grid.edge(int64_t{home[a]} - ring, a);
          const double hi_edge = grid.edge(int64_t{home[a]} + ring + 1, a);
          margin = std::min({margin, qp[a] - lo_edge, hi_edge - qp[a]});
        }
        margin -= grid.cell() * 1e-9;  // cell assignment rounds; stay conservative
        if (margin > 0 && heap.front().d2 < margin * margin) break;
      }
    }
    std::sort_heap(heap.begin(), heap.end());
  };

  // Exact answer by scanning every support point of the query's batch (for
  // queries so far from the support that cell indices would overflow).
  const auto brute_force = [&](int64_t q, std::vector<Cand>& heap) {
    heap.clear();
    const double* qp = query + 3 * q;
    for (int64_t s = 0; s < ns; ++s) {
      if (sbatch[s] != qbatch[q]) continue;
      const Cand c{dist2(qp, support + 3 * s), static_cast<int32_t>(s)};
      if (static_cast<int64_t>(heap.size()) < k) {
        heap.push_back(c);
        std::push_heap(heap.begin(), heap.end());
      } else if (c < heap.front()) {
        std::pop_heap(heap.begin(), heap.end());
        heap.back() = c;
        std::push_heap(heap.begin(), heap.end());
      }
    }
    std::sort_heap(heap.begin(), heap.end());
  };

  // Queries sharing a home cell share the candidates of its 27 neighbouring
  // cells; a query whose k-th candidate is nearer than the edge of that
  // block is done. The others retry on a grid of twice the cell size (sparse
  // regions of a scan), and the last level falls back to the ring search.
  // Every accepted answer is exact, so the level never changes the result.
  std::vector<int32_t> pending(nq);
  for (int64_t q = 0; q < nq; ++q) pending[q] = static_cast<int32_t>(q);
  std::vector<char> failed(nq, 0);
  // A query that failed a level keeps its k-th distance there: those k
  // candidates lie in the next level's (larger) block too, so it bounds the
  // search again.
  std::vector<double> kth_bound(nq, std::numeric_limits<double>::infinity());
  // About 2k points per occupied cell: with nearest-first cells and box
  // pruning, larger cells cost less than the retries of smaller ones.
  double cell = pick_cell(support, sbatch, ns, std::max<double>(2.0, 2.0 * k));
  constexpr int kLevels = 8;
  for (int level = 0; level < kLevels && !pending.empty(); ++level, cell *= 2.0) {
    const bool last = level == kLevels - 1;
    const Grid grid(support, sbatch, ns, cell);
    const int64_t np = static_cast<int64_t>(pending.size());
    std::vector<int32_t> qkeys(4 * np);
    for (int64_t i = 0; i < np; ++i) {
      const int64_t q = pending[i];
      qkeys[4 * i] = qbatch[q];
      for (int a = 0; a < 3; ++a) qkeys[4 * i + a + 1] = grid.cell_of(query[3 * q + a], a);
    }
    const UniqueRows groups = unique_rows(qkeys.data(), np);
    const int64_t n_groups = static_cast<int64_t>(groups.offsets.size()) - 1;
    parallel_for((n_groups + 63) / 64, [&](int64_t t) {
      const int64_t end = std::min(n_groups, (t + 1) * 64);
      // The block's candidates, coordinates stored per axis so that a cell's
      // distances compute as independent lanes.
      std::vector<int32_t> rows;
      std::vector<double> xs, ys, zs, d2s;
      std::vector<int32_t> cell_start;
      std::vector<std::array<double, 6>> cell_box;  // lo, hi per axis (with slack)
      std::vector<Cand> top(static_cast<size_t>(k)), heap;
      std::vector<int32_t> prev;
      for (int64_t g = t * 64; g < end; ++g) {
        const int32_t* home = groups.coords.data() + 4 * g;
        const auto* bounds = grid.bounds(home[0]);
        if (!bounds) continue;
        rows.clear();
        xs.clear();
        ys.clear();
        zs.clear();
        cell_start.clear();
        cell_box.clear();
        bool covered = true;
        for (int a = 0; a < 3; ++a) {
          covered = covered && home[a + 1] - kBlock <= bounds->lo[a] &&
                    home[a + 1] + kBlock >= bounds->hi[a];
        }
        // The block's cells nearest-first (home, faces, edges, corners), so the
        // running k-th distance tightens early and far cells can be skipped.
        for (const auto& d : kBlockOrder) {
          const int32_t key[4] = {home[0], home[1] + d[0], home[2] + d[1], home[3] + d[2]};
          const size_t before = rows.size();
          grid.visit(key, [&](int32_t row) {
            const double* p = support + 3 * static_cast<int64_t>(row);
            rows.push_back(row);
            xs.push_back(p[0]);
            ys.push_back(p[1]);
            zs.push_back(p[2]);
          });
          if (rows.size() > before) {
            cell_start.push_back(static_cast<int32_t>(before));
            std::array<double, 6> box;
            for (int a = 0; a < 3; ++a) {
              box[a] = grid.edge(int64_t{home[a + 1]} + d[a], a) - grid.cell() * 1e-9;
              box[a + 3] = box[a] + grid.cell() * (1.0 + 2e-9);
            }
            cell_box.push_back(box);
          }
        }
        cell_start.push_back(static_cast<int32_t>(rows.size()));
        d2s.resize(rows.size());
        const double h = grid.cell(), slack = h * 1e-9;
        prev.clear();  // the k neighbours of the group's last query with k candidates
        for (int32_t i = groups.offsets[g]; i < groups.offsets[g + 1]; ++i) {
          const int64_t q = pending[groups.members[i]];
          const double* qp = query + 3 * q;
          if (!grid.in_range(qp)) {
            brute_force(q, heap);
            store(q, heap.data(), heap.size());
            continue;
          }
          // The k neighbours of the group's previous query are candidates of
          // this block too: the farthest of them from this query bounds its
          // k-th distance (computed as the candidates' are, so exactly). The k
          // best candidates within the bound by (distance, row) are kept
          // sorted; once k are held, the k-th tightens the bound. Without a
          // bound every candidate is considered.
          double bound = kth_bound[q];
          if (!prev.empty()) {
            double reach = 0.0;
            for (const int32_t row : prev) {
              reach = std::max(reach, dist2(qp, support + 3 * static_cast<int64_t>(row)));
            }
            bound = std::min(bound, reach);
          }
          const double qx = qp[0], qy = qp[1], qz = qp[2];
          int64_t n_top = 0;
          for (;;) {
            n_top = 0;
            double limit = bound;  // candidates above it cannot enter the k best
            for (size_t c = 0; c + 1 < cell_start.size(); ++c) {
              // Lower bound of the distance to this cell's box.
              double dmin = 0.0;
              for (int a = 0; a < 3; ++a) {
                const double gap = std::max({cell_box[c][a] - qp[a], qp[a] - cell_box[c][a + 3], 0.0});
                dmin += gap * gap;
              }
              if (dmin > limit) continue;
              const int32_t lo = cell_start[c], hi = cell_start[c + 1];
              for (int32_t j = lo; j < hi; ++j) {
                const double dx = qx - xs[j], dy = qy - ys[j], dz = qz - zs[j];
                d2s[j] = dx * dx + dy * dy + dz * dz;
              }
              for (int32_t j = lo; j < hi; ++j) {
                if (!(d2s[j] <= limit)) continue;
                const Cand cand{d2s[j], rows[j]};
                int64_t pos = n_top;
                if (n_top == k) {
                  if (!(cand < top[k - 1])) continue;
                  pos = k - 1;
                } else {
                  ++n_top;
                }
                for (; pos > 0 && cand < top[pos - 1]; --pos) top[pos] = top[pos - 1];
                top[pos] = cand;
                if (n_top == k) limit = std::min(limit, top[k - 1].d2);
              }
            }
            // (Cannot happen: the bound holds k candidates. Kept as a guard.)
            if (n_top >= k || !std::isfinite(bound)) break;
            bound = std::numeric_limits<double>::infinity();
          }
          prev.clear();
          if (n_top == k) {
            for (int64_t j = 0; j < k; ++j) prev.push_back(top[j].row);
          }
          bool done = covered;
          if (!done && n_top == k) {
            double margin = std::numeric_limits<double>::infinity();
            for (int a = 0; a < 3; ++a) {
              const double lo_edge = grid.edge(int64_t{home[a + 1]} - kBlock, a);
              const double hi_edge = grid.edge(int64_t{home[a + 1]} + kBlock + 1, a);
              margin = std::min({margin, qp[a] - lo_edge, hi_edge - qp[a]});
            }
            margin -= slack;
            done = margin > 0 && top[k - 1].d2 < margin * margin;
          }
          if (done) {
            store(q, top.data(), static_cast<size_t>(n_top));
          } else if (last) {
            ring_search(grid, q, heap);
            store(q, heap.data(), heap.size());
          } else {
            failed[q] = 1;
            if (n_top == k) kth_bound[q] = top[k - 1].d2;
          }
        }
      }
    });
    std::vector<int32_t> next;
    for (int32_t q : pending) {
      if (failed[q]) next.push_back(q);
      failed[q] = 0;
    }
    pending.swap(next);
  }
}

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
