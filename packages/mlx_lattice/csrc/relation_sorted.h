// Neighbour search for coordinates sorted by (batch, x, y, z), by merging
// instead of hashing.
//
// Sorted rows form columns (runs of one (batch, x, y), z ascending) and
// slabs (runs of one (batch, x), y ascending). For a slab and an offset's
// (dx, dy), the neighbouring slab is found once, and its columns are walked
// with one pointer per dy as the slab's own columns ascend in y; inside a
// column pair the z values are merged. Every access is sequential: no hash
// probe and no cache miss per lookup, which on sparse scans (a LiDAR sweep
// at 5 cm: 1.9 voxels per column) is where the coordinate hash spends its
// time.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace mlx_lattice {

// Whether the n rows of (batch, x, y, z) are strictly ascending (so also
// free of duplicates).
bool rows_sorted(const int32_t* coords, int64_t n);

// The (n, K) neighbour map of a sorted coordinate set with itself: cell
// (r, k) is the row at coords[r] + offsets[k], or -1. Rows must be strictly
// ascending (rows_sorted). Same result as a hash search, cell for cell.
// `symmetric`: offset K - 1 - k is minus offset k (odd kernel sizes), so
// only the offsets before the centre are searched and each hit also fills
// its mirror cell (every cell still has one writer).
std::vector<int32_t> sorted_neighbour_map(const int32_t* coords, int64_t n,
                                          const std::vector<std::array<int64_t, 3>>& offsets,
                                          bool symmetric);

}  // namespace mlx_lattice
