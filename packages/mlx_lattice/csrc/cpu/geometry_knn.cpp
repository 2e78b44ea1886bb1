// Exact k nearest neighbours over the grid of cpu/geometry_grid.h: queries
// grouped by cell share their block's candidates; ties broken by support row.
#include <algorithm>
#include <array>
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

namespace {

// Offer candidate c to a max-heap holding the k nearest so far.
void keep_nearest(std::vector<Cand>& heap, const Cand& c, int64_t k) {
  if (static_cast<int64_t>(heap.size()) < k) {
    heap.push_back(c);
    std::push_heap(heap.begin(), heap.end());
  } else if (c < heap.front()) {
    std::pop_heap(heap.begin(), heap.end());
    heap.back() = c;
    std::push_heap(heap.begin(), heap.end());
  }
}

// Half-width in cells of the block of cells a query group shares.
constexpr int kBlock = 1;

// The cells of the (2 kBlock + 1)^3 block, nearest first (by |dx| + |dy| + |dz|).
const std::vector<std::array<int, 3>> kBlockOrder = [] {
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

}  // namespace

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
  // Queries of batches without support keep this (written by the threads:
  // the table's first touch).
  constexpr int64_t kFillChunk = 4096;
  parallel_for((nq + kFillChunk - 1) / kFillChunk, [&](int64_t t) {
    const int64_t end = std::min(nq, (t + 1) * kFillChunk);
    for (int64_t q = t * kFillChunk; q < end; ++q) store(q, nullptr, 0);
  });
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
      keep_nearest(heap, c, k);
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
      keep_nearest(heap, c, k);
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
                const double gap =
                    std::max({cell_box[c][a] - qp[a], qp[a] - cell_box[c][a + 3], 0.0});
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

}  // namespace mlx_lattice::geometry
