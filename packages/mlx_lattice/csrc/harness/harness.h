// The test-only harness extension: the product's primitives with eval_cpu
// running their Metal encode bodies through tools/msl's MSL CPU harness.
#pragma once

#include <memory>

#include "../metal/encoder.h"

namespace mlx_lattice::gpu {

// Runs the MSL kernels through the CPU harness.
std::unique_ptr<KernelEncoder> harness_encoder();

}  // namespace mlx_lattice::gpu
