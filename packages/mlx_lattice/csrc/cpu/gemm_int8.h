// Integer sparse convolution (w8a8 and w4a8): int8 activations quantized per
// row times the unsigned integer codes of a group-affine quantized weight,
// accumulated exactly in int32 (AVX512-VNNI / AVX-VNNI vpdpbusd, or scalar),
// with a float32 epilogue.
//
// The math, for output row o, edge e = (i -> o, offset k), column x and
// weight group g (channels [g * gs, (g + 1) * gs)):
//   a[i, c]  = clamp(rint(F[i, c] / sa[i]), -127, 127),  sa[i] = max|F[i]| / 127
//   acc      = sum_{c in g} q[k, x, c] * a[i, c]              (int32, exact)
//   asum     = sum_{c in g} a[i, c]                           (int32, exact)
//   t        = float(acc) * s[k, x, g]
//   t        = t + float(asum) * b[k, x, g]
//   out[o,x] = out[o, x] + t * sa[i]
// in float32 with one rounding per operation (no fused multiply-add), groups
// ascending inside offsets ascending (the output CSR sorted by offset).
//
// With a static activation scale S (act_scale > 0) every row is quantized
// with S (a[i, c] = rint(clamp(F[i, c] / S, -127, 127))) and S is folded into
// the weight's scales and biases once per call, so no edge multiplies by an
// activation scale:
//   s' = s[k, x, g] * S,  b' = b[k, x, g] * S                 (float32)
//   t  = float(acc) * s' + float(asum) * b'
//   out[o,x] = out[o, x] + t
// A row with a non-finite value adds t * NaN instead. Since
// w = s * q + b, t * sa is the edge's contribution with the weight's exact
// dequantized values; the weight codes are the unsigned vpdpbusd operand, so
// no offset correction is needed and the bias term uses the exact row sums.
// Every ISA path performs these same operations: results are the same bits
// on every path and for any thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "float_formats.h"
#include "group_by.h"

namespace mlx_lattice::kernels {

// Quantizes rows of x (n, c) to int8 with one symmetric scale per row:
// q (n, stride) with zeros in [c, stride), scale (n), gsum (n, stride / group)
// the per-group sums of q. A row with a non-finite value gets scale NaN and
// q = 0 (its contributions become NaN, as in float arithmetic). With
// static_scale > 0 every row uses that scale (values beyond 127 steps
// saturate) and scale[i] is 1 (NaN for a non-finite row).
// nonneg (n), when given: nonneg[i] = 1 where row i of q has no negative
// code (a ReLU's output, the usual input of a layer: the AVX2 kernel then
// takes the codes as vpmaddubsw's unsigned operand), else 0; marked while
// the row is still in the cache.
void quantize_rows_int8(const float* x, int64_t n, int64_t c, int64_t stride, int64_t group,
                        int8_t* q, float* scale, int32_t* gsum, float static_scale = 0.0f,
                        uint8_t* nonneg = nullptr);

// The integer convolution over the output CSR `csr` of the edges (a_index:
// input rows, kernel_ids: offsets; c_index: output rows, the CSR groups
// themselves, so not read; an output row has at most one edge per offset,
// std::invalid_argument otherwise), with the weight in
// mx.quantize's affine layout (packed codes (K, cout, storage_in * bits / 8
// bytes), scales and biases (K, cout, storage_in / group)). out (n_out, cout)
// is overwritten. group % 4 == 0; bits in 1..8. act_scale: 0 for dynamic
// per-row scales, else the static activation scale (finite, > 0).
void int8_conv(const float* feats, int64_t n_in, int64_t cin, const uint8_t* packed,
               int64_t row_bytes, const float* scales, const float* biases, int64_t n_kernels,
               int64_t cout, int64_t storage_in, int64_t group, int bits, float act_scale,
               const Csr& csr,
               const int32_t* a_index, const int32_t* c_index, const int32_t* kernel_ids,
               float* out);

// Rows of int8 codes already quantized at a static scale (the previous
// layer's requantized output): q (n, stride) with zeros in [c, stride),
// the per-group sums gsum (n, stride / group), scale[i] = 1. A code of -128
// reads as -127 (the symmetric range every kernel path sums exactly).
// nonneg as quantize_rows_int8's.
void load_rows_int8(const int8_t* x, int64_t n, int64_t c, int64_t stride, int64_t group,
                    int8_t* q, float* scale, int32_t* gsum, uint8_t* nonneg = nullptr);

// 1 where the n codes at q hold no negative one, else 0.
inline uint8_t codes_nonneg(const int8_t* q, int64_t n) {
  uint8_t bits = 0;
  for (int64_t i = 0; i < n; ++i) bits |= static_cast<uint8_t>(q[i]);
  return (bits & 0x80u) == 0;
}

// The fused epilogue of int8_conv_fused, per output row o and column x, on
// the float32 sum acc[o, x] that int8_conv computes (in float32, one
// rounding per operation, no fused multiply-add, in this order):
//   y = acc[o, x] + bias[x]                               (bias given)
//   y = y + residual[o, x]                                (float32 residual)
//   y = y + float(rq[o, x]) * residual_scale              (int8 residual)
//   y = y < 0 ? +0 : y                                    (relu; NaN stays)
// then out_scale == 0: out[o, x] = y rounded to out_format (nearest even);
// out_scale > 0: out[o, x] = int8 q with
//   q = clamp(round_half_even(y / out_scale), -127, 127),   NaN -> 0
// (the division of quantize_rows_int8's static path: the codes equal those
// the next layer would compute from the float output; +-inf saturate).
struct Int8Epilogue {
  const float* bias = nullptr;     // (cout) or none
  const void* residual = nullptr;  // (n_out, cout) float32 or int8, or none
  bool residual_int8 = false;
  float residual_scale = 0.0f;  // the int8 residual's scale (> 0)
  bool relu = false;
  float out_scale = 0.0f;  // > 0: int8 output at this static scale
  FloatFormat out_format = FloatFormat::kF32;  // float output's format
};

// Output rows [r0, r1) of the epilogue: acc holds their float32 sums
// ((r1 - r0) x cout, overwritten with y), out the whole output, or null
// for a float32 output that acc itself is (y stays there). The residual
// must not share memory with acc.
void int8_epilogue_rows(float* acc, int64_t r0, int64_t r1, int64_t cout, const Int8Epilogue& ep,
                        void* out);

// The weight in the kernels' layout, with the static input scale folded
// into its scales and biases (gemm_int8.cpp), for the kernel chosen for
// (cin, cout): packed once and reused across calls (the fused op keeps it
// in the weight cache, weight_cache.h).
struct PackedInt8Weight;
std::shared_ptr<const PackedInt8Weight> pack_int8_weight(
    const uint8_t* packed, int64_t row_bytes, const float* scales, const float* biases,
    int64_t n_kernels, int64_t cout, int64_t cin, int64_t storage_in, int64_t group, int bits,
    float in_scale);
size_t packed_int8_weight_bytes(const PackedInt8Weight& w);

// Whether the kernel chosen now for (cin, cout) reads the centered form of
// `bits`-bit codes (a packed weight's layout depends on it: cache keys).
bool int8_weight_centered(int64_t cin, int64_t cout, int bits);

// int8_conv with a static activation scale in_scale (> 0) and the fused
// epilogue: feats are float32 rows quantized with in_scale, or (codes not
// null, feats null) int8 codes already at in_scale. out: (n_out, cout) in
// the epilogue's output type. weight: the weight packed by pack_int8_weight
// with the same arguments, or null (packed for this call); one packed for
// another kernel (the ISA cap changed) is packed again.
void int8_conv_fused(const float* feats, const int8_t* codes, int64_t n_in, int64_t cin,
                     const uint8_t* packed, int64_t row_bytes, const float* scales,
                     const float* biases, int64_t n_kernels, int64_t cout, int64_t storage_in,
                     int64_t group, int bits, float in_scale, const Csr& csr,
                     const int32_t* a_index, const int32_t* kernel_ids, const Int8Epilogue& ep,
                     void* out, const PackedInt8Weight* weight = nullptr);

// Name of the int8 micro-kernel in use ("amx-int8", "avx512-vnni",
// "avx-vnni", "avx2-fma", "scalar"; AArch64's "neon-i8mm", "neon-dotprod"), chosen per
// call under the ISA ceiling (cpu/isa.h). Where it is "amx-int8",
// convolutions of at most 32 channels in and out run "avx512-vnni"
// (faster there; the same bits).
const char* int8_isa();

namespace amx_int8 {
struct Rows;
struct Weights;
}  // namespace amx_int8

// A row-block driver (cpu/amx_int8.h's run_rows instantiated with a tile
// policy): output rows [g0, g1) of `csr`, out the whole output.
using Int8RowsFn = void (*)(const amx_int8::Rows& a, const amx_int8::Weights& w,
                            int64_t group, const Csr& csr, const int32_t* a_index,
                            const int32_t* kernel_ids, int64_t g0, int64_t g1, float* out);

// int8_conv with a given row-block driver instead of the chosen kernel:
// tests and the AMX check run the drivers with the tile model this way.
void int8_conv_rows(Int8RowsFn rows, const float* feats, int64_t n_in, int64_t cin,
                    const uint8_t* packed, int64_t row_bytes, const float* scales,
                    const float* biases, int64_t n_kernels, int64_t cout, int64_t storage_in,
                    int64_t group, int bits, float act_scale, const Csr& csr,
                    const int32_t* a_index, const int32_t* kernel_ids, float* out);

// int8_conv_fused with a given row-block driver (the tests run the AMX
// driver on the tile model this way, epilogue included).
void int8_conv_rows_fused(Int8RowsFn rows, const float* feats, const int8_t* codes, int64_t n_in,
                          int64_t cin, const uint8_t* packed, int64_t row_bytes,
                          const float* scales, const float* biases, int64_t n_kernels,
                          int64_t cout, int64_t storage_in, int64_t group, int bits,
                          float in_scale, const Csr& csr, const int32_t* a_index,
                          const int32_t* kernel_ids, const Int8Epilogue& ep, void* out);

// The AMX-INT8 driver on the hardware (cpu/gemm_int8_amx.cpp); nullptr
// where this build has none. Only call where isa_supported(kAmxInt8).
extern const Int8RowsFn kAmxInt8RowsHw;

}  // namespace mlx_lattice::kernels
