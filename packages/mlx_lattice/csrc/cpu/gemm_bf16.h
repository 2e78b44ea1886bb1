// bfloat16 sparse convolution forward with AVX512-BF16 (vdpbf16ps): bf16
// features and weights, float32 accumulation.
//
// Per output value the accumulation is, offsets ascending (output CSR sorted
// by offset) and channel pairs ascending inside an offset:
//   acc = acc + F[i, 2p + 1] * W[k, 2p + 1, x]   (exact product, one rounding)
//   acc = acc + F[i, 2p] * W[k, 2p, x]
// (vdpbf16ps's order; denormal inputs and results are flushed to zero). The
// result is the same bits for any thread count; it may differ in the last
// float32 bits from the float32 path (which adds channels in order), which
// machines without AVX512-BF16 use.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace mlx_lattice::kernels {

// Whether bf16_conv runs here (AVX512-BF16 present and allowed by
// MLX_LATTICE_GEMM_ISA); otherwise callers use the float32 path.
bool bf16_conv_available();

// out (n_out, cout) bfloat16, overwritten: out[o] = sum over edges e of o of
// F[a_index[e]] @ W[kernel_ids[e]], F bf16 (n_in, cin), W bf16 (K, cin, cout),
// accumulated in a float32 tile and rounded to bf16 (nearest even) once per
// tile. c_index must be the output CSR's own rows (a forward convolution).
void bf16_conv(const uint16_t* feats, int64_t n_in, int64_t cin, const uint16_t* weight,
               int64_t n_kernels, int64_t cout, const Csr& csr, const int32_t* a_index,
               const int32_t* c_index, const int32_t* kernel_ids, uint16_t* out);

}  // namespace mlx_lattice::kernels
