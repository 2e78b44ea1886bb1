// The AMX-INT8 output-stationary driver of the integer sparse convolution
// (cpu/gemm_int8.h's math, the same bits), a template on its tile policy
// (cpu/amx_tiles.h: TileHw, or the test model TileModel) and on its
// epilogue (portable C++ or AVX-512), with no MLX dependency.
//
// Dataflow, per window of output rows [g0, g1) (CSR groups; the caller's
// tile of kInt8TileRows, whose float32 rows stay in cache):
// 1. Buckets: the window's edges grouped by kernel offset (tiles.h's
//    bucket_tile_edges, as the VNNI path does): input row and window-local
//    output row per edge, in CSR order inside an offset (a row with two
//    edges of one offset raises InputError).
// 2. For k ascending, the offset's edges 16 at a time (a batch fills every
//    row of the A tile but the last batch's tail, so no product multiplies an
//    absent row, as it would in blocks of 16 output rows, where a block's
//    offsets are the union of its rows'): the batch's quantized input rows
//    are loaded straight from the features when they are 16 consecutive
//    rows (a sorted grid's usual case), else gathered into one tile-strided
//    buffer; for each strip of up to 64 output columns and each weight group
//    g: C tiles (16 rows x 16 int32 columns each, up to 4) are zeroed, then
//    for each chunk of the group (kc <= 64 bytes) the A tile is loaded once
//    and TDPBSUD (signed activations x unsigned weight codes) runs against
//    each strip's B tile (kc / 4 rows of 16 columns x 4 codes: the packed
//    weight's own layout, so no repacking); the C tiles are stored and the
//    epilogue adds float(acc) * s + float(asum) * b (times the row's scale)
//    to each edge's output row.
// 3. The window's float32 rows are zeroed first and summed in place in the
//    output, or, where the output is large (output_window.h), in the
//    thread's own buffer, which is then streamed to the output.
// The float epilogue per (offset, group) is what the documented math asks
// (each edge's integer sum is scaled by its input row's scale and its
// offset's group scale before the float sum), so int32 cannot accumulate
// across offsets. An output row has at most one edge per offset, so a
// batch's rows are distinct and every element's additions come in the
// reference order (offsets, then groups, ascending).
//
// Tile configuration (one place: int8_tile_config): tiles 0-3 C (16 x 64
// bytes), tile 4 A (16 x kc), tiles 5 and 6 B (kc / 4 x 64), alternating so
// a B load can overlap the previous product.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "amx_tiles.h"
#include "group_by.h"
#include "line_vector.h"
#include "output_window.h"
#include "parallel.h"
#include "quantized_weight.h"
#include "tiles.h"

namespace mlx_lattice::kernels::amx_int8 {

constexpr int kBlockRows = 16;  // edges per batch = rows of a tile

// The weight in gemm_int8.cpp's packed layout: codes[k][quad][cout_pad][4],
// scales and biases [k][group][cout_pad]; cout_pad a multiple of 16.
struct Weights {
  const uint8_t* codes;
  const float* scales;
  const float* biases;
  int64_t quads;     // storage_in / 4
  int64_t groups;    // storage_in / group
  int64_t cout_pad;  // columns, a multiple of 16
  int64_t n_kernels;
  int64_t cout;
};

// Quantized rows (quantize_rows_int8): q (n, stride) int8, scale (n),
// gsum (n, groups). static_scale: every finite row's scale is 1.
struct Rows {
  const int8_t* q;
  const float* scale;
  const int32_t* gsum;
  int64_t stride;  // storage_in bytes
  bool static_scale;
};

// The largest chunk of a group one A tile holds: 64, 32, 16, 8 or 4 bytes
// dividing the group (group % 4 == 0).
inline int chunk_bytes(int64_t group_bytes) {
  for (int kc = amx::kMaxColsb; kc > 4; kc /= 2) {
    if (group_bytes % kc == 0) return kc;
  }
  return 4;
}

inline amx::TileConfig int8_tile_config(int kc) {
  amx::TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.set(t, kBlockRows, amx::kMaxColsb);
  cfg.set(4, kBlockRows, kc);
  cfg.set(5, kc / 4, amx::kMaxColsb);
  cfg.set(6, kc / 4, amx::kMaxColsb);
  return cfg;
}

// What the epilogue of one stored strip needs: rows r < m of the strip
// (acc row r is the batch's edge r), each added into its own output row.
struct EpiArgs {
  const int32_t* acc;   // 16 rows x 64 int32 (row stride 64)
  const float* s;       // group scales of the strip's columns
  const float* b;       // group biases
  int64_t width;        // real columns of the strip (<= 64)
  int m;                // rows (edges) of the batch
  const float* asum;    // [m]: the group sum of each edge's input row
  const float* sa;      // [m]: its scale (read unless Unit)
  float* const* out;    // [m]: its output row, at the strip's first column
};

// Portable epilogue: one rounding per operation, as the documented math.
struct EpiScalar {
  static constexpr const char* kName = "scalar";
  template <bool Unit>
  MLX_LATTICE_NO_CONTRACT static void rows(const EpiArgs& e) {
    MLX_LATTICE_NO_CONTRACT_BODY
    for (int r = 0; r < e.m; ++r) {
      const int32_t* acc = e.acc + r * 64;
      float* out = e.out[r];
      for (int64_t x = 0; x < e.width; ++x) {
        float t = static_cast<float>(acc[x]) * e.s[x];
        const float u = e.asum[r] * e.b[x];
        t = t + u;
        if constexpr (!Unit) t = t * e.sa[r];
        out[x] = out[x] + t;
      }
    }
  }
};

#if defined(__x86_64__) || defined(_M_X64)
// AVX-512 epilogue: the same operations, 16 columns per vector, each
// product kept rounded on its own (no contraction into an FMA); a column
// vector's scales and biases are loaded once for all rows of the batch.
struct EpiAvx512 {
  static constexpr const char* kName = "avx512";
  template <bool Unit>
  __attribute__((target("avx512f"))) static void rows(const EpiArgs& e) {
    for (int64_t x = 0; x < e.width; x += 16) {
      const int64_t rem = e.width - x;
      const __mmask16 mk = rem >= 16 ? static_cast<__mmask16>(0xffff)
                                     : static_cast<__mmask16>((1u << rem) - 1u);
      const __m512 s = _mm512_loadu_ps(e.s + x);
      const __m512 b = _mm512_loadu_ps(e.b + x);
      for (int r = 0; r < e.m; ++r) {
        // The zero-masked conversion of all lanes: the plain form's undefined
        // pass-through operand reads as uninitialized to GCC 12.
        const __m512i sums = _mm512_load_si512(e.acc + r * 64 + x);
        __m512 t = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(0xffff, sums), s);
        __m512 u = _mm512_mul_ps(_mm512_set1_ps(e.asum[r]), b);
        asm("" : "+v"(t));
        asm("" : "+v"(u));
        t = _mm512_add_ps(t, u);
        if constexpr (!Unit) t = _mm512_mul_ps(t, _mm512_set1_ps(e.sa[r]));
        asm("" : "+v"(t));
        float* o = e.out[r] + x;
        _mm512_mask_storeu_ps(o, mk, _mm512_add_ps(_mm512_maskz_loadu_ps(mk, o), t));
      }
    }
  }
};
#endif

// Per-thread scratch of the driver.
struct Scratch {
  std::vector<int32_t> rows;      // [k][cap]: input row of each bucketed edge
  std::vector<int32_t> outs;      // [k][cap]: its window-local output row
  std::vector<int32_t> count;     // [k]: edges of offset k in the window
  LineVector<int8_t> gathered;   // 16 rows x stride
  LineVector<float> window;      // the window's sums where the output is streamed
  alignas(64) int32_t acc[kBlockRows * 64];
};

// Copies one quantized row (whole 64-byte lines as fixed-size copies, which
// compile to vector moves; the rest byte-wise).
inline void copy_row(int8_t* dst, const int8_t* src, int64_t bytes) {
  int64_t x = 0;
  for (; x + 64 <= bytes; x += 64) std::memcpy(dst + x, src + x, 64);
  if (x < bytes) std::memcpy(dst + x, src + x, bytes - x);
}

// Output rows [g0, g1) of the output CSR `csr`; out points at row 0 of the
// whole output (cout floats per row) and rows [g0, g1) are overwritten.
template <class Tiles, class Epi>
inline void run_rows(const Rows& a, const Weights& w, int64_t group_bytes, const Csr& csr,
                     const int32_t* a_index, const int32_t* kernel_ids, int64_t g0, int64_t g1,
                     float* out, Scratch& s) {
  const int64_t cout = w.cout;
  const int64_t nk = w.n_kernels;
  const int kc = chunk_bytes(group_bytes);
  const int64_t chunks = group_bytes / kc;
  const int64_t stride = a.stride;
  const int64_t bstride = w.cout_pad * 4;
  if (g1 <= g0) return;
  const int64_t cap = g1 - g0;
  s.count.resize(nk);
  fit_buckets(nk * cap, s.rows, s.outs);
  s.gathered.resize(kBlockRows * stride);
  int32_t* bucket_rows = s.rows.data();
  int32_t* bucket_outs = s.outs.data();
  // A row's edges come together (CSR order), so a second edge of one offset
  // in a row finds that row at the end of the offset's bucket.
  bucket_tile_edges(csr, g0, g1, kernel_ids, nk, s.count.data(),
                    [bucket_rows, bucket_outs, cap, a_index](int32_t k, int32_t n, int32_t local,
                                                             int32_t e) {
                      if (n > 0 && bucket_outs[k * cap + n - 1] == local) {
                        throw_repeated_offset();
                      }
                      bucket_rows[k * cap + n] = a_index[e];
                      bucket_outs[k * cap + n] = local;
                    });
  // Summed in place, or in the thread's buffer and streamed out at the end
  // (output_window.h).
  const bool stream = stream_output(csr.groups * cout * int64_t{4}, cout * int64_t{4});
  float* window = stream ? window_buffer(s.window, cap * cout) : out + g0 * cout;
  std::memset(window, 0, sizeof(float) * cap * cout);
  amx::TileScope<Tiles> scope(int8_tile_config(kc));
  int8_t* gathered = s.gathered.data();
  for (int64_t k = 0; k < nk; ++k) {
    const int64_t count = s.count[k];
    const uint8_t* codes_k = w.codes + k * w.quads * bstride;
    for (int64_t i0 = 0; i0 < count; i0 += kBlockRows) {
      const int m = static_cast<int>(std::min<int64_t>(kBlockRows, count - i0));
      const int32_t* rows = bucket_rows + k * cap + i0;
      const int32_t* outs = bucket_outs + k * cap + i0;
      // The next batch's rows (scattered over the features) are requested
      // behind this batch's work.
      const int next = static_cast<int>(std::min<int64_t>(kBlockRows, count - i0 - m));
      for (int r = 0; r < next; ++r) {
        prefetch_lines(a.q + static_cast<int64_t>(rows[m + r]) * stride, stride);
      }
      // The A rows: 16 consecutive feature rows are read in place (a tail
      // batch is gathered, so no tile row reads past the features).
      bool consecutive = m == kBlockRows;
      for (int r = 1; consecutive && r < kBlockRows; ++r) consecutive = rows[r] == rows[0] + r;
      const int8_t* a_rows = gathered;
      if (consecutive) {
        a_rows = a.q + static_cast<int64_t>(rows[0]) * stride;
      } else {
        for (int r = 0; r < m; ++r) {
          copy_row(gathered + r * stride, a.q + static_cast<int64_t>(rows[r]) * stride, stride);
        }
      }
      bool unit = a.static_scale;
      float sa[kBlockRows];
      float* row_out[kBlockRows];
      for (int r = 0; r < m; ++r) {
        sa[r] = a.scale[rows[r]];
        unit = unit && sa[r] == 1.0f;
        row_out[r] = window + static_cast<int64_t>(outs[r]) * cout;
      }
      float asum[kBlockRows];
      float* strip_out[kBlockRows];
      for (int64_t n0 = 0; n0 < w.cout_pad; n0 += 64) {
        const int nc = static_cast<int>(std::min<int64_t>(4, (w.cout_pad - n0) / 16));
        const int64_t width = std::min<int64_t>(64, cout - n0);
        for (int64_t g = 0; g < w.groups; ++g) {
          amx::zero_strip<Tiles>(nc);
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t byte0 = g * group_bytes + c * kc;
            Tiles::template load<4>(a_rows + byte0, stride);
            amx::multiply_strip<Tiles, amx::Dot::kBsud>(
                nc, codes_k + (byte0 / 4) * bstride + n0 * 4, bstride);
          }
          amx::store_strip<Tiles>(nc, s.acc, 256);
          const int64_t wofs = (k * w.groups + g) * w.cout_pad + n0;
          for (int r = 0; r < m; ++r) {
            asum[r] = static_cast<float>(a.gsum[rows[r] * w.groups + g]);
            strip_out[r] = row_out[r] + n0;
          }
          const EpiArgs e{s.acc, w.scales + wofs, w.biases + wofs, width, m, asum, sa, strip_out};
          if (unit) {
            Epi::template rows<true>(e);
          } else {
            Epi::template rows<false>(e);
          }
        }
      }
    }
  }
  if (stream) stream_rows(out + g0 * cout, window, sizeof(float) * cap * cout);
}

}  // namespace mlx_lattice::kernels::amx_int8
