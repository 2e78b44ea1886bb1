// bias_relu_add: y = relu(x + bias) + residual over (N, C) float32 rows in
// one pass (BiasReluAdd), the epilogue of a linear layer whose batch norm is
// folded into it and whose output a skip addition reads (SPVCNN's point
// branch: to_points(x) + relu(norm(linear(z)))), instead of a bias + ReLU
// pass and an add pass. Per element in float32, one rounding per operation
// in this order: v = x + bias; v = v < 0 ? +0 : v (NaN stays); v + residual
// (so the bits of mlx_lattice.fused.bias_relu followed by an add). CPU
// stream only (mlx_lattice.fused.bias_relu_add runs the two passes on other
// devices); inference only: no gradient, no vmap.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>

#include "common.h"
#include "mlx/primitives.h"
#include "cpu/eval.h"
#include "cpu/parallel.h"
#include "validate.h"

namespace mlx_lattice {

namespace nb = nanobind;
using array = mx::array;

namespace {

constexpr const char* kOp = "bias_relu_add";

class BiasReluAdd : public mx::UnaryPrimitive {
 public:
  BiasReluAdd(mx::Stream stream, bool relu) : mx::UnaryPrimitive(stream), relu_(relu) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>&, array&) override {
    fail(kOp, "runs on the CPU stream only (mlx_lattice.fused.bias_relu_add takes two passes "
              "elsewhere).");
  }
  const char* name() const override { return "BiasReluAdd"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return relu_ == static_cast<const BiasReluAdd&>(other).relu_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  bool relu_;
};

// Values per parallel task (whole rows): 128 KiB of x.
constexpr int64_t kChunkValues = 1 << 15;

// n values; branch-free so that the compiler vectorizes it (GCC only at
// -O3: a plain loop at -O2 ran at a third of MLX's add).
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("O3")))
#endif
void bias_relu_add_rows(const float* x, const float* b, const float* r, int64_t n, int64_t c,
                        bool relu, float* y) {
  for (int64_t row = 0; row < n * c; row += c) {
    if (relu) {
      for (int64_t j = 0; j < c; ++j) {
        const float v = x[row + j] + b[j];
        y[row + j] = (v < 0.0f ? 0.0f : v) + r[row + j];
      }
    } else {
      for (int64_t j = 0; j < c; ++j) y[row + j] = (x[row + j] + b[j]) + r[row + j];
    }
  }
}

void BiasReluAdd::eval_cpu(const std::vector<array>& inputs, array& out) {
  cpu::dispatch(stream(), inputs, out, [relu = relu_](std::vector<array>& in, array& o) {
    const int64_t n = o.shape(0), c = o.shape(1);
    if (n == 0 || c == 0) return;
    const float* x = in[0].data<float>();
    const float* b = in[1].data<float>();
    const float* r = in[2].data<float>();
    float* y = o.data<float>();
    const int64_t per = std::max<int64_t>(1, kChunkValues / c);
    parallel_for((n + per - 1) / per, [&](int64_t chunk) {
      const int64_t at = chunk * per * c;
      const int64_t rows = std::min(n, (chunk + 1) * per) - chunk * per;
      bias_relu_add_rows(x + at, b, r + at, rows, c, relu, y + at);
    });
  });
}

}  // namespace

array bias_relu_add(const array& x, const array& bias, const array& residual, bool relu,
                    mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (s.device != mx::Device::cpu) {
    fail(kOp, "runs on the CPU stream only (mlx_lattice.fused.bias_relu_add takes two passes "
              "elsewhere).");
  }
  if (x.dtype() != mx::float32 || x.ndim() != 2) {
    fail(kOp, "x must be (N, C) float32, got " + dtype_str(x.dtype()) + " " +
                  shape_str(x.shape()) + ".");
  }
  check_float_dtype(kOp, "bias", bias);
  if (bias.ndim() != 1 || bias.shape(0) != x.shape(1)) {
    fail(kOp, "bias must be (C,) = (" + std::to_string(x.shape(1)) + ",), got " +
                  shape_str(bias.shape()) + ".");
  }
  if (residual.dtype() != mx::float32 || residual.shape() != x.shape()) {
    fail(kOp, "residual must be float32 of x's shape " + shape_str(x.shape()) + ", got " +
                  dtype_str(residual.dtype()) + " " + shape_str(residual.shape()) + ".");
  }
  return array(x.shape(), mx::float32, std::make_shared<BiasReluAdd>(s, relu),
               {as_rows(x, mx::float32, s), as_rows(bias, mx::float32, s),
                as_rows(residual, mx::float32, s)});
}

void bind_bias_relu_add(nb::module_& m) {
  using namespace nb::literals;
  m.def(
      "bias_relu_add",
      [](const array& x, const array& bias, const array& residual, bool relu,
         mx::StreamOrDevice s) {
        nb::gil_scoped_release unlocked;
        return bias_relu_add(x, bias, residual, relu, s);
      },
      "x"_a, "bias"_a, "residual"_a, nb::kw_only(), "relu"_a = true, "stream"_a = nb::none(),
      R"pbdoc(
``relu(x + bias) + residual`` of (N, C) float32 rows, (C,) bias, in one pass
on the CPU stream; per element in float32, rounded after the sum, the ReLU
(``v < 0 -> 0``, NaN stays) and the second sum. Inference only.
)pbdoc");
}

}  // namespace mlx_lattice
