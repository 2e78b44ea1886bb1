// The AMX drivers on the portable tile model (cpu/amx_tile_model.h), bound
// into the test-only harness_ext so the fuzz targets can run them on any
// host (tests/fuzz_amx_model.py): the int8 forward (both epilogues), the
// bf16 forward or feature gradient, and the bf16 weight gradient (both slab
// gathers). The product extension never holds the model.

// GCC 12 reports _mm512_cvtepi32_ps's own undefined pass-through operand as
// "maybe uninitialized" (in the AVX-512 epilogue); it is not read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "mlx/mlx.h"

#include "../cpu/amx_model_drivers.h"
#include "../cpu/gemm_bf16.h"
#include "../cpu/gemm_int8.h"
#include "../cpu/isa.h"
#include "harness.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace mlx_lattice {

namespace {

using kernels::Csr;

bool avx512_usable() {
#if defined(__x86_64__)
  return isa::isa_supported(isa::Isa::kAvx512);
#else
  return false;
#endif
}

// The model driver named `name`: "scalar", or "avx512" where the host has
// AVX-512.
template <class Fn>
Fn pick(const std::string& name, const char* what, Fn scalar, Fn avx512) {
  if (name == "scalar") return scalar;
  if (name != "avx512") {
    throw std::invalid_argument(std::string("amx model: ") + what + " is 'scalar' or 'avx512'");
  }
  if (avx512 == nullptr || !avx512_usable()) {
    throw std::invalid_argument("amx model: no AVX-512 here");
  }
  return avx512;
}

#if defined(__x86_64__)
constexpr kernels::Int8RowsFn kInt8Avx512 = kernels::amx_model::int8_rows_avx512;
constexpr kernels::Bf16WgradFn kWgradAvx512 = kernels::amx_model::wgrad_avx512;
#else
constexpr kernels::Int8RowsFn kInt8Avx512 = nullptr;
constexpr kernels::Bf16WgradFn kWgradAvx512 = nullptr;
#endif

// `a` evaluated and row-contiguous, of dtype `dt` and rank `ndim`.
mx::array operand(const mx::array& a, mx::Dtype dt, int ndim, const char* name) {
  if (a.dtype() != dt || static_cast<int>(a.ndim()) != ndim) {
    throw std::invalid_argument(std::string("amx model: ") + name + " has the wrong dtype or rank");
  }
  mx::array c = mx::contiguous(a);
  c.eval();
  return c;
}

template <class T>
const T* data(const mx::array& a) {
  static const T zero{};
  return a.size() ? static_cast<const T*>(a.data<void>()) : &zero;
}

// A CSR of `groups` over `edges` edges, edge ids in range, and the edges'
// index arrays in [0, bound) each: the drivers trust validated relations.
Csr checked_csr(const mx::array& offsets, const mx::array& edge_ids, int64_t edges) {
  const int64_t groups = static_cast<int64_t>(offsets.size()) - 1;
  if (groups < 0) throw std::invalid_argument("amx model: offsets must not be empty");
  const int32_t* o = data<int32_t>(offsets);
  if (o[0] != 0 || o[groups] != edges) throw std::invalid_argument("amx model: bad offsets");
  for (int64_t g = 0; g < groups; ++g) {
    if (o[g + 1] < o[g]) throw std::invalid_argument("amx model: offsets decrease");
  }
  if (edge_ids.size() != 0 && static_cast<int64_t>(edge_ids.size()) != edges) {
    throw std::invalid_argument("amx model: edge_ids must be empty or hold every edge");
  }
  for (int64_t j = 0; j < static_cast<int64_t>(edge_ids.size()); ++j) {
    const int32_t e = data<int32_t>(edge_ids)[j];
    if (e < 0 || e >= edges) throw std::invalid_argument("amx model: edge id out of range");
  }
  return Csr{o, edge_ids.size() ? data<int32_t>(edge_ids) : nullptr, groups};
}

void check_indices(const mx::array& a, int64_t bound, const char* name) {
  for (int64_t j = 0; j < static_cast<int64_t>(a.size()); ++j) {
    const int32_t v = data<int32_t>(a)[j];
    if (v < 0 || v >= bound) {
      throw std::invalid_argument(std::string("amx model: ") + name + " out of range");
    }
  }
}

}  // namespace

void bind_amx_model(nb::module_& m) {
  m.def(
      "amx_model_int8_conv",
      [](const mx::array& feats, const mx::array& words, const mx::array& scales,
         const mx::array& biases, const mx::array& offsets, const mx::array& edge_ids,
         const mx::array& in_rows, const mx::array& kernel_ids, int64_t storage_in,
         int64_t group, int bits, float act_scale, const std::string& epilogue) {
        const auto f = operand(feats, mx::float32, 2, "feats");
        const auto w = operand(words, mx::uint32, 3, "words");
        const auto s = operand(scales, mx::float32, 3, "scales");
        const auto b = operand(biases, mx::float32, 3, "biases");
        const auto off = operand(offsets, mx::int32, 1, "offsets");
        const auto ids = operand(edge_ids, mx::int32, 1, "edge_ids");
        const auto rows = operand(in_rows, mx::int32, 1, "in_rows");
        const auto kid = operand(kernel_ids, mx::int32, 1, "kernel_ids");
        const int64_t n_in = f.shape(0), cin = f.shape(1);
        const int64_t nk = w.shape(0), cout = w.shape(1), row_bytes = w.shape(2) * 4;
        const int64_t edges = rows.size();
        if (static_cast<int64_t>(kid.size()) != edges || group <= 0 || group % 4 != 0 ||
            storage_in % group != 0 || storage_in < cin || row_bytes * 8 != storage_in * bits ||
            s.shape(0) != nk || s.shape(1) != cout || s.shape(2) != storage_in / group ||
            b.shape() != s.shape()) {
          throw std::invalid_argument("amx model: inconsistent int8 operands");
        }
        const Csr csr = checked_csr(off, ids, edges);
        check_indices(rows, n_in, "in_rows");
        check_indices(kid, nk, "kernel_ids");
        const kernels::Int8RowsFn fn =
            pick(epilogue, "epilogue", kernels::Int8RowsFn{kernels::amx_model::int8_rows_scalar},
                 kInt8Avx512);
        std::vector<float> out(std::max<int64_t>(1, csr.groups * cout));
        kernels::int8_conv_rows(fn, data<float>(f), n_in, cin, data<uint8_t>(w), row_bytes,
                                data<float>(s), data<float>(b), nk, cout, storage_in, group, bits,
                                act_scale, csr, data<int32_t>(rows), data<int32_t>(kid),
                                out.data());
        return mx::array(out.begin(), {static_cast<int>(csr.groups), static_cast<int>(cout)},
                         mx::float32);
      },
      "feats"_a, "words"_a, "scales"_a, "biases"_a, "offsets"_a, "edge_ids"_a, "in_rows"_a,
      "kernel_ids"_a, "storage_in"_a, "group"_a, "bits"_a, "act_scale"_a, "epilogue"_a,
      "The w8a8 / w4a8 convolution through the AMX-INT8 driver on the tile model (float32 "
      "features, mx.quantize's packed words, float32 scales and biases, the output CSR).");
  m.def(
      "amx_model_bf16_conv",
      [](const mx::array& feats, const mx::array& weight, const mx::array& offsets,
         const mx::array& edge_ids, const mx::array& a_index, const mx::array& kernel_ids,
         bool transpose) {
        const auto f = operand(feats, mx::bfloat16, 2, "feats");
        const auto w = operand(weight, mx::bfloat16, 3, "weight");
        const auto off = operand(offsets, mx::int32, 1, "offsets");
        const auto ids = operand(edge_ids, mx::int32, 1, "edge_ids");
        const auto rows = operand(a_index, mx::int32, 1, "a_index");
        const auto kid = operand(kernel_ids, mx::int32, 1, "kernel_ids");
        const int64_t nk = w.shape(0), cin = w.shape(1), cout = w.shape(2);
        const int64_t edges = rows.size();
        if (static_cast<int64_t>(kid.size()) != edges || f.shape(1) != (transpose ? cout : cin)) {
          throw std::invalid_argument("amx model: inconsistent bf16 operands");
        }
        const Csr csr = checked_csr(off, ids, edges);
        check_indices(rows, f.shape(0), "a_index");
        check_indices(kid, nk, "kernel_ids");
        const int64_t out_ch = transpose ? cin : cout;
        std::vector<uint16_t> out(std::max<int64_t>(1, csr.groups * out_ch));
        kernels::bf16_conv_rows(kernels::amx_model::bf16_rows, data<uint16_t>(f), f.shape(0), cin,
                                data<uint16_t>(w), nk, cout, transpose, csr, data<int32_t>(rows),
                                data<int32_t>(kid), out.data());
        return mx::array(out.begin(), {static_cast<int>(csr.groups), static_cast<int>(out_ch)},
                         mx::uint16);
      },
      "feats"_a, "weight"_a, "offsets"_a, "edge_ids"_a, "a_index"_a, "kernel_ids"_a,
      "transpose"_a,
      "The bf16 convolution through the AMX-BF16 driver on the tile model (uint16 bits of "
      "the bf16 result); transpose: the feature gradient (each offset's weight transposed).");
  m.def(
      "amx_model_bf16_wgrad",
      [](const mx::array& feats, const mx::array& grad, const mx::array& offsets,
         const mx::array& edge_ids, const mx::array& in_rows, const mx::array& out_rows,
         const std::string& gather) {
        const auto f = operand(feats, mx::bfloat16, 2, "feats");
        const auto g = operand(grad, mx::bfloat16, 2, "grad");
        const auto off = operand(offsets, mx::int32, 1, "offsets");
        const auto ids = operand(edge_ids, mx::int32, 1, "edge_ids");
        const auto fi = operand(in_rows, mx::int32, 1, "in_rows");
        const auto gi = operand(out_rows, mx::int32, 1, "out_rows");
        const int64_t edges = fi.size();
        if (static_cast<int64_t>(gi.size()) != edges) {
          throw std::invalid_argument("amx model: inconsistent weight-gradient operands");
        }
        const Csr csr = checked_csr(off, ids, edges);
        check_indices(fi, f.shape(0), "in_rows");
        check_indices(gi, g.shape(0), "out_rows");
        const kernels::Bf16WgradFn fn =
            pick(gather, "gather", kernels::Bf16WgradFn{kernels::amx_model::wgrad_scalar},
                 kWgradAvx512);
        const int64_t cin = f.shape(1), cout = g.shape(1);
        std::vector<float> dw(std::max<int64_t>(1, csr.groups * cin * cout));
        kernels::bf16_weight_grad_rows(fn, data<uint16_t>(f), f.shape(0), cin,
                                       data<uint16_t>(g), g.shape(0), cout, csr,
                                       data<int32_t>(fi), data<int32_t>(gi), dw.data());
        return mx::array(dw.begin(),
                         {static_cast<int>(csr.groups), static_cast<int>(cin),
                          static_cast<int>(cout)},
                         mx::float32);
      },
      "feats"_a, "grad"_a, "offsets"_a, "edge_ids"_a, "in_rows"_a, "out_rows"_a, "gather"_a,
      "The bf16 weight gradient (float32 dW) through the AMX-BF16 driver on the tile model, "
      "over the kernel CSR.");
  m.def("amx_model_avx512", &avx512_usable,
        "Whether the AVX-512 epilogue and slab gather can run on this host.");
}

}  // namespace mlx_lattice
