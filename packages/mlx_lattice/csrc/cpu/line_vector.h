// Vectors whose storage starts on a cache line (64 bytes).
//
// The kernels load and store whole 64-byte vectors (AVX-512) and 64-byte
// tile rows (AMX). A std::vector's storage is only 16-byte aligned (glibc
// puts a 16-byte header before every block it maps, so every buffer of
// 128 KiB or more starts 16 bytes into a line), and MLX's CPU buffers start
// 8 bytes after such a block. A vector read from there spans two lines, and
// a 64-channel int8 row or a 16-float row touches one line more than it
// holds. The drivers' scratch, packed weights and staging buffers are
// LineVectors; a float32 operand that arrives from MLX is used in place or
// copied to one (line_aligned).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

namespace mlx_lattice::kernels {

inline constexpr std::size_t kLineBytes = 64;

// std::allocator's interface over the aligned forms of operator new and
// delete.
template <typename T>
struct LineAllocator {
  using value_type = T;

  LineAllocator() noexcept = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) noexcept {}  // NOLINT: rebinding converts implicitly

  T* allocate(std::size_t n) {
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(T)) throw std::bad_array_new_length();
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kLineBytes}));
  }
  void deallocate(T* p, std::size_t) noexcept {
    ::operator delete(p, std::align_val_t{kLineBytes});
  }

  template <typename U>
  bool operator==(const LineAllocator<U>&) const noexcept {
    return true;
  }
};

template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

inline bool on_line(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % kLineBytes == 0;
}

// `data` (n values) where it starts on a line; otherwise its copy in
// `copy`, when the caller will read it often enough (`reads` whole passes
// or more) for the copy to pay: each pass over a misaligned operand loads
// split vectors.
template <typename T>
const T* line_aligned(const T* data, std::size_t n, LineVector<T>& copy, double reads) {
  constexpr double kMinReads = 8.0;
  if (n == 0 || on_line(data) || reads < kMinReads) return data;
  copy.resize(n);
  std::memcpy(copy.data(), data, n * sizeof(T));
  return copy.data();
}

}  // namespace mlx_lattice::kernels
