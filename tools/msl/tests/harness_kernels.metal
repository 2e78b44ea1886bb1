// Kernels that exercise the harness: collectives, threadgroup memory,
// 8x8 MMA, and two planted bugs the harness must catch.
#include <metal_stdlib>
using namespace metal;

// out[g] = sum of in over threadgroup g, through threadgroup memory.
kernel void group_sum(
    device const float* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    uint gid [[thread_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint group [[threadgroup_position_in_grid]],
    uint size [[threads_per_threadgroup]]) {
  threadgroup float partial[256];
  partial[lid] = in[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = size / 2; stride > 0; stride /= 2) {
    if (lid < stride) {
      partial[lid] += partial[lid + stride];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid == 0) {
    out[group] = partial[0];
  }
}

// The same with the first barrier removed: reads other threads' slots
// before they are written.
kernel void group_sum_missing_barrier(
    device const float* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    uint gid [[thread_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint group [[threadgroup_position_in_grid]],
    uint size [[threads_per_threadgroup]]) {
  threadgroup float partial[256];
  partial[lid] = in[gid];
  for (uint stride = size / 2; stride > 0; stride /= 2) {
    if (lid < stride) {
      partial[lid] += partial[lid + stride];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid == 0) {
    out[group] = partial[0];
  }
}

// A barrier only half the threadgroup reaches.
kernel void divergent_barrier(
    device float* out [[buffer(0)]],
    uint lid [[thread_index_in_threadgroup]]) {
  if (lid < 16) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[lid] = float(lid);
}

// Per simdgroup: sum, max, prefix sum and a shuffle.
kernel void simd_ops(
    device const float* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    uint gid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  float x = in[gid];
  float s = simd_sum(x);
  float m = simd_max(x);
  float p = simd_prefix_exclusive_sum(x);
  float sh = simd_shuffle(x, ushort(31 - lane));
  out[4 * gid + 0] = s;
  out[4 * gid + 1] = m;
  out[4 * gid + 2] = p;
  out[4 * gid + 3] = sh;
}

// C (8x8) = A (8x8) * B (8x8) + C with simdgroup_matrix, one simdgroup.
kernel void mma8(
    device const float* a [[buffer(0)]],
    device const half* b [[buffer(1)]],
    device float* c [[buffer(2)]]) {
  simdgroup_matrix<float, 8, 8> ma;
  simdgroup_matrix<half, 8, 8> mb;
  simdgroup_matrix<float, 8, 8> mc;
  simdgroup_load(ma, a, 8);
  simdgroup_load(mb, b, 8);
  simdgroup_load(mc, c, 8);
  simdgroup_multiply_accumulate(mc, ma, mb, mc);
  simdgroup_store(mc, c, 8);
}
