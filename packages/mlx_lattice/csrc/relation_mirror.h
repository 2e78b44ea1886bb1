// The edge pass of a sorted symmetric relation (relation_builder.cpp's
// mirrored path): each row's edges before the kernel's centre are written
// with their mirrors, both groupings at once. Three builds of the same code:
// one with the POPCNT instruction (every x86-64 CPU with AVX2, and AArch64),
// that one with each row's kernel ids compressed by AVX-512 (x86-64 with
// AVX-512F), and a portable one; mirror_kernels() picks per CPU and ISA
// ceiling (MLX_LATTICE_GEMM_ISA).
#pragma once

#include <cstdint>

namespace mlx_lattice {

// One tile's inputs and the relation's arrays (rows [t * tile, (t + 1) *
// tile) of n are the tile's).
struct MirrorTile {
  const uint32_t* masks;       // (n,) each row's offset mask, centre included
  const int32_t* half;         // (n, K / 2) each row's neighbours before the centre
  const int32_t* out_offsets;  // (n + 1,) each row's first edge
  const int32_t* k_offsets;    // (K + 1,) each offset's first slot in k_edge_ids
  const int32_t* k_slot;       // (tiles, K / 2 + 1) each tile's first slot per offset
  int32_t* in_rows;
  int32_t* out_rows;
  int32_t* kernel_ids;
  int32_t* in_edge_ids;
  int32_t* k_edge_ids;
  int64_t n, n_kernels, tile;
};

struct MirrorKernels {
  // counts[o] = the number of edges of row o (its mask's set bits), o in
  // [o0, o1), and k_counts[k] = the number of those rows whose mask has bit
  // k, for k in [0, centre] (centre < 32).
  void (*count)(const uint32_t* masks, int64_t o0, int64_t o1, int32_t* counts, int centre,
                int32_t* k_counts);
  // Writes tile t's edges, their mirrors and both groupings' entries.
  void (*write)(const MirrorTile& m, int64_t t);
};

// The AVX-512 writer at the avx512f level, the POPCNT kernels when the CPU
// has the instruction (on x86-64 as part of the avx2-fma level, so an ISA
// ceiling of `scalar` takes the portable ones), else the portable ones. The
// results are the same bits.
MirrorKernels mirror_kernels();

}  // namespace mlx_lattice
