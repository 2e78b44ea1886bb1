// Graph builders of the geometry primitives and their transforms (vjp, jvp,
// vmap). Both are linear in the features: voxelize's sum/mean are sums over a
// voxel's points, max/first route the gradient to the picked point;
// devoxelize's transpose is the same map read the other way.
#include <algorithm>
#include "cpu/input_error.h"
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

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
                      const std::vector<array>& index, mx::Stream s, mx::Dtype out_dtype) {
  const int64_t rows_out = face == Face::kForward ? index[0].shape(0) : n_voxels;
  // The CPU kernel widens float16 / bfloat16 rows and rounds its output
  // itself: the bits of the casts, without their passes over memory. Metal
  // kernels take and give float32.
  const bool cpu = !uses_metal_bodies(s);
  const bool half = x.dtype() == mx::float16 || x.dtype() == mx::bfloat16;
  const mx::Dtype kernel_out = cpu ? out_dtype : mx::float32;
  std::vector<array> inputs = {cpu && half ? mx::contiguous(x, false, s) : as_float32(x, s)};
  inputs.insert(inputs.end(), index.begin(), index.end());
  array out({static_cast<int>(rows_out), x.shape(1)}, kernel_out,
            std::make_shared<GeometryDevoxelize>(s, face, nearest, n_voxels, kernel_out), inputs);
  return kernel_out == out_dtype ? out : mx::astype(out, out_dtype, s);
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
  throw ::mlx_lattice::InputError(
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
                                      n_voxels_, cotangents[0], index, s, primals[0].dtype()));
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
      throw ::mlx_lattice::InputError(
          "GeometryDevoxelize (devoxelize): forward-mode derivatives flow only to "
          "voxel_features.");
    }
    out = make_devoxelize(face_, nearest_, n_voxels_, tangents[i], index, s, out_dtype_);
  }
  if (!out) return {mx::zeros(output_shapes(primals)[0], out_dtype_, s)};
  return {*out};
}

std::pair<std::vector<array>, std::vector<int>> GeometryDevoxelize::vmap(const std::vector<array>&,
                                                                         const std::vector<int>&) {
  throw ::mlx_lattice::InputError(
      "GeometryDevoxelize (devoxelize): vmap is not supported; stack the channels of the "
      "batched features instead (features are (N, C)).");
}

}  // namespace mlx_lattice

// ---------------------------------------------------- GeometryKnn, Morton
// Index-valued outputs: no gradients (a clear error, never a silent zero).

namespace mlx_lattice {

namespace {

// Cell key of each support point: ((batch * nx + cx) * ny + cy) * nz + cz,
// with c = floor((p - origin) * (1 / cell)) in float32 as the kernel computes
// it for queries (clipped to the grid; points lie inside it up to rounding).
array cell_keys(const array& pts, const array& batch, const KnnGrid& g, mx::Stream s) {
  const float inv = 1.0f / g.cell;
  auto rel = mx::multiply(mx::subtract(pts, array(g.origin, {1, 3}), s), array(inv), s);
  auto cells = mx::astype(mx::floor(rel, s), mx::int32, s);
  cells = mx::clip(cells, array(0),
                   array({g.dims[0] - 1, g.dims[1] - 1, g.dims[2] - 1}, {1, 3}), s);
  auto axis = [&](int a) { return mx::squeeze(mx::slice(cells, {0, a}, {pts.shape(0), a + 1}, s), 1, s); };
  auto key = mx::add(mx::multiply(batch, array(g.dims[0]), s), axis(0), s);
  key = mx::add(mx::multiply(key, array(g.dims[1]), s), axis(1), s);
  return mx::add(mx::multiply(key, array(g.dims[2]), s), axis(2), s);
}

[[noreturn]] void not_differentiable(const char* what) {
  throw ::mlx_lattice::InputError(std::string(what) +
                              " has index-valued outputs and no derivatives; gather the "
                              "neighbours' points or features and differentiate those.");
}

// vjp/jvp/vmap of a primitive with index-valued outputs: no derivatives, and
// vmap refused with a hint on how to batch instead.
#define INDEX_VALUED_TRANSFORMS(P, what, vmap_hint)                                         \
  std::vector<array> P::vjp(const std::vector<array>&, const std::vector<array>&,           \
                            const std::vector<int>&, const std::vector<array>&) {           \
    not_differentiable(what);                                                               \
  }                                                                                         \
  std::vector<array> P::jvp(const std::vector<array>&, const std::vector<array>&,           \
                            const std::vector<int>&) {                                      \
    not_differentiable(what);                                                               \
  }                                                                                         \
  std::pair<std::vector<array>, std::vector<int>> P::vmap(const std::vector<array>&,        \
                                                          const std::vector<int>&) {        \
    throw ::mlx_lattice::InputError(std::string(what) + ": vmap is not supported; " vmap_hint); \
  }

// The Metal search kernels' inputs: query and support in float32, then the
// support's cell keys sorted, the sort order and the support in that order.
// Order inside a cell is left to the sort: the kernels break ties by row.
void append_metal_support(std::vector<array>& inputs, const KnnGrid& grid, mx::Stream s) {
  inputs[0] = as_float32(inputs[0], s);
  inputs[2] = as_float32(inputs[2], s);
  auto keys = cell_keys(inputs[2], inputs[3], grid, s);
  auto order = mx::astype(mx::argsort(keys, 0, s), mx::int32, s);
  inputs.push_back(mx::take(keys, order, 0, s));
  inputs.push_back(order);
  inputs.push_back(mx::contiguous(mx::take(inputs[2], order, 0, s), false, s));
}

}  // namespace

std::vector<array> make_knn(int k, const KnnGrid& grid, const array& query, const array& qbatch,
                            const array& support, const array& sbatch, mx::Stream s,
                            double radius) {
  const int nq = query.shape(0);
  std::vector<array> inputs = {query, qbatch, support, sbatch};
  if (uses_metal_bodies(s)) {
    append_metal_support(inputs, grid, s);
  }
  return array::make_arrays({{nq, k}, {nq, k}}, {mx::int32, mx::float32},
                            std::make_shared<GeometryKnn>(s, k, grid, radius), inputs);
}

bool GeometryKnn::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GeometryKnn&>(other);
  const auto& a = grid_;
  const auto& b = o.grid_;
  return k_ == o.k_ && radius_ == o.radius_ && a.cell == b.cell && a.n_batches == b.n_batches &&
         std::equal(a.origin, a.origin + 3, b.origin) && std::equal(a.dims, a.dims + 3, b.dims);
}

std::vector<mx::Shape> GeometryKnn::output_shapes(const std::vector<array>& inputs) {
  return {{inputs[0].shape(0), k_}, {inputs[0].shape(0), k_}};
}

INDEX_VALUED_TRANSFORMS(GeometryKnn, "GeometryKnn (knn)",
                        "batch points through query_batch / support_batch instead.")

array make_morton(const array& coords, mx::Stream s) {
  return array({coords.shape(0)}, mx::int64, std::make_shared<GeometryMorton>(s),
               {mx::contiguous(coords, false, s)});
}

std::vector<mx::Shape> GeometryMorton::output_shapes(const std::vector<array>& inputs) {
  return {{inputs[0].shape(0)}};
}

INDEX_VALUED_TRANSFORMS(GeometryMorton, "GeometryMorton (morton_codes)",
                        "codes are per row, pass the stacked (N, 4) rows.")

}  // namespace mlx_lattice

// ---------------------------------------------------- GeometryHash

namespace mlx_lattice {

std::vector<array> make_coord_hash(const array& coords, const array& queries, mx::Stream s) {
  const int n = coords.shape(0), q = queries.shape(0);
  int64_t slots = 64;
  while (slots < 2 * static_cast<int64_t>(n)) slots <<= 1;
  if (slots > std::numeric_limits<int32_t>::max()) {
    throw ::mlx_lattice::InputError("coords has too many rows for the coordinate hash.");
  }
  auto outs = array::make_arrays(
      {{n}, {q}, {static_cast<int>(slots)}, {static_cast<int>(slots)}, {n}},
      {mx::int32, mx::int32, mx::int32, mx::int32, mx::int32},
      std::make_shared<GeometryHash>(s, slots),
      {mx::contiguous(mx::astype(coords, mx::int32, s), false, s),
       mx::contiguous(mx::astype(queries, mx::int32, s), false, s)});
  return {outs[0], outs[1]};
}

std::vector<mx::Shape> GeometryHash::output_shapes(const std::vector<array>& inputs) {
  const int n = inputs[0].shape(0), slots = static_cast<int>(slots_);
  return {{n}, {inputs[1].shape(0)}, {slots}, {slots}, {n}};
}

INDEX_VALUED_TRANSFORMS(GeometryHash, "GeometryHash (coordinate lookup)",
                        "the batch is the first coordinate column, pass the stacked (N, 4) rows.")

}  // namespace mlx_lattice

// ---------------------------------------------------- GeometryRadius

namespace mlx_lattice {

std::vector<array> make_radius(const KnnGrid& grid, double radius, const array& query,
                               const array& qbatch, const array& support, const array& sbatch,
                               const std::optional<array>& offsets, int total, mx::Stream s) {
  const int nq = query.shape(0);
  std::vector<array> inputs = {query, qbatch, support, sbatch};
  const bool fill = offsets.has_value();
  if (fill) inputs.push_back(mx::contiguous(mx::astype(*offsets, mx::int32, s), false, s));
  if (uses_metal_bodies(s)) {
    append_metal_support(inputs, grid, s);
  }
  auto prim = std::make_shared<GeometryRadius>(s, grid, radius, fill, total);
  if (!fill) return array::make_arrays({{nq}}, {mx::int32}, prim, inputs);
  return array::make_arrays({{total}, {total}}, {mx::int32, mx::float32}, prim, inputs);
}

bool GeometryRadius::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GeometryRadius&>(other);
  const auto& a = grid_;
  const auto& b = o.grid_;
  return radius_ == o.radius_ && fill_ == o.fill_ && total_ == o.total_ && a.cell == b.cell &&
         a.n_batches == b.n_batches && std::equal(a.origin, a.origin + 3, b.origin) &&
         std::equal(a.dims, a.dims + 3, b.dims);
}

std::vector<mx::Shape> GeometryRadius::output_shapes(const std::vector<array>& inputs) {
  if (!fill_) return {{inputs[0].shape(0)}};
  return {{total_}, {total_}};
}

INDEX_VALUED_TRANSFORMS(GeometryRadius, "GeometryRadius (radius search)",
                        "batch points through query_batch / support_batch instead.")

}  // namespace mlx_lattice
