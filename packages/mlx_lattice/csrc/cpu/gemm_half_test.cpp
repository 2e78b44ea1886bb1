// Tests of the half-precision convolution blocks (gemm_bf16.h) with no MLX,
// against an emulation of their documented arithmetic, bit for bit.
//
//   gemm_half_test CEILING BF16 FP16
//     sets MLX_LATTICE_GEMM_ISA=CEILING and requires the bf16 and fp16 paths
//     to be exactly BF16 and FP16 ("float32": no block, the float32 path
//     would run); each block present is checked. Used natively by Bazel and
//     under qemu-aarch64-static by tools/arm64/kernel_tests.sh.
//   gemm_half_test
//     checks whatever blocks this CPU has (Bazel's native run); the
//     amx-bf16 row driver is amx_bf16_test's.
//
// References (both exact emulations: every product of two half values is
// exact in float32, so `acc + a * b` in float32 is one rounding, as the
// hardware's fused steps):
//   bf16: offsets ascending, pairs ascending, channel 2p + 1 before 2p;
//   fp16: offsets ascending, channels ascending (the float32 FMA chain);
// then rounded once to the storage format, nearest even (bf16 compared as
// bits, fp16 as values: the rounding below is computed arithmetically).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gemm_bf16.h"

namespace {

namespace k = mlx_lattice::kernels;

int failures = 0;

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// A random normal half value: its storage bits and its float value.
struct Half {
  uint16_t bits;
  float value;
};

Half random_bf16(std::mt19937& gen, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  const uint16_t bits = static_cast<uint16_t>(float_bits(normal(gen)) >> 16);  // truncated
  return {bits, bits_to_float(static_cast<uint32_t>(bits) << 16)};
}

// The value of fp16 bits (finite).
float fp16_value(uint16_t bits) {
  const int exp = (bits >> 10) & 0x1f;
  const int man = bits & 0x3ff;
  const float mag = exp ? std::ldexp(1.0f + man / 1024.0f, exp - 15) : std::ldexp(man, -24);
  return bits & 0x8000 ? -mag : mag;
}

// Random sign, exponent (|value| in [2^-6 * scale, 2^3 * scale)) and mantissa.
Half random_fp16(std::mt19937& gen, float scale) {
  const int base = 15 + std::ilogb(scale);
  const int exp = std::uniform_int_distribution<int>(base - 6, base + 2)(gen);
  const int man = std::uniform_int_distribution<int>(0, 1023)(gen);
  const int sign = std::uniform_int_distribution<int>(0, 1)(gen);
  const uint16_t bits = static_cast<uint16_t>(sign << 15 | exp << 10 | man);
  return {bits, fp16_value(bits)};
}

uint16_t round_bf16(float f) {
  const uint32_t u = float_bits(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // finite values
}

// f rounded to the nearest fp16 value, ties to even (|f| < 65504), as a float:
// a multiple of the fp16 spacing at f's magnitude (2^-24 below 2^-14).
float round_fp16(float f) {
  const int e = f == 0.0f ? -14 : std::max(std::ilogb(f), -14);
  const float ulp = std::ldexp(1.0f, e - 10);
  return std::nearbyint(f / ulp) * ulp;  // the default rounding mode: nearest even
}

// One convolution: n_out outputs, each with edges to random inputs at
// distinct offsets, checked against the emulation.
void check_conv(std::mt19937& gen, bool bf16, int64_t cin, int64_t cout, int64_t n_in,
                int64_t n_out, int64_t n_kernels) {
  auto random = [&](float scale) { return bf16 ? random_bf16(gen, scale) : random_fp16(gen, scale); };
  std::vector<Half> f(n_in * cin), w(n_kernels * cin * cout);
  for (Half& h : f) h = random(1.0f);
  for (Half& h : w) h = random(0.2f);
  // Output CSR: out_offsets over edges grouped by output; offsets of one
  // output distinct, in random order (the kernel sorts them per tile).
  std::vector<int32_t> offsets{0}, a_index, c_index, kernel_ids;
  std::uniform_int_distribution<int64_t> pick_in(0, n_in - 1);
  for (int64_t o = 0; o < n_out; ++o) {
    std::vector<int32_t> ks(n_kernels);
    for (int64_t q = 0; q < n_kernels; ++q) ks[q] = static_cast<int32_t>(q);
    std::shuffle(ks.begin(), ks.end(), gen);
    const int64_t degree = std::uniform_int_distribution<int64_t>(0, n_kernels)(gen);
    for (int64_t e = 0; e < degree; ++e) {
      a_index.push_back(static_cast<int32_t>(pick_in(gen)));
      c_index.push_back(static_cast<int32_t>(o));
      kernel_ids.push_back(ks[e]);
    }
    offsets.push_back(static_cast<int32_t>(a_index.size()));
  }
  std::vector<uint16_t> fb(f.size()), wb(w.size()), out(n_out * cout, 0xdead);
  for (size_t i = 0; i < f.size(); ++i) fb[i] = f[i].bits;
  for (size_t i = 0; i < w.size(); ++i) wb[i] = w[i].bits;
  const k::Csr csr{offsets.data(), nullptr, n_out};
  k::half_conv(bf16 ? k::FloatFormat::kBF16 : k::FloatFormat::kF16, fb.data(), n_in, cin,
               wb.data(), n_kernels, cout, csr, a_index.data(), c_index.data(), kernel_ids.data(),
               out.data());
  for (int64_t o = 0; o < n_out; ++o) {
    for (int64_t x = 0; x < cout; ++x) {
      float acc = 0.0f;
      for (int64_t q = 0; q < n_kernels; ++q) {
        for (int32_t e = offsets[o]; e < offsets[o + 1]; ++e) {
          if (kernel_ids[e] != q) continue;
          const Half* fr = f.data() + a_index[e] * cin;
          const Half* wk = w.data() + q * cin * cout;
          for (int64_t c = 0; c < cin; c += bf16 ? 2 : 1) {
            if (bf16) {  // pair (c, c + 1), odd first; a missing channel adds 0
              if (c + 1 < cin) acc = acc + fr[c + 1].value * wk[(c + 1) * cout + x].value;
              acc = acc + fr[c].value * wk[c * cout + x].value;
            } else {
              acc = acc + fr[c].value * wk[c * cout + x].value;
            }
          }
        }
      }
      const uint16_t got = out[o * cout + x];
      const bool ok = bf16 ? got == round_bf16(acc) : fp16_value(got) == round_fp16(acc);
      if (!ok && ++failures <= 10) {
        std::fprintf(stderr, "FAIL %s cin=%lld cout=%lld at [%lld,%lld]: got 0x%04x, float32 sum %.9g\n",
                     bf16 ? "bf16" : "fp16", (long long)cin, (long long)cout, (long long)o,
                     (long long)x, got, acc);
      }
    }
  }
}

int run(const char* ceiling, const char* want_bf16, const char* want_fp16) {
  if (ceiling) setenv("MLX_LATTICE_GEMM_ISA", ceiling, 1);
  const char* bf16_path = k::half_isa(k::FloatFormat::kBF16);
  const char* fp16_path = k::half_isa(k::FloatFormat::kF16);
  if (!want_bf16) want_bf16 = bf16_path;
  if (!want_fp16) want_fp16 = fp16_path;
  if (std::strcmp(bf16_path, want_bf16) != 0 || std::strcmp(fp16_path, want_fp16) != 0) {
    std::fprintf(stderr, "FAIL ceiling %s: paths bf16 %s fp16 %s, expected %s %s\n", ceiling,
                 bf16_path, fp16_path, want_bf16, want_fp16);
    return 1;
  }
  const unsigned seed = 20261202u;
  std::mt19937 gen(seed);
  // Channel counts odd and even, columns across the 8-column strips and the
  // 16-column padding; more outputs than one 128-row tile.
  const int64_t shapes[][2] = {{1, 1}, {2, 3}, {7, 33}, {19, 70}, {32, 16}, {64, 64}, {3, 8}};
  int cases = 0;
  for (bool bf16 : {true, false}) {
    const auto format = bf16 ? k::FloatFormat::kBF16 : k::FloatFormat::kF16;
    if (!k::half_conv_available(format)) continue;
    if (bf16 && std::strcmp(bf16_path, "amx-bf16") == 0) {
      // The tile driver's order is the instruction's, checked within its
      // bound by amx_bf16_test.
      std::printf("bf16 path amx-bf16: checked by amx_bf16_test\n");
      continue;
    }
    for (const auto& s : shapes) {
      check_conv(gen, bf16, s[0], s[1], 150, 300, 27);
      ++cases;
    }
    // One output row, no output rows, one input row, kernels of 1 and 8
    // offsets: (n_in, n_out, K).
    const int64_t sets[][3] = {{1, 1, 27}, {40, 1, 8}, {20, 17, 1}, {5, 0, 27}, {1, 40, 8}};
    for (const auto& t : sets) {
      check_conv(gen, bf16, 19, 70, t[0], t[1], t[2]);
      ++cases;
    }
  }
  std::printf("half conv, ceiling %s: bf16 %s, fp16 %s, %d cases, seed %u, %s\n",
              ceiling ? ceiling : "(none)",
              want_bf16, want_fp16, cases, seed, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4) return run(argv[1], argv[2], argv[3]);
  if (argc == 1) return run(nullptr, nullptr, nullptr);
  std::fprintf(stderr, "usage: %s CEILING BF16_PATH FP16_PATH\n", argv[0]);
  return 2;
}
