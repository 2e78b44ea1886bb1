#include "group_by.h"

#include <vector>

namespace mlx_lattice::kernels {

void group_by(const int32_t* keys, int64_t n_edges, int64_t groups, std::vector<int32_t>& offsets,
              std::vector<int32_t>& edge_ids) {
  offsets.assign(groups + 1, 0);
  for (int64_t e = 0; e < n_edges; ++e) ++offsets[keys[e] + 1];
  for (int64_t g = 0; g < groups; ++g) offsets[g + 1] += offsets[g];
  edge_ids.resize(n_edges);
  std::vector<int32_t> cursor(offsets.begin(), offsets.end() - 1);
  for (int64_t e = 0; e < n_edges; ++e) edge_ids[cursor[keys[e]]++] = static_cast<int32_t>(e);
}

}  // namespace mlx_lattice::kernels
