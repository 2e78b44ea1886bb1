// The single candidate parent of each fine row in a coarser set, for
// kernels of at most two taps per axis (a U-Net's 2x2x2 downsampling and its
// transposed upsampling): the strided `forward` relations and their `target`
// transposes of relation_builder.h without searching every offset.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "relation_builder.h"
#include "relation_hash.h"
#include "relation_sorted.h"

namespace mlx_lattice {

// For each fine row p: the coarse row q and the kernel offset k with
// p == q + offset(k) (offsets as for `forward`, all >= 0), or row -1.
struct Parents {
  std::vector<int32_t> row, kernel;
};

// Parents when every axis has kernel size 1 or 2 and, on each size-2 axis,
// every coarse coordinate is a multiple of M = 2 * dilation * tensor_stride
// (as after flooring to a stride of 2, or on the coarse side of a transposed
// relation): offsets 0 and d = dilation * tensor_stride are then < M, so the
// only candidate is q = floor(p / M) * M (size 1: q = p), and p - q must be
// 0 or d. The coarse rows are found by key in `sorted_coarse` when given,
// else in `coarse_table`; for computed strided outputs (`floored_row`: each
// fine row's floored output row), q is a row exactly when it equals p
// floored to the stride, and neither is read. Returns nothing when the
// kernel or the coordinates do not fit.
std::optional<Parents> single_parents(const int32_t* fine, int64_t n_fine, const int32_t* coarse,
                                      int64_t n_coarse, const SortedRows* sorted_coarse,
                                      const CoordTable* coarse_table,
                                      const std::vector<int32_t>& floored_row, Triple stride,
                                      Triple kernel_size, Triple dilation, Triple tensor_stride);

}  // namespace mlx_lattice
