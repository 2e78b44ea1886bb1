// Device-side vocabulary of MSL for CPU execution (see msl_runtime.h).
//
// Included first by every preprocessed kernel file. Covers what this
// project's kernels use: address-space qualifiers, builtins (passed by the
// generated launcher), half/bfloat, small vectors, threadgroup memory,
// threadgroup/simdgroup barriers, simd_* collectives, simdgroup_matrix
// 8x8 with MLX's fragment layout, and 32-bit atomics (atomic_int,
// atomic_uint with memory_order_relaxed). Kernel bodies must keep barriers and
// collectives in uniform control flow, as Metal requires.
#pragma once

#include <algorithm>
#include <atomic>
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

// Atomics: atomic_int / atomic_uint in device or threadgroup memory with
// MSL's free functions (*_explicit, memory_order_relaxed only, as Metal).
// In thread-per-lane mode they are real atomics (std::atomic_ref, seen by
// ThreadSanitizer). With fibers every atomic operation is also a switch
// point: the lane yields after it, so under the forward and reverse
// schedules lanes interleave at each atomic and a read-modify-write built
// from a separate load and store loses updates, as it can on a GPU. Every
// third compare-exchange of a lane fails spuriously (the weak form may), so
// kernels must retry.
enum memory_order { memory_order_relaxed };

template <typename T>
struct msl_atomic {
  using value_type = T;
  T value;
};
using atomic_int = msl_atomic<int32_t>;
using atomic_uint = msl_atomic<uint32_t>;
static_assert(sizeof(atomic_int) == 4 && alignof(atomic_int) == 4, "atomic_int is one int32");
static_assert(sizeof(atomic_uint) == 4 && alignof(atomic_uint) == 4, "atomic_uint is one uint32");

namespace msl::detail {

template <typename A>
using atomic_value_t = typename std::remove_cv_t<A>::value_type;

template <typename A>
std::atomic_ref<atomic_value_t<A>> atomic_of(A* object) {
  using Plain = std::remove_cv_t<A>;
  return std::atomic_ref<atomic_value_t<A>>(const_cast<Plain*>(object)->value);
}

}  // namespace msl::detail

template <typename A>
msl::detail::atomic_value_t<A> atomic_load_explicit(A* object, memory_order) {
  auto v = msl::detail::atomic_of(object).load(std::memory_order_relaxed);
  msl::detail::atomic_point();
  return v;
}

template <typename A, typename C>
void atomic_store_explicit(A* object, C desired, memory_order) {
  msl::detail::atomic_of(object).store(static_cast<msl::detail::atomic_value_t<A>>(desired),
                                      std::memory_order_relaxed);
  msl::detail::atomic_point();
}

template <typename A, typename C>
msl::detail::atomic_value_t<A> atomic_exchange_explicit(A* object, C desired, memory_order) {
  auto v = msl::detail::atomic_of(object).exchange(
      static_cast<msl::detail::atomic_value_t<A>>(desired), std::memory_order_relaxed);
  msl::detail::atomic_point();
  return v;
}

template <typename A, typename C>
msl::detail::atomic_value_t<A> atomic_fetch_add_explicit(A* object, C operand, memory_order) {
  auto v = msl::detail::atomic_of(object).fetch_add(
      static_cast<msl::detail::atomic_value_t<A>>(operand), std::memory_order_relaxed);
  msl::detail::atomic_point();
  return v;
}

template <typename A, typename C>
msl::detail::atomic_value_t<A> atomic_fetch_sub_explicit(A* object, C operand, memory_order) {
  auto v = msl::detail::atomic_of(object).fetch_sub(
      static_cast<msl::detail::atomic_value_t<A>>(operand), std::memory_order_relaxed);
  msl::detail::atomic_point();
  return v;
}

template <typename A, typename C>
msl::detail::atomic_value_t<A> atomic_fetch_min_explicit(A* object, C operand, memory_order) {
  using T = msl::detail::atomic_value_t<A>;
  auto ref = msl::detail::atomic_of(object);
  const T x = static_cast<T>(operand);
  T old = ref.load(std::memory_order_relaxed);
  while (x < old && !ref.compare_exchange_weak(old, x, std::memory_order_relaxed)) {
  }
  msl::detail::atomic_point();
  return old;
}

template <typename A, typename C>
msl::detail::atomic_value_t<A> atomic_fetch_max_explicit(A* object, C operand, memory_order) {
  using T = msl::detail::atomic_value_t<A>;
  auto ref = msl::detail::atomic_of(object);
  const T x = static_cast<T>(operand);
  T old = ref.load(std::memory_order_relaxed);
  while (x > old && !ref.compare_exchange_weak(old, x, std::memory_order_relaxed)) {
  }
  msl::detail::atomic_point();
  return old;
}

// On failure *expected receives the current value.
template <typename A, typename C>
bool atomic_compare_exchange_weak_explicit(A* object, msl::detail::atomic_value_t<A>* expected,
                                           C desired, memory_order, memory_order) {
  auto ref = msl::detail::atomic_of(object);
  bool ok;
  if (msl::detail::spurious_failure()) {
    *expected = ref.load(std::memory_order_relaxed);
    ok = false;
  } else {
    ok = ref.compare_exchange_strong(*expected,
                                     static_cast<msl::detail::atomic_value_t<A>>(desired),
                                     std::memory_order_relaxed);
  }
  msl::detail::atomic_point();
  return ok;
}

// Reinterprets the bits of a value of the same size (MSL's as_type).
template <typename To, typename From>
To as_type(From v) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of equal size");
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
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
