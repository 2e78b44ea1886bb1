// Graph builders and autodiff of the geometry primitives.
#include <sstream>
#include <stdexcept>

#include "common.h"
#include "geometry_primitives.h"
#include "validate.h"

namespace mlx_lattice {

namespace {

constexpr const char* kVoxelizeOp = "voxelize";
constexpr const char* kDevoxelizeOp = "devoxelize";

int reduce_mode(const std::string& reduce) {
  if (reduce == "sum") return 0;
  if (reduce == "mean") return 1;
  if (reduce == "max") return 2;
  if (reduce == "first") return 3;
  fail(kVoxelizeOp, "reduce must be 'sum', 'mean', 'max' or 'first', got '" + reduce + "'.");
}

void check_features(const char* op, const char* name, const mx::array& f) {
  if (f.ndim() != 2) {
    fail(op, std::string(name) + " must be (rows, C), got shape " + shape_str(f.shape()) + ".");
  }
  check_float_dtype(op, name, f);
}

// The voxel grouping: offsets (N + 1) over P points, members a permutation of
// [0, P) consistent with point_to_voxel.
std::vector<mx::array> checked_grouping(const mx::array& offsets, const mx::array& members,
                                        const mx::array& p2v, int64_t n_points) {
  return validated("geometry_voxelize", {offsets, members, p2v}, [&] {
    auto a = concrete_indices(kVoxelizeOp,
                              {{"voxel_offsets", offsets},
                               {"voxel_points", members},
                               {"point_to_voxel", p2v}},
                              {1, 1, 1});
    const int64_t n_voxels = static_cast<int64_t>(a[0].size()) - 1;
    if (n_voxels < 0) fail(kVoxelizeOp, "voxel_offsets must have at least one entry.");
    if (static_cast<int64_t>(a[1].size()) != n_points || static_cast<int64_t>(a[2].size()) != n_points) {
      std::ostringstream msg;
      msg << "voxel_points and point_to_voxel must have " << n_points
          << " entries (one per point), got " << a[1].size() << " and " << a[2].size() << ".";
      fail(kVoxelizeOp, msg.str());
    }
    check_offsets(kVoxelizeOp, "voxel_offsets", a[0], n_voxels, n_points);
    check_range(kVoxelizeOp, "voxel_points", a[1], 0, n_points);
    check_range(kVoxelizeOp, "point_to_voxel", a[2], 0, std::max<int64_t>(n_voxels, 1));
    const int32_t* off = a[0].data<int32_t>();
    const int32_t* mem = a[1].data<int32_t>();
    const int32_t* inv = a[2].data<int32_t>();
    for (int64_t v = 0; v < n_voxels; ++v) {
      for (int32_t i = off[v]; i < off[v + 1]; ++i) {
        if (inv[mem[i]] != v) {
          std::ostringstream msg;
          msg << "voxel_points lists point " << mem[i] << " under voxel " << v
              << " but point_to_voxel maps it to " << inv[mem[i]] << ".";
          fail(kVoxelizeOp, msg.str());
        }
      }
    }
    return a;
  });
}

std::vector<mx::array> checked_point_voxel_map(const mx::array& rows, const mx::array& nearest,
                                               const mx::array& offsets, const mx::array& entries,
                                               int64_t n_voxels) {
  return validated("geometry_devoxelize", {rows, nearest, offsets, entries}, [&] {
    auto a = concrete_indices(kDevoxelizeOp,
                              {{"rows", rows},
                               {"nearest", nearest},
                               {"voxel_offsets", offsets},
                               {"voxel_entries", entries}},
                              {2, 1, 1, 1});
    if (a[0].shape(1) != 8) {
      fail(kDevoxelizeOp, "rows must be (P, 8), got " + shape_str(a[0].shape()) + ".");
    }
    const int64_t n_points = a[0].shape(0);
    if (static_cast<int64_t>(a[1].size()) != n_points) {
      fail(kDevoxelizeOp, "nearest must have one entry per point.");
    }
    check_range(kDevoxelizeOp, "rows", a[0], -1, n_voxels);
    check_range(kDevoxelizeOp, "nearest", a[1], -1, n_voxels);
    check_offsets(kDevoxelizeOp, "voxel_offsets", a[2], n_voxels, a[3].size());
    check_range(kDevoxelizeOp, "voxel_entries", a[3], 0, std::max<int64_t>(8 * n_points, 1));
    const int32_t* r = a[0].data<int32_t>();
    const int32_t* off = a[2].data<int32_t>();
    const int32_t* ent = a[3].data<int32_t>();
    for (int64_t v = 0; v < n_voxels; ++v) {
      for (int32_t i = off[v]; i < off[v + 1]; ++i) {
        if (r[ent[i]] != v) {
          fail(kDevoxelizeOp, "voxel_entries is inconsistent with rows at voxel " +
                                  std::to_string(v) + ".");
        }
      }
    }
    return a;
  });
}

mx::array devoxelize_face(const mx::array& x, const std::vector<mx::array>& index_inputs,
                          Devoxelize::Face face, bool nearest, int64_t n_voxels,
                          mx::Stream stream) {
  const int64_t rows_out = face == Devoxelize::kForward ? index_inputs[0].shape(0) : n_voxels;
  std::vector<mx::array> inputs = {mx::contiguous(mx::astype(x, mx::float32, stream), false, stream)};
  inputs.insert(inputs.end(), index_inputs.begin(), index_inputs.end());
  return mx::array({static_cast<int>(rows_out), x.shape(1)}, mx::float32,
                   std::make_shared<Devoxelize>(stream, face, nearest, n_voxels), inputs);
}

}  // namespace

mx::array geometry_voxelize(const mx::array& feats, const mx::array& voxel_offsets,
                            const mx::array& voxel_points, const mx::array& point_to_voxel,
                            const std::string& reduce, mx::StreamOrDevice s) {
  const int mode = reduce_mode(reduce);
  check_features(kVoxelizeOp, "point_features", feats);
  auto idx = checked_grouping(voxel_offsets, voxel_points, point_to_voxel, feats.shape(0));
  auto stream = mx::to_stream(s);
  const int n_voxels = static_cast<int>(idx[0].size()) - 1;
  const int channels = feats.shape(1);
  auto outs = mx::array::make_arrays(
      {{n_voxels, channels}, {n_voxels, channels}}, {mx::float32, mx::int32},
      std::make_shared<Voxelize>(stream, mode),
      {mx::contiguous(mx::astype(feats, mx::float32, stream), false, stream), idx[0], idx[1],
       idx[2]});
  return mx::astype(outs[0], feats.dtype(), stream);
}

mx::array geometry_devoxelize(const mx::array& voxel_features, const mx::array& rows,
                              const mx::array& weights, const mx::array& nearest,
                              const mx::array& voxel_offsets, const mx::array& voxel_entries,
                              bool nearest_mode, mx::StreamOrDevice s) {
  check_features(kDevoxelizeOp, "voxel_features", voxel_features);
  const int64_t n_voxels = voxel_features.shape(0);
  auto idx = checked_point_voxel_map(rows, nearest, voxel_offsets, voxel_entries, n_voxels);
  if (weights.dtype() != mx::float32 || weights.shape() != idx[0].shape()) {
    fail(kDevoxelizeOp, "weights must be float32 of the shape of rows " +
                            shape_str(idx[0].shape()) + ", got " + dtype_str(weights.dtype()) +
                            " " + shape_str(weights.shape()) + ".");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> index_inputs = {idx[0], mx::contiguous(weights, false, stream), idx[1],
                                         idx[2], idx[3]};
  auto out = devoxelize_face(voxel_features, index_inputs, Devoxelize::kForward, nearest_mode,
                             n_voxels, stream);
  return mx::astype(out, voxel_features.dtype(), stream);
}

// ---- Voxelize ---------------------------------------------------------------------------

std::vector<mx::Shape> Voxelize::output_shapes(const std::vector<mx::array>& inputs) {
  const int n = static_cast<int>(inputs[1].size()) - 1;
  return {{n, inputs[0].shape(1)}, {n, inputs[0].shape(1)}};
}

std::vector<mx::array> Voxelize::vjp(const std::vector<mx::array>& primals,
                                     const std::vector<mx::array>& cotangents,
                                     const std::vector<int>& argnums,
                                     const std::vector<mx::array>& outputs) {
  auto s = stream();
  std::vector<mx::array> grads;
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
      auto counts = mx::subtract(mx::slice(offsets, {1}, {n + 1}, s),
                                 mx::slice(offsets, {0}, {n}, s), s);
      counts = mx::maximum(mx::astype(counts, mx::float32, s), mx::array(1.0f), s);
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

std::vector<mx::array> Voxelize::jvp(const std::vector<mx::array>& primals,
                                     const std::vector<mx::array>& tangents,
                                     const std::vector<int>& argnums) {
  auto s = stream();
  const int n = static_cast<int>(primals[1].size()) - 1;
  mx::array t = mx::zeros({n, primals[0].shape(1)}, mx::float32, s);
  for (size_t i = 0; i < argnums.size(); ++i) {
    if (argnums[i] != 0) continue;
    auto outs = mx::array::make_arrays(
        {{n, primals[0].shape(1)}, {n, primals[0].shape(1)}}, {mx::float32, mx::int32},
        std::make_shared<Voxelize>(s, mode_),
        {mx::contiguous(tangents[i], false, s), primals[1], primals[2], primals[3]});
    if (mode_ < 2) {
      t = outs[0];
    } else {
      auto picks = mx::array::make_arrays(
          {{n, primals[0].shape(1)}, {n, primals[0].shape(1)}}, {mx::float32, mx::int32},
          std::make_shared<Voxelize>(s, mode_), primals)[1];
      auto safe = mx::maximum(picks, mx::array(0), s);
      auto taken = mx::take_along_axis(tangents[i], safe, 0, s);
      t = mx::where(mx::greater_equal(picks, mx::array(0), s), taken, mx::zeros_like(taken, s), s);
    }
  }
  return {t};
}

std::pair<std::vector<mx::array>, std::vector<int>> Voxelize::vmap(const std::vector<mx::array>&,
                                                                   const std::vector<int>&) {
  throw std::invalid_argument(
      "GeometryVoxelize (voxelize): vmap is not supported; voxelize each item or batch "
      "points through the batch indices of quantize_points.");
}

void Voxelize::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw_no_gpu(name());
}

// ---- Devoxelize -------------------------------------------------------------------------

std::vector<mx::Shape> Devoxelize::output_shapes(const std::vector<mx::array>& inputs) {
  const int rows = face_ == kForward ? inputs[1].shape(0) : static_cast<int>(n_voxels_);
  return {{rows, inputs[0].shape(1)}};
}

std::vector<mx::array> Devoxelize::vjp(const std::vector<mx::array>& primals,
                                       const std::vector<mx::array>& cotangents,
                                       const std::vector<int>& argnums,
                                       const std::vector<mx::array>&) {
  auto s = stream();
  std::vector<mx::array> index_inputs(primals.begin() + 1, primals.end());
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg == 0) {
      grads.push_back(devoxelize_face(cotangents[0], index_inputs,
                                      face_ == kForward ? kTranspose : kForward, nearest_,
                                      n_voxels_, s));
    } else if (arg == 2 && face_ == kForward && !nearest_) {
      // d out[p] / d w[p, c] = vf[rows[p, c]] (0 for missing voxels).
      const auto& rows = primals[1];
      auto gathered = mx::take(primals[0], mx::maximum(rows, mx::array(0), s), 0, s);
      auto dot = mx::sum(mx::multiply(gathered, mx::expand_dims(cotangents[0], 1, s), s), -1,
                         false, s);
      grads.push_back(
          mx::where(mx::greater_equal(rows, mx::array(0), s), dot, mx::zeros_like(dot, s), s));
    } else {
      grads.push_back(mx::zeros_like(primals[arg], s));
    }
  }
  return grads;
}

std::vector<mx::array> Devoxelize::jvp(const std::vector<mx::array>& primals,
                                       const std::vector<mx::array>& tangents,
                                       const std::vector<int>& argnums) {
  auto s = stream();
  std::vector<mx::array> index_inputs(primals.begin() + 1, primals.end());
  std::optional<mx::array> out;
  for (size_t i = 0; i < argnums.size(); ++i) {
    if (argnums[i] != 0) {
      throw std::invalid_argument(
          "GeometryDevoxelize (devoxelize): forward-mode derivatives flow only to "
          "voxel_features.");
    }
    out = devoxelize_face(tangents[i], index_inputs, face_, nearest_, n_voxels_, s);
  }
  if (!out) {
    auto shape = output_shapes(primals)[0];
    return {mx::zeros(shape, mx::float32, s)};
  }
  return {*out};
}

std::pair<std::vector<mx::array>, std::vector<int>> Devoxelize::vmap(const std::vector<mx::array>&,
                                                                     const std::vector<int>&) {
  throw std::invalid_argument(
      "GeometryDevoxelize (devoxelize): vmap is not supported; stack the channels of the "
      "batched features instead (features are (N, C)).");
}

void Devoxelize::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw_no_gpu(name());
}

}  // namespace mlx_lattice
