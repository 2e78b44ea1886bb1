// The AMX drivers instantiated with the portable tile model
// (cpu/amx_tile_model.h), as the function types the dispatch takes
// (Int8RowsFn, Bf16RowsFn, Bf16WgradFn): for the tests (amx_int8_test,
// amx_bf16_test) and the test-only harness extension's fuzz bindings. Not
// part of the product extension.
#pragma once

#include <cstdint>

#include "amx_bf16.h"
#include "amx_bf16_wgrad.h"
#include "amx_int8.h"
#include "amx_tile_model.h"

namespace mlx_lattice::kernels::amx_model {

// The int8 forward with the portable epilogue.
inline void int8_rows_scalar(const amx_int8::Rows& a, const amx_int8::Weights& w, int64_t group,
                             const Csr& csr, const int32_t* a_index, const int32_t* kernel_ids,
                             int64_t g0, int64_t g1, float* out) {
  thread_local amx_int8::Scratch s;
  amx_int8::run_rows<amx::TileModel, amx_int8::EpiScalar>(a, w, group, csr, a_index, kernel_ids,
                                                          g0, g1, out, s);
}

// The bf16 forward (or feature gradient).
inline void bf16_rows(const amx_bf16::Rows& a, const amx_bf16::Weights& w, const Csr& csr,
                      const int32_t* a_index, const int32_t* kernel_ids, int64_t g0, int64_t g1,
                      uint16_t* out) {
  thread_local amx_bf16::Scratch s;
  amx_bf16::run_rows<amx::TileModel>(a, w, csr, a_index, kernel_ids, g0, g1, out, s);
}

// The bf16 weight gradient with the portable slab gather.
inline void wgrad_scalar(const amx_bf16::WgradArgs& p, int64_t k0, int64_t k1, float* dweight) {
  thread_local amx_bf16::WgradScratch s;
  amx_bf16::run_wgrad<amx::TileModel>(p, k0, k1, dweight, s);
}

#if defined(__x86_64__)
// The AVX-512 epilogue and slab gather: only where isa_supported(kAvx512).
inline void int8_rows_avx512(const amx_int8::Rows& a, const amx_int8::Weights& w, int64_t group,
                             const Csr& csr, const int32_t* a_index, const int32_t* kernel_ids,
                             int64_t g0, int64_t g1, float* out) {
  thread_local amx_int8::Scratch s;
  amx_int8::run_rows<amx::TileModel, amx_int8::EpiAvx512>(a, w, group, csr, a_index, kernel_ids,
                                                          g0, g1, out, s);
}

inline void wgrad_avx512(const amx_bf16::WgradArgs& p, int64_t k0, int64_t k1, float* dweight) {
  thread_local amx_bf16::WgradScratch s;
  amx_bf16::run_wgrad<amx::TileModel, amx_bf16::GatherAvx512>(p, k0, k1, dweight, s);
}
#endif

}  // namespace mlx_lattice::kernels::amx_model
