#include "relation_transpose.h"

#include <algorithm>
#include <cstdint>

#include "relation_buffer.h"
#include "relation_groups.h"
#include "cpu/parallel.h"

namespace mlx_lattice {

std::map<std::string, mx::array> transpose_relation(const Relation& rel) {
  // New outputs are the old inputs: the old input grouping lists each new
  // output row's edges (old edge ids), and its offsets are the new output
  // offsets.
  const int64_t n_rows = rel.n_in, n_groups = rel.n_out, n_kernels = rel.n_kernels;
  const int64_t n_edges = rel.n_edges();
  const int32_t* by_in = rel.in_offsets.data<int32_t>();
  const int32_t* old_ids = rel.in_edge_ids.data<int32_t>();
  const int32_t* old_out = rel.out_rows.data<int32_t>();
  const int32_t* old_kernel = rel.kernel_ids.data<int32_t>();

  Int32Buffer out_offsets(n_rows + 1);
  std::copy(by_in, by_in + n_rows + 1, out_offsets.data);
  Int32Buffer in_rows(n_edges), out_rows(n_edges), kernel_ids(n_edges);
  constexpr int64_t kTile = 4096;
  parallel_for((n_rows + kTile - 1) / kTile, [&](int64_t t) {
    const int64_t r1 = std::min(n_rows, (t + 1) * kTile);
    for (int64_t r = t * kTile; r < r1; ++r) {
      const int64_t begin = by_in[r], end = by_in[r + 1];
      for (int64_t e = begin; e < end; ++e) {
        const int32_t old = old_ids[e];
        in_rows.data[e] = old_out[old];
        kernel_ids.data[e] = old_kernel[old];
        out_rows.data[e] = static_cast<int32_t>(r);
      }
      sort_row_by_offset(kernel_ids.data, in_rows.data, begin, end);
    }
  });

  Int32Buffer in_offsets(n_groups + 1), in_edge_ids(n_edges);
  Int32Buffer k_offsets(n_kernels + 1), k_edge_ids(n_edges);
  group_by(n_edges, {in_rows.data, n_groups, in_offsets.data, in_edge_ids.data},
           {kernel_ids.data, n_kernels, k_offsets.data, k_edge_ids.data});

  return RelationBuffers{in_rows,    out_rows,    kernel_ids, out_offsets,
                         in_offsets, in_edge_ids, k_offsets,  k_edge_ids}
      .arrays();
}

}  // namespace mlx_lattice
