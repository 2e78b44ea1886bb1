// Graph builders of the geometry primitives and their transforms (vjp, jvp,
// vmap). Both are linear in the features: voxelize's sum/mean are sums over a
// voxel's points, max/first route the gradient to the picked point;
// devoxelize's transpose is the same map read the other way.
#include <optional>
#include <stdexcept>

#include "primitives.h"

namespace mlx_lattice {

namespace {

using Face = GeometryDevoxelize::Face;

array as_float32(const array& x, mx::Stream s) {
  return mx::contiguous(mx::astype(x, mx::float32, s), false, s);
}

}  // namespace

// ------------------------------------------------------------ graph builders

std::vector<array> make_voxelize(int mode, const array& feats, const std::vector<array>& index,
                                 mx::Stream s) {
  const int n_voxels = static_cast<int>(index[0].size()) - 1;
  const int channels = feats.shape(1);
  return array::make_arrays({{n_voxels, channels}, {n_voxels, channels}}, {mx::float32, mx::int32},
                            std::make_shared<GeometryVoxelize>(s, mode),
                            {as_float32(feats, s), index[0], index[1], index[2]});
}

array make_devoxelize(Face face, bool nearest, int64_t n_voxels, const array& x,
                      const std::vector<array>& index, mx::Stream s) {
  const int64_t rows_out = face == Face::kForward ? index[0].shape(0) : n_voxels;
  std::vector<array> inputs = {as_float32(x, s)};
  inputs.insert(inputs.end(), index.begin(), index.end());
  return array({static_cast<int>(rows_out), x.shape(1)}, mx::float32,
               std::make_shared<GeometryDevoxelize>(s, face, nearest, n_voxels), inputs);
}

// ---------------------------------------------------------- GeometryVoxelize

std::vector<mx::Shape> GeometryVoxelize::output_shapes(const std::vector<array>& inputs) {
  const int n = static_cast<int>(inputs[1].size()) - 1;
  return {{n, inputs[0].shape(1)}, {n, inputs[0].shape(1)}};
}

std::vector<array> GeometryVoxelize::vjp(const std::vector<array>& primals,
                                         const std::vector<array>& cotangents,
                                         const std::vector<int>& argnums,
                                         const std::vector<array>& outputs) {
  auto s = stream();
  std::vector<array> grads;
  for (int arg : argnums) {
    if (arg != 0) {
      grads.push_back(mx::zeros_like(primals[arg], s));
      continue;
    }
    const auto& offsets = primals[1];
    const auto& p2v = primals[3];
    auto g = cotangents[0];
    if (mode_ == 1) {
      const int n = static_cast<int>(offsets.size()) - 1;
      auto counts =
          mx::subtract(mx::slice(offsets, {1}, {n + 1}, s), mx::slice(offsets, {0}, {n}, s), s);
      counts = mx::maximum(mx::astype(counts, mx::float32, s), array(1.0f), s);
      g = mx::divide(g, mx::expand_dims(counts, 1, s), s);
    }
    auto gathered = mx::take(g, p2v, 0, s);
    if (mode_ >= 2) {
      // Only the point each max/first picked receives the gradient.
      auto picked = mx::take(outputs[1], p2v, 0, s);
      auto self = mx::expand_dims(mx::arange(static_cast<int>(p2v.size()), mx::int32, s), 1, s);
      gathered = mx::where(mx::equal(picked, self, s), gathered, mx::zeros_like(gathered, s), s);
    }
    grads.push_back(gathered);
  }
  return grads;
}

std::vector<array> GeometryVoxelize::jvp(const std::vector<array>& primals,
                                         const std::vector<array>& tangents,
                                         const std::vector<int>& argnums) {
  auto s = stream();
  const int n = static_cast<int>(primals[1].size()) - 1;
  const std::vector<array> index = {primals[1], primals[2], primals[3]};
  array t = mx::zeros({n, primals[0].shape(1)}, mx::float32, s);
  for (size_t i = 0; i < argnums.size(); ++i) {
    if (argnums[i] != 0) continue;
    if (mode_ < 2) {
      t = make_voxelize(mode_, tangents[i], index, s)[0];
    } else {
      auto picks = make_voxelize(mode_, primals[0], index, s)[1];
      auto safe = mx::maximum(picks, array(0), s);
      auto taken = mx::take_along_axis(tangents[i], safe, 0, s);
      t = mx::where(mx::greater_equal(picks, array(0), s), taken, mx::zeros_like(taken, s), s);
    }
  }
  return {t};
}

std::pair<std::vector<array>, std::vector<int>> GeometryVoxelize::vmap(const std::vector<array>&,
                                                                       const std::vector<int>&) {
  throw std::invalid_argument(
      "GeometryVoxelize (voxelize): vmap is not supported; voxelize each item or batch "
      "points through the batch indices of quantize_points.");
}

// -------------------------------------------------------- GeometryDevoxelize

std::vector<mx::Shape> GeometryDevoxelize::output_shapes(const std::vector<array>& inputs) {
  const int rows = face_ == kForward ? inputs[1].shape(0) : static_cast<int>(n_voxels_);
  return {{rows, inputs[0].shape(1)}};
}

std::vector<array> GeometryDevoxelize::vjp(const std::vector<array>& primals,
                                           const std::vector<array>& cotangents,
                                           const std::vector<int>& argnums,
                                           const std::vector<array>&) {
  auto s = stream();
  std::vector<array> index(primals.begin() + 1, primals.end());
  std::vector<array> grads;
  for (int arg : argnums) {
    if (arg == 0) {
      grads.push_back(make_devoxelize(face_ == kForward ? kTranspose : kForward, nearest_,
                                      n_voxels_, cotangents[0], index, s));
    } else if (arg == 2 && face_ == kForward && !nearest_) {
      // d out[p] / d w[p, c] = vf[rows[p, c]] (0 for missing voxels).
      const auto& rows = primals[1];
      auto gathered = mx::take(primals[0], mx::maximum(rows, array(0), s), 0, s);
      auto dot =
          mx::sum(mx::multiply(gathered, mx::expand_dims(cotangents[0], 1, s), s), -1, false, s);
      grads.push_back(
          mx::where(mx::greater_equal(rows, array(0), s), dot, mx::zeros_like(dot, s), s));
    } else {
      grads.push_back(mx::zeros_like(primals[arg], s));
    }
  }
  return grads;
}

std::vector<array> GeometryDevoxelize::jvp(const std::vector<array>& primals,
                                           const std::vector<array>& tangents,
                                           const std::vector<int>& argnums) {
  auto s = stream();
  std::vector<array> index(primals.begin() + 1, primals.end());
  std::optional<array> out;
  for (size_t i = 0; i < argnums.size(); ++i) {
    if (argnums[i] != 0) {
      throw std::invalid_argument(
          "GeometryDevoxelize (devoxelize): forward-mode derivatives flow only to "
          "voxel_features.");
    }
    out = make_devoxelize(face_, nearest_, n_voxels_, tangents[i], index, s);
  }
  if (!out) return {mx::zeros(output_shapes(primals)[0], mx::float32, s)};
  return {*out};
}

std::pair<std::vector<array>, std::vector<int>> GeometryDevoxelize::vmap(const std::vector<array>&,
                                                                         const std::vector<int>&) {
  throw std::invalid_argument(
      "GeometryDevoxelize (devoxelize): vmap is not supported; stack the channels of the "
      "batched features instead (features are (N, C)).");
}

}  // namespace mlx_lattice
