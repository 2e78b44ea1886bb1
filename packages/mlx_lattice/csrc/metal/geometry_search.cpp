// GPU encode bodies of the neighbour and coordinate primitives (kernels in
// geometry_search.metal). GeometryKnn's graph builder added the support's
// grid (sorted keys, their permutation, the sorted points) as inputs 4-6.
#include <algorithm>
#include <cmath>
#include <limits>

#include "encode.h"

namespace mlx_lattice::gpu {

void encode(const GeometryKnn& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  const auto& g = p.grid();
  KnnPlan plan{u32(in[0].shape(0)),
               u32(in[2].shape(0)),
               u32(p.k()),
               u32(g.n_batches),
               {g.dims[0], g.dims[1], g.dims[2]},
               {g.origin[0], g.origin[1], g.origin[2]},
               1.0f / g.cell,
               g.cell,
               p.radius() > 0 ? static_cast<float>(p.radius() * p.radius())
                              : std::numeric_limits<float>::infinity()};
  encode_knn(enc, ops.floats(in[0]), ops.index(in[1]), ops.floats(in[6]), ops.index(in[5]),
             ops.index(in[4]), ops.index(out[0]), ops.output(out[1]), plan);
}

void encode(const GeometryMorton&, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  encode_morton(enc, ops.index(in[0]), ops.index(out[0]), u32(in[0].shape(0)));
}

// Inputs: query, qbatch, support, sbatch, [offsets,] then the grid (sorted
// keys, their permutation, the sorted support).
void encode(const GeometryRadius& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  const auto& g = p.grid();
  const size_t grid = p.fill() ? 5 : 4;
  KnnPlan plan{u32(in[0].shape(0)),
               u32(in[2].shape(0)),
               1,
               u32(g.n_batches),
               {g.dims[0], g.dims[1], g.dims[2]},
               {g.origin[0], g.origin[1], g.origin[2]},
               1.0f / g.cell,
               g.cell,
               static_cast<float>(p.radius() * p.radius())};
  // Cells per axis that can hold a point within r (one more for the
  // rounding of the cell assignment), at most the grid.
  const double widest = std::max({g.dims[0], g.dims[1], g.dims[2]});
  const auto reach = static_cast<int32_t>(std::min(widest, std::ceil(p.radius() / g.cell) + 1.0));
  if (p.fill()) {
    encode_radius(enc, ops.floats(in[0]), ops.index(in[1]), ops.floats(in[grid + 2]),
                  ops.index(in[grid + 1]), ops.index(in[grid]), ops.index(in[4]), Buffer{},
                  ops.index(out[0]), ops.output(out[1]), plan, reach, true);
  } else {
    encode_radius(enc, ops.floats(in[0]), ops.index(in[1]), ops.floats(in[grid + 2]),
                  ops.index(in[grid + 1]), ops.index(in[grid]), Buffer{}, ops.index(out[0]),
                  Buffer{}, Buffer{}, plan, reach, false);
  }
}

}  // namespace mlx_lattice::gpu
