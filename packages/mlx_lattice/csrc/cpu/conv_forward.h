// The output-stationary float convolutions (cpu/conv_forward.cpp): float32
// rows gathered by pointer, or half-precision rows widened per register
// block.
#pragma once

#include <cstdint>

#include "float_formats.h"
#include "group_by.h"

namespace mlx_lattice::kernels {

// Stationary conv: for every group g (a row of C) and edge e in it,
//   C[c_index[e]] += A[a_index[e]] @ B[kernel_ids[e]]
// with B a stack of (a_width x c_width) matrices. C rows are zeroed first.
// Forward conv: groups = outputs, A = features, C = output.
// Input gradient: groups = inputs, A = output gradient, C = feature gradient,
// B = transposed weights.
// c_index[e] must be e's group (the CSR groups C's rows); the tiles address
// C by group and do not read it.
void stationary_conv(const float* a, int64_t a_width, const float* b, int64_t n_kernels,
                     float* c, int64_t c_width, const Csr& csr, const int32_t* a_index,
                     const int32_t* c_index, const int32_t* kernel_ids);

// The forward stationary_conv with features and output stored as `format`:
// half-precision input rows are converted to float32 per register block as
// the tile's GEMMs gather them, and the tile's output rows accumulate in a
// float32 buffer rounded to `format` once (nearest even). The arithmetic is
// stationary_conv's, so the result is its float32 result rounded. c_index
// must be the output CSR's own rows.
void forward_conv(const void* feats, FloatFormat format, int64_t cin, const float* weight,
                  int64_t n_kernels, int64_t cout, const Csr& csr, const int32_t* a_index,
                  const int32_t* c_index, const int32_t* kernel_ids, void* out);

}  // namespace mlx_lattice::kernels
