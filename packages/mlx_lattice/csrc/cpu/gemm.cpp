#include "gemm.h"

#include "isa.h"
#include "line_vector.h"
#include "parallel.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include "avx2_lanes.h"
#define MLX_LATTICE_X86 1
#endif
#if defined(__aarch64__)
#include "gemm_arm.h"
#endif

namespace mlx_lattice {

namespace {

constexpr int kRows = kGemmBlockRows;

// Pads a partial block: extra rows read zeros and write to scratch.
struct Padding {
  std::vector<float> zeros;
  std::vector<float> sink;
  void fit(int64_t kdim, int64_t n) {
    if (static_cast<int64_t>(zeros.size()) < kdim) zeros.assign(kdim, 0.0f);
    if (static_cast<int64_t>(sink.size()) < n) sink.assign(n, 0.0f);
  }
};

thread_local Padding padding;

template <typename T, typename Block>
void for_each_block(int64_t m, const T* const* a_rows, int64_t kdim, int64_t n,
                    float* const* c_rows, Block&& block) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) {
    // The next block's rows are gathered from anywhere in A: their loads are
    // issued now, hidden behind this block's arithmetic.
    const int64_t next = std::min<int64_t>(m, r + 2 * kRows);
    for (int64_t i = r + kRows; i < next; ++i) {
      prefetch_lines(a_rows[i], kdim * static_cast<int64_t>(sizeof(T)));
    }
    block(a_rows + r, c_rows + r);
  }
  if constexpr (!std::is_same_v<T, float>) {
    return;  // half-precision rows come in whole blocks (rows_avx512)
  } else if (r < m) {
    padding.fit(kdim, n);
    const float* a[kRows];
    float* c[kRows];
    for (int i = 0; i < kRows; ++i) {
      bool real = r + i < m;
      a[i] = real ? a_rows[r + i] : padding.zeros.data();
      c[i] = real ? c_rows[r + i] : padding.sink.data();
    }
    block(a, c);
  }
}

void block_scalar(const float* const* a, const float* b, int64_t kdim, int64_t n,
                  float* const* c) {
  for (int64_t n0 = 0; n0 < n; n0 += 16) {
    int64_t w = std::min<int64_t>(16, n - n0);
    float acc[kRows][16];
    for (int r = 0; r < kRows; ++r) {
      for (int64_t x = 0; x < w; ++x) acc[r][x] = c[r][n0 + x];
    }
    for (int64_t j = 0; j < kdim; ++j) {
      const float* bj = b + j * n + n0;
      for (int r = 0; r < kRows; ++r) {
        float av = a[r][j];
        for (int64_t x = 0; x < w; ++x) acc[r][x] += av * bj[x];
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int64_t x = 0; x < w; ++x) c[r][n0 + x] = acc[r][x];
    }
  }
}

#ifdef MLX_LATTICE_X86

#include "gemm_avx2.inc"  // rows_avx2, outer_avx2

// What block512 reads A's rows as: float32, or float16 / bfloat16 values
// widened to float32 (exactly) 16 at a time inside the block.
constexpr int kAFloat = 0;
constexpr int kAF16 = 1;
constexpr int kABF16 = 2;
template <int AF>
using AElem = std::conditional_t<AF == kAFloat, float, uint16_t>;

// n <= 16 half-precision values from src widened to float32 (zeros past n).
template <int AF>
__attribute__((target("avx512f"))) inline __m512 widen16(const uint16_t* src, int64_t n) {
  __m256i h;
  if (n == 16) {
    h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  } else {
    alignas(32) uint16_t rest[16] = {};
    std::memcpy(rest, src, sizeof(uint16_t) * static_cast<size_t>(n));
    h = _mm256_load_si256(reinterpret_cast<const __m256i*>(rest));
  }
  // Zero-masked forms over all 16 lanes: the plain ones' values, without
  // the undefined pass-through operand GCC 12 warns about.
  constexpr __mmask16 all = 0xffff;
  if constexpr (AF == kAF16) {
    return _mm512_maskz_cvtph_ps(all, h);
  } else {
    const __m512i wide = _mm512_maskz_cvtepu16_epi32(all, h);
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all, wide, 16));
  }
}

// acc += *ptr (broadcast) * bv as one FMA with an embedded-broadcast memory
// operand: no separate broadcast instruction. Used where a block has one or
// two vectors per row (C <= 32), whose broadcasts otherwise take a third of
// the loop's vector instructions (the AMD hosts); the product and sum are
// the same FMA, so the bits are too. Intel cores run two full-width FMAs a
// cycle and their broadcast load is a plain load, so there each row's
// broadcast goes to a register once and feeds both FMAs (SPLAT): one load per
// row instead of two (C32 block in L1: 142 against 84-124 GFLOP/s per core
// on the Intel AMX host).
#define EMB_FMA(acc, bv, ptr) \
  asm("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(bv), "m"(*(ptr)))

// AVX-512: one R x (16*V) block (V <= 4, so a 64-wide row in one pass) with
// masked tails. MASKED is false where width == 16 * V: plain loads and
// stores of the same values, and no mask register that GCC 12 would move
// into the loop at each step. OUTER selects the addressing: rows (forward:
// a[r][j] times b[j]) or outer products (weight gradient: a[j][r0 + r]
// times g[j]). Per
// output value the sequence is the same as the AVX2 path (C loaded, then one
// FMA per j ascending), so results match it bit for bit.
template <int R, int V, bool OUTER, bool MASKED = true, bool SPLAT = false, int AF = kAFloat>
__attribute__((target("avx512f"))) inline void block512(const AElem<AF>* const* a, const float* b,
                                                        const float* const* g, int64_t kdim,
                                                        int64_t n, int64_t r0,
                                                        float* const* cr, int64_t n0,
                                                        int64_t width) {
  static_assert(AF == kAFloat || !OUTER, "half-precision A only in the row form");
  __mmask16 mk[4];
  for (int v = 0; v < 4; ++v) {
    const int64_t rem = MASKED ? width - 16 * v : 16;
    mk[v] = rem >= 16 ? static_cast<__mmask16>(0xffff)
                      : (rem > 0 ? static_cast<__mmask16>((1u << rem) - 1u) : 0);
  }
  const __m512 zero = _mm512_setzero_ps();
#define DECL(r) __m512 x##r##0 = zero, x##r##1 = zero, x##r##2 = zero, x##r##3 = zero;
  DECL(0) DECL(1) DECL(2) DECL(3) DECL(4) DECL(5)
#undef DECL
#define LOAD(v, ptr) (MASKED ? _mm512_maskz_loadu_ps(mk[v], ptr) : _mm512_loadu_ps(ptr))
#define LOADC(r, v) \
  if constexpr (R > r && V > v) x##r##v = LOAD(v, cr[r] + n0 + 16 * v);
#define LOADROW(r) LOADC(r, 0) LOADC(r, 1) LOADC(r, 2) LOADC(r, 3)
  LOADROW(0) LOADROW(1) LOADROW(2) LOADROW(3) LOADROW(4) LOADROW(5)
#undef LOADROW
#undef LOADC
  // Row r's FMAs of one step, with A's float32 value at AV(r).
#define ROW(r, AV)                                                    \
  if constexpr (R > r && !OUTER && V <= 2 && !SPLAT) {                \
    EMB_FMA(x##r##0, b0, AV(r));                                      \
    if constexpr (V > 1) EMB_FMA(x##r##1, b1, AV(r));                 \
  } else if constexpr (R > r) {                                       \
    const __m512 s = _mm512_set1_ps(*AV(r));                          \
    x##r##0 = _mm512_fmadd_ps(s, b0, x##r##0);                        \
    if constexpr (V > 1) x##r##1 = _mm512_fmadd_ps(s, b1, x##r##1);   \
    if constexpr (V > 2) x##r##2 = _mm512_fmadd_ps(s, b2, x##r##2);   \
    if constexpr (V > 3) x##r##3 = _mm512_fmadd_ps(s, b3, x##r##3);   \
  }
  // Step j: B's vectors of row j (g[j] for outer products), then every
  // row's FMAs. B's vectors stay in registers: left to itself, GCC 12 folds
  // each load into every row's FMA for R <= 3 (R loads of one vector per
  // step), and the loop waits on the load ports.
#define STEP(j, AV)                                                   \
  {                                                                   \
    const float* bj = OUTER ? g[j] + n0 : b + (j) * n + n0;           \
    __m512 b0 = LOAD(0, bj), b1 = zero, b2 = zero, b3 = zero;         \
    if constexpr (V > 1) b1 = LOAD(1, bj + 16);                       \
    if constexpr (V > 2) b2 = LOAD(2, bj + 32);                       \
    if constexpr (V > 3) b3 = LOAD(3, bj + 48);                       \
    asm("" : "+v"(b0));                                               \
    if constexpr (V > 1) asm("" : "+v"(b1));                          \
    if constexpr (V > 2) asm("" : "+v"(b2));                          \
    if constexpr (V > 3) asm("" : "+v"(b3));                          \
    ROW(0, AV) ROW(1, AV) ROW(2, AV) ROW(3, AV) ROW(4, AV) ROW(5, AV) \
  }
  if constexpr (AF == kAFloat) {
    for (int64_t j = 0; j < kdim; ++j) {
      const float* fj = OUTER ? a[j] + r0 : nullptr;
#define AV_ROW(r) (OUTER ? fj + (r) : a[r] + j)
      STEP(j, AV_ROW)
#undef AV_ROW
    }
  } else {
    // Half-precision rows of A, widened 16 values at a time into a buffer
    // in L1 that the steps read as float32 (the same values gemm_rows reads
    // from a widened row, so the same bits). Two buffers: the next 16 values
    // of each row are widened before this chunk's steps, so no step's
    // broadcast reads a line its own chunk has just stored (with one buffer,
    // each chunk's first broadcasts waited on the 64-byte stores: fp16 C64
    // at 0.95-0.98 of the float32 forward on the AMD AVX-512 hosts, now
    // 0.99-1.00).
    alignas(64) float wide[2][R][16];
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(wide[0][r], widen16<AF>(a[r], std::min<int64_t>(16, kdim)));
    }
    for (int64_t j0 = 0; j0 < kdim; j0 += 16) {
      const int64_t kc = std::min<int64_t>(16, kdim - j0);
      float(*cur)[16] = wide[(j0 >> 4) & 1];
      if (j0 + 16 < kdim) {
        float(*next)[16] = wide[((j0 >> 4) + 1) & 1];
        const int64_t kn = std::min<int64_t>(16, kdim - j0 - 16);
        for (int r = 0; r < R; ++r) _mm512_store_ps(next[r], widen16<AF>(a[r] + j0 + 16, kn));
      }
      for (int64_t i = 0; i < kc; ++i) {
#define AV_WIDE(r) (&cur[r][i])
        STEP(j0 + i, AV_WIDE)
#undef AV_WIDE
      }
    }
  }
#undef STEP
#undef ROW
#define STOREC(r, v)                                                          \
  if constexpr (R > r && V > v) {                                             \
    if constexpr (MASKED) {                                                   \
      _mm512_mask_storeu_ps(cr[r] + n0 + 16 * v, mk[v], x##r##v);             \
    } else {                                                                  \
      _mm512_storeu_ps(cr[r] + n0 + 16 * v, x##r##v);                         \
    }                                                                         \
  }
#define STOREROW(r) STOREC(r, 0) STOREC(r, 1) STOREC(r, 2) STOREC(r, 3)
  STOREROW(0) STOREROW(1) STOREROW(2) STOREROW(3) STOREROW(4) STOREROW(5)
#undef STOREROW
#undef STOREC
#undef LOAD
}

// The last column strip: V vectors, all full (a width of 16 * V) or the
// last one masked.
template <int R, int V, bool OUTER, bool SPLAT, int AF = kAFloat>
__attribute__((target("avx512f"))) inline void strip512(const AElem<AF>* const* a, const float* b,
                                                        const float* const* g, int64_t kdim,
                                                        int64_t n, int64_t r0,
                                                        float* const* cr, int64_t n0,
                                                        int64_t width) {
  if (width == 16 * V) {
    block512<R, V, OUTER, false, SPLAT, AF>(a, b, g, kdim, n, r0, cr, n0, width);
  } else {
    block512<R, V, OUTER, true, SPLAT, AF>(a, b, g, kdim, n, r0, cr, n0, width);
  }
}

// All column strips of one R-row block.
template <int R, bool OUTER, bool SPLAT = false, int AF = kAFloat>
__attribute__((target("avx512f"))) void rows512(const AElem<AF>* const* a, const float* b,
                                                const float* const* g, int64_t kdim, int64_t n,
                                                int64_t r0, float* const* cr) {
  int64_t n0 = 0;
  for (; n0 + 64 <= n; n0 += 64) {
    block512<R, 4, OUTER, false, false, AF>(a, b, g, kdim, n, r0, cr, n0, 64);
  }
  const int64_t rest = n - n0;
  if (rest > 48) {
    strip512<R, 4, OUTER, SPLAT, AF>(a, b, g, kdim, n, r0, cr, n0, rest);
  } else if (rest > 32) {
    strip512<R, 3, OUTER, SPLAT, AF>(a, b, g, kdim, n, r0, cr, n0, rest);
  } else if (rest > 16) {
    strip512<R, 2, OUTER, SPLAT, AF>(a, b, g, kdim, n, r0, cr, n0, rest);
  } else if (rest > 0) {
    strip512<R, 1, OUTER, SPLAT, AF>(a, b, g, kdim, n, r0, cr, n0, rest);
  }
}

// The fp32 micro-kernels by ISA level (cpu/isa.h: chosen from CPU feature
// bits, capped by MLX_LATTICE_GEMM_ISA so tests exercise every path).
struct Fp32Entry {
  isa::Isa isa;
};
constexpr Fp32Entry kFp32Table[] = {{isa::Isa::kAvx512}, {isa::Isa::kAvx2}, {isa::Isa::kScalar}};

isa::Isa selected_isa() {
  static const isa::Isa chosen = isa::pick(kFp32Table).isa;
  return chosen;
}

bool has_avx512() { return selected_isa() == isa::Isa::kAvx512; }

bool has_avx2() { return selected_isa() != isa::Isa::kScalar; }

// Whether the forward blocks broadcast into registers (block512's SPLAT):
// on Intel cores, not on AMD's; MLX_LATTICE_GEMM_SPLAT=0 or 1 forces it
// (gemm_test runs both). Read once.
bool cpu_splats() {
  static const bool splat = [] {
    bool forced = false;
    if (splat_from_text(std::getenv("MLX_LATTICE_GEMM_SPLAT"), forced)) return forced;
    return isa::cpu_is_intel();
  }();
  return splat;
}

// gemm_rows on AVX-512: full blocks of 6 rows, then a block of the 1-5 rows
// left (no padding rows computed: about 7% of the work at 28 rows per
// offset and tile).
template <bool SPLAT, int AF = kAFloat>
__attribute__((target("avx512f"))) void rows_avx512(int64_t m, const AElem<AF>* const* a_rows,
                                                    const float* b, int64_t kdim, int64_t n,
                                                    float* const* c_rows) {
  using T = AElem<AF>;
  const int64_t full = m / kRows * kRows;
  for_each_block(full, a_rows, kdim, n, c_rows, [&](const T* const* a, float* const* c) {
    rows512<6, false, SPLAT, AF>(a, b, nullptr, kdim, n, 0, c);
  });
  const T* const* a = a_rows + full;
  float* const* c = c_rows + full;
  switch (m - full) {
    case 5: rows512<5, false, SPLAT, AF>(a, b, nullptr, kdim, n, 0, c); break;
    case 4: rows512<4, false, SPLAT, AF>(a, b, nullptr, kdim, n, 0, c); break;
    case 3: rows512<3, false, SPLAT, AF>(a, b, nullptr, kdim, n, 0, c); break;
    case 2: rows512<2, false, SPLAT, AF>(a, b, nullptr, kdim, n, 0, c); break;
    case 1: rows512<1, false, SPLAT, AF>(a, b, nullptr, kdim, n, 0, c); break;
    default: break;
  }
}

#endif

}  // namespace

bool splat_from_text(const char* text, bool& splat) {
  if (text == nullptr || (std::strcmp(text, "0") != 0 && std::strcmp(text, "1") != 0)) {
    return false;
  }
  splat = text[0] == '1';
  return true;
}

void gemm_rows(int64_t m, const float* const* a_rows, const float* b, int64_t kdim, int64_t n,
               float* const* c_rows) {
  if (m <= 0 || n <= 0 || kdim <= 0) return;
#if defined(__aarch64__)
  if (arm::selected_isa()) return arm::gemm_rows(m, a_rows, b, kdim, n, c_rows);
#endif
#ifdef MLX_LATTICE_X86
  if (has_avx512()) {
    if (cpu_splats()) {
      rows_avx512<true>(m, a_rows, b, kdim, n, c_rows);
    } else {
      rows_avx512<false>(m, a_rows, b, kdim, n, c_rows);
    }
    return;
  }
  if (has_avx2()) {
    rows_avx2(m, a_rows, b, kdim, n, c_rows);
    return;
  }
#endif
  for_each_block(m, a_rows, kdim, n, c_rows,
                 [&](const float* const* a, float* const* c) { block_scalar(a, b, kdim, n, c); });
}

void gemm_rows_widened(int64_t m, const uint16_t* const* a_rows, WidenRow widen, const float* b,
                       int64_t kdim, int64_t n, float* const* c_rows) {
  if (m <= 0 || n <= 0 || kdim <= 0) return;
  // kRows widened rows, each starting on a line; reused across calls.
  thread_local kernels::LineVector<float> widened_tls;
  auto& widened = this_thread(widened_tls);
  const int64_t stride = (kdim + 15) / 16 * 16;
  if (static_cast<int64_t>(widened.size()) < kRows * stride) widened.resize(kRows * stride);
  float* w[kRows];
  for (int i = 0; i < kRows; ++i) w[i] = widened.data() + i * stride;
  const int64_t row_bytes = kdim * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t i = 0; i < std::min<int64_t>(m, kRows); ++i) prefetch_lines(a_rows[i], row_bytes);
  for (int64_t r = 0; r < m; r += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, m - r);
    const int64_t next = std::min<int64_t>(m, r + 2 * kRows);
    for (int64_t i = r + kRows; i < next; ++i) prefetch_lines(a_rows[i], row_bytes);
    for (int64_t i = 0; i < rows; ++i) widen(a_rows[r + i], kdim, w[i]);
    gemm_rows(rows, w, b, kdim, n, c_rows + r);
  }
}

bool gemm_rows_half(int64_t m, const uint16_t* const* a_rows, bool bf16, const float* b,
                    int64_t kdim, int64_t n, float* const* c_rows) {
#ifdef MLX_LATTICE_X86
  if (!has_avx512()) return false;
  if (m <= 0 || n <= 0 || kdim <= 0) return true;
  const bool splat = cpu_splats();
  if (bf16) {
    splat ? rows_avx512<true, kABF16>(m, a_rows, b, kdim, n, c_rows)
          : rows_avx512<false, kABF16>(m, a_rows, b, kdim, n, c_rows);
  } else {
    splat ? rows_avx512<true, kAF16>(m, a_rows, b, kdim, n, c_rows)
          : rows_avx512<false, kAF16>(m, a_rows, b, kdim, n, c_rows);
  }
  return true;
#else
  (void)m, (void)a_rows, (void)bf16, (void)b, (void)kdim, (void)n, (void)c_rows;
  return false;
#endif
}

void gemm_outer(int64_t m, const float* const* f, const float* const* g, int64_t r0, int64_t r1,
                float* c, int64_t n) {
  if (m <= 0 || n <= 0) return;
#if defined(__aarch64__)
  if (arm::selected_isa()) return arm::gemm_outer(m, f, g, r0, r1, c, n);
#endif
  int64_t r = r0;
#ifdef MLX_LATTICE_X86
  if (has_avx512()) {
    float* cr[kRows];
    auto block = [&]<int R>() {
      for (int i = 0; i < kRows; ++i) cr[i] = c + (r + (i < R ? i : 0)) * n;
      rows512<R, true>(f, nullptr, g, m, n, r, cr);
    };
    for (; r + kRows <= r1; r += kRows) block.template operator()<6>();
    switch (r1 - r) {
      case 5: block.template operator()<5>(); break;
      case 4: block.template operator()<4>(); break;
      case 3: block.template operator()<3>(); break;
      case 2: block.template operator()<2>(); break;
      case 1: block.template operator()<1>(); break;
      default: break;
    }
    return;
  }
  if (has_avx2()) {
    for (; r + kRows <= r1; r += kRows) outer_avx2<6>(m, f, g, r, c, n);
    switch (r1 - r) {
      case 5: outer_avx2<5>(m, f, g, r, c, n); break;
      case 4: outer_avx2<4>(m, f, g, r, c, n); break;
      case 3: outer_avx2<3>(m, f, g, r, c, n); break;
      case 2: outer_avx2<2>(m, f, g, r, c, n); break;
      case 1: outer_avx2<1>(m, f, g, r, c, n); break;
      default: break;
    }
    return;
  }
#endif
  // Machines without AVX2: plain loops, same order.
  for (; r < r1; ++r) {
    float* cr = c + r * n;
    for (int64_t j = 0; j < m; ++j) {
      const float a = f[j][r];
      const float* gj = g[j];
      for (int64_t x = 0; x < n; ++x) cr[x] += a * gj[x];
    }
  }
}

const char* gemm_isa() {
#if defined(__aarch64__)
  if (arm::selected_isa()) return arm::selected_isa();
#endif
#ifdef MLX_LATTICE_X86
  if (has_avx512()) return "avx512f";
  if (has_avx2()) return "avx2-fma";
#endif
  return "scalar";
}

std::vector<std::string> gemm_isas() {
  // The fp32 levels of this architecture, best first (cpu/isa.h).
  constexpr isa::Isa kLevels[] = {isa::Isa::kAvx512, isa::Isa::kAvx2, isa::Isa::kNeon};
  std::vector<std::string> isas;
  for (isa::Isa level : kLevels) {
    if (isa::isa_supported(level)) isas.push_back(isa::isa_name(level));
  }
  isas.push_back("scalar");
  return isas;
}

}  // namespace mlx_lattice
