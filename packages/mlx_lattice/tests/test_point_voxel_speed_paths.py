"""The point-voxel map's paths (points that share the previous point's cell
reuse its corner rows; the out-of-range check inside the parallel loop; any
thread count) against a NumPy loop reference and against each other, bit for
bit.

Every random input comes from `seeded` (the repository's seeded generator,
printed on failure, replayed with ``TEST_SEED=<seed>``).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice._native import ext
from mlx_lattice.geometry import GeometryError, devoxelize, point_voxel_map


@pytest.fixture
def seeded(rng: np.random.Generator) -> np.random.Generator:
    return rng


def pvm_ref(points, coords, size, origin, batch):
    """Rows, weights and nearest voxel per point, from the documented formulas."""
    table = {tuple(int(v) for v in c): i for i, c in enumerate(coords)}
    rows = np.full((len(points), 8), -1)
    weights = np.zeros((len(points), 8))
    nearest = np.full(len(points), -1)
    for p, (pt, b) in enumerate(zip(points.astype(np.float64), batch, strict=True)):
        u = [(pt[a] - origin[a]) / size[a] - 0.5 for a in range(3)]
        base = [math.floor(x) for x in u]
        t = [u[a] - base[a] for a in range(3)]
        w = np.zeros(8)
        for c in range(8):
            d = ((c >> 2) & 1, (c >> 1) & 1, c & 1)
            r = table.get((int(b), base[0] + d[0], base[1] + d[1], base[2] + d[2]), -1)
            rows[p, c] = r
            wc = 1.0
            for a in range(3):
                wc *= t[a] if d[a] else 1.0 - t[a]
            w[c] = wc if r >= 0 else 0.0
        if w.sum() > 0:
            weights[p] = w / w.sum()
            present = np.flatnonzero(rows[p] >= 0)
            nearest[p] = rows[p, present[np.argmax(w[present])]]
    return rows, weights, nearest


def _scene(rng, n_points, batches, sorted_points):
    """Points in runs along a line (consecutive points share cells) and the
    voxels of most of their cells, shuffled."""
    starts = rng.uniform(-3.0, 3.0, (n_points // 8 + 1, 3))
    pts = (starts[:, None, :] + rng.uniform(-0.05, 0.05, (len(starts), 8, 3))).reshape(-1, 3)
    pts = pts[:n_points]
    if not sorted_points:
        pts = pts[rng.permutation(len(pts))]
    batch = rng.integers(0, batches, len(pts)).astype(np.int32)
    size = rng.uniform(0.3, 0.7, 3)
    origin = rng.uniform(-0.5, 0.5, 3)
    cells = np.floor((pts - origin) / size).astype(np.int64)
    coords = np.unique(np.concatenate([batch[:, None], cells], axis=1), axis=0)
    coords = coords[rng.random(len(coords)) > 0.25]
    coords = coords[rng.permutation(len(coords))].astype(np.int32)
    return pts, batch, size, origin, coords


def _raw(pts, batch, coords, size, origin):
    return ext.geometry_point_voxel_map(
        np.ascontiguousarray(pts, np.float64),
        np.ascontiguousarray(batch, np.int32),
        np.ascontiguousarray(coords, np.int32),
        tuple(float(s) for s in size),
        tuple(float(o) for o in origin),
    )


def _same(a, b):
    for k in ("rows", "weights", "nearest", "voxel_offsets", "voxel_entries"):
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)


def _check_ref(raw, pts, batch, coords, size, origin):
    rows, weights, nearest = pvm_ref(pts, coords, size, origin, batch)
    np.testing.assert_array_equal(np.array(raw["rows"]), rows)
    np.testing.assert_allclose(np.array(raw["weights"]), weights, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.array(raw["nearest"]), nearest)
    off, ent = np.array(raw["voxel_offsets"]), np.array(raw["voxel_entries"])
    flat = rows.reshape(-1)
    for v in range(len(coords)):
        np.testing.assert_array_equal(ent[off[v] : off[v + 1]], np.flatnonzero(flat == v))


@pytest.mark.parametrize("sorted_points", [True, False])
def test_matches_loop_reference(seeded, sorted_points):
    pts, batch, size, origin, coords = _scene(seeded, 600, 3, sorted_points)
    raw = _raw(pts, batch, coords, size, origin)
    _check_ref(raw, pts, batch, coords, size, origin)


def test_runs_of_shared_cells_match_shuffled_order_bitwise(seeded):
    # In runs (consecutive points share cells, rows are reused) and shuffled
    # (almost no reuse): the same per-point bits.
    pts, batch, size, origin, coords = _scene(seeded, 5000, 2, True)
    order = seeded.permutation(len(pts))
    runs = _raw(pts, batch, coords, size, origin)
    shuffled = _raw(pts[order], batch[order], coords, size, origin)
    for k in ("rows", "weights", "nearest"):
        np.testing.assert_array_equal(np.array(runs[k])[order], np.array(shuffled[k]), err_msg=k)


def test_points_away_from_every_voxel(seeded):
    pts, batch, size, origin, coords = _scene(seeded, 200, 1, True)
    pts = np.concatenate([pts, seeded.uniform(50.0, 60.0, (20, 3))])
    batch = np.concatenate([batch, np.zeros(20, np.int32)])
    raw = _raw(pts, batch, coords, size, origin)
    _check_ref(raw, pts, batch, coords, size, origin)
    assert (np.array(raw["nearest"])[-20:] == -1).all()


def test_empty_coords_and_empty_points(seeded):
    pts, batch, size, origin, _ = _scene(seeded, 50, 1, True)
    raw = _raw(pts, batch, np.zeros((0, 4), np.int32), size, origin)
    assert (np.array(raw["rows"]) == -1).all()
    assert (np.array(raw["weights"]) == 0).all()
    assert np.array(raw["voxel_offsets"]).tolist() == [0]
    coords = np.array([[0, 0, 0, 0]], np.int32)
    raw = _raw(np.zeros((0, 3)), np.zeros(0, np.int32), coords, size, origin)
    assert np.array(raw["rows"]).shape == (0, 8)
    assert np.array(raw["voxel_offsets"]).tolist() == [0, 0]


def test_duplicate_coords_named():
    coords = np.array([[0, 1, 2, 3], [0, 5, 5, 5], [0, 1, 2, 3]], np.int32)
    with pytest.raises(GeometryError, match=r"duplicate coordinate \(0, 1, 2, 3\) at rows 0 and 2"):
        point_voxel_map(np.zeros((1, 3)), coords, 1.0)


def test_lowest_out_of_range_row_is_reported():
    pts = np.zeros((5000, 3))
    pts[4500, 0] = 1e12
    pts[3000, 1] = -1e12
    with pytest.raises(GeometryError, match="points row 3000 is outside the int32"):
        point_voxel_map(pts, np.zeros((1, 4), np.int32), 1.0)


@pytest.mark.parametrize("sorted_points", [True, False])
def test_same_bits_for_any_thread_count(seeded, sorted_points):
    pts, batch, size, origin, coords = _scene(seeded, 20000, 2, sorted_points)
    before = mlx_lattice.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 8):
            mlx_lattice.set_num_threads(threads)
            results.append(_raw(pts, batch, coords, size, origin))
    finally:
        mlx_lattice.set_num_threads(before)
    for r in results[1:]:
        _same(results[0], r)
    vf = mx.array(seeded.standard_normal((len(coords), 5)).astype(np.float32))
    pvm = point_voxel_map(pts, coords, size, origin=origin, batch=batch)
    np.testing.assert_array_equal(np.array(pvm.rows), np.array(results[0]["rows"]))
    out = np.array(devoxelize(vf, pvm))
    rows, weights = np.array(results[0]["rows"]), np.array(results[0]["weights"])
    ref = (np.array(vf)[np.maximum(rows, 0)] * (weights * (rows >= 0))[..., None]).sum(1)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
