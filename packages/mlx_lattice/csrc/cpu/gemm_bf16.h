// Half-precision sparse convolution forward: bf16 or fp16 features and
// weights, float32 accumulation in a tile, rounded once per tile. One tile
// driver (cpu/gemm_bf16.cpp) with blocks by ISA level (cpu/isa.h):
//   bf16: amx-bf16 (TDPBF16PS, the output-stationary row driver of
//         cpu/amx_bf16.h, which states its own order and error bound),
//         avx512-bf16 (vdpbf16ps), neon-bf16 (BFMLALT/BFMLALB,
//         cpu/gemm_half_neon.inc); each also runs the feature gradient
//         (half_conv_transposed);
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

#include "float_formats.h"
#include "group_by.h"

namespace mlx_lattice::kernels {

// Whether half_conv runs `format` (kBF16 or kF16) here: a block for it
// present and allowed by MLX_LATTICE_GEMM_ISA; otherwise callers use the
// float32 path. Always false for kF32.
bool half_conv_available(FloatFormat format);

// The block's ISA name for `format` ("amx-bf16", "avx512-bf16", "neon-bf16" for bf16;
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

// Whether the feature gradient of a `format` convolution runs in `format`
// here (half_conv_transposed): bf16 wherever half_conv runs it (the
// amx-bf16 row driver, the avx512-bf16 and neon-bf16 blocks); elsewhere,
// and for fp16, callers widen to the float32 path.
bool half_conv_transposed_available(FloatFormat format);

// The feature gradient: out (n_in, cin) in `format`, overwritten: out[i] =
// sum over edges e of input row i of G[g_index[e]] @ W[kernel_ids[e]]^T,
// G (n_out, cout) and W (K, cin, cout) stored in `format`; csr is the
// input-side CSR of the relation (edge_ids into the edge arrays) and
// c_index[e] each edge's input row. The forward's order with the roles
// swapped: per input value, offsets ascending, then cotangent channel pairs
// ascending (2p + 1 before 2p) on the blocks; amx-bf16 in TDPBF16PS's
// order (cpu/amx_bf16.h). Does nothing where
// half_conv_transposed_available(format) is false.
void half_conv_transposed(FloatFormat format, const uint16_t* grad, int64_t n_out, int64_t cout,
                          const uint16_t* weight, int64_t n_kernels, int64_t cin, const Csr& csr,
                          const int32_t* g_index, const int32_t* c_index,
                          const int32_t* kernel_ids, uint16_t* out);

// Whether the weight gradient of a convolution with `format` features and
// cotangents runs on a half-precision kernel here (half_weight_grad): the
// amx-bf16 and avx512-bf16 drivers (bf16 only); elsewhere callers use the
// float32 path.
bool half_weight_grad_available(FloatFormat format);

// dW (K, cin, cout) float32, overwritten: dW[k] = sum over edges e of
// offset k (kernel_csr, edge_ids into the edge arrays) of F[in_rows[e]]^T
// G[out_rows[e]], F (n_in, cin) and G (n_out, cout) stored in `format`
// (cpu/amx_bf16_wgrad.h states the order and bound; avx512-bf16: the
// offset's edges in kernel-CSR order, in pairs, the odd edge's product
// added before the even's, float32, subnormals flushed). Does nothing where
// half_weight_grad_available(format) is false.
void half_weight_grad(FloatFormat format, const uint16_t* feats, int64_t n_in, int64_t cin,
                      const uint16_t* grad, int64_t n_out, int64_t cout, const Csr& kernel_csr,
                      const int32_t* in_rows, const int32_t* out_rows, float* dweight);

namespace amx_bf16 {
struct Rows;
struct Weights;
struct WgradArgs;
}  // namespace amx_bf16

// A bf16 row-block driver (cpu/amx_bf16.h's run_rows instantiated with a
// tile policy): output rows [g0, g1) of `csr`, out the whole output.
using Bf16RowsFn = void (*)(const amx_bf16::Rows& a, const amx_bf16::Weights& w, const Csr& csr,
                            const int32_t* a_index, const int32_t* kernel_ids, int64_t g0,
                            int64_t g1, uint16_t* out);

// The bf16 convolution with a given row-block driver instead of the chosen
// kernel (tests run the driver on the tile model this way): out (n_rows,
// cout') = per edge F[a_index[e]] @ W'[kernel_ids[e]] over the rows of
// `csr`, with W' = W (K, cin, cout) or, transpose_weight, each offset's
// W^T (K, cout, cin) (then the feature rows have cout channels and out has
// cin).
void bf16_conv_rows(Bf16RowsFn rows, const uint16_t* feats, int64_t n_in, int64_t cin,
                    const uint16_t* weight, int64_t n_kernels, int64_t cout, bool transpose_weight,
                    const Csr& csr, const int32_t* a_index, const int32_t* kernel_ids,
                    uint16_t* out);

// A bf16 weight-gradient driver (cpu/amx_bf16_wgrad.h's run_wgrad with a
// tile policy): the offsets p.order[k0 .. k1) of dweight (k0 .. k1 where
// p.order is null).
using Bf16WgradFn = void (*)(const amx_bf16::WgradArgs& p, int64_t k0, int64_t k1,
                             float* dweight);

// half_weight_grad with a given driver (tests run it on the tile model):
// one call per thread with its share of the offsets, balanced by edges;
// window_rows output rows per window of the AMX driver (<= 0: sized so a
// window's F and G rows fill about a quarter of L2).
void bf16_weight_grad_rows(Bf16WgradFn fn, const uint16_t* feats, int64_t n_in, int64_t cin,
                           const uint16_t* grad, int64_t n_out, int64_t cout,
                           const Csr& kernel_csr, const int32_t* in_rows,
                           const int32_t* out_rows, float* dweight, int64_t window_rows = 0);

// The AMX-BF16 drivers on the hardware (cpu/gemm_bf16_amx.cpp); nullptr
// where this build has none. Only call where isa_supported(kAmxBf16).
extern const Bf16RowsFn kAmxBf16RowsHw;
extern const Bf16WgradFn kAmxBf16WgradHw;

}  // namespace mlx_lattice::kernels
