// eval_gpu of every primitive on Apple GPUs (macOS builds only; the build
// picks no_metal.cpp elsewhere): the primitive's encode body (metal/<op>.cpp)
// on the stream's Metal command encoder. Untested on the Linux machines this
// project is developed on; the same bodies run there through the harness.
#include "encode.h"

namespace mlx_lattice {

namespace {

template <typename P>
void eval_on_metal(P& p, const std::vector<array>& inputs, array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto enc = gpu::metal_encoder(p.stream());
  gpu::Operands ops(false);
  gpu::encode(p, *enc, ops, inputs, out);
}

template <typename P>
void eval_on_metal(P& p, const std::vector<array>& inputs, std::vector<array>& outs) {
  for (auto& out : outs) out.set_data(mx::allocator::malloc(out.nbytes()));
  auto enc = gpu::metal_encoder(p.stream());
  gpu::Operands ops(false);
  gpu::encode(p, *enc, ops, inputs, outs);
}

}  // namespace

void SparseConv::eval_gpu(const std::vector<array>& in, array& out) {
  eval_on_metal(*this, in, out);
}
void SparseConvSorted::eval_gpu(const std::vector<array>& in, array& out) {
  eval_on_metal(*this, in, out);
}
void SparseQuantizedConv::eval_gpu(const std::vector<array>& in, array& out) {
  eval_on_metal(*this, in, out);
}
void SparseDenominator::eval_gpu(const std::vector<array>& in, array& out) {
  eval_on_metal(*this, in, out);
}
void SparsePool::eval_gpu(const std::vector<array>& in, array& out) {
  eval_on_metal(*this, in, out);
}
void GeometryVoxelize::eval_gpu(const std::vector<array>& in, std::vector<array>& out) {
  eval_on_metal(*this, in, out);
}
void GeometryDevoxelize::eval_gpu(const std::vector<array>& in, std::vector<array>& out) {
  eval_on_metal(*this, in, out);
}

}  // namespace mlx_lattice
