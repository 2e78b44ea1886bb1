// The product extension module mlx_lattice._native.ext.
#include "bindings.h"

namespace mlx_lattice {
// The activation arena (arena_bindings.cpp), bound by the product module only.
void bind_arena(nanobind::module_& m);
// concat_rows (concat_rows.cpp).
void bind_concat_rows(nanobind::module_& m);
}  // namespace mlx_lattice

NB_MODULE(ext, m) {
  m.doc() = "Native MLX primitives of mlx_lattice (import mlx.core first).";
  mlx_lattice::bind_ops(m);
  mlx_lattice::bind_entropy(m);
  mlx_lattice::bind_arena(m);
  mlx_lattice::bind_concat_rows(m);
}
