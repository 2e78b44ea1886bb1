// The AMX-BF16 weight gradient of the bf16 sparse convolution, a template
// on its tile policy (cpu/amx_tiles.h: TileHw, or the test model
// TileModel), with no MLX dependency; tile configuration and rounding from
// cpu/amx_bf16.h.
//
// Per kernel offset k (one task each): dW[k] (cin x cout, float32) = sum
// over the edges e of k, in kernel-CSR order, of F[in_rows[e]]^T
// G[out_rows[e]]: a GEMM whose inner dimension is the edges. The edges are
// taken in slabs of kSlabEdges; per slab the driver gathers
//   A: F's rows transposed, at[c][e] (cin rounded up to 16 rows, the slab's
//      edges rounded up to 32 columns; padding zero),
//   B: G's rows in TDPBF16PS's pair layout, bt[e / 2][x][e % 2] (cout
//      rounded up to 16 columns),
// and for each block of 16 channels and each strip of up to 64 columns
// loads the C tiles from the float32 accumulator, runs TDPBF16PS over the
// slab's chunks of 32 edges and stores them back (a load and store of
// float32 is exact, so slabs change nothing in the sums).
//
// Accumulation order, per dW element: edges in kernel-CSR order, in pairs
// (the tile model: even edge, then odd, one rounding per addition,
// subnormals flushed; the hardware may fuse or reorder inside an
// instruction). Error bound against the exact sum S of the n bf16 products
// (u = 2^-24): |dW - S| <= n u sum |products| (the float32 result is not
// rounded here; a bf16 weight's caller rounds it once, adding 2^-8 |S|).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_bf16.h"

namespace mlx_lattice::kernels::amx_bf16 {

constexpr int64_t kSlabEdges = 512;  // edges gathered at once (a multiple of 32)

struct WgradArgs {
  const uint16_t* f;  // (n_f, cin)
  int64_t n_f, cin;
  const uint16_t* g;  // (n_g, cout)
  int64_t n_g, cout;
  Csr kernel_csr;  // groups = K; edge_ids into in_rows / out_rows
  const int32_t* in_rows;
  const int32_t* out_rows;
};

struct WgradScratch {
  std::vector<uint16_t> at;   // cin_pad x kSlabEdges
  std::vector<uint16_t> bt;   // kSlabEdges / 2 x cout_pad x 2
  std::vector<float> acc;     // cin_pad x cout_pad
};

// Gathers the n edges of the kernel CSR from position sj into s.at
// (at[c][i], cin rows of kSlabEdges) and s.bt (bt[i / 2][x][i % 2], rows of
// cout_pad pairs), zero elsewhere; sized by the caller. Raises InputError on
// a row index out of range.
inline void gather_slab(const WgradArgs& p, int64_t sj, int64_t n, int64_t cout_pad,
                        WgradScratch& s) {
  std::fill(s.at.begin(), s.at.end(), 0);
  std::fill(s.bt.begin(), s.bt.end(), 0);
  // Raw pointers in locals: without strict aliasing each uint16 store
  // would reload the vectors' data pointers.
  uint16_t* const at = s.at.data();
  uint16_t* const bt = s.bt.data();
  const int64_t cin = p.cin, cout = p.cout;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = sj + i;
    const int32_t e = p.kernel_csr.edge_ids ? p.kernel_csr.edge_ids[j] : static_cast<int32_t>(j);
    const int32_t fi = p.in_rows[e];
    const int32_t gi = p.out_rows[e];
    if (fi < 0 || fi >= p.n_f || gi < 0 || gi >= p.n_g) {
      throw InputError("relation: a row index is out of range");
    }
    const uint16_t* fr = p.f + static_cast<int64_t>(fi) * cin;
    for (int64_t c = 0; c < cin; ++c) at[c * kSlabEdges + i] = fr[c];
    const uint16_t* gr = p.g + static_cast<int64_t>(gi) * cout;
    uint16_t* bp = bt + (i / 2) * cout_pad * 2 + i % 2;
    for (int64_t x = 0; x < cout; ++x) bp[2 * x] = gr[x];
  }
}

// dW[k] for offsets [k0, k1); dweight (K, cin, cout) float32, rows of those
// offsets overwritten.
template <class Tiles>
inline void run_wgrad(const WgradArgs& p, int64_t k0, int64_t k1, float* dweight,
                      WgradScratch& s) {
  const int64_t cin_pad = ceil_div(p.cin, 16) * 16;
  const int64_t cout_pad = ceil_div(p.cout, 16) * 16;
  const int64_t at_stride = kSlabEdges * 2;  // bytes per row of at
  const int64_t bt_stride = cout_pad * 4;    // bytes per pair row of bt
  const int64_t acc_stride = cout_pad * 4;   // bytes per row of acc
  s.at.resize(cin_pad * kSlabEdges);
  s.bt.resize(kSlabEdges / 2 * cout_pad * 2);
  s.acc.resize(cin_pad * cout_pad);
  if (k1 <= k0) return;
  amx::TileScope<Tiles> scope(bf16_tile_config());
  for (int64_t k = k0; k < k1; ++k) {
    std::fill(s.acc.begin(), s.acc.end(), 0.0f);
    const int64_t j0 = p.kernel_csr.offsets[k];
    const int64_t j1 = p.kernel_csr.offsets[k + 1];
    for (int64_t sj = j0; sj < j1; sj += kSlabEdges) {
      const int64_t n = std::min(kSlabEdges, j1 - sj);
      const int64_t chunks = ceil_div(n, 32);
      gather_slab(p, sj, n, cout_pad, s);
      const auto* at = reinterpret_cast<const uint8_t*>(s.at.data());
      const auto* bt = reinterpret_cast<const uint8_t*>(s.bt.data());
      for (int64_t c0 = 0; c0 < cin_pad; c0 += 16) {
        float* crow = s.acc.data() + c0 * cout_pad;
        for (int64_t n0 = 0; n0 < cout_pad; n0 += kStripCols) {
          const int nc = static_cast<int>(std::min<int64_t>(4, (cout_pad - n0) / 16));
          amx::load_strip<Tiles>(nc, crow + n0, acc_stride);
          for (int64_t ch = 0; ch < chunks; ++ch) {
            Tiles::template load<4>(at + c0 * at_stride + ch * 64, at_stride);
            amx::multiply_strip<Tiles, amx::Dot::kBf16ps>(nc, bt + ch * 16 * bt_stride + n0 * 4,
                                                          bt_stride);
          }
          amx::store_strip<Tiles>(nc, crow + n0, acc_stride);
        }
      }
    }
    float* dst = dweight + k * p.cin * p.cout;
    for (int64_t c = 0; c < p.cin; ++c) {
      std::memcpy(dst + c * p.cout, s.acc.data() + c * cout_pad, sizeof(float) * p.cout);
    }
  }
}

}  // namespace mlx_lattice::kernels::amx_bf16
