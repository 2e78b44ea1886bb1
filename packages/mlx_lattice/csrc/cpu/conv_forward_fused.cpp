// CPU evaluation of SparseQuantizedConvFused: the static-scale integer
// convolution with its fused epilogue (cpu/gemm_int8.h: int8_conv_fused).
// The weight in the kernels' layout, its scales times the input scale, is
// packed once per weight and input scale and kept in the weight cache
// (weight_cache.h), as the weight-only convolution keeps its dequantized
// weight.
#include <bit>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "../primitives.h"
#include "../weight_cache.h"
#include "eval.h"
#include "gemm_int8.h"
#include "group_by.h"

namespace mlx_lattice {

using cpu::dispatch;
using cpu::FloatIn;
using cpu::idx;

namespace {

// The packed weight of inputs 1-3 (codes, float32 scales and biases) at
// the static input scale q.act_scale, from the cache.
std::shared_ptr<const kernels::PackedInt8Weight> packed_weight(const std::vector<array>& in,
                                                               const WeightSources& sources,
                                                               const QuantSpec& q,
                                                               int64_t n_kernels) {
  const auto& packed = in[1];
  const int64_t row_bytes = static_cast<int64_t>(packed.shape(2)) * 4;
  const std::vector<int64_t> spec{
      1,  // kind 1: a weight packed for the integer kernels
      n_kernels, q.in_channels, q.out_channels, q.storage_in_channels, q.group_size, q.bits,
      row_bytes, std::bit_cast<int32_t>(q.act_scale),
      kernels::int8_weight_centered(q.in_channels, q.out_channels, q.bits)};
  return std::static_pointer_cast<const kernels::PackedInt8Weight>(cached_weight(sources, spec, [&] {
    auto w = kernels::pack_int8_weight(packed.size() ? packed.data<uint8_t>() : nullptr, row_bytes,
                                       in[2].data<float>(), in[3].data<float>(), n_kernels,
                                       q.out_channels, q.in_channels, q.storage_in_channels,
                                       q.group_size, q.bits, q.act_scale);
    return CachedWeight{w, kernels::packed_int8_weight_bytes(*w)};
  }));
}

}  // namespace

void SparseQuantizedConvFused::eval_cpu(const std::vector<array>& inputs, array& out) {
  // The weight's identity from the inputs themselves: the encoder's task
  // sees weak copies of them (weight_cache.h).
  auto sources = weight_sources({inputs[1], inputs[2], inputs[3]});
  dispatch(stream(), inputs, out,
           [rel = rel_, f = spec_, sources = std::move(sources)](std::vector<array>& in,
                                                                  array& o) {
    const Relation& r = *rel;
    const QuantSpec& q = f.quant;
    const auto& packed = in[1];
    kernels::Int8Epilogue ep;
    size_t next = 4;
    if (f.has_bias) ep.bias = in[next++].data<float>();
    if (f.residual != 0) {
      const auto& res = in[next++];
      ep.residual = res.size() ? res.data<void>() : nullptr;
      ep.residual_int8 = f.residual == 2;
      ep.residual_scale = f.residual_scale;
    }
    ep.relu = f.relu;
    ep.out_scale = f.out_scale;
    ep.out_format = cpu::format_of(o.dtype());
    const auto& feats = in[0];
    std::optional<FloatIn> f32;
    if (!f.int8_input) f32.emplace(feats, 0);
    const auto weight = packed_weight(in, sources, q, r.n_kernels);
    kernels::Csr csr{idx(r.out_offsets), nullptr, r.n_out};
    kernels::int8_conv_fused(
        f32 ? f32->get() : nullptr,
        f.int8_input && feats.size() ? feats.data<int8_t>() : nullptr, feats.shape(0),
        q.in_channels, packed.size() ? packed.data<uint8_t>() : nullptr,
        static_cast<int64_t>(packed.shape(2)) * 4, in[2].data<float>(), in[3].data<float>(),
        r.n_kernels, q.out_channels, q.storage_in_channels, q.group_size, q.bits, q.act_scale,
        csr, idx(r.in_rows), idx(r.kernel_ids), ep, o.size() ? o.data<void>() : nullptr,
        weight.get());
  });
}

}  // namespace mlx_lattice
