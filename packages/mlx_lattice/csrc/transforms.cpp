// Graph builders of the primitives and their transforms (vjp, jvp, vmap).
//
// A bilinear convolution's gradients are convolutions with the roles of the
// operands exchanged, so every order of differentiation works. vmap runs
// one primitive per slice of the mapped axis (relations are per call, and
// the slices share it) and stacks the results on axis 0.
#include <optional>
#include "cpu/input_error.h"
#include <stdexcept>

#include "common.h"
#include "primitives.h"

namespace mlx_lattice {

namespace {

using Conv = SparseConv::Mode;

// Floating operands share the dtype of the primitive's first operand and are
// made row-contiguous; the Metal kernels compute in float32.
array as_dtype(const array& a, mx::Dtype dtype, mx::Stream s) {
  return as_rows(a, s.device == mx::Device::gpu ? mx::float32 : dtype, s);
}

mx::Dtype compute_dtype(mx::Dtype dtype, mx::Stream s) {
  return s.device == mx::Device::gpu ? mx::float32 : dtype;
}

int rows(int64_t n) { return static_cast<int>(n); }

std::optional<array> tangent_of(int arg, const std::vector<array>& tangents,
                                const std::vector<int>& argnums) {
  for (size_t i = 0; i < argnums.size(); ++i) {
    if (argnums[i] == arg) return tangents[i];
  }
  return std::nullopt;
}

// The jvp of a bilinear op(a, b): op(ta, b) + op(a, tb) over the tangents given.
template <typename Op>
std::vector<array> bilinear_jvp(Op op, const std::vector<array>& primals,
                                const std::vector<array>& tangents,
                                const std::vector<int>& argnums, mx::Stream s) {
  auto ta = tangent_of(0, tangents, argnums);
  auto tb = tangent_of(1, tangents, argnums);
  std::optional<array> sum;
  if (ta) sum = op(*ta, primals[1]);
  if (tb) sum = sum ? mx::add(*sum, op(primals[0], *tb), s) : op(primals[0], *tb);
  if (!sum) return {mx::zeros_like(op(primals[0], primals[1]), s)};
  return {*sum};
}

// vmap by slices: `build` rebuilds the primitive on one slice of the inputs.
template <typename Build>
std::pair<std::vector<array>, std::vector<int>> vmap_by_slices(const std::vector<array>& inputs,
                                                               const std::vector<int>& axes,
                                                               Build build, mx::Stream s) {
  int batch = -1;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (axes[i] >= 0) batch = inputs[i].shape(axes[i]);
  }
  if (batch < 0) return {{build(inputs)}, {-1}};
  if (batch == 0) {
    // An empty map: one slice's result shape (graph only, never evaluated)
    // behind a leading 0.
    std::vector<array> one;
    for (size_t i = 0; i < inputs.size(); ++i) {
      auto shape = inputs[i].shape();
      if (axes[i] >= 0) shape.erase(shape.begin() + axes[i]);
      one.push_back(axes[i] >= 0 ? mx::zeros(shape, inputs[i].dtype(), s) : inputs[i]);
    }
    auto slice = build(one);
    auto shape = slice.shape();
    shape.insert(shape.begin(), 0);
    return {{mx::zeros(shape, slice.dtype(), s)}, {0}};
  }
  std::vector<array> outs;
  for (int b = 0; b < batch; ++b) {
    std::vector<array> slice;
    for (size_t i = 0; i < inputs.size(); ++i) {
      slice.push_back(axes[i] >= 0 ? mx::take(inputs[i], b, axes[i], s) : inputs[i]);
    }
    outs.push_back(build(slice));
  }
  return {{mx::stack(outs, 0, s)}, {0}};
}

}  // namespace

// ------------------------------------------------------------ graph builders

namespace {

// Mixed precision: a float32 weight beside half-precision features stays
// float32 (no MLX cast; the CPU kernels round it to the features' dtype as
// they read it), and the weight gradient comes out in the weight's dtype.
// Every other operand takes the dtype of the first.
mx::Dtype weight_operand_dtype(const array& feats, const array& weight) {
  return weight.dtype() == mx::float32 ? mx::float32 : feats.dtype();
}

array build_conv(Conv mode, const array& a, const array& b, const RelationPtr& rel,
                 mx::Dtype out_dtype, mx::Stream s) {
  if (mode == Conv::kInputGrad) check_input_offsets_distinct("SparseConv", rel);
  mx::Shape shape;
  switch (mode) {
    case Conv::kForward:
      shape = {rows(rel->n_out), b.shape(2)};
      break;
    case Conv::kInputGrad:
      shape = {rows(rel->n_in), b.shape(1)};
      break;
    case Conv::kWeightGrad:
      shape = {rows(rel->n_kernels), a.shape(1), b.shape(1)};
      break;
  }
  const auto b_dtype = mode == Conv::kWeightGrad ? a.dtype() : weight_operand_dtype(a, b);
  return array(shape, compute_dtype(out_dtype, s), std::make_shared<SparseConv>(s, rel, mode),
               {as_dtype(a, a.dtype(), s), as_dtype(b, b_dtype, s)});
}

// The weight gradient (F, G) -> dW in the weight's dtype.
array weight_grad(const array& f, const array& g, const array& weight, const RelationPtr& rel,
                  mx::Stream s) {
  return build_conv(Conv::kWeightGrad, f, g, rel, weight.dtype(), s);
}

}  // namespace

array make_conv(Conv mode, const array& a, const array& b, const RelationPtr& rel, mx::Stream s) {
  return build_conv(mode, a, b, rel, a.dtype(), s);
}

array make_sorted(const array& f, const array& w, const RelationPtr& rel, const SortedPtr& view,
                  bool store_sorted, mx::Stream s) {
  return array({rows(rel->n_out), w.shape(2)}, compute_dtype(f.dtype(), s),
               std::make_shared<SparseConvSorted>(s, rel, view, store_sorted),
               {as_dtype(f, f.dtype(), s), as_dtype(w, f.dtype(), s)});
}

array make_quantized(const array& f, const std::vector<array>& quant, const RelationPtr& rel,
                     QuantSpec spec, mx::Stream s) {
  return array({rows(rel->n_out), static_cast<int>(spec.out_channels)},
               compute_dtype(f.dtype(), s), std::make_shared<SparseQuantizedConv>(s, rel, spec),
               {as_dtype(f, f.dtype(), s), mx::contiguous(quant[0], false, s),
                as_dtype(quant[1], mx::float32, s), as_dtype(quant[2], mx::float32, s)});
}

array make_denominator(SparseDenominator::Mode mode, const array& x, const RelationPtr& rel,
                       mx::Stream s) {
  mx::Shape shape = mode == SparseDenominator::Mode::kDenominator
                        ? mx::Shape{rows(rel->n_out), x.shape(2)}
                        : mx::Shape{rows(rel->n_kernels), x.shape(1)};
  return array(shape, compute_dtype(x.dtype(), s),
               std::make_shared<SparseDenominator>(s, rel, mode), {as_dtype(x, x.dtype(), s)});
}

array make_pool(SparsePool::Stage stage, kernels::PoolMode mode, const std::vector<array>& floats,
                const RelationPtr& rel, mx::Stream s) {
  const int64_t n = stage == SparsePool::Stage::kBackward ? rel->n_in : rel->n_out;
  std::vector<array> inputs;
  for (auto& f : floats) inputs.push_back(as_dtype(f, floats[0].dtype(), s));
  return array({rows(n), floats[0].shape(1)}, compute_dtype(floats[0].dtype(), s),
               std::make_shared<SparsePool>(s, rel, stage, mode), inputs);
}

// ---------------------------------------------------------------- SparseConv

std::vector<array> SparseConv::vjp(const std::vector<array>& primals,
                                   const std::vector<array>& cotangents,
                                   const std::vector<int>& argnums, const std::vector<array>&) {
  const auto& a = primals[0];
  const auto& b = primals[1];
  const auto& ct = cotangents[0];
  auto s = stream();
  std::vector<array> grads;
  for (int arg : argnums) {
    switch (mode_) {
      case Conv::kForward:  // (F, W)
        grads.push_back(arg == 0 ? make_conv(Conv::kInputGrad, ct, b, rel_, s)
                                 : weight_grad(a, ct, b, rel_, s));
        break;
      case Conv::kInputGrad:  // (G, W)
        grads.push_back(arg == 0 ? make_conv(Conv::kForward, ct, b, rel_, s)
                                 : weight_grad(ct, a, b, rel_, s));
        break;
      case Conv::kWeightGrad:  // (F, G)
        grads.push_back(arg == 0 ? make_conv(Conv::kInputGrad, b, ct, rel_, s)
                                 : make_conv(Conv::kForward, a, ct, rel_, s));
        break;
    }
  }
  return grads;
}

std::vector<array> SparseConv::jvp(const std::vector<array>& primals,
                                   const std::vector<array>& tangents,
                                   const std::vector<int>& argnums) {
  auto op = [&](const array& a, const array& b) { return make_conv(mode_, a, b, rel_, stream()); };
  return bilinear_jvp(op, primals, tangents, argnums, stream());
}

std::pair<std::vector<array>, std::vector<int>> SparseConv::vmap(const std::vector<array>& inputs,
                                                                 const std::vector<int>& axes) {
  auto build = [&](const std::vector<array>& in) {
    return make_conv(mode_, in[0], in[1], rel_, stream());
  };
  return vmap_by_slices(inputs, axes, build, stream());
}

bool SparseConv::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const SparseConv&>(other);
  return mode_ == o.mode_ && same_relation(o);
}

// ---------------------------------------------------------- SparseConvSorted

std::vector<array> SparseConvSorted::vjp(const std::vector<array>& primals,
                                         const std::vector<array>& cotangents,
                                         const std::vector<int>& argnums,
                                         const std::vector<array>&) {
  auto s = stream();
  array ct = cotangents[0];
  if (store_sorted_) {
    // Row r of a sorted result is output row reorder_rows[r].
    ct = mx::take(ct, mx::argsort(view_->reorder, s), 0, s);
  }
  std::vector<array> grads;
  for (int arg : argnums) {
    grads.push_back(arg == 0 ? make_conv(Conv::kInputGrad, ct, primals[1], rel_, s)
                             : weight_grad(primals[0], ct, primals[1], rel_, s));
  }
  return grads;
}

std::vector<array> SparseConvSorted::jvp(const std::vector<array>& primals,
                                         const std::vector<array>& tangents,
                                         const std::vector<int>& argnums) {
  auto op = [&](const array& f, const array& w) {
    return make_sorted(f, w, rel_, view_, store_sorted_, stream());
  };
  return bilinear_jvp(op, primals, tangents, argnums, stream());
}

std::pair<std::vector<array>, std::vector<int>> SparseConvSorted::vmap(
    const std::vector<array>& inputs, const std::vector<int>& axes) {
  auto build = [&](const std::vector<array>& in) {
    return make_sorted(in[0], in[1], rel_, view_, store_sorted_, stream());
  };
  return vmap_by_slices(inputs, axes, build, stream());
}

bool SparseConvSorted::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const SparseConvSorted&>(other);
  return same_relation(o) && view_ == o.view_ && store_sorted_ == o.store_sorted_;
}

// ------------------------------------------------------- SparseQuantizedConv

std::vector<array> SparseQuantizedConv::vjp(const std::vector<array>& primals,
                                            const std::vector<array>& cotangents,
                                            const std::vector<int>& argnums,
                                            const std::vector<array>&) {
  auto s = stream();
  std::vector<array> grads;
  for (int arg : argnums) {
    if (arg != 0) {
      throw ::mlx_lattice::InputError(
          "SparseQuantizedConv: gradients with respect to the quantized weight, scales or "
          "biases are not supported; differentiate with respect to the features.");
    }
    auto w = mx::dequantize(primals[1], primals[2], primals[3], spec_.group_size, spec_.bits,
                            "affine", std::nullopt, mx::float32, s);
    w = mx::slice(w, {0, 0, 0},
                  {rows(rel_->n_kernels), static_cast<int>(spec_.out_channels),
                   static_cast<int>(spec_.in_channels)},
                  s);
    grads.push_back(
        make_conv(Conv::kInputGrad, cotangents[0], mx::transpose(w, {0, 2, 1}, s), rel_, s));
  }
  return grads;
}

std::vector<array> SparseQuantizedConv::jvp(const std::vector<array>& primals,
                                            const std::vector<array>& tangents,
                                            const std::vector<int>& argnums) {
  for (int arg : argnums) {
    if (arg != 0) {
      throw ::mlx_lattice::InputError(
          "SparseQuantizedConv: tangents of the quantized weight, scales or biases are not "
          "supported.");
    }
  }
  auto tf = tangent_of(0, tangents, argnums);
  std::vector<array> quant = {primals[1], primals[2], primals[3]};
  // Quantized activations: the tangent of the float-activation convolution
  // (straight-through, as the vjp).
  QuantSpec linear = spec_;
  linear.act_bits = 0;
  linear.act_scale = 0.0f;
  auto out = make_quantized(tf ? *tf : primals[0], quant, rel_, linear, stream());
  return {tf ? out : mx::zeros_like(out, stream())};
}

std::pair<std::vector<array>, std::vector<int>> SparseQuantizedConv::vmap(
    const std::vector<array>& inputs, const std::vector<int>& axes) {
  auto build = [&](const std::vector<array>& in) {
    return make_quantized(in[0], {in[1], in[2], in[3]}, rel_, spec_, stream());
  };
  return vmap_by_slices(inputs, axes, build, stream());
}

bool SparseQuantizedConv::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const SparseQuantizedConv&>(other);
  return same_relation(o) && spec_ == o.spec_;
}

// --------------------------------------------------------- SparseDenominator

std::vector<array> SparseDenominator::vjp(const std::vector<array>& primals,
                                          const std::vector<array>& cotangents,
                                          const std::vector<int>& argnums,
                                          const std::vector<array>&) {
  auto s = stream();
  const auto& ct = cotangents[0];
  if (mode_ == Mode::kDenominator) {
    // d/dW[k, c, n] = sum over edges of k of ct[out_e, n], for every c.
    auto per_kernel = make_denominator(Mode::kGradient, ct, rel_, s);
    return {mx::broadcast_to(mx::expand_dims(per_kernel, 1, s), primals[0].shape(), s)};
  }
  return {make_denominator(Mode::kDenominator, mx::expand_dims(ct, 1, s), rel_, s)};
}

std::vector<array> SparseDenominator::jvp(const std::vector<array>& primals,
                                          const std::vector<array>& tangents,
                                          const std::vector<int>& argnums) {
  auto t = tangent_of(0, tangents, argnums);
  auto out = make_denominator(mode_, t ? *t : primals[0], rel_, stream());
  return {t ? out : mx::zeros_like(out, stream())};
}

std::pair<std::vector<array>, std::vector<int>> SparseDenominator::vmap(
    const std::vector<array>& inputs, const std::vector<int>& axes) {
  auto build = [&](const std::vector<array>& in) {
    return make_denominator(mode_, in[0], rel_, stream());
  };
  return vmap_by_slices(inputs, axes, build, stream());
}

bool SparseDenominator::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const SparseDenominator&>(other);
  return mode_ == o.mode_ && same_relation(o);
}

// ---------------------------------------------------------------- SparsePool

std::vector<array> SparsePool::vjp(const std::vector<array>& primals,
                                   const std::vector<array>& cotangents,
                                   const std::vector<int>& argnums, const std::vector<array>&) {
  auto s = stream();
  using kernels::PoolMode;
  const auto& ct = cotangents[0];
  std::vector<array> grads;
  for (int arg : argnums) {
    if (stage_ == Stage::kForward) {
      grads.push_back(make_pool(Stage::kBackward, mode_, {ct, primals[0]}, rel_, s));
    } else if (stage_ == Stage::kMaxSelect) {
      grads.push_back(arg == 0 ? mx::zeros_like(primals[0], s)
                               : make_pool(Stage::kBackward, PoolMode::kMax, {ct, primals[0]},
                                           rel_, s));
    } else if (arg == 1) {
      grads.push_back(mx::zeros_like(primals[1], s));
    } else if (mode_ == PoolMode::kMax) {
      grads.push_back(make_pool(Stage::kMaxSelect, mode_, {primals[1], ct}, rel_, s));
    } else {
      grads.push_back(make_pool(Stage::kForward, mode_, {ct}, rel_, s));
    }
  }
  return grads;
}

std::vector<array> SparsePool::jvp(const std::vector<array>& primals,
                                   const std::vector<array>& tangents,
                                   const std::vector<int>& argnums) {
  auto s = stream();
  using kernels::PoolMode;
  std::optional<array> out;
  if (stage_ == Stage::kForward) {
    if (auto t = tangent_of(0, tangents, argnums)) {
      out = mode_ == PoolMode::kMax ? make_pool(Stage::kMaxSelect, mode_, {primals[0], *t}, rel_, s)
                                    : make_pool(Stage::kForward, mode_, {*t}, rel_, s);
    }
  } else if (stage_ == Stage::kMaxSelect) {
    if (auto t = tangent_of(1, tangents, argnums)) {
      out = make_pool(Stage::kMaxSelect, mode_, {primals[0], *t}, rel_, s);
    }
  } else if (auto t = tangent_of(0, tangents, argnums)) {
    out = make_pool(Stage::kBackward, mode_, {*t, primals[1]}, rel_, s);
  }
  if (!out) return {mx::zeros_like(make_pool(stage_, mode_, primals, rel_, s), s)};
  return {*out};
}

std::pair<std::vector<array>, std::vector<int>> SparsePool::vmap(const std::vector<array>& inputs,
                                                                 const std::vector<int>& axes) {
  auto build = [&](const std::vector<array>& in) {
    return make_pool(stage_, mode_, in, rel_, stream());
  };
  return vmap_by_slices(inputs, axes, build, stream());
}

bool SparsePool::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const SparsePool&>(other);
  return stage_ == o.stage_ && mode_ == o.mode_ && same_relation(o);
}

}  // namespace mlx_lattice
