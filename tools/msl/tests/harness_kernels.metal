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

// Atomics. counters[0] += 1 per thread (old values to order[gid]),
// counters[1] = max gid, counters[2] = min gid, counters[3] exchanged to
// the gid (the last writer stays); per threadgroup, a threadgroup atomic
// counts its threads into group_counts[group].
kernel void atomic_counter(
    device atomic_uint* counters [[buffer(0)]],
    device uint* order [[buffer(1)]],
    device uint* group_counts [[buffer(2)]],
    uint gid [[thread_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint group [[threadgroup_position_in_grid]]) {
  threadgroup atomic_uint local;
  if (lid == 0) {
    atomic_store_explicit(&local, 0u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  order[gid] = atomic_fetch_add_explicit(&counters[0], 1u, memory_order_relaxed);
  atomic_fetch_max_explicit(&counters[1], gid, memory_order_relaxed);
  atomic_fetch_min_explicit(&counters[2], gid, memory_order_relaxed);
  atomic_exchange_explicit(&counters[3], gid, memory_order_relaxed);
  atomic_fetch_add_explicit(&local, 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 0) {
    group_counts[group] = atomic_load_explicit(&local, memory_order_relaxed);
  }
}

// Open addressing with compare-exchange: each thread inserts keys[gid]
// into a table of `slots` entries (-1 = empty; an entry holds a row whose
// key it stands for), writes its slot to slot_of[gid], and lowers
// first[slot] to its row: afterwards first[slot_of[i]] is the first row
// with keys[i]'s value.
kernel void atomic_hash_insert(
    device const int* keys [[buffer(0)]],
    device atomic_int* table [[buffer(1)]],
    device atomic_int* first [[buffer(2)]],
    device int* slot_of [[buffer(3)]],
    constant uint& n [[buffer(4)]],
    constant uint& slots [[buffer(5)]],
    uint gid [[thread_position_in_grid]]) {
  if (gid >= n) {
    return;
  }
  const int key = keys[gid];
  uint slot = uint(key * 7 + 3) % slots;
  for (uint probe = 0; probe < slots; ++probe) {
    int expected = -1;
    bool placed = false;
    while (!(placed = atomic_compare_exchange_weak_explicit(
                 &table[slot], &expected, int(gid), memory_order_relaxed, memory_order_relaxed)) &&
           expected == -1) {
    }
    if (placed || keys[expected] == key) {
      slot_of[gid] = int(slot);
      atomic_fetch_min_explicit(&first[slot], int(gid), memory_order_relaxed);
      return;
    }
    slot = (slot + 1) % slots;
  }
  slot_of[gid] = -1;
}

// Planted bug: an increment made of a separate atomic load and store.
kernel void atomic_lost_update(
    device atomic_uint* counter [[buffer(0)]],
    uint gid [[thread_position_in_grid]]) {
  uint seen = atomic_load_explicit(counter, memory_order_relaxed);
  atomic_store_explicit(counter, seen + 1u, memory_order_relaxed);
}

// Planted race for ThreadSanitizer: a plain (non-atomic) increment.
kernel void plain_counter(
    device uint* counter [[buffer(0)]],
    uint gid [[thread_position_in_grid]]) {
  counter[0] += 1u;
}
