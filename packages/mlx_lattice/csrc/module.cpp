// The product extension module mlx_lattice._native.ext.
#include "bindings.h"

NB_MODULE(ext, m) {
  m.doc() = "Native MLX primitives of mlx_lattice (import mlx.core first).";
  mlx_lattice::bind_ops(m);
  mlx_lattice::bind_entropy(m);
}
