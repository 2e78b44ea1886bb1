// An exact GPU hash of (batch, x, y, z) coordinate rows: open addressing over
// row ids. A slot holds -1 (empty) or a row; a row claims an empty slot with
// a 32-bit compare-exchange, and on a collision the full coordinates of the
// slot's row are compared (no lossy hashing). Equal rows share one slot, and
// atomic_fetch_min leaves each slot's smallest row in `minrow`, so every
// result is independent of the order threads ran in:
//   first[r] = the smallest row with coords[r]'s coordinates;
//   rows[i]  = that smallest row for queries[i], or -1.
// Four dispatches (clear, insert, resolve, query), each over fixed sizes;
// the table has a power-of-two number of slots >= 2 * n, so probing ends.
#include <metal_stdlib>
using namespace metal;

struct HashParams {
  uint n;     // coordinate rows
  uint q;     // query rows
  uint mask;  // slots - 1
};

inline uint mlxl_hash_row(device const int* c) {
  uint h = uint(c[0]) * 0x9E3779B1u;
  h ^= uint(c[1]) * 0x85EBCA77u + (h << 6) + (h >> 2);
  h ^= uint(c[2]) * 0xC2B2AE3Du + (h << 6) + (h >> 2);
  h ^= uint(c[3]) * 0x27D4EB2Fu + (h << 6) + (h >> 2);
  return h ^ (h >> 15);
}

inline bool mlxl_same_row(device const int* a, device const int* b) {
  return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

kernel void mlxl_hash_clear(
    device int* table [[buffer(0)]],
    device int* minrow [[buffer(1)]],
    constant HashParams& p [[buffer(2)]],
    uint i [[thread_position_in_grid]]) {
  if (i > p.mask) return;
  table[i] = -1;
  minrow[i] = 2147483647;
}

kernel void mlxl_hash_insert(
    device const int* coords [[buffer(0)]],
    device atomic_int* table [[buffer(1)]],
    device atomic_int* minrow [[buffer(2)]],
    device int* slot_of [[buffer(3)]],
    constant HashParams& p [[buffer(4)]],
    uint r [[thread_position_in_grid]]) {
  if (r >= p.n) return;
  device const int* c = coords + 4 * size_t(r);
  uint slot = mlxl_hash_row(c) & p.mask;
  for (uint probe = 0; probe <= p.mask; ++probe) {
    int expected = -1;
    bool placed = false;
    // The weak form may fail spuriously (expected stays -1): retry.
    while (!(placed = atomic_compare_exchange_weak_explicit(
                 &table[slot], &expected, int(r), memory_order_relaxed, memory_order_relaxed)) &&
           expected == -1) {
    }
    if (placed || mlxl_same_row(coords + 4 * size_t(expected), c)) {
      slot_of[r] = int(slot);
      atomic_fetch_min_explicit(&minrow[slot], int(r), memory_order_relaxed);
      return;
    }
    slot = (slot + 1) & p.mask;
  }
  slot_of[r] = -1;  // unreachable: the table has more slots than rows
}

kernel void mlxl_hash_resolve(
    device const int* slot_of [[buffer(0)]],
    device const int* minrow [[buffer(1)]],
    device int* first [[buffer(2)]],
    constant HashParams& p [[buffer(3)]],
    uint r [[thread_position_in_grid]]) {
  if (r >= p.n) return;
  const int slot = slot_of[r];
  first[r] = slot >= 0 ? minrow[slot] : int(r);
}

kernel void mlxl_hash_query(
    device const int* coords [[buffer(0)]],
    device const int* queries [[buffer(1)]],
    device const int* table [[buffer(2)]],
    device const int* minrow [[buffer(3)]],
    device int* rows [[buffer(4)]],
    constant HashParams& p [[buffer(5)]],
    uint i [[thread_position_in_grid]]) {
  if (i >= p.q) return;
  device const int* c = queries + 4 * size_t(i);
  uint slot = mlxl_hash_row(c) & p.mask;
  int found = -1;
  for (uint probe = 0; probe <= p.mask; ++probe) {
    const int s = table[slot];
    if (s < 0) break;
    if (mlxl_same_row(coords + 4 * size_t(s), c)) {
      found = minrow[slot];
      break;
    }
    slot = (slot + 1) & p.mask;
  }
  rows[i] = found;
}
