// Neighbour search for coordinates sorted by (batch, x, y, z), by walking
// instead of hashing.
//
// Each row gets one 64-bit key in mixed radix (batch, then x, y, z, each
// axis padded by the kernel's reach), so keys ascend with the rows and the
// neighbour at offset (dx, dy, dz) has the row's key plus a constant. For
// the offsets of one (dx, dy), one pointer then walks the sorted keys
// alongside the rows: every access is sequential, with no hash probe and no
// cache miss per lookup, which on sparse scans (a LiDAR sweep at 5 cm: 1.9
// voxels per column) is where a coordinate hash spends its time.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace mlx_lattice {

// std::allocator but for value-initialization (resize(n), vector(n)), which
// leaves the entries unset: for scratch that a pass writes whole before any
// read, where zeroing it first is a serial pass of its own.
template <typename T>
struct UnsetAllocator : std::allocator<T> {
  UnsetAllocator() noexcept = default;
  template <typename U>
  UnsetAllocator(const UnsetAllocator<U>&) noexcept {}
  template <typename U>
  struct rebind {
    using other = UnsetAllocator<U>;
  };
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <typename T>
using UnsetVector = std::vector<T, UnsetAllocator<T>>;

// Keys of n > 0 rows in mixed radix, ((b * X + x) * Y + y) * Z + z, each
// coordinate shifted to start at h (the offsets' reach on that axis) and
// each radix the axis' range plus 2h, so a neighbour's key is the row's key
// plus a constant per offset and never aliases another coordinate; they
// ascend with the rows. `keys` (n + 1, the last a sentinel above every key)
// is empty when the rows are not strictly ascending or the product of
// radices passes 2^62.
struct PackedKeys {
  UnsetVector<int64_t> keys;
  std::array<int64_t, 3> radix{}, reach{};
  std::array<int64_t, 4> low{}, high{};
};
PackedKeys packed_keys(const int32_t* coords, int64_t n,
                       const std::vector<std::array<int64_t, 3>>& offsets);

// Whether the rows strictly ascend by (batch, x, y, z) (so hold no
// duplicate).
bool rows_ascending(const int32_t* coords, int64_t n);

// The same, for n > 0 rows, with each column's range (low[4], high[4])
// from the same pass over parallel chunks of rows.
bool rows_ascending(const int32_t* coords, int64_t n, std::array<int64_t, 4>& low,
                    std::array<int64_t, 4>& high);

// A coordinate set sorted by (batch, x, y, z), searched by key from a
// cursor instead of hashed: lookups whose coordinates mostly ascend (the
// coarse rows of sorted finer rows) move the cursor a few keys at a time.
class SortedRows {
 public:
  // Nothing when the rows are not strictly ascending or span more than
  // 2^62 cells.
  static std::optional<SortedRows> of(const int32_t* coords, int64_t n);

  // The (n_out, K) neighbour map of other rows into this set, row-major:
  // cell (o, k) is the row at out_c[o] + offsets[k], or -1; the hash
  // search's map (neighbour_map, not symmetric), cell for cell. Per output
  // and (dx, dy), one search from that column's cursor, then each further
  // dz a step or two on; parallel tiles of outputs. Where the outputs
  // ascend too (a strided relation's computed outputs), each cursor moves a
  // few keys at a time.
  std::vector<int32_t> neighbour_map(const int32_t* out_c, int64_t n_out,
                                     const std::vector<std::array<int64_t, 3>>& offsets) const;

  // The row of coordinate q (batch, x, y, z), or -1. The search starts at
  // `cursor` (any row, or n) and leaves it at q's place.
  int32_t find(const int32_t* q, int64_t& cursor) const {
    const PackedKeys& p = packed_;
    int64_t key = 0;
    for (int a = 0; a < 4; ++a) {
      if (q[a] < p.low[a] || q[a] > p.high[a]) return -1;
      key = (a == 0 ? 0 : key * p.radix[a - 1]) + (q[a] - p.low[a]);
    }
    // Mostly the key at the cursor or the next one (siblings share a
    // parent; a column's parents ascend).
    const int64_t* k = p.keys.data();
    int64_t j = cursor;
    if (k[j] != key) j = k[j] < key && k[j + 1] >= key ? j + 1 : seek(key, j);
    cursor = j;
    return k[j] == key ? static_cast<int32_t>(j) : -1;
  }

 private:
  // The first position at or after which keys are >= key, from j.
  int64_t seek(int64_t key, int64_t j) const;

  PackedKeys packed_;
};

// The (n, K) neighbour map of a sorted coordinate set with itself, row-major:
// cell (r, k) is the row at coords[r] + offsets[k], or -1. Same result as a
// hash search, cell for cell. Returns null, having written nothing, when
// the rows of (batch, x, y, z) are not strictly ascending or the keys do not
// fit (the coordinates span more than 2^62 cells in all): search otherwise.
// `symmetric`: offset K - 1 - k is minus offset k (odd kernel sizes), so
// only the offsets before the centre are searched and each hit also fills
// its mirror cell (every cell still has one writer).
//
// With `masks` (n entries; symmetric, at most 32 offsets), each row's offset
// mask is written instead of the mirrors (bit k set where row r has a
// neighbour at offset k, the centre included), and the map holds only the
// searched columns: (n, K / 2), of which only the cells whose bit is set
// in their row's mask are written (the others are unset, not -1).
std::unique_ptr<int32_t[]> sorted_neighbour_map(const int32_t* coords, int64_t n,
                                          const std::vector<std::array<int64_t, 3>>& offsets,
                                          bool symmetric, uint32_t* masks = nullptr);

}  // namespace mlx_lattice
