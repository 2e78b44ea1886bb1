// The AMX tile configuration in one place, and the hardware tile operations
// as a policy class (TileHw) of the tile drivers (cpu/amx_int8.h).
//
// A driver is a template on its tile policy: TileHw issues the real
// instructions (x86-64 Linux, compiled with target("amx-tile,amx-int8,
// amx-bf16"); used only where cpu/isa.h reports Isa::kAmxInt8 / kAmxBf16,
// which includes the OS permission); cpu/amx_tile_model.h's TileModel
// computes the same operations in portable C++ with the documented
// semantics, so the drivers' blocking, packing and tail paths run and are
// tested on hosts without AMX. The model is for tests only: the product
// instantiates TileHw alone.
//
// Policy interface (T, C, A, B: tile numbers 0..7, compile-time):
//   configure(const TileConfig&)   LDTILECFG (zeroes every tile)
//   release()                      TILERELEASE
//   zero<T>()                      TILEZERO
//   load<T>(ptr, stride_bytes)     TILELOADD (rows[T] rows of colsb[T] bytes)
//   store<T>(ptr, stride_bytes)    TILESTORED
//   dpbsud<C, A, B>()              TDPBSUD: C[m][n] += sum_k s8 A[m][4k+i] * u8 B[k][4n+i]
//   dpbssd<C, A, B>()              TDPBSSD: both signed
//   dpbusd<C, A, B>()              TDPBUSD: A unsigned, B signed
//   dpbf16ps<C, A, B>()            TDPBF16PS: bf16 pairs into fp32
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__) && \
    (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11)
#include <immintrin.h>
#define MLX_LATTICE_AMX 1
#endif

namespace mlx_lattice::amx {

// Palette 1: 8 tiles of at most 16 rows of at most 64 bytes.
constexpr int kTiles = 8;
constexpr int kMaxRows = 16;
constexpr int kMaxColsb = 64;

// LDTILECFG's 64-byte memory operand (the instruction needs no alignment;
// none is declared, since GCC's AddressSanitizer places over-aligned locals
// at 32-byte boundaries only).
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of tiles 0..7 (8..15 reserved, 0)
  uint8_t rows[16] = {};    // rows of tiles 0..7 (8..15 reserved, 0)

  void set(int tile, int n_rows, int n_colsb) {
    rows[tile] = static_cast<uint8_t>(n_rows);
    colsb[tile] = static_cast<uint16_t>(n_colsb);
  }
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// Throws std::logic_error unless `cfg` is a valid palette-1 configuration
// (the checks LDTILECFG makes with #GP): every used tile 1..16 rows and
// 1..64 bytes per row, unused tiles 0 x 0, reserved bytes 0. Drivers call
// it before configuring, so a blocking error is a clear exception on every
// host rather than a fault on AMX hosts only.
inline void check_config(const TileConfig& cfg) {
  auto fail = [](const std::string& what) {
    throw std::logic_error("AMX tile configuration: " + what);
  };
  if (cfg.palette != 1) fail("palette must be 1");
  if (cfg.start_row != 0) fail("start_row must be 0");
  for (uint8_t b : cfg.reserved) {
    if (b != 0) fail("reserved bytes must be 0");
  }
  for (int t = 0; t < 16; ++t) {
    const int r = cfg.rows[t];
    const int c = cfg.colsb[t];
    if (t >= kTiles) {
      if (r != 0 || c != 0) fail("tiles 8..15 do not exist in palette 1");
      continue;
    }
    if ((r == 0) != (c == 0)) fail("tile " + std::to_string(t) + " has rows xor bytes");
    if (r > kMaxRows) fail("tile " + std::to_string(t) + " has more than 16 rows");
    if (c > kMaxColsb) fail("tile " + std::to_string(t) + " has more than 64 bytes per row");
  }
}

#ifdef MLX_LATTICE_AMX

// Not always_inline: a driver instantiated with TileHw is inlined whole into
// a [[gnu::flatten]] entry point compiled for AMX (gemm_int8_amx.cpp), where
// these become single instructions; anywhere else they stay calls.
#define MLX_LATTICE_AMX_TARGET __attribute__((target("amx-tile,amx-int8,amx-bf16")))

// The instructions themselves. Only call where isa_supported(kAmxInt8 or
// kAmxBf16) holds (CPUID, XCR0 and the process's permission).
struct TileHw {
  static constexpr const char* kName = "hardware";
  MLX_LATTICE_AMX_TARGET static inline void configure(const TileConfig& cfg) {
    asm volatile("ldtilecfg %0" ::"m"(cfg));
  }
  MLX_LATTICE_AMX_TARGET static inline void release() { asm volatile("tilerelease" ::: "memory"); }
  // Inline assembly with the tile numbers as immediates (GCC's _tile_*
  // macros paste their arguments' spelling, which a template parameter is
  // not). AT&T order: sources first, destination last.
  template <int T>
  MLX_LATTICE_AMX_TARGET static inline void zero() {
    asm volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  MLX_LATTICE_AMX_TARGET static inline void load(const void* p, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  MLX_LATTICE_AMX_TARGET static inline void store(void* p, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int C, int A, int B>
  MLX_LATTICE_AMX_TARGET static inline void dpbsud() {
    asm volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
  template <int C, int A, int B>
  MLX_LATTICE_AMX_TARGET static inline void dpbssd() {
    asm volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
  template <int C, int A, int B>
  MLX_LATTICE_AMX_TARGET static inline void dpbusd() {
    asm volatile("tdpbusd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
  template <int C, int A, int B>
  MLX_LATTICE_AMX_TARGET static inline void dpbf16ps() {
    asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};

#endif  // MLX_LATTICE_AMX

// Releases the tile state when a driver's scope ends, also by an exception.
template <class Tiles>
struct TileScope {
  explicit TileScope(const TileConfig& cfg) {
    check_config(cfg);
    Tiles::configure(cfg);
  }
  ~TileScope() { Tiles::release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// The strip every driver works on: C tiles 0..nc-1 (1 <= nc <= 4), each 16
// rows of 16 four-byte columns, the strip's column tiles side by side.
enum class Dot { kBsud, kBf16ps };  // TDPBSUD (the int8 drivers), TDPBF16PS (bf16)

template <class Tiles>
inline void zero_strip(int nc) {
  Tiles::template zero<0>();
  if (nc > 1) Tiles::template zero<1>();
  if (nc > 2) Tiles::template zero<2>();
  if (nc > 3) Tiles::template zero<3>();
}

// C tiles from (load) or to (store) rows of `stride` bytes; tile j at p + 16 j.
template <class Tiles, class T>
inline void load_strip(int nc, const T* p, int64_t stride) {
  Tiles::template load<0>(p, stride);
  if (nc > 1) Tiles::template load<1>(p + 16, stride);
  if (nc > 2) Tiles::template load<2>(p + 32, stride);
  if (nc > 3) Tiles::template load<3>(p + 48, stride);
}

template <class Tiles, class T>
inline void store_strip(int nc, T* p, int64_t stride) {
  Tiles::template store<0>(p, stride);
  if (nc > 1) Tiles::template store<1>(p + 16, stride);
  if (nc > 2) Tiles::template store<2>(p + 32, stride);
  if (nc > 3) Tiles::template store<3>(p + 48, stride);
}

template <class Tiles, Dot kDot, int C, int B>
inline void dot() {
  if constexpr (kDot == Dot::kBsud) {
    Tiles::template dpbsud<C, 4, B>();
  } else {
    Tiles::template dpbf16ps<C, 4, B>();
  }
}

// C tile j += A (tile 4, loaded) x the B tile at b + 64 j bytes (rows of
// `stride` bytes), j < nc; B tiles load alternately into tiles 5 and 6 so a
// load can overlap the previous product.
template <class Tiles, Dot kDot>
inline void multiply_strip(int nc, const uint8_t* b, int64_t stride) {
  Tiles::template load<5>(b, stride);
  dot<Tiles, kDot, 0, 5>();
  if (nc > 1) {
    Tiles::template load<6>(b + 64, stride);
    dot<Tiles, kDot, 1, 6>();
  }
  if (nc > 2) {
    Tiles::template load<5>(b + 128, stride);
    dot<Tiles, kDot, 2, 5>();
  }
  if (nc > 3) {
    Tiles::template load<6>(b + 192, stride);
    dot<Tiles, kDot, 3, 6>();
  }
}

}  // namespace mlx_lattice::amx
