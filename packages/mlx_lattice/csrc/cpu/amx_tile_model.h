// A portable model of the AMX tile instructions, for tests: TileModel has
// TileHw's interface (cpu/amx_tiles.h) and computes in plain C++, so the tile
// drivers' blocking, packing and tail code runs on any host. Not part of the
// product extension (only test and check targets include it).
//
// Semantics modelled (Intel ISA reference, palette 1):
// - State per thread: a configuration and 8 tiles of 16 x 64 bytes.
//   configure() checks the limits (check_config) and zeroes every tile;
//   release() returns to "unconfigured"; any other operation while
//   unconfigured, or on a tile with 0 rows, throws std::logic_error (the
//   hardware raises #UD / #GP).
// - load<T>(p, stride): rows[T] rows of colsb[T] bytes from p + r * stride;
//   the rest of the tile is zeroed. store<T> writes rows[T] x colsb[T] bytes.
// - TDPBSSD / TDPBSUD / TDPBUSD (int8): with M = rows[C], K = colsb[A] / 4,
//   N = colsb[C] / 4, requires rows[A] == M, rows[B] == K, colsb[B] ==
//   colsb[C], colsb[A] % 4 == 0. C[m][n] (int32) += sum over k < K of the
//   four-byte dot A[m][4k..4k+3] . B[k][4n..4n+3], bytes sign- or
//   zero-extended per instruction, sums wrapping modulo 2^32 (no
//   saturation). Integer sums are exact, so the order is immaterial.
// - TDPBF16PS: same shape rules; for k ascending, then the even element
//   before the odd one:
//     C[m][n] = C[m][n] + f32(A[m][2k]) * f32(B[k][2n])
//     C[m][n] = C[m][n] + f32(A[m][2k+1]) * f32(B[k][2n+1])
//   Products of two bf16 values are exact in float32 (8-bit significands);
//   each addition rounds to nearest even. Denormal inputs are read as zero
//   and denormal results flushed to zero (the instruction ignores MXCSR and
//   behaves as DAZ/FTZ). This model's order is one valid reading of the
//   reference's pseudocode; hardware results may differ from it in the last
//   bits where the hardware fuses or reorders, which is why bf16 tests use a
//   bound rather than bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "amx_tiles.h"

namespace mlx_lattice::amx {

class TileModel {
 public:
  static constexpr const char* kName = "model";

  static void configure(const TileConfig& cfg) {
    check_config(cfg);
    State& s = state();
    s.cfg = cfg;
    s.configured = true;
    std::memset(s.data, 0, sizeof(s.data));
  }
  static void release() {
    State& s = state();
    s.configured = false;
    s.cfg = TileConfig{};
    std::memset(s.data, 0, sizeof(s.data));
  }
  static bool configured() { return state().configured; }

  template <int T>
  static void zero() {
    used(T);
    std::memset(state().data[T], 0, kTileBytes);
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    used(T);
    State& s = state();
    uint8_t* t = s.data[T];
    std::memset(t, 0, kTileBytes);
    const auto* src = static_cast<const uint8_t*>(p);
    for (int r = 0; r < s.cfg.rows[T]; ++r) std::memcpy(t + r * kMaxColsb, src + r * stride, s.cfg.colsb[T]);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    used(T);
    State& s = state();
    auto* dst = static_cast<uint8_t*>(p);
    for (int r = 0; r < s.cfg.rows[T]; ++r) std::memcpy(dst + r * stride, s.data[T] + r * kMaxColsb, s.cfg.colsb[T]);
  }
  template <int C, int A, int B>
  static void dpbssd() { dot_int8<C, A, B, true, true>(); }
  template <int C, int A, int B>
  static void dpbsud() { dot_int8<C, A, B, true, false>(); }
  template <int C, int A, int B>
  static void dpbusd() { dot_int8<C, A, B, false, true>(); }
  template <int C, int A, int B>
  static void dpbf16ps() {
    const Shape sh = shape(C, A, B, "TDPBF16PS");
    State& s = state();
    for (int m = 0; m < sh.m; ++m) {
      for (int n = 0; n < sh.n; ++n) {
        float c = get<float>(s.data[C], m, n);
        for (int k = 0; k < sh.k; ++k) {
          for (int i = 0; i < 2; ++i) {
            const float a = bf16(get<uint16_t>(s.data[A], m, 2 * k + i, 2));
            const float b = bf16(get<uint16_t>(s.data[B], k, 2 * n + i, 2));
            c = ftz(c + a * b);  // a * b exact; one rounding per addition
          }
        }
        put(s.data[C], m, n, c);
      }
    }
  }

  // The bytes of tile t (row r starts at r * 64), for tests of the model.
  static const uint8_t* tile_bytes(int t) { return state().data[t]; }

 private:
  static constexpr int kTileBytes = kMaxRows * kMaxColsb;
  struct State {
    TileConfig cfg;
    bool configured = false;
    alignas(64) uint8_t data[kTiles][kTileBytes] = {};
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  struct Shape {
    int m, k, n;
  };
  static void used(int t) {
    const State& s = state();
    if (!s.configured) throw std::logic_error("AMX tile model: tile used before configure()");
    if (s.cfg.rows[t] == 0) {
      throw std::logic_error("AMX tile model: tile " + std::to_string(t) + " is not configured");
    }
  }
  static Shape shape(int c, int a, int b, const char* op) {
    used(c);
    used(a);
    used(b);
    const TileConfig& cfg = state().cfg;
    auto fail = [op](const char* what) {
      throw std::logic_error(std::string("AMX tile model: ") + op + ": " + what);
    };
    if (c == a || c == b || a == b) fail("tiles must be distinct");
    if (cfg.colsb[a] % 4 || cfg.colsb[c] % 4) fail("rows of A and C must be whole dwords");
    if (cfg.rows[a] != cfg.rows[c]) fail("rows of A differ from rows of C");
    if (cfg.rows[b] != cfg.colsb[a] / 4) fail("rows of B differ from dwords per row of A");
    if (cfg.colsb[b] != cfg.colsb[c]) fail("bytes per row of B differ from those of C");
    return {cfg.rows[c], cfg.colsb[a] / 4, cfg.colsb[c] / 4};
  }
  template <typename V>
  static V get(const uint8_t* t, int r, int i, int size = 4) {
    V v;
    std::memcpy(&v, t + r * kMaxColsb + i * size, sizeof(V));
    return v;
  }
  template <typename V>
  static void put(uint8_t* t, int r, int i, V v) {
    std::memcpy(t + r * kMaxColsb + i * sizeof(V), &v, sizeof(V));
  }
  static float ftz(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }
  static float bf16(uint16_t bits) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return ftz(f);
  }
  template <int C, int A, int B, bool SignedA, bool SignedB>
  static void dot_int8() {
    const Shape sh = shape(C, A, B, "TDPB*D");
    State& s = state();
    for (int m = 0; m < sh.m; ++m) {
      for (int n = 0; n < sh.n; ++n) {
        uint32_t c = get<uint32_t>(s.data[C], m, n);
        for (int k = 0; k < sh.k; ++k) {
          for (int i = 0; i < 4; ++i) {
            const uint8_t ab = s.data[A][m * kMaxColsb + 4 * k + i];
            const uint8_t bb = s.data[B][k * kMaxColsb + 4 * n + i];
            const int32_t av = SignedA ? static_cast<int8_t>(ab) : ab;
            const int32_t bv = SignedB ? static_cast<int8_t>(bb) : bb;
            c += static_cast<uint32_t>(av * bv);  // modulo 2^32
          }
        }
        put(s.data[C], m, n, c);
      }
    }
  }
};

}  // namespace mlx_lattice::amx
