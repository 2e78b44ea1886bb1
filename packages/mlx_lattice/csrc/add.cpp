// Elementwise sum of two same-shaped float arrays in their own dtype
// (FeatureAdd): graph builder with validation and the transforms. Each sum
// is the float32 sum of the two values rounded once to the dtype, which for
// float16 and bfloat16 is the correctly rounded IEEE sum (float32 carries
// more than 2p + 2 bits of either format, so the double rounding is
// innocuous). eval_cpu in cpu/add.cpp (F16C conversions of blocks), Metal
// kernels in metal/add.metal. MLX's own CPU float16 add runs element by
// element through a software half type, many times slower.
#include <stdexcept>
#include "cpu/input_error.h"
#include <string>

#include "primitives.h"

namespace mlx_lattice {

namespace {

std::string shape_of(const array& a) {
  std::string s = "(";
  for (int i = 0; i < static_cast<int>(a.ndim()); ++i) {
    s += (i ? ", " : "") + std::to_string(a.shape(i));
  }
  return s + (a.ndim() == 1 ? ",)" : ")");
}

bool float_dtype(mx::Dtype d) { return d == mx::float32 || d == mx::float16 || d == mx::bfloat16; }

}  // namespace

array feature_add(const array& a, const array& b, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (!float_dtype(a.dtype())) {
    throw ::mlx_lattice::InputError("feature_add: a must be float32, float16 or bfloat16.");
  }
  if (b.dtype() != a.dtype()) {
    throw ::mlx_lattice::InputError("feature_add: b must have a's dtype.");
  }
  if (a.shape() != b.shape()) {
    throw ::mlx_lattice::InputError("feature_add: b must have a's shape " + shape_of(a) + ", got " +
                                shape_of(b) + ".");
  }
  return array(a.shape(), a.dtype(), std::make_shared<FeatureAdd>(s),
               {mx::contiguous(a, false, s), mx::contiguous(b, false, s)});
}

std::vector<array> FeatureAdd::vjp(const std::vector<array>&, const std::vector<array>& cotangents,
                                   const std::vector<int>& argnums, const std::vector<array>&) {
  return std::vector<array>(argnums.size(), cotangents[0]);
}

std::vector<array> FeatureAdd::jvp(const std::vector<array>&, const std::vector<array>& tangents,
                                   const std::vector<int>&) {
  if (tangents.size() == 1) return {tangents[0]};
  return {feature_add(tangents[0], tangents[1], stream())};
}

std::pair<std::vector<array>, std::vector<int>> FeatureAdd::vmap(const std::vector<array>& inputs,
                                                                 const std::vector<int>& axes) {
  // The mapped axis to the front; an unmapped operand is broadcast along it.
  auto s = stream();
  const int n = axes[0] >= 0 ? inputs[0].shape(axes[0]) : inputs[1].shape(axes[1]);
  auto front = [&](const array& x, int axis) {
    if (axis >= 0) return mx::moveaxis(x, axis, 0, s);
    auto shape = x.shape();
    shape.insert(shape.begin(), n);
    return mx::broadcast_to(mx::expand_dims(x, 0, s), shape, s);
  };
  return {{feature_add(front(inputs[0], axes[0]), front(inputs[1], axes[1]), s)}, {0}};
}

}  // namespace mlx_lattice
