#include "sparse_ops.h"

#include <algorithm>
#include <functional>
#include <list>
#include <sstream>

#include "common.h"
#include "kernels.h"
#include "metal/encoder.h"
#include "metal/plans.h"
#include "mlx/backend/cpu/encoder.h"
#include "primitives.h"
#include "validate.h"

namespace mlx_lattice {

namespace {

using Conv = SparseConv::Mode;

// Floating operands share the dtype of the primitive's first operand (the
// features, or a cotangent of them) and are made row-contiguous.
mx::array as_dtype(const mx::array& a, mx::Dtype dtype, mx::Stream s) {
  if (s.device == mx::Device::gpu) dtype = mx::float32;  // the Metal kernels are float32
  return mx::contiguous(a.dtype() == dtype ? a : mx::astype(a, dtype, s), false, s);
}

// The dtype a primitive computes in on stream s.
mx::Dtype compute_dtype(mx::Dtype dtype, mx::Stream s) {
  return s.device == mx::Device::gpu ? mx::float32 : dtype;
}

kernels::FloatFormat format_of(mx::Dtype dtype) {
  if (dtype == mx::float16) return kernels::FloatFormat::kF16;
  if (dtype == mx::bfloat16) return kernels::FloatFormat::kBF16;
  return kernels::FloatFormat::kF32;
}

// Float32 staging buffers of half-precision operands, kept per evaluating
// thread: fresh multi-megabyte allocations per call cost more in page faults
// than the conversions themselves. Slot 0, 1: inputs; slot 2: the output.
float* staging(int slot, size_t n) {
  thread_local std::vector<float> buffers[3];
  auto& b = buffers[slot];
  if (b.size() < n) b.resize(n);
  return b.data();
}

// A float32 view of a floating array: its own data, or a converted copy.
class FloatIn {
 public:
  FloatIn(const mx::array& a, int slot) {
    if (a.dtype() == mx::float32 || a.size() == 0) {
      ptr_ = a.size() ? a.data<float>() : nullptr;
    } else {
      float* buf = staging(slot, a.size());
      kernels::to_float32(a.data<void>(), format_of(a.dtype()), a.size(), buf);
      ptr_ = buf;
    }
  }
  const float* get() const { return ptr_; }

 private:
  const float* ptr_ = nullptr;
};

// A float32 buffer for an output, written back in the output's dtype.
class FloatOut {
 public:
  explicit FloatOut(mx::array& out) : out_(out) {
    if (out.dtype() != mx::float32) {
      ptr_ = staging(2, out.size());
    } else {
      ptr_ = out.size() ? out.data<float>() : nullptr;
    }
  }
  float* get() { return ptr_; }
  void finish() {
    if (out_.dtype() != mx::float32 && out_.size()) {
      kernels::from_float32(ptr_, out_.size(), format_of(out_.dtype()), out_.data<void>());
    }
  }

 private:
  mx::array& out_;
  float* ptr_ = nullptr;
};

}  // namespace

mx::array make_conv(Conv mode, const mx::array& a, const mx::array& b, const RelationArrays& rel,
                    ConvDims d, mx::Stream s) {
  mx::Shape shape;
  switch (mode) {
    case Conv::kForward:
      shape = {static_cast<int>(d.n_out), b.shape(2)};
      break;
    case Conv::kInputGrad:
      shape = {static_cast<int>(d.n_in), b.shape(1)};
      break;
    case Conv::kWeightGrad:
      shape = {static_cast<int>(d.n_kernels), a.shape(1), b.shape(1)};
      break;
  }
  std::vector<mx::array> inputs = {as_dtype(a, a.dtype(), s), as_dtype(b, a.dtype(), s)};
  for (auto& r : rel.list()) inputs.push_back(r);
  return mx::array(shape, compute_dtype(a.dtype(), s), std::make_shared<SparseConv>(s, mode, d),
                   inputs);
}

mx::array make_sorted(const mx::array& f, const mx::array& w, const mx::array& sorted_map,
                      const mx::array& reorder, const RelationArrays& rel, ConvDims d,
                      bool store_sorted, mx::Stream s) {
  std::vector<mx::array> inputs = {as_dtype(f, f.dtype(), s), as_dtype(w, f.dtype(), s),
                                   sorted_map, reorder};
  for (auto& r : rel.list()) inputs.push_back(r);
  return mx::array({static_cast<int>(d.n_out), w.shape(2)}, compute_dtype(f.dtype(), s),
                   std::make_shared<SparseConvSorted>(s, d, store_sorted), inputs);
}

mx::array make_direct(const mx::array& f, const mx::array& w, const mx::array& sorted_map,
                      const mx::array& reorder, const mx::array& tile_masks, ConvDims d,
                      bool store_sorted, mx::Stream s) {
  return mx::array({static_cast<int>(d.n_out), w.shape(2)}, compute_dtype(f.dtype(), s),
                   std::make_shared<SparseConvDirect>(s, d, store_sorted),
                   {as_dtype(f, f.dtype(), s), as_dtype(w, f.dtype(), s), sorted_map, reorder,
                    tile_masks});
}

mx::array make_quantized(const mx::array& f, const std::vector<mx::array>& quant,
                         const RelationArrays& rel, ConvDims d, QuantSpec spec, mx::Stream s) {
  std::vector<mx::array> inputs = {as_dtype(f, f.dtype(), s), quant[0],
                                   as_dtype(quant[1], mx::float32, s),
                                   as_dtype(quant[2], mx::float32, s)};
  for (auto& r : rel.list()) inputs.push_back(r);
  return mx::array({static_cast<int>(d.n_out), static_cast<int>(spec.out_channels)},
                   compute_dtype(f.dtype(), s),
                   std::make_shared<SparseQuantizedConv>(s, d, spec), inputs);
}

mx::array make_denominator(SparseDenominator::Mode mode, const mx::array& x,
                           const mx::array& kernel_ids, const mx::array& out_offsets, ConvDims d,
                           mx::Stream s) {
  mx::Shape shape = mode == SparseDenominator::Mode::kDenominator
                        ? mx::Shape{static_cast<int>(d.n_out), x.shape(2)}
                        : mx::Shape{static_cast<int>(d.n_kernels), x.shape(1)};
  return mx::array(shape, compute_dtype(x.dtype(), s),
                   std::make_shared<SparseDenominator>(s, mode, d),
                   {as_dtype(x, x.dtype(), s), kernel_ids, out_offsets});
}

mx::array make_pool(SparsePool::Stage stage, kernels::PoolMode mode,
                    const std::vector<mx::array>& floats, const mx::array& in_rows,
                    const mx::array& out_offsets, ConvDims d, mx::Stream s) {
  int rows = static_cast<int>(stage == SparsePool::Stage::kBackward ? d.n_in : d.n_out);
  std::vector<mx::array> inputs;
  for (auto& f : floats) inputs.push_back(as_dtype(f, floats[0].dtype(), s));
  inputs.push_back(in_rows);
  inputs.push_back(out_offsets);
  return mx::array({rows, floats[0].shape(1)}, compute_dtype(floats[0].dtype(), s),
                   std::make_shared<SparsePool>(s, stage, mode, d), inputs);
}

namespace {

// Adds two optional terms of a jvp.
mx::array sum_terms(std::optional<mx::array> a, std::optional<mx::array> b, mx::Stream s) {
  if (a && b) return mx::add(*a, *b, s);
  return a ? *a : *b;
}

// Tangent of argument `arg` among the jvp's tangents, if it has one.
std::optional<mx::array> tangent_of(int arg, const std::vector<mx::array>& tangents,
                                    const std::vector<int>& argnums) {
  for (size_t i = 0; i < argnums.size(); ++i) {
    if (argnums[i] == arg) return tangents[i];
  }
  return std::nullopt;
}

// The jvp of a bilinear op(a, b): op(ta, b) + op(a, tb) over the tangents given.
template <typename Op>
std::vector<mx::array> bilinear_jvp(Op op, const std::vector<mx::array>& primals,
                                    const std::vector<mx::array>& tangents,
                                    const std::vector<int>& argnums, mx::Stream s) {
  auto ta = tangent_of(0, tangents, argnums);
  auto tb = tangent_of(1, tangents, argnums);
  std::optional<mx::array> first, second;
  if (ta) first = op(*ta, primals[1]);
  if (tb) second = op(primals[0], *tb);
  if (!first && !second) return {mx::zeros_like(op(primals[0], primals[1]), s)};
  return {sum_terms(first, second, s)};
}

// Runs `body` on the stream's CPU encoder with weak copies of the arrays.
template <typename Body>
void dispatch(mx::Stream stream, const std::vector<mx::array>& inputs,
              std::vector<mx::array>& outputs, Body body) {
  for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  std::vector<mx::array> in_copies;
  for (auto& in : inputs) {
    encoder.set_input_array(in);
    in_copies.push_back(mx::array::unsafe_weak_copy(in));
  }
  std::vector<mx::array> out_copies;
  for (auto& out : outputs) {
    encoder.set_output_array(out);
    out_copies.push_back(mx::array::unsafe_weak_copy(out));
  }
  encoder.dispatch([in = std::move(in_copies), out = std::move(out_copies), body]() mutable {
    body(in, out);
  });
}

const int32_t* idx(const mx::array& a) { return idx_or_null(a); }

kernels::Csr csr_or_rebuilt(const mx::array& offsets, const mx::array& edge_ids,
                            const mx::array& keys, int64_t groups, std::vector<int32_t>& off_buf,
                            std::vector<int32_t>& ids_buf) {
  if (offsets.size() != 0) return {offsets.data<int32_t>(), idx(edge_ids), groups};
  kernels::group_by(idx(keys), keys.size(), groups, off_buf, ids_buf);
  return {off_buf.data(), ids_buf.data(), groups};
}

std::vector<mx::array> zero_grads_for_indices(const std::vector<mx::array>& primals,
                                              const std::vector<int>& argnums, size_t first,
                                              std::vector<mx::array> grads, mx::Stream s) {
  // Index arrays carry no gradient; MLX only asks for them if they were
  // (unusually) produced from differentiated values.
  std::vector<mx::array> out;
  size_t g = 0;
  for (int arg : argnums) {
    if (static_cast<size_t>(arg) < first) {
      out.push_back(grads[g++]);
    } else {
      out.push_back(mx::zeros_like(primals[arg], s));
    }
  }
  return out;
}

// -- the GPU path: encode plans run by the Metal encoder (macOS) or by the
// MSL CPU harness (set_metal_harness / MLX_LATTICE_METAL_HARNESS) --

// The buffers of one GPU evaluation. On the harness, half-precision operands
// are staged as float32 host memory and outputs converted back by finish();
// on Metal the (float32) arrays are bound directly.
class Operands {
 public:
  explicit Operands(bool host) : host_(host) {}
  Operands(const Operands&) = delete;
  Operands& operator=(const Operands&) = delete;

  gpu::Buffer floats(const mx::array& a) {
    if (!host_) return {&a, nullptr, a.nbytes()};
    if (a.dtype() == mx::float32 || a.size() == 0) return index(a);
    auto& buf = staged_.emplace_back(a.size());
    kernels::to_float32(a.data<void>(), format_of(a.dtype()), a.size(), buf.data());
    return {nullptr, buf.data(), buf.size() * 4};
  }
  gpu::Buffer output(mx::array& a) {
    if (!host_ || a.dtype() == mx::float32 || a.size() == 0) return index(a);
    auto& buf = staged_.emplace_back(a.size());
    pending_.push_back({&a, buf.data()});
    return {nullptr, buf.data(), buf.size() * 4};
  }
  gpu::Buffer index(const mx::array& a) {
    return {&a, host_ && a.size() ? a.data<void>() : nullptr, a.nbytes()};
  }
  // Host-made index data (rebuilt groupings); the Metal encoder uploads it.
  gpu::Buffer made(std::vector<int32_t> v) {
    auto& kept = made_.emplace_back(std::move(v));
    return {nullptr, kept.data(), kept.size() * 4};
  }
  void finish() {
    for (auto& [array, data] : pending_) {
      kernels::from_float32(data, array->size(), format_of(array->dtype()), array->data<void>());
    }
  }

 private:
  bool host_;
  std::list<std::vector<float>> staged_;  // list: stable addresses
  std::list<std::vector<int32_t>> made_;
  std::vector<std::pair<mx::array*, const float*>> pending_;
};

// The output row of every edge (edges are grouped by output).
std::vector<int32_t> rows_of_edges(const mx::array& out_offsets) {
  const int32_t* off = idx(out_offsets);
  const int64_t groups = static_cast<int64_t>(out_offsets.size()) - 1;
  std::vector<int32_t> rows(groups >= 0 ? off[groups] : 0);
  for (int64_t o = 0; o < groups; ++o) {
    for (int32_t e = off[o]; e < off[o + 1]; ++e) rows[e] = static_cast<int32_t>(o);
  }
  return rows;
}

std::vector<int32_t> grouping(const mx::array& keys, int64_t groups, bool offsets) {
  std::vector<int32_t> off, ids;
  kernels::group_by(idx(keys), keys.size(), groups, off, ids);
  return offsets ? off : ids;
}

// The relation's buffers, with absent input / kernel groupings rebuilt.
gpu::Relation relation_buffers(Operands& ops, const RelationArrays& r, int64_t n_in,
                               int64_t n_kernels) {
  gpu::Relation rel{ops.index(r.in_rows),     ops.index(r.out_rows),    ops.index(r.kernel_ids),
                    ops.index(r.out_offsets), ops.index(r.in_offsets),  ops.index(r.in_edge_ids),
                    ops.index(r.k_offsets),   ops.index(r.k_edge_ids)};
  if (r.in_offsets.size() == 0) {
    rel.in_offsets = ops.made(grouping(r.in_rows, n_in, true));
    rel.in_edge_ids = ops.made(grouping(r.in_rows, n_in, false));
  }
  if (r.k_offsets.size() == 0) {
    rel.k_offsets = ops.made(grouping(r.kernel_ids, n_kernels, true));
    rel.k_edge_ids = ops.made(grouping(r.kernel_ids, n_kernels, false));
  }
  return rel;
}

uint32_t u32(int64_t v) { return static_cast<uint32_t>(v); }

using GpuBody = std::function<void(gpu::KernelEncoder&, Operands&, std::vector<mx::array>&,
                                   std::vector<mx::array>&)>;

// Runs a GPU body on the CPU stream through the MSL harness.
void run_on_harness(mx::Stream stream, const std::vector<mx::array>& inputs,
                    std::vector<mx::array>& outputs, GpuBody body) {
  dispatch(stream, inputs, outputs,
           [body](std::vector<mx::array>& in, std::vector<mx::array>& out) {
             auto enc = gpu::harness_encoder();
             Operands ops(true);
             body(*enc, ops, in, out);
             ops.finish();
           });
}


GpuBody conv_body(SparseConv::Mode mode, ConvDims d) {
  return [mode, d](gpu::KernelEncoder& enc, Operands& ops, std::vector<mx::array>& in,
                   std::vector<mx::array>& out) {
    using M = SparseConv::Mode;
    auto rel = relation_buffers(ops, RelationArrays::from(in, 2), d.n_in, d.n_kernels);
    const bool wgrad = mode == M::kWeightGrad;
    const int64_t cin = wgrad ? in[0].shape(1) : in[1].shape(1);
    const int64_t cout = wgrad ? in[1].shape(1) : in[1].shape(2);
    const auto face = mode == M::kForward     ? gpu::ConvFace::kForward
                      : mode == M::kInputGrad ? gpu::ConvFace::kInputGrad
                                              : gpu::ConvFace::kWeightGrad;
    gpu::encode_conv(enc, face, ops.floats(in[0]), ops.floats(in[1]), rel, ops.output(out[0]),
                     u32(d.n_in), u32(d.n_out), u32(d.n_kernels), u32(cin), u32(cout));
  };
}

GpuBody sorted_body(ConvDims d, bool store_sorted, bool direct) {
  return [d, store_sorted, direct](gpu::KernelEncoder& enc, Operands& ops,
                                   std::vector<mx::array>& in, std::vector<mx::array>& out) {
    gpu::Buffer masks;
    if (direct) {
      masks = ops.index(in[4]);
    } else {
      // Tile masks from the map (the validated masks are supersets of these).
      const int32_t* map = idx(in[2]);
      std::vector<int32_t> m((d.n_out + kernels::kSortedTileRows - 1) / kernels::kSortedTileRows, 0);
      for (int64_t r = 0; r < d.n_out; ++r) {
        for (int64_t k = 0; k < d.n_kernels; ++k) {
          if (map[r * d.n_kernels + k] >= 0) {
            m[r / kernels::kSortedTileRows] |= static_cast<int32_t>(1u << k);
          }
        }
      }
      masks = ops.made(std::move(m));
    }
    gpu::encode_sorted_conv(enc, direct, ops.floats(in[0]), ops.floats(in[1]), ops.index(in[2]),
                            ops.index(in[3]), masks, ops.output(out[0]), u32(d.n_out),
                            u32(d.n_kernels), u32(in[1].shape(1)), u32(in[1].shape(2)),
                            store_sorted);
  };
}

GpuBody quantized_body(ConvDims d, QuantSpec q) {
  return [d, q](gpu::KernelEncoder& enc, Operands& ops, std::vector<mx::array>& in,
                std::vector<mx::array>& out) {
    auto rel = relation_buffers(ops, RelationArrays::from(in, 4), d.n_in, d.n_kernels);
    gpu::encode_quantized_conv(enc, ops.floats(in[0]), ops.index(in[1]), ops.floats(in[2]),
                               ops.floats(in[3]), rel, ops.output(out[0]), u32(d.n_out),
                               u32(d.n_kernels), u32(q.in_channels), u32(q.out_channels),
                               u32(in[1].shape(2) * 4), u32(q.storage_in_channels / q.group_size),
                               u32(q.group_size), u32(q.bits));
  };
}

GpuBody denominator_body(SparseDenominator::Mode mode, ConvDims d) {
  return [mode, d](gpu::KernelEncoder& enc, Operands& ops, std::vector<mx::array>& in,
                   std::vector<mx::array>& out) {
    if (mode == SparseDenominator::Mode::kDenominator) {
      gpu::encode_denominator(enc, ops.floats(in[0]), ops.index(in[1]), ops.index(in[2]),
                              ops.output(out[0]), u32(d.n_out), u32(d.n_kernels),
                              u32(in[0].shape(1)), u32(in[0].shape(2)));
    } else {
      gpu::encode_denominator_grad(enc, ops.floats(in[0]), ops.made(rows_of_edges(in[2])),
                                   ops.made(grouping(in[1], d.n_kernels, true)),
                                   ops.made(grouping(in[1], d.n_kernels, false)),
                                   ops.output(out[0]), u32(d.n_kernels), u32(in[0].shape(1)));
    }
  };
}

GpuBody pool_body(SparsePool::Stage stage, kernels::PoolMode mode, ConvDims d) {
  return [stage, mode, d](gpu::KernelEncoder& enc, Operands& ops, std::vector<mx::array>& in,
                          std::vector<mx::array>& out) {
    using S = SparsePool::Stage;
    const size_t n_float = stage == S::kForward ? 1 : 2;
    const auto& in_rows = in[n_float];
    const auto& offsets = in[n_float + 1];
    gpu::Relation rel{ops.index(in_rows),
                      ops.made(rows_of_edges(offsets)),
                      {},
                      ops.index(offsets),
                      ops.made(grouping(in_rows, d.n_in, true)),
                      ops.made(grouping(in_rows, d.n_in, false)),
                      {},
                      {}};
    const auto gstage = stage == S::kForward     ? gpu::PoolStage::kForward
                        : stage == S::kMaxSelect ? gpu::PoolStage::kMaxSelect
                                                 : gpu::PoolStage::kBackward;
    const uint32_t gmode = mode == kernels::PoolMode::kMax ? 0 : mode == kernels::PoolMode::kAvg ? 1 : 2;
    gpu::Buffer second = n_float == 2 ? ops.floats(in[1]) : gpu::Buffer{};
    gpu::encode_pool(enc, gstage, gmode, ops.floats(in[0]), second, rel, ops.output(out[0]),
                     u32(d.n_in), u32(d.n_out), u32(in[0].shape(1)));
  };
}

// The GPU body of any sparse primitive.
GpuBody body_for(const SparsePrimitive& p) {
  if (auto* c = dynamic_cast<const SparseConv*>(&p)) return conv_body(c->mode(), c->dims());
  if (auto* c = dynamic_cast<const SparseConvSorted*>(&p)) {
    return sorted_body(c->dims(), c->store_sorted(), false);
  }
  if (auto* c = dynamic_cast<const SparseConvDirect*>(&p)) {
    return sorted_body(c->dims(), c->store_sorted(), true);
  }
  if (auto* c = dynamic_cast<const SparseQuantizedConv*>(&p)) {
    return quantized_body(c->dims(), c->spec());
  }
  if (auto* c = dynamic_cast<const SparseDenominator*>(&p)) {
    return denominator_body(c->mode(), c->dims());
  }
  if (auto* c = dynamic_cast<const SparsePool*>(&p)) return pool_body(c->stage(), c->mode(), c->dims());
  throw std::logic_error("no GPU body for primitive " + std::string(p.name()));
}

}  // namespace

void SparsePrimitive::eval_gpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
#ifdef MLX_LATTICE_METAL
  // Metal: bind the (float32) arrays and encode on the stream's command encoder.
  for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  auto enc = gpu::metal_encoder(stream());
  Operands ops(false);
  std::vector<mx::array> in = inputs;
  body_for(*this)(*enc, ops, in, outputs);
#else
  throw_no_gpu(name());
#endif
}

bool SparsePrimitive::run_harness_if_enabled(const std::vector<mx::array>& inputs,
                                             std::vector<mx::array>& outputs) {
  if (!gpu::harness_enabled()) return false;
  run_on_harness(stream(), inputs, outputs, body_for(*this));
  return true;
}

// ---------------------------------------------------------------- SparseConv

void SparseConv::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  if (run_harness_if_enabled(inputs, outputs)) return;
  dispatch(stream(), inputs, outputs,
           [mode = mode_, d = dims_](std::vector<mx::array>& in, std::vector<mx::array>& out) {
             const auto& a = in[0];
             const auto& b = in[1];
             auto rel = RelationArrays::from(in, 2);
             FloatIn a32(a, 0), b32(b, 1);
             FloatOut out32(out[0]);
             float* result = out32.get();
             if (mode == Conv::kForward) {
               kernels::Csr csr{idx(rel.out_offsets), nullptr, d.n_out};
               kernels::stationary_conv(a32.get(), a.shape(1), b32.get(), d.n_kernels, result,
                                        b.shape(2), csr, idx(rel.in_rows), idx(rel.out_rows),
                                        idx(rel.kernel_ids));
             } else if (mode == Conv::kInputGrad) {
               const int64_t cin = b.shape(1);
               const int64_t cout = b.shape(2);
               std::vector<float> wt(d.n_kernels * cin * cout);
               const float* w = b32.get();
               for (int64_t k = 0; k < d.n_kernels; ++k) {
                 for (int64_t i = 0; i < cin; ++i) {
                   for (int64_t o = 0; o < cout; ++o) {
                     wt[(k * cout + o) * cin + i] = w[(k * cin + i) * cout + o];
                   }
                 }
               }
               std::vector<int32_t> off, ids;
               auto csr = csr_or_rebuilt(rel.in_offsets, rel.in_edge_ids, rel.in_rows, d.n_in,
                                         off, ids);
               kernels::stationary_conv(a32.get(), cout, wt.data(), d.n_kernels, result, cin, csr,
                                        idx(rel.out_rows), idx(rel.in_rows), idx(rel.kernel_ids));
             } else {
               std::vector<int32_t> off, ids;
               auto csr = csr_or_rebuilt(rel.k_offsets, rel.k_edge_ids, rel.kernel_ids,
                                         d.n_kernels, off, ids);
               kernels::weight_gradient(a32.get(), a.shape(1), b32.get(), b.shape(1), csr,
                                        idx(rel.in_rows), idx(rel.out_rows), result);
             }
             out32.finish();
           });
}

std::vector<mx::array> SparseConv::vjp(const std::vector<mx::array>& primals,
                                       const std::vector<mx::array>& cotangents,
                                       const std::vector<int>& argnums,
                                       const std::vector<mx::array>&) {
  const auto& a = primals[0];
  const auto& b = primals[1];
  const auto& ct = cotangents[0];
  auto rel = RelationArrays::from(primals, 2);
  auto s = stream();
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg > 1) continue;
    switch (mode_) {
      case Conv::kForward:  // (F, W)
        grads.push_back(arg == 0 ? make_conv(Conv::kInputGrad, ct, b, rel, dims_, s)
                                 : make_conv(Conv::kWeightGrad, a, ct, rel, dims_, s));
        break;
      case Conv::kInputGrad:  // (G, W)
        grads.push_back(arg == 0 ? make_conv(Conv::kForward, ct, b, rel, dims_, s)
                                 : make_conv(Conv::kWeightGrad, ct, a, rel, dims_, s));
        break;
      case Conv::kWeightGrad:  // (F, G)
        grads.push_back(arg == 0 ? make_conv(Conv::kInputGrad, b, ct, rel, dims_, s)
                                 : make_conv(Conv::kForward, a, ct, rel, dims_, s));
        break;
    }
  }
  return zero_grads_for_indices(primals, argnums, 2, grads, s);
}

std::vector<mx::array> SparseConv::jvp(const std::vector<mx::array>& primals,
                                       const std::vector<mx::array>& tangents,
                                       const std::vector<int>& argnums) {
  auto rel = RelationArrays::from(primals, 2);
  auto op = [&](const mx::array& a, const mx::array& b) {
    return make_conv(mode_, a, b, rel, dims_, stream());
  };
  return bilinear_jvp(op, primals, tangents, argnums, stream());
}

bool SparseConv::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const SparseConv&>(other);
  return mode_ == o.mode_ && dims_ == o.dims_;
}

// ---------------------------------------------------------- SparseConvSorted

void SparseConvSorted::eval_cpu(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  if (run_harness_if_enabled(inputs, outputs)) return;
  dispatch(stream(), inputs, outputs,
           [d = dims_, store = store_sorted_](std::vector<mx::array>& in,
                                             std::vector<mx::array>& out) {
             const auto& f = in[0];
             const auto& w = in[1];
             FloatIn f32(f, 0), w32(w, 1);
             FloatOut out32(out[0]);
             kernels::sorted_conv(f32.get(), f.shape(1), w32.get(), d.n_kernels, w.shape(2),
                                  idx(in[2]), idx(in[3]), d.n_out, store, out32.get());
             out32.finish();
           });
}

std::vector<mx::array> SparseConvSorted::vjp(const std::vector<mx::array>& primals,
                                             const std::vector<mx::array>& cotangents,
                                             const std::vector<int>& argnums,
                                             const std::vector<mx::array>&) {
  auto s = stream();
  auto rel = RelationArrays::from(primals, 4);
  mx::array ct = cotangents[0];
  if (store_sorted_) {
    // Row r of a sorted result is output row reorder_rows[r].
    ct = mx::take(ct, mx::argsort(primals[3], s), 0, s);
  }
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg == 0) grads.push_back(make_conv(Conv::kInputGrad, ct, primals[1], rel, dims_, s));
    if (arg == 1) grads.push_back(make_conv(Conv::kWeightGrad, primals[0], ct, rel, dims_, s));
  }
  return zero_grads_for_indices(primals, argnums, 2, grads, s);
}

std::vector<mx::array> SparseConvSorted::jvp(const std::vector<mx::array>& primals,
                                             const std::vector<mx::array>& tangents,
                                             const std::vector<int>& argnums) {
  auto rel = RelationArrays::from(primals, 4);
  auto op = [&](const mx::array& f, const mx::array& w) {
    return make_sorted(f, w, primals[2], primals[3], rel, dims_, store_sorted_, stream());
  };
  return bilinear_jvp(op, primals, tangents, argnums, stream());
}

bool SparseConvSorted::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const SparseConvSorted&>(other);
  return dims_ == o.dims_ && store_sorted_ == o.store_sorted_;
}

// ---------------------------------------------------------- SparseConvDirect

void SparseConvDirect::eval_cpu(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  if (run_harness_if_enabled(inputs, outputs)) return;
  dispatch(stream(), inputs, outputs,
           [d = dims_, store = store_sorted_](std::vector<mx::array>& in,
                                             std::vector<mx::array>& out) {
             const auto& f = in[0];
             const auto& w = in[1];
             FloatIn f32(f, 0), w32(w, 1);
             FloatOut out32(out[0]);
             kernels::sorted_direct(f32.get(), f.shape(1), w32.get(), d.n_kernels, w.shape(2),
                                    idx(in[2]), idx(in[3]), idx(in[4]), d.n_out, store,
                                    out32.get());
             out32.finish();
           });
}

std::vector<mx::array> SparseConvDirect::vjp(const std::vector<mx::array>& primals,
                                             const std::vector<mx::array>& cotangents,
                                             const std::vector<int>& argnums,
                                             const std::vector<mx::array>&) {
  // The direct path is a diagnostic: its gradients are plain MLX gathers,
  // matmuls and scatters over the sorted map (validated tile masks never hide
  // a present entry, so they do not enter the gradient).
  auto s = stream();
  const auto& f = primals[0];
  const auto& w = primals[1];
  const auto& map = primals[2];
  const int n = static_cast<int>(dims_.n_out);
  const int k = static_cast<int>(dims_.n_kernels);
  const int cin = w.shape(1);
  const int cout = w.shape(2);
  mx::array ct = cotangents[0];
  if (!store_sorted_) ct = mx::take(ct, primals[3], 0, s);
  auto valid = mx::expand_dims(mx::astype(mx::greater_equal(map, mx::array(0), s), mx::float32, s),
                               2, s);
  auto flat = mx::reshape(mx::maximum(map, mx::array(0), s), {n * k}, s);
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg == 0) {
      auto wt = mx::reshape(mx::transpose(w, {2, 0, 1}, s), {cout, k * cin}, s);
      auto contrib = mx::multiply(mx::reshape(mx::matmul(ct, wt, s), {n, k, cin}, s), valid, s);
      auto index = mx::broadcast_to(mx::reshape(flat, {n * k, 1}, s), {n * k, cin}, s);
      grads.push_back(mx::astype(
          mx::scatter_add_axis(mx::zeros({static_cast<int>(dims_.n_in), cin}, mx::float32, s),
                               index, mx::reshape(contrib, {n * k, cin}, s), 0, s),
          f.dtype(), s));
    } else if (arg == 1) {
      auto gathered = mx::multiply(mx::reshape(mx::take(f, flat, 0, s), {n, k, cin}, s), valid, s);
      grads.push_back(
          mx::astype(mx::matmul(mx::transpose(gathered, {1, 2, 0}, s), ct, s), w.dtype(), s));
    }
  }
  return zero_grads_for_indices(primals, argnums, 2, grads, s);
}

std::vector<mx::array> SparseConvDirect::jvp(const std::vector<mx::array>& primals,
                                             const std::vector<mx::array>& tangents,
                                             const std::vector<int>& argnums) {
  auto op = [&](const mx::array& f, const mx::array& w) {
    return make_direct(f, w, primals[2], primals[3], primals[4], dims_, store_sorted_, stream());
  };
  return bilinear_jvp(op, primals, tangents, argnums, stream());
}

bool SparseConvDirect::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const SparseConvDirect&>(other);
  return dims_ == o.dims_ && store_sorted_ == o.store_sorted_;
}

// ------------------------------------------------------- SparseQuantizedConv

void SparseQuantizedConv::eval_cpu(const std::vector<mx::array>& inputs,
                                   std::vector<mx::array>& outputs) {
  if (run_harness_if_enabled(inputs, outputs)) return;
  dispatch(stream(), inputs, outputs,
           [d = dims_, q = spec_](std::vector<mx::array>& in, std::vector<mx::array>& out) {
             const auto& f = in[0];
             const auto& packed = in[1];
             auto rel = RelationArrays::from(in, 4);
             std::vector<float> w(d.n_kernels * q.in_channels * q.out_channels);
             kernels::dequantize_weight(
                 packed.size() ? packed.data<uint8_t>() : nullptr,
                 static_cast<int64_t>(packed.shape(2)) * 4, in[2].data<float>(),
                 in[3].data<float>(), d.n_kernels, q.out_channels, q.in_channels,
                 q.storage_in_channels, q.group_size, q.bits, w.data());
             kernels::Csr csr{idx(rel.out_offsets), nullptr, d.n_out};
             FloatIn f32(f, 0);
             FloatOut out32(out[0]);
             kernels::stationary_conv(f32.get(), q.in_channels, w.data(), d.n_kernels,
                                      out32.get(), q.out_channels, csr, idx(rel.in_rows),
                                      idx(rel.out_rows), idx(rel.kernel_ids));
             out32.finish();
           });
}

std::vector<mx::array> SparseQuantizedConv::vjp(const std::vector<mx::array>& primals,
                                                const std::vector<mx::array>& cotangents,
                                                const std::vector<int>& argnums,
                                                const std::vector<mx::array>&) {
  auto s = stream();
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg == 0) {
      auto w = mx::dequantize(primals[1], primals[2], primals[3], spec_.group_size, spec_.bits,
                              "affine", std::nullopt, mx::float32, s);
      w = mx::slice(w, {0, 0, 0},
                    {static_cast<int>(dims_.n_kernels), static_cast<int>(spec_.out_channels),
                     static_cast<int>(spec_.in_channels)},
                    s);
      grads.push_back(make_conv(Conv::kInputGrad, cotangents[0], mx::transpose(w, {0, 2, 1}, s),
                                RelationArrays::from(primals, 4), dims_, s));
    } else if (arg <= 3) {
      throw std::invalid_argument(
          "sparse_quantized_conv_features: gradients with respect to the quantized weight, "
          "scales or biases are not supported; differentiate with respect to the features.");
    }
  }
  return zero_grads_for_indices(primals, argnums, 4, grads, s);
}

std::vector<mx::array> SparseQuantizedConv::jvp(const std::vector<mx::array>& primals,
                                                const std::vector<mx::array>& tangents,
                                                const std::vector<int>& argnums) {
  auto tf = tangent_of(0, tangents, argnums);
  for (int arg : argnums) {
    if (arg >= 1 && arg <= 3) {
      throw std::invalid_argument(
          "sparse_quantized_conv_features: tangents of the quantized weight, scales or biases "
          "are not supported.");
    }
  }
  auto rel = RelationArrays::from(primals, 4);
  std::vector<mx::array> quant = {primals[1], primals[2], primals[3]};
  auto out = make_quantized(tf ? *tf : primals[0], quant, rel, dims_, spec_, stream());
  return {tf ? out : mx::zeros_like(out)};
}

bool SparseQuantizedConv::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const SparseQuantizedConv&>(other);
  return dims_ == o.dims_ && spec_ == o.spec_;
}

// --------------------------------------------------------- SparseDenominator

void SparseDenominator::eval_cpu(const std::vector<mx::array>& inputs,
                                 std::vector<mx::array>& outputs) {
  if (run_harness_if_enabled(inputs, outputs)) return;
  dispatch(stream(), inputs, outputs,
           [mode = mode_, d = dims_](std::vector<mx::array>& in, std::vector<mx::array>& out) {
             const auto& x = in[0];
             FloatIn x32(x, 0);
             FloatOut out32(out[0]);
             if (mode == Mode::kDenominator) {
               kernels::normalization_denominator(x32.get(), d.n_kernels, x.shape(1), x.shape(2),
                                                  idx(in[1]), idx(in[2]), d.n_out, out32.get());
             } else {
               kernels::denominator_gradient(x32.get(), x.shape(1), idx(in[1]), idx(in[2]),
                                             d.n_out, d.n_kernels, out32.get());
             }
             out32.finish();
           });
}

std::vector<mx::array> SparseDenominator::vjp(const std::vector<mx::array>& primals,
                                              const std::vector<mx::array>& cotangents,
                                              const std::vector<int>& argnums,
                                              const std::vector<mx::array>&) {
  auto s = stream();
  const auto& ct = cotangents[0];
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg != 0) continue;
    if (mode_ == Mode::kDenominator) {
      // d/dW[k, c, n] = sum over edges of k of ct[out_e, n], for every c.
      auto per_kernel =
          make_denominator(Mode::kGradient, ct, primals[1], primals[2], dims_, s);
      auto shape = primals[0].shape();
      grads.push_back(mx::broadcast_to(
          mx::expand_dims(per_kernel, 1, s), shape, s));
    } else {
      grads.push_back(make_denominator(Mode::kDenominator, mx::expand_dims(ct, 1, s), primals[1],
                                       primals[2], dims_, s));
    }
  }
  return zero_grads_for_indices(primals, argnums, 1, grads, s);
}

std::vector<mx::array> SparseDenominator::jvp(const std::vector<mx::array>& primals,
                                              const std::vector<mx::array>& tangents,
                                              const std::vector<int>& argnums) {
  auto t = tangent_of(0, tangents, argnums);
  auto out = make_denominator(mode_, t ? *t : primals[0], primals[1], primals[2], dims_, stream());
  return {t ? out : mx::zeros_like(out)};
}

bool SparseDenominator::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const SparseDenominator&>(other);
  return mode_ == o.mode_ && dims_ == o.dims_;
}

// ---------------------------------------------------------------- SparsePool

void SparsePool::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  if (run_harness_if_enabled(inputs, outputs)) return;
  dispatch(stream(), inputs, outputs,
           [stage = stage_, mode = mode_, d = dims_](std::vector<mx::array>& in,
                                                    std::vector<mx::array>& out) {
             const size_t n_float = stage == Stage::kForward ? 1 : 2;
             const int32_t* in_rows = idx(in[n_float]);
             const int32_t* offsets = idx(in[n_float + 1]);
             const int64_t channels = in[0].shape(1);
             FloatIn x0(in[0], 0);
             FloatOut out32(out[0]);
             float* result = out32.get();
             if (stage == Stage::kForward) {
               kernels::pool_forward(x0.get(), channels, in_rows, offsets, d.n_out, mode, result);
             } else {
               FloatIn x1(in[1], 1);
               if (stage == Stage::kMaxSelect) {
                 kernels::pool_max_select(x0.get(), x1.get(), channels, in_rows, offsets, d.n_out,
                                          result);
               } else {
                 kernels::pool_backward(x0.get(), x1.get(), channels, in_rows, offsets, d.n_out,
                                        d.n_in, mode, result);
               }
             }
             out32.finish();
           });
}

std::vector<mx::array> SparsePool::vjp(const std::vector<mx::array>& primals,
                                       const std::vector<mx::array>& cotangents,
                                       const std::vector<int>& argnums,
                                       const std::vector<mx::array>&) {
  auto s = stream();
  using kernels::PoolMode;
  const size_t n_float = stage_ == Stage::kForward ? 1 : 2;
  const auto& in_rows = primals[n_float];
  const auto& offsets = primals[n_float + 1];
  const auto& ct = cotangents[0];
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (static_cast<size_t>(arg) >= n_float) continue;
    if (stage_ == Stage::kForward) {
      grads.push_back(
          make_pool(Stage::kBackward, mode_, {ct, primals[0]}, in_rows, offsets, dims_, s));
    } else if (stage_ == Stage::kMaxSelect) {
      grads.push_back(arg == 0 ? mx::zeros_like(primals[0], s)
                               : make_pool(Stage::kBackward, PoolMode::kMax, {ct, primals[0]},
                                           in_rows, offsets, dims_, s));
    } else if (arg == 1) {
      grads.push_back(mx::zeros_like(primals[1], s));
    } else if (mode_ == PoolMode::kMax) {
      grads.push_back(
          make_pool(Stage::kMaxSelect, mode_, {primals[1], ct}, in_rows, offsets, dims_, s));
    } else {
      grads.push_back(make_pool(Stage::kForward, mode_, {ct}, in_rows, offsets, dims_, s));
    }
  }
  return zero_grads_for_indices(primals, argnums, n_float, grads, s);
}

std::vector<mx::array> SparsePool::jvp(const std::vector<mx::array>& primals,
                                       const std::vector<mx::array>& tangents,
                                       const std::vector<int>& argnums) {
  auto s = stream();
  using kernels::PoolMode;
  const size_t n_float = stage_ == Stage::kForward ? 1 : 2;
  const auto& in_rows = primals[n_float];
  const auto& offsets = primals[n_float + 1];
  std::optional<mx::array> out;
  if (stage_ == Stage::kForward) {
    if (auto t = tangent_of(0, tangents, argnums)) {
      out = mode_ == PoolMode::kMax
                ? make_pool(Stage::kMaxSelect, mode_, {primals[0], *t}, in_rows, offsets, dims_, s)
                : make_pool(Stage::kForward, mode_, {*t}, in_rows, offsets, dims_, s);
    }
  } else if (stage_ == Stage::kMaxSelect) {
    if (auto t = tangent_of(1, tangents, argnums)) {
      out = make_pool(Stage::kMaxSelect, mode_, {primals[0], *t}, in_rows, offsets, dims_, s);
    }
  } else if (auto t = tangent_of(0, tangents, argnums)) {
    out = make_pool(Stage::kBackward, mode_, {*t, primals[1]}, in_rows, offsets, dims_, s);
  }
  if (!out) {
    std::vector<mx::array> floats(primals.begin(), primals.begin() + n_float);
    return {mx::zeros_like(make_pool(stage_, mode_, floats, in_rows, offsets, dims_, s), s)};
  }
  return {*out};
}

bool SparsePool::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const SparsePool&>(other);
  return stage_ == o.stage_ && mode_ == o.mode_ && dims_ == o.dims_;
}

}  // namespace mlx_lattice
