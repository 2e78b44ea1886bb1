// CPU evaluation of SparsePool (forward, max-select tangent, backward).
#include <vector>

#include "../primitives.h"
#include "eval.h"
#include "pool.h"

namespace mlx_lattice {

void SparsePool::eval_cpu(const std::vector<array>& inputs, array& out) {
  cpu::dispatch(stream(), inputs, out,
                [stage = stage_, mode = mode_, rel = rel_](std::vector<array>& in, array& o) {
                  const Relation& r = *rel;
                  const int32_t* in_rows = cpu::idx(r.in_rows);
                  const int32_t* offsets = cpu::idx(r.out_offsets);
                  const int64_t channels = in[0].shape(1);
                  cpu::FloatIn x0(in[0], 0);
                  cpu::FloatOut out32(o);
                  if (stage == Stage::kForward) {
                    kernels::pool_forward(x0.get(), channels, in_rows, offsets, r.n_out, mode,
                                          out32.get());
                  } else {
                    cpu::FloatIn x1(in[1], 1);
                    if (stage == Stage::kMaxSelect) {
                      kernels::pool_max_select(x0.get(), x1.get(), channels, in_rows, offsets,
                                               r.n_out, out32.get());
                    } else {
                      kernels::pool_backward(x0.get(), x1.get(), channels, in_rows, offsets,
                                             r.n_out, r.n_in, mode, out32.get());
                    }
                  }
                  out32.finish();
                });
}

}  // namespace mlx_lattice
