// Python bindings of mlx_lattice._native.ext: thin wrappers, real docstrings.
//
// Every function releases the GIL while it validates index arrays or builds
// relations; kernels themselves run when MLX evaluates the result.
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "gemm.h"
#include "metal/encoder.h"
#include "msl_runtime.h"
#include "kernels.h"
#include "parallel.h"
#include "relations.h"
#include "scaled_add.h"
#include "sparse_ops.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace ml = mlx_lattice;

void bind_geometry(nb::module_& m);  // geometry_bindings.cpp

NB_MODULE(ext, m) {
  m.doc() = "Native MLX primitives of mlx_lattice (import mlx.core first).";
  using release = nb::call_guard<nb::gil_scoped_release>;

  // A second Python handle sharing the array's current value (descriptor):
  // it keeps that value alive, so `same_value` stays exact after the original
  // Python object is updated in place (which swaps its descriptor).
  m.def(
      "array_value", [](const mlx::core::array& a) { return mlx::core::array(a); }, "a"_a,
      "A handle on the current value of ``a`` (for caches).");
  m.def(
      "same_value",
      [](const mlx::core::array& handle, const mlx::core::array& a) { return handle.id() == a.id(); },
      "handle"_a, "a"_a, "Whether ``a`` still holds the value captured by ``array_value``.");

  m.attr("SORTED_TILE_ROWS") = ml::kernels::kSortedTileRows;

  m.def("scaled_add", &ml::scaled_add, "x"_a, "y"_a, nb::kw_only(), "alpha"_a = 1.0f,
        "beta"_a = 1.0f, "stream"_a = nb::none(),
        R"pbdoc(
Compute ``alpha * x + beta * y`` as one MLX primitive (the extension's smoke test).

Raises:
    ValueError: if the shapes or dtypes of ``x`` and ``y`` differ.
)pbdoc");

  m.def("set_num_threads", &ml::set_num_threads, "n"_a, release(),
        "Set the number of threads of the CPU kernels (>= 1).");
  m.def("get_num_threads", &ml::get_num_threads,
        "Threads of the CPU kernels: MLX_LATTICE_NUM_THREADS if set, else all cores.");
  m.def("set_metal_harness", &ml::gpu::set_harness, "enabled"_a,
        "Route evaluation through the Metal kernels run on the CPU harness (tests).");
  m.def("harness_groups_run", &msl::dispatched_groups,
        "Threadgroups the Metal harness has run in this process (diagnostics).");
  m.def("metal_harness_enabled", &ml::gpu::harness_enabled,
        "Whether evaluation runs the Metal kernels through the CPU harness.");
  m.def("gemm_isa", &ml::gemm_isa, "The GEMM micro-kernel in use: 'avx2-fma' or 'scalar'.");

  m.def("check_coordinates", &ml::check_coordinates, "coords"_a, "name"_a = "coords", release(),
        R"pbdoc(
Check an ``(N, 4)`` int32 coordinate set (batch, x, y, z) for duplicates.

Raises:
    ValueError: naming both rows of the first duplicate, or a wrong dtype/shape.
)pbdoc");

  m.def("build_kernel_relation", &ml::build_kernel_relation, "in_coords"_a,
        "out_coords"_a = nb::none(), nb::kw_only(), "kernel_size"_a, "stride"_a, "dilation"_a,
        "tensor_stride"_a, "kind"_a, release(),
        R"pbdoc(
Build the edge list between two coordinate sets for one kernel shape.

Offsets are enumerated x-major, ``offset(i) = (i - (size - 1) // 2) *
dilation * tensor_stride`` per axis; an edge joins input ``p`` to output
``q`` when ``p == q + offset`` (``submanifold``, ``forward``) or
``p == q - offset`` (``target``). Returns a dict of int32 arrays:
``out_coords``, ``in_rows``, ``out_rows``, ``kernel_ids``, ``counts``,
``output_row_offsets``, ``output_edge_ids``, ``input_row_offsets``,
``input_edge_ids``, ``kernel_row_offsets``, ``kernel_edge_ids``.
)pbdoc");

  m.def("sparse_conv_features", &ml::sparse_conv_features, "feats"_a, "weight"_a, "in_rows"_a,
        "out_rows"_a, "kernel_ids"_a, "counts"_a, "output_row_offsets"_a, "input_row_offsets"_a,
        "input_edge_ids"_a, "kernel_row_offsets"_a, "kernel_edge_ids"_a, "n_out_capacity"_a,
        "n_kernels"_a, nb::kw_only(), "stream"_a = nb::none(), release(),
        R"pbdoc(
Sparse convolution ``out[o] = sum_e feats[in_rows[e]] @ W[kernel_ids[e]]``.

``weight`` is ``(K, Cin, Cout)`` or ``(Cout, kx, ky, kz, Cin)``. Edges must be
grouped by output (``output_row_offsets``) with offsets ascending in each
group; the input and kernel groupings may be empty arrays (rebuilt when a
gradient needs them). Differentiable in ``feats`` and ``weight``; the result
has the dtype of ``feats``.

Raises:
    ValueError: for a bad shape or dtype, or an index array that is out of
        range or inconsistent with the relation.
)pbdoc");

  m.def("sparse_conv_features_sorted_implicit_gemm",
        &ml::sparse_conv_features_sorted_implicit_gemm, "feats"_a, "weight"_a,
        "sorted_out_in_map"_a, "sorted_kv_out_in_map"_a, "reorder_rows"_a, "tile_masks"_a,
        "in_rows"_a, "out_rows"_a, "kernel_ids"_a, "counts"_a, "output_row_offsets"_a,
        "input_row_offsets"_a, "input_edge_ids"_a, "kernel_row_offsets"_a, "kernel_edge_ids"_a,
        "n_out_capacity"_a, "n_kernels"_a, nb::kw_only(), "store_sorted"_a = false,
        "stream"_a = nb::none(), release(),
        R"pbdoc(
Sparse convolution through the sorted implicit-GEMM view.

Row ``r`` of the sorted view is output row ``reorder_rows[r]``; with
``store_sorted=True`` results stay in sorted order. ``weight`` is the mapped
``(K, Cin, Cout)`` weight. Gradients use the relation's edge groupings.
)pbdoc");

  m.def("sparse_conv_features_sorted_direct_reference",
        &ml::sparse_conv_features_sorted_direct_reference, "feats"_a, "weight"_a,
        "sorted_out_in_map"_a, "reorder_rows"_a, "tile_masks"_a, "n_out_capacity"_a,
        "n_kernels"_a, nb::kw_only(), "store_sorted"_a = false, "stream"_a = nb::none(),
        release(),
        "The sorted dataflow computed by direct loops, for diagnostics and tests.");

  m.def("sparse_quantized_conv_features", &ml::sparse_quantized_conv_features, "feats"_a,
        "weight"_a, "scales"_a, "biases"_a, "in_rows"_a, "out_rows"_a, "kernel_ids"_a, "counts"_a,
        "output_row_offsets"_a, "sorted_kv_out_in_map"_a, "reorder_rows"_a, "tile_masks"_a,
        "n_out_capacity"_a, "n_kernels"_a, "in_channels"_a, "out_channels"_a,
        "storage_in_channels"_a, "group_size"_a, "bits"_a, nb::kw_only(),
        "stream"_a = nb::none(), release(),
        R"pbdoc(
Sparse convolution with group-affine quantized weights.

``weight`` is uint32 ``(K, Cout, storage_in_channels * bits / 32)`` in
``mx.quantize``'s layout with ``scales``/``biases`` of shape
``(K, Cout, storage_in_channels / group_size)``. Weights are dequantized
inside the kernel; differentiable in ``feats``.
)pbdoc");

  m.def("sparse_conv_normalization_denominator", &ml::sparse_conv_normalization_denominator,
        "weight"_a, "kernel_ids"_a, "counts"_a, "output_row_offsets"_a, nb::kw_only(),
        "stream"_a = nb::none(), release(),
        R"pbdoc(
``out[o] = sum over edges e of o of sum_c weight[kernel_ids[e], c, :]``: the
convolution of all-ones features with ``weight``, reduced in output-CSR edge
order in float32.
)pbdoc");

  bind_geometry(m);

  m.def("sparse_pool_features", &ml::sparse_pool_features, "feats"_a, "in_rows"_a, "out_rows"_a,
        "kernel_ids"_a, "output_row_offsets"_a, "counts"_a, "input_exclusive"_a, "mode"_a,
        "n_out_capacity"_a, "n_kernels"_a, nb::kw_only(), "stream"_a = nb::none(), release(),
        R"pbdoc(
Sparse pooling over a relation: ``mode`` is ``'max'``, ``'avg'`` (mean over
the present neighbours) or ``'sum'``; outputs without neighbours are 0.
``input_exclusive=True`` asserts every input row feeds at most one output
(non-overlapping windows) and is checked. Differentiable in ``feats``; the
max gradient goes to the first maximum in edge order.
)pbdoc");
}
