// The MLX primitives of mlx_lattice, declared in MLX's own style
// (mlx/primitives.h): single-output UnaryPrimitives with DEFINE_* helpers;
// the geometry primitives at the end derive from mx::Primitive (voxelize has
// two outputs).
//
// Where each part of a primitive lives (see csrc/README.md):
//   graph builders, vjp / jvp / vmap   transforms.cpp (geometry: transforms_geometry.cpp)
//   eval_cpu                           cpu/<op>.cpp or cpu/<op>_eval.cpp (kernels: README.md)
//   eval_gpu                           metal/eval.cpp (macOS) or no_metal.cpp
//   Metal encode bodies                metal/<op>.cpp (kernels in metal/*.metal)
//
// Every sparse primitive holds its validated relation (relation.h) by shared
// pointer: index data is graph-constant, only floating operands are inputs.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "cpu/pool.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "relation.h"

namespace mlx_lattice {

namespace mx = mlx::core;
using mx::array;  // for MLX's DEFINE_* macros

// Base of every sparse primitive: the relation it runs over.
class SparsePrimitive : public mx::UnaryPrimitive {
 public:
  SparsePrimitive(mx::Stream s, RelationPtr rel) : mx::UnaryPrimitive(s), rel_(std::move(rel)) {}
  const Relation& relation() const { return *rel_; }
  const RelationPtr& relation_ptr() const { return rel_; }

 protected:
  bool same_relation(const SparsePrimitive& o) const { return rel_ == o.rel_; }
  RelationPtr rel_;
};

// The three bilinear faces of one sparse convolution:
//   kForward:    (F, W) -> out[o] = sum_e F[in_e] @ W[k_e]
//   kInputGrad:  (G, W) -> dF[i] = sum_e G[out_e] @ W[k_e]^T
//   kWeightGrad: (F, G) -> dW[k] = sum_e F[in_e]^T G[out_e]
class SparseConv : public SparsePrimitive {
 public:
  enum class Mode { kForward, kInputGrad, kWeightGrad };
  SparseConv(mx::Stream s, RelationPtr rel, Mode mode)
      : SparsePrimitive(s, std::move(rel)), mode_(mode) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>& inputs, array& out) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(SparseConv)
  bool is_equivalent(const mx::Primitive& other) const override;
  Mode mode() const { return mode_; }

 private:
  Mode mode_;
};

// Forward convolution through the sorted implicit-GEMM view: (F, W) -> out,
// row r of the view is output row reorder[r] (or row r when store_sorted).
class SparseConvSorted : public SparsePrimitive {
 public:
  SparseConvSorted(mx::Stream s, RelationPtr rel, SortedPtr view, bool store_sorted)
      : SparsePrimitive(s, std::move(rel)), view_(std::move(view)), store_sorted_(store_sorted) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>& inputs, array& out) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(SparseConvSorted)
  bool is_equivalent(const mx::Primitive& other) const override;
  const SortedArrays& view() const { return *view_; }
  const SortedPtr& view_ptr() const { return view_; }
  bool store_sorted() const { return store_sorted_; }

 private:
  SortedPtr view_;
  bool store_sorted_;
};

struct QuantSpec {
  int64_t in_channels = 0;
  int64_t out_channels = 0;
  int64_t storage_in_channels = 0;
  int group_size = 0;
  int bits = 0;
  // 0: float activations (weights dequantized); 8: activations quantized to
  // int8 per row and an integer GEMM (cpu/gemm_int8.h; CPU only).
  int act_bits = 0;
  // With act_bits 8: 0 quantizes each row with its own dynamic scale; a
  // positive value is one static scale for every row (validated in ops.cpp).
  float act_scale = 0.0f;
  bool operator==(const QuantSpec&) const = default;
};

// Convolution with group-affine quantized weights: (F, packed, scales,
// biases) -> out; weights are dequantized inside the kernel.
class SparseQuantizedConv : public SparsePrimitive {
 public:
  SparseQuantizedConv(mx::Stream s, RelationPtr rel, QuantSpec spec)
      : SparsePrimitive(s, std::move(rel)), spec_(spec) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>& inputs, array& out) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(SparseQuantizedConv)
  bool is_equivalent(const mx::Primitive& other) const override;
  const QuantSpec& spec() const { return spec_; }

 private:
  QuantSpec spec_;
};

// The inference-only static-scale integer convolution with a fused
// epilogue (cpu/gemm_int8.h: Int8Epilogue): (F float or int8 codes, packed,
// scales, biases[, bias (Cout) float32][, residual (N_out, Cout) float32 or
// int8]) -> out (float or int8, the array's dtype). Built by
// sparse_quantized_conv_fused (fused_conv.cpp); no gradients, no vmap.
struct FusedSpec {
  QuantSpec quant;       // act_bits 8; act_scale: the input's static scale
  bool int8_input = false;
  bool has_bias = false;
  int residual = 0;      // 0 none, 1 float32, 2 int8 (times residual_scale)
  float residual_scale = 0.0f;
  bool relu = false;
  float out_scale = 0.0f;  // > 0: int8 output at this scale
  bool operator==(const FusedSpec&) const = default;
};

class SparseQuantizedConvFused : public SparsePrimitive {
 public:
  SparseQuantizedConvFused(mx::Stream s, RelationPtr rel, FusedSpec spec)
      : SparsePrimitive(s, std::move(rel)), spec_(spec) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>& inputs, array& out) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(SparseQuantizedConvFused)
  bool is_equivalent(const mx::Primitive& other) const override;
  const FusedSpec& spec() const { return spec_; }

 private:
  FusedSpec spec_;
};

// kDenominator: (W) -> out[o] = sum_e colsum(W[k_e]).
// kGradient:    (G) -> dS[k] = sum_{e of k} G[out_e].
class SparseDenominator : public SparsePrimitive {
 public:
  enum class Mode { kDenominator, kGradient };
  SparseDenominator(mx::Stream s, RelationPtr rel, Mode mode)
      : SparsePrimitive(s, std::move(rel)), mode_(mode) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>& inputs, array& out) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(SparseDenominator)
  bool is_equivalent(const mx::Primitive& other) const override;
  Mode mode() const { return mode_; }

 private:
  Mode mode_;
};

// Pooling. kForward: (F); kMaxSelect: (F, T) picks T at each max of F;
// kBackward: (G, F) -> dF.
class SparsePool : public SparsePrimitive {
 public:
  enum class Stage { kForward, kMaxSelect, kBackward };
  SparsePool(mx::Stream s, RelationPtr rel, Stage stage, kernels::PoolMode mode)
      : SparsePrimitive(s, std::move(rel)), stage_(stage), mode_(mode) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>& inputs, array& out) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(SparsePool)
  bool is_equivalent(const mx::Primitive& other) const override;
  Stage stage() const { return stage_; }
  kernels::PoolMode mode() const { return mode_; }

 private:
  Stage stage_;
  kernels::PoolMode mode_;
};

// ------------------------------------------------------------------ geometry
// No relation: the index arrays are inputs after the features, validated by
// ops.cpp (memoized like relations) before the node is built. Kernels in
// cpu/geometry_*.cpp and metal/geometry.metal.

// Point features (P, C) -> voxel features (N, C) and, as a second output, the
// (N, C) int32 point each max/first picked (-1 for sum/mean and empty voxels).
// Inputs: feats (float32), voxel_offsets (N + 1), voxel_points (P),
// point_to_voxel (P). mode: 0 sum, 1 mean, 2 max, 3 first.
class GeometryVoxelize : public mx::Primitive {
 public:
  GeometryVoxelize(mx::Stream stream, int mode) : mx::Primitive(stream), mode_(mode) {}
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  void eval_gpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(GeometryVoxelize)
  bool is_equivalent(const mx::Primitive& other) const override {
    return mode_ == static_cast<const GeometryVoxelize&>(other).mode_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override;
  int mode() const { return mode_; }

 private:
  int mode_;
};

// Voxel features (N, C) -> point features (P, C) through a point-voxel map
// (kForward) and its transpose (kTranspose: (P, C) -> (N, C)). Inputs after
// the features: rows (P, 8), weights (P, 8) float32, nearest (P,),
// voxel_offsets (N + 1), voxel_entries (E). On the CPU the features may be
// float16 / bfloat16 and the output is out_dtype (float32 arithmetic, the
// bits of casts around a float32 kernel); Metal takes and gives float32.
class GeometryDevoxelize : public mx::Primitive {
 public:
  enum Face { kForward = 0, kTranspose = 1 };
  GeometryDevoxelize(mx::Stream stream, Face face, bool nearest, int64_t n_voxels,
                     mx::Dtype out_dtype = mx::float32)
      : mx::Primitive(stream),
        face_(face),
        nearest_(nearest),
        n_voxels_(n_voxels),
        out_dtype_(out_dtype) {}
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  void eval_gpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(GeometryDevoxelize)
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GeometryDevoxelize&>(other);
    return face_ == o.face_ && nearest_ == o.nearest_ && n_voxels_ == o.n_voxels_ &&
           out_dtype_ == o.out_dtype_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override;
  Face face() const { return face_; }
  bool nearest() const { return nearest_; }
  int64_t n_voxels() const { return n_voxels_; }
  mx::Dtype out_dtype() const { return out_dtype_; }

 private:
  Face face_;
  bool nearest_;
  int64_t n_voxels_;
  mx::Dtype out_dtype_;
};

// The k nearest support points of every query (same batch), by (squared
// distance, support row): outputs rows (Q, k) int32 (-1 past the batch's
// support) and dist2 (Q, k) float32 (+inf there). Inputs: query (Q, 3),
// query_batch (Q), support (S, 3), support_batch (S); points float64 (CPU
// kernels) or float32. Where the Metal bodies evaluate (uses_metal_bodies),
// also the support's grid: its cell keys sorted (S), the permutation sorting
// them (S) and the support sorted by cell (S, 3), float32. With a radius
// (> 0) only neighbours within it count (radius_relation with
// max_neighbors = k). Not differentiable: gather the neighbours and
// recompute distances instead.
constexpr int kKnnMaxKGpu = 64;  // the largest k of the Metal kernel (MLXL_KNN_MAX_K)
struct KnnGrid {
  float origin[3] = {0, 0, 0};
  float cell = 1;
  int32_t dims[3] = {1, 1, 1};  // cells per axis; batches * dims fit in int32
  int32_t n_batches = 0;
};
class GeometryKnn : public mx::Primitive {
 public:
  GeometryKnn(mx::Stream stream, int k, KnnGrid grid, double radius = 0.0)
      : mx::Primitive(stream), k_(k), grid_(grid), radius_(radius) {}
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  void eval_gpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(GeometryKnn)
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override;
  int k() const { return k_; }
  const KnnGrid& grid() const { return grid_; }
  double radius() const { return radius_; }

 private:
  int k_;
  KnnGrid grid_;
  double radius_;
};

// Morton codes (N,) int64 of (N, 4) int32 coordinates (layout in
// cpu/geometry_kernels.h; the range is validated before the node is built).
class GeometryMorton : public mx::Primitive {
 public:
  explicit GeometryMorton(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  void eval_gpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(GeometryMorton)
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override;
};

// ---- Exact coordinate hash (geometry_hash.metal; cpu/geometry_hash.cpp).
// Inputs: coords (N, 4) and queries (Q, 4) int32. Outputs: first (N,) int32,
// the smallest row with coords[r]'s coordinates (first[r] == r for the first
// occurrence); rows (Q,) int32, that smallest row for each query or -1; then
// scratch of the GPU kernels: table (slots,), minrow (slots,), slot_of (N,)
// (contents unspecified). slots: a power of two >= max(64, 2N). Results do
// not depend on the order GPU threads ran in. Not differentiable.
class GeometryHash : public mx::Primitive {
 public:
  GeometryHash(mx::Stream stream, int64_t slots) : mx::Primitive(stream), slots_(slots) {}
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  void eval_gpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(GeometryHash)
  bool is_equivalent(const mx::Primitive& other) const override {
    return slots_ == static_cast<const GeometryHash&>(other).slots_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override;
  int64_t slots() const { return slots_; }

 private:
  int64_t slots_;
};
// Radius search without a cap, in two passes (geometry_search.metal;
// cpu/geometry_radius.cpp). Count pass (no offsets): inputs query (Q, 3),
// query_batch (Q), support (S, 3), support_batch (S) -> counts (Q,) int32.
// Fill pass: the same plus offsets (Q + 1,) int32 (the prefix sum of the
// counts) -> rows (T,) int32 and dist2 (T,) float32, each query's range
// sorted by (distance, row). Where the Metal bodies evaluate, the support's
// grid follows, as for GeometryKnn. Not differentiable.
class GeometryRadius : public mx::Primitive {
 public:
  GeometryRadius(mx::Stream stream, KnnGrid grid, double radius, bool fill, int total)
      : mx::Primitive(stream), grid_(grid), radius_(radius), fill_(fill), total_(total) {}
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  void eval_gpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(GeometryRadius)
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override;
  const KnnGrid& grid() const { return grid_; }
  double radius() const { return radius_; }
  bool fill() const { return fill_; }

 private:
  KnnGrid grid_;
  double radius_;
  bool fill_;
  int total_;
};
// ---- end of the coordinate hash block.

// Whether primitives on this stream evaluate through the Metal encode bodies
// (a GPU stream; every stream in the test-only harness extension): their
// graph builders then add the GPU-only inputs (the kNN grid). Defined by
// cpu/geometry.cpp and harness/eval.cpp.
bool uses_metal_bodies(const mx::Stream& s);

// ------------------------------------------------------------ feature add
// a + b for same-shaped float32 / float16 / bfloat16 arrays in their dtype,
// each sum computed in float32 and rounded once (for the half formats the
// correctly rounded IEEE sum): graph code in add.cpp, CPU evaluation in
// cpu/add.cpp, Metal kernels in metal/add.metal. Differentiable (the
// cotangent passes to both operands), jvp and vmap implemented.
class FeatureAdd : public mx::UnaryPrimitive {
 public:
  explicit FeatureAdd(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>& inputs, array& out) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(FeatureAdd)
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }
};

// Validates and builds FeatureAdd (add.cpp); raises std::invalid_argument
// naming the argument for a bad dtype or shape.
array feature_add(const array& a, const array& b, mx::StreamOrDevice s = {});

// ------------------------------------------------------- eval-mode norm
// The affine map of a batch norm with given (running) statistics, + optional
// ReLU: (x, mean, scale, bias) -> y = [relu]((x - mean) * scale + bias) in
// x's dtype (float32, float16 or bfloat16; (N, C), N >= 0), computed in
// float32 and rounded once; mean, scale and bias (C,) float32. Graph code in
// norm.cpp (batch_norm_eval folds weight / sqrt(var + eps) into scale with
// MLX ops, so gradients reach weight and the statistics through them), CPU
// evaluation in cpu/norm_eval.cpp (kernel batch_norm_affine of cpu/norm.h),
// Metal kernels in metal/norm.metal. vjp and jvp as MLX ops in float32;
// vmap raises.
class BatchNormEval : public mx::UnaryPrimitive {
 public:
  BatchNormEval(mx::Stream stream, bool relu) : mx::UnaryPrimitive(stream), relu_(relu) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>& inputs, array& out) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(BatchNormEval)
  bool is_equivalent(const mx::Primitive& other) const override {
    return relu_ == static_cast<const BatchNormEval&>(other).relu_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }
  bool relu() const { return relu_; }

 private:
  bool relu_;
};

// Every primitive class, for the files that define one method per primitive
// by build choice (metal/eval.cpp, no_metal.cpp, harness/eval.cpp). A new
// primitive is added here (multi-output ones to the second list).
#define MLX_LATTICE_PRIMITIVES(X) \
  X(SparseConv)                   \
  X(SparseConvSorted)             \
  X(SparseQuantizedConv)          \
  X(SparseQuantizedConvFused)     \
  X(SparseDenominator)            \
  X(SparsePool)                   \
  X(FeatureAdd)                   \
  X(BatchNormEval)

// Primitives with several outputs (eval signatures take a vector of outputs).
#define MLX_LATTICE_MULTI_OUTPUT_PRIMITIVES(X) \
  X(GeometryVoxelize)                          \
  X(GeometryDevoxelize)                        \
  X(GeometryKnn)                               \
  X(GeometryMorton)                            \
  X(GeometryHash)                              \
  X(GeometryRadius)                            \
  X(BatchNormTrain)                            \
  X(BatchNormTrainGrad)

// Graph builders (transforms.cpp; callers have validated). Floating operands
// are cast to the first operand's dtype (float32 on the GPU stream) and made
// row-contiguous.
array make_conv(SparseConv::Mode mode, const array& a, const array& b, const RelationPtr& rel,
                mx::Stream s);
array make_sorted(const array& f, const array& w, const RelationPtr& rel, const SortedPtr& view,
                  bool store_sorted, mx::Stream s);
// quant = {packed weight, scales, biases}.
array make_quantized(const array& f, const std::vector<array>& quant, const RelationPtr& rel,
                     QuantSpec spec, mx::Stream s);
array make_denominator(SparseDenominator::Mode mode, const array& x, const RelationPtr& rel,
                       mx::Stream s);
array make_pool(SparsePool::Stage stage, kernels::PoolMode mode, const std::vector<array>& floats,
                const RelationPtr& rel, mx::Stream s);

// Geometry builders (transforms_geometry.cpp; ops.cpp has validated the index
// arrays). Features are cast to float32. make_voxelize returns {values,
// picks}; index = {voxel_offsets, voxel_points, point_to_voxel}.
std::vector<array> make_voxelize(int mode, const array& feats, const std::vector<array>& index,
                                 mx::Stream s);
// index = {rows, weights, nearest, voxel_offsets, voxel_entries}. The result
// is in out_dtype; on a CPU stream half-precision x is read and out_dtype
// written by the kernel itself (no cast nodes).
array make_devoxelize(GeometryDevoxelize::Face face, bool nearest, int64_t n_voxels, const array& x,
                      const std::vector<array>& index, mx::Stream s,
                      mx::Dtype out_dtype = mx::float32);
// {rows, dist2}; points as given (float64 stays on the CPU kernels).
// radius > 0: only neighbours within it (the k nearest of them).
std::vector<array> make_knn(int k, const KnnGrid& grid, const array& query, const array& qbatch,
                            const array& support, const array& sbatch, mx::Stream s,
                            double radius = 0.0);
array make_morton(const array& coords, mx::Stream s);
// {first, rows} of GeometryHash over (N, 4) coords and (Q, 4) queries, int32.
std::vector<array> make_coord_hash(const array& coords, const array& queries, mx::Stream s);
// GeometryRadius: {counts} without offsets, {rows, dist2} (total rows) with.
std::vector<array> make_radius(const KnnGrid& grid, double radius, const array& query,
                               const array& qbatch, const array& support, const array& sbatch,
                               const std::optional<array>& offsets, int total, mx::Stream s);

// ---------------------------------------------------------------- batch norm
// Training-mode batch norm (+ optional ReLU) of (N, C) features, N >= 1:
// graph code and transforms in norm.cpp, CPU evaluation in cpu/norm_eval.cpp
// (kernels in cpu/norm.h), Metal kernels in metal/norm.metal.
// BatchNormTrain: (x, weight, bias) -> (y in x's dtype, mean, var float32);
// weight and bias float32. The mean / var outputs carry no gradient (their
// cotangents are ignored; the Python API stops them).
class BatchNormTrain : public mx::Primitive {
 public:
  BatchNormTrain(mx::Stream stream, float eps, bool relu)
      : mx::Primitive(stream), eps_(eps), relu_(relu) {}
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  void eval_gpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(BatchNormTrain)
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const BatchNormTrain&>(other);
    return eps_ == o.eps_ && relu_ == o.relu_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override;
  float eps() const { return eps_; }
  bool relu() const { return relu_; }

 private:
  float eps_;
  bool relu_;
};

// The closed-form backward pass of BatchNormTrain: (g, x, y, weight, mean,
// var) -> (dx in x's dtype, dweight, dbias float32); g and y in x's dtype
// (y only read with relu: gradients pass where y > 0). Not differentiable.
class BatchNormTrainGrad : public mx::Primitive {
 public:
  BatchNormTrainGrad(mx::Stream stream, float eps, bool relu)
      : mx::Primitive(stream), eps_(eps), relu_(relu) {}
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  void eval_gpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  DEFINE_VMAP()
  DEFINE_GRADS()
  DEFINE_NAME(BatchNormTrainGrad)
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const BatchNormTrainGrad&>(other);
    return eps_ == o.eps_ && relu_ == o.relu_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override;
  float eps() const { return eps_; }
  bool relu() const { return relu_; }

 private:
  float eps_;
  bool relu_;
};

// Validates and builds BatchNormTrain (norm.cpp): {y, mean, var}. Raises
// std::invalid_argument naming the argument for a bad rank, shape, dtype
// or eps.
std::vector<array> batch_norm_train(const array& x, const array& weight, const array& bias,
                                    float eps, bool relu, mx::StreamOrDevice s = {});

// Validates and builds BatchNormEval (norm.cpp): y = [relu]((x - mean) *
// weight / sqrt(var + eps) + bias) with the given statistics; weight and
// bias optional (absent: 1 and 0). Raises std::invalid_argument naming the
// argument for a bad rank, shape, dtype or eps.
array batch_norm_eval(const array& x, const array& mean, const array& var,
                      const std::optional<array>& weight, const std::optional<array>& bias,
                      float eps, bool relu, mx::StreamOrDevice s = {});

}  // namespace mlx_lattice
