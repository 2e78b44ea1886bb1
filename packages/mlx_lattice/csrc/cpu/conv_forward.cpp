// The output-stationary tile drivers of the float convolutions:
// stationary_conv (float32 rows gathered by pointer) and forward_conv
// (half-precision rows converted per tile).
#include <algorithm>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_LATTICE_X86 1
#endif

#include "gemm.h"
#include "isa.h"
#include "kernels.h"
#include "parallel.h"
#include "tiles.h"

namespace mlx_lattice::kernels {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Per-thread scratch of the tile loops, reused across calls.
struct Scratch {
  TileEdges edges;
  std::vector<const float*> a_ptrs;
  std::vector<float*> c_ptrs;
  std::vector<int32_t> in_rows;
  // A tile's distinct input rows (in order of first use) and, per input
  // row, its slot among them or -1: every entry is -1 between tiles.
  std::vector<int32_t> distinct;
  std::vector<int32_t> row_slot;
  std::vector<float> rows;  // a tile's converted input rows, one per distinct row
  std::vector<float> tile;  // a tile's float32 output rows
  std::vector<float> panel;  // one offset's dequantized weight
};

thread_local Scratch scratch;

// Output rows per tile for rows `width` values wide: kTileRows from 64 up;
// narrower rows take more (up to 4 x kTileRows at 32 and below), so an
// offset gets more rows per tile: fewer partial register blocks and less
// per-tile work per edge where each edge's arithmetic is smallest.
int64_t tile_rows_for(int64_t width) {
  if (width >= 64) return kTileRows;
  return std::min<int64_t>(4 * kTileRows, kTileRows * 128 / std::max<int64_t>(width, 1));
}

// gemm_rows over every offset of a tile whose pointer lists are filled;
// panel(k) gives offset k's (a_width x c_width) matrix.
template <typename Panel>
void tile_gemm(Scratch& s, Panel&& panel, int64_t n_kernels, int64_t a_width, int64_t c_width) {
  for (int64_t k = 0; k < n_kernels; ++k) {
    const int64_t begin = s.edges.counts[k];
    const int64_t rows = s.edges.counts[k + 1] - begin;
    if (rows > 0) {
      gemm_rows(rows, s.a_ptrs.data() + begin, panel(k), a_width, c_width,
                s.c_ptrs.data() + begin);
    }
  }
}

// The forward tile loop over tiles of `tile_rows` outputs: float32 rows
// are read in place and written straight to `out`; half-precision rows are
// converted per tile and the tile's float32 outputs rounded once.
template <typename Panel>
void forward_tiles(const void* feats, FloatFormat format, int64_t cin, Panel&& panel,
                   int64_t n_kernels, int64_t cout, const Csr& csr, const int32_t* a_index,
                   const int32_t* c_index, const int32_t* kernel_ids, void* out,
                   int64_t tile_rows) {
  const bool wide = format == FloatFormat::kF32;
  const uint16_t* f = static_cast<const uint16_t*>(feats);
  const int64_t tiles = ceil_div(csr.groups, tile_rows);
  parallel_for(tiles, [&](int64_t tile) {
    const int64_t g0 = tile * tile_rows;
    const int64_t g1 = std::min(csr.groups, g0 + tile_rows);
    auto& s = scratch;
    float* c = wide ? static_cast<float*>(out) + g0 * cout : nullptr;
    if (wide) {
      std::memset(c, 0, sizeof(float) * (g1 - g0) * cout);
    } else {
      s.tile.assign((g1 - g0) * cout, 0.0f);
      c = s.tile.data();
    }
    if (csr.offsets[g1] > csr.offsets[g0]) {
      const int64_t n_tile = csr.offsets[g1] - csr.offsets[g0];
      s.a_ptrs.resize(n_tile);
      s.c_ptrs.resize(n_tile);
      s.in_rows.resize(n_tile);
      int32_t* in_rows = s.in_rows.data();
      float** c_ptrs = s.c_ptrs.data();
      sort_tile_edges(csr, g0, g1, kernel_ids, n_kernels, s.edges, [&](int32_t slot, int32_t e) {
        in_rows[slot] = a_index[e];
        c_ptrs[slot] = c + (static_cast<int64_t>(c_index[e]) - g0) * cout;
      });
      if (wide) {
        const float* a = static_cast<const float*>(feats);
        for (int64_t slot = 0; slot < n_tile; ++slot) {
          s.a_ptrs[slot] = a + static_cast<int64_t>(s.in_rows[slot]) * cin;
        }
      } else {
        // A row feeds up to K edges of a tile: each distinct row is
        // converted once and its edges point at that copy (the values, so
        // the results, are the same as converting it per edge).
        if (static_cast<int64_t>(s.rows.size()) < n_tile * cin) s.rows.resize(n_tile * cin);
        s.distinct.resize(n_tile);
        int32_t* distinct = s.distinct.data();
        int32_t* row_slot = s.row_slot.data();
        int64_t n_rows = 0;
        const float** a_ptrs = s.a_ptrs.data();
        float* rows = s.rows.data();
        for (int64_t slot = 0; slot < n_tile; ++slot) {
          const int32_t r = in_rows[slot];  // in [0, n_in): checked by the relation
          if (r >= static_cast<int64_t>(s.row_slot.size())) {
            s.row_slot.resize(std::max<size_t>(r + 1, 2 * s.row_slot.size()), -1);
            row_slot = s.row_slot.data();
          }
          int32_t m = row_slot[r];
          if (m < 0) {
            m = static_cast<int32_t>(n_rows);
            row_slot[r] = m;
            distinct[n_rows++] = r;
          }
          a_ptrs[slot] = rows + static_cast<int64_t>(m) * cin;
        }
        // Rows kAhead rows ahead are requested while this one converts
        // (the gathered rows are otherwise fetched one latency at a time).
        constexpr int64_t kAhead = 8;
        auto prefetch = [&](int64_t i) {
          if (i >= n_rows) return;
          const char* p = reinterpret_cast<const char*>(f + static_cast<int64_t>(distinct[i]) * cin);
          for (int64_t b = 0; b < cin * 2; b += 64) __builtin_prefetch(p + b);
        };
        for (int64_t i = 0; i < kAhead; ++i) prefetch(i);
        for (int64_t i = 0; i < n_rows; ++i) {
          prefetch(i + kAhead);
          convert_to_float32(f + static_cast<int64_t>(distinct[i]) * cin, format, cin,
                             rows + i * cin);
          row_slot[distinct[i]] = -1;
        }
      }
      tile_gemm(s, panel, n_kernels, cin, cout);
    }
    if (!wide) {
      convert_from_float32(c, (g1 - g0) * cout, format, static_cast<uint16_t*>(out) + g0 * cout);
    }
  });
}

// A quantized weight's codes re-laid out per call as (K, cin, cout) bytes,
// scales and biases as (K, groups, cout): the panel of one offset then
// dequantizes with contiguous vector loads.
struct Codes {
  std::vector<uint8_t> q;
  std::vector<float> s;
  std::vector<float> b;
};

void unpack_codes(const QuantizedWeightView& w, int64_t n_kernels, int64_t cin, int64_t cout,
                  Codes& out) {
  const int64_t groups = w.storage_in / w.group_size;
  out.q.resize(n_kernels * cin * cout);
  out.s.resize(n_kernels * groups * cout);
  out.b.resize(n_kernels * groups * cout);
  parallel_for(n_kernels, [&](int64_t k) {
    for (int64_t o = 0; o < cout; ++o) {
      const int64_t row = k * cout + o;
      const uint8_t* p = w.packed + row * w.row_bytes;
      for (int64_t c = 0; c < cin; ++c) {
        out.q[(k * cin + c) * cout + o] =
            static_cast<uint8_t>(unpack_code(p, w.row_bytes, c, w.bits));
      }
      for (int64_t g = 0; g < groups; ++g) {
        out.s[(k * groups + g) * cout + o] = w.scales[row * groups + g];
        out.b[(k * groups + g) * cout + o] = w.biases[row * groups + g];
      }
    }
  });
}

// panel[c, x] = s[g, x] * q[c, x] + b[g, x] (g = c / group), rounded after
// the product and after the sum: dequantize_weight's values.
MLX_LATTICE_NO_CONTRACT void dequantize_panel_scalar(const uint8_t* q, const float* s,
                                                     const float* b, int64_t cin, int64_t cout,
                                                     int64_t group, float* panel) {
  MLX_LATTICE_NO_CONTRACT_BODY
  for (int64_t c = 0; c < cin; ++c) {
    const float* sg = s + (c / group) * cout;
    const float* bg = b + (c / group) * cout;
    for (int64_t x = 0; x < cout; ++x) {
      panel[c * cout + x] = sg[x] * static_cast<float>(q[c * cout + x]) + bg[x];
    }
  }
}

#ifdef MLX_LATTICE_X86
__attribute__((target("avx512f"))) void dequantize_panel_avx512(const uint8_t* q, const float* s,
                                                                const float* b, int64_t cin,
                                                                int64_t cout, int64_t group,
                                                                float* panel) {
  for (int64_t c = 0; c < cin; ++c) {
    const float* sg = s + (c / group) * cout;
    const float* bg = b + (c / group) * cout;
    const uint8_t* qc = q + c * cout;
    float* pc = panel + c * cout;
    int64_t x = 0;
    for (; x + 16 <= cout; x += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qc + x));
      const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
      __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sg + x), codes);
      asm("" : "+v"(v));  // no fused multiply-add: the product rounds on its own
      _mm512_storeu_ps(pc + x, _mm512_add_ps(v, _mm512_loadu_ps(bg + x)));
    }
    for (; x < cout; ++x) pc[x] = sg[x] * static_cast<float>(qc[x]) + bg[x];
  }
}
#endif

// Per-thread buckets of stationary_conv's tiles: offset k's rows are
// a_ptrs / c_ptrs[k * cap, k * cap + count[k]) for tiles of cap rows.
struct Buckets {
  std::vector<const float*> a_ptrs;
  std::vector<float*> c_ptrs;
  std::vector<int32_t> count;
};

thread_local Buckets buckets;

}  // namespace

void stationary_conv(const float* a, int64_t a_width, const float* b, int64_t n_kernels,
                     float* c, int64_t c_width, const Csr& csr, const int32_t* a_index,
                     const int32_t* /*c_index: each group's own row*/, const int32_t* kernel_ids) {
  const int64_t tile_rows = tile_rows_for(c_width);
  const int64_t tiles = ceil_div(csr.groups, tile_rows);
  const int64_t b_stride = a_width * c_width;
  parallel_for(tiles, [&](int64_t tile) {
    const int64_t g0 = tile * tile_rows;
    const int64_t g1 = std::min(csr.groups, g0 + tile_rows);
    float* const c_tile = c + g0 * c_width;
    std::memset(c_tile, 0, sizeof(float) * (g1 - g0) * c_width);
    if (csr.offsets[g1] == csr.offsets[g0]) return;
    // One bucket of g1 - g0 pointer pairs per offset (an offset has at most
    // one edge per output row), filled in one pass over the tile's edges:
    // no counting pass and no slot indirection (bucket_tile_edges).
    auto& s = buckets;
    const int64_t cap = g1 - g0;
    if (static_cast<int64_t>(s.a_ptrs.size()) < n_kernels * cap) {
      s.a_ptrs.resize(n_kernels * cap);
      s.c_ptrs.resize(n_kernels * cap);
    }
    s.count.resize(n_kernels);
    const float** a_ptrs = s.a_ptrs.data();
    float** c_ptrs = s.c_ptrs.data();
    int32_t* count = s.count.data();
    // Captured by value: the library builds with -fno-strict-aliasing, so
    // through references every pointer store would reload them.
    bucket_tile_edges(csr, g0, g1, kernel_ids, n_kernels, count,
                      [=](int32_t k, int32_t n, int32_t local, int32_t e) {
                        const int64_t slot = k * cap + n;
                        a_ptrs[slot] = a + static_cast<int64_t>(a_index[e]) * a_width;
                        c_ptrs[slot] = c_tile + static_cast<int64_t>(local) * c_width;
                      });
    for (int64_t k = 0; k < n_kernels; ++k) {
      if (count[k] > 0) {
        gemm_rows(count[k], a_ptrs + k * cap, b + k * b_stride, a_width, c_width,
                  c_ptrs + k * cap);
      }
    }
  });
}

void forward_conv(const void* feats, FloatFormat format, int64_t cin, const float* weight,
                  int64_t n_kernels, int64_t cout, const Csr& csr, const int32_t* a_index,
                  const int32_t* c_index, const int32_t* kernel_ids, void* out) {
  if (format == FloatFormat::kF32) {
    stationary_conv(static_cast<const float*>(feats), cin, weight, n_kernels,
                    static_cast<float*>(out), cout, csr, a_index, c_index, kernel_ids);
    return;
  }
  const int64_t stride = cin * cout;
  forward_tiles(feats, format, cin, [&](int64_t k) { return weight + k * stride; }, n_kernels,
                cout, csr, a_index, c_index, kernel_ids, out, tile_rows_for(cout));
}

void forward_conv_quantized(const void* feats, FloatFormat format, int64_t cin,
                            const QuantizedWeightView& weight, int64_t n_kernels, int64_t cout,
                            const Csr& csr, const int32_t* a_index, const int32_t* c_index,
                            const int32_t* kernel_ids, void* out) {
  // Larger tiles than the float path: each tile dequantizes one panel per
  // offset it uses, so more rows per panel amortize it (about 2% at C64).
  constexpr int64_t kQuantizedTileRows = 4 * kTileRows;
  thread_local Codes codes;
  Codes& w = codes;  // the workers below use this thread's codes
  unpack_codes(weight, n_kernels, cin, cout, w);
  const int64_t groups = weight.storage_in / weight.group_size;
  auto dequantize = dequantize_panel_scalar;
#ifdef MLX_LATTICE_X86
  if (isa::isa_usable(isa::Isa::kAvx512)) dequantize = dequantize_panel_avx512;
#endif
  auto panel = [&](int64_t k) {
    auto& p = scratch.panel;
    if (static_cast<int64_t>(p.size()) < cin * cout) p.resize(cin * cout);
    dequantize(w.q.data() + k * cin * cout, w.s.data() + k * groups * cout,
               w.b.data() + k * groups * cout, cin, cout, weight.group_size, p.data());
    return static_cast<const float*>(p.data());
  };
  forward_tiles(feats, format, cin, panel, n_kernels, cout, csr, a_index, c_index, kernel_ids,
                out, kQuantizedTileRows);
}

}  // namespace mlx_lattice::kernels
