// mlx_lattice's exported kernels from another module: a 2-point stationary
// convolution with one 1x1 weight per offset, checked against hand arithmetic.
#include <cstdio>
#include <vector>

#include "mlx_lattice/conv_forward.h"
#include "mlx_lattice/group_by.h"

int main() {
  namespace k = mlx_lattice::kernels;
  // Edges (input -> output, offset): 0->0 (k0), 1->0 (k1), 1->1 (k0).
  const std::vector<int32_t> out_of_edge = {0, 0, 1}, in_of_edge = {0, 1, 1}, offset = {0, 1, 0};
  std::vector<int32_t> offsets, edge_ids;
  k::group_by(out_of_edge.data(), 3, 2, offsets, edge_ids);
  const k::Csr csr{offsets.data(), edge_ids.data(), 2};
  const std::vector<float> features = {1.0f, 10.0f}, weights = {2.0f, 3.0f};
  std::vector<float> out(2, -1.0f);
  k::stationary_conv(features.data(), 1, weights.data(), 2, out.data(), 1, csr, in_of_edge.data(),
                     out_of_edge.data(), offset.data());
  // out[0] = 1*2 + 10*3 = 32, out[1] = 10*2 = 20.
  if (out[0] != 32.0f || out[1] != 20.0f) {
    std::fprintf(stderr, "stationary_conv gave %g %g, expected 32 20\n", out[0], out[1]);
    return 1;
  }
  std::printf("stationary_conv: %g %g\n", out[0], out[1]);
  return 0;
}
