// Weights quantized by mx.quantize (group-affine, packed codes): the one
// reader of a packed code, and the dequantization to float32
// (cpu/quantized_weight.cpp).
#pragma once

#include <cstdint>

// Functions whose documented rounding is "after the product and after the
// sum" (the weight dequantization s * q + b): no fused multiply-add
// contraction, which GCC applies by default on AArch64 and which would make
// the values differ from the float reference there.
#if defined(__clang__)
#define MLX_LATTICE_NO_CONTRACT
#define MLX_LATTICE_NO_CONTRACT_BODY _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define MLX_LATTICE_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#define MLX_LATTICE_NO_CONTRACT_BODY
#else
#define MLX_LATTICE_NO_CONTRACT
#define MLX_LATTICE_NO_CONTRACT_BODY
#endif

namespace mlx_lattice::kernels {

// A group-affine quantized weight in mx.quantize's layout: packed codes
// (K, cout, row_bytes), `bits` each little-endian over rows of storage_in
// values, scales and biases (K, cout, storage_in / group_size).
struct QuantizedWeightView {
  const uint8_t* packed = nullptr;
  int64_t row_bytes = 0;
  const float* scales = nullptr;
  const float* biases = nullptr;
  int64_t storage_in = 0;
  int64_t group_size = 0;
  int bits = 8;
};

// Code `c` of one packed row of mx.quantize's layout (`bits` per value,
// little-endian, `row_bytes` bytes): the value's bits start at bit c * bits
// and span at most two bytes (bits <= 8); the second byte is read only when
// it lies inside the row.
inline uint32_t unpack_code(const uint8_t* row, int64_t row_bytes, int64_t c, int bits) {
  const int64_t bit = c * bits;
  const int64_t byte = bit >> 3;
  uint32_t v = row[byte];
  if (byte + 1 < row_bytes) v |= static_cast<uint32_t>(row[byte + 1]) << 8;
  return (v >> (bit & 7)) & ((1u << bits) - 1u);
}

// The float32 weight (K, cin, cout) of a quantized weight (mx.quantize's
// group-affine layout): s * q + b, rounded after the product and after the
// sum. Offsets in parallel, each offset's codes re-laid out as (cin, cout)
// and dequantized as one panel (AVX-512 where usable).
void dequantize_weight_panels(const QuantizedWeightView& weight, int64_t n_kernels, int64_t cin,
                              int64_t cout, float* out);

}  // namespace mlx_lattice::kernels
