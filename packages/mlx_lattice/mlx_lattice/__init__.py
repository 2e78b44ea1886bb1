"""Sparse 3-D convolution on MLX.

The engine lives in :mod:`mlx_lattice.core`: coordinates, kernel relations,
quantized weights and the ops layer over native MLX primitives.
"""

from mlx_lattice._threads import get_num_threads, set_num_threads
from mlx_lattice._version import __version__

__all__ = ["__version__", "get_num_threads", "set_num_threads"]
