// CPU evaluation of the geometry primitives (GeometryVoxelize,
// GeometryDevoxelize, GeometryKnn, GeometryMorton): the kernels of cpu/geometry_*.cpp on the CPU stream's
// encoder. Operands are float32 / int32 (the graph builders cast), except
// GeometryDevoxelize's features and output (float16 / bfloat16 too).
#include <algorithm>
#include <limits>
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
                  // Half-precision features widened, a half output rounded
                  // (exactly the casts the graph would otherwise hold).
                  const cpu::FloatIn x(in[0], 0);
                  cpu::FloatOut o(out);
                  if (face == kForward) {
                    geometry::devoxelize(x.get(), channels, cpu::idx(in[1]), weights,
                                         cpu::idx(in[3]), n_points, nearest, o.get());
                  } else {
                    geometry::devoxelize_transpose(x.get(), channels, cpu::idx(in[1]), weights,
                                                   cpu::idx(in[3]), cpu::idx(in[4]), n_voxels,
                                                   n_points, nearest, o.get());
                  }
                  o.finish();
                });
}

bool uses_metal_bodies(const mx::Stream& s) { return s.device == mx::Device::gpu; }

namespace {

// float64 points: the array's own data, or a converted copy.
const double* points64(const array& a, std::vector<double>& copy) {
  if (a.size() == 0) return nullptr;
  if (a.dtype() == mx::float64) return a.data<double>();
  copy.resize(a.size());
  const float* f = a.data<float>();
  for (size_t i = 0; i < a.size(); ++i) copy[i] = f[i];
  return copy.data();
}

}  // namespace

void GeometryKnn::eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) {
  cpu::dispatch(stream(), inputs, outputs,
                [k = k_, radius = radius_](std::vector<array>& in, std::vector<array>& out) {
                  const int64_t nq = in[0].shape(0), ns = in[2].shape(0);
                  std::vector<double> qcopy, scopy;
                  const double* q = points64(in[0], qcopy);
                  const double* sp = points64(in[2], scopy);
                  int32_t* rows = out[0].data<int32_t>();
                  float* d2 = out[1].data<float>();
                  if (radius <= 0.0) {
                    geometry::knn(q, cpu::idx(in[1]), nq, sp, cpu::idx(in[3]), ns, k, k, rows, d2);
                    return;
                  }
                  const auto nb = geometry::radius_search(q, cpu::idx(in[1]), nq, sp,
                                                          cpu::idx(in[3]), ns, radius, k);
                  for (int64_t i = 0; i < nq; ++i) {
                    const int32_t b = nb.offsets[i], n = nb.offsets[i + 1] - b;
                    for (int64_t j = 0; j < k; ++j) {
                      rows[i * k + j] = j < n ? nb.rows[b + j] : -1;
                      d2[i * k + j] = j < n ? static_cast<float>(nb.dist2[b + j])
                                            : std::numeric_limits<float>::infinity();
                    }
                  }
                });
}

void GeometryMorton::eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) {
  cpu::dispatch(stream(), inputs, outputs, [](std::vector<array>& in, std::vector<array>& out) {
    const auto codes = geometry::morton_codes(cpu::idx(in[0]), in[0].shape(0));
    std::copy(codes.begin(), codes.end(), out[0].data<int64_t>());
  });
}

}  // namespace mlx_lattice
