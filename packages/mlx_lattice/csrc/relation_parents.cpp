#include "relation_parents.h"

#include <algorithm>
#include <bit>
#include <limits>

#include "relation_strided.h"
#include "cpu/parallel.h"

namespace mlx_lattice {

std::optional<Parents> single_parents(const int32_t* fine, int64_t n_fine, const int32_t* coarse,
                                      int64_t n_coarse, const SortedRows* sorted_coarse,
                                      const CoordTable* coarse_table,
                                      const std::vector<int32_t>& floored_row, Triple stride,
                                      Triple kernel_size, Triple dilation, Triple tensor_stride) {
  // A coarse row by key from a cursor (one per tile of fine rows), or hashed.
  auto find = [&](const int32_t* q, int64_t& cursor) {
    return sorted_coarse ? sorted_coarse->find(q, cursor)
                         : coarse_table->find_hashed(q, hash_coord(q));
  };
  FloorDiv to_tap[3], to_pair[3], to_step[3];
  for (int a = 0; a < 3; ++a) {
    if (kernel_size[a] > 2) return std::nullopt;
    const int64_t d = static_cast<int64_t>(dilation[a]) * tensor_stride[a];
    to_tap[a] = FloorDiv(d);
    to_pair[a] = FloorDiv(2 * d);
    to_step[a] = FloorDiv(static_cast<int64_t>(stride[a]) * tensor_stride[a]);
  }
  const bool computed = !floored_row.empty();
  // Powers of two throughout (tensor strides are): p - q is a mask, and,
  // for computed outputs, flooring to the pair is flooring to the stride
  // when the two are equal.
  bool masks_only = true;
  for (int a = 0; a < 3; ++a) {
    const FloorDiv& floor_q = kernel_size[a] == 2 ? to_pair[a] : to_step[a];
    masks_only = masks_only && std::has_single_bit(static_cast<uint64_t>(floor_q.step())) &&
                 std::has_single_bit(static_cast<uint64_t>(to_tap[a].step())) &&
                 (!computed || kernel_size[a] == 1 || to_pair[a].step() == to_step[a].step());
  }
  constexpr int64_t kTile = 4096;
  // (Computed outputs with masks only are multiples of the pairs.)
  std::vector<char> fits(computed && masks_only ? 0 : ceil_div(n_coarse, kTile), 1);
  parallel_for(static_cast<int64_t>(fits.size()), [&](int64_t t) {
    const FloorDiv pair[3] = {to_pair[0], to_pair[1], to_pair[2]};
    const bool two[3] = {kernel_size[0] == 2, kernel_size[1] == 2, kernel_size[2] == 2};
    bool all = true;
    for (int64_t r = t * kTile; r < std::min(n_coarse, (t + 1) * kTile); ++r) {
      for (int a = 0; a < 3; ++a) {
        const int64_t v = coarse[4 * r + a + 1];
        all = all && (!two[a] || pair[a].floor(v) == v);
      }
    }
    fits[t] = all;
  });
  if (std::find(fits.begin(), fits.end(), 0) != fits.end()) return std::nullopt;
  Parents parents;
  parents.row.resize(n_fine);
  parents.kernel.resize(n_fine);
  parallel_for(ceil_div(n_fine, kTile), [&](int64_t t) {
    // Locals: without strict aliasing each store could change the arrays.
    const FloorDiv tap_of[3] = {to_tap[0], to_tap[1], to_tap[2]};
    const FloorDiv pair[3] = {to_pair[0], to_pair[1], to_pair[2]};
    const FloorDiv step[3] = {to_step[0], to_step[1], to_step[2]};
    const int size[3] = {kernel_size[0], kernel_size[1], kernel_size[2]};
    const int32_t* floored = floored_row.data();
    int32_t* rows = parents.row.data();
    int32_t* kernels = parents.kernel.data();
    int64_t cursor = 0;
    const int64_t p0 = t * kTile, p1 = std::min(n_fine, (t + 1) * kTile);
    if (masks_only) {
      // Size 2: q = v & -2d and v - q in {0, d}; size 1: q = v, on the
      // stride's multiples when computed.
      int64_t d[3], below_mask[3];
      for (int a = 0; a < 3; ++a) {
        d[a] = tap_of[a].step();
        below_mask[a] = size[a] == 2 ? -pair[a].step() : computed ? -step[a].step() : -1;
      }
      for (int64_t p = p0; p < p1; ++p) {
        const int32_t* c = fine + 4 * p;
        int32_t q[4] = {c[0], 0, 0, 0};
        int32_t k = 0;
        bool ok = true;  // bitwise, without branches: whether rest is 0 or d is data
        for (int a = 0; a < 3; ++a) {
          const int64_t v = c[a + 1], below = v & below_mask[a], rest = v - below;
          if (size[a] == 2) {
            ok &= ((rest == 0) | (rest == d[a])) & (below >= std::numeric_limits<int32_t>::min());
            k = 2 * k + (rest != 0);
          } else {
            ok &= rest == 0;
          }
          q[a + 1] = static_cast<int32_t>(below);
        }
        const int32_t row = !ok ? -1 : computed ? floored[p] : find(q, cursor);
        rows[p] = row;
        kernels[p] = row < 0 ? 0 : k;
      }
      return;
    }
    for (int64_t p = p0; p < p1; ++p) {
      const int32_t* c = fine + 4 * p;
      int32_t q[4] = {c[0], 0, 0, 0};
      int32_t k = 0;
      bool ok = true;
      for (int a = 0; a < 3; ++a) {
        int64_t v = c[a + 1], tap = 0;
        if (size[a] == 2) {
          const int64_t below = pair[a].floor(v);
          tap = tap_of[a].quotient(v - below);
          ok = ok && tap_of[a].floor(v - below) == v - below &&
               below >= std::numeric_limits<int32_t>::min();
          v = below;
          if (computed) ok = ok && v == step[a].floor(c[a + 1]);
        } else if (computed) {
          ok = ok && v == step[a].floor(v);
        }
        q[a + 1] = static_cast<int32_t>(v);
        k = k * size[a] + static_cast<int32_t>(tap);
      }
      const int32_t row = !ok ? -1 : computed ? floored[p] : find(q, cursor);
      rows[p] = row;
      kernels[p] = row < 0 ? 0 : k;
    }
  });
  return parents;
}

}  // namespace mlx_lattice
