// Batch norm (+ ReLU) graph code. Training mode: the builder with validation
// and the transforms of BatchNormTrain and BatchNormTrainGrad (eval_cpu in
// cpu/norm_eval.cpp over the kernels of cpu/norm.cpp; eval_gpu by the build
// choice of every primitive, metal/norm.cpp on Apple GPUs). The backward pass
// is its own primitive, so mx.grad of a network runs two reductions and one
// fused map per norm instead of MLX's elementwise chain; the statistics are
// float32 whatever the features' dtype. Eval mode (running statistics):
// BatchNormEval, one fused map in the features' own dtype instead of MLX's
// elementwise chain (and, for half-precision features, its casts).
#include <cmath>
#include "cpu/input_error.h"
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "common.h"
#include "primitives.h"

namespace mlx_lattice {

namespace {

std::string shape_str(const array& a) {
  std::string s = "(";
  for (int i = 0; i < static_cast<int>(a.ndim()); ++i) {
    s += (i ? ", " : "") + std::to_string(a.shape(i));
  }
  return s + (a.ndim() == 1 ? ",)" : ")");
}

bool float_dtype(mx::Dtype d) { return d == mx::float32 || d == mx::float16 || d == mx::bfloat16; }

// A per-channel parameter `name` of `fn`: (c,) and a float dtype.
void check_channels(const char* fn, const char* name, const array& p, int c) {
  if (p.ndim() != 1 || p.shape(0) != c) {
    throw ::mlx_lattice::InputError(std::string(fn) + ": " + name + " must be (" +
                                    std::to_string(c) + ",), got shape " + shape_str(p) + ".");
  }
  if (!float_dtype(p.dtype())) {
    throw ::mlx_lattice::InputError(std::string(fn) + ": " + name +
                                    " must be float32, float16 or bfloat16.");
  }
}

void check_eps(const char* fn, float eps) {
  if (!(eps >= 0.0f) || !std::isfinite(eps)) {
    throw ::mlx_lattice::InputError(std::string(fn) + ": eps must be finite and >= 0.");
  }
}

}  // namespace

std::vector<array> batch_norm_train(const array& x, const array& weight, const array& bias,
                                    float eps, bool relu, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (x.ndim() != 2 || x.shape(0) < 1) {
    throw ::mlx_lattice::InputError("batch_norm_train: x must be (N, C) with N >= 1, got shape " +
                                shape_str(x) + ".");
  }
  if (!float_dtype(x.dtype())) {
    throw ::mlx_lattice::InputError(
        "batch_norm_train: x must be float32, float16 or bfloat16.");
  }
  const int c = x.shape(1);
  check_channels("batch_norm_train", "weight", weight, c);
  check_channels("batch_norm_train", "bias", bias, c);
  check_eps("batch_norm_train", eps);
  const int n = x.shape(0);
  return array::make_arrays(
      {{n, c}, {c}, {c}}, {x.dtype(), mx::float32, mx::float32},
      std::make_shared<BatchNormTrain>(s, eps, relu),
      {as_rows(x, x.dtype(), s), as_rows(weight, mx::float32, s), as_rows(bias, mx::float32, s)});
}

// ------------------------------------------------------------ BatchNormTrain

std::vector<mx::Shape> BatchNormTrain::output_shapes(const std::vector<array>& inputs) {
  const int c = inputs[0].shape(1);
  return {inputs[0].shape(), {c}, {c}};
}

std::vector<array> BatchNormTrain::vjp(const std::vector<array>& primals,
                                       const std::vector<array>& cotangents,
                                       const std::vector<int>& argnums,
                                       const std::vector<array>& outputs) {
  auto s = stream();
  const auto& x = primals[0];
  const int n = x.shape(0), c = x.shape(1);
  auto grads = array::make_arrays(
      {{n, c}, {c}, {c}}, {x.dtype(), mx::float32, mx::float32},
      std::make_shared<BatchNormTrainGrad>(s, eps_, relu_),
      {as_rows(cotangents[0], x.dtype(), s), x, outputs[0], primals[1], outputs[1], outputs[2]});
  std::vector<array> out;
  for (int arg : argnums) {
    out.push_back(mx::astype(grads[arg], primals[arg].dtype(), s));
  }
  return out;
}

std::vector<array> BatchNormTrain::jvp(const std::vector<array>&, const std::vector<array>&,
                                       const std::vector<int>&) {
  throw ::mlx_lattice::InputError(
      "BatchNormTrain (batch_norm_train): jvp is not supported; use mx.vjp / mx.grad, or "
      "mlx.nn.BatchNorm for forward-mode derivatives.");
}

std::pair<std::vector<array>, std::vector<int>> BatchNormTrain::vmap(const std::vector<array>&,
                                                                     const std::vector<int>&) {
  throw ::mlx_lattice::InputError(
      "BatchNormTrain (batch_norm_train): vmap is not supported; normalize each (N, C) item "
      "separately.");
}

// -------------------------------------------------------- BatchNormTrainGrad

std::vector<mx::Shape> BatchNormTrainGrad::output_shapes(const std::vector<array>& inputs) {
  const int c = inputs[1].shape(1);
  return {inputs[1].shape(), {c}, {c}};
}

std::vector<array> BatchNormTrainGrad::vjp(const std::vector<array>&, const std::vector<array>&,
                                           const std::vector<int>&, const std::vector<array>&) {
  throw ::mlx_lattice::InputError(
      "BatchNormTrainGrad (the batch_norm_train gradient): second derivatives are not "
      "supported; use mlx.nn.BatchNorm for higher-order gradients.");
}

std::vector<array> BatchNormTrainGrad::jvp(const std::vector<array>&, const std::vector<array>&,
                                           const std::vector<int>&) {
  throw ::mlx_lattice::InputError(
      "BatchNormTrainGrad (the batch_norm_train gradient): jvp is not supported.");
}

std::pair<std::vector<array>, std::vector<int>> BatchNormTrainGrad::vmap(
    const std::vector<array>&, const std::vector<int>&) {
  throw ::mlx_lattice::InputError(
      "BatchNormTrainGrad (the batch_norm_train gradient): vmap is not supported.");
}

// ------------------------------------------------------------ BatchNormEval

array batch_norm_eval(const array& x, const array& mean, const array& var,
                      const std::optional<array>& weight, const std::optional<array>& bias,
                      float eps, bool relu, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (x.ndim() != 2) {
    throw ::mlx_lattice::InputError("batch_norm_eval: x must be (N, C), got shape " +
                                    shape_str(x) + ".");
  }
  if (!float_dtype(x.dtype())) {
    throw ::mlx_lattice::InputError("batch_norm_eval: x must be float32, float16 or bfloat16.");
  }
  const int c = x.shape(1);
  check_channels("batch_norm_eval", "mean", mean, c);
  check_channels("batch_norm_eval", "var", var, c);
  if (weight) check_channels("batch_norm_eval", "weight", *weight, c);
  if (bias) check_channels("batch_norm_eval", "bias", *bias, c);
  check_eps("batch_norm_eval", eps);
  // scale = weight * rsqrt(var + eps), as mlx.nn.BatchNorm forms its factors.
  array scale = mx::rsqrt(mx::add(mx::astype(var, mx::float32, s), array(eps), s), s);
  if (weight) scale = mx::multiply(mx::astype(*weight, mx::float32, s), scale, s);
  // as_rows: the kernel reads c values of each (mx::zeros is a broadcast).
  array shift = as_rows(bias ? *bias : mx::zeros({c}, mx::float32, s), mx::float32, s);
  return array(x.shape(), x.dtype(), std::make_shared<BatchNormEval>(s, relu),
               {mx::contiguous(x, false, s), as_rows(mean, mx::float32, s),
                mx::contiguous(scale, false, s), shift});
}

namespace {

// The float32 cotangent or tangent g passed where y > 0 (with the ReLU).
array relu_masked(const array& g, const array& y, bool relu, mx::Stream s) {
  if (!relu) return g;
  const auto pass = mx::greater(mx::astype(y, mx::float32, s), array(0.0f), s);
  return mx::where(pass, g, array(0.0f), s);
}

}  // namespace

// inputs {x, mean, scale, bias}: dy/dx = scale, dy/dmean = -scale,
// dy/dscale = x - mean, dy/dbias = 1 (masked by the ReLU), in float32.
std::vector<array> BatchNormEval::vjp(const std::vector<array>& primals,
                                      const std::vector<array>& cotangents,
                                      const std::vector<int>& argnums,
                                      const std::vector<array>& outputs) {
  auto s = stream();
  const auto& x = primals[0];
  const auto& scale = primals[2];
  const array g =
      relu_masked(mx::astype(cotangents[0], mx::float32, s), outputs[0], relu_, s);
  std::vector<array> out;
  for (int arg : argnums) {
    if (arg == 0) {
      out.push_back(mx::astype(mx::multiply(g, scale, s), x.dtype(), s));
    } else if (arg == 1) {
      out.push_back(mx::negative(mx::multiply(mx::sum(g, 0, false, s), scale, s), s));
    } else if (arg == 2) {
      const auto centred = mx::subtract(mx::astype(x, mx::float32, s), primals[1], s);
      out.push_back(mx::sum(mx::multiply(g, centred, s), 0, false, s));
    } else {
      out.push_back(mx::sum(g, 0, false, s));
    }
  }
  return out;
}

std::vector<array> BatchNormEval::jvp(const std::vector<array>& primals,
                                      const std::vector<array>& tangents,
                                      const std::vector<int>& argnums) {
  auto s = stream();
  const auto& x = primals[0];
  const auto& scale = primals[2];
  std::optional<array> dy;
  for (size_t i = 0; i < argnums.size(); ++i) {
    const array t = mx::astype(tangents[i], mx::float32, s);
    array term = t;
    if (argnums[i] == 0) {
      term = mx::multiply(t, scale, s);
    } else if (argnums[i] == 1) {
      term = mx::negative(mx::multiply(t, scale, s), s);
    } else if (argnums[i] == 2) {
      term = mx::multiply(mx::subtract(mx::astype(x, mx::float32, s), primals[1], s), t, s);
    }
    dy = dy ? mx::add(*dy, term, s) : term;
  }
  if (!dy) return {mx::zeros_like(x, s)};  // no tangent given
  const array y(x.shape(), x.dtype(), std::make_shared<BatchNormEval>(s, relu_), primals);
  const array full = mx::broadcast_to(*dy, x.shape(), s);
  return {mx::astype(relu_masked(full, y, relu_, s), x.dtype(), s)};
}

std::pair<std::vector<array>, std::vector<int>> BatchNormEval::vmap(const std::vector<array>&,
                                                                    const std::vector<int>&) {
  throw ::mlx_lattice::InputError(
      "BatchNormEval (batch_norm_eval): vmap is not supported; normalize each (N, C) item "
      "separately.");
}

}  // namespace mlx_lattice
