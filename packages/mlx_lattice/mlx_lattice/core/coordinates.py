"""Integer coordinate sets: ``(N, 4)`` int32 rows of (batch, x, y, z)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_lattice._errors import MlxLatticeError, MlxLatticeTypeError
from mlx_lattice._native import ext

__all__ = ["as_coordinates", "check_coordinates"]


def as_coordinates(coords: mx.array | np.ndarray, name: str = "coords") -> mx.array:
    """Return ``coords`` as an ``(N, 4)`` int32 ``mx.array``, checked.

    Integer NumPy or MLX arrays are accepted (values must fit int32); floats
    are refused so no coordinate is silently rounded.

    >>> as_coordinates(np.array([[0, 1, 2, 3]])).dtype
    mlx.core.int32
    """
    if isinstance(coords, np.ndarray):
        if not np.issubdtype(coords.dtype, np.integer):
            raise MlxLatticeTypeError(f"{name} must hold integers, got dtype {coords.dtype}.")
        if coords.size and (
            coords.min() < np.iinfo(np.int32).min or coords.max() > np.iinfo(np.int32).max
        ):
            raise MlxLatticeError(f"{name} has values outside the int32 range.")
        coords = mx.array(coords.astype(np.int32))
    elif not isinstance(coords, mx.array):
        raise MlxLatticeTypeError(f"{name} must be an mx.array or np.ndarray, got {type(coords).__name__}.")
    if coords.dtype != mx.int32:
        if not mx.issubdtype(coords.dtype, mx.integer):
            raise MlxLatticeTypeError(f"{name} must hold integers, got dtype {coords.dtype}.")
        coords = coords.astype(mx.int32)
    if coords.ndim != 2 or coords.shape[1] != 4:
        raise MlxLatticeError(
            f"{name} must be (N, 4) = (batch, x, y, z), got shape {tuple(coords.shape)}."
        )
    return coords


def check_coordinates(coords: mx.array | np.ndarray, name: str = "coords") -> mx.array:
    """Validate a coordinate set and return it as int32.

    Duplicates are rejected with both rows named; negative and large values
    are fine (hashing compares full coordinates, so collisions are harmless).

    >>> check_coordinates(np.array([[0, 1, 2, 3], [0, 1, 2, 3]]))
    Traceback (most recent call last):
    ...
    mlx_lattice._errors.MlxLatticeError: build_kernel_relation: coords has duplicate coordinate (0, 1, 2, 3) at rows 0 and 1.
    """
    coords = as_coordinates(coords, name)
    ext.check_coordinates(coords, name)
    return coords
