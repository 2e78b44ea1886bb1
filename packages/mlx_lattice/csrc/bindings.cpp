// Python bindings of the extension: thin wrappers, real docstrings.
//
// A relation crosses as one Python object (core/relations.py's
// KernelRelation), read here into RelationArrays; a sorted view and a
// quantized weight likewise. Every function releases the GIL while it
// validates index arrays or builds relations; kernels run when MLX evaluates.
#include "bindings.h"
#include "cpu/input_error.h"

#include <cstdlib>
#include <exception>
#include <stdexcept>

#include <nanobind/stl/array.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "cpu/gemm.h"
#include "cpu/gemm_bf16.h"
#include "cpu/gemm_int8.h"
#include "cpu/float_formats.h"
#include "cpu/isa.h"
#include "cpu/sorted_conv.h"
#include "cpu/parallel.h"
#include "ops.h"
#include "primitives.h"
#include "relation_builder.h"
#include "relation_transpose.h"
#include "validate.h"
#include "weight_cache.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace mlx_lattice {

namespace {

using release = nb::call_guard<nb::gil_scoped_release>;

nb::object field(nb::handle obj, const std::string& path) {
  nb::object cur = nb::borrow(obj);
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string name = path.substr(start, dot == std::string::npos ? dot : dot - start);
    if (!nb::hasattr(cur, name.c_str())) {
      throw nb::type_error(("expected an object with a '" + path + "' attribute").c_str());
    }
    cur = cur.attr(name.c_str());
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
}

mx::array array_field(nb::handle obj, const char* what, const std::string& path) {
  nb::object v = field(obj, path);
  if (!nb::isinstance<mx::array>(v)) {
    throw nb::type_error((std::string(what) + "." + path + " must be an mlx.core.array, got " +
                          nb::type_name(v.type()).c_str() + ".")
                             .c_str());
  }
  return nb::cast<mx::array>(v);
}

int64_t int_field(nb::handle obj, const char* what, const std::string& path) {
  nb::object v = field(obj, path);
  if (!nb::isinstance<nb::int_>(v)) {
    throw nb::type_error((std::string(what) + "." + path + " must be an int.").c_str());
  }
  return nb::cast<int64_t>(v);
}

// A relation built here travels with its Python object as a capsule (the
// `_native` field of KernelRelation) holding the validated Relation. The
// capsule's context is this extension's own tag, so another extension built
// from these sources (the test-only harness) never trusts it.
constexpr const char* kBuiltName = "mlx_lattice.built_relation";
const int kExtensionTag = 0;

void destroy_built(PyObject* capsule) {
  delete static_cast<RelationPtr*>(PyCapsule_GetPointer(capsule, kBuiltName));
}

// (The C API directly: nanobind's capsule keeps its cleanup in the context.)
nb::object built_capsule(RelationPtr rel) {
  PyObject* cap = PyCapsule_New(new RelationPtr(std::move(rel)), kBuiltName, destroy_built);
  if (!cap || PyCapsule_SetContext(cap, const_cast<int*>(&kExtensionTag)) != 0) {
    throw nb::python_error();
  }
  return nb::steal(cap);
}

RelationPtr built_of(nb::handle r) {
  if (!nb::hasattr(r, "_native")) return nullptr;
  nb::object cap = r.attr("_native");
  if (!PyCapsule_IsValid(cap.ptr(), kBuiltName) ||
      PyCapsule_GetContext(cap.ptr()) != &kExtensionTag) {
    return nullptr;
  }
  return *static_cast<RelationPtr*>(PyCapsule_GetPointer(cap.ptr(), kBuiltName));
}

// The relation a builder returned as arrays by name (valid by construction).
RelationPtr relation_of(const std::map<std::string, mx::array>& raw, int64_t n_in, int64_t n_out,
                        int64_t n_kernels) {
  return std::make_shared<const Relation>(
      Relation{raw.at("in_rows"), raw.at("out_rows"), raw.at("kernel_ids"),
               raw.at("output_row_offsets"), raw.at("input_row_offsets"),
               raw.at("input_edge_ids"), raw.at("kernel_row_offsets"),
               raw.at("kernel_edge_ids"), n_in, n_out, n_kernels});
}

RelationArrays relation_from(nb::handle r) {
  const char* w = "relation";
  return {{array_field(r, w, "edges.in_rows"), array_field(r, w, "edges.out_rows"),
           array_field(r, w, "edges.kernel_ids"), array_field(r, w, "output_csr.row_offsets"),
           array_field(r, w, "input_csr.row_offsets"), array_field(r, w, "input_csr.edge_ids"),
           array_field(r, w, "kernel_csr.row_offsets"), array_field(r, w, "kernel_csr.edge_ids"),
           int_field(r, w, "n_in"), int_field(r, w, "n_out_capacity"), int_field(r, w, "n_kernels")},
          built_of(r)};
}

SortedArrays sorted_from(nb::handle v) {
  const char* w = "view";
  return {array_field(v, w, "sorted_out_in_map"), array_field(v, w, "reorder_rows"),
          array_field(v, w, "tile_masks")};
}

// "<who>: unknown ISA level '<name>'; the levels are <this architecture's>."
std::string unknown_isa_level(const std::string& who, const std::string& name) {
  return who + ": unknown ISA level '" + name + "'; the levels are " + isa::isa_level_names() +
         ".";
}

QuantizedArrays quantized_from(nb::handle q) {
  const char* w = "weight";
  auto i = [&](const char* name) { return static_cast<int>(int_field(q, w, name)); };
  return {array_field(q, w, "weight"), array_field(q, w, "scales"), array_field(q, w, "biases"),
          i("in_channels"),            i("out_channels"),           i("storage_in_channels"),
          i("group_size"),             i("bits")};
}

}  // namespace

void bind_ops(nb::module_& m) {
  // Bad input found by the native checks (InputError, see validate.cpp)
  // reaches Python as mlx_lattice's own MlxLatticeError (a ValueError); if the
  // package's error module cannot be imported (a bare extension), it is a
  // ValueError. Only InputError: the translator is shared with every
  // nanobind extension in the process, MLX's own errors included.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const InputError& e) {
      PyObject* module = PyImport_ImportModule("mlx_lattice._errors");
      PyObject* cls = module ? PyObject_GetAttrString(module, "MlxLatticeError") : nullptr;
      if (cls == nullptr) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, e.what());
      } else {
        PyErr_SetString(cls, e.what());
      }
      Py_XDECREF(cls);
      Py_XDECREF(module);
    }
  });
  // A second Python handle sharing the array's current value (descriptor):
  // it keeps that value alive, so `same_value` stays exact after the original
  // Python object is updated in place (which swaps its descriptor).
  m.def(
      "array_value", [](const mx::array& a) { return mx::array(a); }, "a"_a,
      "A handle on the current value of ``a`` (for caches).");
  m.def(
      "same_value", [](const mx::array& handle, const mx::array& a) { return handle.id() == a.id(); },
      "handle"_a, "a"_a, "Whether ``a`` still holds the value captured by ``array_value``.");
  m.def(
      "is_tracer", [](const mx::array& a) { return a.is_tracer(); }, "a"_a,
      "Whether ``a`` is a placeholder of a transformation being traced (``mx.compile``, "
      "``mx.vjp``, ``mx.vmap``): it cannot be evaluated on its own.");

  m.attr("SORTED_TILE_ROWS") = kernels::kSortedTileRows;

  // The dequantized-weight cache of weight-only quantized convolutions
  // (weight_cache.h) and the relation validation memo (validate.h).
  m.def("clear_weight_cache", &clear_weight_cache,
        "Drop the cached dequantized weights and zero the cache's counters.");
  m.def("clear_validation_memo", &clear_validation_memo,
        "Forget the remembered validations of index arrays.");
  m.def(
      "set_weight_cache_budget",
      [](int64_t nbytes) {
        if (nbytes < 0) {
          throw ::mlx_lattice::InputError("set_weight_cache_budget: nbytes must be >= 0, got " +
                                      std::to_string(nbytes) + ".");
        }
        set_weight_cache_budget(static_cast<size_t>(nbytes));
      },
      "nbytes"_a, "Bound the dequantized-weight cache to nbytes bytes (0: no caching).");
  m.def(
      "weight_cache_info",
      [] {
        const auto i = weight_cache_info();
        return std::map<std::string, uint64_t>{{"entries", i.entries}, {"bytes", i.bytes},
                                               {"budget", i.budget},   {"hits", i.hits},
                                               {"misses", i.misses},   {"evictions", i.evictions}};
      },
      "The dequantized-weight cache: entries, bytes, budget, hits, misses, evictions.");

  m.def("set_num_threads", &set_num_threads, "n"_a, release(),
        "Set the number of threads of the CPU kernels (>= 1).");
  m.def("get_num_threads", &get_num_threads,
        "Threads of the CPU kernels: MLX_LATTICE_NUM_THREADS if set, else the CPUs this "
        "process may run on (its affinity mask on Linux), at most 1024.");
  m.def(
      "bf16_isa", [] { return kernels::half_isa(kernels::FloatFormat::kBF16); },
      "The bf16 forward convolution's kernel: 'amx-bf16' (TDPBF16PS tiles), 'avx512-bf16' "
      "(vdpbf16ps; not on Intel CPUs, where it is slower than float32), 'neon-bf16' "
      "(BFMLALB/T) or 'float32' (converted to float32).");
  m.def(
      "fp16_isa", [] { return kernels::half_isa(kernels::FloatFormat::kF16); },
      "The float16 forward convolution's kernel: 'neon-fhm' (FMLAL/FMLAL2) or 'float32' "
      "(converted to float32).");
  m.def("int8_isa", &kernels::int8_isa,
        "The int8 micro-kernel in use: 'amx-int8', 'avx512-vnni', 'avx-vnni', 'avx2-fma', "
        "'neon-i8mm', 'neon-dotprod' or 'scalar'.");
  m.def(
      "set_isa_ceiling",
      [](const std::optional<std::string>& name) {
        if (!name) {
          isa::reset_isa_ceiling();
          return;
        }
        isa::Isa level;
        if (!isa::isa_from_name(name->c_str(), level)) {
          throw ::mlx_lattice::InputError(unknown_isa_level("set_kernel_isa", *name));
        }
        isa::set_isa_ceiling(level);
      },
      "name"_a.none(),
      "Cap the CPU micro-kernels at ISA level ``name`` (cpu/isa.h's names; the int8 family "
      "follows at once, the others choose at first use); None: back to MLX_LATTICE_GEMM_ISA.");
  m.def(
      "set_l2_cache_bytes",
      [](std::optional<int64_t> bytes) { isa::set_l2_cache_bytes(bytes ? *bytes : -1); },
      "bytes"_a.none(),
      "The L2 size (bytes >= 0, at most 2^40) the CPU tile drivers size their tiles from; None: "
      "the host's.");
  m.def("l2_cache_bytes", &isa::l2_cache_bytes,
        "The L2 size the CPU tile drivers size their tiles from now.");
  m.def(
      "check_environment",
      [] {
        // Read as the kernels read them (at first use); an empty value is unset.
        const char* isa_env = std::getenv("MLX_LATTICE_GEMM_ISA");
        isa::Isa level;
        if (isa_env && *isa_env && !isa::isa_from_name(isa_env, level)) {
          throw ::mlx_lattice::InputError(unknown_isa_level("MLX_LATTICE_GEMM_ISA", isa_env));
        }
        // The others: `valid` or "VARIABLE: <rule>, got '<value>'.".
        auto check = [](const char* name, bool (*valid)(const char*), const char* rule) {
          const char* value = std::getenv(name);
          if (value && *value && !valid(value)) {
            throw ::mlx_lattice::InputError(std::string(name) + ": " + rule + ", got '" +
                                            value + "'.");
          }
        };
        check(
            "MLX_LATTICE_NUM_THREADS",
            [](const char* v) { int n = 0; return ::mlx_lattice::threads_from_text(v, n); },
            "must be an integer in [1, 1024]");
        check(
            "MLX_LATTICE_GEMM_SPLAT",
            [](const char* v) { bool b = false; return ::mlx_lattice::splat_from_text(v, b); },
            "must be 0 or 1");
        check(
            "MLX_LATTICE_WEIGHT_CACHE_MB",
            [](const char* v) {
              size_t bytes = 0;
              return ::mlx_lattice::weight_cache_bytes_from_text(v, bytes);
            },
            "must be an integer number of MiB in [0, 2^40]");
      },
      "Raises MlxLatticeError for an MLX_LATTICE_GEMM_ISA that names no ISA level, an "
      "MLX_LATTICE_NUM_THREADS that is no integer in [1, 1024], an MLX_LATTICE_GEMM_SPLAT "
      "other than 0 or 1, or an MLX_LATTICE_WEIGHT_CACHE_MB that is no integer in [0, 2^40] "
      "(unset or empty: fine).");
  m.def(
      "isa_ceiling", [] { return std::string(isa::isa_name(isa::isa_ceiling())); },
      "The current ISA ceiling's name.");
  m.def(
      "isa_supported",
      [](const std::string& name) {
        isa::Isa level;
        return isa::isa_from_name(name.c_str(), level) && isa::isa_supported(level);
      },
      "name"_a,
      "Whether this build, CPU and OS can run ISA level ``name`` (False when unknown or another "
      "architecture's); for an AMX level this asks the OS for the tile permission (once).");
  m.def("gemm_isa", &gemm_isa,
        "The GEMM micro-kernel in use: 'avx512f', 'avx2-fma', 'neon-fma' or 'scalar'.");
  m.def("gemm_isas", &gemm_isas,
        "The GEMM micro-kernels this build and CPU can run, best first ('scalar' last); "
        "MLX_LATTICE_GEMM_ISA forces one.");

  m.def("check_coordinates", &check_coordinates, "coords"_a, "name"_a = "coords", release(),
        R"pbdoc(
Check an ``(N, 4)`` int32 coordinate set (batch, x, y, z) for duplicates.

Raises:
    ValueError: naming both rows of the first duplicate, or a wrong dtype/shape.
)pbdoc");

  m.def(
      "build_kernel_relation",
      [](const mx::array& in_coords, const std::optional<mx::array>& out_coords, Triple kernel_size,
         Triple stride, Triple dilation, Triple tensor_stride, const std::string& kind) {
        std::map<std::string, mx::array> raw;
        RelationPtr rel;
        {
          nb::gil_scoped_release unlocked;
          raw = build_kernel_relation(in_coords, out_coords, kernel_size, stride, dilation,
                                      tensor_stride, kind);
          const int64_t n_kernels =
              static_cast<int64_t>(kernel_size[0]) * kernel_size[1] * kernel_size[2];
          rel = relation_of(raw, in_coords.shape(0), raw.at("out_coords").shape(0), n_kernels);
        }
        nb::dict result;
        for (auto& [name, a] : raw) result[name.c_str()] = nb::cast(a, nb::rv_policy::copy);
        result["native"] = built_capsule(std::move(rel));
        return result;
      },
      "in_coords"_a, "out_coords"_a = nb::none(), nb::kw_only(), "kernel_size"_a, "stride"_a,
      "dilation"_a, "tensor_stride"_a, "kind"_a,
      R"pbdoc(
Build the edge list between two coordinate sets for one kernel shape.

Offsets are enumerated x-major, ``offset(i) = (i - (size - 1) // 2) *
dilation * tensor_stride`` per axis; an edge joins input ``p`` to output
``q`` when ``p == q + offset`` (``submanifold``, ``forward``) or
``p == q - offset`` (``target``). Returns a dict of int32 arrays:
``out_coords``, ``in_rows``, ``out_rows``, ``kernel_ids``,
``output_row_offsets``, ``input_row_offsets``, ``input_edge_ids``,
``kernel_row_offsets``, ``kernel_edge_ids``; and ``native``, the relation as
validated here (valid by construction), which the ops use while the arrays
are unchanged.
)pbdoc");

  m.def(
      "transpose_kernel_relation",
      [](nb::handle relation) {
        const std::string op = "transpose_kernel_relation";
        auto arrays = relation_from(relation);
        std::map<std::string, mx::array> raw;
        RelationPtr rel;
        {
          nb::gil_scoped_release unlocked;
          RelationPtr given = validated_relation(op, arrays);
          // The builder's relations never repeat an offset within an input
          // row (the edge p == q + offset(k) fixes q); check any other.
          if (given != arrays.built) {
            const auto [row, k] = first_repeated_kernel(given->in_offsets, &given->in_edge_ids,
                                                         given->kernel_ids, given->n_kernels);
            if (row >= 0) {
              fail(op, "input row " + std::to_string(row) + " has two edges of kernel offset " +
                           std::to_string(k) +
                           "; the transpose would give one output row two edges of one offset.");
            }
          }
          raw = transpose_relation(*given);
          rel = relation_of(raw, given->n_out, given->n_in, given->n_kernels);
        }
        nb::dict result;
        for (auto& [name, a] : raw) result[name.c_str()] = nb::cast(a, nb::rv_policy::copy);
        result["native"] = built_capsule(std::move(rel));
        return result;
      },
      "relation"_a,
      R"pbdoc(
The edges of ``relation`` (a KernelRelation) reversed: input and output rows
swapped, kernel offsets kept, laid out as ``build_kernel_relation`` lays out
every relation (edges grouped by the new output row with offsets ascending,
edge ids ascending within each input row and each offset). Returns the same
dict as ``build_kernel_relation`` without ``out_coords``.

Raises:
    ValueError: the relation is invalid (naming the field), or an input row
        has two edges of one kernel offset.
)pbdoc");

  m.def(
      "sparse_conv_features",
      [](const mx::array& feats, const mx::array& weight, nb::handle relation,
         mx::StreamOrDevice s) {
        auto rel = relation_from(relation);
        nb::gil_scoped_release unlocked;
        return sparse_conv_features(feats, weight, rel, s);
      },
      "feats"_a, "weight"_a, "relation"_a, nb::kw_only(), "stream"_a = nb::none(),
      R"pbdoc(
Sparse convolution ``out[o] = sum_e feats[in_rows[e]] @ W[kernel_ids[e]]``
over a ``KernelRelation`` (the generic output-stationary dataflow).

``weight`` is the mapped ``(K, Cin, Cout)`` weight. Differentiable in
``feats`` and ``weight``; the result has the dtype of ``feats``.

Raises:
    ValueError: for a bad shape or dtype, or a relation whose index arrays
        are out of range or inconsistent.
)pbdoc");

  m.def(
      "sparse_conv_features_sorted_implicit_gemm",
      [](const mx::array& feats, const mx::array& weight, nb::handle relation, nb::handle view,
         bool store_sorted, mx::StreamOrDevice s) {
        auto rel = relation_from(relation);
        auto sorted = sorted_from(view);
        nb::gil_scoped_release unlocked;
        return sparse_conv_features_sorted_implicit_gemm(feats, weight, rel, sorted, store_sorted,
                                                         s);
      },
      "feats"_a, "weight"_a, "relation"_a, "view"_a, nb::kw_only(), "store_sorted"_a = false,
      "stream"_a = nb::none(),
      R"pbdoc(
Sparse convolution through the relation's sorted implicit-GEMM ``view``.

Row ``r`` of the view is output row ``view.reorder_rows[r]``; with
``store_sorted=True`` results stay in sorted order. ``weight`` is the mapped
``(K, Cin, Cout)`` weight. Gradients use the relation's edge groupings.
)pbdoc");

  m.def(
      "sparse_quantized_conv_features",
      [](const mx::array& feats, nb::handle weight, nb::handle relation, int act_bits,
         float act_scale, mx::StreamOrDevice s) {
        auto q = quantized_from(weight);
        auto rel = relation_from(relation);
        nb::gil_scoped_release unlocked;
        return sparse_quantized_conv_features(feats, q, rel, act_bits, act_scale, s);
      },
      "feats"_a, "weight"_a, "relation"_a, nb::kw_only(), "act_bits"_a = 0,
      "act_scale"_a = 0.0f, "stream"_a = nb::none(),
      R"pbdoc(
Sparse convolution with a group-affine ``QuantizedWeight``.

``weight.weight`` is uint32 ``(K, Cout, storage_in_channels * bits / 32)``
in ``mx.quantize``'s layout with ``scales``/``biases`` of shape
``(K, Cout, storage_in_channels / group_size)``. Weights are dequantized
inside the kernel; differentiable in ``feats``. ``act_bits=8`` quantizes the
features per row (symmetric, dynamic scale max|row| / 127) and runs an
int8 x uint8 -> int32 GEMM with a float32 epilogue (CPU only); its gradient
is the float-activation one (straight-through). ``act_scale > 0`` replaces the
dynamic per-row scales by one static scale for every row (values beyond
``127 * act_scale`` saturate).
)pbdoc");

  m.def(
      "sparse_quantized_conv_fused",
      [](const mx::array& feats, nb::handle weight, nb::handle relation, float in_scale,
         std::optional<mx::array> bias, std::optional<mx::array> residual, float residual_scale,
         bool relu, float out_scale, std::optional<std::string> out_dtype,
         mx::StreamOrDevice s) {
        auto q = quantized_from(weight);
        auto rel = relation_from(relation);
        FusedEpilogueArgs args{in_scale, std::move(bias), std::move(residual), residual_scale,
                               relu, out_scale, out_dtype.value_or("")};
        nb::gil_scoped_release unlocked;
        return sparse_quantized_conv_fused(feats, q, rel, args, s);
      },
      "feats"_a, "weight"_a, "relation"_a, nb::kw_only(), "in_scale"_a, "bias"_a = nb::none(),
      "residual"_a = nb::none(), "residual_scale"_a = 0.0f, "relu"_a = false,
      "out_scale"_a = 0.0f, "out_dtype"_a = nb::none(), "stream"_a = nb::none(),
      R"pbdoc(
Static-scale w8a8 / w4a8 convolution with a fused epilogue; inference only
(no gradient or vmap; mx.eval and mx.compile work). ``feats``: float rows
quantized with ``in_scale``, or int8 codes already at ``in_scale``. Per
output value, in float32 (one rounding per operation): ``y = acc + bias``,
``+ residual`` (float) or ``+ float(residual) * residual_scale`` (int8),
``relu`` (``y < 0 -> 0``); then int8 ``clip(round_half_even(y / out_scale),
-127, 127)`` (NaN -> 0) when ``out_scale > 0``, else ``y`` in ``out_dtype``.
The full contract: csrc/README.md, "The fused int8 convolution".
)pbdoc)pbdoc");

  m.def(
      "sparse_conv_normalization_denominator",
      [](const mx::array& weight, nb::handle relation, mx::StreamOrDevice s) {
        auto rel = relation_from(relation);
        nb::gil_scoped_release unlocked;
        return sparse_conv_normalization_denominator(weight, rel, s);
      },
      "weight"_a, "relation"_a, nb::kw_only(), "stream"_a = nb::none(),
      R"pbdoc(
``out[o] = sum over edges e of o of sum_c weight[kernel_ids[e], c, :]``: the
convolution of all-ones features with ``weight``, reduced in output-CSR edge
order in float32.
)pbdoc");

  m.def(
      "sparse_pool_features",
      [](const mx::array& feats, nb::handle relation, bool input_exclusive,
         const std::string& mode, mx::StreamOrDevice s) {
        auto rel = relation_from(relation);
        nb::gil_scoped_release unlocked;
        return sparse_pool_features(feats, rel, input_exclusive, mode, s);
      },
      "feats"_a, "relation"_a, nb::kw_only(), "input_exclusive"_a, "mode"_a,
      "stream"_a = nb::none(),
      R"pbdoc(
Sparse pooling over a relation: ``mode`` is ``'max'``, ``'avg'`` (mean over
the present neighbours) or ``'sum'``; outputs without neighbours are 0.
``input_exclusive=True`` asserts every input row feeds at most one output
(non-overlapping windows) and is checked. Differentiable in ``feats``; the
max gradient goes to the first maximum in edge order.
)pbdoc");

  bind_geometry(m);
  bind_bias_relu_add(m);

  // ------------------------------------------------------------ feature add
  m.def(
      "feature_add",
      [](const mx::array& a, const mx::array& b, mx::StreamOrDevice s) {
        nb::gil_scoped_release unlocked;
        return feature_add(a, b, s);
      },
      "a"_a, "b"_a, nb::kw_only(), "stream"_a = nb::none(),
      R"pbdoc(
``a + b`` for same-shaped float32, float16 or bfloat16 arrays, in their
dtype: each sum computed in float32 and rounded once to the dtype (for
float16 and bfloat16 the correctly rounded IEEE sum, the bits of NumPy's
float16 add). Differentiable in both operands; ``jvp``, ``vmap`` and
``mx.compile`` work. On the CPU half-precision operands are widened in
blocks (F16C where available); on Apple GPUs a Metal kernel.
)pbdoc");

  // ------------------------------------------------------------ batch norm
  m.def(
      "batch_norm_train",
      [](const mx::array& x, const mx::array& weight, const mx::array& bias, float eps, bool relu,
         mx::StreamOrDevice s) {
        nb::gil_scoped_release unlocked;
        auto out = batch_norm_train(x, weight, bias, eps, relu, s);
        return std::make_tuple(out[0], out[1], out[2]);
      },
      "x"_a, "weight"_a, "bias"_a, nb::kw_only(), "eps"_a, "relu"_a, "stream"_a = nb::none(),
      R"pbdoc(
Training-mode batch norm of ``(N, C)`` features ``x`` (float32, float16 or
bfloat16; ``N >= 1``) over the rows, then a ReLU if ``relu``: returns
``(y, mean, var)``, ``y`` in ``x``'s dtype, the biased batch statistics
float32. Statistics are two-pass in double over fixed row blocks (bitwise
the same for any thread count); the affine map runs in float32 and is
rounded once to ``x``'s dtype. Differentiable (closed-form backward, its own
primitive) in ``x``, ``weight`` and ``bias``; ``mean`` and ``var`` carry no
gradient. On GPU streams (Apple GPUs) the Metal kernels sum the same row
blocks in compensated float32.
)pbdoc");

  m.def(
      "batch_norm_eval",
      [](const mx::array& x, const mx::array& mean, const mx::array& var,
         const std::optional<mx::array>& weight, const std::optional<mx::array>& bias, float eps,
         bool relu, mx::StreamOrDevice s) {
        nb::gil_scoped_release unlocked;
        return batch_norm_eval(x, mean, var, weight, bias, eps, relu, s);
      },
      "x"_a, "mean"_a, "var"_a, "weight"_a.none(), "bias"_a.none(), nb::kw_only(), "eps"_a,
      "relu"_a, "stream"_a = nb::none(),
      R"pbdoc(
Eval-mode batch norm of ``(N, C)`` features ``x`` (float32, float16 or
bfloat16; ``N >= 0``) with given statistics ``mean`` and ``var`` (``(C,)``,
e.g. running averages), then a ReLU if ``relu``:
``y = (x - mean) * scale + bias`` with ``scale = weight * rsqrt(var + eps)``
(``weight`` and ``bias`` may be ``None``: 1 and 0). ``scale`` is formed in
float32 with MLX ops; the map is one native pass in float32 per element,
rounded once to ``x``'s dtype (no casts or half-precision MLX ops around
it). Differentiable in every argument (``vjp`` and ``jvp``, float32 MLX ops);
``vmap`` raises; ``mx.compile`` works. On GPU streams (Apple GPUs) a Metal
kernel computes the same expression.
)pbdoc");
}

}  // namespace mlx_lattice
