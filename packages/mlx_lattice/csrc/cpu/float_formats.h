// Storage formats of the floating arrays the kernels read and write, and the
// conversions between them and float32 (widening exact, narrowing rounded
// to nearest even).
#pragma once

#include <cstdint>

namespace mlx_lattice::kernels {

// Storage formats of floating arrays the kernels read and write.
enum class FloatFormat { kF32, kF16, kBF16 };

// dst[i] = float(src[i]) / dst[i] = round-to-nearest-even(src[i]), in parallel.
void to_float32(const void* src, FloatFormat format, int64_t n, float* dst);
void from_float32(const float* src, int64_t n, FloatFormat format, void* dst);

// Serial conversions of n values (the parallel to_float32 / from_float32
// split their arrays into these), for per-tile use.
void convert_to_float32(const void* src, FloatFormat format, int64_t n, float* dst);
void convert_from_float32(const float* src, int64_t n, FloatFormat format, void* dst);

// The serial widening of n float16 or bfloat16 values (format kF16 or
// kBF16) that convert_to_float32 runs, as a function to call per row
// without choosing it again: 8 lanes at a time where the CPU has them.
using RowToFloat32 = void (*)(const uint16_t* src, int64_t n, float* dst);
RowToFloat32 row_to_float32(FloatFormat format);

}  // namespace mlx_lattice::kernels
