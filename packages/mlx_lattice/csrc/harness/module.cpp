// The test-only extension `harness_ext`: the product's bindings over
// primitives whose eval_cpu runs the Metal kernels through the MSL harness
// (harness/eval.cpp), the AMX drivers on the tile model (harness/
// amx_model.cpp), plus diagnostics. Never part of the wheel.
#include <memory>
#include <stdexcept>
#include <string>

#include <nanobind/stl/string.h>

#include "../bindings.h"
#include "../primitives.h"
#include "harness.h"
#include "msl_runtime.h"

namespace nb = nanobind;

NB_MODULE(harness_ext, m) {
  m.doc() = "mlx_lattice's primitives evaluated by their Metal kernels on the CPU (tests only).";
  mlx_lattice::bind_ops(m);
  mlx_lattice::bind_amx_model(m);
  m.def("harness_groups_run", &msl::dispatched_groups,
        "Threadgroups the Metal harness has run in this process.");
  // The product's no_metal.cpp, reached directly: what eval_gpu raises in
  // builds without Metal kernels (MLX's CPU-only build refuses GPU streams
  // before any primitive's eval_gpu could run).
  m.def("no_metal_eval_gpu_error", []() -> std::string {
    namespace mx = mlx::core;
    auto rel = std::make_shared<const mlx_lattice::Relation>(mlx_lattice::Relation{
        mx::array({0}), mx::array({0}), mx::array({0}), mx::array({0, 1}), mx::array({0, 1}),
        mx::array({0}), mx::array({0, 1}), mx::array({0}), 1, 1, 1});
    mlx_lattice::SparseConv prim(mx::default_stream(mx::Device::cpu), rel,
                                 mlx_lattice::SparseConv::Mode::kForward);
    mx::array out({1, 1}, mx::float32, nullptr, {});
    try {
      prim.eval_gpu({mx::ones({1, 1}), mx::ones({1, 1, 1})}, out);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  });
}
