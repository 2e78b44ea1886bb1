// CPU evaluation of the geometry primitives: allocate, then run the kernels
// of geometry_kernels.cpp on the CPU stream's encoder.
#include "../geometry_primitives.h"
#include "geometry_kernels.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_lattice {

void Voxelize::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (auto& out : outputs) encoder.set_output_array(out);
  encoder.dispatch([feats = mx::array::unsafe_weak_copy(inputs[0]),
                    offsets = mx::array::unsafe_weak_copy(inputs[1]),
                    members = mx::array::unsafe_weak_copy(inputs[2]),
                    out = mx::array::unsafe_weak_copy(outputs[0]),
                    arg = mx::array::unsafe_weak_copy(outputs[1]), mode = mode()]() mutable {
    const int64_t n_voxels = static_cast<int64_t>(offsets.size()) - 1;
    if (out.size() == 0) return;
    geometry::voxel_reduce(feats.data<float>(), feats.shape(1), offsets.data<int32_t>(),
                           members.size() ? members.data<int32_t>() : nullptr, n_voxels,
                           static_cast<geometry::Reduce>(mode), out.data<float>(),
                           arg.data<int32_t>());
  });
}

void Devoxelize::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  std::vector<mx::array> weak;
  for (const auto& in : inputs) weak.push_back(mx::array::unsafe_weak_copy(in));
  encoder.dispatch([in = std::move(weak), out = mx::array::unsafe_weak_copy(out), face = face_,
                    nearest = nearest_, n_voxels = n_voxels_]() mutable {
    if (out.size() == 0) return;
    const auto ptr = [](const mx::array& a) { return a.size() ? a.data<int32_t>() : nullptr; };
    const int64_t channels = in[0].shape(1);
    const int64_t n_points = in[1].shape(0);
    if (face == kForward) {
      geometry::devoxelize(in[0].data<float>(), channels, ptr(in[1]),
                           n_points ? in[2].data<float>() : nullptr, ptr(in[3]), n_points, nearest,
                           out.data<float>());
    } else {
      geometry::devoxelize_transpose(in[0].data<float>(), channels, ptr(in[1]),
                                     n_points ? in[2].data<float>() : nullptr, ptr(in[3]),
                                     ptr(in[4]), ptr(in[5]), n_voxels, nearest, out.data<float>());
    }
  });
}

}  // namespace mlx_lattice
