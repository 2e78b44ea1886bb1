// Generic sparse convolution kernels (float32), their gradients, the
// quantized convolutions (the static-int8 one with its fused epilogue) and
// the normalization denominator.
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

// ---- The static-scale integer convolution with its fused epilogue
// (cpu/gemm_int8.h: int8_conv_fused, Int8Epilogue): one thread per output
// value, its edges by offset ascending, groups ascending, each
// edge's group term in float32 one rounding per operation: the CPU
// kernels' sums, bit for bit.
struct FusedDims {
  uint n_rows;
  uint cin;
  uint cout;
  uint n_kernels;
  uint row_bytes;
  uint groups;
  uint group_size;
  uint bits;
  uint int8_input;  // feats are int8 codes (buffer 1), else floats (buffer 0)
  uint has_bias;
  uint residual;    // 0 none, 1 float (buffer 6), 2 int8 (buffer 7)
  uint relu;
  float in_scale;
  float residual_scale;
  float out_scale;  // > 0: int8 output
};

// The unsigned code of offset k, output channel c, input channel i.
inline int quant_code(device const uchar* packed, constant FusedDims& d, uint k, uint c, uint i) {
  device const uchar* p = packed + size_t(k * d.cout + c) * d.row_bytes;
  const uint bit = i * d.bits;
  const uint byte = bit >> 3;
  uint v = p[byte];
  if (byte + 1 < d.row_bytes) v |= uint(p[byte + 1]) << 8;
  return int((v >> (bit & 7)) & ((1u << d.bits) - 1u));
}

// No contraction of a product and a sum into one FMA from here on (Apple's
// compiler may otherwise fuse `dot * s` with `+ u` or the residual's scaled
// add): each operation rounds once, as the CPU kernels (built with
// -ffp-contract=off) round, so the outputs are the CPU's bits. Explicit fma()
// calls are unaffected. kMetalSources is one string, so this also holds for
// the sources embedded after this one, which then round as their CPU twins.
// Apple's compiler only: the CPU harness (tools/msl, g++, which knows no
// METAL pragma) builds with -ffp-contract=off, the same rule.
#ifdef __METAL_VERSION__
#pragma METAL fp contract(off)
#endif

// y of output row o, channel c, before its output conversion.
inline float fused_value(device const float* feats, device const char* codes,
                         device const uchar* packed, device const float* scales,
                         device const float* biases, device const float* bias,
                         device const float* res_f, device const char* res_q,
                         device const int* in_rows, device const int* kernel_ids,
                         device const int* out_offsets, constant FusedDims& d, uint o, uint c) {
  float acc = 0.0f;
  // Offsets ascending whatever the CSR order (a row has at most one edge
  // per offset): the order the CPU kernels sum in.
  for (uint k = 0; k < d.n_kernels; ++k) {
    int e = out_offsets[o];
    while (e < out_offsets[o + 1] && uint(kernel_ids[e]) != k) ++e;
    if (e == out_offsets[o + 1]) continue;
    const uint row = uint(in_rows[e]);
    device const float* f = feats + size_t(row) * d.cin;
    device const char* q = codes + size_t(row) * d.cin;
    // A float row with a non-finite value adds NaN (its codes are 0).
    bool finite = true;
    if (d.int8_input == 0) {
      for (uint i = 0; i < d.cin; ++i) finite = finite && (f[i] - f[i] == 0.0f);
    }
    for (uint g = 0; g < d.groups; ++g) {
      int dot = 0;
      int asum = 0;
      const uint c1 = min(d.cin, (g + 1) * d.group_size);
      for (uint i = g * d.group_size; finite && i < c1; ++i) {
        const int a = d.int8_input != 0 ? max(int(q[i]), -127)
                                        : int(rint(clamp(f[i] / d.in_scale, -127.0f, 127.0f)));
        dot += a * quant_code(packed, d, k, c, i);
        asum += a;
      }
      const uint gi = (k * d.cout + c) * d.groups + g;
      const float s = scales[gi] * d.in_scale;
      const float b = biases[gi] * d.in_scale;
      float t = float(dot) * s;
      const float u = float(asum) * b;
      t = t + u;
      acc = acc + (finite ? t : t * NAN);
    }
  }
  const size_t at = size_t(o) * d.cout + c;
  float y = acc;
  if (d.has_bias != 0) y = y + bias[c];
  if (d.residual == 1) y = y + res_f[at];
  if (d.residual == 2) {
    const float r = float(res_q[at]) * d.residual_scale;
    y = y + r;
  }
  if (d.relu != 0 && y < 0.0f) y = 0.0f;
  return y;
}

kernel void mlxl_int8_conv_fused_float(
    device const float* feats [[buffer(0)]],
    device const char* codes [[buffer(1)]],
    device const uchar* packed [[buffer(2)]],
    device const float* scales [[buffer(3)]],
    device const float* biases [[buffer(4)]],
    device const float* bias [[buffer(5)]],
    device const float* res_f [[buffer(6)]],
    device const char* res_q [[buffer(7)]],
    device const int* in_rows [[buffer(8)]],
    device const int* kernel_ids [[buffer(9)]],
    device const int* out_offsets [[buffer(10)]],
    device float* out [[buffer(11)]],
    constant FusedDims& d [[buffer(12)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint c = pos.x, o = pos.y;
  if (c >= d.cout || o >= d.n_rows) return;
  out[size_t(o) * d.cout + c] = fused_value(feats, codes, packed, scales, biases, bias, res_f,
                                            res_q, in_rows, kernel_ids, out_offsets, d, o, c);
}

// q = clamp(round_half_even(y / out_scale), -127, 127), NaN -> 0.
kernel void mlxl_int8_conv_fused_int8(
    device const float* feats [[buffer(0)]],
    device const char* codes [[buffer(1)]],
    device const uchar* packed [[buffer(2)]],
    device const float* scales [[buffer(3)]],
    device const float* biases [[buffer(4)]],
    device const float* bias [[buffer(5)]],
    device const float* res_f [[buffer(6)]],
    device const char* res_q [[buffer(7)]],
    device const int* in_rows [[buffer(8)]],
    device const int* kernel_ids [[buffer(9)]],
    device const int* out_offsets [[buffer(10)]],
    device char* out [[buffer(11)]],
    constant FusedDims& d [[buffer(12)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint c = pos.x, o = pos.y;
  if (c >= d.cout || o >= d.n_rows) return;
  const float v = fused_value(feats, codes, packed, scales, biases, bias, res_f, res_q, in_rows,
                              kernel_ids, out_offsets, d, o, c) / d.out_scale;
  out[size_t(o) * d.cout + c] = v != v ? char(0) : char(rint(clamp(v, -127.0f, 127.0f)));
}
