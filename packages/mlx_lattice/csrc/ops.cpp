// The public operations: argument checks, relation validation, graph build.
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "primitives.h"
#include "validate.h"

namespace mlx_lattice {

namespace {

using Conv = SparseConv::Mode;

std::string str(int64_t v) { return std::to_string(v); }

void check_features(const std::string& op, const mx::array& feats, const Relation& rel) {
  check_float_dtype(op.c_str(), "feats", feats);
  if (feats.ndim() != 2 || feats.shape(1) < 1) {
    fail(op, "feats must be (N, C) with C >= 1, got shape " + shape_str(feats.shape()) + ".");
  }
  if (feats.shape(0) != rel.n_in) {
    fail(op, "feats must have the relation's n_in = " + str(rel.n_in) + " rows, got " +
                 str(feats.shape(0)) + ".");
  }
}

// The mapped (K, Cin, Cout) weight.
void check_weight(const std::string& op, const mx::array& weight, int64_t n_kernels,
                  int64_t cin) {
  check_float_dtype(op.c_str(), "weight", weight);
  if (weight.ndim() != 3 || weight.shape(0) != n_kernels || weight.shape(1) != cin ||
      weight.shape(2) < 1) {
    fail(op, "weight must be (K, Cin, Cout) = (" + str(n_kernels) + ", " + str(cin) +
                 ", Cout), got " + shape_str(weight.shape()) + ".");
  }
}

// ---- geometry

constexpr const char* kVoxelizeOp = "voxelize";
constexpr const char* kDevoxelizeOp = "devoxelize";

int reduce_mode(const std::string& reduce) {
  if (reduce == "sum") return 0;
  if (reduce == "mean") return 1;
  if (reduce == "max") return 2;
  if (reduce == "first") return 3;
  fail(kVoxelizeOp, "reduce must be 'sum', 'mean', 'max' or 'first', got '" + reduce + "'.");
}

void check_table(const char* op, const char* name, const mx::array& f) {
  if (f.ndim() != 2) {
    fail(op, std::string(name) + " must be (rows, C), got shape " + shape_str(f.shape()) + ".");
  }
  check_float_dtype(op, name, f);
}

// The voxel grouping: offsets (N + 1) over P points, members a permutation of
// [0, P) consistent with point_to_voxel.
std::vector<mx::array> checked_grouping(const mx::array& offsets, const mx::array& members,
                                        const mx::array& p2v, int64_t n_points) {
  const auto tag = "geometry_voxelize/" + std::to_string(n_points);
  auto memo = validated(tag, {offsets, members, p2v}, [&]() -> std::shared_ptr<const void> {
    auto a = concrete_indices(
        kVoxelizeOp,
        {{"voxel_offsets", offsets}, {"voxel_points", members}, {"point_to_voxel", p2v}},
        {1, 1, 1});
    const int64_t n_voxels = static_cast<int64_t>(a[0].size()) - 1;
    if (n_voxels < 0) fail(kVoxelizeOp, "voxel_offsets must have at least one entry.");
    if (static_cast<int64_t>(a[1].size()) != n_points ||
        static_cast<int64_t>(a[2].size()) != n_points) {
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
    return std::make_shared<const std::vector<mx::array>>(std::move(a));
  });
  return *std::static_pointer_cast<const std::vector<mx::array>>(memo);
}

std::vector<mx::array> checked_point_voxel_map(const mx::array& rows, const mx::array& nearest,
                                               const mx::array& offsets, const mx::array& entries,
                                               int64_t n_voxels) {
  const auto tag = "geometry_devoxelize/" + std::to_string(n_voxels);
  auto memo =
      validated(tag, {rows, nearest, offsets, entries}, [&]() -> std::shared_ptr<const void> {
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
              fail(kDevoxelizeOp,
                   "voxel_entries is inconsistent with rows at voxel " + std::to_string(v) + ".");
            }
          }
        }
        return std::make_shared<const std::vector<mx::array>>(std::move(a));
      });
  return *std::static_pointer_cast<const std::vector<mx::array>>(memo);
}

}  // namespace

void check_quantized_weight(const std::string& op, const QuantizedArrays& q, int64_t n_kernels,
                            int64_t feat_cols) {
  const int bits = q.bits;
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    fail(op, "bits must be one of 2, 3, 4, 5, 6, 8, got " + str(bits) + ".");
  }
  if (q.group_size < 1 || q.in_channels < 1 || q.out_channels < 1 ||
      q.storage_in_channels < q.in_channels || q.storage_in_channels % q.group_size != 0 ||
      (static_cast<int64_t>(q.storage_in_channels) * bits) % 32 != 0) {
    fail(op, "need 1 <= in_channels <= storage_in_channels, storage_in_channels a multiple of "
             "group_size and of 32 / gcd(bits, 32); got in_channels=" + str(q.in_channels) +
             ", storage_in_channels=" + str(q.storage_in_channels) + ", group_size=" +
             str(q.group_size) + ", bits=" + str(bits) + ".");
  }
  if (feat_cols != q.in_channels) {
    fail(op, "feats must have in_channels = " + str(q.in_channels) + " columns, got " +
                 str(feat_cols) + ".");
  }
  const int k = static_cast<int>(n_kernels);
  const int packed_cols = static_cast<int>(static_cast<int64_t>(q.storage_in_channels) * bits / 32);
  mx::Shape packed_shape = {k, q.out_channels, packed_cols};
  mx::Shape group_shape = {k, q.out_channels, q.storage_in_channels / q.group_size};
  if (q.packed.dtype() != mx::uint32 || q.packed.shape() != packed_shape) {
    fail(op, "weight must be uint32 of shape " + shape_str(packed_shape) + ", got " +
                 dtype_str(q.packed.dtype()) + " " + shape_str(q.packed.shape()) + ".");
  }
  check_float_dtype(op.c_str(), "scales", q.scales);
  check_float_dtype(op.c_str(), "biases", q.biases);
  if (q.scales.shape() != group_shape || q.biases.shape() != group_shape) {
    fail(op, "scales and biases must have shape " + shape_str(group_shape) + ", got " +
                 shape_str(q.scales.shape()) + " and " + shape_str(q.biases.shape()) + ".");
  }
}

void check_int8_group_size(const std::string& op, int group_size) {
  // A group's int32 sum of codes (< 256) times activations (|q| <= 127) is
  // exact up to 66,311 values per group: at most 65536 keeps every ISA's
  // sums exact (cpu/gemm_int8.h).
  if (group_size % 4 != 0 || group_size > 65536) {
    fail(op, "int8 activations need a weight group_size (exact int32 group sums) that is a "
             "multiple of 4 and at most 65536, got " + str(group_size) + ".");
  }
}

mx::array sparse_conv_features(const mx::array& feats, const mx::array& weight,
                               const RelationArrays& relation, mx::StreamOrDevice s) {
  const std::string op = "sparse_conv_features";
  auto stream = mx::to_stream(s);
  auto rel = validated_relation(op, relation);
  check_features(op, feats, *rel);
  check_weight(op, weight, rel->n_kernels, feats.shape(1));
  return mx::astype(make_conv(Conv::kForward, feats, weight, rel, stream), feats.dtype(), stream);
}

mx::array sparse_conv_features_sorted_implicit_gemm(const mx::array& feats,
                                                    const mx::array& weight,
                                                    const RelationArrays& relation,
                                                    const SortedArrays& view, bool store_sorted,
                                                    mx::StreamOrDevice s) {
  const std::string op = "sparse_conv_features_sorted_implicit_gemm";
  auto stream = mx::to_stream(s);
  auto rel = validated_relation(op, relation);
  check_features(op, feats, *rel);
  check_weight(op, weight, rel->n_kernels, feats.shape(1));
  auto sorted = validated_sorted_view(op, view, rel);
  return mx::astype(make_sorted(feats, weight, rel, sorted, store_sorted, stream), feats.dtype(),
                    stream);
}

mx::array sparse_quantized_conv_features(const mx::array& feats, const QuantizedArrays& q,
                                         const RelationArrays& relation, int act_bits,
                                         float act_scale, mx::StreamOrDevice s) {
  const std::string op = "sparse_quantized_conv_features";
  auto stream = mx::to_stream(s);
  auto rel = validated_relation(op, relation);
  check_features(op, feats, *rel);
  check_quantized_weight(op, q, rel->n_kernels, feats.shape(1));
  const int bits = q.bits;
  if (act_bits != 0 && act_bits != 8) {
    fail(op, "act_bits must be 0 (float activations) or 8, got " + str(act_bits) + ".");
  }
  if (act_bits == 8) check_int8_group_size(op, q.group_size);
  if (act_bits == 8 && stream.device == mx::Device::gpu) {
    fail(op, "act_bits=8 runs on the CPU stream only.");
  }
  if (!std::isfinite(act_scale) || act_scale < 0.0f) {
    fail(op, "act_scale must be a finite positive static activation scale (or 0: dynamic "
             "per-row scales), got " + num_str(act_scale) + ".");
  }
  if (act_scale != 0.0f && act_bits != 8) {
    fail(op, "act_scale (a static activation scale) needs act_bits=8.");
  }
  QuantSpec spec{q.in_channels, q.out_channels, q.storage_in_channels, q.group_size, bits,
                 act_bits, act_scale};
  return mx::astype(make_quantized(feats, {q.packed, q.scales, q.biases}, rel, spec, stream),
                    feats.dtype(), stream);
}

mx::array sparse_conv_normalization_denominator(const mx::array& weight,
                                                const RelationArrays& relation,
                                                mx::StreamOrDevice s) {
  const std::string op = "sparse_conv_normalization_denominator";
  auto stream = mx::to_stream(s);
  auto rel = validated_relation(op, relation);
  check_float_dtype(op.c_str(), "weight", weight);
  if (weight.ndim() != 3 || weight.shape(0) != rel->n_kernels || weight.shape(2) < 1) {
    fail(op, "weight must be the mapped (K, Cin, Cout) weight with K = " + str(rel->n_kernels) +
                 ", got shape " + shape_str(weight.shape()) + ".");
  }
  return mx::astype(
      make_denominator(SparseDenominator::Mode::kDenominator, weight, rel, stream),
      weight.dtype(), stream);
}

mx::array sparse_pool_features(const mx::array& feats, const RelationArrays& relation,
                               bool input_exclusive, const std::string& mode,
                               mx::StreamOrDevice s) {
  const std::string op = "sparse_pool_features";
  auto stream = mx::to_stream(s);
  kernels::PoolMode pool_mode;
  if (mode == "max") {
    pool_mode = kernels::PoolMode::kMax;
  } else if (mode == "avg") {
    pool_mode = kernels::PoolMode::kAvg;
  } else if (mode == "sum") {
    pool_mode = kernels::PoolMode::kSum;
  } else {
    fail(op, "mode must be 'max', 'avg' or 'sum', got '" + mode + "'.");
  }
  auto rel = validated_relation(op, relation);
  check_features(op, feats, *rel);
  if (input_exclusive) check_input_exclusive(op, rel);
  return mx::astype(make_pool(SparsePool::Stage::kForward, pool_mode, {feats}, rel, stream),
                    feats.dtype(), stream);
}

mx::array geometry_voxelize(const mx::array& feats, const mx::array& voxel_offsets,
                            const mx::array& voxel_points, const mx::array& point_to_voxel,
                            const std::string& reduce, mx::StreamOrDevice s) {
  const int mode = reduce_mode(reduce);
  check_table(kVoxelizeOp, "point_features", feats);
  auto idx = checked_grouping(voxel_offsets, voxel_points, point_to_voxel, feats.shape(0));
  auto stream = mx::to_stream(s);
  return mx::astype(make_voxelize(mode, feats, idx, stream)[0], feats.dtype(), stream);
}

mx::array geometry_devoxelize(const mx::array& voxel_features, const mx::array& rows,
                              const mx::array& weights, const mx::array& nearest,
                              const mx::array& voxel_offsets, const mx::array& voxel_entries,
                              bool nearest_mode, const std::string& out_dtype,
                              mx::StreamOrDevice s) {
  check_table(kDevoxelizeOp, "voxel_features", voxel_features);
  mx::Dtype dtype = voxel_features.dtype();
  if (out_dtype == "float32") {
    dtype = mx::float32;
  } else if (out_dtype == "float16") {
    dtype = mx::float16;
  } else if (out_dtype == "bfloat16") {
    dtype = mx::bfloat16;
  } else if (!out_dtype.empty()) {
    fail(kDevoxelizeOp,
         "dtype must be float32, float16 or bfloat16 (or none), got " + out_dtype + ".");
  }
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
  auto out = make_devoxelize(GeometryDevoxelize::kForward, nearest_mode, n_voxels, voxel_features,
                             index_inputs, stream, dtype);
  return out;
}

}  // namespace mlx_lattice
