// GPU encode bodies of BatchNormTrain, BatchNormTrainGrad and BatchNormEval
// (kernels in norm.metal). Features are bound in their own dtype (float32, float16 or
// bfloat16; the kernels convert), the statistics and parameters as float32.
#include "encode.h"

namespace mlx_lattice::gpu {

namespace {

NormFormat norm_format(mx::Dtype dtype) {
  return dtype == mx::float16 ? NormFormat::kF16
         : dtype == mx::bfloat16 ? NormFormat::kBF16
                                 : NormFormat::kF32;
}

}  // namespace

// in = {x, weight, bias}; out = {y, mean, var}.
void encode(const BatchNormTrain& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  const auto& x = in[0];
  encode_batch_norm(enc, norm_format(x.dtype()), ops.index(x), ops.index(in[1]),
                    ops.index(in[2]), ops.index(out[0]), ops.index(out[1]), ops.index(out[2]),
                    u32(x.shape(0)), u32(x.shape(1)), p.eps(), p.relu());
}

// in = {g, x, y, weight, mean, var}; out = {dx, dweight, dbias}.
void encode(const BatchNormTrainGrad& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  const auto& x = in[1];
  encode_batch_norm_grad(enc, norm_format(x.dtype()), ops.index(in[0]), ops.index(x),
                         ops.index(in[2]), ops.index(in[3]), ops.index(in[4]), ops.index(in[5]),
                         ops.index(out[0]), ops.index(out[1]), ops.index(out[2]),
                         u32(x.shape(0)), u32(x.shape(1)), p.eps(), p.relu());
}

// in = {x, mean, scale, bias}; out = y.
void encode(const BatchNormEval& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out) {
  const auto& x = in[0];
  if (x.size() == 0) return;
  encode_batch_norm_eval(enc, norm_format(x.dtype()), ops.index(x), ops.index(in[1]),
                         ops.index(in[2]), ops.index(in[3]), ops.index(out), u32(x.shape(0)),
                         u32(x.shape(1)), p.relu());
}

}  // namespace mlx_lattice::gpu
