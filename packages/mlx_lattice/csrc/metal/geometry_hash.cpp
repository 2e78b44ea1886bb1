// GPU encode body of GeometryHash (kernels in geometry_hash.metal).
#include "encode.h"

namespace mlx_lattice::gpu {

void encode(const GeometryHash& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  encode_coord_hash(enc, ops.index(in[0]), ops.index(in[1]), ops.index(out[0]),
                    ops.index(out[1]), ops.index(out[2]), ops.index(out[3]), ops.index(out[4]),
                    u32(in[0].shape(0)), u32(in[1].shape(0)), u32(p.slots()));
}

}  // namespace mlx_lattice::gpu
