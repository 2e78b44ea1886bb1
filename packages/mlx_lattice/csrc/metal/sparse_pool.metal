// Sparse pooling kernels (float32): forward (max/avg/sum), the tangent of
// max pooling, and the feature gradient. One thread per output value; the
// maximum is the first in edge order.
#include <metal_stdlib>
using namespace metal;

struct PoolDims {
  uint n_rows;    // rows of the result
  uint channels;
  uint mode;      // 0 max, 1 avg, 2 sum
};

inline int first_max_edge(device const float* feats, device const int* in_rows, int e0, int e1,
                          uint channels, uint c) {
  int best = e0;
  float value = feats[size_t(in_rows[e0]) * channels + c];
  for (int e = e0 + 1; e < e1; ++e) {
    const float v = feats[size_t(in_rows[e]) * channels + c];
    if (v > value) {
      value = v;
      best = e;
    }
  }
  return best;
}

kernel void mlxl_pool_forward(
    device const float* feats [[buffer(0)]],
    device const int* in_rows [[buffer(1)]],
    device const int* out_offsets [[buffer(2)]],
    device float* out [[buffer(3)]],
    constant PoolDims& d [[buffer(4)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint c = pos.x, o = pos.y;
  if (c >= d.channels || o >= d.n_rows) return;
  const int e0 = out_offsets[o], e1 = out_offsets[o + 1];
  float acc = 0.0f;
  if (e1 > e0) {
    acc = feats[size_t(in_rows[e0]) * d.channels + c];
    for (int e = e0 + 1; e < e1; ++e) {
      const float v = feats[size_t(in_rows[e]) * d.channels + c];
      acc = d.mode == 0 ? (v > acc ? v : acc) : acc + v;
    }
    if (d.mode == 1) acc *= 1.0f / float(e1 - e0);
  }
  out[size_t(o) * d.channels + c] = acc;
}

kernel void mlxl_pool_max_select(
    device const float* feats [[buffer(0)]],
    device const float* tangent [[buffer(1)]],
    device const int* in_rows [[buffer(2)]],
    device const int* out_offsets [[buffer(3)]],
    device float* out [[buffer(4)]],
    constant PoolDims& d [[buffer(5)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint c = pos.x, o = pos.y;
  if (c >= d.channels || o >= d.n_rows) return;
  const int e0 = out_offsets[o], e1 = out_offsets[o + 1];
  float v = 0.0f;
  if (e1 > e0) {
    const int e = first_max_edge(feats, in_rows, e0, e1, d.channels, c);
    v = tangent[size_t(in_rows[e]) * d.channels + c];
  }
  out[size_t(o) * d.channels + c] = v;
}

// dF[i, c] = sum over edges e of input i of the gradient reaching it
// (input-CSR order; out_of_edge maps an edge to its output row).
kernel void mlxl_pool_backward(
    device const float* grad [[buffer(0)]],
    device const float* feats [[buffer(1)]],
    device const int* in_rows [[buffer(2)]],
    device const int* out_rows [[buffer(3)]],
    device const int* out_offsets [[buffer(4)]],
    device const int* in_offsets [[buffer(5)]],
    device const int* in_edge_ids [[buffer(6)]],
    device float* out [[buffer(7)]],
    constant PoolDims& d [[buffer(8)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint c = pos.x, i = pos.y;
  if (c >= d.channels || i >= d.n_rows) return;
  float acc = 0.0f;
  for (int j = in_offsets[i]; j < in_offsets[i + 1]; ++j) {
    const int e = in_edge_ids[j];
    const int o = out_rows[e];
    const int e0 = out_offsets[o], e1 = out_offsets[o + 1];
    const float g = grad[size_t(o) * d.channels + c];
    if (d.mode == 0) {
      if (first_max_edge(feats, in_rows, e0, e1, d.channels, c) == e) acc += g;
    } else {
      acc += d.mode == 1 ? g * (1.0f / float(e1 - e0)) : g;
    }
  }
  out[size_t(i) * d.channels + c] = acc;
}
