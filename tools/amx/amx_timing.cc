// Throughput of the sparse-convolution kernels on a synthetic relation of
// //benchmarks:sparse_conv's size (100k output rows, about 5.9 edges per row
// over the 27 offsets of a 3x3x3 kernel, C64 in and out), with no MLX: the
// float32 AVX-512 FMA forward (kernels::stationary_conv), the int8 forward on
// AVX512-VNNI and on AMX-INT8 (dynamic and static activation scales), each
// forced through the ISA ceiling, and the bf16 forward on AMX-BF16; each time is the best of several runs, on
// one thread and on every thread. Ratios are within this run only.
//
// On every host it also times the AMX drivers with the tile instructions
// left out (TileSkip: configuration, loads, products and stores do nothing):
// the drivers' own work (bucketing, gathers, the epilogue, the window's
// float32 rows), which bounds what the tiles can give on this host: no
// tile unit makes a call faster than that.
//
// Usage: amx_timing [rows] [repeats]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "amx_bf16.h"
#include "amx_bf16_wgrad.h"
#include "amx_int8.h"
#include "gemm.h"
#include "gemm_bf16.h"
#include "gemm_int8.h"
#include "isa.h"
#include "conv_forward.h"
#include "group_by.h"
#include "parallel.h"
#include "weight_gradient.h"

namespace {

using namespace mlx_lattice;
using namespace mlx_lattice::kernels;

template <typename F>
double best_seconds(int repeats, F&& f) {
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    best = std::min(best, dt.count());
  }
  return best;
}

// The tile policy with every instruction left out (amx_tiles.h's interface).
struct TileSkip {
  static constexpr const char* kName = "skipped";
  static void configure(const amx::TileConfig&) {}
  static void release() {}
  template <int T>
  static void zero() {}
  template <int T>
  static void load(const void* p, int64_t) {
    asm volatile("" ::"r"(p) : "memory");
  }
  template <int T>
  static void store(void* p, int64_t) {
    asm volatile("" ::"r"(p) : "memory");
  }
  template <int C, int A, int B>
  static void dpbsud() {}
  template <int C, int A, int B>
  static void dpbf16ps() {}
};

void int8_rows_skip(const amx_int8::Rows& a, const amx_int8::Weights& w, int64_t group,
                    const Csr& csr, const int32_t* a_index, const int32_t* kernel_ids, int64_t g0,
                    int64_t g1, float* out) {
  thread_local amx_int8::Scratch s;
#if defined(__x86_64__)
  amx_int8::run_rows<TileSkip, amx_int8::EpiAvx512>(a, w, group, csr, a_index, kernel_ids, g0,
                                                     g1, out, s);
#else
  amx_int8::run_rows<TileSkip, amx_int8::EpiScalar>(a, w, group, csr, a_index, kernel_ids, g0,
                                                     g1, out, s);
#endif
}

void bf16_rows_skip(const amx_bf16::Rows& a, const amx_bf16::Weights& w, const Csr& csr,
                    const int32_t* a_index, const int32_t* kernel_ids, int64_t g0, int64_t g1,
                    uint16_t* out) {
  thread_local amx_bf16::Scratch s;
  amx_bf16::run_rows<TileSkip>(a, w, csr, a_index, kernel_ids, g0, g1, out, s);
}

void bf16_wgrad_skip(const amx_bf16::WgradArgs& p, int64_t k0, int64_t k1, float* dweight) {
  thread_local amx_bf16::WgradScratch s;
#if defined(__x86_64__)
  amx_bf16::run_wgrad<TileSkip, amx_bf16::GatherAvx512>(p, k0, k1, dweight, s);
#else
  amx_bf16::run_wgrad<TileSkip>(p, k0, k1, dweight, s);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 100000;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 5;
  const int64_t c = 64, nk = 27, group = 64;
  const unsigned seed = 20261204u;
  std::mt19937 gen(seed);
  // Each output row takes each offset with probability 5.9 / 27 (the centre
  // always), its input row a random row near it (sorted inputs, as a voxel
  // grid gives).
  std::vector<int32_t> offsets{0}, a_index, c_index, kid;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int64_t o = 0; o < n; ++o) {
    for (int64_t k = 0; k < nk; ++k) {
      if (k == 13 || u(gen) < 4.9 / 26.0) {
        const int64_t i = k == 13 ? o : std::clamp<int64_t>(o + (k - 13) * 37 + gen() % 64 - 32, 0, n - 1);
        a_index.push_back(static_cast<int32_t>(i));
        c_index.push_back(static_cast<int32_t>(o));
        kid.push_back(static_cast<int32_t>(k));
      }
    }
    offsets.push_back(static_cast<int32_t>(a_index.size()));
  }
  const int64_t edges = static_cast<int64_t>(a_index.size());
  Csr csr;
  csr.offsets = offsets.data();
  csr.groups = n;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> f(n * c), w(nk * c * c), out(n * c);
  for (auto& v : f) v = nd(gen);
  for (auto& v : w) v = 0.1f * nd(gen);
  // bf16 copies (truncated: the timing needs no rounding).
  std::vector<uint16_t> fb(n * c), wb(nk * c * c), outb(n * c);
  for (size_t i = 0; i < f.size(); ++i) {
    uint32_t bitsv;
    std::memcpy(&bitsv, &f[i], 4);
    fb[i] = static_cast<uint16_t>(bitsv >> 16);
  }
  for (size_t i = 0; i < w.size(); ++i) {
    uint32_t bitsv;
    std::memcpy(&bitsv, &w[i], 4);
    wb[i] = static_cast<uint16_t>(bitsv >> 16);
  }
  std::vector<uint8_t> packed(nk * c * c);
  for (auto& v : packed) v = static_cast<uint8_t>(gen());
  std::vector<float> sc(nk * c * (c / group), 0.01f), bi(sc.size(), -1.0f);
  const double ops = 2.0 * edges * c * c;
  // The kernel CSR (edges grouped by offset) of the weight gradients.
  std::vector<int32_t> k_offsets, k_edge_ids;
  group_by(kid.data(), edges, nk, k_offsets, k_edge_ids);
  const Csr kcsr{k_offsets.data(), k_edge_ids.data(), nk};
  std::vector<float> dw(nk * c * c);
  std::printf("relation: %lld rows, %lld edges (%.2f per row), C%lld, seed %u\n",
              static_cast<long long>(n), static_cast<long long>(edges),
              double(edges) / double(n), static_cast<long long>(c), seed);
  std::printf("amx-int8 usable: %s; amx-bf16 usable: %s; avx512-vnni: %s\n",
              isa::isa_supported(isa::Isa::kAmxInt8) ? "yes" : "no",
              isa::isa_supported(isa::Isa::kAmxBf16) ? "yes" : "no",
              isa::isa_supported(isa::Isa::kAvx512Vnni) ? "yes" : "no");
  const int all = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int threads : {1, all}) {
    if (threads == all && all == 1) break;
    set_num_threads(threads);
    const double t32 = best_seconds(repeats, [&] {
      stationary_conv(f.data(), c, w.data(), nk, out.data(), c, csr, a_index.data(),
                      c_index.data(), kid.data());
    });
    std::printf("threads %d\n  fp32 %-12s %8.2f ms %8.1f GFLOP/s  1.00x\n", threads,
                gemm_isa(), t32 * 1e3, ops / t32 * 1e-9);
    for (isa::Isa level : {isa::Isa::kAvx512Vnni, isa::Isa::kAmxInt8}) {
      if (!isa::isa_supported(level)) {
        std::printf("  int8 %-12s skipped: not usable on this host\n", isa::isa_name(level));
        continue;
      }
      isa::set_isa_ceiling(level);
      for (float act : {0.0f, 0.05f}) {
        const double t8 = best_seconds(repeats, [&] {
          int8_conv(f.data(), n, c, packed.data(), c, sc.data(), bi.data(), nk, c, c, group, 8,
                    act, csr, a_index.data(), c_index.data(), kid.data(), out.data());
        });
        std::printf("  int8 %-12s %8.2f ms %8.1f GOP/s   %.2fx fp32 (w8a8, %s scale)\n",
                    int8_isa(), t8 * 1e3, ops / t8 * 1e-9, t32 / t8,
                    act > 0 ? "static" : "dynamic");
      }
      isa::reset_isa_ceiling();
    }
    // The drivers' own work, tile instructions left out (every host).
    for (float act : {0.0f, 0.05f}) {
      const double tk = best_seconds(repeats, [&] {
        int8_conv_rows(int8_rows_skip, f.data(), n, c, packed.data(), c, sc.data(), bi.data(), nk,
                       c, c, group, 8, act, csr, a_index.data(), kid.data(), out.data());
      });
      std::printf("  int8 %-12s %8.2f ms  tiles skipped: at most %.2fx fp32 (w8a8, %s scale)\n",
                  "amx driver", tk * 1e3, t32 / tk, act > 0 ? "static" : "dynamic");
    }
    {
      const double tk = best_seconds(repeats, [&] {
        bf16_conv_rows(bf16_rows_skip, fb.data(), n, c, wb.data(), nk, c, false, csr,
                       a_index.data(), kid.data(), outb.data());
      });
      std::printf("  bf16 %-12s %8.2f ms  tiles skipped: at most %.2fx fp32 (forward)\n",
                  "amx driver", tk * 1e3, t32 / tk);
    }
    // Weight gradients: float32, and bf16 on the AMX driver (tiles skipped
    // on every host; on the hardware where usable).
    const double tw32 = best_seconds(repeats, [&] {
      weight_gradient(f.data(), c, f.data(), c, kcsr, a_index.data(), c_index.data(), dw.data());
    });
    std::printf("  fp32 %-12s %8.2f ms  weight gradient, %.2fx the fp32 forward's time\n",
                "gradient", tw32 * 1e3, tw32 / t32);
    {
      const double tk = best_seconds(repeats, [&] {
        bf16_weight_grad_rows(bf16_wgrad_skip, fb.data(), n, c, fb.data(), n, c, kcsr,
                              a_index.data(), c_index.data(), dw.data());
      });
      std::printf("  bf16 %-12s %8.2f ms  tiles skipped: at most %.2fx the fp32 weight gradient\n",
                  "amx wgrad", tk * 1e3, tw32 / tk);
    }
    if (kAmxBf16WgradHw && isa::isa_supported(isa::Isa::kAmxBf16)) {
      const double tk = best_seconds(repeats, [&] {
        bf16_weight_grad_rows(kAmxBf16WgradHw, fb.data(), n, c, fb.data(), n, c, kcsr,
                              a_index.data(), c_index.data(), dw.data());
      });
      std::printf("  bf16 %-12s %8.2f ms  %.2fx the fp32 weight gradient\n", "amx-bf16 wgrad",
                  tk * 1e3, tw32 / tk);
    }
    // bf16 forward on the AMX-BF16 row driver (the hardware only).
    if (kAmxBf16RowsHw && isa::isa_supported(isa::Isa::kAmxBf16)) {
      const double t16 = best_seconds(repeats, [&] {
        bf16_conv_rows(kAmxBf16RowsHw, fb.data(), n, c, wb.data(), nk, c, false, csr,
                       a_index.data(), kid.data(), outb.data());
      });
      std::printf("  bf16 %-12s %8.2f ms %8.1f GFLOP/s %.2fx fp32 (forward)\n", "amx-bf16",
                  t16 * 1e3, ops / t16 * 1e-9, t32 / t16);
    } else {
      std::printf("  bf16 %-12s skipped: not usable on this host\n", "amx-bf16");
    }
  }
  return 0;
}
