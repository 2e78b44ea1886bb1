// GPU encode body of SparseDenominator.
#include "encode.h"

namespace mlx_lattice::gpu {

void encode(const SparseDenominator& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out) {
  const auto& r = p.relation();
  if (p.mode() == SparseDenominator::Mode::kDenominator) {
    encode_denominator(enc, ops.floats(in[0]), ops.index(r.kernel_ids), ops.index(r.out_offsets),
                       ops.output(out), u32(r.n_out), u32(r.n_kernels), u32(in[0].shape(1)),
                       u32(in[0].shape(2)));
  } else {
    encode_denominator_grad(enc, ops.floats(in[0]), ops.index(r.out_rows), ops.index(r.k_offsets),
                            ops.index(r.k_edge_ids), ops.output(out), u32(r.n_kernels),
                            u32(in[0].shape(1)));
  }
}

}  // namespace mlx_lattice::gpu
