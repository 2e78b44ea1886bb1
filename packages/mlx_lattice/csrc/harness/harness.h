// The test-only harness extension: the product's primitives with eval_cpu
// running their Metal encode bodies through tools/msl's MSL CPU harness, and
// the AMX drivers on the tile model.
#pragma once

#include <memory>

#include <nanobind/nanobind.h>

#include "../metal/encoder.h"

namespace mlx_lattice {

// The AMX drivers on the tile model (amx_model.cpp), for the fuzz targets.
void bind_amx_model(nanobind::module_& m);

}  // namespace mlx_lattice

namespace mlx_lattice::gpu {

// Runs the MSL kernels through the CPU harness.
std::unique_ptr<KernelEncoder> harness_encoder();

}  // namespace mlx_lattice::gpu
