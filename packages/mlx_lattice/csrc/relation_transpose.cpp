#include "relation_transpose.h"

#include <algorithm>
#include <cstdint>
#include <vector>

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
  const int32_t* old_in = rel.in_rows.data<int32_t>();
  Int32Buffer in_rows(n_edges), out_rows(n_edges), kernel_ids(n_edges);
  constexpr int64_t kTile = 4096;
  // Per tile, whether its rows have at most one edge each (a row of one
  // edge needs no sort) and its old edges, stored by output and offset,
  // have ascending input rows within each output: with every tile so, a
  // strided forward relation of a two-tap kernel onto sorted outputs.
  std::vector<char> single(ceil_div(std::max(n_rows, n_edges), kTile), 1);
  parallel_for(static_cast<int64_t>(single.size()), [&](int64_t t) {
    bool fine = true;
    const int64_t r1 = std::min(n_rows, (t + 1) * kTile);
    for (int64_t r = t * kTile; r < r1; ++r) {
      const int64_t begin = by_in[r], end = by_in[r + 1];
      for (int64_t e = begin; e < end; ++e) {
        const int32_t old = old_ids[e];
        in_rows.data[e] = old_out[old];
        kernel_ids.data[e] = old_kernel[old];
        out_rows.data[e] = static_cast<int32_t>(r);
      }
      if (end - begin > 1) {
        fine = false;
        sort_row_by_offset(kernel_ids.data, in_rows.data, begin, end);
      }
    }
    const int64_t e1 = std::min(n_edges, (t + 1) * kTile);
    for (int64_t e = std::max<int64_t>(1, t * kTile); e < e1; ++e) {
      fine &= old_out[e] != old_out[e - 1] || old_in[e] > old_in[e - 1];
    }
    single[t] = fine;
  });

  Int32Buffer in_offsets(n_groups + 1), in_edge_ids(n_edges);
  Int32Buffer k_offsets(n_kernels + 1), k_edge_ids(n_edges);
  if (std::find(single.begin(), single.end(), 0) == single.end()) {
    // Each old input has at most one edge, so old edge j is new edge
    // by_in[old_in[j]]; the new input grouping (by old output) lists, for
    // each old output in order, the new ids of its old edges, which ascend
    // with their old input rows, as they do: the old output grouping with
    // the ids renamed, no counting sort.
    const int32_t* by_out = rel.out_offsets.data<int32_t>();
    std::copy(by_out, by_out + n_groups + 1, in_offsets.data);
    parallel_for(ceil_div(n_edges, kTile), [&](int64_t t) {
      int32_t* ids = in_edge_ids.data;
      for (int64_t j = t * kTile; j < std::min(n_edges, (t + 1) * kTile); ++j) {
        ids[j] = by_in[old_in[j]];
      }
    });
    group_by(n_edges, {kernel_ids.data, n_kernels, k_offsets.data, k_edge_ids.data});
  } else {
    group_by(n_edges, {in_rows.data, n_groups, in_offsets.data, in_edge_ids.data},
             {kernel_ids.data, n_kernels, k_offsets.data, k_edge_ids.data});
  }

  return RelationBuffers{in_rows,    out_rows,    kernel_ids, out_offsets,
                         in_offsets, in_edge_ids, k_offsets,  k_edge_ids}
      .arrays();
}

}  // namespace mlx_lattice
