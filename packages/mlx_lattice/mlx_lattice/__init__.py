"""Sparse 3-D convolution on MLX."""

from mlx_lattice._version import __version__

__all__ = ["__version__"]
