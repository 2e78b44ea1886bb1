// Device-side vocabulary of MSL for CPU execution (see msl_runtime.h).
//
// Included first by every preprocessed kernel file. Covers what this
// project's kernels use: address-space qualifiers, builtins (passed by the
// generated launcher), half/bfloat, small vectors, threadgroup memory,
// threadgroup/simdgroup barriers, simd_* collectives and simdgroup_matrix
// 8x8 with MLX's fragment layout. Kernel bodies must keep barriers and
// collectives in uniform control flow, as Metal requires.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <source_location>
#include <type_traits>

#include "msl_detail.h"

// Address spaces carry no meaning on the CPU (threadgroup *variables* are
// rewritten by msl2cpp.py into shared per-group storage).
#define device
#define threadgroup
#define constant const
#define thread

using uint = uint32_t;
using ulong = uint64_t;
using ushort = uint16_t;
using uchar = uint8_t;
using half = _Float16;

struct bfloat {
  uint16_t bits = 0;
  bfloat() = default;
  bfloat(float f) {  // NOLINT: implicit like MSL
    uint32_t x;
    std::memcpy(&x, &f, 4);
    x += 0x7fffu + ((x >> 16) & 1u);
    bits = static_cast<uint16_t>(x >> 16);
  }
  operator float() const {  // NOLINT
    uint32_t x = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &x, 4);
    return f;
  }
};

template <typename T, int N>
struct vec;

#define MSL_VEC_OPS(N)                                                              \
  vec& operator+=(const vec& o) {                                                   \
    for (int i = 0; i < N; ++i) (*this)[i] += o[i];                                 \
    return *this;                                                                   \
  }                                                                                 \
  friend vec operator+(vec a, const vec& b) { return a += b; }                      \
  friend vec operator-(vec a, const vec& b) {                                       \
    for (int i = 0; i < N; ++i) a[i] -= b[i];                                       \
    return a;                                                                       \
  }                                                                                 \
  friend vec operator*(vec a, const vec& b) {                                       \
    for (int i = 0; i < N; ++i) a[i] *= b[i];                                       \
    return a;                                                                       \
  }                                                                                 \
  friend vec operator*(vec a, T s) {                                                \
    for (int i = 0; i < N; ++i) a[i] *= s;                                          \
    return a;                                                                       \
  }                                                                                 \
  T& operator[](int i) { return reinterpret_cast<T*>(this)[i]; }                    \
  const T& operator[](int i) const { return reinterpret_cast<const T*>(this)[i]; }

template <typename T>
struct vec<T, 2> {
  T x{}, y{};
  vec() = default;
  vec(T a, T b) : x(a), y(b) {}
  explicit vec(T s) : x(s), y(s) {}
  MSL_VEC_OPS(2)
};
template <typename T>
struct vec<T, 3> {
  T x{}, y{}, z{};
  vec() = default;
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  explicit vec(T s) : x(s), y(s), z(s) {}
  MSL_VEC_OPS(3)
};
template <typename T>
struct vec<T, 4> {
  T x{}, y{}, z{}, w{};
  vec() = default;
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  explicit vec(T s) : x(s), y(s), z(s), w(s) {}
  MSL_VEC_OPS(4)
};
#undef MSL_VEC_OPS

using float2 = vec<float, 2>;
using float3 = vec<float, 3>;
using float4 = vec<float, 4>;
using half2 = vec<half, 2>;
using half4 = vec<half, 4>;
using uint2 = vec<uint, 2>;
using uint3 = vec<uint, 3>;
using int2 = vec<int, 2>;
using short2 = vec<short, 2>;

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

inline void threadgroup_barrier(mem_flags,
                                std::source_location at = std::source_location::current()) {
  msl::detail::barrier(msl::detail::Scope::kThreadgroup, at.file_name(), at.line());
}

inline void simdgroup_barrier(mem_flags,
                              std::source_location at = std::source_location::current()) {
  msl::detail::barrier(msl::detail::Scope::kSimdgroup, at.file_name(), at.line());
}

namespace msl::detail {

// Every lane deposits `value`; after a simd barrier each reads all slots.
template <typename T, typename F>
T simd_collective(T value, F&& combine, const std::source_location& at) {
  static_assert(sizeof(T) <= kExchangeBytes, "value too large for a simd collective");
  unsigned char* area = exchange_area();
  const auto& l = lane();
  std::memcpy(area + l.simd_lane * kExchangeBytes, &value, sizeof(T));
  barrier(Scope::kSimdgroup, at.file_name(), at.line());
  T out = combine(area, l);
  barrier(Scope::kSimdgroup, at.file_name(), at.line());  // slots free again
  return out;
}

template <typename T>
T slot(const unsigned char* area, uint32_t i) {
  T v;
  std::memcpy(&v, area + i * kExchangeBytes, sizeof(T));
  return v;
}

}  // namespace msl::detail

template <typename T>
T simd_sum(T x, std::source_location at = std::source_location::current()) {
  return msl::detail::simd_collective(
      x,
      [](const unsigned char* a, const msl::detail::LaneInfo& l) {
        T s = msl::detail::slot<T>(a, 0);
        for (uint32_t i = 1; i < l.simd_size; ++i) s += msl::detail::slot<T>(a, i);
        return s;
      },
      at);
}

template <typename T>
T simd_max(T x, std::source_location at = std::source_location::current()) {
  return msl::detail::simd_collective(
      x,
      [](const unsigned char* a, const msl::detail::LaneInfo& l) {
        T s = msl::detail::slot<T>(a, 0);
        for (uint32_t i = 1; i < l.simd_size; ++i) s = std::max(s, msl::detail::slot<T>(a, i));
        return s;
      },
      at);
}

template <typename T>
T simd_shuffle(T x, ushort src, std::source_location at = std::source_location::current()) {
  return msl::detail::simd_collective(
      x,
      [src](const unsigned char* a, const msl::detail::LaneInfo& l) {
        return msl::detail::slot<T>(a, src < l.simd_size ? src : l.simd_lane);
      },
      at);
}

template <typename T>
T simd_broadcast(T x, ushort src, std::source_location at = std::source_location::current()) {
  return simd_shuffle(x, src, at);
}

template <typename T>
T simd_shuffle_down(T x, ushort delta, std::source_location at = std::source_location::current()) {
  return msl::detail::simd_collective(
      x,
      [delta](const unsigned char* a, const msl::detail::LaneInfo& l) {
        uint32_t src = l.simd_lane + delta;
        return msl::detail::slot<T>(a, src < l.simd_size ? src : l.simd_lane);
      },
      at);
}

template <typename T>
T simd_prefix_exclusive_sum(T x, std::source_location at = std::source_location::current()) {
  return msl::detail::simd_collective(
      x,
      [](const unsigned char* a, const msl::detail::LaneInfo& l) {
        T s{};
        for (uint32_t i = 0; i < l.simd_lane; ++i) s += msl::detail::slot<T>(a, i);
        return s;
      },
      at);
}

// simdgroup_matrix<T, 8, 8>: each lane holds two elements, row fm and
// columns fn, fn + 1 (MLX's steel/gemm/mma.h fragment layout):
//   qid = lane / 4; fm = (qid & 4) + (lane / 2) % 4; fn = (qid & 2) * 2 + (lane % 2) * 2.
template <typename T, int R, int C>
struct simdgroup_matrix {
  static_assert(R == 8 && C == 8, "only 8x8 simdgroup matrices");
  T elements[2]{};
  T* thread_elements() { return elements; }
  const T* thread_elements() const { return elements; }
};

namespace msl::detail {

inline void fragment_coord(uint32_t lane_id, int& row, int& col) {
  const int qid = static_cast<int>(lane_id) / 4;
  row = (qid & 4) + (static_cast<int>(lane_id) / 2) % 4;
  col = (qid & 2) * 2 + (static_cast<int>(lane_id) % 2) * 2;
}

template <typename T>
void require_full_simdgroup(const char* what) {
  if (lane().simd_size != kSimdWidth) {
    throw HarnessError(std::string(what) + " needs a full simdgroup of 32 threads");
  }
}

// The full 8x8 matrix from every lane's fragment (a collective).
template <typename T>
void gather_matrix(const simdgroup_matrix<T, 8, 8>& m, float (&full)[8][8],
                   const std::source_location& at) {
  unsigned char* area = exchange_area();
  const auto& l = lane();
  float pair[2] = {static_cast<float>(m.elements[0]), static_cast<float>(m.elements[1])};
  std::memcpy(area + l.simd_lane * kExchangeBytes, pair, sizeof(pair));
  barrier(Scope::kSimdgroup, at.file_name(), at.line());
  for (uint32_t i = 0; i < kSimdWidth; ++i) {
    int r, c;
    fragment_coord(i, r, c);
    std::memcpy(pair, area + i * kExchangeBytes, sizeof(pair));
    full[r][c] = pair[0];
    full[r][c + 1] = pair[1];
  }
  barrier(Scope::kSimdgroup, at.file_name(), at.line());
}

}  // namespace msl::detail

template <typename T, int R = 8, int C = 8>
simdgroup_matrix<T, 8, 8> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, 8, 8> m;
  m.elements[0] = m.elements[1] = value;
  return m;
}

template <typename T, typename P>
void simdgroup_load(simdgroup_matrix<T, 8, 8>& m, const P* src, size_t elements_per_row = 8) {
  int r, c;
  msl::detail::fragment_coord(msl::detail::lane().simd_lane, r, c);
  m.elements[0] = static_cast<T>(src[r * elements_per_row + c]);
  m.elements[1] = static_cast<T>(src[r * elements_per_row + c + 1]);
}

template <typename T, typename P>
void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, P* dst, size_t elements_per_row = 8) {
  int r, c;
  msl::detail::fragment_coord(msl::detail::lane().simd_lane, r, c);
  dst[r * elements_per_row + c] = static_cast<P>(m.elements[0]);
  dst[r * elements_per_row + c + 1] = static_cast<P>(m.elements[1]);
}

// d = a * b + c, accumulated in float32 in k order.
template <typename T, typename U, typename V, typename W>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<U, 8, 8>& a,
                                   const simdgroup_matrix<V, 8, 8>& b,
                                   const simdgroup_matrix<W, 8, 8>& c,
                                   std::source_location at = std::source_location::current()) {
  msl::detail::require_full_simdgroup<T>("simdgroup_multiply_accumulate");
  float fa[8][8], fb[8][8], fc[8][8];
  msl::detail::gather_matrix(a, fa, at);
  msl::detail::gather_matrix(b, fb, at);
  msl::detail::gather_matrix(c, fc, at);
  int r, col;
  msl::detail::fragment_coord(msl::detail::lane().simd_lane, r, col);
  for (int e = 0; e < 2; ++e) {
    float acc = fc[r][col + e];
    for (int k = 0; k < 8; ++k) acc = std::fma(fa[r][k], fb[k][col + e], acc);
    d.elements[e] = static_cast<T>(acc);
  }
}

namespace metal {
using std::abs;
using std::exp;
using std::floor;
using std::fma;
using std::sqrt;
template <typename T>
T clamp(T x, T lo, T hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}
template <typename T>
T max(T a, T b) {
  return a > b ? a : b;
}
template <typename T>
T min(T a, T b) {
  return a < b ? a : b;
}
namespace fast {
using std::exp;
using std::sqrt;
}  // namespace fast
}  // namespace metal

using metal::max;
using metal::min;
