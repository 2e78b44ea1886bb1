"""The native extension `ext` (C++ MLX primitives bound with nanobind).

`mlx.core` is imported first: it loads `libmlx` and registers the array type
that the extension's functions accept.
"""

import mlx.core  # noqa: F401  (must precede the extension)

from mlx_lattice._native import ext

__all__ = ["ext"]
