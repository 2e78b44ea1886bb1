// AArch64 micro-kernels of gemm.h and the CPU features they are chosen by.
//
// Declared on every platform so gemm.cpp needs no ARM #ifdefs beyond its
// hook; on other machines `arm::available()` is empty and nothing else is
// called.
#pragma once

#include <cstdint>

namespace mlx_lattice::arm {

// Features read from the CPU (getauxval on Linux, sysctlbyname on macOS).
struct Features {
  bool neon = false;     // Advanced SIMD with fp32 FMA (always on AArch64)
  bool fp16 = false;     // FEAT_FP16: half-precision arithmetic
  bool fhm = false;      // FEAT_FHM: FMLAL/FMLAL2 (fp16 products, fp32 sums)
  bool dotprod = false;  // FEAT_DotProd: SDOT/UDOT
  bool bf16 = false;     // FEAT_BF16: BFDOT/BFMMLA
  bool i8mm = false;     // FEAT_I8MM: SMMLA
};

Features cpu_features();

// The fp32 path used by gemm_rows/gemm_outer: "neon-fma" (isa::Isa::kNeon),
// or nullptr when this build or CPU has none or MLX_LATTICE_GEMM_ISA's
// ceiling is below it (cpu/isa.h).
const char* selected_isa();

// gemm.h's contracts, with fp32 NEON fused multiply-adds in the same
// per-value order (C loaded, then j ascending): bit-identical to the x86 FMA
// paths and to a std::fma chain.
void gemm_rows(int64_t m, const float* const* a_rows, const float* b, int64_t kdim, int64_t n,
               float* const* c_rows);
void gemm_outer(int64_t m, const float* const* f, const float* const* g, int64_t r0, int64_t r1,
                float* c, int64_t n);

}  // namespace mlx_lattice::arm
