// InputError: bad input to an mlx_lattice op (an argument check failed).
// The extension's exception translator (bindings.cpp) turns it into Python's
// mlx_lattice.MlxLatticeError; std::invalid_argument thrown by MLX itself
// stays MLX's ValueError. No MLX include: the kernels library uses it too.
#pragma once

#include <stdexcept>

namespace mlx_lattice {

struct InputError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

}  // namespace mlx_lattice
