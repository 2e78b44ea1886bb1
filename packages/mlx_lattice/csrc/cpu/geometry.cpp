// CPU evaluation of the geometry primitives (GeometryVoxelize,
// GeometryDevoxelize): the kernels of cpu/geometry_*.cpp on the CPU stream's
// encoder. Operands are float32 / int32 (the graph builders cast).
#include <vector>

#include "../primitives.h"
#include "eval.h"
#include "geometry_kernels.h"

namespace mlx_lattice {

void GeometryVoxelize::eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) {
  cpu::dispatch(
      stream(), inputs, outputs, [mode = mode_](std::vector<array>& in, std::vector<array>& out) {
        if (out[0].size() == 0) return;
        const int64_t n_voxels = static_cast<int64_t>(in[1].size()) - 1;
        geometry::voxel_reduce(in[0].data<float>(), in[0].shape(1), in[1].data<int32_t>(),
                               cpu::idx(in[2]), n_voxels, static_cast<geometry::Reduce>(mode),
                               out[0].data<float>(), out[1].data<int32_t>());
      });
}

void GeometryDevoxelize::eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) {
  cpu::dispatch(stream(), inputs, outputs,
                [face = face_, nearest = nearest_, n_voxels = n_voxels_](std::vector<array>& in,
                                                                         std::vector<array>& outs) {
                  auto& out = outs[0];
                  if (out.size() == 0) return;
                  const int64_t channels = in[0].shape(1);
                  const int64_t n_points = in[1].shape(0);
                  const float* weights = n_points ? in[2].data<float>() : nullptr;
                  if (face == kForward) {
                    geometry::devoxelize(in[0].data<float>(), channels, cpu::idx(in[1]), weights,
                                         cpu::idx(in[3]), n_points, nearest, out.data<float>());
                  } else {
                    geometry::devoxelize_transpose(
                        in[0].data<float>(), channels, cpu::idx(in[1]), weights, cpu::idx(in[3]),
                        cpu::idx(in[4]), cpu::idx(in[5]), n_voxels, nearest, out.data<float>());
                  }
                });
}

}  // namespace mlx_lattice
