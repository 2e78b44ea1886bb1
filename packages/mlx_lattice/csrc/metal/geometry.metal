// Geometry kernels (float32): devoxelize (trilinear / nearest) and its
// transpose, and the reduction of point features onto voxels. One thread per
// output value; every value reduces in the order of the CPU kernels
// (cpu/geometry_voxels.cpp), so the two agree to the bit in float32 when
// neither contracts multiply-adds.
#include <metal_stdlib>
using namespace metal;

struct GeoDims {
  uint rows;      // rows of the result (points or voxels)
  uint channels;
  uint mode;      // devoxelize: 0 linear, 1 nearest; reduce: 0 sum, 1 mean, 2 max, 3 first
};

kernel void mlxl_geo_devoxelize(
    device const float* vf [[buffer(0)]],
    device const int* rows [[buffer(1)]],
    device const float* weights [[buffer(2)]],
    device const int* nearest [[buffer(3)]],
    device float* out [[buffer(4)]],
    constant GeoDims& d [[buffer(5)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint c = pos.x, p = pos.y;
  if (c >= d.channels || p >= d.rows) return;
  float acc = 0.0f;
  if (d.mode == 1) {
    const int r = nearest[p];
    if (r >= 0) acc = vf[size_t(r) * d.channels + c];
  } else {
    for (uint k = 0; k < 8; ++k) {
      const int r = rows[size_t(p) * 8 + k];
      if (r < 0) continue;
      acc += weights[size_t(p) * 8 + k] * vf[size_t(r) * d.channels + c];
    }
  }
  out[size_t(p) * d.channels + c] = acc;
}

// out[v] = sum over the (point, corner) entries of voxel v, ascending.
kernel void mlxl_geo_devoxelize_transpose(
    device const float* g [[buffer(0)]],
    device const float* weights [[buffer(1)]],
    device const int* nearest [[buffer(2)]],
    device const int* offsets [[buffer(3)]],
    device const int* entries [[buffer(4)]],
    device float* out [[buffer(5)]],
    constant GeoDims& d [[buffer(6)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint c = pos.x, v = pos.y;
  if (c >= d.channels || v >= d.rows) return;
  float acc = 0.0f;
  for (int i = offsets[v]; i < offsets[v + 1]; ++i) {
    const int e = entries[i];
    const int p = e / 8;
    float w;
    if (d.mode == 1) {
      if (nearest[p] != int(v)) continue;
      w = 1.0f;
    } else {
      w = weights[e];
    }
    acc += w * g[size_t(p) * d.channels + c];
  }
  out[size_t(v) * d.channels + c] = acc;
}

// Point features onto voxels; arg gets the point max/first picked (-1 for an
// empty voxel). NaN wins a max, as on the CPU.
kernel void mlxl_geo_voxel_reduce(
    device const float* feats [[buffer(0)]],
    device const int* offsets [[buffer(1)]],
    device const int* members [[buffer(2)]],
    device float* out [[buffer(3)]],
    device int* arg [[buffer(4)]],
    constant GeoDims& d [[buffer(5)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint c = pos.x, v = pos.y;
  if (c >= d.channels || v >= d.rows) return;
  const int b = offsets[v], e = offsets[v + 1];
  const size_t o = size_t(v) * d.channels + c;
  if (b == e) {
    out[o] = 0.0f;
    arg[o] = -1;
    return;
  }
  if (d.mode >= 2) {
    int pick = members[b];
    float best = feats[size_t(pick) * d.channels + c];
    if (d.mode == 2) {
      for (int i = b + 1; i < e; ++i) {
        const float x = feats[size_t(members[i]) * d.channels + c];
        if (x > best || (x != x && best == best)) {
          best = x;
          pick = members[i];
        }
      }
    }
    out[o] = best;
    arg[o] = pick;
    return;
  }
  float acc = 0.0f;
  for (int i = b; i < e; ++i) acc += feats[size_t(members[i]) * d.channels + c];
  if (d.mode == 1) acc *= 1.0f / float(e - b);
  out[o] = acc;
  arg[o] = -1;
}
