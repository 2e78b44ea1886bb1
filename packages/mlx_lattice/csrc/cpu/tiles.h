// The shared first step of the output-stationary tile drivers (float32,
// half-precision, bf16 and int8 forward convolutions): a tile's edges
// grouped by kernel offset.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "group_by.h"
#include "input_error.h"
#include "isa.h"
#include "parallel.h"

namespace mlx_lattice::kernels {

// Rows of `row_bytes` each that fill 1 / l2_share of this core's L2, as a
// power of two (at least 1).
inline int64_t l2_fill_rows(int64_t row_bytes, int64_t l2_share) {
  return static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(std::max<int64_t>(
      1, isa::l2_cache_bytes() / l2_share / std::max<int64_t>(row_bytes, 1)))));
}

// Output rows per tile (a driver's window) of `groups` rows whose float32
// sums take `row_bytes` each. `base` is the driver's size measured on cores
// with 0.5-1 MiB of L2 (the AMD hosts). Where a core has 2 MiB or more
// (current Xeons, every AMX host), the tile grows until its float32 rows
// fill 1 / l2_share of L2 (a power of two of rows): each offset then has
// more rows per tile (fewer partial blocks and batches, each offset's
// weight read once for more rows) and the rows still stay in L2. Never
// below `base`; grown only while every thread keeps 8 tiles to balance.
inline int64_t l2_tile_rows(int64_t row_bytes, int64_t base, int64_t groups, int64_t l2_share) {
  const int64_t l2 = isa::l2_cache_bytes();
  if (l2 < (int64_t{2} << 20)) return base;
  const int64_t fill = l2_fill_rows(row_bytes, l2_share);
  const int64_t balanced = groups / (8 * std::max(1, get_num_threads()));
  return std::max(base, std::min(fill, balanced));
}

// Calls fn(g0, g1) for each window [g0, g1) of `rows` consecutive groups
// of `groups` (the last one shorter), windows in parallel: the drivers'
// outer loop.
template <typename Fn>
void parallel_for_windows(int64_t groups, int64_t rows, Fn&& fn) {
  parallel_for(ceil_div(groups, rows), [&](int64_t window) {
    const int64_t g0 = window * rows;
    fn(g0, std::min(groups, g0 + rows));
  });
}

// Grows each of a driver's per-thread bucket arrays to at least `slots`
// entries (an offset's bucket of a window's rows per kernel offset), never
// shrinking them: the thread reuses them across windows.
template <typename... Buckets>
void fit_buckets(int64_t slots, Buckets&... buckets) {
  ((static_cast<int64_t>(buckets.size()) < slots ? buckets.resize(slots) : void()), ...);
}

// The edges of one tile of CSR groups, grouped by kernel offset: the edges
// of offset k are edges[counts[k] : counts[k + 1]], in CSR order inside an
// offset (a stable counting sort). Reused across tiles by its owner thread.
struct TileEdges {
  std::vector<int32_t> counts;
  std::vector<int32_t> edges;
  std::vector<int32_t> cursor;

  int64_t size() const { return static_cast<int64_t>(edges.size()); }
};

// Fills `t` with the edges of groups [g0, g1) of `csr` (kernel_ids[e] in
// [0, n_kernels), validated by the relation) and calls fill(slot, e) for
// every edge, in CSR order (so a driver's per-edge arrays are read in
// sequence, many loads in flight, rather than through the sorted slots).
template <typename Fill>
void sort_tile_edges(const Csr& csr, int64_t g0, int64_t g1, const int32_t* kernel_ids,
                     int64_t n_kernels, TileEdges& t, Fill&& fill) {
  const int64_t j0 = csr.offsets[g0];
  const int64_t j1 = csr.offsets[g1];
  t.counts.assign(n_kernels + 1, 0);
  t.edges.resize(j1 - j0);
  // Raw pointers in locals: the library builds with -fno-strict-aliasing,
  // so every int32 store would otherwise reload the vectors' data pointers.
  int32_t* counts = t.counts.data();
  int32_t* edges = t.edges.data();
  const int32_t* edge_ids = csr.edge_ids;
  if (edge_ids) {
    for (int64_t j = j0; j < j1; ++j) ++counts[kernel_ids[edge_ids[j]] + 1];
  } else {
    // The tile's offsets are one contiguous range: all its lines requested
    // at once rather than one miss at a time.
    prefetch_lines(kernel_ids + j0, (j1 - j0) * static_cast<int64_t>(sizeof(int32_t)));
    for (int64_t j = j0; j < j1; ++j) ++counts[kernel_ids[j] + 1];
  }
  for (int64_t k = 0; k < n_kernels; ++k) counts[k + 1] += counts[k];
  t.cursor.assign(t.counts.begin(), t.counts.end() - 1);
  int32_t* cursor = t.cursor.data();
  for (int64_t j = j0; j < j1; ++j) {
    const int32_t e = edge_ids ? edge_ids[j] : static_cast<int32_t>(j);
    const int32_t slot = cursor[kernel_ids[e]]++;
    edges[slot] = e;
    fill(slot, e);
  }
}

// What a tile pass raises when a bucket of g1 - g0 slots would overflow: a
// relation with two edges of one (group, offset). Out of line and cold, so
// the pass's loop keeps its registers.
[[noreturn, gnu::noinline, gnu::cold]] inline void throw_repeated_offset() {
  throw ::mlx_lattice::InputError("relation: a row has two edges with the same kernel offset");
}

// What a tile pass raises for a kernel offset outside [0, n_kernels).
[[noreturn, gnu::noinline, gnu::cold]] inline void throw_offset_out_of_range() {
  throw ::mlx_lattice::InputError("relation: a kernel offset is out of range");
}

// One pass over the edges of groups [g0, g1) of `csr` that buckets them by
// kernel offset without a counting pass: calls place(k, n, local, e) for
// edge e, the n-th edge of offset k in CSR order, which belongs to group
// g0 + local, and leaves each offset's edge count in count[0, n_kernels).
// A relation holds at most one edge per (group, offset) (validated for
// output rows when a relation is checked, and for input rows before a
// feature gradient is built), so n < g1 - g0 and a driver's buckets of
// g1 - g0 slots per offset cannot overflow; a tile that would overflow one
// raises std::invalid_argument (throw_repeated_offset) before anything is
// placed out of bounds; an offset outside [0, n_kernels) raises InputError
// before it indexes a bucket. Inside an offset the order is
// sort_tile_edges's (CSR order).
template <typename Place>
void bucket_tile_edges(const Csr& csr, int64_t g0, int64_t g1, const int32_t* kernel_ids,
                       int64_t n_kernels, int32_t* count, Place&& place) {
  const int32_t cap = static_cast<int32_t>(g1 - g0);
  std::fill(count, count + n_kernels, 0);
  const int32_t* offsets = csr.offsets;
  const int32_t* edge_ids = csr.edge_ids;
  for (int32_t local = 0; local < cap; ++local) {
    const int64_t end = offsets[g0 + local + 1];
    for (int64_t j = offsets[g0 + local]; j < end; ++j) {
      const int32_t e = edge_ids ? edge_ids[j] : static_cast<int32_t>(j);
      const int32_t k = kernel_ids[e];
      if (static_cast<uint64_t>(static_cast<uint32_t>(k)) >= static_cast<uint64_t>(n_kernels)) {
        throw_offset_out_of_range();
      }
      const int32_t n = count[k];
      if (n == cap) throw_repeated_offset();
      count[k] = n + 1;
      place(k, n, local, e);
    }
  }
}

// bucket_tile_edges for the drivers that gather rows by pointer: slot
// k * (g1 - g0) + n of a_ptrs names the input row of offset k's n-th edge
// (rows + a_index[e] * row_width) and the same slot of c_ptrs its output
// row in the tile (c + local * c_width).
template <typename T>
void bucket_row_pointers(const Csr& csr, int64_t g0, int64_t g1, const int32_t* kernel_ids,
                         int64_t n_kernels, int32_t* count, const T* rows,
                         const int32_t* a_index, int64_t row_width, float* c, int64_t c_width,
                         const T** a_ptrs, float** c_ptrs) {
  const int64_t cap = g1 - g0;
  // Captured by value: the library builds with -fno-strict-aliasing, so
  // through references every pointer store would reload them.
  bucket_tile_edges(csr, g0, g1, kernel_ids, n_kernels, count,
                    [=](int32_t k, int32_t n, int32_t local, int32_t e) {
                      const int64_t slot = k * cap + n;
                      a_ptrs[slot] = rows + static_cast<int64_t>(a_index[e]) * row_width;
                      c_ptrs[slot] = c + static_cast<int64_t>(local) * c_width;
                    });
}

}  // namespace mlx_lattice::kernels
