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

#define MLX_LATTICE_EVAL_GPU(P)                                  \
  void P::eval_gpu(const std::vector<array>& in, array& out) { \
    eval_on_metal(*this, in, out);                             \
  }
MLX_LATTICE_PRIMITIVES(MLX_LATTICE_EVAL_GPU)
#undef MLX_LATTICE_EVAL_GPU
#define MLX_LATTICE_EVAL_GPU_MULTI(P)                                  \
  void P::eval_gpu(const std::vector<array>& in, std::vector<array>& out) { \
    eval_on_metal(*this, in, out);                             \
  }
MLX_LATTICE_MULTI_OUTPUT_PRIMITIVES(MLX_LATTICE_EVAL_GPU_MULTI)
#undef MLX_LATTICE_EVAL_GPU_MULTI

}  // namespace mlx_lattice
