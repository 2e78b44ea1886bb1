// Generic sparse convolution kernels (float32), their gradients, the
// quantized convolution and the normalization denominator.
//
// One thread per output value, reducing in a fixed order (edges in CSR order,
// then channels ascending), so results do not depend on scheduling. Edges of
// output o are e in [out_offsets[o], out_offsets[o + 1]); grouped views of
// inputs and kernel offsets list edge ids.
#include <metal_stdlib>
using namespace metal;

struct ConvDims {
  uint n_rows;     // rows of the result
  uint cin;
  uint cout;
  uint n_kernels;
};

// out[o, c] = sum_e sum_i F[in_rows[e], i] * W[k_e, i, c]
kernel void mlxl_conv_forward(
    device const float* feats [[buffer(0)]],
    device const float* weight [[buffer(1)]],
    device const int* in_rows [[buffer(2)]],
    device const int* kernel_ids [[buffer(3)]],
    device const int* out_offsets [[buffer(4)]],
    device float* out [[buffer(5)]],
    constant ConvDims& d [[buffer(6)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint c = pos.x, o = pos.y;
  if (c >= d.cout || o >= d.n_rows) return;
  float acc = 0.0f;
  for (int e = out_offsets[o]; e < out_offsets[o + 1]; ++e) {
    device const float* f = feats + size_t(in_rows[e]) * d.cin;
    device const float* w = weight + size_t(kernel_ids[e]) * d.cin * d.cout + c;
    for (uint i = 0; i < d.cin; ++i) acc = fma(f[i], w[size_t(i) * d.cout], acc);
  }
  out[size_t(o) * d.cout + c] = acc;
}

// dF[i, c] = sum over edges of input i of sum_o G[out_e, o] * W[k_e, c, o]
// (d.cin = channels of dF, d.cout = channels of G).
kernel void mlxl_conv_input_grad(
    device const float* grad [[buffer(0)]],
    device const float* weight [[buffer(1)]],
    device const int* out_rows [[buffer(2)]],
    device const int* kernel_ids [[buffer(3)]],
    device const int* in_offsets [[buffer(4)]],
    device const int* in_edge_ids [[buffer(5)]],
    device float* out [[buffer(6)]],
    constant ConvDims& d [[buffer(7)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint c = pos.x, i = pos.y;
  if (c >= d.cin || i >= d.n_rows) return;
  float acc = 0.0f;
  for (int j = in_offsets[i]; j < in_offsets[i + 1]; ++j) {
    const int e = in_edge_ids[j];
    device const float* g = grad + size_t(out_rows[e]) * d.cout;
    device const float* w = weight + (size_t(kernel_ids[e]) * d.cin + c) * d.cout;
    for (uint o = 0; o < d.cout; ++o) acc = fma(g[o], w[o], acc);
  }
  out[size_t(i) * d.cin + c] = acc;
}

// dW[k, i, o] = sum over edges of offset k of F[in_e, i] * G[out_e, o]
kernel void mlxl_conv_weight_grad(
    device const float* feats [[buffer(0)]],
    device const float* grad [[buffer(1)]],
    device const int* in_rows [[buffer(2)]],
    device const int* out_rows [[buffer(3)]],
    device const int* k_offsets [[buffer(4)]],
    device const int* k_edge_ids [[buffer(5)]],
    device float* out [[buffer(6)]],
    constant ConvDims& d [[buffer(7)]],
    uint3 pos [[thread_position_in_grid]]) {
  const uint o = pos.x, i = pos.y, k = pos.z;
  if (o >= d.cout || i >= d.cin || k >= d.n_kernels) return;
  float acc = 0.0f;
  for (int j = k_offsets[k]; j < k_offsets[k + 1]; ++j) {
    const int e = k_edge_ids[j];
    acc = fma(feats[size_t(in_rows[e]) * d.cin + i], grad[size_t(out_rows[e]) * d.cout + o], acc);
  }
  out[(size_t(k) * d.cin + i) * d.cout + o] = acc;
}

struct QuantDims {
  uint n_rows;
  uint cin;
  uint cout;
  uint n_kernels;
  uint row_bytes;   // bytes of one packed (k, c) row
  uint groups;      // scale groups per row
  uint group_size;
  uint bits;
};

// The quantized weight value of offset k, output channel c, input channel i:
// bits-wide fields packed little-endian in a byte stream (mx.quantize).
inline float dequantized(device const uchar* packed, device const float* scales,
                         device const float* biases, constant QuantDims& d, uint k, uint c,
                         uint i) {
  const uint row = k * d.cout + c;
  device const uchar* p = packed + size_t(row) * d.row_bytes;
  const uint bit = i * d.bits;
  const uint byte = bit >> 3;
  uint v = p[byte];
  if (byte + 1 < d.row_bytes) v |= uint(p[byte + 1]) << 8;
  const float q = float((v >> (bit & 7)) & ((1u << d.bits) - 1u));
  const uint g = row * d.groups + i / d.group_size;
  return scales[g] * q + biases[g];
}

kernel void mlxl_quantized_conv_forward(
    device const float* feats [[buffer(0)]],
    device const uchar* packed [[buffer(1)]],
    device const float* scales [[buffer(2)]],
    device const float* biases [[buffer(3)]],
    device const int* in_rows [[buffer(4)]],
    device const int* kernel_ids [[buffer(5)]],
    device const int* out_offsets [[buffer(6)]],
    device float* out [[buffer(7)]],
    constant QuantDims& d [[buffer(8)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint c = pos.x, o = pos.y;
  if (c >= d.cout || o >= d.n_rows) return;
  float acc = 0.0f;
  for (int e = out_offsets[o]; e < out_offsets[o + 1]; ++e) {
    device const float* f = feats + size_t(in_rows[e]) * d.cin;
    const uint k = uint(kernel_ids[e]);
    for (uint i = 0; i < d.cin; ++i) {
      acc = fma(f[i], dequantized(packed, scales, biases, d, k, c, i), acc);
    }
  }
  out[size_t(o) * d.cout + c] = acc;
}

// out[o, c] = sum over edges of o of sum_i W[k_e, i, c]
kernel void mlxl_denominator(
    device const float* weight [[buffer(0)]],
    device const int* kernel_ids [[buffer(1)]],
    device const int* out_offsets [[buffer(2)]],
    device float* out [[buffer(3)]],
    constant ConvDims& d [[buffer(4)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint c = pos.x, o = pos.y;
  if (c >= d.cout || o >= d.n_rows) return;
  float acc = 0.0f;
  for (int e = out_offsets[o]; e < out_offsets[o + 1]; ++e) {
    device const float* w = weight + size_t(kernel_ids[e]) * d.cin * d.cout + c;
    float colsum = 0.0f;
    for (uint i = 0; i < d.cin; ++i) colsum += w[size_t(i) * d.cout];
    acc += colsum;
  }
  out[size_t(o) * d.cout + c] = acc;
}

// dS[k, c] = sum over edges e of offset k (kernel-CSR order) of G[out_e, c]
kernel void mlxl_denominator_grad(
    device const float* grad [[buffer(0)]],
    device const int* out_rows [[buffer(1)]],
    device const int* k_offsets [[buffer(2)]],
    device const int* k_edge_ids [[buffer(3)]],
    device float* out [[buffer(4)]],
    constant ConvDims& d [[buffer(5)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint c = pos.x, k = pos.y;
  if (c >= d.cout || k >= d.n_kernels) return;
  float acc = 0.0f;
  for (int j = k_offsets[k]; j < k_offsets[k + 1]; ++j) {
    acc += grad[size_t(out_rows[k_edge_ids[j]]) * d.cout + c];
  }
  out[size_t(k) * d.cout + c] = acc;
}
