"""Built-in coordinate sets the benchmarks share."""

from __future__ import annotations

import numpy as np

__all__ = ["range_scan_coords", "surface_coords"]


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


def range_scan_coords(width: int = 640, height: int = 480, voxel: float = 0.033) -> np.ndarray:
    """A range-camera case: one depth image (``width`` x ``height`` pixels,
    90 x 70 degrees) of a room 8 m deep and 6 m wide seen from 1.2 m above
    its floor, with a box and a sphere in front of the back wall,
    back-projected and voxelized at ``voxel`` metres (78,702 voxels at the
    defaults). Unlike a LiDAR scan, the near floor and walls are dense,
    whole surfaces: many voxels have most of their 26 neighbours. Rows in
    (x, y, z) order, int32 ``(batch, x, y, z)``.

    >>> range_scan_coords(32, 24, 0.1).shape[1]
    4
    """
    u = np.tan(np.radians(45)) * np.linspace(-1, 1, width)
    v = np.tan(np.radians(35)) * np.linspace(-1, 1, height)
    dy, dz = (a.ravel() for a in np.meshgrid(u, v))
    rays = np.stack([np.ones_like(dy), dy, dz], 1)  # the camera looks along +x
    t = np.full(len(rays), np.inf)

    def plane(axis: int, at: float) -> None:
        with np.errstate(divide="ignore"):
            hit = at / rays[:, axis]
        t[:] = np.where((hit > 0) & (hit < t), hit, t)

    for axis, at in ((0, 8.0), (1, -3.0), (1, 3.0), (2, -1.2), (2, 1.8)):
        plane(axis, at)
    # A box (x 4-5, y -1.5 to -0.5, floor to 0.3 m) by its faces that face
    # the camera, and a sphere of radius 0.6 at (5, 1.2, -0.6).
    for axis, at, span in ((0, 4.0, ((1, -1.5, -0.5), (2, -1.2, -0.3))),
                           (2, -0.3, ((0, 4.0, 5.0), (1, -1.5, -0.5)))):
        with np.errstate(divide="ignore"):
            hit = at / rays[:, axis]
        p = rays * hit[:, None]
        inside = (hit > 0) & (hit < t)
        for a, lo, hi in span:
            inside &= (p[:, a] >= lo) & (p[:, a] <= hi)
        t[:] = np.where(inside, hit, t)
    centre, radius = np.array([5.0, 1.2, -0.6]), 0.6
    dots = rays @ centre
    lengths = np.einsum("ij,ij->i", rays, rays)
    disc = dots**2 - lengths * (centre @ centre - radius**2)
    with np.errstate(invalid="ignore"):
        hit = (dots - np.sqrt(disc)) / lengths
    t[:] = np.where((disc >= 0) & (hit > 0) & (hit < t), hit, t)
    pts = rays[np.isfinite(t)] * t[np.isfinite(t), None]
    vox = np.unique(np.floor(pts / voxel).astype(np.int64), axis=0)
    return np.concatenate([np.zeros((len(vox), 1), np.int64), vox], 1).astype(np.int32)
