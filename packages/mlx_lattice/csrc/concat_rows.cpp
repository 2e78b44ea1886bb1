// concat_rows: the rows of two (N, Ca) and (N, Cb) arrays of one dtype
// joined side by side, out[i] = [a[i], b[i]] (N, Ca + Cb) (ConcatRows): the
// U-Net decoder's concatenation of a skip and an upsampled tensor. MLX's CPU
// concatenate copies element by element on one thread; this copies each
// row's two runs of bytes, in tasks of rows over the extension's thread pool,
// into an output from the active activation arena (cpu/eval.h). Any dtype:
// the bytes are copied, never converted, so the result is MLX's
// concatenate's, bit for bit. Graph builder, transforms and CPU evaluation in
// this file. Other streams get mx::concatenate (the builder chooses it), so
// eval_gpu is never reached through concat_rows. Differentiable (the
// cotangent's two column blocks), jvp and vmap (as rows of the mapped
// arrays); mx.compile traces it like any primitive.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "cpu/eval.h"
#include "cpu/parallel.h"
#include "mlx/primitives.h"
#include "validate.h"

namespace mlx_lattice {

namespace nb = nanobind;
using array = mx::array;

array concat_rows(const array& a, const array& b, mx::StreamOrDevice sd = {});

namespace {

constexpr const char* kOp = "concat_rows";

class ConcatRows : public mx::UnaryPrimitive {
 public:
  explicit ConcatRows(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>&, array&) override {
    fail(kOp,
         "evaluates on the CPU stream only (on other streams concat_rows builds "
         "mx.concatenate).");
  }
  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums,
                         const std::vector<array>& outputs) override;
  std::vector<array> jvp(const std::vector<array>& primals, const std::vector<array>& tangents,
                         const std::vector<int>& argnums) override;
  std::pair<std::vector<array>, std::vector<int>> vmap(const std::vector<array>& inputs,
                                                       const std::vector<int>& axes) override;
  const char* name() const override { return "ConcatRows"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override {
    return {{inputs[0].shape(0), inputs[0].shape(1) + inputs[1].shape(1)}};
  }
};

// Bytes of output per parallel task (whole rows): large enough that the
// pool's hand-off is a small part of a task, small enough that a 100k-row
// output splits into hundreds of tasks for many cores.
constexpr int64_t kTaskBytes = 1 << 17;

// `rows` runs of Bytes bytes, src rows `src_stride` apart, dst rows
// `dst_stride` apart: a copy of a constant size compiles to a few vector
// moves instead of a call to memcpy per row.
template <int64_t Bytes>
void copy_fixed(const char* src, int64_t src_stride, char* dst, int64_t dst_stride, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * dst_stride, src + r * src_stride, Bytes);
  }
}

// The run sizes with a constant-size copy.
using CopyRuns = void (*)(const char*, int64_t, char*, int64_t, int64_t);
template <int64_t... Bytes>
constexpr std::array<std::pair<int64_t, CopyRuns>, sizeof...(Bytes)> kConstantCopies{
    {{Bytes, &copy_fixed<Bytes>}...}};
constexpr auto kCopies = kConstantCopies<4, 8, 16, 32, 64, 128, 256, 384, 512>;

// `rows` runs of `bytes` bytes from contiguous src rows into dst rows
// `dst_stride` apart.
void copy_runs(const char* src, int64_t bytes, char* dst, int64_t dst_stride, int64_t rows) {
  for (const auto& [size, copy] : kCopies) {
    if (size == bytes) return copy(src, bytes, dst, dst_stride, rows);
  }
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * dst_stride, src + r * bytes, static_cast<size_t>(bytes));
  }
}

void ConcatRows::eval_cpu(const std::vector<array>& inputs, array& out) {
  cpu::dispatch(stream(), inputs, out, [](std::vector<array>& in, array& o) {
    const int64_t n = o.shape(0);
    const int64_t item = static_cast<int64_t>(o.itemsize());
    const int64_t a_bytes = in[0].shape(1) * item, b_bytes = in[1].shape(1) * item;
    const int64_t row = a_bytes + b_bytes;
    if (n == 0 || row == 0) return;
    const char* a = a_bytes ? in[0].data<char>() : nullptr;
    const char* b = b_bytes ? in[1].data<char>() : nullptr;
    char* dst = o.data<char>();
    const int64_t per = std::max<int64_t>(1, kTaskBytes / row);
    parallel_for(ceil_div(n, per), [&](int64_t task) {
      const int64_t r0 = task * per;
      const int64_t rows = std::min(n, r0 + per) - r0;
      char* d = dst + r0 * row;
      if (a) copy_runs(a + r0 * a_bytes, a_bytes, d, row, rows);
      if (b) copy_runs(b + r0 * b_bytes, b_bytes, d + a_bytes, row, rows);
    });
  });
}

std::vector<array> ConcatRows::vjp(const std::vector<array>& primals,
                                   const std::vector<array>& cotangents,
                                   const std::vector<int>& argnums, const std::vector<array>&) {
  // The cotangent's first Ca columns go to a, the rest to b.
  auto s = stream();
  const auto& c = cotangents[0];
  const int n = c.shape(0), ca = primals[0].shape(1), width = c.shape(1);
  std::vector<array> grads;
  for (const int arg : argnums) {
    grads.push_back(arg == 0 ? mx::slice(c, {0, 0}, {n, ca}, s)
                             : mx::slice(c, {0, ca}, {n, width}, s));
  }
  return grads;
}

std::vector<array> ConcatRows::jvp(const std::vector<array>& primals,
                                   const std::vector<array>& tangents,
                                   const std::vector<int>& argnums) {
  // A primal without a tangent contributes zeros.
  auto s = stream();
  std::array<array, 2> t{mx::zeros_like(primals[0], s), mx::zeros_like(primals[1], s)};
  for (size_t i = 0; i < argnums.size(); ++i) t[argnums[i]] = tangents[i];
  return {concat_rows(t[0], t[1], s)};
}

std::pair<std::vector<array>, std::vector<int>> ConcatRows::vmap(const std::vector<array>& inputs,
                                                                 const std::vector<int>& axes) {
  // The mapped axis to the front (an unmapped operand broadcast along it);
  // the (B, N, C) operands are then B * N rows.
  auto s = stream();
  const int batch = axes[0] >= 0 ? inputs[0].shape(axes[0]) : inputs[1].shape(axes[1]);
  std::array<array, 2> x{inputs[0], inputs[1]};
  for (int i = 0; i < 2; ++i) {
    if (axes[i] >= 0) {
      x[i] = mx::moveaxis(x[i], axes[i], 0, s);
    } else {
      auto shape = x[i].shape();
      shape.insert(shape.begin(), batch);
      x[i] = mx::broadcast_to(mx::expand_dims(x[i], 0, s), shape, s);
    }
  }
  auto shape = x[0].shape();
  shape.back() += x[1].shape().back();
  auto rows = [&](const array& v) {
    int n = 1;
    for (size_t d = 0; d + 1 < v.ndim(); ++d) n *= v.shape(d);
    return mx::reshape(v, {n, v.shape().back()}, s);
  };
  return {{mx::reshape(concat_rows(rows(x[0]), rows(x[1]), s), shape, s)}, {0}};
}

}  // namespace

array concat_rows(const array& a, const array& b, mx::StreamOrDevice sd) {
  auto s = mx::to_stream(sd);
  if (a.ndim() != 2) {
    fail(kOp, "a must be 2-D (rows, columns), got shape " + shape_str(a.shape()) + ".");
  }
  if (b.ndim() != 2) {
    fail(kOp, "b must be 2-D (rows, columns), got shape " + shape_str(b.shape()) + ".");
  }
  if (b.dtype() != a.dtype()) {
    fail(kOp,
         "b must have a's dtype " + dtype_str(a.dtype()) + ", got " + dtype_str(b.dtype()) + ".");
  }
  if (b.shape(0) != a.shape(0)) {
    fail(kOp, "b must have a's " + std::to_string(a.shape(0)) + " rows, got " +
                  std::to_string(b.shape(0)) + ".");
  }
  const int64_t width = int64_t{a.shape(1)} + b.shape(1);
  if (width > std::numeric_limits<int32_t>::max()) {
    fail(kOp, "a and b together have " + std::to_string(width) + " columns, more than " +
                  std::to_string(std::numeric_limits<int32_t>::max()) + ".");
  }
  if (s.device != mx::Device::cpu) return mx::concatenate({a, b}, 1, s);
  return array({a.shape(0), static_cast<int>(width)}, a.dtype(), std::make_shared<ConcatRows>(s),
               {mx::contiguous(a, false, s), mx::contiguous(b, false, s)});
}

void bind_concat_rows(nb::module_& m) {
  using namespace nb::literals;
  m.def(
      "concat_rows",
      [](const array& a, const array& b, mx::StreamOrDevice s) {
        nb::gil_scoped_release unlocked;
        return concat_rows(a, b, s);
      },
      "a"_a, "b"_a, nb::kw_only(), "stream"_a = nb::none(),
      R"pbdoc(
The rows of ``a`` (N, Ca) and ``b`` (N, Cb), one dtype (any), joined side by
side: ``out[i] = [a[i], b[i]]``, (N, Ca + Cb), the bytes of
``mx.concatenate([a, b], axis=1)``. On the CPU stream a native copy over the
extension's threads (output from the active activation arena); on other
streams ``mx.concatenate``. Differentiable; ``jvp``, ``vmap`` and
``mx.compile`` work.
)pbdoc");
}

}  // namespace mlx_lattice
