#include "tiles.h"

namespace mlx_lattice::kernels {

void sort_tile_edges(const Csr& csr, int64_t g0, int64_t g1, const int32_t* kernel_ids,
                     int64_t n_kernels, TileEdges& t) {
  const int64_t j0 = csr.offsets[g0];
  const int64_t j1 = csr.offsets[g1];
  t.counts.assign(n_kernels + 1, 0);
  t.edges.resize(j1 - j0);
  if (csr.edge_ids) {
    for (int64_t j = j0; j < j1; ++j) ++t.counts[kernel_ids[csr.edge_ids[j]] + 1];
  } else {
    for (int64_t j = j0; j < j1; ++j) ++t.counts[kernel_ids[j] + 1];
  }
  for (int64_t k = 0; k < n_kernels; ++k) t.counts[k + 1] += t.counts[k];
  t.cursor.assign(t.counts.begin(), t.counts.end() - 1);
  for (int64_t j = j0; j < j1; ++j) {
    const int32_t e = csr.edge_ids ? csr.edge_ids[j] : static_cast<int32_t>(j);
    t.edges[t.cursor[kernel_ids[e]]++] = e;
  }
}

}  // namespace mlx_lattice::kernels
