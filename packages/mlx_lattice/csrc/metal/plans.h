// Encode plans: one per GPU kernel, written against KernelEncoder.
// Floating buffers are float32; index buffers int32, validated by the ops.
#pragma once

#include <cstdint>

#include "encoder.h"

namespace mlx_lattice::gpu {

struct Relation {
  Buffer in_rows, out_rows, kernel_ids, out_offsets, in_offsets, in_edge_ids, k_offsets, k_edge_ids;
};

enum class ConvFace { kForward, kInputGrad, kWeightGrad };

// kForward: out (n_out, cout) = conv(a = F (n_in, cin), b = W (K, cin, cout)).
// kInputGrad: out (n_in, cin) from a = G (n_out, cout), b = W.
// kWeightGrad: out (K, cin, cout) from a = F, b = G.
void encode_conv(KernelEncoder& enc, ConvFace face, Buffer a, Buffer b, const Relation& rel,
                 Buffer out, uint32_t n_in, uint32_t n_out, uint32_t n_kernels, uint32_t cin,
                 uint32_t cout);

void encode_quantized_conv(KernelEncoder& enc, Buffer feats, Buffer packed, Buffer scales,
                           Buffer biases, const Relation& rel, Buffer out, uint32_t n_out,
                           uint32_t n_kernels, uint32_t cin, uint32_t cout, uint32_t row_bytes,
                           uint32_t groups, uint32_t group_size, uint32_t bits);

// The static-int8 convolution with its fused epilogue: feats floats or
// int8 codes (the unused slot bound to the same buffer), bias / residual
// optional (unbound slots get `feats`), out float32 or int8
// (dims.out_scale > 0). dims is passed to the kernel as it is.
struct FusedDims {  // laid out as sparse_conv.metal's FusedDims
  uint32_t n_rows, cin, cout, n_kernels, row_bytes, groups, group_size, bits;
  uint32_t int8_input, has_bias, residual, relu;
  float in_scale, residual_scale, out_scale;
};
struct FusedConvArgs {
  Buffer feats, packed, scales, biases, bias, res_f, res_q;
  FusedDims dims;
};
void encode_int8_conv_fused(KernelEncoder& enc, const FusedConvArgs& a, const Relation& rel,
                            Buffer out);

void encode_denominator(KernelEncoder& enc, Buffer weight, Buffer kernel_ids, Buffer out_offsets,
                        Buffer out, uint32_t n_out, uint32_t n_kernels, uint32_t cin,
                        uint32_t cout);

void encode_denominator_grad(KernelEncoder& enc, Buffer grad, Buffer out_rows, Buffer k_offsets,
                             Buffer k_edge_ids, Buffer out, uint32_t n_kernels, uint32_t cout);

enum class PoolStage { kForward, kMaxSelect, kBackward };

// mode: 0 max, 1 avg, 2 sum. kForward: out (n_out, C) from x; kMaxSelect:
// from (x = feats, y = tangent); kBackward: out (n_in, C) from (x = grad,
// y = feats).
void encode_pool(KernelEncoder& enc, PoolStage stage, uint32_t mode, Buffer x, Buffer y,
                 const Relation& rel, Buffer out, uint32_t n_in, uint32_t n_out,
                 uint32_t channels);

// The sorted implicit GEMM (simdgroup MMA; cin, cout in {32, 64}); tile_masks
// are the relation's (kernels::kSortedTileRows rows per tile).
void encode_sorted_conv(KernelEncoder& enc, Buffer feats, Buffer weight,
                        Buffer sorted_map, Buffer reorder, Buffer tile_masks, Buffer out,
                        uint32_t n_out, uint32_t n_kernels, uint32_t cin, uint32_t cout,
                        bool store_sorted);

// Geometry (geometry.metal); all buffers float32 / int32.

// out (n_points x channels) from vf (voxels x channels), rows/weights
// (n_points x 8) and nearest (n_points).
void encode_devoxelize(KernelEncoder& enc, Buffer vf, Buffer rows, Buffer weights, Buffer nearest,
                       Buffer out, uint32_t n_points, uint32_t channels, bool nearest_mode);

// out (n_voxels x channels) from g (points x channels) through the voxel
// grouping of (point, corner) entries.
void encode_devoxelize_transpose(KernelEncoder& enc, Buffer g, Buffer weights, Buffer nearest,
                                 Buffer offsets, Buffer entries, Buffer out, uint32_t n_voxels,
                                 uint32_t channels, bool nearest_mode);

// out / arg (n_voxels x channels) from point features and the voxel grouping;
// mode 0 sum, 1 mean, 2 max, 3 first.
void encode_voxel_reduce(KernelEncoder& enc, Buffer feats, Buffer offsets, Buffer members,
                         Buffer out, Buffer arg, uint32_t n_voxels, uint32_t channels,
                         uint32_t mode);

// Neighbours and coordinates (geometry_search.metal).

struct KnnPlan {
  uint32_t nq, ns, k, n_batches;
  int32_t dims[3];
  float origin[3];
  float inv, cell;
  float max_d2;  // +inf for kNN; r^2 for radius search
};
constexpr uint32_t kKnnMaxK = 64;  // MLXL_KNN_MAX_K of the kernel (kKnnMaxKGpu)

// rows / dist2 (nq x k) from the queries and the support sorted by cell key.
void encode_knn(KernelEncoder& enc, Buffer query, Buffer qbatch, Buffer sorted_support,
                Buffer sorted_rows, Buffer sorted_keys, Buffer rows, Buffer dist2,
                const KnnPlan& plan);

// Radius search without a cap (mlxl_geo_radius): fill = false writes
// counts (nq); fill = true writes rows / dist2 at offsets (nq + 1), each
// query's range sorted by (dist2, row). reach: cells scanned per axis.
void encode_radius(KernelEncoder& enc, Buffer query, Buffer qbatch, Buffer sorted_support,
                   Buffer sorted_rows, Buffer sorted_keys, Buffer offsets, Buffer counts,
                   Buffer rows, Buffer dist2, const KnnPlan& plan, int32_t reach, bool fill);

// codes (n, int64) of coords (n x 4 int32).
void encode_morton(KernelEncoder& enc, Buffer coords, Buffer codes, uint32_t n);

// Exact coordinate hash (geometry_hash.metal): coords (n x 4) and queries
// (q x 4) int32; first (n) = smallest row with equal coordinates, rows (q) =
// that row for each query or -1; table / minrow (slots, a power of two
// >= 2n) and slot_of (n) are scratch.
void encode_coord_hash(KernelEncoder& enc, Buffer coords, Buffer queries, Buffer first,
                       Buffer rows, Buffer table, Buffer minrow, Buffer slot_of, uint32_t n,
                       uint32_t q, uint32_t slots);

// Batch norm (norm.metal). Features (n x c) in `format`'s storage
// (x, y, g, dx); weight, bias, mean, var, dweight, dbias (c) float32. Row
// blocks of kNormBlockRows, as the CPU kernels reduce them.
enum class NormFormat { kF32, kF16, kBF16 };
constexpr uint32_t kNormBlockRows = 256;  // MLXL_NORM_BLOCK_ROWS of the kernels

// y, mean, var (biased) from x, weight, bias.
void encode_batch_norm(KernelEncoder& enc, NormFormat format, Buffer x, Buffer weight,
                       Buffer bias, Buffer y, Buffer mean, Buffer var, uint32_t n, uint32_t c,
                       float eps, bool relu);

// dx, dweight, dbias from the cotangent g of y and the forward's x, y, mean,
// var (y only read with relu).
void encode_batch_norm_grad(KernelEncoder& enc, NormFormat format, Buffer g, Buffer x, Buffer y,
                            Buffer weight, Buffer mean, Buffer var, Buffer dx, Buffer dweight,
                            Buffer dbias, uint32_t n, uint32_t c, float eps, bool relu);

// Eval-mode norm: y from x and the given mean, scale, bias (no reductions).
void encode_batch_norm_eval(KernelEncoder& enc, NormFormat format, Buffer x, Buffer mean,
                            Buffer scale, Buffer bias, Buffer y, uint32_t n, uint32_t c,
                            bool relu);

}  // namespace mlx_lattice::gpu
