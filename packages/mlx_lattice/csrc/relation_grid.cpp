#include "relation_grid.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "relation_hash.h"
#include "validate.h"

namespace mlx_lattice {

bool BlockGrid::covers(const std::vector<std::array<int64_t, 3>>& offsets) {
  for (const auto& off : offsets) {
    for (int64_t v : off) {
      if (v < -kEdge || v > kEdge) return false;
    }
  }
  return true;
}

bool BlockGrid::build(const int32_t* coords, int64_t n, const std::string& name,
                      int64_t max_slots_per_row) {
  // Pass 1: the block of every row (block ids in order of first appearance).
  // The table holds at most n blocks; it grows by doubling at half load.
  std::vector<int32_t> row_block(n);
  size_t cap = 1024;
  std::vector<int32_t> table(cap, -1);
  std::vector<std::array<int32_t, 4>> keys;
  auto rehash = [&] {
    cap *= 2;
    table.assign(cap, -1);
    for (size_t id = 0; id < keys.size(); ++id) {
      size_t i = hash_coord(keys[id].data()) & (cap - 1);
      while (table[i] >= 0) i = (i + 1) & (cap - 1);
      table[i] = static_cast<int32_t>(id);
    }
  };
  for (int64_t r = 0; r < n; ++r) {
    const int32_t* c = coords + 4 * r;
    const std::array<int32_t, 4> key = {c[0], c[1] >> kShift, c[2] >> kShift, c[3] >> kShift};
    size_t i = hash_coord(key.data()) & (cap - 1);
    int32_t id;
    // (16-byte memcmp, inlined; GCC 12 calls the library for std::array's
    // operator!=, a third of this serial pass.)
    while ((id = table[i]) >= 0 && std::memcmp(keys[id].data(), key.data(), 16) != 0) {
      i = (i + 1) & (cap - 1);
    }
    if (id < 0) {
      id = static_cast<int32_t>(keys.size());
      keys.push_back(key);
      table[i] = id;
      if (2 * keys.size() > cap) rehash();
      if (static_cast<int64_t>(keys.size()) * kCells > max_slots_per_row * n + 4 * kCells) {
        return false;
      }
    }
    row_block[r] = id;
  }
  const int64_t n_blocks = static_cast<int64_t>(keys.size());

  // Pass 2: cells in row order (so the first duplicate is the first row whose
  // coordinate an earlier row holds), and the rows of each block.
  std::vector<int32_t> cells(n_blocks * kCells, -1);
  std::vector<int32_t> offsets(n_blocks + 1, 0);
  for (int64_t r = 0; r < n; ++r) {
    const int32_t* c = coords + 4 * r;
    const int local = (((c[1] & (kEdge - 1)) * kEdge) + (c[2] & (kEdge - 1))) * kEdge +
                      (c[3] & (kEdge - 1));
    int32_t& slot = cells[static_cast<int64_t>(row_block[r]) * kCells + local];
    if (slot >= 0) {
      std::ostringstream msg;
      msg << name << " has duplicate coordinate (" << c[0] << ", " << c[1] << ", " << c[2] << ", "
          << c[3] << ") at rows " << slot << " and " << r << ".";
      fail("build_kernel_relation", msg.str());
    }
    slot = static_cast<int32_t>(r);
    ++offsets[row_block[r] + 1];
  }
  for (int64_t b = 0; b < n_blocks; ++b) offsets[b + 1] += offsets[b];
  std::vector<int32_t> rows(n);
  std::vector<int32_t> cursor(offsets.begin(), offsets.end() - 1);
  for (int64_t r = 0; r < n; ++r) rows[cursor[row_block[r]]++] = static_cast<int32_t>(r);

  coords_ = coords;
  n_ = n;
  mask_ = cap - 1;
  table_ = std::move(table);
  keys_ = std::move(keys);
  cells_ = std::move(cells);
  block_offsets_ = std::move(offsets);
  block_rows_ = std::move(rows);
  find_neighbours();
  return true;
}

void BlockGrid::find_neighbours() {
  // Direction d = (dx + 1) * 9 + (dy + 1) * 3 + (dz + 1); block b is the
  // neighbour at 26 - d of its neighbour at d, so only d < 13 is searched and
  // each hit also fills its mirror. Every entry has one writer.
  const int64_t n_blocks = static_cast<int64_t>(keys_.size());
  around_.assign(n_blocks * 27, -1);
  constexpr int64_t kPerTask = 256;
  parallel_for((n_blocks + kPerTask - 1) / kPerTask, [&](int64_t task) {
    for (int64_t b = task * kPerTask; b < std::min(n_blocks, (task + 1) * kPerTask); ++b) {
      const std::array<int32_t, 4>& key = keys_[b];
      around_[b * 27 + 13] = static_cast<int32_t>(b);
      int32_t probes[13][4];
      uint64_t hashes[13];
      for (int d = 0; d < 13; ++d) {
        int32_t* p = probes[d];
        p[0] = key[0];
        p[1] = key[1] + d / 9 - 1;
        p[2] = key[2] + d / 3 % 3 - 1;
        p[3] = key[3] + d % 3 - 1;
        hashes[d] = hash_coord(p);
        __builtin_prefetch(table_.data() + (hashes[d] & mask_));
      }
      for (int d = 0; d < 13; ++d) {
        int32_t id;
        for (size_t i = hashes[d] & mask_;; i = (i + 1) & mask_) {
          id = table_[i];
          if (id < 0 || std::memcmp(keys_[id].data(), probes[d], 16) == 0) break;
        }
        around_[b * 27 + d] = id;
        if (id >= 0) around_[static_cast<int64_t>(id) * 27 + 26 - d] = static_cast<int32_t>(b);
      }
    }
  });
}

}  // namespace mlx_lattice
