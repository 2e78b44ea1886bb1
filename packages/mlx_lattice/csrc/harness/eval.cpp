// eval_cpu of every primitive in the test-only harness extension: the
// primitive's Metal encode body (metal/<op>.cpp) run on the CPU stream by
// the MSL harness. The product extension compiles cpu/<op>.cpp instead.
#include "../cpu/eval.h"
#include "../metal/encode.h"
#include "harness.h"

namespace mlx_lattice {

namespace {

template <typename P>
void eval_on_harness(P& p, const std::vector<array>& inputs, array& out) {
  // The task runs after eval_cpu returns: keep the primitive alive with it.
  auto prim = std::static_pointer_cast<P>(out.primitive_ptr());
  cpu::dispatch(p.stream(), inputs, out, [prim](std::vector<array>& in, array& o) {
    auto enc = gpu::harness_encoder();
    gpu::Operands ops(true);
    gpu::encode(*prim, *enc, ops, in, o);
    ops.finish();
  });
}

template <typename P>
void eval_on_harness(P& p, const std::vector<array>& inputs, std::vector<array>& outs) {
  auto prim = std::static_pointer_cast<P>(outs[0].primitive_ptr());
  cpu::dispatch(p.stream(), inputs, outs, [prim](std::vector<array>& in, std::vector<array>& o) {
    auto enc = gpu::harness_encoder();
    gpu::Operands ops(true);
    gpu::encode(*prim, *enc, ops, in, o);
    ops.finish();
  });
}

}  // namespace

// Every stream of the harness extension evaluates through the Metal bodies.
bool uses_metal_bodies(const mx::Stream&) { return true; }

#define MLX_LATTICE_EVAL_CPU(P)                                  \
  void P::eval_cpu(const std::vector<array>& in, array& out) { \
    eval_on_harness(*this, in, out);                           \
  }
MLX_LATTICE_PRIMITIVES(MLX_LATTICE_EVAL_CPU)
#undef MLX_LATTICE_EVAL_CPU
#define MLX_LATTICE_EVAL_CPU_MULTI(P)                                  \
  void P::eval_cpu(const std::vector<array>& in, std::vector<array>& out) { \
    eval_on_harness(*this, in, out);                           \
  }
MLX_LATTICE_MULTI_OUTPUT_PRIMITIVES(MLX_LATTICE_EVAL_CPU_MULTI)
#undef MLX_LATTICE_EVAL_CPU_MULTI

}  // namespace mlx_lattice
