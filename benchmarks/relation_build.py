"""Relation building at scale: the native builder against a NumPy sort-based
reference and against the fp32 forward convolution it feeds.

Two built-in cases: the LiDAR scan (about 100k voxels) and a large surface
(a sphere sampled on a 512^3 grid, about 709k voxels, 13.6 edges per
voxel). For each: relation build, the same relation through the coordinate
hash (outputs given), the NumPy reference (sorted keys and ``searchsorted``
per offset) and the C64 fp32 forward on the built relation, measured
interleaved, reported as ratios. Then the stride-2 (2x2x2) downsampling
relation and its transpose against NumPy sort-based references (the
downsampling reference produces the same arrays, checked; the transposed
one only finds the edges).
"""

from __future__ import annotations

import os
import statistics

import mlx.core as mx
import numpy as np

from benchmarks.host_class import host_class_line
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


def _packed(c: np.ndarray, lo: np.ndarray, span: np.ndarray) -> np.ndarray:
    xyz = c[:, 1:] - lo
    return ((c[:, 0] * span[0] + xyz[:, 0]) * span[1] + xyz[:, 1]) * span[2] + xyz[:, 2]


def numpy_strided(coords: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stride-2, 2x2x2 downsampling by sorting: the outputs (floored inputs,
    unique and ascending), then (in, out, offset) edges grouped by output,
    offsets ascending."""
    c = coords.astype(np.int64)
    floored = np.concatenate([c[:, :1], (c[:, 1:] // 2) * 2], axis=1)
    lo = floored[:, 1:].min(0)
    span = floored[:, 1:].max(0) - lo + 2
    _, first, inverse = np.unique(
        _packed(floored, lo, span), return_index=True, return_inverse=True
    )
    out_rows = inverse.reshape(-1)
    r = c[:, 1:] - floored[:, 1:]
    kid = (r[:, 0] * 2 + r[:, 1]) * 2 + r[:, 2]
    order = np.lexsort((kid, out_rows))
    return floored[first], out_rows[order], kid[order]


def numpy_transposed(coarse: np.ndarray, fine: np.ndarray) -> int:
    """Edges of the transposed 2x2x2 relation (coarse -> fine): each fine
    row's floored coordinate looked up among the coarse rows (``searchsorted``)."""
    c, f = coarse.astype(np.int64), fine.astype(np.int64)
    floored = np.concatenate([f[:, :1], (f[:, 1:] // 2) * 2], axis=1)
    lo = np.minimum(c[:, 1:].min(0), floored[:, 1:].min(0))
    span = np.maximum(c[:, 1:].max(0), floored[:, 1:].max(0)) - lo + 2
    keys = _packed(c, lo, span)
    order = np.argsort(keys, kind="stable")
    q = _packed(floored, lo, span)
    pos = np.minimum(np.searchsorted(keys[order], q), len(keys) - 1)
    hit = keys[order][pos] == q
    _ = order[pos[hit]]
    return int(hit.sum())


def measure_strided(name: str, coords_np: np.ndarray) -> None:
    """The stride-2 downsampling relation and its transpose against NumPy."""
    coords = mx.array(coords_np)
    mx.eval(coords)
    down = build_kernel_relation(coords, kernel_size=2, stride=2, kind="forward")
    out_np, out_rows, kid = numpy_strided(coords_np)
    np.testing.assert_array_equal(np.array(down.out_coords), out_np)
    np.testing.assert_array_equal(np.array(down.edges.out_rows), out_rows)
    np.testing.assert_array_equal(np.array(down.edges.kernel_ids), kid)
    coarse = down.out_coords
    assert numpy_transposed(out_np, coords_np) == down.n_edges
    fwd, up, fwd_ref, up_ref = [], [], [], []
    for _ in range(ROUNDS):
        fwd.append(
            median_s(
                lambda: build_kernel_relation(coords, kernel_size=2, stride=2, kind="forward"),
                repeats=3,
            )
        )
        up.append(
            median_s(
                lambda: build_kernel_relation(coarse, coords, kernel_size=2, kind="target"),
                repeats=3,
            )
        )
        fwd_ref.append(median_s(lambda: numpy_strided(coords_np), repeats=1))
        up_ref.append(median_s(lambda: numpy_transposed(out_np, coords_np), repeats=1))
    f, u, fr, ur = (statistics.median(x) for x in (fwd, up, fwd_ref, up_ref))
    print(
        f"{name}, stride 2 (2x2x2) -> {down.n_out_capacity} voxels: downsampling {f * 1e3:.1f} ms "
        f"(NumPy/ours {fr / f:.2f}), transposed {u * 1e3:.1f} ms (NumPy edges only/ours "
        f"{ur / u:.2f})"
    )


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
    print(host_class_line())
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average: {load}; threads: {os.environ.get('MLX_LATTICE_NUM_THREADS', 'default')}")
    rng = np.random.default_rng(0)
    scan = synthetic_lidar_scan(seed=0)
    measure("LiDAR scan", voxelize_points(scan.points, 0.05).astype(np.int32), rng)
    measure("large surface (512^3)", surface_coords(), rng)
    measure_strided("LiDAR scan", voxelize_points(scan.points, 0.05).astype(np.int32))
    measure_strided("large surface (512^3)", surface_coords())


if __name__ == "__main__":
    main()
