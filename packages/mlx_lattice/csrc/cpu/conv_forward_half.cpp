// The half-precision forward tile driver: see conv_forward_half.h.
#include "conv_forward_half.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_LATTICE_X86 1
#endif

#include "gemm.h"
#include "isa.h"
#include "line_vector.h"
#include "parallel.h"
#include "float_formats.h"
#include "tiles.h"

namespace mlx_lattice::kernels {

namespace {

// Per-thread scratch of the tile loop, reused across tiles and calls.
struct Scratch {
  // One bucket of tile_rows (A row, C row) pointer pairs per offset: offset
  // k's edges are [k * cap, k * cap + count[k]), in CSR order.
  std::vector<const float*> a_ptrs;
  std::vector<float*> c_ptrs;
  std::vector<int32_t> count;
  // A tile's distinct input rows in order of first use and, per input row,
  // its slot among them or -1: every entry is -1 between tiles.
  std::vector<int32_t> distinct;
  std::vector<int32_t> row_slot;
  LineVector<float> rows;  // the distinct rows widened, one after the other
  LineVector<float> tile;  // the tile's float32 output rows
};

thread_local Scratch scratch;

using WidenFn = void (*)(const uint16_t* src, int64_t n, float* dst);
using RoundFn = void (*)(const float* src, int64_t n, uint16_t* dst);

void widen_any(FloatFormat format, const uint16_t* src, int64_t n, float* dst) {
  convert_to_float32(src, format, n, dst);
}

#ifdef MLX_LATTICE_X86
// All 16 lanes. The zero-masked forms of the conversions give the same
// values as the plain ones, whose undefined pass-through operand GCC 12
// reports as "may be used uninitialized".
constexpr __mmask16 kAll = 0xffff;

// float32 -> float16, nearest even (vcvtps2ph, the F16C rounding of
// from_float32), 16 values at a time.
__attribute__((target("avx512f"))) void round_f16_avx512(const float* src, int64_t n,
                                                         uint16_t* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h =
        _mm512_maskz_cvtps_ph(kAll, _mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
  if (i < n) convert_from_float32(src + i, n - i, FloatFormat::kF16, dst + i);
}
#endif

// Grows the row map to hold row r (the map is sized by the largest input
// row seen so far: the driver is not told the number of input rows).
[[gnu::noinline, gnu::cold]] int32_t* grow_slots(std::vector<int32_t>& slots, int32_t r) {
  const int64_t size = std::max<int64_t>(int64_t{r} + 1, 2 * static_cast<int64_t>(slots.size()));
  slots.resize(size, -1);
  return slots.data();
}

// The tile's one pass over its edges (groups [g0, g1) of csr, CSR order):
// buckets every edge by offset, as bucket_tile_edges (cpu/tiles.h) does --
// offset k's edges are bucket slots [k * cap, k * cap + count[k]) for
// cap = g1 - g0: a relation has at most one edge per group and offset, so
// a bucket never overflows, and a tile that would raises first -- and gives
// each distinct input row one slot of the widened copy `rows`, which the
// edge's A pointer names before the row is widened: distinct[0, n_rows)
// lists the rows in order of first use and slots[r] is r's slot (it was -1
// for every row before the pass). The lines of each row's first kHeadBytes
// and its last line are requested here, a pass ahead of the widening (all
// of a row up to 64 channels; the widening requests the rest of wider
// rows). n_rows is kept current, so that on a throw the caller can put the
// slots back. Not inlined: inside the tile loop most of its values lived
// on the stack.
constexpr int64_t kHeadBytes = 128;

template <bool kEdgeIds>
[[gnu::noinline]] void fill_tile(const int32_t* offsets, const int32_t* edge_ids, int64_t g0,
                                 int64_t g1, const int32_t* kernel_ids, const int32_t* a_index,
                                 const uint16_t* feats, int64_t width, float* rows, float* c,
                                 int64_t stride, std::vector<int32_t>& slots, int32_t* distinct,
                                 int32_t* count, const float** a_ptrs, float** c_ptrs,
                                 int64_t& n_rows) {
  const int32_t cap = static_cast<int32_t>(g1 - g0);
  int32_t* row_slot = slots.data();
  uint32_t n_slots = static_cast<uint32_t>(slots.size());
  int32_t fresh_rows = 0;
  const int64_t row_bytes = width * 2;
  const int64_t head_bytes = std::min(row_bytes, kHeadBytes);
  for (int32_t local = 0; local < cap; ++local, c += stride) {
    const int64_t end = offsets[g0 + local + 1];
    for (int64_t j = offsets[g0 + local]; j < end; ++j) {
      const int64_t e = kEdgeIds ? edge_ids[j] : j;
      const int32_t k = kernel_ids[e];  // in [0, n_kernels): checked by the relation
      const int32_t r = a_index[e];     // in [0, n_in): checked by the relation
      const int32_t n = count[k];
      if (n == cap) {
        n_rows = fresh_rows;
        throw_repeated_offset();
      }
      count[k] = n + 1;
      if (static_cast<uint32_t>(r) >= n_slots) {
        n_rows = fresh_rows;
        row_slot = grow_slots(slots, r);
        n_slots = static_cast<uint32_t>(slots.size());
      }
      const char* src = reinterpret_cast<const char*>(feats + static_cast<int64_t>(r) * width);
      prefetch_lines(src, head_bytes);
      __builtin_prefetch(src + row_bytes - 1);
      // Branch-free (whether a row is new is a coin flip to the
      // predictor): the stores are harmless when it is not.
      int32_t m = row_slot[r];
      const bool fresh = m < 0;
      m = fresh ? fresh_rows : m;
      row_slot[r] = m;
      distinct[fresh_rows] = r;  // fresh_rows <= edges seen < the tile's edges
      fresh_rows += fresh;
      const int64_t slot = static_cast<int64_t>(k) * cap + n;
      a_ptrs[slot] = rows + static_cast<int64_t>(m) * width;
      c_ptrs[slot] = c;
    }
  }
  n_rows = fresh_rows;
}

}  // namespace

#ifdef MLX_LATTICE_X86
__attribute__((target("avx512f"))) void widen_f16_avx512(const uint16_t* src, int64_t n,
                                                         float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_maskz_cvtph_ps(kAll, h));
  }
  if (i < n) {
    alignas(32) uint16_t rest[16] = {};
    std::memcpy(rest, src + i, sizeof(uint16_t) * (n - i));
    const __m512 v =
        _mm512_maskz_cvtph_ps(kAll, _mm256_load_si256(reinterpret_cast<const __m256i*>(rest)));
    _mm512_mask_storeu_ps(dst + i, static_cast<__mmask16>((1u << (n - i)) - 1u), v);
  }
}
#endif

void half_rows_forward(const uint16_t* feats, FloatFormat format, int64_t cin,
                       const float* weight, int64_t n_kernels, int64_t cout, const Csr& csr,
                       const int32_t* a_index, const int32_t* kernel_ids, uint16_t* out,
                       int64_t tile_rows) {
  WidenFn widen = nullptr;
  RoundFn round = nullptr;
#ifdef MLX_LATTICE_X86
  if (format == FloatFormat::kF16 && isa::isa_usable(isa::Isa::kAvx512)) {
    widen = widen_f16_avx512;
    round = round_f16_avx512;
  }
#endif
  const int64_t w_stride = cin * cout;
  parallel_for_windows(csr.groups, tile_rows, [&](int64_t g0, int64_t g1) {
    const int64_t cap = g1 - g0;
    auto& s = this_thread(scratch);
    s.tile.assign(cap * cout, 0.0f);
    float* c = s.tile.data();
    const int64_t n_tile = csr.offsets[g1] - csr.offsets[g0];
    // The tile's output lines, requested a share per offset while its GEMMs
    // run, so that the rounding below does not wait on them.
    uint16_t* const out_tile = out + g0 * cout;
    const int64_t out_bytes = cap * cout * 2;
    const int64_t out_step = ceil_div(ceil_div(out_bytes, 64), n_kernels) * 64;
    if (n_tile > 0) {
      fit_buckets(n_kernels * cap, s.a_ptrs, s.c_ptrs);
      s.count.assign(n_kernels, 0);
      if (static_cast<int64_t>(s.distinct.size()) < n_tile) s.distinct.resize(n_tile);
      if (static_cast<int64_t>(s.rows.size()) < n_tile * cin) s.rows.resize(n_tile * cin);
      // Raw pointers and sizes in locals (the library builds with
      // -fno-strict-aliasing: through the vectors every store would reload
      // them).
      const float** a_ptrs = s.a_ptrs.data();
      float** c_ptrs = s.c_ptrs.data();
      const int32_t* count = s.count.data();
      int32_t* distinct = s.distinct.data();
      float* rows = s.rows.data();
      const int64_t width = cin;
      int64_t n_rows = 0;
      // Should anything below throw (an allocation, an invalid relation)
      // before the widening loop has put every slot back to -1, the guard
      // does it: a stale slot would point a later tile of this thread at
      // the wrong row.
      struct SlotGuard {
        std::vector<int32_t>& slots;
        const int32_t* distinct;
        const int64_t& n;
        bool armed = true;
        ~SlotGuard() {
          if (armed) {
            for (int64_t i = 0; i < n; ++i) slots[distinct[i]] = -1;
          }
        }
      } guard{s.row_slot, distinct, n_rows};
      const auto pass = csr.edge_ids ? fill_tile<true> : fill_tile<false>;
      pass(csr.offsets, csr.edge_ids, g0, g1, kernel_ids, a_index, feats, width, rows, c, cout,
           s.row_slot, distinct, s.count.data(), a_ptrs, c_ptrs, n_rows);
      int32_t* row_slot = s.row_slot.data();
      // Rows wider than 64 channels: the lines after their head, kAhead
      // rows ahead.
      constexpr int64_t kAhead = 8;
      const int64_t row_bytes = width * 2;
      auto ahead = [&](int64_t i) {
        if (row_bytes <= kHeadBytes || i >= n_rows) return;
        const char* p =
            reinterpret_cast<const char*>(feats + static_cast<int64_t>(distinct[i]) * width);
        prefetch_lines(p + kHeadBytes, row_bytes - kHeadBytes);
      };
      for (int64_t i = 0; i < kAhead; ++i) ahead(i);
      for (int64_t i = 0; i < n_rows; ++i) {
        ahead(i + kAhead);
        const uint16_t* src = feats + static_cast<int64_t>(distinct[i]) * width;
        if (widen) {
          widen(src, width, rows + i * width);
        } else {
          widen_any(format, src, width, rows + i * width);
        }
        row_slot[distinct[i]] = -1;
      }
      guard.armed = false;
      const char* out_lines = reinterpret_cast<const char*>(out_tile);
      for (int64_t k = 0; k < n_kernels; ++k) {
        const int64_t b1 = std::min(out_bytes, (k + 1) * out_step);
        for (int64_t b = k * out_step; b < b1; b += 64) __builtin_prefetch(out_lines + b, 1);
        if (count[k] > 0) {
          gemm_rows(count[k], a_ptrs + k * cap, weight + k * w_stride, cin, cout, c_ptrs + k * cap);
        }
      }
    }
    if (round) {
      round(c, cap * cout, out_tile);
    } else {
      convert_from_float32(c, cap * cout, format, out_tile);
    }
  });
}

}  // namespace mlx_lattice::kernels
