// CPU evaluation of GeometryHash: the same results as the Metal kernels
// (geometry_hash.metal) from a serial open-addressing index. The scratch
// outputs (table, minrow, slot_of) are filled with -1.
#include <algorithm>
#include <cstring>
#include <vector>

#include "../primitives.h"
#include "eval.h"

namespace mlx_lattice {

namespace {

uint64_t row_hash(const int32_t* c) {
  uint64_t h = 1469598103934665603ull;
  for (int a = 0; a < 4; ++a) h = (h ^ static_cast<uint32_t>(c[a])) * 1099511628211ull;
  return h ^ (h >> 29);
}

bool same_row(const int32_t* a, const int32_t* b) { return std::memcmp(a, b, 4 * sizeof(int32_t)) == 0; }

}  // namespace

void GeometryHash::eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) {
  cpu::dispatch(stream(), inputs, outputs, [slots = slots_](std::vector<array>& in,
                                                           std::vector<array>& out) {
    const int64_t n = in[0].shape(0), q = in[1].shape(0);
    const int32_t* coords = n ? in[0].data<int32_t>() : nullptr;
    const int32_t* queries = q ? in[1].data<int32_t>() : nullptr;
    // Rows are inserted in order, so a slot holds the smallest row of its
    // coordinates.
    const uint64_t mask = static_cast<uint64_t>(slots) - 1;
    std::vector<int32_t> table(slots, -1);
    auto find = [&](const int32_t* c, bool insert, int32_t row) -> int32_t {
      for (uint64_t i = row_hash(c) & mask;; i = (i + 1) & mask) {
        const int32_t s = table[i];
        if (s < 0) {
          if (insert) table[i] = row;
          return insert ? row : -1;
        }
        if (same_row(coords + 4 * static_cast<int64_t>(s), c)) return s;
      }
    };
    for (int64_t r = 0; r < n; ++r) {
      out[0].data<int32_t>()[r] = find(coords + 4 * r, true, static_cast<int32_t>(r));
      out[4].data<int32_t>()[r] = -1;
    }
    for (int64_t i = 0; i < q; ++i) out[1].data<int32_t>()[i] = find(queries + 4 * i, false, -1);
    std::fill_n(out[2].data<int32_t>(), slots, -1);
    std::fill_n(out[3].data<int32_t>(), slots, -1);
  });
}

}  // namespace mlx_lattice
