// CPU evaluation of SparseQuantizedConvFused: the static-scale integer
// convolution with its fused epilogue (cpu/gemm_int8.h: int8_conv_fused).
#include <optional>
#include <vector>

#include "../primitives.h"
#include "eval.h"
#include "gemm_int8.h"
#include "group_by.h"

namespace mlx_lattice {

using cpu::dispatch;
using cpu::FloatIn;
using cpu::idx;

void SparseQuantizedConvFused::eval_cpu(const std::vector<array>& inputs, array& out) {
  dispatch(stream(), inputs, out, [rel = rel_, f = spec_](std::vector<array>& in, array& o) {
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
    kernels::Csr csr{idx(r.out_offsets), nullptr, r.n_out};
    kernels::int8_conv_fused(
        f32 ? f32->get() : nullptr,
        f.int8_input && feats.size() ? feats.data<int8_t>() : nullptr, feats.shape(0),
        q.in_channels, packed.size() ? packed.data<uint8_t>() : nullptr,
        static_cast<int64_t>(packed.shape(2)) * 4, in[2].data<float>(), in[3].data<float>(),
        r.n_kernels, q.out_channels, q.storage_in_channels, q.group_size, q.bits, q.act_scale,
        csr, idx(r.in_rows), idx(r.kernel_ids), ep, o.size() ? o.data<void>() : nullptr);
  });
}

}  // namespace mlx_lattice
