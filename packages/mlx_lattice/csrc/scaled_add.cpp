#include "scaled_add.h"

#include <sstream>
#include <stdexcept>

#include "common.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_lattice {

namespace {

template <typename T>
void scaled_add_kernel(const T* x, const T* y, T* out, size_t n, float alpha, float beta) {
  for (size_t i = 0; i < n; ++i) {
    out[i] = static_cast<T>(alpha * static_cast<float>(x[i]) + beta * static_cast<float>(y[i]));
  }
}

}  // namespace

mx::array scaled_add(const mx::array& x, const mx::array& y, float alpha, float beta,
                     mx::StreamOrDevice s) {
  if (x.shape() != y.shape()) {
    std::ostringstream msg;
    msg << "scaled_add: x and y must have the same shape, got x " << shape_str(x.shape())
        << " and y " << shape_str(y.shape()) << ".";
    throw std::invalid_argument(msg.str());
  }
  check_float_dtype("scaled_add", "x", x);
  if (y.dtype() != x.dtype()) {
    throw std::invalid_argument("scaled_add: y must have the dtype of x, got " +
                                dtype_str(y.dtype()) + " and " + dtype_str(x.dtype()) + ".");
  }
  auto stream = mx::to_stream(s);
  return mx::array(x.shape(), x.dtype(), std::make_shared<ScaledAdd>(stream, alpha, beta),
                   {mx::contiguous(x, false, stream), mx::contiguous(y, false, stream)});
}

void ScaledAdd::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& y = inputs[1];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(y);
  encoder.set_output_array(out);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(x), y = mx::array::unsafe_weak_copy(y),
                    out = mx::array::unsafe_weak_copy(out), alpha = alpha_,
                    beta = beta_]() mutable {
    dispatch_float(out.dtype(), [&]<typename T>() {
      scaled_add_kernel<T>(x.data<T>(), y.data<T>(), out.data<T>(), out.size(), alpha, beta);
    });
  });
}

void ScaledAdd::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw_no_gpu(name());
}

std::vector<mx::array> ScaledAdd::jvp(const std::vector<mx::array>& primals,
                                      const std::vector<mx::array>& tangents,
                                      const std::vector<int>& argnums) {
  // d(out) = alpha * dx + beta * dy, over the arguments that carry tangents.
  auto zero = mx::zeros_like(primals[0], stream());
  mx::array dx = zero, dy = zero;
  for (size_t i = 0; i < argnums.size(); ++i) {
    (argnums[i] == 0 ? dx : dy) = tangents[i];
  }
  return {scaled_add(dx, dy, alpha_, beta_, stream())};
}

std::vector<mx::array> ScaledAdd::vjp(const std::vector<mx::array>&,
                                      const std::vector<mx::array>& cotangents,
                                      const std::vector<int>& argnums,
                                      const std::vector<mx::array>&) {
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    float scale = arg == 0 ? alpha_ : beta_;
    grads.push_back(mx::multiply(cotangents[0], mx::array(scale, cotangents[0].dtype()), stream()));
  }
  return grads;
}

std::pair<std::vector<mx::array>, std::vector<int>> ScaledAdd::vmap(
    const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
  // Elementwise: align the mapped axes at 0 and apply.
  auto x = axes[0] >= 0 ? mx::moveaxis(inputs[0], axes[0], 0, stream()) : inputs[0];
  auto y = axes[1] >= 0 ? mx::moveaxis(inputs[1], axes[1], 0, stream()) : inputs[1];
  if (axes[0] < 0) x = mx::broadcast_to(x, y.shape(), stream());
  if (axes[1] < 0) y = mx::broadcast_to(y, x.shape(), stream());
  return {{scaled_add(x, y, alpha_, beta_, stream())}, {0}};
}

bool ScaledAdd::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const ScaledAdd&>(other);
  return alpha_ == o.alpha_ && beta_ == o.beta_;
}

}  // namespace mlx_lattice
