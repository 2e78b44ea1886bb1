"""The native extension `ext` (C++ MLX primitives bound with nanobind).

`mlx.core` is imported first: it loads `libmlx` and registers the array type
that the extension's functions accept. The kernels' environment variables
(``MLX_LATTICE_GEMM_ISA``, ``MLX_LATTICE_NUM_THREADS``,
``MLX_LATTICE_GEMM_SPLAT``, ``MLX_LATTICE_WEIGHT_CACHE_MB``) are checked here,
once: a value the kernels could not use raises
:class:`~mlx_lattice.MlxLatticeError` naming the variable, instead of being
ignored at the first kernel call.
"""

import mlx.core  # noqa: F401  (must precede the extension)

from mlx_lattice._native import ext

ext.check_environment()

__all__ = ["ext"]
