#include "relation_transpose.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "relation_buffer.h"
#include "relation_groups.h"
#include "cpu/parallel.h"

namespace mlx_lattice {

namespace {

// Whether every input row of `rel` has at most one edge and each output's
// edges (stored together, by offset) have ascending input rows: a strided
// forward relation of a two-tap kernel onto sorted outputs. One parallel
// pass over the edges.
bool single_edge_inputs(const Relation& rel) {
  const int64_t n_rows = rel.n_in, n_edges = rel.n_edges();
  const int32_t* by_in = rel.in_offsets.data<int32_t>();
  const int32_t* ins = rel.in_rows.data<int32_t>();
  const int32_t* outs = rel.out_rows.data<int32_t>();
  if (n_edges > n_rows) return false;
  constexpr int64_t kPart = 16384;
  std::vector<char> ok(ceil_div(std::max(n_rows, n_edges), kPart), 1);
  parallel_for(static_cast<int64_t>(ok.size()), [&](int64_t t) {
    bool fine = true;
    for (int64_t r = t * kPart; r < std::min(n_rows, (t + 1) * kPart); ++r) {
      fine &= by_in[r + 1] - by_in[r] <= 1;
    }
    for (int64_t e = std::max<int64_t>(1, t * kPart); e < std::min(n_edges, (t + 1) * kPart);
         ++e) {
      fine &= outs[e] != outs[e - 1] || ins[e] > ins[e - 1];
    }
    ok[t] = fine;
  });
  return std::find(ok.begin(), ok.end(), 0) == ok.end();
}

}  // namespace

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
  if (single_edge_inputs(rel)) {
    // Each old input has at most one edge, so old edge j is new edge
    // by_in[old_in[j]]; the new input grouping (by old output) lists, for
    // each old output in order, the new ids of its old edges, which ascend
    // with their old input rows, as they do: the old output grouping with
    // the ids renamed, no counting sort.
    const int32_t* old_in = rel.in_rows.data<int32_t>();
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
