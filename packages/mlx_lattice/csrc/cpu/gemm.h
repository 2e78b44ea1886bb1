// Row-indirect GEMM micro-kernels: C[r] += A[r] @ B for rows given by pointer.
//
// The rows of A and C are addressed through pointer lists, so a sparse conv
// gathers its neighbour rows and scatters into its output rows without
// copying. Every output row is computed by the same instruction sequence
// (C loaded, then one fused multiply-add per j in ascending order), whatever
// rows share its register block: results do not depend on tiling or threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mlx_lattice {

// Rows per register block of gemm_rows (x86 and scalar paths): each block
// reads the whole of B, so a call over m rows reads B about m / 6 times.
inline constexpr int kGemmBlockRows = 6;

// For r in [0, m): c_rows[r][0:n] += sum_j a_rows[r][j] * b[j * n + 0:n].
// b is (kdim, n) row-major. Rows of c_rows must be distinct.
void gemm_rows(int64_t m, const float* const* a_rows, const float* b, int64_t kdim, int64_t n,
               float* const* c_rows);

// gemm_rows over half-precision rows of A: each register block's rows are
// widened to float32 by `widen` (kdim values from a row to a buffer) just
// before the block runs, while the next block's rows are requested. The
// arithmetic is gemm_rows's on the widened rows, so the same bits.
using WidenRow = void (*)(const uint16_t* src, int64_t n, float* dst);
void gemm_rows_widened(int64_t m, const uint16_t* const* a_rows, WidenRow widen, const float* b,
                       int64_t kdim, int64_t n, float* const* c_rows);

// gemm_rows over float16 (bf16 false) or bfloat16 rows of A, each register
// block widening its rows 16 values at a time as it runs (the values
// gemm_rows_widened's widening gives, so the same bits), where gemm_rows
// runs AVX-512; false, with nothing done, elsewhere.
bool gemm_rows_half(int64_t m, const uint16_t* const* a_rows, bool bf16, const float* b,
                    int64_t kdim, int64_t n, float* const* c_rows);

// For rows r in [r0, r1): c[r * n + 0:n] += sum_j f[j][r] * g[j][0:n], j
// ascending (outer products of gathered rows, as in a weight gradient).
void gemm_outer(int64_t m, const float* const* f, const float* const* g, int64_t r0, int64_t r1,
                float* c, int64_t n);

// Name of the micro-kernel in use ("avx512f", "avx2-fma", "neon-fma" or
// "scalar"), for benchmarks. MLX_LATTICE_GEMM_ISA names a lower one to force.
// The AVX-512 forward blocks of one or two vectors per row broadcast A's
// values into registers on Intel cores and fold them into the FMA's memory
// operand elsewhere (the same bits); MLX_LATTICE_GEMM_SPLAT=1 or 0 forces
// one form.
const char* gemm_isa();

// MLX_LATTICE_GEMM_SPLAT's value: "1" (broadcast into registers) or "0"
// (the memory operand) sets `splat` and returns true; anything else false.
bool splat_from_text(const char* text, bool& splat);

// The micro-kernels this build and CPU can run, best first; "scalar" always
// last. Tests force each through MLX_LATTICE_GEMM_ISA.
std::vector<std::string> gemm_isas();

}  // namespace mlx_lattice
