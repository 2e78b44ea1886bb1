#include "relation_hash.h"

#include <algorithm>
#include <limits>

#include "cpu/parallel.h"

namespace mlx_lattice {

// The (n_out, K) neighbour map through the coordinate hash, in parallel tiles
// of outputs. Lookups go in batches: hash and prefetch a batch, then probe
// it, so the cache misses of one batch overlap. A submanifold relation with
// odd kernel sizes is symmetric (p = q + offset(k) <=> q = p + offset(K - 1
// - k)), so only the offsets before the centre are looked up and each hit
// fills its mirror cell; every cell has exactly one writer, so the map does
// not depend on scheduling.
std::vector<int32_t> neighbour_map(const CoordTable& table, const int32_t* out_c, int64_t n_out,
                                   const std::vector<std::array<int64_t, 3>>& offsets,
                                   bool symmetric) {
  const int64_t n_kernels = static_cast<int64_t>(offsets.size());
  const int64_t searched = symmetric ? n_kernels / 2 : n_kernels;
  std::vector<int32_t> map(n_out * n_kernels, -1);
  const int64_t tile = 1024;
  constexpr int64_t kBatch = 32;
  parallel_for((n_out + tile - 1) / tile, [&](int64_t t) {
    const int64_t o1 = std::min(n_out, (t + 1) * tile);
    int32_t keys[kBatch][4];
    uint64_t hashes[kBatch];
    bool valid[kBatch];
    for (int64_t o = t * tile; o < o1; ++o) {
      const int32_t* c = out_c + 4 * o;
      if (symmetric) map[o * n_kernels + n_kernels / 2] = static_cast<int32_t>(o);
      for (int64_t k0 = 0; k0 < searched; k0 += kBatch) {
        const int64_t nb = std::min(kBatch, searched - k0);
        for (int64_t b = 0; b < nb; ++b) {
          int32_t* q = keys[b];
          q[0] = c[0];
          bool inside = true;
          for (int a = 0; a < 3; ++a) {
            int64_t v = static_cast<int64_t>(c[a + 1]) + offsets[k0 + b][a];
            inside = inside && v >= std::numeric_limits<int32_t>::min() &&
                     v <= std::numeric_limits<int32_t>::max();
            q[a + 1] = static_cast<int32_t>(v);
          }
          valid[b] = inside;
          hashes[b] = hash_coord(q);
          table.prefetch(hashes[b]);
        }
        for (int64_t b = 0; b < nb; ++b) {
          const int32_t row = valid[b] ? table.find_hashed(keys[b], hashes[b]) : -1;
          map[o * n_kernels + k0 + b] = row;
          if (symmetric && row >= 0) {
            map[static_cast<int64_t>(row) * n_kernels + (n_kernels - 1 - (k0 + b))] =
                static_cast<int32_t>(o);
          }
        }
      }
    }
  });
  return map;
}

}  // namespace mlx_lattice
