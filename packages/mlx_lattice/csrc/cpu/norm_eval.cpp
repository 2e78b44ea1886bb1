// eval_cpu of the batch norm primitives (BatchNormTrain, BatchNormTrainGrad,
// BatchNormEval; graph code in ../norm.cpp) over the kernels of norm.cpp. The test-only
// harness extension evaluates them through their Metal kernels instead.
#include "../primitives.h"
#include "eval.h"
#include "norm.h"

namespace mlx_lattice {

void BatchNormTrain::eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) {
  cpu::dispatch(stream(), inputs, outputs,
                [eps = eps_, relu = relu_](std::vector<array>& in, std::vector<array>& out) {
                  const auto& x = in[0];
                  kernels::batch_norm_forward(x.data<void>(), cpu::format_of(x.dtype()),
                                              x.shape(0), x.shape(1), in[1].data<float>(),
                                              in[2].data<float>(), eps, relu, out[0].data<void>(),
                                              out[1].data<float>(), out[2].data<float>());
                });
}

void BatchNormTrainGrad::eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) {
  cpu::dispatch(stream(), inputs, outputs,
                [eps = eps_, relu = relu_](std::vector<array>& in, std::vector<array>& out) {
                  const auto& x = in[1];
                  kernels::batch_norm_backward(
                      in[0].data<void>(), x.data<void>(), in[2].data<void>(),
                      cpu::format_of(x.dtype()), x.shape(0), x.shape(1), in[3].data<float>(),
                      in[4].data<float>(), in[5].data<float>(), eps, relu, out[0].data<void>(),
                      out[1].data<float>(), out[2].data<float>());
                });
}

void BatchNormEval::eval_cpu(const std::vector<array>& inputs, array& out) {
  cpu::dispatch(stream(), inputs, out, [relu = relu_](std::vector<array>& in, array& y) {
    const auto& x = in[0];
    if (x.size() == 0) return;
    kernels::batch_norm_affine(x.data<void>(), cpu::format_of(x.dtype()), x.shape(0),
                               x.shape(1), in[1].data<float>(), in[2].data<float>(),
                               in[3].data<float>(), relu, y.data<void>());
  });
}

}  // namespace mlx_lattice
