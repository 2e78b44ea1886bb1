#include "weight_gradient.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "conv_forward_half.h"
#include "gemm.h"
#include "line_vector.h"
#include "parallel.h"

namespace mlx_lattice::kernels {

namespace {

// Per-thread pointer buffers of the chunk loop, reused across calls.
struct TileScratch {
  std::vector<const float*> a_ptrs;
  std::vector<const float*> pack_a_rows;
};

thread_local TileScratch scratch;

// Widens columns [c0, c1) of m half-precision rows src[j] into
// dst + j * stride + c0 (row_widener: exact, so every path gives the same
// floats).
void widen_rows(FloatFormat format, const uint16_t* const* src, int64_t m, int64_t c0,
                int64_t c1, float* dst, int64_t stride) {
  const WidenRow widen = row_widener(format);
  for (int64_t j = 0; j < m; ++j) widen(src[j] + c0, c1 - c0, dst + j * stride + c0);
}

// Per thread: the half-precision rows of two chunks of edges (F's, then
// G's, null where G's row is already widened), the widened rows of one chunk
// (kChunk rows of F, then of G) and a band's widened rows of G.
thread_local std::vector<const uint16_t*> half_rows_tls;
thread_local LineVector<float> widened_rows_tls;
thread_local LineVector<float> band_rows_g_tls;

}  // namespace

void weight_gradient(const float* feats, int64_t cin, const float* grad, int64_t cout,
                     const Csr& kernel_csr, const int32_t* in_rows, const int32_t* out_rows,
                     float* dweight) {
  weight_gradient(feats, FloatFormat::kF32, cin, grad, FloatFormat::kF32, cout, kernel_csr,
                  in_rows, out_rows, dweight);
}

void weight_gradient(const void* feats, FloatFormat feats_format, int64_t cin, const void* grad,
                     FloatFormat grad_format, int64_t cout, const Csr& kernel_csr,
                     const int32_t* in_rows, const int32_t* out_rows, float* dweight) {
  constexpr int64_t kChunk = 128;  // edges gathered and prefetched per micro-kernel call
  // A task walks its offsets band by band: band b is the edges whose output
  // row lies in rows [b * band_rows, (b + 1) * band_rows), about kBandEdges
  // edges, so with each offset's edges in output order (as the relation
  // builder stores them) a band's gradient rows and their neighbours' feature
  // rows (a few hundred KB) serve every offset from L2 instead of being
  // fetched again per offset. (Bands cut at the same fraction of every
  // offset's edge list drift apart by thousands of rows on a real scan, as
  // the offsets' edge densities differ along the rows: 1.4x the forward time
  // against 1.1x.) A band's slice of an offset's list is found by binary
  // search, which cuts any edge order into consecutive slices, so an
  // unsorted grouping is still summed exactly, only with less cache reuse.
  constexpr int64_t kBandEdges = 8192;
  // Consecutive bands form slabs; a task computes one slab's partial dW of
  // its offsets (each value accumulates the slab's edges of its offset in
  // kernel-CSR order, one fused multiply-add after the other, from zero)
  // and dW is the sum of the partials in slab order. The slabs depend only
  // on the relation and the sizes, never on the thread count, so neither do
  // the bits.
  constexpr int64_t kSlabEdges = int64_t{1} << 16;
  constexpr int64_t kMaxSlabs = 16;
  constexpr int64_t kPartialBytes = int64_t{64} << 20;  // partial buffers, at most
  constexpr int64_t kKeptBytes = int64_t{16} << 20;     // kept for the next call
  const int64_t n_kernels = kernel_csr.groups;
  if (n_kernels == 0 || cin == 0 || cout == 0) return;
  const bool half_f = feats_format != FloatFormat::kF32;
  const bool half_g = grad_format != FloatFormat::kF32;
  const int64_t f_width = half_f ? 2 : 4;
  const int64_t g_width = half_g ? 2 : 4;
  const auto* const feats32 = half_f ? nullptr : static_cast<const float*>(feats);
  const auto* const feats16 = half_f ? static_cast<const uint16_t*>(feats) : nullptr;
  const auto* const grad32 = half_g ? nullptr : static_cast<const float*>(grad);
  const auto* const grad16 = half_g ? static_cast<const uint16_t*>(grad) : nullptr;
  const int64_t panel = cin * cout;
  const int64_t size = n_kernels * panel;
  const int64_t n_edges = kernel_csr.offsets[n_kernels] - kernel_csr.offsets[0];
  const int64_t bands = std::max<int64_t>(1, ceil_div(n_edges, kBandEdges));
  const int64_t slabs = std::max<int64_t>(
      1, std::min({ceil_div(n_edges, kSlabEdges), kMaxSlabs, bands,
                   kPartialBytes / static_cast<int64_t>(sizeof(float) * size) + 1}));
  auto row_of = [&](int64_t p) -> int64_t {
    return out_rows[kernel_csr.edge_ids ? kernel_csr.edge_ids[p] : p];
  };
  int64_t rows_bound = 1;  // the largest last output row of an offset, plus one
  for (int64_t k = 0; k < n_kernels; ++k) {
    if (kernel_csr.offsets[k + 1] > kernel_csr.offsets[k]) {
      rows_bound = std::max(rows_bound, row_of(kernel_csr.offsets[k + 1] - 1) + 1);
    }
  }
  const int64_t band_rows = ceil_div(rows_bound, bands);
  // First edge of band `band` in offset k's list: the lower bound of its
  // first row (monotone in the row even where the list is unsorted), the
  // list's ends for the first and past-the-last band.
  auto bound = [&](int64_t k, int64_t band) -> int64_t {
    const int64_t lo = kernel_csr.offsets[k];
    const int64_t end = kernel_csr.offsets[k + 1];
    if (band <= 0) return lo;
    if (band >= bands) return end;
    return first_at_row(kernel_csr, out_rows, lo, end, band * band_rows);
  };
  // Slab 0 accumulates into dW itself, the others into their own buffers
  // (a calling thread keeps them for its next call up to kKeptBytes).
  thread_local LineVector<float> kept;
  std::unique_ptr<float[]> owned;
  float* partials = nullptr;
  const int64_t partial_floats = (slabs - 1) * size;
  if (partial_floats * static_cast<int64_t>(sizeof(float)) <= kKeptBytes) {
    if (static_cast<int64_t>(kept.size()) < partial_floats) kept.resize(partial_floats);
    partials = kept.data();
  } else {
    owned.reset(new float[partial_floats]);
    partials = owned.get();
  }
  auto target = [&](int64_t slab) { return slab == 0 ? dweight : partials + (slab - 1) * size; };
  // With fewer slabs than twice the threads, a slab's offsets are split into
  // groups, and with few offsets (a pointwise layer) the rows of dW too:
  // each task still owns whole values of one partial, so the bits stay.
  const int64_t threads = std::max(1, get_num_threads());
  const int64_t n_groups =
      std::min<int64_t>(n_kernels, std::max<int64_t>(1, ceil_div(2 * threads, slabs)));
  const int64_t row_blocks = std::min<int64_t>(
      ceil_div(cin, 6), std::max<int64_t>(1, ceil_div(2 * threads, slabs * n_groups)));
  const int64_t row_block = ceil_div(ceil_div(cin, row_blocks), 6) * 6;
  const int64_t per_slab = n_groups * row_blocks;
  parallel_for(slabs * per_slab, [&](int64_t task) {
    const int64_t slab = task / per_slab;
    const int64_t group = task % per_slab / row_blocks;
    const int64_t r0 = std::min(cin, task % row_blocks * row_block);
    const int64_t r1 = std::min(cin, r0 + row_block);
    if (r0 >= r1) return;
    const int64_t k0 = n_kernels * group / n_groups;
    const int64_t k1 = n_kernels * (group + 1) / n_groups;
    float* out = target(slab);
    for (int64_t k = k0; k < k1; ++k) {
      std::memset(out + k * panel + r0 * cout, 0, sizeof(float) * (r1 - r0) * cout);
    }
    auto& s = this_thread(scratch);
    auto& half_rows = this_thread(half_rows_tls);
    auto& widened_rows = this_thread(widened_rows_tls);
    auto& band_rows_g = this_thread(band_rows_g_tls);
    // Two pointer buffers: the next chunk's rows are gathered and prefetched
    // while the current chunk computes. A half-precision operand's rows are
    // kept in half_rows until widen() writes their widened copies and points
    // the micro-kernel at them, just before the chunk computes (so after the
    // previous chunk's compute has fetched them); F only in the task's
    // columns [r0, r1), all the micro-kernel reads of it. G's rows of a band
    // (a range of output rows) serve every offset of the band: they are
    // widened once per band when the range is no longer than the band's
    // edges (with the builder's output order, every edge's row is in it),
    // and a row outside the range is widened with its chunk.
    s.a_ptrs.resize(2 * kChunk);
    s.pack_a_rows.resize(2 * kChunk);
    if (half_f || half_g) {
      half_rows.resize(4 * kChunk);
      widened_rows.resize(kChunk * ((half_f ? cin : 0) + (half_g ? cout : 0)));
    }
    const uint16_t** const half_f_rows = half_rows.data();
    const uint16_t** const half_g_rows = half_rows.data() + 2 * kChunk;
    float* const wide_f = widened_rows.data();
    float* const wide_g = widened_rows.data() + (half_f ? kChunk * cin : 0);
    int64_t g_lo = 0;  // G's rows [g_lo, g_hi) are widened in band_rows_g
    int64_t g_hi = 0;
    auto gather = [&](int64_t j0, int64_t j_end, int slot) {
      const int64_t m = std::min<int64_t>(kChunk, j_end - j0);
      const float** f = s.pack_a_rows.data() + slot * kChunk;
      const float** g = s.a_ptrs.data() + slot * kChunk;
      const uint16_t** hf = half_f_rows + slot * kChunk;
      const uint16_t** hg = half_g_rows + slot * kChunk;
      for (int64_t j = 0; j < m; ++j) {
        const int64_t e = kernel_csr.edge_ids ? kernel_csr.edge_ids[j0 + j] : j0 + j;
        const int64_t in_row = in_rows[e];
        const int64_t out_row = out_rows[e];
        const void* fr;
        const void* gr;
        int64_t g_bytes = cout * g_width;
        if (half_f) {
          fr = hf[j] = feats16 + in_row * cin;
        } else {
          fr = f[j] = feats32 + in_row * cin;
        }
        if (!half_g) {
          gr = g[j] = grad32 + out_row * cout;
        } else if (out_row >= g_lo && out_row < g_hi) {
          gr = g[j] = band_rows_g.data() + (out_row - g_lo) * cout;
          hg[j] = nullptr;
          g_bytes = cout * 4;
        } else {
          gr = hg[j] = grad16 + out_row * cout;
        }
        prefetch_lines(fr, cin * f_width);
        prefetch_lines(gr, g_bytes);
      }
      return m;
    };
    auto widen = [&](int64_t m, int slot) {
      const float** f = s.pack_a_rows.data() + slot * kChunk;
      const float** g = s.a_ptrs.data() + slot * kChunk;
      if (half_f) {
        widen_rows(feats_format, half_f_rows + slot * kChunk, m, r0, r1, wide_f, cin);
        for (int64_t j = 0; j < m; ++j) f[j] = wide_f + j * cin;
      }
      if (half_g) {
        const uint16_t** hg = half_g_rows + slot * kChunk;
        for (int64_t j = 0; j < m; ++j) {
          if (hg[j] == nullptr) continue;
          widen_rows(grad_format, hg + j, 1, 0, cout, wide_g + j * cout, cout);
          g[j] = wide_g + j * cout;
        }
      }
    };
    // Bands of at most kBandFloats widened G values (or none).
    constexpr int64_t kBandFloats = int64_t{1} << 20;
    const int64_t band_end = bands * (slab + 1) / slabs;
    for (int64_t band = bands * slab / slabs; band < band_end; ++band) {
      g_lo = g_hi = 0;
      if (half_g) {
        int64_t band_edges = 0;
        for (int64_t k = k0; k < k1; ++k) band_edges += bound(k, band + 1) - bound(k, band);
        const int64_t lo = std::min(rows_bound, band * band_rows);
        const int64_t hi = std::min(rows_bound, lo + band_rows);
        if (hi > lo && hi - lo <= band_edges && (hi - lo) * cout <= kBandFloats) {
          if (static_cast<int64_t>(band_rows_g.size()) < (hi - lo) * cout) {
            band_rows_g.resize((hi - lo) * cout);
          }
          // G's rows lo..hi-1 are consecutive in memory: one row of
          // (hi - lo) * cout values.
          const uint16_t* first = grad16 + lo * cout;
          widen_rows(grad_format, &first, 1, 0, (hi - lo) * cout, band_rows_g.data(), 0);
          g_lo = lo;
          g_hi = hi;
        }
      }
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t j_begin = bound(k, band);
        const int64_t j_end = bound(k, band + 1);
        if (j_begin >= j_end) continue;
        float* dw = out + k * panel;
        int slot = 0;
        int64_t m = gather(j_begin, j_end, slot);
        for (int64_t j0 = j_begin; j0 < j_end; j0 += kChunk) {
          if (half_f || half_g) widen(m, slot);
          const int64_t next = j0 + kChunk < j_end ? gather(j0 + kChunk, j_end, 1 - slot) : 0;
          gemm_outer(m, s.pack_a_rows.data() + slot * kChunk, s.a_ptrs.data() + slot * kChunk,
                     r0, r1, dw, cout);
          slot = 1 - slot;
          m = next;
        }
      }
    }
  });
  if (slabs == 1) return;
  // dW += partial 1, += partial 2, ... for every value, in blocks of values.
  constexpr int64_t kSumBlock = 4096;
  parallel_for(ceil_div(size, kSumBlock), [&](int64_t block) {
    const int64_t i0 = block * kSumBlock;
    const int64_t i1 = std::min(size, i0 + kSumBlock);
    for (int64_t slab = 1; slab < slabs; ++slab) {
      const float* p = target(slab);
      for (int64_t i = i0; i < i1; ++i) dweight[i] += p[i];
    }
  });
}

}  // namespace mlx_lattice::kernels
