// The coordinate hash of the relation builder: an open-addressing table of
// (batch, x, y, z) rows, and the neighbour map searched through it (for
// coordinates in any order; relation_sorted.h merges sorted ones and
// relation_grid.h indexes dense ones).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

namespace mlx_lattice {

// Multiply-xor hash of the four coordinates with one final avalanche round.
inline uint64_t hash_coord(const int32_t* c) {
  uint64_t h = static_cast<uint64_t>(static_cast<uint32_t>(c[0])) * 0x27d4eb2f165667c5ULL ^
               static_cast<uint64_t>(static_cast<uint32_t>(c[1])) * 0x9e3779b97f4a7c15ULL ^
               static_cast<uint64_t>(static_cast<uint32_t>(c[2])) * 0xc2b2ae3d27d4eb4fULL ^
               static_cast<uint64_t>(static_cast<uint32_t>(c[3])) * 0x165667b19e3779f9ULL;
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 32;
  return h;
}

// Open-addressing table keyed by the full coordinate. A slot packs a 32-bit
// fingerprint of the hash with the row index, so most misses are decided
// without touching the coordinates; a fingerprint match is confirmed by
// comparing the full key, so a collision can never alias two coordinates.
class CoordTable {
 public:
  CoordTable(const int32_t* coords, int64_t n) : coords_(coords) {
    size_t cap = 16;
    while (cap < static_cast<size_t>(2 * n)) cap <<= 1;
    mask_ = cap - 1;
    slots_.assign(cap, kEmpty);
  }

  // Inserts row; returns the row already holding the coordinate, or -1.
  int32_t insert(int32_t row) {
    const int32_t* c = coords_ + 4 * static_cast<int64_t>(row);
    const uint64_t h = hash_coord(c);
    const uint64_t tag = h >> 32;
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const uint64_t s = slots_[i];
      if (s == kEmpty) {
        slots_[i] = (tag << 32) | static_cast<uint32_t>(row);
        return -1;
      }
      if ((s >> 32) == tag && same(static_cast<int32_t>(s & 0xffffffffu), c)) {
        return static_cast<int32_t>(s & 0xffffffffu);
      }
    }
  }

  // Starts loading the slot a lookup of hash h will read first.
  void prefetch(uint64_t h) const { __builtin_prefetch(slots_.data() + (h & mask_)); }

  int32_t find_hashed(const int32_t* c, uint64_t h) const {
    const uint64_t tag = h >> 32;
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const uint64_t s = slots_[i];
      if (s == kEmpty) return -1;
      if ((s >> 32) == tag && same(static_cast<int32_t>(s & 0xffffffffu), c)) {
        return static_cast<int32_t>(s & 0xffffffffu);
      }
    }
  }

 private:
  // Rows are < 2^31, so a slot with all low bits set is never a real entry.
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  bool same(int32_t row, const int32_t* c) const {
    return std::memcmp(coords_ + 4 * static_cast<int64_t>(row), c, 16) == 0;
  }

  const int32_t* coords_;
  size_t mask_ = 0;
  std::vector<uint64_t> slots_;
};

// The (n_out, K) neighbour map of out_c's rows in `table`: cell (o, k) is the
// row at out_c[o] + offsets[k], or -1 (see relation_hash.cpp).
std::vector<int32_t> neighbour_map(const CoordTable& table, const int32_t* out_c, int64_t n_out,
                                   const std::vector<std::array<int64_t, 3>>& offsets,
                                   bool symmetric);

}  // namespace mlx_lattice
