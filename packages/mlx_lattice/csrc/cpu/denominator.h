// The normalisation denominator of a convolution and its gradient
// (cpu/denominator.cpp).
#pragma once

#include <cstdint>

namespace mlx_lattice::kernels {

// out[o] = sum over edges e of o of colsum(W[kernel_ids[e]]).
void normalization_denominator(const float* weight, int64_t n_kernels, int64_t cin,
                               int64_t cout, const int32_t* kernel_ids, const int32_t* out_offsets,
                               int64_t n_out, float* out);

// dS[k] = sum over edges e of offset k (in edge order) of G[out(e)]; (K, cout).
void denominator_gradient(const float* grad, int64_t cout, const int32_t* kernel_ids,
                          const int32_t* out_offsets, int64_t n_out, int64_t n_kernels,
                          float* out);

}  // namespace mlx_lattice::kernels
