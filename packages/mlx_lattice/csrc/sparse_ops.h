// Sparse convolution, normalization and pooling as MLX primitives.
//
// The public operations validate their arguments and index arrays, cast
// features and weights to float32 (kernels accumulate in float32) and return
// results in the feature dtype. The primitives are internal: their vjp and jvp
// are built from each other (a bilinear convolution's gradients are
// convolutions with the roles of the operands exchanged), so every order of
// differentiation works.
#pragma once

#include <optional>
#include <string>

#include "mlx/mlx.h"

namespace mlx_lattice {

namespace mx = mlx::core;

mx::array sparse_conv_features(const mx::array& feats, const mx::array& weight,
                               const mx::array& in_rows, const mx::array& out_rows,
                               const mx::array& kernel_ids, const mx::array& counts,
                               const mx::array& output_row_offsets,
                               const mx::array& input_row_offsets, const mx::array& input_edge_ids,
                               const mx::array& kernel_row_offsets,
                               const mx::array& kernel_edge_ids, int n_out_capacity, int n_kernels,
                               mx::StreamOrDevice s = {});

mx::array sparse_conv_features_sorted_implicit_gemm(
    const mx::array& feats, const mx::array& weight, const mx::array& sorted_out_in_map,
    const mx::array& sorted_kv_out_in_map, const mx::array& reorder_rows,
    const mx::array& tile_masks, const mx::array& in_rows, const mx::array& out_rows,
    const mx::array& kernel_ids, const mx::array& counts, const mx::array& output_row_offsets,
    const mx::array& input_row_offsets, const mx::array& input_edge_ids,
    const mx::array& kernel_row_offsets, const mx::array& kernel_edge_ids, int n_out_capacity,
    int n_kernels, bool store_sorted, mx::StreamOrDevice s = {});

mx::array sparse_conv_features_sorted_direct_reference(
    const mx::array& feats, const mx::array& weight, const mx::array& sorted_out_in_map,
    const mx::array& reorder_rows, const mx::array& tile_masks, int n_out_capacity, int n_kernels,
    bool store_sorted, mx::StreamOrDevice s = {});

mx::array sparse_quantized_conv_features(
    const mx::array& feats, const mx::array& weight, const mx::array& scales,
    const mx::array& biases, const mx::array& in_rows, const mx::array& out_rows,
    const mx::array& kernel_ids, const mx::array& counts, const mx::array& output_row_offsets,
    const mx::array& sorted_kv_out_in_map, const mx::array& reorder_rows,
    const mx::array& tile_masks, int n_out_capacity, int n_kernels, int in_channels,
    int out_channels, int storage_in_channels, int group_size, int bits,
    mx::StreamOrDevice s = {});

mx::array sparse_conv_normalization_denominator(const mx::array& weight,
                                                const mx::array& kernel_ids,
                                                const mx::array& counts,
                                                const mx::array& output_row_offsets,
                                                mx::StreamOrDevice s = {});

mx::array sparse_pool_features(const mx::array& feats, const mx::array& in_rows,
                               const mx::array& out_rows, const mx::array& kernel_ids,
                               const mx::array& output_row_offsets, const mx::array& counts,
                               bool input_exclusive, const std::string& mode, int n_out_capacity,
                               int n_kernels, mx::StreamOrDevice s = {});

}  // namespace mlx_lattice
