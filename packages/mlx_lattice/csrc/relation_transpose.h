// The transpose of a kernel relation: its edges with inputs and outputs
// swapped. A transposed convolution back onto a finer set runs the `target`
// relation, which has exactly the edges of the strided `forward` relation
// that came down from that set (relation_builder.h: in == out + offset(k)
// one way is out == in - offset(k) the other); a network that built the
// forward relation transposes it instead of searching the coarse set again.
#pragma once

#include <map>
#include <string>

#include "relation.h"

namespace mlx_lattice {

// The relation with rel's edges reversed, laid out as the builder lays out
// every relation: edges grouped by (new) output row with offsets ascending,
// edge ids ascending within each input row and each offset. `rel` must be
// validated and have distinct offsets within each input row
// (check_input_offsets_distinct). Returns the builder's arrays but
// out_coords: in_rows, out_rows, kernel_ids, output_row_offsets,
// input_row_offsets, input_edge_ids, kernel_row_offsets, kernel_edge_ids.
std::map<std::string, mx::array> transpose_relation(const Relation& rel);

}  // namespace mlx_lattice
