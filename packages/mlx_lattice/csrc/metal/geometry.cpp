// GPU encode bodies of the geometry primitives (kernels in geometry.metal).
// Operands are float32 / int32: the graph builders cast.
#include "encode.h"

namespace mlx_lattice::gpu {

void encode(const GeometryVoxelize& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  encode_voxel_reduce(enc, ops.floats(in[0]), ops.index(in[1]), ops.index(in[2]),
                      ops.output(out[0]), ops.index(out[1]), u32(out[0].shape(0)),
                      u32(out[0].shape(1)), u32(p.mode()));
}

void encode(const GeometryDevoxelize& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  const auto channels = u32(out[0].shape(1));
  if (p.face() == GeometryDevoxelize::kForward) {
    encode_devoxelize(enc, ops.floats(in[0]), ops.index(in[1]), ops.floats(in[2]), ops.index(in[3]),
                      ops.output(out[0]), u32(out[0].shape(0)), channels, p.nearest());
  } else {
    encode_devoxelize_transpose(enc, ops.floats(in[0]), ops.floats(in[2]), ops.index(in[3]),
                                ops.index(in[4]), ops.index(in[5]), ops.output(out[0]),
                                u32(p.n_voxels()), channels, p.nearest());
  }
}

}  // namespace mlx_lattice::gpu
