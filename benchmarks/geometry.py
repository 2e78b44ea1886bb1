"""Benchmark: mlx_lattice.geometry on the built-in LiDAR scan (one run, ratios).

The scan's ~135k points at 5 cm voxels (~100k voxels):

* quantize_points (voxels + point->voxel map) against NumPy's
  ``np.unique(..., axis=0, return_inverse=True)`` on the floored points, and
  with a mean voxelize of 4 channels against the same plus ``np.add.at``;
* devoxelize (linear, 64 channels): forward, backward (vjp) and their ratio;
* kNN (k = 16) and radius search over the voxel centres against SciPy's
  ``cKDTree`` (tree build included, as ours builds its grid per call) with
  the same number of threads (``workers=`` / ``set_num_threads``). The two
  sides alternate call by call (7 pairs) and the lines give the medians and
  the median of the per-pair ratios, so a change in machine load between
  the sides does not bias the ratio; the process CPU-time ratio is printed
  too;
* union and intersection of two scans' voxels against NumPy (``np.unique``
  on the stacked rows, ``np.intersect1d`` on a row view).

Ratios > 1 mean mlx_lattice is faster.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from scipy.spatial import cKDTree

import mlx_lattice
from benchmarks.host_class import host_class_line
from benchmarks.timing import median_s
from mlx_lattice.coords import intersection_coords, union_coords
from mlx_lattice.data import synthetic_lidar_scan
from mlx_lattice.geometry import (
    devoxelize,
    knn_relation,
    point_voxel_map,
    quantize_points,
    radius_relation,
    voxelize,
)

VOXEL = 0.05


def _row(name: str, ours: float, ref: float, ref_name: str) -> None:
    print(
        f"{name:<40} {ours * 1e3:9.2f} ms   {ref_name:<28} {ref * 1e3:9.2f} ms   ratio {ref / ours:6.2f}x"
    )


def _paired(
    name: str,
    ours: Callable[[], object],
    ref: Callable[[], object],
    ref_name: str,
    pairs: int = 7,
) -> None:
    """Alternates ours / ref call by call; prints the medians, the median of
    the per-pair wall-clock ratios and the ratio of total CPU time."""
    ours()
    ref()
    walls: list[tuple[float, float]] = []
    cpu = [0.0, 0.0]
    for _ in range(pairs):
        pair = []
        for side, fn in enumerate((ours, ref)):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            pair.append(time.perf_counter() - w0)
            cpu[side] += time.process_time() - c0
        walls.append((pair[0], pair[1]))
    t_ours = statistics.median(w[0] for w in walls)
    t_ref = statistics.median(w[1] for w in walls)
    ratio = statistics.median(w[1] / w[0] for w in walls)
    print(
        f"{name:<40} {t_ours * 1e3:9.2f} ms   {ref_name:<28} {t_ref * 1e3:9.2f} ms   "
        f"ratio {ratio:6.2f}x (paired median; CPU time {cpu[1] / cpu[0]:.2f}x)"
    )


def _numpy_unique(points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keys = np.floor(points.astype(np.float64) / VOXEL).astype(np.int32)
    keys = np.concatenate([np.zeros((len(keys), 1), np.int32), keys], axis=1)
    coords, inverse = np.unique(keys, axis=0, return_inverse=True)
    return coords, inverse.reshape(-1)


def _numpy_voxelize(points: np.ndarray, feats: np.ndarray) -> np.ndarray:
    coords, inverse = _numpy_unique(points)
    out = np.zeros((len(coords), feats.shape[1]), np.float32)
    np.add.at(out, inverse, feats)
    return out / np.bincount(inverse, minlength=len(coords))[:, None]


def main() -> None:
    print(host_class_line())
    rng = np.random.default_rng(0)
    pts = synthetic_lidar_scan(seed=0).points
    pts64 = pts.astype(np.float64)
    threads = mlx_lattice.get_num_threads()
    print(f"points {len(pts)}, voxel {VOXEL} m, threads {threads}")

    # points -> voxels
    t_q = median_s(lambda: quantize_points(pts64, VOXEL))
    t_np = median_s(lambda: _numpy_unique(pts64))
    vox = quantize_points(pts64, VOXEL)
    coords_np, inv_np = _numpy_unique(pts64)
    assert np.array_equal(np.array(vox.coords), coords_np)
    assert np.array_equal(np.array(vox.point_to_voxel), inv_np)
    print(f"voxels {vox.num_voxels}")
    _row("quantize_points (voxels + map)", t_q, t_np, "np.unique(return_inverse)")
    feats4 = rng.standard_normal((len(pts), 4)).astype(np.float32)
    f4 = mx.array(feats4)
    t_qv = median_s(lambda: mx.eval(voxelize(f4, quantize_points(pts64, VOXEL), "mean")))
    t_npv = median_s(lambda: _numpy_voxelize(pts64, feats4))
    _row("quantize + voxelize mean (C=4)", t_qv, t_npv, "np.unique + np.add.at")

    # voxels -> points
    t_pvm = median_s(lambda: point_voxel_map(pts64, vox.coords, VOXEL))
    pvm = point_voxel_map(pts64, vox.coords, VOXEL)
    vf = mx.array(rng.standard_normal((vox.num_voxels, 64)).astype(np.float32))
    cot = mx.array(rng.standard_normal((len(pts), 64)).astype(np.float32))
    mx.eval(vf, cot)
    t_fwd = median_s(lambda: mx.eval(devoxelize(vf, pvm)))
    t_bwd = median_s(lambda: mx.eval(mx.vjp(lambda v: devoxelize(v, pvm), [vf], [cot])[1]))
    print(f"{'point_voxel_map build':<40} {t_pvm * 1e3:9.2f} ms")
    print(
        f"{'devoxelize linear C=64':<40} forward {t_fwd * 1e3:.2f} ms, backward {t_bwd * 1e3:.2f} ms,"
        f" backward/forward {t_bwd / t_fwd:.2f} (target <= 2)"
    )

    # neighbours over the voxel centres
    centres = (np.array(vox.coords)[:, 1:] + 0.5) * VOXEL
    k = 16
    print(
        f"neighbours: the same {len(centres)} voxel centres as queries and support on both"
        f" sides; per call ours builds its grid and the full relation (CSRs included),"
        f" cKDTree (default options) builds its tree and queries with workers={threads}"
    )
    _paired(
        f"knn_relation k={k}",
        lambda: knn_relation(centres, centres, k),
        lambda: cKDTree(centres).query(centres, k=k, workers=threads),
        f"cKDTree query workers={threads}",
    )
    r = 2.5 * VOXEL
    _paired(
        f"radius_relation r={r:.3f}",
        lambda: radius_relation(centres, centres, r),
        lambda: cKDTree(centres).query_ball_point(
            centres, r, workers=threads, return_sorted=True
        ),
        f"cKDTree ball workers={threads}",
    )

    # coordinate sets
    a = vox.coords
    b = quantize_points(synthetic_lidar_scan(seed=1).points.astype(np.float64), VOXEL).coords
    an, bn = np.array(a), np.array(b)
    mx.eval(a, b)

    def np_union() -> np.ndarray:
        return np.unique(np.concatenate([an, bn]), axis=0)

    def np_intersection() -> np.ndarray:
        view = np.dtype((np.void, 16))
        return np.intersect1d(
            np.ascontiguousarray(an).view(view), np.ascontiguousarray(bn).view(view)
        )

    _row(
        "union_coords (two scans)",
        median_s(lambda: union_coords(a, b)),
        median_s(np_union),
        "np.unique(concat)",
    )
    _row(
        "intersection_coords (two scans)",
        median_s(lambda: intersection_coords(a, b)),
        median_s(np_intersection),
        "np.intersect1d(row view)",
    )


if __name__ == "__main__":
    main()
