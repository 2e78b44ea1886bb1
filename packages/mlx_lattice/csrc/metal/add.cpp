// GPU encode body of FeatureAdd (kernels in add.metal): operands bound in
// their own dtype, one thread per element.
#include <cstdint>
#include "../cpu/input_error.h"
#include <stdexcept>
#include <string>

#include "encode.h"

namespace mlx_lattice::gpu {

// in = {a, b}; out = a + b.
void encode(const FeatureAdd&, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out) {
  const size_t n = out.size();
  if (n == 0) return;
  if (n > UINT32_MAX - 255) {
    throw ::mlx_lattice::InputError("feature_add: at most 2^32 - 256 elements on a GPU stream.");
  }
  const auto dtype = out.dtype();
  enc.kernel(std::string("mlxl_add") + (dtype == mx::float16    ? "_f16"
                                        : dtype == mx::bfloat16 ? "_bf16"
                                                                : "_f32"));
  enc.input(0, ops.index(in[0]));
  enc.input(1, ops.index(in[1]));
  enc.output(2, ops.index(out));
  const uint32_t count = u32(n);
  enc.value(3, count);
  enc.dispatch({(count + 255) / 256, 1, 1}, {256, 1, 1});
}

}  // namespace mlx_lattice::gpu
