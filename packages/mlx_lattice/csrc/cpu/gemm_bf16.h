// Half-precision sparse convolution forward: bf16 or fp16 features and
// weights, float32 accumulation in a tile, rounded once per tile. One tile
// driver (cpu/gemm_bf16.cpp) with blocks by ISA level (cpu/isa.h):
//   bf16: avx512-bf16 (vdpbf16ps), neon-bf16 (BFMLALT/BFMLALB,
//         cpu/gemm_half_neon.inc);
//   fp16: neon-fhm (FMLAL/FMLAL2).
//
// bf16, per output value, offsets ascending (output CSR sorted by offset) and
// channel pairs ascending inside an offset:
//   acc = acc + F[i, 2p + 1] * W[k, 2p + 1, x]   (exact product, one rounding)
//   acc = acc + F[i, 2p] * W[k, 2p, x]
// (vdpbf16ps's order; vdpbf16ps flushes subnormal inputs and results to
// zero, BFMLAL does not). The result is the same bits for any thread count;
// it may differ in the last float32 bits from the float32 path (which adds
// channels in order), which machines without a bf16 block use.
//
// fp16: channels ascending, acc = acc + F[i, c] * W[k, c, x] with the exact
// product and one rounding: the float32 FMA path's chain on the widened
// inputs, so the same bits as the float32 path wherever it fuses.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace mlx_lattice::kernels {

// Whether half_conv runs `format` (kBF16 or kF16) here: a block for it
// present and allowed by MLX_LATTICE_GEMM_ISA; otherwise callers use the
// float32 path. Always false for kF32.
bool half_conv_available(FloatFormat format);

// The block's ISA name for `format` ("avx512-bf16", "neon-bf16" for bf16;
// "neon-fhm" for fp16), or "float32".
const char* half_isa(FloatFormat format);

// out (n_out, cout) in `format`, overwritten: out[o] = sum over edges e of o
// of F[a_index[e]] @ W[kernel_ids[e]], F (n_in, cin) and W (K, cin, cout)
// stored in `format`, accumulated in a float32 tile and rounded (nearest
// even) once per tile. c_index must be the output CSR's own rows (a forward
// convolution). Does nothing where half_conv_available(format) is false.
void half_conv(FloatFormat format, const uint16_t* feats, int64_t n_in, int64_t cin,
               const uint16_t* weight, int64_t n_kernels, int64_t cout, const Csr& csr,
               const int32_t* a_index, const int32_t* c_index, const int32_t* kernel_ids,
               uint16_t* out);

}  // namespace mlx_lattice::kernels
