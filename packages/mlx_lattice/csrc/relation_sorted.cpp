#include "relation_sorted.h"

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <optional>

#include "cpu/parallel.h"
#include "relation_pages.h"

namespace mlx_lattice {

namespace {

// The searched offsets of one (dx, dy): neighbours of row i at these offsets
// have keys key[i] + delta + dz, dz in [lo, hi]; kernel[dz - lo] is the
// offset's index, or -1 for a dz in the range no offset has.
struct KeyGroup {
  int64_t delta, lo, hi;
  std::vector<int32_t> kernel;
  // Whether every dz in [lo, hi] is an offset, kernel[dz - lo] being
  // kernel[0] + dz - lo (unit dilation and tensor stride along z).
  bool unit = false;
};

// Whether n > 0 rows strictly ascend, and each column's range (low[4],
// high[4]): one pass over parallel chunks of rows.
bool scan_rows(const int32_t* coords, int64_t n, std::array<int64_t, 4>& low,
               std::array<int64_t, 4>& high) {
  // Chunks of 8192 rows: a 79k-row scan splits into 10 tasks, even over 2
  // threads (at 32768 rows it was 3, one thread running two).
  constexpr int64_t kChunk = int64_t{1} << 13;
  const int64_t n_chunks = ceil_div(n, kChunk);
  std::vector<std::array<int32_t, 8>> ranges(n_chunks);
  std::vector<char> ascending(n_chunks, 1);
  // Rows compare as two unsigned words each, the coordinates' sign bits
  // flipped: (batch, x) above (y, z).
  auto word = [](int32_t a, int32_t b) {
    return (uint64_t{static_cast<uint32_t>(a) ^ 0x80000000u} << 32) |
           (static_cast<uint32_t>(b) ^ 0x80000000u);
  };
  parallel_for(n_chunks, [&](int64_t t) {
    const int64_t r0 = t * kChunk, r1 = std::min(n, (t + 1) * kChunk);
    const int32_t* c = coords + 4 * r0;
    int32_t lo_[4] = {c[0], c[1], c[2], c[3]}, hi_[4] = {c[0], c[1], c[2], c[3]};
    uint64_t prev_hi = 0, prev_lo = 0;
    if (r0 > 0) {
      prev_hi = word(c[-4], c[-3]);
      prev_lo = word(c[-2], c[-1]);
    }
    bool rising = true;
    for (int64_t r = r0; r < r1; ++r, c += 4) {
      const uint64_t hi = word(c[0], c[1]), lo = word(c[2], c[3]);
      rising = rising && (hi > prev_hi || (hi == prev_hi && lo > prev_lo) || r == 0);
      prev_hi = hi;
      prev_lo = lo;
      for (int a = 0; a < 4; ++a) {
        lo_[a] = std::min(lo_[a], c[a]);
        hi_[a] = std::max(hi_[a], c[a]);
      }
    }
    ascending[t] = rising;
    std::copy(lo_, lo_ + 4, ranges[t].begin());
    std::copy(hi_, hi_ + 4, ranges[t].begin() + 4);
  });
  for (int a = 0; a < 4; ++a) {
    low[a] = ranges[0][a];
    high[a] = ranges[0][a + 4];
    for (const auto& range : ranges) {
      low[a] = std::min<int64_t>(low[a], range[a]);
      high[a] = std::max<int64_t>(high[a], range[a + 4]);
    }
  }
  return std::find(ascending.begin(), ascending.end(), 0) == ascending.end();
}

}  // namespace

PackedKeys packed_keys(const int32_t* coords, int64_t n,
                       const std::vector<std::array<int64_t, 3>>& offsets) {
  PackedKeys packed;
  std::array<int64_t, 3>& radix = packed.radix;
  std::array<int64_t, 3>& reach = packed.reach;
  for (const auto& off : offsets) {
    for (int a = 0; a < 3; ++a) reach[a] = std::max(reach[a], off[a] < 0 ? -off[a] : off[a]);
  }
  for (int a = 0; a < 3; ++a) {
    if (reach[a] > (int64_t{1} << 40)) return packed;
  }
  std::array<int64_t, 4>& low = packed.low;
  std::array<int64_t, 4>& high = packed.high;
  if (!scan_rows(coords, n, low, high)) return packed;
  // Ranges are at most 2^32 and reaches at most 2^40 (past that, the hash),
  // so each radix fits in 42 bits, and the product is checked in 128 bits.
  unsigned __int128 product = static_cast<unsigned __int128>(high[0] - low[0] + 1);
  for (int a = 0; a < 3; ++a) {
    radix[a] = high[a + 1] - low[a + 1] + 1 + 2 * reach[a];
    product *= static_cast<unsigned __int128>(radix[a]);
    if (product > (static_cast<unsigned __int128>(1) << 62)) return packed;
  }
  UnsetVector<int64_t>& keys = packed.keys;
  keys.resize(n + 1);
  advise_huge_pages(keys.data(), sizeof(int64_t) * keys.size());
  keys[n] = std::numeric_limits<int64_t>::max();  // a sentinel past every key
  constexpr int64_t kChunk = int64_t{1} << 13;
  parallel_for(ceil_div(n, kChunk), [&](int64_t t) {
    // Locals: without strict aliasing each store could change the arrays.
    const int64_t b0 = low[0], rx = radix[0], ry = radix[1], rz = radix[2];
    const int64_t x0 = low[1] - reach[0], y0 = low[2] - reach[1], z0 = low[3] - reach[2];
    int64_t* out = keys.data();
    for (int64_t r = t * kChunk; r < std::min(n, (t + 1) * kChunk); ++r) {
      const int32_t* c = coords + 4 * r;
      out[r] = (((c[0] - b0) * rx + (c[1] - x0)) * ry + (c[2] - y0)) * rz + (c[3] - z0);
    }
  });
  return packed;
}

namespace {

// Offsets [0, count) by (dx, dy): each column's (dz, k), ascending by dz.
using OffsetColumns =
    std::map<std::pair<int64_t, int64_t>, std::vector<std::pair<int64_t, int32_t>>>;

OffsetColumns offset_columns(const std::vector<std::array<int64_t, 3>>& offsets, size_t count) {
  OffsetColumns columns;
  for (size_t k = 0; k < count; ++k) {
    columns[{offsets[k][0], offsets[k][1]}].push_back({offsets[k][2], static_cast<int32_t>(k)});
  }
  for (auto& column : columns) std::sort(column.second.begin(), column.second.end());
  return columns;
}

// The searched offsets [0, searched), grouped by (dx, dy).
std::vector<KeyGroup> group_offsets(const std::vector<std::array<int64_t, 3>>& offsets,
                                    size_t searched, const std::array<int64_t, 3>& radix) {
  std::vector<KeyGroup> groups;
  for (const auto& [dxy, dz] : offset_columns(offsets, searched)) {
    KeyGroup g{(dxy.first * radix[1] + dxy.second) * radix[2], dz.front().first,
               dz.back().first, {}};
    g.kernel.assign(g.hi - g.lo + 1, -1);
    for (const auto& [z, k] : dz) g.kernel[z - g.lo] = k;
    g.unit = true;
    for (size_t t = 0; t < g.kernel.size(); ++t) {
      g.unit = g.unit && g.kernel[t] == g.kernel[0] + static_cast<int32_t>(t);
    }
    groups.push_back(std::move(g));
  }
  return groups;
}

}  // namespace

namespace {

// The walks over rows [i0, i1) of sorted_neighbour_map. Functions of their
// own, every value they read a by-value parameter: as a lambda over
// captured references (the library builds with -fno-strict-aliasing) the
// walk reloaded them after each store into the map or the masks, and took
// 5-7% longer over a 100k-row scan's relation.
struct Walk {
  const int64_t* key;
  int32_t* out;
  uint32_t* masks;
  bool mirror;
  int64_t n_kernels;
  int64_t stride;
};

// One (dx, dy) group whose offsets are not consecutive along z (a dilation
// or tensor stride along z): a neighbour's offset is kernel[key difference
// - lo], or none where that is -1. delta: the group's delta + lo; span: hi
// - lo. j: the first row whose key is at least key[i0] + delta.
[[gnu::noinline]] void walk_rows(const Walk w, int64_t delta, int64_t span,
                                 const int32_t* kernel, int64_t i0, int64_t i1, int64_t j) {
  const int64_t* const key = w.key;
  int32_t* const out = w.out;
  uint32_t* const row_masks = w.masks;
  const bool mirror = w.mirror;
  const int64_t k_count = w.n_kernels, stride = w.stride;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t base = key[i] + delta;
    while (key[j] < base) ++j;
    uint32_t own = 0;
    for (int64_t u = j; key[u] <= base + span; ++u) {
      const int32_t k = kernel[key[u] - base];
      if (k < 0) continue;
      out[i * stride + k] = static_cast<int32_t>(u);
      own |= uint32_t{1} << (k & 31);
      if (mirror) out[u * stride + k_count - 1 - k] = static_cast<int32_t>(i);
      if (row_masks != nullptr) row_masks[u] |= uint32_t{1} << ((k_count - 1 - k) & 31);
    }
    if (row_masks != nullptr) row_masks[i] |= own;
  }
}

// The walk of every group whose offsets are consecutive along z (the usual
// kernels: a neighbour's offset is the first one's plus the key
// difference, without a table), all at once, row by row: a row's cells of
// the map are written together and its own mask once, instead of once per
// group pass (each pass over a chunk's map rows took its store misses
// again). j[g]: group g's first row whose key is at least key[i0] + its
// delta, moved along.
struct UnitGroup {
  int64_t delta, span;  // the group's keys are key[i] + delta + [0, span]
  int32_t first_k;
};

[[gnu::noinline]] void walk_rows_together(const Walk w, const UnitGroup* groups, int64_t n_groups,
                                          int64_t i0, int64_t i1, int64_t* j) {
  const int64_t* const key = w.key;
  int32_t* const out = w.out;
  uint32_t* const row_masks = w.masks;
  const bool mirror = w.mirror;
  const int64_t k_count = w.n_kernels, stride = w.stride;
  for (int64_t i = i0; i < i1; ++i) {
    uint32_t own = 0;
    int32_t* const cells = out + i * stride;
    for (int64_t g = 0; g < n_groups; ++g) {
      const int64_t base = key[i] + groups[g].delta, last = base + groups[g].span;
      const int32_t first_k = groups[g].first_k;
      int64_t u = j[g];
      while (key[u] < base) ++u;
      j[g] = u;
      for (; key[u] <= last; ++u) {
        const int32_t k = first_k + static_cast<int32_t>(key[u] - base);
        cells[k] = static_cast<int32_t>(u);
        own |= uint32_t{1} << (k & 31);
        if (mirror) out[u * stride + k_count - 1 - k] = static_cast<int32_t>(i);
        if (row_masks != nullptr) row_masks[u] |= uint32_t{1} << ((k_count - 1 - k) & 31);
      }
    }
    if (row_masks != nullptr) row_masks[i] |= own;
  }
}

}  // namespace

std::unique_ptr<int32_t[]> sorted_neighbour_map(const int32_t* coords, int64_t n,
                                                const std::vector<std::array<int64_t, 3>>& offsets,
                                                bool symmetric, uint32_t* masks) {
  const int64_t n_kernels = static_cast<int64_t>(offsets.size());
  const int64_t centre = n_kernels / 2;
  // With masks, the mirrors are kept in the masks alone: the map has only
  // the searched columns.
  const bool half = masks != nullptr;
  const int64_t columns = half ? centre : n_kernels;
  if (n == 0) return std::unique_ptr<int32_t[]>(new int32_t[1]);
  const PackedKeys packed = packed_keys(coords, n, offsets);
  if (packed.keys.empty()) return nullptr;
  const UnsetVector<int64_t>& keys = packed.keys;
  const std::array<int64_t, 3>& radix = packed.radix;
  // Cells and masks are initialised by the tasks that own their rows.
  std::unique_ptr<int32_t[]> map(new int32_t[n * columns]);
  advise_huge_pages(map.get(), sizeof(int32_t) * static_cast<size_t>(n * columns));
  const size_t searched = symmetric ? static_cast<size_t>(centre) : offsets.size();
  const std::vector<KeyGroup> groups = group_offsets(offsets, searched, radix);
  int64_t lowest = 0;  // the most negative key difference searched
  for (const KeyGroup& g : groups) lowest = std::min(lowest, g.delta + g.lo);
  const int64_t* key = keys.data();
  // Rows in chunks; a mirror write reaches back to the first row whose key
  // is at least the chunk's first key + `lowest`. Chunks run in two rounds,
  // even then odd, and are made long enough that no chunk reaches past the
  // one before it, so no two threads write one row's cells or mask at once.
  int64_t chunk = std::max<int64_t>(4096, ceil_div(n, 8 * static_cast<int64_t>(get_num_threads())));
  auto first_at_least = [&](int64_t v) {
    return static_cast<int64_t>(std::lower_bound(key, key + n, v) - key);
  };
  if (symmetric) {
    for (bool fits = false; !fits && chunk < n;) {
      fits = true;
      for (int64_t i0 = chunk; i0 < n && fits; i0 += chunk) {
        fits = first_at_least(key[i0] + lowest) >= i0 - chunk;
      }
      if (!fits) chunk *= 2;
    }
  }
  const int64_t n_chunks = ceil_div(n, chunk);
  std::vector<UnitGroup> unit_groups;
  for (const KeyGroup& g : groups) {
    if (g.unit) unit_groups.push_back({g.delta + g.lo, g.hi - g.lo, g.kernel[0]});
  }
  const Walk w{key, map.get(), masks, symmetric && !half, n_kernels, columns};
  auto walk = [&](int64_t i0, int64_t i1) {
    // Cells are written once each and masks are ORed, so the order of the
    // groups does not matter.
    if (!unit_groups.empty()) {
      std::vector<int64_t> j(unit_groups.size());
      for (size_t g = 0; g < unit_groups.size(); ++g) {
        j[g] = first_at_least(key[i0] + unit_groups[g].delta);
      }
      walk_rows_together(w, unit_groups.data(), static_cast<int64_t>(unit_groups.size()), i0,
                         i1, j.data());
    }
    for (const KeyGroup& g : groups) {
      if (g.unit) continue;
      const int64_t delta = g.delta + g.lo;
      walk_rows(w, delta, g.hi - g.lo, g.kernel.data(), i0, i1, first_at_least(key[i0] + delta));
    }
  };
  parallel_for(n_chunks, [&](int64_t c) {
    const int64_t i0 = c * chunk, i1 = std::min(n, i0 + chunk);
    // With masks, a cell is read only where its row's mask has the bit,
    // which the walk sets as it writes the cell: no -1 fill.
    if (!half) std::fill(map.get() + i0 * columns, map.get() + i1 * columns, -1);
    for (int64_t i = i0; i < i1; ++i) {
      if (half) {
        masks[i] = uint32_t{1} << centre;
      } else if (symmetric) {
        map[i * columns + centre] = static_cast<int32_t>(i);
      }
    }
  });
  for (int64_t round = 0; round < 2; ++round) {
    parallel_for(ceil_div(n_chunks - round, 2), [&](int64_t t) {
      const int64_t c = 2 * t + round;
      walk(c * chunk, std::min(n, (c + 1) * chunk));
    });
  }
  return map;
}


std::optional<SortedRows> SortedRows::of(const int32_t* coords, int64_t n) {
  SortedRows rows;
  if (n > 0) {
    rows.packed_ = packed_keys(coords, n, {});
    if (rows.packed_.keys.empty()) return std::nullopt;
  } else {
    rows.packed_.keys.assign(1, std::numeric_limits<int64_t>::max());
    rows.packed_.high = {-1, -1, -1, -1};  // no coordinate is in range
  }
  return rows;
}

bool rows_ascending(const int32_t* coords, int64_t n) {
  std::array<int64_t, 4> low, high;
  return n == 0 || scan_rows(coords, n, low, high);
}

bool rows_ascending(const int32_t* coords, int64_t n, std::array<int64_t, 4>& low,
                    std::array<int64_t, 4>& high) {
  return scan_rows(coords, n, low, high);
}

std::vector<int32_t> SortedRows::neighbour_map(
    const int32_t* out_c, int64_t n_out,
    const std::vector<std::array<int64_t, 3>>& offsets) const {
  const int64_t n_kernels = static_cast<int64_t>(offsets.size());
  std::vector<int32_t> map(n_out * n_kernels);
  // The offsets grouped by (dx, dy), each group's (dz, k) ascending by dz:
  // one cursor per group, and the group's next dz a step or two past the
  // previous one's place.
  struct Group {
    int64_t dx, dy;
    std::vector<std::pair<int64_t, int32_t>> dz;
  };
  std::vector<Group> groups;
  for (auto& [dxy, dz] : offset_columns(offsets, offsets.size())) {
    groups.push_back({dxy.first, dxy.second, std::move(dz)});
  }
  constexpr int64_t kTile = 1024;
  int32_t* const cells = map.data();
  const int64_t* const keys = packed_.keys.data();
  const std::array<int64_t, 4> low = packed_.low, high = packed_.high;
  const std::array<int64_t, 3> radix = packed_.radix;
  parallel_for(ceil_div(n_out, kTile), [&, cells, keys, low, high, radix](int64_t t) {
    const int64_t o0 = t * kTile, o1 = std::min(n_out, o0 + kTile);
    std::vector<int64_t> cursor(groups.size(), 0);
    for (int64_t o = o0; o < o1; ++o) {
      const int32_t* c = out_c + 4 * o;
      int32_t* row = cells + o * n_kernels;
      for (size_t gi = 0; gi < groups.size(); ++gi) {
        const Group& g = groups[gi];
        const int64_t x = int64_t{c[1]} + g.dx, y = int64_t{c[2]} + g.dy;
        const bool column = c[0] >= low[0] && c[0] <= high[0] && x >= low[1] && x <= high[1] &&
                            y >= low[2] && y <= high[2];
        if (!column) {
          for (const auto& cell : g.dz) row[cell.second] = -1;
          continue;
        }
        // Key of (batch, x, y, low z), computed only inside the set's range
        // (no overflow): the column's keys are base + (z - low z).
        const int64_t base =
            (((int64_t{c[0]} - low[0]) * radix[0] + (x - low[1])) * radix[1] + (y - low[2])) *
            radix[2];
        int64_t at = cursor[gi];
        bool first = true;
        for (const auto& [dz, k] : g.dz) {
          const int64_t z = int64_t{c[3]} + dz;
          if (z < low[3] || z > high[3]) {
            row[k] = -1;
            continue;
          }
          const int64_t key = base + (z - low[3]);
          if (first) {
            // The group's first lookup moves its cursor (seek gallops
            // either way); the rest step forward from it.
            if (keys[at] != key) {
              at = keys[at] < key && keys[at + 1] >= key ? at + 1 : seek(key, at);
            }
            cursor[gi] = at;
            first = false;
          } else {
            while (keys[at] < key) ++at;  // a few steps: z ascends within the column
          }
          row[k] = keys[at] == key ? static_cast<int32_t>(at) : -1;
        }
      }
    }
  });
  return map;
}

int64_t SortedRows::seek(int64_t key, int64_t j) const {
  // Gallop from j to the first key >= key (the sentinel ends the keys),
  // forward or back, then bisect the last step.
  const int64_t* k = packed_.keys.data();
  const int64_t n = static_cast<int64_t>(packed_.keys.size()) - 1;
  if (k[j] < key) {
    int64_t lo = j, step = 1;  // k[lo] < key
    while (j + step < n && k[j + step] < key) {
      lo = j + step;
      step *= 2;
    }
    return std::lower_bound(k + lo + 1, k + std::min(j + step, n), key) - k;
  }
  int64_t hi = j, step = 1;  // k[hi] >= key
  while (j - step >= 0 && k[j - step] >= key) {
    hi = j - step;
    step *= 2;
  }
  return std::lower_bound(k + std::max<int64_t>(j - step + 1, 0), k + hi, key) - k;
}

}  // namespace mlx_lattice
