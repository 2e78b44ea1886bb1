"""Built-in coordinate sets the benchmarks share."""

from __future__ import annotations

import numpy as np

__all__ = ["surface_coords"]


def surface_coords(grid: int = 512) -> np.ndarray:
    """A large built-in case: a sphere of radius 0.4 * grid sampled densely
    (Fibonacci points 0.3 voxel apart) and voxelized on a grid^3 grid, rows
    in x-major order (about 709k surface voxels at grid 512), as int32
    ``(batch, x, y, z)`` rows.

    >>> surface_coords(16).shape[1]
    4
    """
    radius = 0.4 * grid
    n = int(4 * np.pi * radius**2 / 0.09)
    i = np.arange(n, dtype=np.float64) + 0.5
    z = 1 - 2 * i / n
    r = np.sqrt(1 - z * z)
    phi = i * np.pi * (3 - np.sqrt(5))
    pts = np.stack([r * np.cos(phi), r * np.sin(phi), z], 1) * radius + grid / 2
    vox = np.floor(pts).astype(np.int64)
    keys = np.unique((vox[:, 0] * grid + vox[:, 1]) * grid + vox[:, 2])
    xyz = np.stack([keys // (grid * grid), keys // grid % grid, keys % grid], 1)
    return np.concatenate([np.zeros((len(xyz), 1), np.int64), xyz], 1).astype(np.int32)
