// The public operations of the extension (bound in bindings.cpp).
//
// Each validates its arguments and the relation (relation.h, memoized),
// builds its primitive (transforms.cpp) and returns the result in the
// features' dtype (kernels accumulate in float32). Weights are the mapped
// (K, Cin, Cout) layout; mlx_lattice.core.weights converts the 5-D layout.
#pragma once

#include <string>

#include "mlx/mlx.h"
#include "relation.h"

namespace mlx_lattice {

namespace mx = mlx::core;

// A quantized weight (core/quantized.py's QuantizedWeight): packed uint32
// (K, Cout, storage_in_channels * bits / 32), scales and biases
// (K, Cout, storage_in_channels / group_size).
struct QuantizedArrays {
  mx::array packed, scales, biases;
  int in_channels, out_channels, storage_in_channels, group_size, bits;
};

mx::array sparse_conv_features(const mx::array& feats, const mx::array& weight,
                               const RelationArrays& relation, mx::StreamOrDevice s = {});

mx::array sparse_conv_features_sorted_implicit_gemm(const mx::array& feats,
                                                    const mx::array& weight,
                                                    const RelationArrays& relation,
                                                    const SortedArrays& view, bool store_sorted,
                                                    mx::StreamOrDevice s = {});

// act_bits: 0 keeps float activations; 8 quantizes them to int8 (symmetric)
// and runs the integer GEMM (CPU only): per row with a dynamic scale when
// act_scale is 0, otherwise with the one static scale act_scale (> 0, finite).
mx::array sparse_quantized_conv_features(const mx::array& feats, const QuantizedArrays& weight,
                                         const RelationArrays& relation, int act_bits = 0,
                                         float act_scale = 0.0f, mx::StreamOrDevice s = {});

mx::array sparse_conv_normalization_denominator(const mx::array& weight,
                                                const RelationArrays& relation,
                                                mx::StreamOrDevice s = {});

mx::array sparse_pool_features(const mx::array& feats, const RelationArrays& relation,
                               bool input_exclusive, const std::string& mode,
                               mx::StreamOrDevice s = {});

// Geometry (bound by geometry_bindings.cpp). The index arrays are checked on
// evaluated data (memoized by identity) before the node is built; features
// of any float dtype, result in that dtype (float32 inside).
// reduce: 'sum', 'mean', 'max' or 'first' over each voxel's points.
mx::array geometry_voxelize(const mx::array& feats, const mx::array& voxel_offsets,
                            const mx::array& voxel_points, const mx::array& point_to_voxel,
                            const std::string& reduce, mx::StreamOrDevice s = {});
mx::array geometry_devoxelize(const mx::array& voxel_features, const mx::array& rows,
                              const mx::array& weights, const mx::array& nearest,
                              const mx::array& voxel_offsets, const mx::array& voxel_entries,
                              bool nearest_mode, const std::string& out_dtype = "",
                              mx::StreamOrDevice s = {});

}  // namespace mlx_lattice
