// CPU evaluation of the convolution primitives: SparseConv (three faces),
// SparseConvSorted and SparseQuantizedConv.
#include <memory>
#include <optional>
#include <vector>

#include "../primitives.h"
#include "../weight_cache.h"
#include "eval.h"
#include "conv_forward.h"
#include "float_formats.h"
#include "gemm_bf16.h"
#include "gemm_int8.h"
#include "group_by.h"
#include "line_vector.h"
#include "quantized_weight.h"
#include "sorted_conv.h"
#include "weight_gradient.h"

namespace mlx_lattice {

using cpu::dispatch;
using cpu::FloatIn;
using cpu::FloatOut;
using cpu::idx;

namespace {

// Mixed precision: a float32 weight beside half-precision features (the
// forward and input-gradient faces) is rounded to the features' format, as
// MLX's cast would round it, so the result equals the convolution with the
// cast weight. `bits` holds the rounded weight, `values` it widened back.
struct RoundedWeight {
  RoundedWeight(const array& w, kernels::FloatFormat format)
      : bits(w.size()), values(w.size()) {
    if (w.size() == 0) return;
    kernels::from_float32(w.data<float>(), w.size(), format, bits.data());
    kernels::to_float32(bits.data(), format, w.size(), values.data());
  }
  kernels::LineVector<uint16_t> bits;
  kernels::LineVector<float> values;
};

// The float32 weight (K, cin, cout) of a weight-only quantized weight
// (inputs 1-3: packed codes, float32 scales and biases), from the cache.
std::shared_ptr<const kernels::LineVector<float>> dequantized_weight(const std::vector<array>& in,
                                                             const WeightSources& sources,
                                                             const QuantSpec& q,
                                                             int64_t n_kernels) {
  const auto& packed = in[1];
  const kernels::QuantizedWeightView view{packed.size() ? packed.data<uint8_t>() : nullptr,
                                          static_cast<int64_t>(packed.shape(2)) * 4,
                                          in[2].data<float>(),
                                          in[3].data<float>(),
                                          q.storage_in_channels,
                                          q.group_size,
                                          q.bits};
  const std::vector<int64_t> spec{n_kernels,  q.in_channels, q.out_channels, q.storage_in_channels,
                                  q.group_size, q.bits,        view.row_bytes};
  const auto floats = static_cast<size_t>(n_kernels * q.in_channels * q.out_channels);
  return cached_dequantized_weight(sources, spec, floats, [&](float* w) {
    kernels::dequantize_weight_panels(view, n_kernels, q.in_channels, q.out_channels, w);
  });
}

}  // namespace

void SparseConv::eval_cpu(const std::vector<array>& inputs, array& out) {
  dispatch(stream(), inputs, out,
           [mode = mode_, rel = rel_](std::vector<array>& in, array& o) {
             const auto& a = in[0];
             const auto& b = in[1];
             const Relation& r = *rel;
             const auto format = cpu::format_of(a.dtype());
             const bool mixed = mode != Mode::kWeightGrad && a.dtype() != mx::float32 &&
                                b.dtype() == mx::float32;
             std::optional<RoundedWeight> rounded;
             if (mixed) rounded.emplace(b, format);
             const bool half = (a.dtype() == b.dtype() || mixed) && o.dtype() == a.dtype() &&
                               kernels::half_conv_available(format);
             if (mode == Mode::kForward && half) {
               // Half x half -> float32 tiles (cpu/gemm_bf16.h).
               kernels::Csr csr{idx(r.out_offsets), nullptr, r.n_out};
               kernels::half_conv(format, a.data<uint16_t>(), a.shape(0), a.shape(1),
                                  mixed ? rounded->bits.data() : b.data<uint16_t>(),
                                  r.n_kernels, b.shape(2), csr, idx(r.in_rows), idx(r.out_rows),
                                  idx(r.kernel_ids), o.data<uint16_t>());
               return;
             }
             if (mode == Mode::kForward && a.dtype() == o.dtype() && a.dtype() != mx::float32) {
               // Half-precision rows converted per tile (cpu/conv_forward.cpp).
               FloatIn b32(b, 1);
               kernels::Csr csr{idx(r.out_offsets), nullptr, r.n_out};
               kernels::forward_conv(a.size() ? a.data<void>() : nullptr,
                                     cpu::format_of(a.dtype()), a.shape(1),
                                     mixed ? rounded->values.data() : b32.get(), r.n_kernels,
                                     b.shape(2), csr, idx(r.in_rows), idx(r.out_rows),
                                     idx(r.kernel_ids), o.size() ? o.data<void>() : nullptr);
               return;
             }
             // The input gradient runs the forward's tiles over the input
             // CSR with each offset's weight transposed, (K, cout, cin).
             auto transposed = [&](const float* w) {
               const int64_t cin = b.shape(1);
               const int64_t cout = b.shape(2);
               kernels::LineVector<float> wt(r.n_kernels * cin * cout);
               for (int64_t k = 0; k < r.n_kernels; ++k) {
                 for (int64_t i = 0; i < cin; ++i) {
                   for (int64_t x = 0; x < cout; ++x) {
                     wt[(k * cout + x) * cin + i] = w[(k * cin + i) * cout + x];
                   }
                 }
               }
               return wt;
             };
             if (mode == Mode::kInputGrad && half &&
                 kernels::half_conv_transposed_available(format)) {
               // The bf16 feature gradient on the bf16 kernels
               // (cpu/gemm_bf16.h): the input CSR with each offset's
               // weight transposed, float32 tiles rounded once.
               kernels::Csr csr{idx(r.in_offsets), idx(r.in_edge_ids), r.n_in};
               kernels::half_conv_transposed(
                   format, a.size() ? a.data<uint16_t>() : nullptr, a.shape(0), b.shape(2),
                   mixed ? rounded->bits.data() : b.data<uint16_t>(), r.n_kernels, b.shape(1),
                   csr, idx(r.out_rows), idx(r.in_rows), idx(r.kernel_ids),
                   o.size() ? o.data<uint16_t>() : nullptr);
               return;
             }
             if (mode == Mode::kInputGrad && a.dtype() == o.dtype() && a.dtype() != mx::float32) {
               // Half-precision cotangent rows widened per register block by
               // the forward's half driver (no float32 copy of G, one rounding
               // of each output row): the bits of the float32 path below.
               FloatIn b32(b, 1);
               const auto wt = transposed(mixed ? rounded->values.data() : b32.get());
               kernels::Csr csr{idx(r.in_offsets), idx(r.in_edge_ids), r.n_in};
               kernels::forward_conv(a.size() ? a.data<void>() : nullptr, format, b.shape(2),
                                     wt.data(), r.n_kernels, b.shape(1), csr, idx(r.out_rows),
                                     idx(r.in_rows), idx(r.kernel_ids),
                                     o.size() ? o.data<void>() : nullptr);
               return;
             }
             if (mode == Mode::kWeightGrad && a.dtype() == b.dtype() && a.dtype() != mx::float32 &&
                 kernels::half_weight_grad_available(format)) {
               // bf16 features and cotangents on the amx-bf16 weight-gradient
               // driver (cpu/amx_bf16_wgrad.h): float32 dW, rounded once to
               // a half weight's dtype.
               FloatOut out32(o);
               kernels::Csr csr{idx(r.k_offsets), idx(r.k_edge_ids), r.n_kernels};
               kernels::half_weight_grad(format, a.size() ? a.data<uint16_t>() : nullptr,
                                         a.shape(0), a.shape(1),
                                         b.size() ? b.data<uint16_t>() : nullptr, b.shape(0),
                                         b.shape(1), csr, idx(r.in_rows), idx(r.out_rows),
                                         out32.get());
               out32.finish();
               return;
             }
             if (mode == Mode::kWeightGrad) {
               // Half-precision feature and cotangent rows are widened per
               // chunk of edges inside the kernel (no float32 copy of F or
               // G): the bits of the float32 path on the widened arrays. dW
               // stays float32 beside a float32 weight (mixed precision) and
               // is rounded once to a half weight's dtype.
               FloatOut out32(o);
               kernels::Csr csr{idx(r.k_offsets), idx(r.k_edge_ids), r.n_kernels};
               kernels::weight_gradient(a.size() ? a.data<void>() : nullptr, format, a.shape(1),
                                        b.size() ? b.data<void>() : nullptr,
                                        cpu::format_of(b.dtype()), b.shape(1), csr,
                                        idx(r.in_rows), idx(r.out_rows), out32.get());
               out32.finish();
               return;
             }
             FloatIn a32(a, 0), b32(b, 1);
             FloatOut out32(o);
             if (mode == Mode::kForward) {
               kernels::Csr csr{idx(r.out_offsets), nullptr, r.n_out};
               kernels::stationary_conv(a32.get(), a.shape(1),
                                        mixed ? rounded->values.data() : b32.get(), r.n_kernels,
                                        out32.get(), b.shape(2), csr, idx(r.in_rows),
                                        idx(r.out_rows), idx(r.kernel_ids));
             } else {
               const int64_t cin = b.shape(1);
               const int64_t cout = b.shape(2);
               const auto wt = transposed(mixed ? rounded->values.data() : b32.get());
               kernels::Csr csr{idx(r.in_offsets), idx(r.in_edge_ids), r.n_in};
               kernels::stationary_conv(a32.get(), cout, wt.data(), r.n_kernels, out32.get(), cin,
                                        csr, idx(r.out_rows), idx(r.in_rows), idx(r.kernel_ids));
             }
             out32.finish();
           });
}

void SparseConvSorted::eval_cpu(const std::vector<array>& inputs, array& out) {
  dispatch(stream(), inputs, out,
           [rel = rel_, view = view_, store = store_sorted_](std::vector<array>& in, array& o) {
             const auto& f = in[0];
             const auto& w = in[1];
             FloatIn f32(f, 0), w32(w, 1);
             FloatOut out32(o);
             kernels::sorted_conv(f32.get(), f.shape(1), w32.get(), rel->n_kernels, w.shape(2),
                                  idx(view->sorted_map), idx(view->reorder), rel->n_out, store,
                                  out32.get());
             out32.finish();
           });
}

void SparseQuantizedConv::eval_cpu(const std::vector<array>& inputs, array& out) {
  // The weight's identity comes from the inputs themselves: the encoder's
  // task sees weak copies of them (weight_cache.h).
  auto sources = spec_.act_bits == 8 ? WeightSources{}
                                     : weight_sources({inputs[1], inputs[2], inputs[3]});
  dispatch(stream(), inputs, out,
           [rel = rel_, q = spec_, sources = std::move(sources)](std::vector<array>& in,
                                                                  array& o) {
    const Relation& r = *rel;
    const auto& packed = in[1];
    if (q.act_bits == 8) {
      kernels::Csr csr{idx(r.out_offsets), nullptr, r.n_out};
      FloatIn f32(in[0], 0);
      FloatOut out32(o);
      kernels::int8_conv(f32.get(), in[0].shape(0), q.in_channels,
                         packed.size() ? packed.data<uint8_t>() : nullptr,
                         static_cast<int64_t>(packed.shape(2)) * 4, in[2].data<float>(),
                         in[3].data<float>(), r.n_kernels, q.out_channels,
                         q.storage_in_channels, q.group_size, q.bits, q.act_scale, csr,
                         idx(r.in_rows), idx(r.out_rows), idx(r.kernel_ids), out32.get());
      out32.finish();
      return;
    }
    // Weight-only: the float32 weight (K, cin, cout), dequantized unless
    // cached; cached per weight object from its second call on
    // (weight_cache.h: keyed on the codes', scales' and biases' buffers,
    // which it keeps alive; K * cin * cout * 4 bytes per weight within a
    // byte budget), then the float forward. Dequantizing per tile inside the
    // forward instead cost every tile one panel per offset (3-4% of the
    // forward at C64); per call, one pass over the weight every call.
    kernels::Csr csr{idx(r.out_offsets), nullptr, r.n_out};
    const auto weight = dequantized_weight(in, sources, q, r.n_kernels);
    if (in[0].dtype() == o.dtype()) {
      kernels::forward_conv(in[0].size() ? in[0].data<void>() : nullptr,
                            cpu::format_of(o.dtype()), q.in_channels, weight->data(), r.n_kernels,
                            q.out_channels, csr, idx(r.in_rows), idx(r.out_rows),
                            idx(r.kernel_ids), o.size() ? o.data<void>() : nullptr);
      return;
    }
    FloatIn f32(in[0], 0);
    FloatOut out32(o);
    kernels::stationary_conv(f32.get(), q.in_channels, weight->data(), r.n_kernels, out32.get(),
                             q.out_channels, csr, idx(r.in_rows), idx(r.out_rows),
                             idx(r.kernel_ids));
    out32.finish();
  });
}

}  // namespace mlx_lattice
