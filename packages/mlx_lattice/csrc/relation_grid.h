// A cache-friendly coordinate index for relations of a coordinate set with
// itself (submanifold relations, unstrided forward relations).
//
// Space is cut into blocks of kEdge^3 cells; a small open-addressing table
// maps each occupied block (batch, x >> 2, y >> 2, z >> 2) to a dense array
// of kEdge^3 row slots. Neighbours are searched block by block: the 27
// blocks around a block are resolved once, and every lookup of its voxels
// is then an array read inside those 27 (a few KiB, cache resident), where
// a hash of single coordinates takes one cache miss per lookup.
//
// The grid applies when every kernel offset stays within one block along
// each axis and the occupied blocks are dense enough (see build); the
// builder falls back to its coordinate hash otherwise.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/parallel.h"

namespace mlx_lattice {

class BlockGrid {
 public:
  static constexpr int kShift = 2;
  static constexpr int kEdge = 1 << kShift;
  static constexpr int kCells = kEdge * kEdge * kEdge;

  // Whether lookups at these offsets stay within the neighbouring blocks.
  static bool covers(const std::vector<std::array<int64_t, 3>>& offsets);

  // Slots per row past which build gives up: sparse points, for which the
  // coordinate hash is smaller. (Sorted points take the walk of
  // relation_sorted.h, faster than the grid even on a sphere's surface at
  // 4.4 slots per row.)
  static constexpr int64_t kMaxSlotsPerRow = 16;

  // Indexes n rows of (batch, x, y, z) coords. Returns false, having built
  // nothing, when the occupied blocks would hold more than max_slots_per_row
  // slots per row. Raises ValueError naming `name` and both rows of the
  // first duplicate.
  bool build(const int32_t* coords, int64_t n, const std::string& name,
             int64_t max_slots_per_row = kMaxSlotsPerRow);

  // Calls visit(row, nbr) for every row, nbr[k] the row at coords[row] +
  // offsets[k] or -1. Rows are visited block by block on the thread pool;
  // each row is visited exactly once, so per-row writes are deterministic.
  template <class Visit>
  void for_each_row(const std::vector<std::array<int64_t, 3>>& offsets, Visit&& visit) const;

 private:
  static constexpr int kBlocksPerTask = 64;

  void find_neighbours();

  const int32_t* coords_ = nullptr;
  int64_t n_ = 0;
  size_t mask_ = 0;
  std::vector<int32_t> table_;             // block table: block id or -1
  std::vector<std::array<int32_t, 4>> keys_;  // key of each block id
  std::vector<int32_t> cells_;             // kCells row slots per block, -1 empty
  std::vector<int32_t> block_offsets_;     // rows of each block: CSR offsets
  std::vector<int32_t> block_rows_;        // rows of each block, ascending
  std::vector<int32_t> around_;            // 27 neighbouring block ids (or -1) per block
};

template <class Visit>
void BlockGrid::for_each_row(const std::vector<std::array<int64_t, 3>>& offsets,
                             Visit&& visit) const {
  const int64_t n_blocks = static_cast<int64_t>(keys_.size());
  const int64_t n_kernels = static_cast<int64_t>(offsets.size());
  // Each block is copied with a halo of h cells into a padded cube of P^3
  // row slots; the neighbour at offset k of the row in padded cell i is then
  // pad[i + delta[k]].
  int h = 0;
  for (const auto& off : offsets) {
    for (int64_t v : off) h = std::max(h, static_cast<int>(v < 0 ? -v : v));
  }
  const int P = kEdge + 2 * h;
  std::vector<int64_t> delta(n_kernels);
  for (int64_t k = 0; k < n_kernels; ++k) {
    delta[k] = (offsets[k][0] * P + offsets[k][1]) * P + offsets[k][2];
  }
  // Per padded coordinate: the neighbouring block along the axis (0..2) and
  // the cell inside it.
  std::vector<int> side(P), cell(P);
  for (int p = 0; p < P; ++p) {
    side[p] = ((p - h) >> kShift) + 1;
    cell[p] = (p - h) & (kEdge - 1);
  }
  static const std::array<int32_t, kCells> empty = [] {
    std::array<int32_t, kCells> e;
    e.fill(-1);
    return e;
  }();
  parallel_for((n_blocks + kBlocksPerTask - 1) / kBlocksPerTask, [&](int64_t task) {
    const int64_t b1 = std::min(n_blocks, (task + 1) * kBlocksPerTask);
    std::vector<int32_t> nbr(n_kernels), pad(static_cast<size_t>(P) * P * P);
    const int32_t* around[27];
    for (int64_t b = task * kBlocksPerTask; b < b1; ++b) {
      for (int d = 0; d < 27; ++d) {
        const int32_t id = around_[b * 27 + d];
        around[d] = id < 0 ? empty.data() : cells_.data() + static_cast<int64_t>(id) * kCells;
      }
      int32_t* dst = pad.data();
      for (int px = 0; px < P; ++px) {
        for (int py = 0; py < P; ++py) {
          const int32_t* const* row_blocks = around + (side[px] * 3 + side[py]) * 3;
          const int base = (cell[px] * kEdge + cell[py]) * kEdge;
          for (int pz = 0; pz < P; ++pz) *dst++ = row_blocks[side[pz]][base + cell[pz]];
        }
      }
      for (int32_t j = block_offsets_[b]; j < block_offsets_[b + 1]; ++j) {
        const int32_t row = block_rows_[j];
        const int32_t* c = coords_ + 4 * static_cast<int64_t>(row);
        const int64_t i = (((c[1] & (kEdge - 1)) + h) * P + ((c[2] & (kEdge - 1)) + h)) * P +
                          ((c[3] & (kEdge - 1)) + h);
        for (int64_t k = 0; k < n_kernels; ++k) nbr[k] = pad[i + delta[k]];
        visit(static_cast<int64_t>(row), nbr.data());
      }
    }
  });
}

}  // namespace mlx_lattice
