// GPU encode bodies of the convolution primitives (and the Operands helpers).
#include "../cpu/eval.h"
#include "encode.h"

namespace mlx_lattice::gpu {

Buffer Operands::floats(const mx::array& a) {
  if (!host_) return {&a, nullptr, a.nbytes()};
  if (a.dtype() == mx::float32 || a.size() == 0) return index(a);
  auto& buf = staged_.emplace_back(a.size());
  kernels::to_float32(a.data<void>(), cpu::format_of(a.dtype()), a.size(), buf.data());
  return {nullptr, buf.data(), buf.size() * 4};
}

Buffer Operands::output(mx::array& a) {
  if (!host_ || a.dtype() == mx::float32 || a.size() == 0) return index(a);
  auto& buf = staged_.emplace_back(a.size());
  pending_.push_back({&a, buf.data()});
  return {nullptr, buf.data(), buf.size() * 4};
}

void Operands::finish() {
  for (auto& [array, data] : pending_) {
    kernels::from_float32(data, array->size(), cpu::format_of(array->dtype()),
                          array->data<void>());
  }
}

Relation relation_buffers(Operands& ops, const mlx_lattice::Relation& r) {
  return {ops.index(r.in_rows),     ops.index(r.out_rows),   ops.index(r.kernel_ids),
          ops.index(r.out_offsets), ops.index(r.in_offsets), ops.index(r.in_edge_ids),
          ops.index(r.k_offsets),   ops.index(r.k_edge_ids)};
}

void encode(const SparseConv& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out) {
  using M = SparseConv::Mode;
  const auto& r = p.relation();
  const bool wgrad = p.mode() == M::kWeightGrad;
  const int64_t cin = wgrad ? in[0].shape(1) : in[1].shape(1);
  const int64_t cout = wgrad ? in[1].shape(1) : in[1].shape(2);
  const auto face = p.mode() == M::kForward     ? ConvFace::kForward
                    : p.mode() == M::kInputGrad ? ConvFace::kInputGrad
                                                : ConvFace::kWeightGrad;
  encode_conv(enc, face, ops.floats(in[0]), ops.floats(in[1]), relation_buffers(ops, r),
              ops.output(out), u32(r.n_in), u32(r.n_out), u32(r.n_kernels), u32(cin), u32(cout));
}

void encode(const SparseConvSorted& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out) {
  const auto& r = p.relation();
  const auto& v = p.view();
  encode_sorted_conv(enc, ops.floats(in[0]), ops.floats(in[1]), ops.index(v.sorted_map),
                     ops.index(v.reorder), ops.index(v.tile_masks), ops.output(out), u32(r.n_out),
                     u32(r.n_kernels), u32(in[1].shape(1)), u32(in[1].shape(2)),
                     p.store_sorted());
}

void encode(const SparseQuantizedConv& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out) {
  const auto& r = p.relation();
  const auto& q = p.spec();
  encode_quantized_conv(enc, ops.floats(in[0]), ops.index(in[1]), ops.floats(in[2]),
                        ops.floats(in[3]), relation_buffers(ops, r), ops.output(out), u32(r.n_out),
                        u32(r.n_kernels), u32(q.in_channels), u32(q.out_channels),
                        u32(in[1].shape(2) * 4), u32(q.storage_in_channels / q.group_size),
                        u32(q.group_size), u32(q.bits));
}

// int8 operands (codes, an int8 residual, an int8 output) are bound as
// they are: Operands stages floating arrays only.
void encode(const SparseQuantizedConvFused& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out) {
  const auto& r = p.relation();
  const auto& f = p.spec();
  const auto& q = f.quant;
  FusedConvArgs a{};
  a.feats = f.int8_input ? ops.index(in[0]) : ops.floats(in[0]);
  a.packed = ops.index(in[1]);
  a.scales = ops.floats(in[2]);
  a.biases = ops.floats(in[3]);
  size_t next = 4;
  if (f.has_bias) a.bias = ops.floats(in[next++]);
  if (f.residual == 1) a.res_f = ops.floats(in[next++]);
  if (f.residual == 2) a.res_q = ops.index(in[next++]);
  a.dims = {u32(r.n_out),
            u32(q.in_channels),
            u32(q.out_channels),
            u32(r.n_kernels),
            u32(in[1].shape(2) * 4),
            u32(q.storage_in_channels / q.group_size),
            u32(q.group_size),
            u32(q.bits),
            f.int8_input ? 1u : 0u,
            f.has_bias ? 1u : 0u,
            u32(f.residual),
            f.relu ? 1u : 0u,
            q.act_scale,
            f.residual_scale,
            f.out_scale};
  encode_int8_conv_fused(enc, a, relation_buffers(ops, r),
                         out.dtype() == mx::int8 ? ops.index(out) : ops.output(out));
}

}  // namespace mlx_lattice::gpu
