// The small encoder interface every GPU encode plan is written against.
//
// Two implementations: the Metal encoder (macOS, metal_encoder.cpp: MLX's
// command encoder, kernels compiled at run time from the MSL sources in this
// folder) and, in the test-only harness extension, the harness encoder
// (harness/encoder.cpp: the same MSL sources, preprocessed into C++, run on
// the CPU by tools/msl). A plan binds buffers
// and bytes and dispatches threadgroups; it never knows which one it drives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "mlx/mlx.h"

namespace mlx_lattice::gpu {

namespace mx = mlx::core;

struct Size3 {
  uint32_t x = 1, y = 1, z = 1;
};

// A buffer argument: the array (for Metal) and its host data (for the
// harness; on Apple silicon the same unified memory).
struct Buffer {
  const mx::array* array = nullptr;
  const void* host = nullptr;
  size_t bytes = 0;  // for host-only buffers (the Metal encoder uploads them)
};

class KernelEncoder {
 public:
  virtual ~KernelEncoder() = default;
  // Selects a kernel by name (library lookup and pipeline on Metal).
  virtual void kernel(const std::string& name) = 0;
  virtual void input(int index, Buffer buffer) = 0;
  virtual void output(int index, Buffer buffer) = 0;
  virtual void bytes(int index, const void* data, size_t size) = 0;
  virtual void threadgroup_memory(int index, size_t size) = 0;
  virtual void dispatch(Size3 groups, Size3 group_size) = 0;
  // A device buffer of `bytes` for intermediate results between dispatches,
  // alive until the encoded work has run (contents undefined until written).
  virtual Buffer scratch(size_t bytes) = 0;

  template <typename T>
  void value(int index, const T& v) {
    bytes(index, &v, sizeof(T));
  }
};

// Encodes on the stream's Metal command encoder (macOS builds
// only; kernels compiled at run time from the MSL sources).
std::unique_ptr<KernelEncoder> metal_encoder(mx::Stream stream);

}  // namespace mlx_lattice::gpu
