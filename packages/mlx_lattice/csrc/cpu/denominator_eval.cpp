// CPU evaluation of SparseDenominator.
#include <vector>

#include "../primitives.h"
#include "eval.h"
#include "denominator.h"

namespace mlx_lattice {

void SparseDenominator::eval_cpu(const std::vector<array>& inputs, array& out) {
  cpu::dispatch(stream(), inputs, out, [mode = mode_, rel = rel_](std::vector<array>& in, array& o) {
    const auto& x = in[0];
    const Relation& r = *rel;
    cpu::FloatIn x32(x, 0);
    cpu::FloatOut out32(o);
    if (mode == Mode::kDenominator) {
      kernels::normalization_denominator(x32.get(), r.n_kernels, x.shape(1), x.shape(2),
                                         cpu::idx(r.kernel_ids), cpu::idx(r.out_offsets), r.n_out,
                                         out32.get());
    } else {
      kernels::denominator_gradient(x32.get(), x.shape(1), cpu::idx(r.kernel_ids),
                                    cpu::idx(r.out_offsets), r.n_out, r.n_kernels, out32.get());
    }
    out32.finish();
  });
}

}  // namespace mlx_lattice
