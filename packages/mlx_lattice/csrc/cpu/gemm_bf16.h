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

// Whether bf16_conv runs here (a bf16 block present and allowed by
// MLX_LATTICE_GEMM_ISA); otherwise callers use the float32 path.
bool bf16_conv_available();

// The bf16 block's ISA name ("avx512-bf16", "neon-bf16"), or "float32".
const char* bf16_isa();

// out (n_out, cout) bfloat16, overwritten: out[o] = sum over edges e of o of
// F[a_index[e]] @ W[kernel_ids[e]], F bf16 (n_in, cin), W bf16 (K, cin, cout),
// accumulated in a float32 tile and rounded to bf16 (nearest even) once per
// tile. c_index must be the output CSR's own rows (a forward convolution).
void bf16_conv(const uint16_t* feats, int64_t n_in, int64_t cin, const uint16_t* weight,
               int64_t n_kernels, int64_t cout, const Csr& csr, const int32_t* a_index,
               const int32_t* c_index, const int32_t* kernel_ids, uint16_t* out);

// The same for float16 (FEAT_FHM's FMLAL/FMLAL2; "neon-fhm" or "float32").
bool fp16_conv_available();
const char* fp16_isa();
void fp16_conv(const uint16_t* feats, int64_t n_in, int64_t cin, const uint16_t* weight,
               int64_t n_kernels, int64_t cout, const Csr& csr, const int32_t* a_index,
               const int32_t* c_index, const int32_t* kernel_ids, uint16_t* out);

}  // namespace mlx_lattice::kernels
