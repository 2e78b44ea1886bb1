"""Points <-> voxels against NumPy loop references and finite differences.

Every random input comes from `seeded`: the repository's seeded generator
(``tools/pytest_main.py``; stable per test, printed on failure, replayed with
``TEST_SEED=<seed>``).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_lattice.coords import (
    CoordinateError,
    contains_coords,
    crop,
    downsample_coords,
    intersection_coords,
    inverse_map,
    lookup_coords,
    morton_codes,
    morton_order,
    morton_sort_coords,
    reindex,
    topk_rows,
    union_coords,
)
from mlx_lattice.data import synthetic_lidar_scan
from mlx_lattice.geometry import (
    GeometryError,
    devoxelize,
    gather_neighbor_features,
    knn_relation,
    point_voxel_map,
    quantize_points,
    radius_relation,
    voxelize,
)
from mlx_lattice.tensor import SparseTensor, SparseTensorError


def _load_refs(name: str):
    """A shared reference module (tests/<name>.py), loaded by path."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


refs = _load_refs("geometry_refs")
pvm_ref = refs.pvm_ref
relation_lists = _load_refs("relation_refs").relation_lists


@pytest.fixture
def seeded(rng: np.random.Generator) -> np.random.Generator:
    return rng


# -- references (plain loops over points, written from the documented formulas) ----------


def quantize_ref(points, size, origin, batch):
    size = np.broadcast_to(np.asarray(size, np.float64), (3,))
    origin = np.zeros(3) if origin is None else np.asarray(origin, np.float64)
    batch = np.zeros(len(points), np.int64) if batch is None else batch
    keys = []
    for p, b in zip(points.astype(np.float64), batch, strict=True):
        keys.append((int(b), *(math.floor((p[a] - origin[a]) / size[a]) for a in range(3))))
    voxels = sorted(set(keys))
    row = {k: i for i, k in enumerate(voxels)}
    p2v = np.array([row[k] for k in keys], np.int64)
    counts = np.bincount(p2v, minlength=len(voxels))
    return np.array(voxels, np.int64).reshape(-1, 4), p2v, counts


def voxelize_ref(feats, p2v, n, reduce):
    out = np.zeros((n, feats.shape[1]))
    for v in range(n):
        rows = feats[p2v == v].astype(np.float64)
        out[v] = {
            "sum": rows.sum(0),
            "mean": rows.mean(0),
            "max": rows.max(0),
            "first": rows[0],
        }[reduce]
    return out


def devoxelize_ref(vf, rows, weights, nearest, mode):
    out = np.zeros((len(rows), vf.shape[1]))
    for p in range(len(rows)):
        if mode == "nearest":
            if nearest[p] >= 0:
                out[p] = vf[nearest[p]]
            continue
        for c in range(8):
            if rows[p, c] >= 0:
                out[p] += weights[p, c] * vf[rows[p, c]].astype(np.float64)
    return out


def random_points(rng, n, batches=1, extent=3.0):
    pts = rng.uniform(-extent, extent, (n, 3))
    return pts, rng.integers(0, batches, n)


# -- quantize_points ------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "batches"), [(0, 1), (1, 1), (200, 1), (500, 3)])
def test_quantize_matches_loop(seeded, n, batches):
    pts, batch = random_points(seeded, n, batches)
    size = seeded.uniform(0.2, 1.0, 3)
    origin = seeded.uniform(-1, 1, 3)
    vox = quantize_points(pts, size, origin=origin, batch=batch)
    coords, p2v, counts = quantize_ref(pts, size, origin, batch)
    np.testing.assert_array_equal(np.array(vox.coords), coords)
    np.testing.assert_array_equal(np.array(vox.point_to_voxel), p2v)
    np.testing.assert_array_equal(np.array(vox.counts), counts)
    off, members = np.array(vox.voxel_offsets), np.array(vox.voxel_points)
    for v in range(len(coords)):
        np.testing.assert_array_equal(members[off[v] : off[v + 1]], np.flatnonzero(p2v == v))


def test_quantize_scalar_size_float32_and_scan():
    scan = synthetic_lidar_scan(seed=0)
    pts = scan.points[::7]
    vox = quantize_points(mx.array(pts), 0.3)
    coords, p2v, _ = quantize_ref(pts, 0.3, None, None)
    np.testing.assert_array_equal(np.array(vox.coords), coords)
    np.testing.assert_array_equal(np.array(vox.point_to_voxel), p2v)


def test_quantize_accepts_mx_half_precision_points(seeded):
    pts = seeded.uniform(-2, 2, (50, 3)).astype(np.float32)
    for dtype in (mx.float16, mx.bfloat16):
        p = mx.array(pts).astype(dtype)
        exact = np.array(p.astype(mx.float32)).astype(np.float64)
        vox = quantize_points(p, 0.5)
        coords, p2v, _ = quantize_ref(exact, 0.5, None, None)
        np.testing.assert_array_equal(np.array(vox.coords), coords)
        np.testing.assert_array_equal(np.array(vox.point_to_voxel), p2v)


def test_quantize_boundaries_are_half_open():
    pts = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5], [-1e-12, 0.0, 0.0]])
    vox = quantize_points(pts, 1.0)
    assert np.array(vox.coords).tolist() == [[0, -1, 0, 0], [0, 0, 0, 0], [0, 1, -1, 0]]


# -- voxelize -------------------------------------------------------------------------------


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "first"])
def test_voxelize_matches_loop(seeded, reduce):
    pts, batch = random_points(seeded, 400, 2, extent=2.0)
    vox = quantize_points(pts, 0.7, batch=batch)
    feats = seeded.standard_normal((400, 5)).astype(np.float32)
    out = voxelize(mx.array(feats), vox, reduce)
    ref = voxelize_ref(feats, np.array(vox.point_to_voxel), vox.num_voxels, reduce)
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "first"])
def test_voxelize_grad_finite_differences(seeded, reduce):
    pts, batch = random_points(seeded, 60, 2, extent=1.0)
    vox = quantize_points(pts, 0.8, batch=batch)
    feats = seeded.standard_normal((60, 3))
    cot = seeded.standard_normal((vox.num_voxels, 3))

    def loss(f):
        return (voxelize(f, vox, reduce) * mx.array(cot.astype(np.float32))).sum()

    grad = np.array(mx.grad(loss)(mx.array(feats.astype(np.float32))))
    p2v = np.array(vox.point_to_voxel)

    def loss_ref(f):
        return float((voxelize_ref(f, p2v, vox.num_voxels, reduce) * cot).sum())

    eps = 1e-4  # float64 reference: central differences exact to ~1e-8
    fd = np.zeros_like(feats)
    for i in range(feats.shape[0]):
        for j in range(feats.shape[1]):
            up, dn = feats.copy(), feats.copy()
            up[i, j] += eps
            dn[i, j] -= eps
            fd[i, j] = (loss_ref(up) - loss_ref(dn)) / (2 * eps)
    keep = np.ones(feats.shape, bool)
    if reduce == "max":
        # Central differences straddle the kink where two points of a voxel
        # are within eps of each other's value: compare away from such ties.
        for v in range(vox.num_voxels):
            rows = np.flatnonzero(p2v == v)
            for j in range(feats.shape[1]):
                vals = np.sort(feats[rows, j])
                if len(vals) > 1 and vals[-1] - vals[-2] <= 2 * eps:
                    keep[rows, j] = False
    np.testing.assert_allclose(grad[keep], fd[keep], rtol=1e-4, atol=1e-4)


def test_voxelize_jvp_matches_forward_of_tangent(seeded):
    pts, _ = random_points(seeded, 100, 1, extent=1.0)
    vox = quantize_points(pts, 0.5)
    f = mx.array(seeded.standard_normal((100, 2)).astype(np.float32))
    t = mx.array(seeded.standard_normal((100, 2)).astype(np.float32))
    for reduce in ("sum", "mean"):
        _, (jt,) = mx.jvp(lambda x, r=reduce: voxelize(x, vox, r), [f], [t])
        np.testing.assert_allclose(np.array(jt), np.array(voxelize(t, vox, reduce)), atol=1e-6)
    _, (jt,) = mx.jvp(lambda x: voxelize(x, vox, "max"), [f], [t])
    ref = voxelize_ref(np.array(f), np.array(vox.point_to_voxel), vox.num_voxels, "max")
    # the tangent of a max is the tangent of the point that attains it
    arg = np.array(
        [
            [
                np.flatnonzero(
                    (np.array(vox.point_to_voxel) == v) & (np.array(f)[:, c] == ref[v, c])
                )[0]
                for c in range(2)
            ]
            for v in range(vox.num_voxels)
        ]
    )
    np.testing.assert_allclose(np.array(jt), np.take_along_axis(np.array(t), arg, 0), atol=0)


def test_voxelize_under_compile_and_dtypes(seeded):
    pts, _ = random_points(seeded, 80, 1)
    vox = quantize_points(pts, 1.0)
    f = mx.array(seeded.standard_normal((80, 4)).astype(np.float32))
    compiled = mx.compile(lambda x: voxelize(x, vox, "mean"))
    np.testing.assert_allclose(np.array(compiled(f)), np.array(voxelize(f, vox, "mean")), atol=0)
    half = voxelize(f.astype(mx.float16), vox, "sum")
    assert half.dtype == mx.float16
    np.testing.assert_allclose(
        np.array(half.astype(mx.float32)),
        np.array(voxelize(f.astype(mx.float16).astype(mx.float32), vox, "sum")),
        rtol=2e-3,
        atol=2e-3,
    )  # fp16 rounding of the result


# -- point_voxel_map / devoxelize -----------------------------------------------------------


def _scene(rng, n_points=300, batches=2, drop=0.3):
    pts, batch = random_points(rng, n_points, batches, extent=2.0)
    size = rng.uniform(0.4, 0.8, 3)
    origin = rng.uniform(-0.5, 0.5, 3)
    coords, _, _ = quantize_ref(pts, size, origin, batch)
    keep = rng.random(len(coords)) > drop  # empty voxels: drop some occupied ones
    coords = coords[keep]
    coords = coords[rng.permutation(len(coords))]
    return pts, batch, size, origin, coords


def test_point_voxel_map_matches_loop(seeded):
    pts, batch, size, origin, coords = _scene(seeded)
    pvm = point_voxel_map(pts, coords, size, origin=origin, batch=batch)
    rows, weights, nearest = pvm_ref(pts, coords, size, origin, batch)
    np.testing.assert_array_equal(np.array(pvm.rows), rows)
    np.testing.assert_allclose(np.array(pvm.weights), weights, atol=1e-6)
    np.testing.assert_array_equal(np.array(pvm.nearest), nearest)
    present = weights.sum(1) > 0
    np.testing.assert_allclose(np.array(pvm.weights).sum(1)[present], 1.0, atol=1e-5)


@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_devoxelize_matches_loop(seeded, mode):
    pts, batch, size, origin, coords = _scene(seeded)
    pvm = point_voxel_map(pts, coords, size, origin=origin, batch=batch)
    vf = seeded.standard_normal((len(coords), 6)).astype(np.float32)
    out = devoxelize(mx.array(vf), pvm, mode)
    rows, weights, nearest = pvm_ref(pts, coords, size, origin, batch)
    np.testing.assert_allclose(
        np.array(out), devoxelize_ref(vf, rows, weights, nearest, mode), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_devoxelize_vjp_jvp(seeded, mode):
    pts, batch, size, origin, coords = _scene(seeded, n_points=40)
    pvm = point_voxel_map(pts, coords, size, origin=origin, batch=batch)
    rows, weights, nearest = pvm_ref(pts, coords, size, origin, batch)
    vf = seeded.standard_normal((len(coords), 2))
    cot = seeded.standard_normal((40, 2))

    def loss_ref(v):
        return float((devoxelize_ref(v, rows, weights, nearest, mode) * cot).sum())

    grad = np.array(
        mx.grad(lambda v: (devoxelize(v, pvm, mode) * mx.array(cot.astype(np.float32))).sum())(
            mx.array(vf.astype(np.float32))
        )
    )
    eps = 1e-4
    fd = np.zeros_like(vf)
    for i in range(vf.shape[0]):
        for j in range(vf.shape[1]):
            up, dn = vf.copy(), vf.copy()
            up[i, j] += eps
            dn[i, j] -= eps
            fd[i, j] = (loss_ref(up) - loss_ref(dn)) / (2 * eps)
    np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-4)
    t = seeded.standard_normal(vf.shape).astype(np.float32)
    _, (jt,) = mx.jvp(
        lambda v: devoxelize(v, pvm, mode), [mx.array(vf.astype(np.float32))], [mx.array(t)]
    )
    np.testing.assert_allclose(
        np.array(jt), devoxelize_ref(t, rows, weights, nearest, mode), rtol=1e-5, atol=1e-5
    )


def test_devoxelize_weight_gradient(seeded):
    pts, batch, size, origin, coords = _scene(seeded, n_points=30)
    pvm = point_voxel_map(pts, coords, size, origin=origin, batch=batch)
    vf = mx.array(seeded.standard_normal((len(coords), 3)).astype(np.float32))
    from mlx_lattice._native import ext

    def f(w):
        return ext.geometry_devoxelize(
            vf, pvm.rows, w, pvm.nearest, pvm.voxel_offsets, pvm.voxel_entries, False
        ).sum()

    g = np.array(mx.grad(f)(pvm.weights))
    rows = np.array(pvm.rows)
    ref = np.where(rows >= 0, np.array(vf)[np.maximum(rows, 0)].sum(-1), 0.0)
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5)


def test_devoxelize_compile_and_scan_roundtrip():
    pts = synthetic_lidar_scan(seed=0).points[::5]
    vox = quantize_points(pts, 0.25)
    pvm = point_voxel_map(pts, vox.coords, 0.25)
    # Features linear in the voxel centre are reproduced exactly by trilinear
    # interpolation wherever all 8 voxels exist.
    centres = (np.array(vox.coords)[:, 1:] + 0.5) * 0.25
    vf = mx.array(centres.astype(np.float32))
    out = np.array(mx.compile(lambda v: devoxelize(v, pvm))(vf))
    full = np.all(np.array(pvm.rows) >= 0, axis=1)
    assert full.sum() > 100
    np.testing.assert_allclose(out[full], pts[full], atol=1e-4)


# -- bad inputs -----------------------------------------------------------------------------


def test_bad_inputs_raise_geometry_errors():
    pts = np.zeros((3, 3))
    with pytest.raises(GeometryError, match="points must be finite"):
        quantize_points(np.array([[0.0, np.nan, 0.0]]), 1.0)
    with pytest.raises(GeometryError, match="points must be finite"):
        point_voxel_map(np.array([[np.inf, 0.0, 0.0]]), np.zeros((1, 4), np.int32), 1.0)
    with pytest.raises(GeometryError, match="voxel_size"):
        quantize_points(pts, 0.0)
    with pytest.raises(GeometryError, match="voxel_size"):
        quantize_points(pts, (1.0, -1.0, 1.0))
    with pytest.raises(GeometryError, match="int32"):
        quantize_points(np.array([[3e9, 0.0, 0.0]]), 1.0)
    with pytest.raises(GeometryError, match="batch"):
        quantize_points(pts, 1.0, batch=np.array([0, -1, 0]))
    with pytest.raises(GeometryError, match="batch"):
        quantize_points(pts, 1.0, batch=np.array([0, 1]))
    with pytest.raises(GeometryError, match=r"points must be \(P, 3\)"):
        quantize_points(np.zeros((3, 2)), 1.0)
    vox = quantize_points(pts, 1.0)
    with pytest.raises(GeometryError, match="reduce"):
        voxelize(mx.zeros((3, 1)), vox, "median")  # type: ignore[arg-type]
    with pytest.raises(GeometryError, match="point_features"):
        voxelize(mx.zeros((4, 1)), vox)
    with pytest.raises(ValueError, match="duplicate"):
        point_voxel_map(pts, np.zeros((2, 4), np.int32), 1.0)
    pvm = point_voxel_map(pts, np.zeros((1, 4), np.int32), 1.0)
    with pytest.raises(GeometryError, match="voxel_features"):
        devoxelize(mx.zeros((2, 1)), pvm)
    with pytest.raises(GeometryError, match="interpolation"):
        devoxelize(mx.zeros((1, 1)), pvm, "cubic")  # type: ignore[arg-type]


def test_corrupt_maps_are_rejected_before_kernels_run():
    from mlx_lattice._native import ext

    pts = np.array([[0.1, 0.1, 0.1], [0.6, 0.6, 0.6]])
    pvm = point_voxel_map(pts, np.array([[0, 0, 0, 0]]), 1.0)
    bad_rows = mx.array(np.full((2, 8), 7, np.int32))
    with pytest.raises(ValueError, match="rows"):
        ext.geometry_devoxelize(
            mx.zeros((1, 1)),
            bad_rows,
            pvm.weights,
            pvm.nearest,
            pvm.voxel_offsets,
            pvm.voxel_entries,
            False,
        )
    vox = quantize_points(pts, 1.0)
    with pytest.raises(ValueError, match="point_to_voxel"):
        ext.geometry_voxelize(
            mx.zeros((2, 1)),
            vox.voxel_offsets,
            vox.voxel_points,
            mx.array([0, 5], dtype=mx.int32),
            "sum",
        )
    with pytest.raises(ValueError, match="voxel_points"):
        ext.geometry_voxelize(
            mx.zeros((2, 1)),
            vox.voxel_offsets,
            mx.array([0, 9], dtype=mx.int32),
            vox.point_to_voxel,
            "sum",
        )


def test_vmap_raises_naming_the_op():
    pts = np.array([[0.1, 0.1, 0.1], [0.6, 0.6, 0.6]])
    pvm = point_voxel_map(pts, np.array([[0, 0, 0, 0]]), 1.0)
    with pytest.raises(ValueError, match="GeometryDevoxelize"):
        mx.vmap(lambda v: devoxelize(v, pvm))(mx.zeros((2, 1, 1)))


# -- neighbours -----------------------------------------------------------------------------


def knn_ref(q, qb, s, sb, k):
    """Brute force: every pair's squared distance, sorted by (distance, row)."""
    out = []
    for i in range(len(q)):
        cand = np.flatnonzero(sb == qb[i])
        d2 = ((s[cand] - q[i]) ** 2).sum(-1)
        order = np.lexsort((cand, d2))[:k]
        out.append(list(zip(d2[order].tolist(), cand[order].tolist(), strict=True)))
    return out


def radius_ref(q, qb, s, sb, r, max_neighbors=None):
    out = []
    for i in range(len(q)):
        cand = np.flatnonzero(sb == qb[i])
        d2 = ((s[cand] - q[i]) ** 2).sum(-1)
        keep = d2 <= r * r
        order = np.lexsort((cand[keep], d2[keep]))
        rows = cand[keep][order].tolist()
        out.append(rows[:max_neighbors] if max_neighbors else rows)
    return out


@pytest.mark.parametrize(
    ("k", "batches", "grid"), [(1, 1, False), (8, 2, False), (16, 3, True), (40, 2, True)]
)
def test_knn_matches_brute_force_with_ties(seeded, k, batches, grid):
    if grid:  # integer lattice points: many exactly equal distances
        s = seeded.integers(-4, 5, (300, 3)).astype(np.float64)
        q = seeded.integers(-4, 5, (120, 3)).astype(np.float64) + seeded.choice(
            [0.0, 0.5], (120, 3)
        )
    else:
        s = seeded.uniform(-5, 5, (400, 3))
        q = seeded.uniform(-6, 6, (150, 3))
    sb, qb = seeded.integers(0, batches, len(s)), seeded.integers(0, batches, len(q))
    rel = knn_relation(q, s, k, query_batch=qb, support_batch=sb)
    ref = knn_ref(q, qb, s, sb, k)
    assert relation_lists(rel) == [[r for _, r in row] for row in ref]
    assert rel.n_kernels == k and rel.n_in == len(s) and rel.n_out_capacity == len(q)
    np.testing.assert_array_equal(
        np.array(rel.counts), np.bincount(np.array(rel.edges.kernel_ids), minlength=k)
    )


def test_knn_matches_ckdtree_on_scan():
    from scipy.spatial import cKDTree

    pts = synthetic_lidar_scan(seed=0).points.astype(np.float64)
    support, query = pts[::3], pts[1::50]
    rel = knn_relation(query, support, 16)
    d, idx = cKDTree(support).query(query, k=16)
    got = np.array(rel.edges.in_rows).reshape(-1, 16)
    d_got = np.sqrt(((support[got] - query[:, None]) ** 2).sum(-1))
    np.testing.assert_allclose(d_got, d, rtol=1e-12, atol=1e-12)
    # cKDTree's order among exact ties is unspecified; compare sets where distances tie
    same = (got == idx) | np.isclose(d_got, d, rtol=0, atol=0)
    assert same.all()


def test_radius_matches_brute_force_and_ckdtree(seeded):
    from scipy.spatial import cKDTree

    s = seeded.integers(-5, 6, (400, 3)).astype(np.float64)  # lattice: points exactly at r
    q = seeded.uniform(-5, 5, (100, 3)).round(1)
    q[:20] = s[:20]
    sb, qb = seeded.integers(0, 2, len(s)), seeded.integers(0, 2, len(q))
    for r, cap in ((1.0, None), (2.0, 5), (0.3, None)):
        rel = radius_relation(q, s, r, cap, query_batch=qb, support_batch=sb)
        assert relation_lists(rel) == radius_ref(q, qb, s, sb, r, cap)
    rel = radius_relation(q, s, 1.5)
    tree = cKDTree(s)
    assert [sorted(x) for x in relation_lists(rel)] == [
        sorted(x) for x in tree.query_ball_point(q, 1.5)
    ]


def test_neighbors_over_voxel_coordinates_feed_pooling(seeded):
    from mlx_lattice.core import ops

    coords = np.unique(
        np.concatenate([seeded.integers(0, 2, (300, 1)), seeded.integers(0, 6, (300, 3))], 1),
        axis=0,
    ).astype(np.int32)
    rel = knn_relation(coords, coords, 4)
    feats = seeded.standard_normal((len(coords), 3)).astype(np.float32)
    pooled = ops.sparse_pool_features_from_relation(
        mx.array(feats), rel, input_exclusive=False, mode="max"
    )
    ref = knn_ref(
        coords[:, 1:].astype(np.float64),
        coords[:, 0],
        coords[:, 1:].astype(np.float64),
        coords[:, 0],
        4,
    )
    expected = np.stack([feats[[r for _, r in row]].max(0) for row in ref])
    np.testing.assert_allclose(np.array(pooled), expected, atol=0)
    gathered = gather_neighbor_features(mx.array(feats), rel)
    np.testing.assert_array_equal(
        np.array(gathered), np.stack([feats[[r for _, r in row]] for row in ref])
    )


def test_gather_neighbor_features_fill_and_grad(seeded):
    s = seeded.uniform(0, 1, (30, 3))
    q = seeded.uniform(0, 1, (10, 3))
    rel = radius_relation(q, s, 0.4, 6)
    feats = mx.array(seeded.standard_normal((30, 2)).astype(np.float32))
    out = np.array(gather_neighbor_features(feats, rel, fill=-7.0))
    lists = radius_ref(q, np.zeros(10), s, np.zeros(30), 0.4, 6)
    for o, rows in enumerate(lists):
        np.testing.assert_array_equal(out[o, : len(rows)], np.array(feats)[rows])
        assert (out[o, len(rows) :] == -7.0).all()
    w = mx.array(seeded.standard_normal((10, 6, 2)).astype(np.float32))
    grad = np.array(mx.grad(lambda f: (gather_neighbor_features(f, rel) * w).sum())(feats))
    ref = np.zeros((30, 2))
    for o, rows in enumerate(lists):
        for kk, r in enumerate(rows):
            ref[r] += np.array(w)[o, kk]
    np.testing.assert_allclose(grad, ref, atol=1e-6)


def test_neighbor_bad_inputs():
    pts = np.zeros((3, 3))
    with pytest.raises(GeometryError, match="k must"):
        knn_relation(pts, pts, 0)
    with pytest.raises(GeometryError, match="r must"):
        radius_relation(pts, pts, -1.0)
    with pytest.raises(GeometryError, match="max_neighbors"):
        radius_relation(pts, pts, 1.0, 0)
    with pytest.raises(GeometryError, match="support must be finite"):
        knn_relation(pts, np.array([[np.nan, 0, 0]]), 1)
    with pytest.raises(GeometryError, match="query_batch"):
        knn_relation(pts, pts, 1, query_batch=np.array([0, 0]))
    with pytest.raises(GeometryError, match="feats"):
        gather_neighbor_features(mx.zeros((2, 1)), knn_relation(pts, pts, 1))


# -- coordinate algebra ---------------------------------------------------------------------


def _rand_set(rng, n, extent=6, batches=2):
    rows = np.concatenate(
        [rng.integers(0, batches, (n, 1)), rng.integers(-extent, extent, (n, 3))], 1
    )
    rows = np.unique(rows, axis=0)
    return rows[rng.permutation(len(rows))].astype(np.int32)


def test_union_intersection_lookup_against_python_sets(seeded):
    a, b = _rand_set(seeded, 300), _rand_set(seeded, 250)
    sa, sb = {tuple(r) for r in a.tolist()}, {tuple(r) for r in b.tolist()}
    ia = {tuple(r): i for i, r in enumerate(a.tolist())}
    ib = {tuple(r): i for i, r in enumerate(b.tolist())}
    for join, expected in ((union_coords(a, b), sa | sb), (intersection_coords(a, b), sa & sb)):
        rows = [tuple(r) for r in np.array(join.coords).tolist()]
        assert rows == sorted(expected)
        assert np.array(join.a_rows).tolist() == [ia.get(r, -1) for r in rows]
        assert np.array(join.b_rows).tolist() == [ib.get(r, -1) for r in rows]
    q = np.concatenate([b, a[:50]])
    assert np.array(lookup_coords(a, q)).tolist() == [ia.get(tuple(r), -1) for r in q.tolist()]
    assert np.array(contains_coords(a, q)).tolist() == [tuple(r) in sa for r in q.tolist()]
    empty = np.zeros((0, 4), np.int32)
    assert np.array(union_coords(a, empty).coords).tolist() == [list(r) for r in sorted(sa)]
    assert np.array(intersection_coords(empty, b).coords).shape == (0, 4)


def test_large_coordinates_are_exact():
    big = np.array(
        [[0, 2**31 - 1, -(2**31), 7], [3, -(2**31), 2**31 - 1, 7], [0, 0, 0, 0]], np.int32
    )
    other = big.copy()
    other[2, 3] = 1
    j = union_coords(big, other)
    assert len(np.array(j.coords)) == 4
    assert np.array(lookup_coords(big, other)).tolist() == [0, 1, -1]


def test_inverse_map_and_downsample(seeded):
    perm = seeded.permutation(20)[:12]
    inv = np.array(inverse_map(perm, 20))
    for i, t in enumerate(perm):
        assert inv[t] == i
    assert (inv >= 0).sum() == 12
    with pytest.raises(CoordinateError, match="repeats"):
        inverse_map(np.array([1, 1]), 3)
    with pytest.raises(CoordinateError, match="indices"):
        inverse_map(np.array([3]), 3)
    c = _rand_set(seeded, 300, extent=9)
    coarse, m = downsample_coords(c, (2, 3, 2), tensor_stride=2)
    step = np.array([4, 6, 4])
    expected = {(r[0], *[(r[a + 1] // step[a]) * step[a] for a in range(3)]) for r in c.tolist()}
    rows = [tuple(r) for r in np.array(coarse).tolist()]
    assert rows == sorted(expected)
    for i, r in enumerate(c.tolist()):
        assert rows[int(np.array(m)[i])] == (
            r[0],
            *[(r[a + 1] // step[a]) * step[a] for a in range(3)],
        )


def morton_ref(x, y, z):
    code = 0
    for bit in range(21):
        for shift, v in ((2, x), (1, y), (0, z)):
            code |= (((v + 2**20) >> bit) & 1) << (3 * bit + shift)
    return code


def test_morton_against_bit_interleaving(seeded):
    c = np.concatenate(
        [seeded.integers(0, 3, (400, 1)), seeded.integers(-(2**20), 2**20, (400, 3))], 1
    ).astype(np.int32)
    c[:5, 1:] = [
        [-(2**20), -(2**20), -(2**20)],
        [2**20 - 1] * 3,
        [-1, 0, 1],
        [0, 0, 0],
        [-1, -1, -1],
    ]
    codes = np.array(morton_codes(c)).tolist()
    assert codes == [morton_ref(*r[1:]) for r in c.tolist()]
    order = np.array(morton_order(c)).tolist()
    assert order == sorted(range(len(c)), key=lambda i: (c[i, 0], codes[i], i))
    sorted_c, o2 = morton_sort_coords(c)
    np.testing.assert_array_equal(np.array(sorted_c), c[order])
    assert np.array(o2).tolist() == order
    with pytest.raises(CoordinateError, match="Morton range"):
        morton_codes(np.array([[0, 2**20, 0, 0]]))


def test_crop_topk_reindex(seeded):
    c = _rand_set(seeded, 200)
    rows = np.array(crop(c, (-2, -3, 0), (2, 4, 5))).tolist()
    assert rows == [
        i
        for i, r in enumerate(c.tolist())
        if -2 <= r[1] <= 2 and -3 <= r[2] <= 4 and 0 <= r[3] <= 5
    ]
    scores = seeded.integers(0, 5, len(c)).astype(np.float64)  # many ties
    got = np.array(topk_rows(scores, 7, coords=c)).tolist()
    expected = []
    for b in np.unique(c[:, 0]):
        idx = [i for i in range(len(c)) if c[i, 0] == b]
        expected += sorted(idx, key=lambda i: (-scores[i], i))[:7]
    assert got == sorted(expected)
    new = _rand_set(seeded, 150)
    feats = mx.array(seeded.standard_normal((len(c), 3)).astype(np.float32))
    out = np.array(reindex(feats, c, new, fill=2.5))
    table = {tuple(r): i for i, r in enumerate(c.tolist())}
    for i, r in enumerate(new.tolist()):
        ref = np.array(feats)[table[tuple(r)]] if tuple(r) in table else np.full(3, 2.5)
        np.testing.assert_array_equal(out[i], ref)
    with pytest.raises(CoordinateError, match="min must be"):
        crop(c, (1, 1, 1), (0, 0, 0))
    with pytest.raises(CoordinateError, match="duplicate"):
        lookup_coords(np.zeros((2, 4), np.int32), c)
    with pytest.raises(CoordinateError, match="k must"):
        topk_rows(scores, -1)


# -- sparse algebra with joins --------------------------------------------------------------


def join_ref(a_coords, a_feats, b_coords, b_feats, join, fill, op):
    """Dictionary reference: rows keyed by coordinate, in the documented order."""
    da = {tuple(c): f for c, f in zip(a_coords.tolist(), a_feats, strict=True)}
    db = {tuple(c): f for c, f in zip(b_coords.tolist(), b_feats, strict=True)}
    keys_a, keys_b = [tuple(c) for c in a_coords.tolist()], [tuple(c) for c in b_coords.tolist()]
    keys = {
        "left": keys_a,
        "right": keys_b,
        "inner": [k for k in keys_a if k in db],
        "outer": keys_a + [k for k in keys_b if k not in da],
    }[join]
    ca, cb = a_feats.shape[1], b_feats.shape[1]
    rows = [op(da.get(k, np.full(ca, fill)), db.get(k, np.full(cb, fill))) for k in keys]
    return np.array(keys, np.int64).reshape(-1, 4), np.array(rows).reshape(len(keys), -1)


@pytest.mark.parametrize("join", ["inner", "left", "right", "outer"])
@pytest.mark.parametrize(
    ("name", "ref_op"),
    [
        ("add", np.add),
        ("sub", np.subtract),
        ("mul", np.multiply),
        ("maximum", np.maximum),
        ("minimum", np.minimum),
    ],
)
def test_binary_joins_against_dict(seeded, join, name, ref_op):
    from mlx_lattice import algebra

    ac, bc = _rand_set(seeded, 120, extent=3), _rand_set(seeded, 100, extent=3)
    af = seeded.standard_normal((len(ac), 3)).astype(np.float32)
    bf = seeded.standard_normal((len(bc), 3)).astype(np.float32)
    a, b = SparseTensor(ac, mx.array(af)), SparseTensor(bc, mx.array(bf))
    fill = float(seeded.uniform(-1, 1))
    out = getattr(algebra, name)(a, b, join=join, fill=fill)
    coords, feats = join_ref(ac, af, bc, bf, join, fill, ref_op)
    np.testing.assert_array_equal(np.array(out.coords), coords)
    np.testing.assert_allclose(np.array(out.feats), feats, rtol=1e-6, atol=1e-6)
    # gradients reach both operands: d sum(out * w) / d a.feats through the joined rows
    w = seeded.standard_normal(feats.shape).astype(np.float32)
    ga, gb = mx.grad(
        lambda fa, fb: (
            getattr(algebra, name)(a.replace(fa), b.replace(fb), join=join, fill=fill).feats
            * mx.array(w)
        ).sum(),
        argnums=(0, 1),
    )(mx.array(af), mx.array(bf))
    eps = 1e-3
    for feats_in, grad, which in ((af, ga, 0), (bf, gb, 1)):
        for i, j in zip(
            seeded.integers(0, len(feats_in), 6), seeded.integers(0, 3, 6), strict=True
        ):
            up, dn = feats_in.astype(np.float64), feats_in.astype(np.float64)
            up[i, j] += eps
            dn[i, j] -= eps
            args_up = (up, bf) if which == 0 else (af, up)
            args_dn = (dn, bf) if which == 0 else (af, dn)
            fd = (
                (join_ref(ac, args_up[0], bc, args_up[1], join, fill, ref_op)[1] * w).sum()
                - (join_ref(ac, args_dn[0], bc, args_dn[1], join, fill, ref_op)[1] * w).sum()
            ) / (2 * eps)
            assert abs(float(np.array(grad)[i, j]) - fd) < 1e-2, (name, join, which, i, j)


def test_cat_operators_and_collate(seeded):
    from mlx_lattice import algebra

    ac, bc = _rand_set(seeded, 60, extent=2), _rand_set(seeded, 50, extent=2)
    af = seeded.standard_normal((len(ac), 2)).astype(np.float32)
    bf = seeded.standard_normal((len(bc), 3)).astype(np.float32)
    a, b = SparseTensor(ac, mx.array(af)), SparseTensor(bc, mx.array(bf))
    for join in ("inner", "left", "right", "outer"):
        out = algebra.cat(a, b, join=join, fill=0.5)
        coords, feats = join_ref(
            ac, af, bc, bf, join, 0.5, lambda x, y: np.concatenate([x[:2], y[:3]])
        )
        np.testing.assert_array_equal(np.array(out.coords), coords)
        np.testing.assert_allclose(np.array(out.feats), feats, atol=0)
    b2 = SparseTensor(bc, mx.array(bf[:, :2]))
    s = a + b2
    coords, feats = join_ref(ac, af, bc, bf[:, :2], "outer", 0.0, np.add)
    np.testing.assert_array_equal(np.array(s.coords), coords)
    np.testing.assert_allclose(np.array(s.feats), feats, atol=1e-6)
    np.testing.assert_allclose(np.array((a * 2.0 - 1.0).feats), af * 2 - 1, atol=1e-6)
    np.testing.assert_allclose(np.array((3.0 - a).feats), 3 - af, atol=1e-6)
    np.testing.assert_allclose(
        np.array((-(a * b2)).feats),
        -join_ref(ac, af, bc, bf[:, :2], "outer", 0.0, np.multiply)[1],
        atol=1e-6,
    )
    same = a + a.replace(mx.ones_like(a.feats))
    assert same.coordinate_key == a.coordinate_key
    with pytest.raises(SparseTensorError, match="channels"):
        algebra.add(a, b)
    with pytest.raises(SparseTensorError, match="join"):
        algebra.add(a, b2, join="cross")
    with pytest.raises(SparseTensorError, match="tensor_stride"):
        algebra.add(a, SparseTensor(bc * 2, mx.array(bf[:, :2]), tensor_stride=2))
    # collate: duplicates raise with reduce="none", merge otherwise (dict reference)
    samples = [seeded.integers(0, 3, (40, 3)) for _ in range(2)]
    feats_in = [seeded.standard_normal((40, 2)).astype(np.float32) for _ in range(2)]
    with pytest.raises(ValueError, match="duplicate"):
        algebra.collate(samples, feats_in)
    for reduce, fn in (("mean", np.mean), ("sum", np.sum), ("max", np.max)):
        x = algebra.collate(samples, [mx.array(f) for f in feats_in], reduce=reduce)
        groups = {}
        for i, (c, f) in enumerate(zip(samples, feats_in, strict=True)):
            for r, v in zip(c.tolist(), f, strict=True):
                groups.setdefault((i, *r), []).append(v)
        keys = sorted(groups)
        np.testing.assert_array_equal(np.array(x.coords), np.array(keys))
        np.testing.assert_allclose(
            np.array(x.feats), np.array([fn(groups[k], axis=0) for k in keys]), rtol=1e-5, atol=1e-6
        )


def test_neighbors_far_queries_and_mixed_scales(seeded):
    # a dense tiny cluster, a far cluster, and queries far outside both
    s = np.concatenate([seeded.uniform(0, 1e-6, (200, 3)), seeded.uniform(1e6, 1e6 + 10, (50, 3))])
    q = np.concatenate(
        [s[::17], seeded.uniform(-1e15, 1e15, (5, 3)), [[1e6 + 5, 1e6 + 5, 1e6 + 5]]]
    )
    sb, qb = np.zeros(len(s), np.int64), np.zeros(len(q), np.int64)
    rel = knn_relation(q, s, 7)
    assert relation_lists(rel) == [[r for _, r in row] for row in knn_ref(q, qb, s, sb, 7)]
    rel = radius_relation(q, s, 3.0)
    assert relation_lists(rel) == radius_ref(q, qb, s, sb, 3.0)


def test_neighbor_conv_against_loop_and_grad(seeded):
    from mlx_lattice.core import ops
    from mlx_lattice.geometry import neighbor_conv

    s = seeded.uniform(0, 2, (120, 3))
    q = seeded.uniform(0, 2, (40, 3))
    rel = knn_relation(q, s, 5)
    feats = seeded.standard_normal((120, 3)).astype(np.float32)
    weight = seeded.standard_normal((5, 3, 4)).astype(
        np.float32
    )  # (K, Cin, Cout): one matrix per rank
    out = np.array(neighbor_conv(mx.array(feats), mx.array(weight), rel))
    ref = np.zeros((40, 4))
    lists = knn_ref(q, np.zeros(40), s, np.zeros(120), 5)
    for o, row in enumerate(lists):
        for rank, (_, r) in enumerate(row):
            ref[o] += feats[r].astype(np.float64) @ weight[rank]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    cot = seeded.standard_normal((40, 4)).astype(np.float32)
    gw = np.array(
        mx.grad(lambda w: (neighbor_conv(mx.array(feats), w, rel) * mx.array(cot)).sum())(
            mx.array(weight)
        )
    )
    ref_gw = np.zeros_like(weight, dtype=np.float64)
    for o, row in enumerate(lists):
        for rank, (_, r) in enumerate(row):
            ref_gw[rank] += np.outer(feats[r], cot[o])
    np.testing.assert_allclose(gw, ref_gw, rtol=1e-4, atol=1e-4)
    # the core conv takes relations with several edges per (input row, offset)
    # and agrees with the loop
    core = ops.sparse_conv_features_from_relation(mx.array(feats), mx.array(weight), rel)
    np.testing.assert_allclose(np.array(core)[:40], ref, rtol=1e-5, atol=1e-5)
    # ... but not its feature gradient, which needs one edge per (input row,
    # offset): asking for it raises (at graph build) instead of summing wrong
    pairs = [(r, rank) for row in lists for rank, (_, r) in enumerate(row)]
    assert len(pairs) > len(set(pairs)), "no support row is the same rank of two queries"
    with pytest.raises(ValueError, match="feature gradient needs at most one edge"):
        mx.grad(
            lambda f: ops.sparse_conv_features_from_relation(f, mx.array(weight), rel).sum()
        )(mx.array(feats))
    # the weight gradient has no such limit: it matches the loop's
    gw_core = mx.grad(
        lambda w: (ops.sparse_conv_features_from_relation(mx.array(feats), w, rel)[:40]
                   * mx.array(cot)).sum()
    )(mx.array(weight))
    np.testing.assert_allclose(np.array(gw_core), ref_gw, rtol=1e-4, atol=1e-4)
    with pytest.raises(GeometryError, match="weight"):
        neighbor_conv(mx.array(feats), mx.zeros((4, 3, 4)), rel)


def test_set_ops_on_two_scans():
    a = np.array(quantize_points(synthetic_lidar_scan(seed=0).points[::4], 0.2).coords)
    b = np.array(quantize_points(synthetic_lidar_scan(seed=1).points[::4], 0.2).coords)
    sa, sb = {tuple(r) for r in a.tolist()}, {tuple(r) for r in b.tolist()}
    assert [tuple(r) for r in np.array(union_coords(a, b).coords).tolist()] == sorted(sa | sb)
    assert [tuple(r) for r in np.array(intersection_coords(a, b).coords).tolist()] == sorted(
        sa & sb
    )
    assert np.array(contains_coords(a, b)).tolist() == [tuple(r) in sa for r in b.tolist()]


def test_voxelize_vmap_raises_naming_the_op():
    vox = quantize_points(np.array([[0.1, 0.1, 0.1], [0.6, 0.6, 0.6]]), 1.0)
    with pytest.raises(ValueError, match="GeometryVoxelize"):
        mx.vmap(lambda f: voxelize(f, vox))(mx.zeros((3, 2, 1)))


def test_thread_count_never_changes_bits(seeded):
    import mlx_lattice

    pts = synthetic_lidar_scan(seed=0).points[::9].astype(np.float64)
    feats = mx.array(seeded.standard_normal((len(pts), 8)).astype(np.float32))
    before = mlx_lattice.get_num_threads()

    def run():
        vox = quantize_points(pts, 0.2)
        pvm = point_voxel_map(pts, vox.coords, 0.2)
        v = voxelize(feats, vox, "mean")
        p = devoxelize(v, pvm)
        g = mx.grad(lambda x: (devoxelize(x, pvm) * feats).sum())(v)
        rel = knn_relation(pts[::5], pts, 8)
        ball = radius_relation(pts[::5], pts, 0.3)
        return [
            np.array(a)
            for a in (vox.coords, pvm.weights, v, p, g, rel.edges.in_rows, ball.edges.in_rows)
        ]

    try:
        mlx_lattice.set_num_threads(1)
        one = run()
        mlx_lattice.set_num_threads(3)
        three = run()
    finally:
        mlx_lattice.set_num_threads(before)
    for a, b in zip(one, three, strict=True):
        np.testing.assert_array_equal(a, b)


def test_coordinate_hash_primitive_on_cpu_streams(rng):
    """GeometryHash evaluated by the product's CPU kernel (the primitive the
    GPU route of the coordinate ops uses): first occurrences and query rows
    against a dictionary reference, duplicates and negatives included."""
    from mlx_lattice._native import ext

    c = rng.integers(-4, 4, (400, 4)).astype(np.int32)
    c[:, 0] = np.abs(c[:, 0]) % 2
    q = np.concatenate([c[rng.integers(0, 400, 50)], rng.integers(-6, 6, (50, 4))]).astype(np.int32)
    raw = ext.coords_hash(mx.array(c), mx.array(q))
    seen = {}
    for i, r in enumerate(c.tolist()):
        seen.setdefault(tuple(r), i)
    assert np.array(raw["first"]).tolist() == [seen[tuple(r)] for r in c.tolist()]
    assert np.array(raw["rows"]).tolist() == [seen.get(tuple(r), -1) for r in q.tolist()]
    empty = ext.coords_hash(mx.zeros((0, 4), mx.int32), mx.array(q))
    assert np.array(empty["rows"]).tolist() == [-1] * len(q)
