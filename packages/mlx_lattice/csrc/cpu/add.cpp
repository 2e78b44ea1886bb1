// eval_cpu of FeatureAdd (graph code in ../add.cpp): chunks of the two
// operands widened to float32 (F16C for float16 where the CPU has it, the
// scalar conversions otherwise), added, and rounded back to the dtype with
// the same conversions as every other kernel. Each element has one writer,
// so the result is the same for any thread count.
#include <algorithm>
#include <cstdint>

#include "../primitives.h"
#include "eval.h"
#include "parallel.h"
#include "float_formats.h"

namespace mlx_lattice {

namespace {

constexpr int64_t kAddChunk = 1 << 15;  // elements per parallel task
constexpr int64_t kAddBlock = 1024;     // elements per float32 block (L1)

void add_floats(const float* a, const float* b, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void add_half(const void* a, const void* b, int64_t n, kernels::FloatFormat format, void* out) {
  const auto* pa = static_cast<const uint16_t*>(a);
  const auto* pb = static_cast<const uint16_t*>(b);
  auto* po = static_cast<uint16_t*>(out);
  float fa[kAddBlock], fb[kAddBlock];
  for (int64_t i = 0; i < n; i += kAddBlock) {
    const int64_t m = std::min(kAddBlock, n - i);
    kernels::convert_to_float32(pa + i, format, m, fa);
    kernels::convert_to_float32(pb + i, format, m, fb);
    add_floats(fa, fb, m, fa);
    kernels::convert_from_float32(fa, m, format, po + i);
  }
}

}  // namespace

void FeatureAdd::eval_cpu(const std::vector<array>& inputs, array& out) {
  cpu::dispatch(stream(), inputs, out, [](std::vector<array>& in, array& o) {
    const int64_t n = static_cast<int64_t>(o.size());
    if (n == 0) return;
    const auto format = cpu::format_of(o.dtype());
    const int64_t width = format == kernels::FloatFormat::kF32 ? 4 : 2;
    const char* a = in[0].data<char>();
    const char* b = in[1].data<char>();
    char* dst = o.data<char>();
    parallel_for((n + kAddChunk - 1) / kAddChunk, [&](int64_t chunk) {
      const int64_t i0 = chunk * kAddChunk;
      const int64_t m = std::min(n, i0 + kAddChunk) - i0;
      if (format == kernels::FloatFormat::kF32) {
        add_floats(reinterpret_cast<const float*>(a) + i0, reinterpret_cast<const float*>(b) + i0,
                   m, reinterpret_cast<float*>(dst) + i0);
      } else {
        add_half(a + i0 * width, b + i0 * width, m, format, dst + i0 * width);
      }
    });
  });
}

}  // namespace mlx_lattice
