// The GPU side of every primitive: one `encode` per primitive class, written
// against KernelEncoder (encoder.h) and the plans (plans.h). Run by
// metal/eval.cpp on Apple GPUs, and by the test-only harness extension on the
// CPU (harness/eval.cpp).
#pragma once

#include <list>
#include <utility>
#include <vector>

#include "../cpu/float_formats.h"
#include "../primitives.h"
#include "plans.h"

namespace mlx_lattice::gpu {

// The buffers of one GPU evaluation. On the harness (host = true),
// half-precision operands are staged as float32 host memory and outputs
// converted back by finish(); on Metal the (float32) arrays are bound directly.
class Operands {
 public:
  explicit Operands(bool host) : host_(host) {}
  Operands(const Operands&) = delete;
  Operands& operator=(const Operands&) = delete;

  Buffer floats(const mx::array& a);
  Buffer output(mx::array& a);
  Buffer index(const mx::array& a) {
    return {&a, host_ && a.size() ? a.data<void>() : nullptr, a.nbytes()};
  }
  void finish();

 private:
  bool host_;
  std::list<std::vector<float>> staged_;  // list: stable addresses
  std::vector<std::pair<mx::array*, const float*>> pending_;
};

inline uint32_t u32(int64_t v) { return static_cast<uint32_t>(v); }

// The relation's buffers.
Relation relation_buffers(Operands& ops, const mlx_lattice::Relation& r);

void encode(const SparseConv& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out);
void encode(const SparseConvSorted& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out);
void encode(const SparseQuantizedConv& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out);
void encode(const SparseQuantizedConvFused& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out);
void encode(const SparseDenominator& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out);
void encode(const SparsePool& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out);
// Elementwise add (add.cpp).
void encode(const FeatureAdd& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out);

// Geometry (geometry.cpp): several outputs.
void encode(const GeometryVoxelize& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out);
void encode(const GeometryDevoxelize& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out);

void encode(const GeometryKnn& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out);
void encode(const GeometryMorton& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out);
void encode(const GeometryHash& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out);
void encode(const GeometryRadius& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out);

// Batch norm (norm.cpp): training forward and backward (several outputs), eval.
void encode(const BatchNormTrain& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out);
void encode(const BatchNormTrainGrad& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out);
void encode(const BatchNormEval& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out);

}  // namespace mlx_lattice::gpu
