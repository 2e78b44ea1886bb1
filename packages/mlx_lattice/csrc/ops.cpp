// The public operations: argument checks, relation validation, graph build.
#include "ops.h"

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

}  // namespace

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
                                         mx::StreamOrDevice s) {
  const std::string op = "sparse_quantized_conv_features";
  auto stream = mx::to_stream(s);
  auto rel = validated_relation(op, relation);
  check_features(op, feats, *rel);
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
  if (feats.shape(1) != q.in_channels) {
    fail(op, "feats must have in_channels = " + str(q.in_channels) + " columns, got " +
                 str(feats.shape(1)) + ".");
  }
  const int k = static_cast<int>(rel->n_kernels);
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
  if (act_bits != 0 && act_bits != 8) {
    fail(op, "act_bits must be 0 (float activations) or 8, got " + str(act_bits) + ".");
  }
  if (act_bits == 8 && q.group_size % 4 != 0) {
    fail(op, "act_bits=8 needs a group_size that is a multiple of 4, got " +
                 str(q.group_size) + ".");
  }
  if (act_bits == 8 && stream.device == mx::Device::gpu) {
    fail(op, "act_bits=8 runs on the CPU stream only.");
  }
  QuantSpec spec{q.in_channels, q.out_channels, q.storage_in_channels, q.group_size, bits,
                 act_bits};
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

}  // namespace mlx_lattice
