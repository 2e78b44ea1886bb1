#include "isa.h"

#include "gemm_arm.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace mlx_lattice::isa {

namespace {

// This architecture's levels, lowest first: the names MLX_LATTICE_GEMM_ISA
// and set_isa_ceiling accept here (another architecture's name would cap
// nothing or everything, so it is unknown), the highest the default ceiling.
#if defined(__x86_64__) || defined(_M_X64)
constexpr Isa kLevels[] = {Isa::kScalar,     Isa::kAvx2,       Isa::kAvxVnni,
                           Isa::kAvx512,     Isa::kAvx512Vnni, Isa::kAvx512Bf16,
                           Isa::kAmxInt8,    Isa::kAmxBf16};
#elif defined(__aarch64__)
constexpr Isa kLevels[] = {Isa::kScalar,  Isa::kNeon,      Isa::kNeonDot,
                           Isa::kNeonFhm, Isa::kNeonI8mm,  Isa::kNeonBf16};
#else
constexpr Isa kLevels[] = {Isa::kScalar};
#endif

#if defined(__x86_64__) || defined(_M_X64)
// CPUID.(EAX=7,ECX=0):EDX bit `bit` (AMX-BF16 22, AMX-TILE 24, AMX-INT8 25).
bool cpuid7_edx(int bit) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> bit) & 1u;
}

// XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS saves the tile state.
// xgetbv needs OSXSAVE (CPUID.1:ECX bit 27).
bool os_tile_state() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return false;
  unsigned lo = 0, hi = 0;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & (3u << 17)) == (3u << 17);
}

// Linux's per-process permission to use the tile data state (XFEATURE 18),
// requested once however many threads ask first (a function-local static's
// initialisation is thread-safe), and only when a kernel table asks for an
// AMX level under the ceiling (or ext.isa_supported is asked about one) in a
// build with the AMX drivers: once granted, Linux refuses every smaller
// sigaltstack than the AMX signal frame in the whole process, so a process
// whose kernels are capped below AMX (or without the drivers) never asks.
// Other OSes: no AMX here.
bool tile_permission() {
#if defined(__linux__)
  if (!kAmxDrivers) return false;
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXfeatureXtiledata = 18;     // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

// The CPU and OS side of an AMX level (the permission is asked apart, at use).
bool amx_present(int feature_bit) {
  return cpuid7_edx(24) && cpuid7_edx(feature_bit) && os_tile_state();
}
#endif

bool detect(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
#if defined(__x86_64__) || defined(_M_X64)
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kAvxVnni:
      return detect(Isa::kAvx2) && __builtin_cpu_supports("avxvnni");
    case Isa::kAvx512:
      return detect(Isa::kAvx2) && __builtin_cpu_supports("avx512f");
    case Isa::kAvx512Vnni:
      return detect(Isa::kAvx512) && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case Isa::kAvx512Bf16:
      return detect(Isa::kAvx512Vnni) && __builtin_cpu_supports("avx512bf16");
    case Isa::kAmxInt8:
      return detect(Isa::kAvx512Vnni) && amx_present(25);
    case Isa::kAmxBf16:
      return detect(Isa::kAvx512Bf16) && amx_present(22);
#endif
#if defined(__aarch64__)
    case Isa::kNeon:
      return arm::cpu_features().neon;
    case Isa::kNeonDot:
      return detect(Isa::kNeon) && arm::cpu_features().dotprod;
    case Isa::kNeonFhm:
      return detect(Isa::kNeon) && arm::cpu_features().fhm;
    case Isa::kNeonI8mm:
      return detect(Isa::kNeon) && arm::cpu_features().i8mm;
    case Isa::kNeonBf16:
      return detect(Isa::kNeon) && arm::cpu_features().bf16;
#endif
    default:
      return false;
  }
}

}  // namespace

bool isa_supported(Isa isa) {
  static const auto bits = [] {
    unsigned mask = 0;
    for (size_t i = 0; i < sizeof(kLevels) / sizeof(kLevels[0]); ++i) {
      if (detect(kLevels[i])) mask |= 1u << i;
    }
    return mask;
  }();
  for (size_t i = 0; i < sizeof(kLevels) / sizeof(kLevels[0]); ++i) {
    if (kLevels[i] != isa) continue;
    if (!((bits >> i) & 1u)) return false;
#if defined(__x86_64__) || defined(_M_X64)
    if (isa == Isa::kAmxInt8 || isa == Isa::kAmxBf16) return tile_permission();
#endif
    return true;
  }
  return false;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2-fma";
    case Isa::kAvxVnni: return "avx-vnni";
    case Isa::kAvx512: return "avx512f";
    case Isa::kAvx512Vnni: return "avx512-vnni";
    case Isa::kAvx512Bf16: return "avx512-bf16";
    case Isa::kAmxInt8: return "amx-int8";
    case Isa::kAmxBf16: return "amx-bf16";
    case Isa::kNeon: return "neon-fma";
    case Isa::kNeonDot: return "neon-dotprod";
    case Isa::kNeonFhm: return "neon-fhm";
    case Isa::kNeonI8mm: return "neon-i8mm";
    case Isa::kNeonBf16: return "neon-bf16";
  }
  return "unknown";
}

namespace {
// set_isa_ceiling's level, or -1 for "the environment's".
std::atomic<int> override_ceiling{-1};
}  // namespace

bool cpu_is_intel() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool intel = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    char v[13];
    std::memcpy(v, &b, 4);
    std::memcpy(v + 4, &d, 4);
    std::memcpy(v + 8, &c, 4);
    v[12] = 0;
    return std::string(v) == "GenuineIntel";
  }();
  return intel;
#else
  return false;
#endif
}

namespace {

// set_l2_cache_bytes's value; -1: none (the host's size).
std::atomic<int64_t> l2_override{-1};

// The size in bytes of one core's level-2 cache (sysconf on Linux, read
// once), or 0 where unknown (off Linux x86-64).
int64_t host_l2_cache_bytes() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__) && defined(_SC_LEVEL2_CACHE_SIZE)
  static const int64_t bytes = [] {
    const long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return v > 0 ? static_cast<int64_t>(v) : int64_t{0};
  }();
  return bytes;
#else
  return 0;
#endif
}

}  // namespace

int64_t l2_cache_bytes() {
  const int64_t forced = l2_override.load(std::memory_order_relaxed);
  return forced >= 0 ? forced : host_l2_cache_bytes();
}

void set_l2_cache_bytes(int64_t bytes) {
  // At most 1 TiB: the drivers multiply it by their thread count.
  l2_override.store(bytes < 0 ? -1 : std::min<int64_t>(bytes, kMaxL2CacheBytes),
                    std::memory_order_relaxed);
}

bool isa_from_name(const char* name, Isa& isa) {
  if (!name) return false;
  const std::string want(name);
  for (Isa level : kLevels) {
    if (want == isa_name(level)) {
      isa = level;
      return true;
    }
  }
  return false;
}

std::string isa_level_names() {
  std::string names;
  for (Isa level : kLevels) {
    if (!names.empty()) names += ", ";
    names += isa_name(level);
  }
  return names;
}

Isa isa_ceiling() {
  const int forced = override_ceiling.load(std::memory_order_relaxed);
  if (forced >= 0) return static_cast<Isa>(forced);
  static const Isa ceiling = [] {
    Isa level = kLevels[sizeof(kLevels) / sizeof(kLevels[0]) - 1];
    isa_from_name(std::getenv("MLX_LATTICE_GEMM_ISA"), level);
    return level;
  }();
  return ceiling;
}

void set_isa_ceiling(Isa isa) { override_ceiling.store(static_cast<int>(isa)); }

void reset_isa_ceiling() { override_ceiling.store(-1); }

}  // namespace mlx_lattice::isa
