// Test-only stand-in for MLX's umbrella header: the encoder interface
// (csrc/metal/encoder.h) only names mx::array and mx::Stream, so the harness
// test can build without linking libmlx.
#pragma once

namespace mlx::core {
class array;
struct Stream;
}  // namespace mlx::core
