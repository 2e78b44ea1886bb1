// Training-mode batch norm (+ optional ReLU) over the rows of (n, c)
// features, forward and closed-form backward (pure C++, no MLX).
//
// Rows are reduced in fixed blocks of kNormBlockRows: every block sums its
// rows in double in row order, and the blocks' partial sums are added in
// block order, so the thread count changes speed, never bits. Statistics are
// two-pass (mean, then the mean of squared deviations from it: no
// cancellation) in double; the per-element affine map runs in float32 and
// half-precision results are rounded to nearest even from that float32
// value (the same bits as casting the float32 result with MLX).
#pragma once

#include <cstdint>

#include "float_formats.h"

namespace mlx_lattice::kernels {

inline constexpr int64_t kNormBlockRows = 256;

// y = [relu]((x - mean) * scale + bias) with scale = weight / sqrt(var + eps)
// (float32 math on the float32 mean and scale); mean and the biased var come
// back (c,) float32.
// x and y are (n, c) in `format`; n >= 1.
void batch_norm_forward(const void* x, FloatFormat format, int64_t n, int64_t c,
                        const float* weight, const float* bias, float eps, bool relu, void* y,
                        float* mean, float* var);

// The affine map alone (batch_norm_forward's last pass; eval-mode batch norm
// with running statistics): y = [relu]((x - mean) * scale + bias) per
// element in float32, rounded once to `format`. Each element has one
// writer, so any thread count gives the same bits. n >= 0.
void batch_norm_affine(const void* x, FloatFormat format, int64_t n, int64_t c, const float* mean,
                       const float* scale, const float* bias, bool relu, void* y);

// The gradient of batch_norm_forward for the cotangent g of y (mean and var
// as it returned them; y only read when relu, where gradients pass through
// y > 0). dx in `format`, dweight and dbias (c,) float32.
void batch_norm_backward(const void* g, const void* x, const void* y, FloatFormat format,
                         int64_t n, int64_t c, const float* weight, const float* mean,
                         const float* var, float eps, bool relu, void* dx, float* dweight,
                         float* dbias);

}  // namespace mlx_lattice::kernels
