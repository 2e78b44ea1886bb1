// The geometry Metal kernels (csrc/metal/geometry.metal), run through the MSL
// CPU harness with their encode plans, against the CPU kernels on seeded
// random inputs (empty voxels, missing corners, several batches). The seed
// is printed; rerun with GEOMETRY_SEED=<seed>.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "../csrc/cpu/geometry_kernels.h"
#include "../csrc/harness/harness.h"
#include "../csrc/metal/geometry_plans.h"

namespace geo = mlx_lattice::geometry;
namespace gpu = mlx_lattice::gpu;

namespace {

int failures = 0;
uint32_t seed = 0;

template <typename T>
gpu::Buffer buf(const std::vector<T>& v) {
  return gpu::Buffer{nullptr, v.empty() ? nullptr : v.data(), v.size() * sizeof(T)};
}

template <typename T>
void expect_equal(const char* what, const std::vector<T>& got, const std::vector<T>& want,
                  double tol) {
  if (got.size() != want.size()) {
    std::printf("FAIL %s: size %zu vs %zu (seed=%u)\n", what, got.size(), want.size(), seed);
    ++failures;
    return;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
    const bool both_nan = std::isnan(g) && std::isnan(w);
    if (!both_nan && !(std::fabs(g - w) <= tol * (1.0 + std::fabs(w)))) {
      std::printf("FAIL %s[%zu]: harness %.9g, cpu %.9g (seed=%u)\n", what, i, g, w, seed);
      ++failures;
      return;
    }
  }
  std::printf("ok   %s (%zu values)\n", what, got.size());
}

void run_case(std::mt19937& rng, int n_points, int batches, int channels, double drop) {
  std::uniform_real_distribution<double> coord(-2.0, 2.0);
  std::uniform_int_distribution<int> batch_of(0, batches - 1);
  std::normal_distribution<float> normal;
  std::vector<double> pts(3 * n_points);
  std::vector<int32_t> batch(n_points);
  for (auto& x : pts) x = coord(rng);
  for (auto& b : batch) b = batch_of(rng);
  const double size[3] = {0.5, 0.7, 0.6}, origin[3] = {0.1, -0.2, 0.0};

  // Voxel reduction over the occupied voxels, every mode.
  auto q = geo::quantize_points(pts.data(), batch.data(), n_points, size, origin);
  const auto& u = q.voxels;
  const auto n_voxels = static_cast<uint32_t>(u.offsets.size() - 1);
  std::vector<float> feats(static_cast<size_t>(n_points) * channels);
  for (auto& f : feats) f = normal(rng);
  for (uint32_t mode = 0; mode < 4; ++mode) {
    std::vector<float> cpu(n_voxels * channels), gpu_out(cpu.size());
    std::vector<int32_t> cpu_arg(cpu.size()), gpu_arg(cpu.size());
    geo::voxel_reduce(feats.data(), channels, u.offsets.data(), u.members.data(), n_voxels,
                      static_cast<geo::Reduce>(mode), cpu.data(), cpu_arg.data());
    auto enc = gpu::harness_encoder();
    gpu::encode_voxel_reduce(*enc, buf(feats), buf(u.offsets), buf(u.members), buf(gpu_out),
                             buf(gpu_arg), n_voxels, channels, mode);
    const std::string name = "voxel_reduce mode " + std::to_string(mode);
    expect_equal((name + " values").c_str(), gpu_out, cpu, 1e-6);
    if (mode >= 2) expect_equal((name + " picks").c_str(), gpu_arg, cpu_arg, 0.0);
  }

  // Devoxelize against a coordinate set with some voxels dropped (missing
  // corners, points with no voxel at all).
  std::vector<int32_t> coords;
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (size_t v = 0; v < n_voxels; ++v) {
    if (unit(rng) >= drop) coords.insert(coords.end(), &u.coords[4 * v], &u.coords[4 * v] + 4);
  }
  const auto kept = static_cast<uint32_t>(coords.size() / 4);
  auto m = geo::point_voxel_map(pts.data(), batch.data(), n_points, coords.data(), kept, size,
                                origin);
  std::vector<float> vf(static_cast<size_t>(kept) * channels), g(feats.size());
  for (auto& f : vf) f = normal(rng);
  for (auto& f : g) f = normal(rng);
  for (bool nearest : {false, true}) {
    std::vector<float> cpu(static_cast<size_t>(n_points) * channels), gpu_out(cpu.size());
    geo::devoxelize(vf.data(), channels, m.rows.data(), m.weights.data(), m.nearest.data(),
                    n_points, nearest, cpu.data());
    auto enc = gpu::harness_encoder();
    gpu::encode_devoxelize(*enc, buf(vf), buf(m.rows), buf(m.weights), buf(m.nearest),
                           buf(gpu_out), n_points, channels, nearest);
    expect_equal(nearest ? "devoxelize nearest" : "devoxelize linear", gpu_out, cpu, 1e-6);

    std::vector<float> cpu_t(static_cast<size_t>(kept) * channels), gpu_t(cpu_t.size());
    geo::devoxelize_transpose(g.data(), channels, m.rows.data(), m.weights.data(),
                              m.nearest.data(), m.offsets.data(), m.entries.data(), kept, nearest,
                              cpu_t.data());
    auto enc_t = gpu::harness_encoder();
    gpu::encode_devoxelize_transpose(*enc_t, buf(g), buf(m.weights), buf(m.nearest),
                                     buf(m.offsets), buf(m.entries), buf(gpu_t), kept, channels,
                                     nearest);
    expect_equal(nearest ? "devoxelize transpose nearest" : "devoxelize transpose linear", gpu_t,
                 cpu_t, 1e-6);
  }
}

}  // namespace

int main() {
  const char* env = std::getenv("GEOMETRY_SEED");
  seed = env ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10)) : std::random_device{}();
  std::printf("seed=%u (rerun with GEOMETRY_SEED=%u)\n", seed, seed);
  std::mt19937 rng(seed);
  run_case(rng, 1, 1, 3, 0.0);      // a single point
  run_case(rng, 300, 2, 5, 0.3);    // several batches, missing voxels
  run_case(rng, 200, 3, 40, 0.6);   // channels across threadgroups, many gaps
  std::printf(failures ? "FAILED (%d)\n" : "PASSED\n", failures);
  return failures ? 1 : 0;
}
