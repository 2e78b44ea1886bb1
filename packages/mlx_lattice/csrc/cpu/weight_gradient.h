// The convolution's weight gradient (cpu/weight_gradient.cpp).
#pragma once

#include <cstdint>

#include "float_formats.h"
#include "group_by.h"

namespace mlx_lattice::kernels {

// dW[k] = sum over edges e of offset k of F[in_rows[e]]^T G[out_rows[e]].
// dW is (K, cin, cout), overwritten. The edges are cut into slabs by output
// row (how many and where depends on the relation and the sizes, never on
// the thread count); a slab's partial sums its edges of each offset in
// kernel-CSR order and the partials are added in slab order.
void weight_gradient(const float* feats, int64_t cin, const float* grad, int64_t cout,
                     const Csr& kernel_csr, const int32_t* in_rows, const int32_t* out_rows,
                     float* dweight);

// weight_gradient with F and G stored as `feats_format` / `grad_format`: a
// half-precision row is widened to float32 (exactly) as its chunk of edges is
// gathered, into a per-thread buffer of kChunk rows, never as a whole array.
// The micro-kernel and its order are the float32 path's, so dW is bit for bit
// weight_gradient on the arrays widened first.
void weight_gradient(const void* feats, FloatFormat feats_format, int64_t cin, const void* grad,
                     FloatFormat grad_format, int64_t cout, const Csr& kernel_csr,
                     const int32_t* in_rows, const int32_t* out_rows, float* dweight);

}  // namespace mlx_lattice::kernels
