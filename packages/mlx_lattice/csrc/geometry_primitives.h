// The MLX primitives of the geometry ops (graph code only; the arithmetic is
// in cpu/geometry_kernels.cpp, the CPU evaluation in cpu/geometry_eval.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mlx_lattice {

namespace mx = mlx::core;

// Point features (P, C) -> voxel features (N, C) and, as a second output, the
// (N, C) int32 point each max/first picked (-1 for sum/mean and empty voxels).
// Inputs: feats (float32), voxel_offsets (N + 1), voxel_points (P),
// point_to_voxel (P).
class Voxelize : public mx::Primitive {
 public:
  Voxelize(mx::Stream stream, int mode) : mx::Primitive(stream), mode_(mode) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>& outputs) override;
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>& inputs,
                                                           const std::vector<int>& axes) override;
  const char* name() const override { return "GeometryVoxelize"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return mode_ == static_cast<const Voxelize&>(other).mode_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  int mode() const { return mode_; }

 private:
  int mode_;
};

// Voxel features (N, C) -> point features (P, C) through a point-voxel map
// (kForward) and its transpose (kTranspose: (P, C) -> (N, C)). Inputs after
// the features: rows (P, 8), weights (P, 8) float32, nearest (P,),
// voxel_offsets (N + 1), voxel_entries (E).
class Devoxelize : public mx::Primitive {
 public:
  enum Face { kForward = 0, kTranspose = 1 };
  Devoxelize(mx::Stream stream, Face face, bool nearest, int64_t n_voxels)
      : mx::Primitive(stream), face_(face), nearest_(nearest), n_voxels_(n_voxels) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>& outputs) override;
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>& inputs,
                                                           const std::vector<int>& axes) override;
  const char* name() const override { return "GeometryDevoxelize"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Devoxelize&>(other);
    return face_ == o.face_ && nearest_ == o.nearest_ && n_voxels_ == o.n_voxels_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  Face face_;
  bool nearest_;
  int64_t n_voxels_;
};

// Graph builders: validate (eagerly, on the index arrays) and build the node.
// feats of any float dtype; the result has feats' dtype (float32 inside).
mx::array geometry_voxelize(const mx::array& feats, const mx::array& voxel_offsets,
                            const mx::array& voxel_points, const mx::array& point_to_voxel,
                            const std::string& reduce, mx::StreamOrDevice s = {});
mx::array geometry_devoxelize(const mx::array& voxel_features, const mx::array& rows,
                              const mx::array& weights, const mx::array& nearest,
                              const mx::array& voxel_offsets, const mx::array& voxel_entries,
                              bool nearest_mode, mx::StreamOrDevice s = {});

}  // namespace mlx_lattice
