// The functions of the extension, bound into a module by module.cpp (the
// product `ext`) and by harness/module.cpp (the test-only `harness_ext`).
#pragma once

#include <nanobind/nanobind.h>

namespace mlx_lattice {

void bind_ops(nanobind::module_& m);

// The geometry functions (geometry_bindings.cpp), called by bind_ops.
void bind_geometry(nanobind::module_& m);

// bias_relu_add (bias_relu_add.cpp), called by bind_ops.
void bind_bias_relu_add(nanobind::module_& m);

// The entropy coders (entropy_bindings.cpp), bound by the product module only.
void bind_entropy(nanobind::module_& m);

}  // namespace mlx_lattice
