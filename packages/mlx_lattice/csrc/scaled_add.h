// A minimal MLX primitive, alpha * x + beta * y: the extension's smoke test
// for eval, autodiff and error paths across the nanobind boundary.
#pragma once

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mlx_lattice {

namespace mx = mlx::core;

class ScaledAdd : public mx::Primitive {
 public:
  ScaledAdd(mx::Stream stream, float alpha, float beta)
      : mx::Primitive(stream), alpha_(alpha), beta_(beta) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>& outputs) override;
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>& inputs,
                                                           const std::vector<int>& axes) override;
  const char* name() const override { return "ScaledAdd"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float alpha_;
  float beta_;
};

// alpha * x + beta * y for floating x, y of one shape. Raises
// std::invalid_argument (ValueError in Python) on a shape or dtype mismatch.
mx::array scaled_add(const mx::array& x, const mx::array& y, float alpha, float beta,
                     mx::StreamOrDevice s = {});

}  // namespace mlx_lattice
