"""Relation building at scale: the native builder against a NumPy sort-based
reference and against the fp32 forward convolution it feeds.

Two built-in cases: the LiDAR scan (about 100k voxels) and a large surface
(a sphere sampled on a 512^3 grid, about 709k voxels, 13.6 edges per
voxel). For each: relation build, the same relation through the coordinate
hash (outputs given), the NumPy reference (sorted keys and ``searchsorted``
per offset) and the C64 fp32 forward on the built relation, measured
interleaved, reported as ratios.
"""

from __future__ import annotations

import os
import statistics

import mlx.core as mx
import numpy as np

from benchmarks.scans import surface_coords
from benchmarks.timing import median_s
from mlx_lattice.core import build_kernel_relation, ops
from mlx_lattice.data import synthetic_lidar_scan, voxelize_points

CHANNELS = 64
ROUNDS = 3


def numpy_relation(coords: np.ndarray) -> int:
    """Submanifold 3x3x3 edges by sorting packed keys and ``searchsorted``."""
    c = coords.astype(np.int64)
    lo = c[:, 1:].min(0) - 1
    span = c[:, 1:].max(0) - lo + 2
    def key(x: np.ndarray) -> np.ndarray:
        xyz = x[:, 1:] - lo
        return ((x[:, 0] * span[0] + xyz[:, 0]) * span[1] + xyz[:, 1]) * span[2] + xyz[:, 2]

    keys = key(c)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    edges = 0
    for dx in (-1, 0, 1):
        for dy in (-1, 0, 1):
            for dz in (-1, 0, 1):
                q = key(c + np.array([0, dx, dy, dz]))
                pos = np.minimum(np.searchsorted(sorted_keys, q), len(keys) - 1)
                hit = sorted_keys[pos] == q
                edges += int(hit.sum())
                _ = order[pos[hit]]
    return edges


def measure(name: str, coords_np: np.ndarray, rng: np.random.Generator) -> None:
    coords = mx.array(coords_np)
    mx.eval(coords)
    rel = build_kernel_relation(coords, kernel_size=3)
    assert numpy_relation(coords_np) == rel.n_edges
    feats = mx.array(rng.standard_normal((rel.n_in, CHANNELS), dtype=np.float32))
    weight = mx.array(rng.standard_normal((27, CHANNELS, CHANNELS), dtype=np.float32) / 40)
    build, hashed, ref, forward = [], [], [], []
    for _ in range(ROUNDS):
        build.append(median_s(lambda: build_kernel_relation(coords, kernel_size=3), repeats=3))
        # The same relation with its outputs given takes the coordinate hash.
        hashed.append(
            median_s(
                lambda: build_kernel_relation(coords, coords, kernel_size=3, kind="forward"),
                repeats=3,
            )
        )
        ref.append(median_s(lambda: numpy_relation(coords_np), repeats=1))
        forward.append(
            median_s(
                lambda: mx.eval(ops.sparse_conv_features_from_relation(feats, weight, rel)),
                repeats=3,
            )
        )
    b, h, r, f = (statistics.median(x) for x in (build, hashed, ref, forward))
    print(
        f"{name}: {rel.n_in} voxels, {rel.n_edges} edges ({rel.n_edges / rel.n_in:.1f}/voxel): "
        f"build {b * 1e3:.0f} ms, NumPy reference {r * 1e3:.0f} ms, fp32 forward C{CHANNELS} "
        f"{f * 1e3:.0f} ms; build/forward {b / f:.2f}, NumPy/build {r / b:.2f}, "
        f"coordinate-hash path/build {h / b:.2f}"
    )


def main() -> None:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average: {load}; threads: {os.environ.get('MLX_LATTICE_NUM_THREADS', 'default')}")
    rng = np.random.default_rng(0)
    scan = synthetic_lidar_scan(seed=0)
    measure("LiDAR scan", voxelize_points(scan.points, 0.05).astype(np.int32), rng)
    measure("large surface (512^3)", surface_coords(), rng)


if __name__ == "__main__":
    main()
