// Groupings of a relation's edges (edge ids per input row, per kernel
// offset), as stable counting sorts whose result never depends on the
// thread count.
#pragma once

#include <cstdint>

namespace mlx_lattice {

// One grouping of edges by keys[e] in [0, groups): offsets (groups + 1) and
// edge_ids (n_edges), ids ascending within a group.
struct EdgeGrouping {
  const int32_t* keys;
  int64_t groups;
  int32_t* offsets;
  int32_t* edge_ids;
};

// Both groupings of the same n_edges edges (by input row and by kernel
// offset) in one counting pass and one scatter pass over the edges.
void group_by(int64_t n_edges, const EdgeGrouping& first, const EdgeGrouping& second);

// One grouping of n_edges edges: a counting pass and a scatter pass.
void group_by(int64_t n_edges, const EdgeGrouping& grouping);

// The grouping by kernel offset for edges stored by output row with
// ascending offsets, from each row's offset mask (bit k: an edge at offset
// k, n_kernels <= 32) and the rows' edge offsets.
void group_by_offset(const uint32_t* masks, const int32_t* out_offsets, int64_t n_out,
                     int64_t n_kernels, int32_t* k_offsets, int32_t* k_edge_ids);

// Sorts edges [begin, end) of one output row by kernel offset, carrying
// their input rows along (offsets within a row are distinct): for edges
// written in another order than the offsets', as a counting sort by output
// or a transpose leaves them.
void sort_row_by_offset(int32_t* kernel_ids, int32_t* in_rows, int64_t begin, int64_t end);

}  // namespace mlx_lattice
