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
#include "parallel.h"
#include "tiles.h"

namespace mlx_lattice::kernels {

namespace {

// Per-thread scratch of the tile loop, reused across tiles and calls.
struct Scratch {
  TileEdges edges;
  std::vector<const float*> a_ptrs;
  std::vector<float*> c_ptrs;
  // A tile's distinct input rows in order of first use and, per input row,
  // its slot among them or -1: every entry is -1 between tiles.
  std::vector<int32_t> distinct;
  std::vector<int32_t> row_slot;
  std::vector<const float*> edge_rows;  // per edge in CSR order, its widened row
  std::vector<float> rows;  // the distinct rows widened, one after the other
  std::vector<float> tile;  // the tile's float32 output rows
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

// float16 -> float32, 16 values per vcvtph2ps (exact); the tail through a
// zero-padded copy and a masked store.
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

}  // namespace

void half_rows_forward(const uint16_t* feats, FloatFormat format, int64_t cin,
                       const float* weight, int64_t n_kernels, int64_t cout, const Csr& csr,
                       const int32_t* a_index, const int32_t* c_index,
                       const int32_t* kernel_ids, uint16_t* out, int64_t tile_rows) {
  WidenFn widen = nullptr;
  RoundFn round = nullptr;
#ifdef MLX_LATTICE_X86
  if (format == FloatFormat::kF16 && isa::isa_usable(isa::Isa::kAvx512)) {
    widen = widen_f16_avx512;
    round = round_f16_avx512;
  }
#endif
  const int64_t w_stride = cin * cout;
  const int64_t tiles = ceil_div(csr.groups, tile_rows);
  parallel_for(tiles, [&](int64_t tile) {
    const int64_t g0 = tile * tile_rows;
    const int64_t g1 = std::min(csr.groups, g0 + tile_rows);
    auto& s = scratch;
    s.tile.assign((g1 - g0) * cout, 0.0f);
    float* c = s.tile.data();
    const int64_t n_tile = csr.offsets[g1] - csr.offsets[g0];
    if (n_tile > 0) {
      s.a_ptrs.resize(n_tile);
      s.c_ptrs.resize(n_tile);
      s.distinct.resize(n_tile);
      s.edge_rows.resize(n_tile);
      if (static_cast<int64_t>(s.rows.size()) < n_tile * cin) s.rows.resize(n_tile * cin);
      // Raw pointers and sizes in locals (the library builds with
      // -fno-strict-aliasing: through the vectors every int32 store would
      // reload them).
      const float** a_ptrs = s.a_ptrs.data();
      float** c_ptrs = s.c_ptrs.data();
      int32_t* distinct = s.distinct.data();
      const float** edge_rows = s.edge_rows.data();
      float* rows = s.rows.data();
      const int64_t width = cin;
      // A row feeds up to K edges of a tile: each distinct row gets one
      // slot, filled once below, and its edges point at it (the same values
      // as widening it per edge, so the same results). First the slots, in
      // CSR order (one short loop: a sequential read of a_index and one
      // lookup per edge), kept per edge in CSR order.
      int64_t n_rows = 0;
      int32_t* row_slot = s.row_slot.data();
      // Should anything below throw (an allocation) before the widening
      // loop has put every slot back to -1, the guard does it: a stale slot
      // would point a later tile of this thread at the wrong row.
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
      {
        const int64_t j0 = csr.offsets[g0];
        const int32_t* edge_ids = csr.edge_ids;
        int64_t n_slots = static_cast<int64_t>(s.row_slot.size());
        for (int64_t i = 0; i < n_tile; ++i) {
          const int64_t e = edge_ids ? edge_ids[j0 + i] : j0 + i;
          const int32_t r = a_index[e];  // in [0, n_in): checked by the relation
          if (r >= n_slots) {
            s.row_slot.resize(std::max<int64_t>(r + 1, 2 * n_slots), -1);
            row_slot = s.row_slot.data();
            n_slots = static_cast<int64_t>(s.row_slot.size());
          }
          // Branch-free (whether a row is new is a coin flip to the
          // predictor): the stores are harmless when it is not.
          int32_t m = row_slot[r];
          const bool fresh = m < 0;
          m = fresh ? static_cast<int32_t>(n_rows) : m;
          row_slot[r] = m;
          distinct[n_rows] = r;  // n_rows <= i < n_tile
          n_rows += fresh;
          edge_rows[i] = rows + static_cast<int64_t>(m) * width;
        }
      }
      // sort_tile_edges calls fill in CSR order: the i-th call is edge i.
      int64_t next = 0;
      const int64_t stride = cout;
      sort_tile_edges(csr, g0, g1, kernel_ids, n_kernels, s.edges, [&](int32_t slot, int32_t e) {
        a_ptrs[slot] = edge_rows[next++];
        c_ptrs[slot] = c + (static_cast<int64_t>(c_index[e]) - g0) * stride;
      });
      // Rows kAhead rows ahead are requested while this one widens (the
      // gathered rows are otherwise fetched one latency at a time).
      constexpr int64_t kAhead = 8;
      auto prefetch = [&](int64_t i) {
        if (i >= n_rows) return;
        const char* p = reinterpret_cast<const char*>(feats + static_cast<int64_t>(distinct[i]) * width);
        for (int64_t b = 0; b < width * 2; b += 64) __builtin_prefetch(p + b);
      };
      for (int64_t i = 0; i < kAhead; ++i) prefetch(i);
      for (int64_t i = 0; i < n_rows; ++i) {
        prefetch(i + kAhead);
        const uint16_t* src = feats + static_cast<int64_t>(distinct[i]) * width;
        if (widen) {
          widen(src, width, rows + i * width);
        } else {
          widen_any(format, src, width, rows + i * width);
        }
        row_slot[distinct[i]] = -1;
      }
      guard.armed = false;
      const int32_t* counts = s.edges.counts.data();
      for (int64_t k = 0; k < n_kernels; ++k) {
        const int64_t begin = counts[k];
        const int64_t m = counts[k + 1] - begin;
        if (m > 0) gemm_rows(m, a_ptrs + begin, weight + k * w_stride, cin, cout, c_ptrs + begin);
      }
    }
    if (round) {
      round(c, (g1 - g0) * cout, out + g0 * cout);
    } else {
      convert_from_float32(c, (g1 - g0) * cout, format, out + g0 * cout);
    }
  });
}

}  // namespace mlx_lattice::kernels
