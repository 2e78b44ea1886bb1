// The MLX Primitive subclasses behind sparse_ops.h (graph code only; the
// arithmetic is in kernels.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mlx_lattice {

namespace mx = mlx::core;

// The edge list of a relation and its groupings, in primitive-input order.
// Empty input/kernel groupings are rebuilt by the kernels when needed.
struct RelationArrays {
  static constexpr size_t kCount = 8;
  mx::array in_rows, out_rows, kernel_ids, out_offsets, in_offsets, in_edge_ids, k_offsets,
      k_edge_ids;

  std::vector<mx::array> list() const {
    return {in_rows, out_rows, kernel_ids, out_offsets, in_offsets, in_edge_ids, k_offsets,
            k_edge_ids};
  }
  static RelationArrays from(const std::vector<mx::array>& v, size_t start) {
    return {v[start],     v[start + 1], v[start + 2], v[start + 3],
            v[start + 4], v[start + 5], v[start + 6], v[start + 7]};
  }
};

struct ConvDims {
  int64_t n_in = 0;
  int64_t n_out = 0;
  int64_t n_kernels = 0;
  bool operator==(const ConvDims&) const = default;
};

// Base with the boilerplate every sparse primitive shares.
class SparsePrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  // Metal kernels on macOS builds; elsewhere a clear "built without Metal
  // kernels" error.
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

 protected:
  // With the MSL harness switched on, evaluates through the GPU encode plans
  // on the CPU and returns true.
  bool run_harness_if_enabled(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs);
};

// The three bilinear faces of one sparse convolution:
//   kForward:    (F, W) -> out[o] = sum_e F[in_e] @ W[k_e]
//   kInputGrad:  (G, W) -> dF[i] = sum_e G[out_e] @ W[k_e]^T
//   kWeightGrad: (F, G) -> dW[k] = sum_e F[in_e]^T G[out_e]
class SparseConv : public SparsePrimitive {
 public:
  enum class Mode { kForward, kInputGrad, kWeightGrad };
  SparseConv(mx::Stream s, Mode mode, ConvDims dims)
      : SparsePrimitive(s), mode_(mode), dims_(dims) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override;
  const char* name() const override { return "SparseConv"; }
  bool is_equivalent(const mx::Primitive& other) const override;

  Mode mode() const { return mode_; }
  const ConvDims& dims() const { return dims_; }

 private:
  Mode mode_;
  ConvDims dims_;
};

// Forward convolution through the sorted implicit-GEMM view. Inputs:
// F, W, sorted_out_in_map, reorder_rows, then the relation arrays (gradients).
class SparseConvSorted : public SparsePrimitive {
 public:
  SparseConvSorted(mx::Stream s, ConvDims dims, bool store_sorted)
      : SparsePrimitive(s), dims_(dims), store_sorted_(store_sorted) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override;
  const char* name() const override { return "SparseConvSorted"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  const ConvDims& dims() const { return dims_; }
  bool store_sorted() const { return store_sorted_; }

 private:
  ConvDims dims_;
  bool store_sorted_;
};

// The sorted dataflow computed directly. Inputs: F, W, sorted_out_in_map,
// reorder_rows, tile_masks.
class SparseConvDirect : public SparsePrimitive {
 public:
  SparseConvDirect(mx::Stream s, ConvDims dims, bool store_sorted)
      : SparsePrimitive(s), dims_(dims), store_sorted_(store_sorted) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override;
  const char* name() const override { return "SparseConvDirect"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  const ConvDims& dims() const { return dims_; }
  bool store_sorted() const { return store_sorted_; }

 private:
  ConvDims dims_;
  bool store_sorted_;
};

struct QuantSpec {
  int64_t in_channels = 0;
  int64_t out_channels = 0;
  int64_t storage_in_channels = 0;
  int group_size = 0;
  int bits = 0;
  bool operator==(const QuantSpec&) const = default;
};

// Convolution with group-affine quantized weights. Inputs: F, packed weight,
// scales, biases, then the relation arrays.
class SparseQuantizedConv : public SparsePrimitive {
 public:
  SparseQuantizedConv(mx::Stream s, ConvDims dims, QuantSpec spec)
      : SparsePrimitive(s), dims_(dims), spec_(spec) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override;
  const char* name() const override { return "SparseQuantizedConv"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  const ConvDims& dims() const { return dims_; }
  const QuantSpec& spec() const { return spec_; }

 private:
  ConvDims dims_;
  QuantSpec spec_;
};

// kDenominator: (W, kernel_ids, out_offsets) -> out[o] = sum_e colsum(W[k_e]).
// kGradient:    (G, kernel_ids, out_offsets) -> dS[k] = sum_{e of k} G[out_e].
class SparseDenominator : public SparsePrimitive {
 public:
  enum class Mode { kDenominator, kGradient };
  SparseDenominator(mx::Stream s, Mode mode, ConvDims dims)
      : SparsePrimitive(s), mode_(mode), dims_(dims) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override;
  const char* name() const override { return "SparseDenominator"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  Mode mode() const { return mode_; }
  const ConvDims& dims() const { return dims_; }

 private:
  Mode mode_;
  ConvDims dims_;
};

// Pooling. kForward: (F, in_rows, out_offsets); kMaxSelect: (F, T, ...) picks
// T at each max of F; kBackward: (G, F, ...) -> dF.
class SparsePool : public SparsePrimitive {
 public:
  enum class Stage { kForward, kMaxSelect, kBackward };
  SparsePool(mx::Stream s, Stage stage, kernels::PoolMode mode, ConvDims dims)
      : SparsePrimitive(s), stage_(stage), mode_(mode), dims_(dims) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override;
  const char* name() const override { return "SparsePool"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  Stage stage() const { return stage_; }
  kernels::PoolMode mode() const { return mode_; }
  const ConvDims& dims() const { return dims_; }

 private:
  Stage stage_;
  kernels::PoolMode mode_;
  ConvDims dims_;
};

// Graph builders of the primitives (no validation: callers have validated).
// Floating operands are cast to contiguous float32.
mx::array make_conv(SparseConv::Mode mode, const mx::array& a, const mx::array& b,
                    const RelationArrays& rel, ConvDims d, mx::Stream s);
mx::array make_sorted(const mx::array& f, const mx::array& w, const mx::array& sorted_map,
                      const mx::array& reorder, const RelationArrays& rel, ConvDims d,
                      bool store_sorted, mx::Stream s);
mx::array make_direct(const mx::array& f, const mx::array& w, const mx::array& sorted_map,
                      const mx::array& reorder, const mx::array& tile_masks, ConvDims d,
                      bool store_sorted, mx::Stream s);
// quant = {packed weight, scales, biases}.
mx::array make_quantized(const mx::array& f, const std::vector<mx::array>& quant,
                         const RelationArrays& rel, ConvDims d, QuantSpec spec, mx::Stream s);
mx::array make_denominator(SparseDenominator::Mode mode, const mx::array& x,
                           const mx::array& kernel_ids, const mx::array& out_offsets, ConvDims d,
                           mx::Stream s);
mx::array make_pool(SparsePool::Stage stage, kernels::PoolMode mode,
                    const std::vector<mx::array>& floats, const mx::array& in_rows,
                    const mx::array& out_offsets, ConvDims d, mx::Stream s);

}  // namespace mlx_lattice
