// The half-precision forward tile driver (cpu/conv_forward_half.cpp):
// float16 / bfloat16 feature rows widened per register block, float32 GEMM,
// the tile's outputs rounded once.
#pragma once

#include <cstdint>

#include "float_formats.h"
#include "group_by.h"

namespace mlx_lattice::kernels {

// out (n_out, cout) in `format` (kF16 or kBF16), overwritten: per tile of
// `tile_rows` outputs, the tile's edges are bucketed by offset as the
// float32 forward's are, each offset's rows run through gemm_rows_widened
// (gemm.h: a register block's rows widened to float32, exactly, just
// before the block runs, the next block's rows requested meanwhile), the
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

#if defined(__x86_64__) || defined(_M_X64)
// float16 -> float32 of n values (exact), 16 per AVX-512 vcvtph2ps, the
// tail through a zero-padded copy and a masked store. Call it where
// isa_usable(kAvx512) holds.
void widen_f16_avx512(const uint16_t* src, int64_t n, float* dst);
#endif

}  // namespace mlx_lattice::kernels
