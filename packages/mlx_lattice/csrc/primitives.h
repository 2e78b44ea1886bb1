// The MLX primitives of mlx_lattice, declared in MLX's own style
// (mlx/primitives.h): single-output UnaryPrimitives with DEFINE_* helpers.
//
// Where each part of a primitive lives (see csrc/README.md):
//   graph builders, vjp / jvp / vmap   transforms.cpp
//   eval_cpu                           cpu/<op>.cpp (kernels in cpu/kernels.cpp)
//   eval_gpu                           metal/eval.cpp (macOS) or no_metal.cpp
//   Metal encode bodies                metal/<op>.cpp (kernels in metal/*.metal)
//
// Every primitive holds its validated relation (relation.h) by shared
// pointer: index data is graph-constant, only floating operands are inputs.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "cpu/kernels.h"
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

}  // namespace mlx_lattice
