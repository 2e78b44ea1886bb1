// The functions of the extension, bound into a module by module.cpp (the
// product `ext`) and by harness/module.cpp (the test-only `harness_ext`).
#pragma once

#include <nanobind/nanobind.h>

namespace mlx_lattice {

void bind_ops(nanobind::module_& m);

}  // namespace mlx_lattice
