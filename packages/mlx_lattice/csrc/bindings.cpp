// Python bindings of mlx_lattice._native.ext: thin wrappers, real docstrings.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "scaled_add.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(ext, m) {
  m.doc() = "Native MLX primitives of mlx_lattice (import mlx.core first).";

  m.def("scaled_add", &mlx_lattice::scaled_add, "x"_a, "y"_a, nb::kw_only(), "alpha"_a = 1.0f,
        "beta"_a = 1.0f, "stream"_a = nb::none(),
        R"pbdoc(
Compute ``alpha * x + beta * y`` as one MLX primitive.

Args:
    x (array): floating input.
    y (array): floating input with the shape and dtype of ``x``.
    alpha (float): scale of ``x``.
    beta (float): scale of ``y``.
    stream (Stream | Device | None): where to evaluate.

Returns:
    array: the result, with the shape and dtype of ``x``.

Raises:
    ValueError: if the shapes or dtypes of ``x`` and ``y`` differ.
)pbdoc");
}
