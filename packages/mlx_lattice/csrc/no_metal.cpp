// eval_gpu of every primitive in builds without Metal kernels (the build
// picks this file instead of metal/eval.cpp off macOS).
#include "common.h"
#include "primitives.h"

namespace mlx_lattice {

#define MLX_LATTICE_NO_GPU(P) \
  void P::eval_gpu(const std::vector<array>&, array&) { throw_no_gpu(name()); }
MLX_LATTICE_PRIMITIVES(MLX_LATTICE_NO_GPU)
#undef MLX_LATTICE_NO_GPU
#define MLX_LATTICE_NO_GPU_MULTI(P) \
  void P::eval_gpu(const std::vector<array>&, std::vector<array>&) { throw_no_gpu(name()); }
MLX_LATTICE_MULTI_OUTPUT_PRIMITIVES(MLX_LATTICE_NO_GPU_MULTI)
#undef MLX_LATTICE_NO_GPU_MULTI

}  // namespace mlx_lattice
