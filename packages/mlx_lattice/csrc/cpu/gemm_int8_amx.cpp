// The AMX-INT8 driver on the hardware: cpu/amx_int8.h's run_rows with the
// real tile instructions and the AVX-512 epilogue, inlined whole into one
// entry point compiled for AMX (it runs only where cpu/isa.h reports
// Isa::kAmxInt8: CPUID, XCR0 and the OS permission).
#include "amx_int8.h"
#include "gemm_int8.h"
#include "isa.h"

// GCC 12 reports _mm512_cvtepi32_ps's own undefined pass-through operand as
// "maybe uninitialized"; it is not read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace mlx_lattice::kernels {

#ifdef MLX_LATTICE_AMX
static_assert(isa::kAmxDrivers, "cpu/isa.h's kAmxDrivers must follow MLX_LATTICE_AMX");
#else
static_assert(!isa::kAmxDrivers, "cpu/isa.h's kAmxDrivers must follow MLX_LATTICE_AMX");
#endif

#ifdef MLX_LATTICE_AMX

namespace {

thread_local amx_int8::Scratch amx_scratch;

[[gnu::flatten]] __attribute__((target(
    "amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl,avx512vnni"))) void
amx_int8_rows_hw(const amx_int8::Rows& a, const amx_int8::Weights& w, int64_t group,
                 const Csr& csr, const int32_t* a_index, const int32_t* kernel_ids, int64_t g0,
                 int64_t g1, float* out) {
  amx_int8::run_rows<amx::TileHw, amx_int8::EpiAvx512>(a, w, group, csr, a_index, kernel_ids,
                                                        g0, g1, out, amx_scratch);
}

}  // namespace

const Int8RowsFn kAmxInt8RowsHw = amx_int8_rows_hw;

#else

const Int8RowsFn kAmxInt8RowsHw = nullptr;

#endif

}  // namespace mlx_lattice::kernels
