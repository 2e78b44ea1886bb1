// The shared first step of the output-stationary tile drivers (float32,
// half-precision, bf16 and int8 forward convolutions): a tile's edges
// grouped by kernel offset.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace mlx_lattice::kernels {

// The edges of one tile of CSR groups, grouped by kernel offset: the edges
// of offset k are edges[counts[k] : counts[k + 1]], in CSR order inside an
// offset (a stable counting sort). Reused across tiles by its owner thread.
struct TileEdges {
  std::vector<int32_t> counts;
  std::vector<int32_t> edges;
  std::vector<int32_t> cursor;

  int64_t size() const { return static_cast<int64_t>(edges.size()); }
};

// Fills `t` with the edges of groups [g0, g1) of `csr` (kernel_ids[e] in
// [0, n_kernels), validated by the relation).
void sort_tile_edges(const Csr& csr, int64_t g0, int64_t g1, const int32_t* kernel_ids,
                     int64_t n_kernels, TileEdges& t);

// Serial conversions of n values (the parallel to_float32 / from_float32 of
// kernels.h split their arrays into these), for per-tile use.
void convert_to_float32(const void* src, FloatFormat format, int64_t n, float* dst);
void convert_from_float32(const float* src, int64_t n, FloatFormat format, void* dst);

}  // namespace mlx_lattice::kernels
