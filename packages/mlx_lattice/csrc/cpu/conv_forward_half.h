// The half-precision forward tile driver (cpu/conv_forward_half.cpp):
// float16 / bfloat16 feature rows widened inside the register blocks,
// float32 GEMM, the tile's outputs rounded once.
#pragma once

#include <cstdint>

#include "float_formats.h"
#include "gemm.h"
#include "group_by.h"

namespace mlx_lattice::kernels {

// out (n_out, cout) in `format` (kF16 or kBF16), overwritten: per tile of
// `tile_rows` outputs, the tile's edges are bucketed by offset as the
// float32 forward's are, each offset's rows run through gemm_rows_half
// (gemm.h: on AVX-512, each register block widens its rows to float32,
// exactly, 16 values at a time as it runs) or elsewhere gemm_rows_widened
// (a block's rows widened just before it runs), the
// tile accumulates in a float32 buffer (stationary_conv's arithmetic:
// offsets ascending, channels ascending), and the buffer is rounded to
// `format` once (nearest even). So the result is stationary_conv's float32
// result on the widened features, rounded; the same bits for any thread
// count. weight is (K, cin, cout) float32; csr is over the output rows
// (group g writes row g).
void half_rows_forward(const uint16_t* feats, FloatFormat format, int64_t cin,
                       const float* weight, int64_t n_kernels, int64_t cout, const Csr& csr,
                       const int32_t* a_index, const int32_t* kernel_ids, uint16_t* out,
                       int64_t tile_rows);

// The widening of a row of `format` values (kF16 or kBF16) to float32,
// exact, so every choice gives the same floats: 16 values per vcvtph2ps
// for float16 where AVX-512 is usable (under the MLX_LATTICE_GEMM_ISA
// ceiling), else convert_to_float32 (F16C or scalar; bfloat16 is a shift).
WidenRow row_widener(FloatFormat format);

}  // namespace mlx_lattice::kernels
