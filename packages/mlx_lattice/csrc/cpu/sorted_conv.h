// The sorted implicit-GEMM dataflow's convolution (cpu/sorted_conv.cpp).
#pragma once

#include <cstdint>

namespace mlx_lattice::kernels {

// Rows per tile of the sorted implicit-GEMM view's tile_masks.
constexpr int64_t kSortedTileRows = 32;

// Sorted implicit GEMM: row r of the sorted view takes input rows
// sorted_map[r * K + k] (or -1). Output row reorder[r], or r if store_sorted.
void sorted_conv(const float* feats, int64_t cin, const float* weight, int64_t n_kernels,
                 int64_t cout, const int32_t* sorted_map, const int32_t* reorder, int64_t n_out,
                 bool store_sorted, float* out);

}  // namespace mlx_lattice::kernels
