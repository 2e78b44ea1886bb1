// sparse_quantized_conv_fused: argument checks, the graph node
// (SparseQuantizedConvFused) and its transforms (inference only: none).
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "ops.h"
#include "primitives.h"
#include "validate.h"

namespace mlx_lattice {

namespace {

constexpr const char* kFusedOp = "sparse_quantized_conv_fused";

void check_scale(const char* name, float v) {
  if (!std::isfinite(v) || v <= 0.0f) {
    fail(kFusedOp, std::string(name) + " must be a finite positive scale, got " + num_str(v) + ".");
  }
}

mx::Dtype float_out_dtype(const std::string& name, mx::Dtype feats) {
  if (name.empty()) return feats == mx::int8 ? mx::float32 : feats;
  if (name == "float32") return mx::float32;
  if (name == "float16") return mx::float16;
  if (name == "bfloat16") return mx::bfloat16;
  fail(kFusedOp, "out_dtype must be 'float32', 'float16' or 'bfloat16' (or 'int8' with "
                 "out_scale), got '" + name + "'.");
}

}  // namespace

mx::array sparse_quantized_conv_fused(const mx::array& feats, const QuantizedArrays& q,
                                      const RelationArrays& relation,
                                      const FusedEpilogueArgs& args, mx::StreamOrDevice s) {
  const std::string op = kFusedOp;
  auto stream = mx::to_stream(s);
  auto rel = validated_relation(op, relation);
  const bool int8_input = feats.dtype() == mx::int8;
  if (!int8_input) check_float_dtype(kFusedOp, "feats", feats);
  if (feats.ndim() != 2 || feats.shape(0) != rel->n_in) {
    fail(op, "feats must be (N_in, Cin) with the relation's N_in = " +
                 std::to_string(rel->n_in) + " rows, got shape " + shape_str(feats.shape()) +
                 ".");
  }
  check_quantized_weight(op, q, rel->n_kernels, feats.shape(1));
  check_int8_group_size(op, q.group_size);
  check_scale("in_scale", args.in_scale);
  const int64_t cout = q.out_channels;
  FusedSpec spec;
  spec.quant = {q.in_channels, q.out_channels, q.storage_in_channels, q.group_size, q.bits, 8,
                args.in_scale};
  spec.int8_input = int8_input;
  spec.relu = args.relu;
  std::vector<array> inputs = {
      int8_input ? as_rows(feats, mx::int8, stream)
                 : as_rows(feats, stream.device == mx::Device::gpu ? mx::float32 : feats.dtype(),
                           stream),
      mx::contiguous(q.packed, false, stream), as_rows(q.scales, mx::float32, stream),
      as_rows(q.biases, mx::float32, stream)};
  if (args.bias) {
    const auto& b = *args.bias;
    check_float_dtype(kFusedOp, "bias", b);
    if (b.ndim() != 1 || b.shape(0) != cout) {
      fail(op, "bias must be (Cout,) = (" + std::to_string(cout) + ",), got " +
                   shape_str(b.shape()) + ".");
    }
    spec.has_bias = true;
    inputs.push_back(as_rows(b, mx::float32, stream));
  }
  if (args.residual) {
    const auto& r = *args.residual;
    const bool r8 = r.dtype() == mx::int8;
    if (!r8) check_float_dtype(kFusedOp, "residual", r);
    if (r.ndim() != 2 || r.shape(0) != rel->n_out || r.shape(1) != cout) {
      fail(op, "residual must be (N_out, Cout) = (" + std::to_string(rel->n_out) + ", " +
                   std::to_string(cout) + "), got " + shape_str(r.shape()) + ".");
    }
    if (r8) {
      check_scale("residual_scale", args.residual_scale);
    } else if (args.residual_scale != 0.0f) {
      fail(op, "residual_scale applies to an int8 residual only; the residual is " +
                   dtype_str(r.dtype()) + ".");
    }
    spec.residual = r8 ? 2 : 1;
    spec.residual_scale = r8 ? args.residual_scale : 0.0f;
    inputs.push_back(as_rows(r, r8 ? mx::int8 : mx::float32, stream));
  } else if (args.residual_scale != 0.0f) {
    fail(op, "residual_scale was given without a residual.");
  }
  mx::Dtype out_dtype = mx::int8;
  if (args.out_scale != 0.0f) {
    check_scale("out_scale", args.out_scale);
    if (!args.out_dtype.empty() && args.out_dtype != "int8") {
      fail(op, "out_scale requantizes to int8; out_dtype must be 'int8' or None, got '" +
                   args.out_dtype + "'.");
    }
    spec.out_scale = args.out_scale;
  } else {
    if (args.out_dtype == "int8") fail(op, "out_dtype 'int8' needs an out_scale.");
    out_dtype = float_out_dtype(args.out_dtype, feats.dtype());
  }
  // The Metal kernel writes float32 (or int8): a half output is cast.
  const bool gpu = stream.device == mx::Device::gpu;
  const mx::Dtype node_dtype = gpu && out_dtype != mx::int8 ? mx::float32 : out_dtype;
  auto out = array({static_cast<int>(rel->n_out), static_cast<int>(cout)}, node_dtype,
                   std::make_shared<SparseQuantizedConvFused>(stream, rel, spec),
                   std::move(inputs));
  return node_dtype == out_dtype ? out : mx::astype(out, out_dtype, stream);
}

std::vector<array> SparseQuantizedConvFused::vjp(const std::vector<array>&,
                                                 const std::vector<array>&,
                                                 const std::vector<int>&,
                                                 const std::vector<array>&) {
  throw InputError(
      "SparseQuantizedConvFused: the fused static-int8 convolution is inference-only and has "
      "no gradient; differentiate the unfused layers (sparse_quantized_conv_features).");
}

std::vector<array> SparseQuantizedConvFused::jvp(const std::vector<array>&,
                                                 const std::vector<array>&,
                                                 const std::vector<int>&) {
  throw InputError(
      "SparseQuantizedConvFused: the fused static-int8 convolution is inference-only and has "
      "no tangent.");
}

std::pair<std::vector<array>, std::vector<int>> SparseQuantizedConvFused::vmap(
    const std::vector<array>&, const std::vector<int>&) {
  throw InputError(
      "SparseQuantizedConvFused: vmap is not supported (one relation per call); map over the "
      "scans in Python.");
}

bool SparseQuantizedConvFused::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const SparseQuantizedConvFused&>(other);
  return same_relation(o) && spec_ == o.spec_;
}

}  // namespace mlx_lattice
