// Kernel relations between coordinate sets, built natively (the builder;
// relation.h is the validated object the primitives share).
//
// Coordinates are (N, 4) int32 rows (batch, x, y, z). Kernel offset k
// enumerates (ix, iy, iz) x-major: k = (ix * ky + iy) * kz + iz, and along
// each axis
//     offset(i) = (i - (size - 1) // 2) * dilation * tensor_stride,
// so odd sizes are centred (3 -> -1, 0, 1) and even sizes lean forward
// (2 -> 0, 1; 4 -> -1, 0, 1, 2). An edge (in, out, k) exists when
//     in_coord == out_coord + offset(k)   (submanifold, forward)
//     in_coord == out_coord - offset(k)   (target: the transpose of forward)
// with equal batch. For `forward` without given outputs, the outputs are the
// input coordinates floored to multiples of tensor_stride * stride, unique
// and ascending (relation_strided.h). Edges are grouped by output row,
// offsets ascending.
#pragma once

#include <array>
#include <map>
#include <optional>
#include <string>

#include "mlx/mlx.h"

namespace mlx_lattice {

namespace mx = mlx::core;

using Triple = std::array<int, 3>;

// Returns out_coords, in_rows, out_rows, kernel_ids, output_row_offsets,
// input_row_offsets, input_edge_ids, kernel_row_offsets,
// kernel_edge_ids (all int32). (Edges are stored grouped by output, so the
// output grouping needs no edge ids.)
std::map<std::string, mx::array> build_kernel_relation(const mx::array& in_coords,
                                                       const std::optional<mx::array>& out_coords,
                                                       Triple kernel_size, Triple stride,
                                                       Triple dilation, Triple tensor_stride,
                                                       const std::string& kind);

// Raises ValueError naming the first duplicated row pair, or a bad shape/dtype.
void check_coordinates(const mx::array& coords, const std::string& name);

}  // namespace mlx_lattice
