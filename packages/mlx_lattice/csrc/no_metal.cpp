// eval_gpu of every primitive in builds without Metal kernels (the build
// picks this file instead of metal/eval.cpp off macOS).
#include "common.h"
#include "primitives.h"

namespace mlx_lattice {

void SparseConv::eval_gpu(const std::vector<array>&, array&) { throw_no_gpu(name()); }
void SparseConvSorted::eval_gpu(const std::vector<array>&, array&) { throw_no_gpu(name()); }
void SparseQuantizedConv::eval_gpu(const std::vector<array>&, array&) { throw_no_gpu(name()); }
void SparseDenominator::eval_gpu(const std::vector<array>&, array&) { throw_no_gpu(name()); }
void SparsePool::eval_gpu(const std::vector<array>&, array&) { throw_no_gpu(name()); }
void GeometryVoxelize::eval_gpu(const std::vector<array>&, std::vector<array>&) {
  throw_no_gpu(name());
}
void GeometryDevoxelize::eval_gpu(const std::vector<array>&, std::vector<array>&) {
  throw_no_gpu(name());
}

}  // namespace mlx_lattice
