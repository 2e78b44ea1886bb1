// Training-mode batch norm (+ ReLU): graph builder with validation and the
// transforms of BatchNormTrain and BatchNormTrainGrad (eval_cpu in
// cpu/norm_eval.cpp over the kernels of cpu/norm.cpp; eval_gpu by the build
// choice of every primitive, metal/norm.cpp on Apple GPUs). The backward pass
// is its own primitive, so mx.grad of a network runs two reductions and one
// fused map per norm instead of MLX's elementwise chain; the statistics are
// float32 whatever the features' dtype.
#include <cmath>
#include "cpu/input_error.h"
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

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

array as_rows(const array& a, mx::Dtype dtype, mx::Stream s) {
  return mx::contiguous(a.dtype() == dtype ? a : mx::astype(a, dtype, s), false, s);
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
  for (auto [name, p] : {std::pair<const char*, const array*>{"weight", &weight},
                         std::pair<const char*, const array*>{"bias", &bias}}) {
    if (p->ndim() != 1 || p->shape(0) != c) {
      throw ::mlx_lattice::InputError("batch_norm_train: " + std::string(name) + " must be (" +
                                  std::to_string(c) + ",), got shape " + shape_str(*p) + ".");
    }
    if (!float_dtype(p->dtype())) {
      throw ::mlx_lattice::InputError("batch_norm_train: " + std::string(name) +
                                  " must be float32, float16 or bfloat16.");
    }
  }
  if (!(eps >= 0.0f) || !std::isfinite(eps)) {
    throw ::mlx_lattice::InputError("batch_norm_train: eps must be finite and >= 0.");
  }
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

}  // namespace mlx_lattice
