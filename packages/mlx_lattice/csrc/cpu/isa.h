// Run-time choice of CPU micro-kernels: one structure for every kernel family
// (fp32 GEMM, int8 VNNI GEMM, bf16 dot GEMM, ...).
//
// A kernel family is a table of entries, best first. Each entry names the
// instruction set it needs (an `Isa` level) and carries the family's function
// pointers. `pick()` returns the first entry whose ISA the CPU supports and
// whose level is at or below the ceiling set by MLX_LATTICE_GEMM_ISA (read
// once per process; lets tests force every path on one machine). The last
// entry of every table is the portable scalar kernel, so a choice always
// exists.
//
// Levels are ordered within one architecture only, and only this
// architecture's names (and "scalar") are accepted. On x86-64:
//   scalar < avx2-fma < avx-vnni < avx512f < avx512-vnni < avx512-bf16
//          < amx-int8 < amx-bf16
// MLX_LATTICE_GEMM_ISA=avx512f, for example, keeps every family at or below
// AVX-512F (fp32 keeps its AVX-512 kernel, int8 falls back to AVX-VNNI where
// the CPU has it, else to its AVX2 kernel).
// set_isa_ceiling() does the same from code (mlx_lattice.set_kernel_isa);
// kernel families that pick per call (int8) follow it at once, those that
// pick at first use (the fp32 GEMM, the bf16 forward and gradients) only
// before it.
//
// The AMX levels need three things, all checked once: CPUID (AMX-TILE and
// AMX-INT8 / AMX-BF16), the OS enabling the tile state in XCR0 (bits 17 and
// 18) and the process's permission to use it, requested once with
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) (cpu/isa.cpp) when an
// AMX level under the ceiling is first asked about, in builds with the AMX
// drivers (kAmxDrivers below). Anything missing: the level
// is unsupported and the families fall back.
//
// ARM64 plugs in here: add levels (e.g. kNeon, kNeonDot for SDOT/UDOT,
// kSve), answer them in `isa_supported()` (isa.cpp, from getauxval(AT_HWCAP)
// on Linux or sysctl on macOS), give them names in `isa_name()`, and put
// entries guarded by `#if defined(__aarch64__)` at the top of each family's
// table (cpu/gemm_int8.cpp, ...). Nothing else changes: the tables, the
// override and the scalar fallback are shared.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mlx_lattice::isa {

// Whether this build compiles the AMX drivers: the condition of
// cpu/amx_tiles.h's MLX_LATTICE_AMX (x86-64 Linux, GCC 11 or later), which
// cpu/gemm_int8_amx.cpp checks against this.
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__) && \
    (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11)
inline constexpr bool kAmxDrivers = true;
#else
inline constexpr bool kAmxDrivers = false;
#endif

enum class Isa : int {
  kScalar = 0,
  // x86-64
  kAvx2 = 10,        // AVX2 + FMA
  kAvxVnni = 20,     // AVX-VNNI (256-bit vpdpbusd, VEX encoded)
  kAvx512 = 30,      // AVX-512F
  kAvx512Vnni = 40,  // AVX-512F/BW/VL + AVX512_VNNI
  kAvx512Bf16 = 50,  // AVX-512 + AVX512_BF16 (vdpbf16ps)
  kAmxInt8 = 60,     // AVX-512 VNNI + AMX-TILE + AMX-INT8 (TDPBSUD), OS permission
  kAmxBf16 = 70,     // AVX-512 BF16 + AMX-TILE + AMX-BF16 (TDPBF16PS), OS permission
  // ARM64 (cpu/gemm_arm.h reads the feature bits)
  kNeon = 100,      // Advanced SIMD, fp32 FMLA (every AArch64 CPU)
  kNeonDot = 110,   // + FEAT_DotProd (SDOT/UDOT)
  kNeonFhm = 115,   // + FEAT_FHM (FMLAL/FMLAL2: fp16 products, fp32 sums)
  kNeonI8mm = 120,  // + FEAT_I8MM (USDOT/SMMLA/USMMLA)
  kNeonBf16 = 130,  // + FEAT_BF16 (BFMLALB/BFMLALT)
};

// Whether this CPU (and OS) can run code of level `isa`.
bool isa_supported(Isa isa);

// The name used in MLX_LATTICE_GEMM_ISA and reported by benchmarks.
const char* isa_name(Isa isa);

// The ceiling: the last set_isa_ceiling() if any, else MLX_LATTICE_GEMM_ISA
// (read once), else this architecture's highest level (also when the name
// is unknown: mlx_lattice's import raises for that, check_environment).
Isa isa_ceiling();

// Sets the ceiling for the whole process (thread-safe), overriding
// MLX_LATTICE_GEMM_ISA; reset_isa_ceiling() returns to the environment's.
// Families that cache their choice at first use (the fp32 GEMM, the bf16
// forward and gradients) see it only before that use.
void set_isa_ceiling(Isa isa);
void reset_isa_ceiling();

// Whether the CPU's vendor string (CPUID leaf 0) is "GenuineIntel"; false
// off x86-64. Kernel families use it where a level's speed differs by vendor
// (cpu/gemm_bf16.cpp).
bool cpu_is_intel();

// The L2 size the tile drivers size their output tiles from (cpu/tiles.h's
// l2_tile_rows): set_l2_cache_bytes's value where one is set, else one
// core's level-2 cache (sysconf on Linux, read once; 0 where unknown, off
// Linux x86-64). Results do not depend on it, only speed.
int64_t l2_cache_bytes();

// Makes l2_cache_bytes() return `bytes` (>= 0, at most kMaxL2CacheBytes)
// from now on, in every thread, so tests run each tile size on any host and
// benchmarks compare them; a negative value returns to the host's size.
constexpr int64_t kMaxL2CacheBytes = int64_t{1} << 40;
void set_l2_cache_bytes(int64_t bytes);

// This architecture's level named `name` (isa_name's spelling); false when
// unknown or another architecture's.
bool isa_from_name(const char* name, Isa& isa);

// This architecture's level names, lowest first, comma-separated (for
// messages).
std::string isa_level_names();

// Whether a kernel of level `isa` may run: under the ceiling (asked first,
// so a level above it never requests the AMX permission) and supported.
inline bool isa_usable(Isa isa) {
  return static_cast<int>(isa) <= static_cast<int>(isa_ceiling()) && isa_supported(isa);
}

// The first usable entry of a best-first table whose last entry is scalar.
// Entry is any struct with a member `Isa isa`.
template <typename Entry, std::size_t N>
const Entry& pick(const Entry (&table)[N]) {
  static_assert(N > 0, "a kernel table needs at least its scalar entry");
  for (std::size_t i = 0; i + 1 < N; ++i) {
    if (isa_usable(table[i].isa)) return table[i];
  }
  return table[N - 1];
}

}  // namespace mlx_lattice::isa
