#include "isa.h"

#include "gemm_arm.h"

#include <cstdlib>
#include <string>

namespace mlx_lattice::isa {

namespace {

constexpr Isa kLevels[] = {Isa::kScalar,     Isa::kAvx2,       Isa::kAvxVnni,
                           Isa::kAvx512,     Isa::kAvx512Vnni, Isa::kAvx512Bf16,
                           Isa::kNeon,       Isa::kNeonDot,    Isa::kNeonFhm,
                           Isa::kNeonI8mm,   Isa::kNeonBf16};

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
    if (kLevels[i] == isa) return (bits >> i) & 1u;
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
    case Isa::kNeon: return "neon-fma";
    case Isa::kNeonDot: return "neon-dotprod";
    case Isa::kNeonFhm: return "neon-fhm";
    case Isa::kNeonI8mm: return "neon-i8mm";
    case Isa::kNeonBf16: return "neon-bf16";
  }
  return "unknown";
}

Isa isa_ceiling() {
  static const Isa ceiling = [] {
    const Isa top = kLevels[sizeof(kLevels) / sizeof(kLevels[0]) - 1];
    const char* env = std::getenv("MLX_LATTICE_GEMM_ISA");
    if (!env) return top;
    const std::string want(env);
    for (Isa level : kLevels) {
      if (want == isa_name(level)) return level;
    }
    return top;
  }();
  return ceiling;
}

}  // namespace mlx_lattice::isa
