#include "gemm_bf16.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_LATTICE_X86 1
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "amx_bf16.h"
#include "amx_bf16_wgrad.h"
#include "isa.h"
#include "line_vector.h"
#include "parallel.h"
#include "tiles.h"

namespace mlx_lattice::kernels {

namespace {

constexpr int kRows = 6;  // rows per register block

// The weight in the micro-kernel's layout: [k][pair p][cout_pad][2] bf16
// (channels 2p and 2p + 1 of one column per 32-bit lane); padding is zero.
struct PackedBf16 {
  LineVector<uint16_t> w;
  int64_t pairs = 0;
  int64_t cout_pad = 0;
};

struct Block {
  const uint16_t* a[kRows];  // feature rows, 2 * pairs values each
  float* c[kRows];
  // Rows that are edges; rows past them read zeros into a sink (blocks
  // that take R < kRows rows skip them).
  int rows = kRows;
};

#ifdef MLX_LATTICE_X86

// acc += pairwise bf16 dot products (vdpbf16ps). Inline assembly for the
// same reason as vpdpbusd in gemm_int8.cpp (GCC 12 copies accumulators).
__attribute__((target("avx512f,avx512bf16"))) inline void dpbf16(__m512& acc, __m512i w,
                                                                  __m512i a) {
  asm("vdpbf16ps %[a], %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [a] "v"(a));
}

// R <= 6 rows x (16 * V) columns (V <= 4) of float32 sums c[r][0, 16 V),
// masked by mk: for each of `pairs` steps q, c[r] += the pair of bf16 at
// a[r] + q * a_stride (broadcast) dotted with b's V vectors at
// b + q * b_stride (strides in bf16 values).
template <int R, int V>
__attribute__((target("avx512f,avx512bf16"))) inline void pair_rows(
    const uint16_t* const* a, int64_t a_stride, const uint16_t* b, int64_t b_stride,
    int64_t pairs, float* const* c, const __mmask16* mk) {
  const __m512 zero = _mm512_setzero_ps();
#define DECL(r) __m512 x##r##0 = zero, x##r##1 = zero, x##r##2 = zero, x##r##3 = zero;
  DECL(0) DECL(1) DECL(2) DECL(3) DECL(4) DECL(5)
#undef DECL
#define LOADC(r, v) \
  if constexpr (R > r && V > v) x##r##v = _mm512_maskz_loadu_ps(mk[v], c[r] + 16 * v);
#define LOADROW(r) LOADC(r, 0) LOADC(r, 1) LOADC(r, 2) LOADC(r, 3)
  LOADROW(0) LOADROW(1) LOADROW(2) LOADROW(3) LOADROW(4) LOADROW(5)
#undef LOADROW
#undef LOADC
  const uint16_t* a0 = a[0];
  const uint16_t* a1 = R > 1 ? a[1] : a[0];
  const uint16_t* a2 = R > 2 ? a[2] : a[0];
  const uint16_t* a3 = R > 3 ? a[3] : a[0];
  const uint16_t* a4 = R > 4 ? a[4] : a[0];
  const uint16_t* a5 = R > 5 ? a[5] : a[0];
  for (int64_t q = 0; q < pairs; ++q) {
    const uint16_t* bq = b + q * b_stride;
    const __m512i b0 = _mm512_loadu_si512(bq);
    __m512i b1 = _mm512_setzero_si512(), b2 = b1, b3 = b1;
    if constexpr (V > 1) b1 = _mm512_loadu_si512(bq + 32);
    if constexpr (V > 2) b2 = _mm512_loadu_si512(bq + 64);
    if constexpr (V > 3) b3 = _mm512_loadu_si512(bq + 96);
#define ROW(r)                                     \
  if constexpr (R > r) {                           \
    int32_t pair;                                  \
    std::memcpy(&pair, a##r + q * a_stride, 4);    \
    const __m512i s = _mm512_set1_epi32(pair);     \
    dpbf16(x##r##0, b0, s);                        \
    if constexpr (V > 1) dpbf16(x##r##1, b1, s);   \
    if constexpr (V > 2) dpbf16(x##r##2, b2, s);   \
    if constexpr (V > 3) dpbf16(x##r##3, b3, s);   \
  }
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
  }
#define STOREC(r, v) \
  if constexpr (R > r && V > v) _mm512_mask_storeu_ps(c[r] + 16 * v, mk[v], x##r##v);
#define STOREROW(r) STOREC(r, 0) STOREC(r, 1) STOREC(r, 2) STOREC(r, 3)
  STOREROW(0) STOREROW(1) STOREROW(2) STOREROW(3) STOREROW(4) STOREROW(5)
#undef STOREROW
#undef STOREC
}

// pair_rows with V picked from the columns left (a multiple of 16, > 0).
template <int R>
__attribute__((target("avx512f,avx512bf16"))) inline void pair_rows_upto(
    int64_t cols_left, const uint16_t* const* a, int64_t a_stride, const uint16_t* b,
    int64_t b_stride, int64_t pairs, float* const* c, const __mmask16* mk) {
  if (cols_left >= 64) {
    pair_rows<R, 4>(a, a_stride, b, b_stride, pairs, c, mk);
  } else if (cols_left == 48) {
    pair_rows<R, 3>(a, a_stride, b, b_stride, pairs, c, mk);
  } else if (cols_left == 32) {
    pair_rows<R, 2>(a, a_stride, b, b_stride, pairs, c, mk);
  } else {
    pair_rows<R, 1>(a, a_stride, b, b_stride, pairs, c, mk);
  }
}

// dst[0:n] = bf16(src[0:n]), round to nearest even (vcvtneps2bf16; NaN stays
// NaN, quieted; the accumulators hold no subnormals).
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void tile_to_bf16(
    const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<const __m256i&>(h));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i));
    _mm256_mask_storeu_epi16(dst + i, m, reinterpret_cast<const __m256i&>(h));
  }
}

// The forward's register block: kRows edges' feature rows against offset
// k's packed weight, into their tile rows, every column strip.
__attribute__((target("avx512f,avx512bf16"))) void block_bf16(const Block& blk,
                                                              const PackedBf16& w, int64_t k,
                                                              int64_t cout) {
  const int64_t stride = w.cout_pad * 2;
  const uint16_t* wk = w.w.data() + k * w.pairs * stride;
  for (int64_t n0 = 0; n0 < w.cout_pad; n0 += 64) {
    __mmask16 mk[4];
    for (int v = 0; v < 4; ++v) {
      const int64_t rem = cout - n0 - 16 * v;
      mk[v] = rem >= 16 ? static_cast<__mmask16>(0xffff)
                        : (rem > 0 ? static_cast<__mmask16>((1u << rem) - 1u) : 0);
    }
    float* c[kRows];
    for (int r = 0; r < kRows; ++r) c[r] = blk.c[r] + n0;
    const int64_t left = w.cout_pad - n0;
    const uint16_t* const wn = wk + n0 * 2;
    switch (blk.rows) {
      case 1: pair_rows_upto<1>(left, blk.a, 2, wn, stride, w.pairs, c, mk); break;
      case 2: pair_rows_upto<2>(left, blk.a, 2, wn, stride, w.pairs, c, mk); break;
      case 3: pair_rows_upto<3>(left, blk.a, 2, wn, stride, w.pairs, c, mk); break;
      case 4: pair_rows_upto<4>(left, blk.a, 2, wn, stride, w.pairs, c, mk); break;
      case 5: pair_rows_upto<5>(left, blk.a, 2, wn, stride, w.pairs, c, mk); break;
      default: pair_rows_upto<kRows>(left, blk.a, 2, wn, stride, w.pairs, c, mk); break;
    }
  }
}

// Words a[i] | b[i] << 16 (b absent: zero) for i in [0, n), zero on to
// n_pad (a multiple of 16): two rows in vdpbf16ps's pair layout.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void interleave_rows(
    const uint16_t* a, const uint16_t* b, int64_t n, int64_t n_pad, uint16_t* out) {
  for (int64_t i = 0; i < n_pad; i += 16) {
    const int64_t left = std::clamp<int64_t>(n - i, 0, 16);
    const __mmask16 m = static_cast<__mmask16>((uint32_t{1} << left) - 1u);
    // (The zero-masked forms: GCC 12 warns about the unmasked ones'
    // undefined pass-through operand.)
    const __m512i lo = _mm512_maskz_cvtepu16_epi32(m, _mm256_maskz_loadu_epi16(m, a + i));
    __m512i word = lo;
    if (b != nullptr) {
      const __m512i hi = _mm512_maskz_cvtepu16_epi32(m, _mm256_maskz_loadu_epi16(m, b + i));
      word = _mm512_or_si512(lo, _mm512_maskz_slli_epi32(m, hi, 16));
    }
    _mm512_storeu_si512(out + 2 * i, word);
  }
}

constexpr int64_t kWgradPairs = 64;  // edge pairs per slab: both panels in L1
constexpr int64_t kWgradAhead = 8;  // edges between a row request and its gather

struct WgradPanels {
  LineVector<uint16_t> f;  // [pair][cin_pad][2]: feature pairs, one word per channel
  LineVector<uint16_t> g;  // [pair][cout_pad][2]: cotangent pairs
  LineVector<float> acc;   // cin_pad x cout_pad
};
thread_local WgradPanels wgrad_panels;

// dW[k] for offsets [k0, k1) on vdpbf16ps. Per slab of an offset's edges,
// each pair of edges (e0, e1) becomes one word per channel of their feature
// rows and of their cotangent rows (vdpbf16ps's pair layout, no transpose);
// dW's float32 rows then take 4 channels x 64 columns at a time over the
// slab's pairs. Per dW element: the offset's edges in kernel-CSR order, in
// pairs, the odd edge's product added before the even's (vdpbf16ps's
// order, as in the forward), float32 throughout.
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void wgrad_bf16(
    const amx_bf16::WgradArgs& p, int64_t k0, int64_t k1, float* dweight) {
  auto& s = this_thread(wgrad_panels);
  const __mmask16 all[4] = {0xffff, 0xffff, 0xffff, 0xffff};
  const int64_t cin_pad = ceil_div(p.cin, 16) * 16;
  const int64_t cout_pad = ceil_div(p.cout, 16) * 16;
  s.f.resize(kWgradPairs * cin_pad * 2);
  s.g.resize(kWgradPairs * cout_pad * 2);
  s.acc.resize(cin_pad * cout_pad);
  uint16_t* const fp = s.f.data();
  uint16_t* const gp = s.g.data();
  float* const acc = s.acc.data();
  // The F and G rows of the edge at position j looked up (edge_rows:
  // validated), kept for its gather and requested: the gather below asks
  // for the edges kWgradAhead positions on, whose rows, scattered over both
  // arrays, would otherwise be waited for one at a time. Edge j's rows stay
  // in ahead[j % kRing] until the pair that gathers it.
  constexpr int64_t kRing = kWgradAhead + 2;
  amx_bf16::EdgeRows ahead[kRing];
  auto request = [&p, &ahead](int64_t j) {
    const amx_bf16::EdgeRows rows = amx_bf16::edge_rows(p, j);
    ahead[j % kRing] = rows;
    prefetch_lines(rows.f, p.cin * 2);
    prefetch_lines(rows.g, p.cout * 2);
  };
  for (int64_t i = k0; i < k1; ++i) {
    const int64_t k = p.offset(i);
    std::fill(acc, acc + cin_pad * cout_pad, 0.0f);
    const int64_t j0 = p.kernel_csr.offsets[k];
    const int64_t j1 = p.kernel_csr.offsets[k + 1];
    for (int64_t j = j0; j < std::min(j1, j0 + kWgradAhead); ++j) request(j);
    for (int64_t sj = j0; sj < j1; sj += 2 * kWgradPairs) {
      const int64_t n = std::min(2 * kWgradPairs, j1 - sj);
      const int64_t pairs = ceil_div(n, 2);
      for (int64_t q = 0; q < pairs; ++q) {
        const int64_t j = sj + 2 * q;
        for (int64_t t = j + kWgradAhead; t < std::min(j1, j + kWgradAhead + 2); ++t) request(t);
        const bool odd = j + 1 < sj + n;
        const amx_bf16::EdgeRows r0 = ahead[j % kRing];
        const amx_bf16::EdgeRows r1 = odd ? ahead[(j + 1) % kRing] : r0;
        interleave_rows(r0.f, odd ? r1.f : nullptr, p.cin, cin_pad, fp + q * cin_pad * 2);
        interleave_rows(r0.g, odd ? r1.g : nullptr, p.cout, cout_pad, gp + q * cout_pad * 2);
      }
      for (int64_t c0 = 0; c0 < cin_pad; c0 += 4) {
        for (int64_t n0 = 0; n0 < cout_pad; n0 += 64) {
          const uint16_t* a[4];
          float* c[4];
          for (int r = 0; r < 4; ++r) {
            a[r] = fp + (c0 + r) * 2;
            c[r] = acc + (c0 + r) * cout_pad + n0;
          }
          pair_rows_upto<4>(cout_pad - n0, a, cin_pad * 2, gp + n0 * 2, cout_pad * 2, pairs, c,
                            all);
        }
      }
    }
    float* dst = dweight + k * p.cin * p.cout;
    for (int64_t c = 0; c < p.cin; ++c) {
      std::memcpy(dst + c * p.cout, acc + c * cout_pad, sizeof(float) * p.cout);
    }
  }
}

#endif

#include "gemm_half_neon.inc"  // AArch64 BFMLALB/T and FMLAL/FMLAL2 blocks

// The half-precision blocks by ISA level (cpu/isa.h), best first; the last
// entry (no kernel) sends callers to the float32 path. An entry runs either
// per register block of edges (block, round) or per block of output rows
// (rows: the AMX output-stationary driver, cpu/amx_bf16.h).
using BlockFn = void (*)(const Block& blk, const PackedBf16& w, int64_t k, int64_t cout);
using RoundFn = void (*)(const float* src, int64_t n, uint16_t* dst);
struct HalfEntry {
  isa::Isa isa;
  BlockFn block;
  RoundFn round;  // the float32 tile to the storage format
  Bf16RowsFn rows = nullptr;
  Bf16WgradFn wgrad = nullptr;  // the weight gradient, where the entry has one
};
// Not constexpr: the AMX entry's driver is defined in its own translation
// unit (a constant-initialized pointer, so set before this table).
const HalfEntry kBf16Table[] = {
#ifdef MLX_LATTICE_X86
    {isa::Isa::kAmxBf16, nullptr, nullptr, kAmxBf16RowsHw, kAmxBf16WgradHw},
    {isa::Isa::kAvx512Bf16, block_bf16, tile_to_bf16, nullptr, wgrad_bf16},
#endif
#if defined(__aarch64__)
    {isa::Isa::kNeonBf16, block_neon_half<true>, tile_to_bf16_neon},
#endif
    {isa::Isa::kScalar, nullptr, nullptr}};
constexpr HalfEntry kFp16Table[] = {
#if defined(__aarch64__)
    {isa::Isa::kNeonFhm, block_neon_half<false>, tile_to_fp16_neon},
#endif
    {isa::Isa::kScalar, nullptr, nullptr}};

// The bf16 entry, host-aware ("never slower than float32"): vdpbf16ps
// (avx512-bf16) runs at the FMA instruction's rate on AMD Zen 4/5, where
// the bf16 block beats the float32 path (1.5x in //benchmarks:sparse_conv),
// but at half of it on Intel cores (fma_peak on an AMX Xeon: 228 against
// 456 GFLOP/s; the bf16 forward ran at 0.69x float32 there), so on Intel
// CPUs the avx512-bf16 entry is skipped: AMX-BF16 where usable, else the
// conversion to float32 and the FMA kernels. The rule is CPUID's vendor,
// not a timing, so a host's choice (and its bits) is the same in every run;
// ext.bf16_isa() reports it. An entry whose driver this build lacks is
// skipped.
const HalfEntry& pick_bf16() {
  constexpr size_t n = sizeof(kBf16Table) / sizeof(kBf16Table[0]);
  for (size_t i = 0; i + 1 < n; ++i) {
    const HalfEntry& e = kBf16Table[i];
    if ((e.block == nullptr && e.rows == nullptr) || !isa::isa_usable(e.isa)) continue;
#ifdef MLX_LATTICE_X86
    if (e.isa == isa::Isa::kAvx512Bf16 && isa::cpu_is_intel()) continue;
#endif
    return e;
  }
  return kBf16Table[n - 1];
}

// The entry picked for a storage format (kBF16 or kF16) at first use (once:
// a caller's half_conv_available and half_conv must agree).
const HalfEntry& entry_for(FloatFormat format) {
  static const HalfEntry& bf16 = pick_bf16();
  static const HalfEntry& fp16 = isa::pick(kFp16Table);
  return format == FloatFormat::kBF16 ? bf16 : fp16;
}

// Output rows per parallel task of the row driver (its window: the edges
// of each offset inside, 16 to a tile): 256, or with 2 MiB of L2 (every AMX
// host) as many as fill an eighth of it with float32 rows (l2_tile_rows;
// C64: 1024 rows, forward and feature gradient 3-5% faster than 256 on the
// Intel AMX host).
constexpr int64_t kAmxTileRows = 256;

// The row driver over every output row of `csr`: the weight packed once per
// call into TDPBF16PS's layout (this thread's buffer, read by the workers).
void rows_conv(Bf16RowsFn fn, const uint16_t* feats, int64_t n_in, int64_t cin,
               const uint16_t* weight, int64_t n_kernels, int64_t cout, bool transpose_weight,
               const Csr& csr, const int32_t* a_index, const int32_t* kernel_ids,
               uint16_t* out) {
  thread_local amx_bf16::PackedWeight packed;
  amx_bf16::PackedWeight& p = this_thread(packed);
  // The driver's channels: rows of `row_ch`, outputs of `out_ch`.
  const int64_t row_ch = transpose_weight ? cout : cin;
  const int64_t out_ch = transpose_weight ? cin : cout;
  amx_bf16::pack_weight(weight, n_kernels, row_ch, out_ch, transpose_weight, p);
  const amx_bf16::Weights w = amx_bf16::view(p, n_kernels, out_ch);
  const amx_bf16::Rows rows{feats, n_in, row_ch};
  const int64_t window = l2_tile_rows(w.cout_pad * 4, kAmxTileRows, csr.groups, 8);
  parallel_for_windows(csr.groups, window, [&](int64_t g0, int64_t g1) {
    fn(rows, w, csr, a_index, kernel_ids, g0, g1, out);
  });
}

struct Scratch {
  TileEdges edges;
  std::vector<const uint16_t*> a_ptrs;
  std::vector<float*> c_ptrs;
  LineVector<float> sink;
  LineVector<float> tile;
};

thread_local Scratch scratch;

struct Buffers {
  PackedBf16 weight;
  LineVector<uint16_t> padded;  // features with an even row length
  LineVector<uint16_t> zeros;
};

// The tile driver shared by every half-precision block (one entry's block and
// rounding): weight packing, per-tile edge sort by offset, float32 tile.
// Rows of `cin` channels give outputs of `cout`: W is (K, cin, cout), or,
// transpose_weight, (K, cout, cin) read as each offset's transpose (the
// feature gradient: cotangent rows, the input CSR, c_index = in_rows).
void conv_tiles(const HalfEntry& entry, const uint16_t* feats, int64_t n_in, int64_t cin,
               const uint16_t* weight, int64_t n_kernels, int64_t cout, bool transpose_weight,
               const Csr& csr, const int32_t* a_index, const int32_t* c_index,
               const int32_t* kernel_ids, uint16_t* out) {
  thread_local Buffers buffers;
  Buffers& buf = this_thread(buffers);  // the workers below use this thread's buffers
  PackedBf16& w = buf.weight;
  w.pairs = ceil_div(cin, 2);
  w.cout_pad = ceil_div(cout, 16) * 16;
  w.w.assign(n_kernels * w.pairs * w.cout_pad * 2, 0);
  for (int64_t k = 0; k < n_kernels; ++k) {
    for (int64_t c = 0; c < cin; ++c) {
      for (int64_t x = 0; x < cout; ++x) {
        w.w[((k * w.pairs + c / 2) * w.cout_pad + x) * 2 + c % 2] =
            transpose_weight ? weight[(k * cout + x) * cin + c] : weight[(k * cin + c) * cout + x];
      }
    }
  }
  // Odd channel counts: rows padded with a zero channel, so the last pair
  // read stays inside the row.
  const int64_t row_len = 2 * w.pairs;
  const uint16_t* rows = feats;
  if (row_len != cin) {
    buf.padded.assign(n_in * row_len, 0);
    for (int64_t r = 0; r < n_in; ++r) {
      std::memcpy(buf.padded.data() + r * row_len, feats + r * cin, sizeof(uint16_t) * cin);
    }
    rows = buf.padded.data();
  }
  buf.zeros.assign(row_len, 0);

  parallel_for_windows(csr.groups, kTileRows, [&](int64_t g0, int64_t g1) {
    auto& s = this_thread(scratch);
    // The tile's output rows accumulate in a float32 buffer (in cache), then
    // are rounded to bf16 once.
    s.tile.assign((g1 - g0) * cout, 0.0f);
    const int64_t n_tile = csr.offsets[g1] - csr.offsets[g0];
    s.a_ptrs.resize(n_tile);
    s.c_ptrs.resize(n_tile);
    sort_tile_edges(csr, g0, g1, kernel_ids, n_kernels, s.edges, [&](int32_t slot, int32_t e) {
      s.a_ptrs[slot] = rows + static_cast<int64_t>(a_index[e]) * row_len;
      s.c_ptrs[slot] = s.tile.data() + (static_cast<int64_t>(c_index[e]) - g0) * cout;
    });
    const auto& counts = s.edges.counts;
    if (static_cast<int64_t>(s.sink.size()) < cout) s.sink.assign(cout, 0.0f);
    Block blk;
    for (int64_t k = 0; k < n_kernels; ++k) {
      for (int64_t r = counts[k]; r < counts[k + 1]; r += kRows) {
        // The next block's rows (this offset's or the next one's first),
        // gathered from anywhere in the features, requested behind this one.
        const int64_t next = std::min<int64_t>(r + kRows, counts[k + 1]);
        for (int64_t i = next; i < std::min<int64_t>(next + kRows, n_tile); ++i) {
          prefetch_lines(s.a_ptrs[i], row_len * 2);
        }
        blk.rows = static_cast<int>(std::min<int64_t>(kRows, counts[k + 1] - r));
        for (int i = 0; i < kRows; ++i) {
          const bool real = r + i < counts[k + 1];
          blk.a[i] = real ? s.a_ptrs[r + i] : buf.zeros.data();
          blk.c[i] = real ? s.c_ptrs[r + i] : s.sink.data();
        }
        entry.block(blk, w, k, cout);
      }
    }
    entry.round(s.tile.data(), (g1 - g0) * cout, out + g0 * cout);
  });
}

// The convolution over `csr`'s groups on an entry: the row driver, or the
// tile driver with the entry's block. W is (K, cin, cout); transposed, the
// rows have cout channels and the outputs cin (the feature gradient).
void run_entry(const HalfEntry& entry, const uint16_t* rows, int64_t n_rows,
               const uint16_t* weight, int64_t n_kernels, int64_t cin, int64_t cout,
               bool transpose_weight, const Csr& csr, const int32_t* a_index,
               const int32_t* c_index, const int32_t* kernel_ids, uint16_t* out) {
  if (entry.rows) {
    rows_conv(entry.rows, rows, n_rows, cin, weight, n_kernels, cout, transpose_weight, csr,
              a_index, kernel_ids, out);
    return;
  }
  conv_tiles(entry, rows, n_rows, transpose_weight ? cout : cin, weight, n_kernels,
             transpose_weight ? cin : cout, transpose_weight, csr, a_index, c_index, kernel_ids,
             out);
}

}  // namespace

bool half_conv_available(FloatFormat format) {
  return format != FloatFormat::kF32 &&
         (entry_for(format).block != nullptr || entry_for(format).rows != nullptr);
}

bool half_weight_grad_available(FloatFormat format) {
  return format != FloatFormat::kF32 && entry_for(format).wgrad != nullptr;
}

bool half_conv_transposed_available(FloatFormat format) {
  return format == FloatFormat::kBF16 &&
         (entry_for(format).rows != nullptr || entry_for(format).block != nullptr);
}

const char* half_isa(FloatFormat format) {
  return half_conv_available(format) ? isa::isa_name(entry_for(format).isa) : "float32";
}

void half_conv(FloatFormat format, const uint16_t* feats, int64_t n_in, int64_t cin,
               const uint16_t* weight, int64_t n_kernels, int64_t cout, const Csr& csr,
               const int32_t* a_index, const int32_t* c_index, const int32_t* kernel_ids,
               uint16_t* out) {
  if (!half_conv_available(format)) return;
  run_entry(entry_for(format), feats, n_in, weight, n_kernels, cin, cout, false, csr, a_index,
            c_index, kernel_ids, out);
}

void half_conv_transposed(FloatFormat format, const uint16_t* grad, int64_t n_out, int64_t cout,
                          const uint16_t* weight, int64_t n_kernels, int64_t cin, const Csr& csr,
                          const int32_t* g_index, const int32_t* c_index,
                          const int32_t* kernel_ids, uint16_t* out) {
  if (!half_conv_transposed_available(format)) return;
  run_entry(entry_for(format), grad, n_out, weight, n_kernels, cin, cout, true, csr, g_index,
            c_index, kernel_ids, out);
}

void bf16_conv_rows(Bf16RowsFn rows, const uint16_t* feats, int64_t n_in, int64_t cin,
                    const uint16_t* weight, int64_t n_kernels, int64_t cout, bool transpose_weight,
                    const Csr& csr, const int32_t* a_index, const int32_t* kernel_ids,
                    uint16_t* out) {
  rows_conv(rows, feats, n_in, cin, weight, n_kernels, cout, transpose_weight, csr, a_index,
            kernel_ids, out);
}

void bf16_weight_grad_rows(Bf16WgradFn fn, const uint16_t* feats, int64_t n_in, int64_t cin,
                           const uint16_t* grad, int64_t n_out, int64_t cout,
                           const Csr& kernel_csr, const int32_t* in_rows,
                           const int32_t* out_rows, float* dweight, int64_t window_rows) {
  // One share of the offsets per thread, balanced by edges (largest first,
  // each to the least loaded share); a share's offsets ascending.
  const int64_t n_kernels = kernel_csr.groups;
  const int64_t shares = std::min<int64_t>(n_kernels, std::max(1, get_num_threads()));
  std::vector<int32_t> by_edges(n_kernels);
  std::iota(by_edges.begin(), by_edges.end(), 0);
  auto edges_of = [&kernel_csr](int64_t k) {
    return int64_t{kernel_csr.offsets[k + 1]} - kernel_csr.offsets[k];
  };
  std::stable_sort(by_edges.begin(), by_edges.end(),
                   [&](int32_t a, int32_t b) { return edges_of(a) > edges_of(b); });
  std::vector<std::vector<int32_t>> share(shares);
  std::vector<int64_t> load(shares, 0);
  for (const int32_t k : by_edges) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    share[t].push_back(k);
    load[t] += edges_of(k);
  }
  std::vector<int32_t> order;
  std::vector<int64_t> starts{0};
  for (auto& ks : share) {
    std::sort(ks.begin(), ks.end());
    order.insert(order.end(), ks.begin(), ks.end());
    starts.push_back(static_cast<int64_t>(order.size()));
  }
  // A window's F and G rows (bf16) fill about a quarter of L2.
  if (window_rows <= 0) window_rows = std::max<int64_t>(64, l2_fill_rows((cin + cout) * 2, 4));
  const amx_bf16::WgradArgs args{feats, n_in,     cin,      grad,         n_out,      cout,
                                 kernel_csr, in_rows, out_rows, order.data(), window_rows};
  parallel_for(shares, [&](int64_t t) { fn(args, starts[t], starts[t + 1], dweight); });
}

void half_weight_grad(FloatFormat format, const uint16_t* feats, int64_t n_in, int64_t cin,
                      const uint16_t* grad, int64_t n_out, int64_t cout, const Csr& kernel_csr,
                      const int32_t* in_rows, const int32_t* out_rows, float* dweight) {
  if (!half_weight_grad_available(format)) return;
  bf16_weight_grad_rows(entry_for(format).wgrad, feats, n_in, cin, grad, n_out, cout, kernel_csr,
                        in_rows, out_rows, dweight);
}

}  // namespace mlx_lattice::kernels
