// Where an output-stationary driver sums a window of output rows, and how
// the finished window reaches the output.
//
// A driver zeroes its window's rows, adds every edge's contribution into
// them and moves on: the output is written once, window by window. Summed
// in place, each output line is first read from memory (the store's read
// for ownership; zeroing 25.6 MB of cold lines takes 1.3 ms on the Intel
// AMX host) only to be overwritten. Where the output cannot stay in cache
// for its reader anyway, the driver instead sums the window in a
// per-thread buffer that stays in L2 across windows, and copies each
// finished window out with non-temporal stores, which write whole lines
// without reading them (0.63 ms for the same 25.6 MB).
//
// Measured on that host (benchmarks/LOG.md, "Output windows"): the float32
// forward 5-10% faster at 32 to 80 columns, the w8a8 forward at 32 and 64;
// at 96 and 128 columns both 5-15% slower, with a plain copy out of the
// buffer as well, so the buffer itself costs there. Rows of at most 256
// bytes are streamed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "isa.h"
#include "line_vector.h"
#include "parallel.h"

namespace mlx_lattice::kernels {

// Whether a driver's output of `bytes` in rows of `row_bytes` is summed in
// per-thread windows and streamed out (stream_rows) rather than summed in
// place: rows of at most 256 bytes, and an output at least twice the L2 of
// every thread together, so it cannot stay in L2 for its reader. (With no
// L2 size known, 0, outputs are summed in place.)
inline bool stream_output(int64_t bytes, int64_t row_bytes) {
  constexpr int64_t kMaxRowBytes = 256;
  const int64_t l2 = isa::l2_cache_bytes();
  return l2 > 0 && row_bytes <= kMaxRowBytes &&
         bytes >= 2 * l2 * std::max(1, get_num_threads());
}

// A per-thread window buffer of at least `floats` floats, on a cache line
// (the buffer grows, never shrinks, and is reused across windows and
// calls).
inline float* window_buffer(LineVector<float>& buffer, int64_t floats) {
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

#if defined(__x86_64__) || defined(_M_X64)
// stream_rows's non-temporal part: the whole `block`-byte blocks of dst
// from byte `i` on (dst + i aligned to `block`); returns the first byte
// not copied. 64-byte stores (AVX-512) fill a write-combining buffer at
// once: 25.6 MB in 0.63 ms here against 0.79 ms in 16-byte stores.
__attribute__((target("avx512f"))) inline int64_t stream_blocks_avx512(unsigned char* d,
                                                                      const unsigned char* s,
                                                                      int64_t i, int64_t bytes) {
  for (; i + 64 <= bytes; i += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
  }
  return i;
}

inline int64_t stream_blocks_sse2(unsigned char* d, const unsigned char* s, int64_t i,
                                  int64_t bytes) {
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  }
  return i;
}
#endif

// Copies `bytes` from src to dst: on x86-64 the whole aligned blocks of dst
// with non-temporal stores (64 bytes where AVX-512 is usable, else SSE2's
// 16), ordered before the return (sfence) so the thread that joins this one
// sees them; elsewhere a plain copy.
inline void stream_rows(void* dst, const void* src, int64_t bytes) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
#if defined(__x86_64__) || defined(_M_X64)
  const bool wide = isa::isa_usable(isa::Isa::kAvx512);
  const int64_t block = wide ? 64 : 16;
  const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(d) % block);
  const int64_t head = std::min<int64_t>(bytes, (block - misaligned) % block);
  std::memcpy(d, s, head);
  const int64_t i =
      wide ? stream_blocks_avx512(d, s, head, bytes) : stream_blocks_sse2(d, s, head, bytes);
  std::memcpy(d + i, s + i, bytes - i);
  _mm_sfence();
#else
  std::memcpy(d, s, bytes);
#endif
}

}  // namespace mlx_lattice::kernels
