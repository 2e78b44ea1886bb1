#include "relation_sorted.h"

#include <algorithm>
#include <map>

#include "cpu/parallel.h"

namespace mlx_lattice {

bool rows_sorted(const int32_t* coords, int64_t n) {
  for (int64_t r = 1; r < n; ++r) {
    const int32_t* a = coords + 4 * (r - 1);
    const int32_t* b = coords + 4 * r;
    if (!std::lexicographical_compare(a, a + 4, b, b + 4)) return false;
  }
  return true;
}

namespace {

// The offsets of one (dx, dy): their dz ascending, and kernel index.
struct DyGroup {
  int64_t dy;
  std::vector<std::pair<int64_t, int32_t>> dz;  // (dz, k), dz ascending
};

struct DxGroup {
  int64_t dx;
  std::vector<DyGroup> dys;  // dy ascending
};

// The offsets [0, searched), grouped by dx, then dy.
std::vector<DxGroup> group_offsets(const std::vector<std::array<int64_t, 3>>& offsets,
                                   size_t searched) {
  std::map<int64_t, std::map<int64_t, std::vector<std::pair<int64_t, int32_t>>>> tree;
  for (size_t k = 0; k < searched; ++k) {
    tree[offsets[k][0]][offsets[k][1]].push_back({offsets[k][2], static_cast<int32_t>(k)});
  }
  std::vector<DxGroup> groups;
  for (auto& [dx, by_dy] : tree) {
    DxGroup g{dx, {}};
    for (auto& [dy, dz] : by_dy) {
      std::sort(dz.begin(), dz.end());
      g.dys.push_back({dy, std::move(dz)});
    }
    groups.push_back(std::move(g));
  }
  return groups;
}

}  // namespace

std::vector<int32_t> sorted_neighbour_map(const int32_t* coords, int64_t n,
                                          const std::vector<std::array<int64_t, 3>>& offsets,
                                          bool symmetric) {
  const int64_t n_kernels = static_cast<int64_t>(offsets.size());
  std::vector<int32_t> map(n * n_kernels, -1);
  if (n == 0) return map;
  const int64_t centre = n_kernels / 2;
  if (symmetric) {
    for (int64_t r = 0; r < n; ++r) map[r * n_kernels + centre] = static_cast<int32_t>(r);
  }
  // Columns: runs of one (batch, x, y); col_start[c] is the first row of c.
  std::vector<int32_t> col_start;
  col_start.reserve(n / 2 + 2);
  for (int64_t r = 0; r < n; ++r) {
    const int32_t* c = coords + 4 * r;
    if (r == 0 || c[0] != c[-4] || c[1] != c[-3] || c[2] != c[-2]) {
      col_start.push_back(static_cast<int32_t>(r));
    }
  }
  const int64_t n_cols = static_cast<int64_t>(col_start.size());
  col_start.push_back(static_cast<int32_t>(n));
  // Slabs: runs of columns of one (batch, x); slab_start[s] is the first
  // column of s.
  std::vector<int32_t> slab_start;
  for (int64_t c = 0; c < n_cols; ++c) {
    const int32_t* a = coords + 4 * static_cast<int64_t>(col_start[c]);
    const int32_t* p = c ? coords + 4 * static_cast<int64_t>(col_start[c - 1]) : nullptr;
    if (!p || a[0] != p[0] || a[1] != p[1]) slab_start.push_back(static_cast<int32_t>(c));
  }
  const int64_t n_slabs = static_cast<int64_t>(slab_start.size());
  slab_start.push_back(static_cast<int32_t>(n_cols));
  auto row = [&](int64_t r) { return coords + 4 * r; };
  auto col_row = [&](int64_t c) { return row(col_start[c]); };
  // The slab holding (b, x), or -1 (binary search over the ascending slabs).
  auto find_slab = [&](int32_t b, int64_t x) -> int64_t {
    int64_t lo = 0, hi = n_slabs;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      const int32_t* s = col_row(slab_start[mid]);
      if (s[0] < b || (s[0] == b && s[1] < x)) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    if (lo == n_slabs) return -1;
    const int32_t* s = col_row(slab_start[lo]);
    return s[0] == b && s[1] == x ? lo : -1;
  };
  const std::vector<DxGroup> groups =
      group_offsets(offsets, symmetric ? static_cast<size_t>(centre) : offsets.size());
  constexpr int64_t kSlabsPerTask = 16;
  parallel_for((n_slabs + kSlabsPerTask - 1) / kSlabsPerTask, [&](int64_t task) {
    std::vector<int64_t> ptr;
    for (int64_t s = task * kSlabsPerTask; s < std::min(n_slabs, (task + 1) * kSlabsPerTask);
         ++s) {
      const int32_t* first = col_row(slab_start[s]);
      const int32_t b = first[0];
      for (const DxGroup& g : groups) {
        const int64_t t = find_slab(b, static_cast<int64_t>(first[1]) + g.dx);
        if (t < 0) continue;
        const int64_t t_end = slab_start[t + 1];
        ptr.assign(g.dys.size(), slab_start[t]);
        for (int64_t c = slab_start[s]; c < slab_start[s + 1]; ++c) {
          const int64_t y = col_row(c)[2];
          for (size_t i = 0; i < g.dys.size(); ++i) {
            const DyGroup& d = g.dys[i];
            const int64_t want = y + d.dy;
            int64_t& p = ptr[i];
            while (p < t_end && col_row(p)[2] < want) ++p;
            if (p == t_end || col_row(p)[2] != want) continue;
            // Merge the z values of column c (rows r) with column p (rows q).
            const int64_t dz_lo = d.dz.front().first, dz_hi = d.dz.back().first;
            int64_t q = col_start[p];
            const int64_t q_end = col_start[p + 1];
            for (int64_t r = col_start[c]; r < col_start[c + 1]; ++r) {
              const int64_t z = row(r)[3];
              while (q < q_end && row(q)[3] < z + dz_lo) ++q;
              size_t j = 0;
              for (int64_t u = q; u < q_end && row(u)[3] <= z + dz_hi; ++u) {
                const int64_t dz = row(u)[3] - z;
                while (j < d.dz.size() && d.dz[j].first < dz) ++j;
                if (j == d.dz.size()) break;
                if (d.dz[j].first == dz) {
                  const int32_t k = d.dz[j].second;
                  map[r * n_kernels + k] = static_cast<int32_t>(u);
                  if (symmetric) map[u * n_kernels + n_kernels - 1 - k] = static_cast<int32_t>(r);
                }
              }
            }
          }
        }
      }
    }
  });
  return map;
}

}  // namespace mlx_lattice
