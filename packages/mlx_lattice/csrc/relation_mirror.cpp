#include "relation_mirror.h"

#include <algorithm>
#include <bit>

#include "cpu/isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace mlx_lattice {

namespace {

// Set bits of v without a POPCNT instruction.
struct PortableCount {
  int32_t operator()(uint32_t v) const {
    v = v - ((v >> 1) & 0x55555555u);
    v = (v & 0x33333333u) + ((v >> 2) & 0x33333333u);
    return static_cast<int32_t>((((v + (v >> 4)) & 0x0f0f0f0fu) * 0x01010101u) >> 24);
  }
};

// Set bits of v: one instruction where the caller's target has it.
struct BuiltinCount {
  [[gnu::always_inline]] int32_t operator()(uint32_t v) const { return __builtin_popcount(v); }
};

// Rows [from, o1): each row's set bits, and added to k_counts[k] the rows
// with bit k <= centre (their set bits below centre + 1, one at a time).
template <class Count>
[[gnu::always_inline]] inline void add_rows(const uint32_t* masks, int64_t from, int64_t o1,
                                            int32_t* counts, int centre, int32_t* k_counts,
                                            Count count) {
  const uint32_t low = (uint32_t{2} << centre) - 1;
  for (int64_t o = from; o < o1; ++o) {
    counts[o] = count(masks[o]);
    for (uint32_t bits = masks[o] & low; bits != 0; bits &= bits - 1) {
      ++k_counts[std::countr_zero(bits)];
    }
  }
}

// MirrorKernels::count, one row at a time.
template <class Count>
[[gnu::always_inline]] inline void count_rows(const uint32_t* masks, int64_t o0, int64_t o1,
                                              int32_t* counts, int centre, int32_t* k_counts,
                                              Count count) {
  std::fill(k_counts, k_counts + centre + 1, 0);
  add_rows(masks, o0, o1, counts, centre, k_counts, count);
}

// Row o's edges are written at its offset in order of k; for each edge
// e = (out o, in q, k) before the centre, its mirror e' = (out q, in o,
// K - 1 - k) sits at q's offset plus the bits of q's mask below K - 1 - k:
// in_edge_ids[e] = e' and in_edge_ids[e'] = e (row o's input edges are the
// mirrors of its own, in the order of k), and the kernel group of K - 1 - k
// holds the mirrors of group k's edges in the same order.
//
// With kRows false the caller has written each row's output rows and kernel
// ids itself (emit_rows_avx512).
template <bool kRows = true, class Count>
[[gnu::always_inline]] inline void write_tile(const MirrorTile& m, int64_t t, Count count) {
  const int64_t o0 = t * m.tile, o1 = std::min(m.n, o0 + m.tile);
  const int k_count = static_cast<int>(m.n_kernels), mid = k_count / 2;
  // Locals: without strict aliasing each store could change the struct.
  const uint32_t* masks = m.masks;
  const int32_t* nbrs = m.half;
  const int32_t* offs = m.out_offsets;
  const int32_t* k_first = m.k_offsets;
  int32_t* ins = m.in_rows;
  int32_t* outs = m.out_rows + offs[o0];
  int32_t* kids = m.kernel_ids + offs[o0];
  int32_t* in_ids = m.in_edge_ids;
  int32_t* k_ids = m.k_edge_ids;
  int32_t next[17];
  std::copy(m.k_slot + t * (mid + 1), m.k_slot + (t + 1) * (mid + 1), next);
  const uint32_t before_centre = (uint32_t{1} << mid) - 1;
  for (int64_t o = o0; o < o1; ++o) {
    const int32_t* nbr = nbrs + o * mid;
    const int32_t row = static_cast<int32_t>(o);
    int32_t e = offs[o];
    if constexpr (kRows) {
      for (uint32_t bits = masks[o]; bits != 0; bits &= bits - 1) {
        *outs++ = row;
        *kids++ = std::countr_zero(bits);
      }
    }
    for (uint32_t bits = masks[o] & before_centre; bits != 0; bits &= bits - 1, ++e) {
      const int k = std::countr_zero(bits), k_mirror = k_count - 1 - k;
      const int32_t q = nbr[k];
      const int32_t mirror = offs[q] + count(masks[q] & ((uint32_t{1} << k_mirror) - 1));
      ins[e] = q;
      ins[mirror] = row;
      in_ids[e] = mirror;
      in_ids[mirror] = e;
      const int32_t slot = next[k]++;
      k_ids[slot] = e;
      k_ids[k_first[k_mirror] + slot - k_first[k]] = mirror;
    }
    ins[e] = row;
    in_ids[e] = e;
    k_ids[next[mid]++] = e;
  }
}

void count_portable(const uint32_t* masks, int64_t o0, int64_t o1, int32_t* counts, int centre,
                    int32_t* k_counts) {
  count_rows(masks, o0, o1, counts, centre, k_counts, PortableCount{});
}

void write_portable(const MirrorTile& m, int64_t t) { write_tile(m, t, PortableCount{}); }

#if defined(__x86_64__)
#define MLX_LATTICE_POPCNT __attribute__((target("popcnt")))
#else
#define MLX_LATTICE_POPCNT
#endif

#if defined(__x86_64__) || defined(__aarch64__)
MLX_LATTICE_POPCNT void count_builtin(const uint32_t* masks, int64_t o0, int64_t o1,
                                      int32_t* counts, int centre, int32_t* k_counts) {
  count_rows(masks, o0, o1, counts, centre, k_counts, BuiltinCount{});
}

MLX_LATTICE_POPCNT void write_builtin(const MirrorTile& m, int64_t t) {
  write_tile(m, t, BuiltinCount{});
}
#endif

#if defined(__x86_64__)
#define MLX_LATTICE_AVX512 __attribute__((target("avx512f,popcnt")))

// Tile t's output rows and kernel ids: row o's kernel ids are its mask's set
// bits ascending, compressed out of 0-31 sixteen lanes at a time and stored
// under a mask of their count, its output rows the same lanes of o (the
// bits write_tile's loop writes, without a branch per edge).
MLX_LATTICE_AVX512 void emit_rows_avx512(const MirrorTile& m, int64_t t) {
  const int64_t o0 = t * m.tile, o1 = std::min(m.n, o0 + m.tile);
  const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(16));
  const uint32_t* masks = m.masks;
  int32_t* outs = m.out_rows + m.out_offsets[o0];
  int32_t* kids = m.kernel_ids + m.out_offsets[o0];
  for (int64_t o = o0; o < o1; ++o) {
    const uint32_t mask = masks[o];
    const int na = __builtin_popcount(mask & 0xffffu), nb = __builtin_popcount(mask >> 16);
    const __mmask16 first = static_cast<__mmask16>((1u << na) - 1u);
    const __mmask16 second = static_cast<__mmask16>((1u << nb) - 1u);
    const __m512i row = _mm512_set1_epi32(static_cast<int32_t>(o));
    _mm512_mask_storeu_epi32(kids, first,
                             _mm512_maskz_compress_epi32(static_cast<__mmask16>(mask), low));
    _mm512_mask_storeu_epi32(outs, first, row);
    _mm512_mask_storeu_epi32(
        kids + na, second, _mm512_maskz_compress_epi32(static_cast<__mmask16>(mask >> 16), high));
    _mm512_mask_storeu_epi32(outs + na, second, row);
    outs += na + nb;
    kids += na + nb;
  }
}

// count_builtin with the bits below centre + 1 counted 16 rows at a time,
// one vector of row counts per bit (plus one in the lanes whose mask has it).
MLX_LATTICE_AVX512 void count_avx512(const uint32_t* masks, int64_t o0, int64_t o1,
                                     int32_t* counts, int centre, int32_t* k_counts) {
  if (centre >= 16) {  // masks of at most 32 offsets: never, but not this block's to assume
    count_rows(masks, o0, o1, counts, centre, k_counts, BuiltinCount{});
    return;
  }
  __m512i per_bit[16];
  for (__m512i& v : per_bit) v = _mm512_setzero_si512();
  const __m512i one = _mm512_set1_epi32(1);
  int64_t o = o0;
  for (; o + 16 <= o1; o += 16) {
    const __m512i v = _mm512_loadu_si512(masks + o);
    for (int k = 0; k <= centre; ++k) {
      const __mmask16 has = _mm512_test_epi32_mask(v, _mm512_set1_epi32(1 << k));
      per_bit[k] = _mm512_mask_add_epi32(per_bit[k], has, per_bit[k], one);
    }
    for (int64_t r = o; r < o + 16; ++r) counts[r] = __builtin_popcount(masks[r]);
  }
  alignas(64) int32_t lanes[16];
  for (int k = 0; k <= centre; ++k) {
    _mm512_store_si512(lanes, per_bit[k]);
    int32_t sum = 0;
    for (const int32_t lane : lanes) sum += lane;
    k_counts[k] = sum;
  }
  add_rows(masks, o, o1, counts, centre, k_counts, BuiltinCount{});
}

MLX_LATTICE_AVX512 void write_avx512(const MirrorTile& m, int64_t t) {
  emit_rows_avx512(m, t);
  write_tile<false>(m, t, BuiltinCount{});
}
#endif

}  // namespace

MirrorKernels mirror_kernels() {
#if defined(__x86_64__)
  if (isa::isa_usable(isa::Isa::kAvx512)) return {count_avx512, write_avx512};
  if (isa::isa_usable(isa::Isa::kAvx2)) return {count_builtin, write_builtin};
#elif defined(__aarch64__)
  return {count_builtin, write_builtin};
#endif
  return {count_portable, write_portable};
}

}  // namespace mlx_lattice
