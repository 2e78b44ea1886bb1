// The AMX-BF16 driver on the hardware: cpu/amx_bf16.h's run_rows with the
// real tile instructions, inlined whole into one entry point compiled for
// AMX (it runs only where cpu/isa.h reports Isa::kAmxBf16: CPUID, XCR0 and
// the OS permission).
#include "amx_bf16.h"
#include "amx_bf16_wgrad.h"
#include "gemm_bf16.h"

namespace mlx_lattice::kernels {

#ifdef MLX_LATTICE_AMX

namespace {

thread_local amx_bf16::Scratch amx_bf16_scratch;
thread_local amx_bf16::WgradScratch amx_bf16_wgrad_scratch;

[[gnu::flatten]] __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl,"
                                       "avx512bf16"))) void
amx_bf16_rows_hw(const amx_bf16::Rows& a, const amx_bf16::Weights& w, const Csr& csr,
                 const int32_t* a_index, const int32_t* kernel_ids, int64_t g0, int64_t g1,
                 uint16_t* out) {
  amx_bf16::run_rows<amx::TileHw>(a, w, csr, a_index, kernel_ids, g0, g1, out,
                                  amx_bf16_scratch);
}

[[gnu::flatten]] __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl,"
                                       "avx512bf16"))) void
amx_bf16_wgrad_hw(const amx_bf16::WgradArgs& p, int64_t k0, int64_t k1, float* dweight) {
  amx_bf16::run_wgrad<amx::TileHw, amx_bf16::GatherAvx512>(p, k0, k1, dweight,
                                                           amx_bf16_wgrad_scratch);
}

}  // namespace

const Bf16RowsFn kAmxBf16RowsHw = amx_bf16_rows_hw;
const Bf16WgradFn kAmxBf16WgradHw = amx_bf16_wgrad_hw;

#else

const Bf16RowsFn kAmxBf16RowsHw = nullptr;
const Bf16WgradFn kAmxBf16WgradHw = nullptr;

#endif

}  // namespace mlx_lattice::kernels
