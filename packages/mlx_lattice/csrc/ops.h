// The public operations of the extension (bound in bindings.cpp).
//
// Each validates its arguments and the relation (relation.h, memoized),
// builds its primitive (transforms.cpp) and returns the result in the
// features' dtype (kernels accumulate in float32). Weights are the mapped
// (K, Cin, Cout) layout; mlx_lattice.core.weights converts the 5-D layout.
#pragma once

#include <optional>
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

// The checks of a QuantizedArrays weight for a convolution over n_kernels
// offsets of feat_cols input channels (shared by the quantized ops).
void check_quantized_weight(const std::string& op, const QuantizedArrays& q, int64_t n_kernels,
                            int64_t feat_cols);

// A weight group size the integer kernels sum exactly (a multiple of 4, at
// most 65536), for the ops with int8 activations.
void check_int8_group_size(const std::string& op, int group_size);

// The epilogue arguments of sparse_quantized_conv_fused (csrc/README.md).
struct FusedEpilogueArgs {
  float in_scale = 0.0f;               // static scale of feats (> 0, finite)
  std::optional<mx::array> bias;       // (Cout,) float
  std::optional<mx::array> residual;   // (N_out, Cout) float or int8
  float residual_scale = 0.0f;         // an int8 residual's scale (> 0)
  bool relu = false;
  float out_scale = 0.0f;              // > 0: int8 output at this scale
  std::string out_dtype;               // float output: "", float32, float16, bfloat16
};

// Static-scale w8a8 / w4a8 convolution with a fused epilogue
// (fused_conv.cpp; cpu/gemm_int8.h: Int8Epilogue). feats float (quantized
// with in_scale) or int8 codes at in_scale. CPU and Metal (GPU) streams (the
// Metal kernels write float32 or int8; a half output is cast); inference only.
mx::array sparse_quantized_conv_fused(const mx::array& feats, const QuantizedArrays& weight,
                                      const RelationArrays& relation,
                                      const FusedEpilogueArgs& args, mx::StreamOrDevice s = {});

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
