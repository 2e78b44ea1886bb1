// Pooling over a relation's output CSR (cpu/pool.cpp).
#pragma once

#include <cstdint>

namespace mlx_lattice::kernels {

enum class PoolMode { kMax, kAvg, kSum };

// Pooling over the output CSR; outputs without edges are 0.
void pool_forward(const float* feats, int64_t channels, const int32_t* in_rows,
                  const int32_t* out_offsets, int64_t n_out, PoolMode mode, float* out);

// out[o, c] = tangent[argmax_e feats[in_rows[e], c]] (first maximum in edge order).
void pool_max_select(const float* feats, const float* tangent, int64_t channels,
                     const int32_t* in_rows, const int32_t* out_offsets, int64_t n_out,
                     float* out);

// Gradient of pool_forward with respect to its features (n_in rows).
void pool_backward(const float* grad, const float* feats, int64_t channels,
                   const int32_t* in_rows, const int32_t* out_offsets, int64_t n_out,
                   int64_t n_in, PoolMode mode, float* dfeats);

}  // namespace mlx_lattice::kernels
