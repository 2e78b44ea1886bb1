// The AMX-BF16 weight gradient of the bf16 sparse convolution, a template
// on its tile policy (cpu/amx_tiles.h: TileHw, or the test model
// TileModel), with no MLX dependency; tile configuration and rounding from
// cpu/amx_bf16.h.
//
// dW[k] (cin x cout, float32) = sum over the edges e of offset k, in
// kernel-CSR order, of F[in_rows[e]]^T G[out_rows[e]]: a GEMM per offset
// whose inner dimension is the edges. A call takes a list of offsets (one
// thread's share) and walks windows of window_rows output rows: in each
// window, for each of its offsets, the next run of that offset's edges
// whose output rows lie in the window (found by binary search; edges whose
// output rows are not ascending within an offset are still each taken
// once, in order, only with less reuse). In a sorted voxel grid an
// offset's input rows lie near its output rows, so a window's F and G rows
// are read from memory once and then from L2 for every offset, instead of
// the whole of F and G once per offset. Each run is taken in slabs of
// kSlabEdges; per slab the driver gathers
//   A: F's rows transposed, at[c][e] (cin rounded up to 16 rows, the slab's
//      edges rounded up to 32 columns; padding zero),
//   B: G's rows in TDPBF16PS's pair layout, bt[e / 2][x][e % 2] (cout
//      rounded up to 16 columns),
// (the gather is a policy: GatherScalar, portable, or GatherAvx512, which
// interleaves edge pairs and transposes 16 x 16 blocks of them in
// registers; both write the same values wherever the tiles read),
// and for each block of 16 channels and each strip of up to 64 columns
// loads the C tiles from the offset's float32 accumulator, runs TDPBF16PS
// over the slab's chunks of 32 edges and stores them back (a load and
// store of float32 is exact, so slabs and windows change nothing in the
// sums).
//
// Accumulation order, per dW element: edges in kernel-CSR order, in pairs
// (the tile model: even edge, then odd, one rounding per addition,
// subnormals flushed; the hardware may fuse or reorder inside an
// instruction, whose pairs restart with each window's run). Error bound
// against the exact sum S of the n bf16 products (u = 2^-24):
// |dW - S| <= n u sum |products| (the float32 result is not rounded here;
// a bf16 weight's caller rounds it once, adding 2^-8 |S|).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "amx_bf16.h"
#include "line_vector.h"

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
  // The offsets a call's [k0, k1) indexes (nullptr: k itself).
  const int32_t* order = nullptr;
  // Output rows per window (<= 0: one window of every row).
  int64_t window_rows = 0;

  // The offset at position i of order.
  int64_t offset(int64_t i) const { return order ? order[i] : i; }
};

struct WgradScratch {
  LineVector<uint16_t> at;   // cin_pad x kSlabEdges
  LineVector<uint16_t> bt;   // kSlabEdges / 2 x cout_pad x 2
  LineVector<float> acc;     // per offset of the call: cin_pad x cout_pad
  std::vector<int64_t> next;  // per offset of the call: its first edge not yet taken
};

// The F and G rows of the edge at position j of the kernel CSR; raises
// InputError on a row index out of range.
struct EdgeRows {
  const uint16_t* f;
  const uint16_t* g;
};
inline EdgeRows edge_rows(const WgradArgs& p, int64_t j) {
  const int32_t e = p.kernel_csr.edge_ids ? p.kernel_csr.edge_ids[j] : static_cast<int32_t>(j);
  const int32_t fi = p.in_rows[e];
  const int32_t gi = p.out_rows[e];
  if (fi < 0 || fi >= p.n_f || gi < 0 || gi >= p.n_g) {
    throw InputError("relation: a row index is out of range");
  }
  return {p.f + static_cast<int64_t>(fi) * p.cin, p.g + static_cast<int64_t>(gi) * p.cout};
}

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
    const EdgeRows rows = edge_rows(p, sj + i);
    const uint16_t* fr = rows.f;
    for (int64_t c = 0; c < cin; ++c) at[c * kSlabEdges + i] = fr[c];
    const uint16_t* gr = rows.g;
    uint16_t* bp = bt + (i / 2) * cout_pad * 2 + i % 2;
    for (int64_t x = 0; x < cout; ++x) bp[2 * x] = gr[x];
  }
}

// The portable slab gather.
struct GatherScalar {
  static constexpr const char* kName = "scalar";
  static void slab(const WgradArgs& p, int64_t sj, int64_t n, int64_t cin_pad, int64_t cout_pad,
                   WgradScratch& s) {
    static_cast<void>(cin_pad);
    gather_slab(p, sj, n, cout_pad, s);
  }
};

#if defined(__x86_64__) || defined(_M_X64)
// GCC 12 reports the unpack and lane-shuffle intrinsics' own undefined
// pass-through operands as uninitialized; they are not read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// The slab gather in AVX-512 registers, 32 edges at a time: two edges'
// rows are interleaved into 32-bit pair words (bf16 pairs along the edges,
// TDPBF16PS's K layout), and for A each 16 x 16 block of pair words
// (pairs x channels) is transposed with unpacks and lane shuffles. It writes
// every element the tiles read (channels up to cin_pad and columns up to
// cout_pad, zero past cin and cout; edges up to the slab's chunks of 32,
// zero past n) and nothing else, so no buffer is cleared first.
//
// Its functions are left out of AddressSanitizer's instrumentation (not
// UBSan's): with detect_stack_use_after_return, GCC 12's runtime puts an
// instrumented function's frame on a fake stack without 64-byte alignment
// (fixed later in LLVM's runtime, llvm-project pull 152819), and an
// unoptimized build keeps these functions' 512-bit temporaries there, where
// their aligned moves fault. What goes unchecked: the masked loads of rows
// whose indices slab has validated, and the stores into the slab's own
// buffers, whose sizes the tests check through the tile model.
#define MLX_LATTICE_NO_ASAN_FRAME __attribute__((no_sanitize("address")))
struct GatherAvx512 {
  static constexpr const char* kName = "avx512";

  // Rows r[0..15] of 16 dwords become their transpose.
  MLX_LATTICE_NO_ASAN_FRAME __attribute__((target("avx512f"))) static void transpose16(
      __m512i* r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
      u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // Lane L of u[4 i + m] holds column 4 L + m of rows 4 i .. 4 i + 3.
    for (int m = 0; m < 4; ++m) {
      const __m512i x0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88);
      const __m512i x1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xdd);
      const __m512i y0 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
      const __m512i y1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xdd);
      r[m] = _mm512_shuffle_i32x4(x0, y0, 0x88);
      r[8 + m] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
      r[4 + m] = _mm512_shuffle_i32x4(x1, y1, 0x88);
      r[12 + m] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
    }
  }

  // Channels [c0, c0 + 32) of rows a and b (nullptr: a zero row; channels
  // past `width` zero) as pair words: lo holds channels c0..c0+15, hi the
  // next 16.
  MLX_LATTICE_NO_ASAN_FRAME __attribute__((target("avx512f,avx512bw"))) static void pairs(
      const uint16_t* a, const uint16_t* b, int64_t c0, int64_t width, __m512i& lo,
      __m512i& hi) {
    const int64_t cnt = std::clamp<int64_t>(width - c0, 0, 32);
    const __mmask32 mk = cnt == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << cnt) - 1u);
    const __m512i va = a ? _mm512_maskz_loadu_epi16(mk, a + c0) : _mm512_setzero_si512();
    const __m512i vb = b ? _mm512_maskz_loadu_epi16(mk, b + c0) : _mm512_setzero_si512();
    alignas(64) static constexpr uint16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                    37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                    53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                    27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    lo = _mm512_permutex2var_epi16(va, _mm512_load_si512(kLo), vb);
    hi = _mm512_permutex2var_epi16(va, _mm512_load_si512(kHi), vb);
  }

  MLX_LATTICE_NO_ASAN_FRAME __attribute__((target("avx512f,avx512bw"))) static void slab(
      const WgradArgs& p, int64_t sj, int64_t n, int64_t cin_pad, int64_t cout_pad,
      WgradScratch& s) {
    uint16_t* const at = s.at.data();
    uint16_t* const bt = s.bt.data();
    const int64_t blocks = ceil_div(n, 32);
    // Each block's F and G rows (scattered over the features and the
    // cotangent) are looked up and requested one block ahead: the loads of
    // a block's rows otherwise waited for memory, most of the call's time.
    const uint16_t* rows_f[2][32];
    const uint16_t* rows_g[2][32];
    auto look_up = [&p, sj, n](int64_t blk, const uint16_t** fr, const uint16_t** gr) {
      for (int i = 0; i < 32; ++i) {
        const int64_t idx = blk * 32 + i;
        fr[i] = gr[i] = nullptr;
        if (idx >= n) continue;
        const EdgeRows rows = edge_rows(p, sj + idx);
        fr[i] = rows.f;
        gr[i] = rows.g;
        prefetch_lines(rows.f, p.cin * 2);
        prefetch_lines(rows.g, p.cout * 2);
      }
    };
    if (blocks > 0) look_up(0, rows_f[0], rows_g[0]);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      if (blk + 1 < blocks) look_up(blk + 1, rows_f[(blk + 1) & 1], rows_g[(blk + 1) & 1]);
      const uint16_t* const* frow = rows_f[blk & 1];
      const uint16_t* const* grow = rows_g[blk & 1];
      // A: at[c][blk * 32 + i] = F row i's channel c.
      for (int64_t c0 = 0; c0 < cin_pad; c0 += 32) {
        __m512i lo[16], hi[16];
        for (int q = 0; q < 16; ++q) pairs(frow[2 * q], frow[2 * q + 1], c0, p.cin, lo[q], hi[q]);
        transpose16(lo);
        transpose16(hi);
        for (int r = 0; r < 16; ++r) {
          _mm512_storeu_si512(at + (c0 + r) * kSlabEdges + blk * 32, lo[r]);
        }
        if (c0 + 16 < cin_pad) {
          for (int r = 0; r < 16; ++r) {
            _mm512_storeu_si512(at + (c0 + 16 + r) * kSlabEdges + blk * 32, hi[r]);
          }
        }
      }
      // B: bt[pair][x][0 or 1], the pair's two G rows interleaved.
      for (int q = 0; q < 16; ++q) {
        uint16_t* row = bt + (blk * 16 + q) * cout_pad * 2;
        for (int64_t x0 = 0; x0 < cout_pad; x0 += 32) {
          __m512i lo, hi;
          pairs(grow[2 * q], grow[2 * q + 1], x0, p.cout, lo, hi);
          _mm512_storeu_si512(row + x0 * 2, lo);
          if (x0 + 16 < cout_pad) _mm512_storeu_si512(row + (x0 + 16) * 2, hi);
        }
      }
    }
  }
};
#undef MLX_LATTICE_NO_ASAN_FRAME
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

// Tiles a slab's chunks of 32 edges (s.at, s.bt) into the float32
// accumulator acc (cin_pad x cout_pad).
template <class Tiles>
inline void multiply_slab(const WgradScratch& s, int64_t chunks, int64_t cin_pad, int64_t cout_pad,
                          float* acc) {
  const int64_t at_stride = kSlabEdges * 2;  // bytes per row of at
  const int64_t bt_stride = cout_pad * 4;    // bytes per pair row of bt
  const int64_t acc_stride = cout_pad * 4;   // bytes per row of acc
  const auto* at = reinterpret_cast<const uint8_t*>(s.at.data());
  const auto* bt = reinterpret_cast<const uint8_t*>(s.bt.data());
  for (int64_t c0 = 0; c0 < cin_pad; c0 += 16) {
    float* crow = acc + c0 * cout_pad;
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

// dW for the offsets order[k0 .. k1) (k itself where p.order is null);
// dweight (K, cin, cout) float32, those offsets' rows overwritten.
template <class Tiles, class Gather = GatherScalar>
inline void run_wgrad(const WgradArgs& p, int64_t k0, int64_t k1, float* dweight,
                      WgradScratch& s) {
  const int64_t cin_pad = ceil_div(p.cin, 16) * 16;
  const int64_t cout_pad = ceil_div(p.cout, 16) * 16;
  const int64_t acc_size = cin_pad * cout_pad;
  const int64_t n_offsets = std::max<int64_t>(0, k1 - k0);
  s.at.resize(cin_pad * kSlabEdges);
  s.bt.resize(kSlabEdges / 2 * cout_pad * 2);
  s.acc.assign(n_offsets * acc_size, 0.0f);
  s.next.resize(n_offsets);
  if (n_offsets == 0) return;
  for (int64_t i = 0; i < n_offsets; ++i) s.next[i] = p.kernel_csr.offsets[p.offset(k0 + i)];
  const int64_t rows = p.window_rows > 0 ? p.window_rows : std::max<int64_t>(1, p.n_g);
  amx::TileScope<Tiles> scope(bf16_tile_config());
  // The last window takes every edge left, whatever its output row.
  for (int64_t r1 = rows;; r1 += rows) {
    const bool last = r1 >= p.n_g;
    for (int64_t i = 0; i < n_offsets; ++i) {
      const int64_t j1 = p.kernel_csr.offsets[p.offset(k0 + i) + 1];
      const int64_t end = last ? j1 : first_at_row(p.kernel_csr, p.out_rows, s.next[i], j1, r1);
      float* acc = s.acc.data() + i * acc_size;
      for (int64_t sj = s.next[i]; sj < end; sj += kSlabEdges) {
        const int64_t n = std::min(kSlabEdges, end - sj);
        Gather::slab(p, sj, n, cin_pad, cout_pad, s);
        multiply_slab<Tiles>(s, ceil_div(n, 32), cin_pad, cout_pad, acc);
      }
      s.next[i] = end;
    }
    if (last) break;
  }
  for (int64_t i = 0; i < n_offsets; ++i) {
    float* dst = dweight + p.offset(k0 + i) * p.cin * p.cout;
    for (int64_t c = 0; c < p.cin; ++c) {
      std::memcpy(dst + c * p.cout, s.acc.data() + i * acc_size + c * cout_pad,
                  sizeof(float) * p.cout);
    }
  }
}

}  // namespace mlx_lattice::kernels::amx_bf16
