"""The point-voxel map's paths (points that share the previous point's cell
reuse its corner rows; the out-of-range check inside the parallel loop; any
thread count) against a NumPy loop reference and against each other, bit for
bit; and the vectorized channel loops of devoxelize, its point-major
transpose and voxelize's sum/mean, bit for bit against float32 emulations of
their documented summation order (every block width and tail, fine and
coarse maps, any thread count) and against float64.

Every random input comes from `seeded` (the repository's seeded generator,
printed on failure, replayed with ``TEST_SEED=<seed>``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice._native import ext
from mlx_lattice.geometry import (
    GeometryError,
    devoxelize,
    point_voxel_map,
    quantize_points,
    voxelize,
)


def _load_refs():
    """The shared references (tests/geometry_refs.py), loaded by path."""
    path = Path(__file__).with_name("geometry_refs.py")
    spec = importlib.util.spec_from_file_location("geometry_refs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


refs = _load_refs()
pvm_ref = refs.pvm_ref


@pytest.fixture
def seeded(rng: np.random.Generator) -> np.random.Generator:
    return rng


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


# -- the vectorized channel loops of devoxelize, its transpose and voxelize ------------------


def _coarse_or_fine(rng, coarse):
    """A scene and its map: fine (about one point per voxel) or coarse (tens
    of points per voxel, as at a U-Net's coarsest level)."""
    pts, batch, size, origin, coords = _scene(rng, 3000, 2, False)
    if coarse:
        size = size * 4
        cells = np.floor((pts - origin) / size).astype(np.int64)
        coords = np.unique(np.concatenate([batch[:, None], cells], axis=1), axis=0)
        coords = coords[rng.permutation(len(coords))].astype(np.int32)
    pvm = point_voxel_map(pts, coords, size, origin=origin, batch=batch)
    return pts, batch, size, origin, coords, pvm


def _per_thread_count(fn):
    before = mlx_lattice.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 8):
            mlx_lattice.set_num_threads(threads)
            results.append(fn())
    finally:
        mlx_lattice.set_num_threads(before)
    return results


@pytest.mark.parametrize("coarse", [False, True])
@pytest.mark.parametrize("channels", [3, 8, 37, 128])
def test_devoxelize_and_transpose_bits_in_documented_order(seeded, coarse, channels):
    # 37 channels: two 16-wide blocks, no 8-wide block, a scalar tail of 5.
    pts, batch, size, origin, coords, pvm = _coarse_or_fine(seeded, coarse)
    vf = seeded.standard_normal((len(coords), channels)).astype(np.float32)
    g = seeded.standard_normal((len(pts), channels)).astype(np.float32)
    rows, weights = np.array(pvm.rows), np.array(pvm.weights)

    def run():
        out, vjp = mx.vjp(lambda v: devoxelize(v, pvm), [mx.array(vf)], [mx.array(g)])
        return np.array(out[0]), np.array(vjp[0])

    results = _per_thread_count(run)
    for out, grad in results:
        # Bit for bit: the float32 order the kernels document, at any thread count.
        np.testing.assert_array_equal(out, refs.devoxelize_f32_ref(vf, rows, weights))
        np.testing.assert_array_equal(
            grad, refs.devoxelize_transpose_f32_ref(g, rows, weights, len(coords))
        )
    # And the math against float64 from the loop reference's map.
    rows64, weights64, _ = pvm_ref(pts, coords, size, origin, batch)
    present = (rows64 >= 0)[..., None]
    dense = vf.astype(np.float64)[np.maximum(rows64, 0)]
    np.testing.assert_allclose(
        results[0][0], (dense * weights64[..., None] * present).sum(1), rtol=1e-5, atol=1e-5
    )
    grad64 = np.zeros((len(coords), channels))
    np.add.at(
        grad64,
        np.maximum(rows64, 0).reshape(-1),
        (weights64 * (rows64 >= 0)).reshape(-1, 1) * np.repeat(g.astype(np.float64), 8, axis=0),
    )
    np.testing.assert_allclose(results[0][1], grad64, rtol=1e-4, atol=1e-4)


_SCALAR_SCRIPT = """
import sys
import mlx.core as mx
import numpy as np
from mlx_lattice.geometry import devoxelize, point_voxel_map
d = np.load(sys.argv[1])
pvm = point_voxel_map(d["pts"], d["coords"], d["size"], origin=d["origin"], batch=d["batch"])
out, vjp = mx.vjp(lambda v: devoxelize(v, pvm), [mx.array(d["vf"])], [mx.array(d["g"])])
np.savez(sys.argv[2], out=np.array(out[0]), grad=np.array(vjp[0]), rows=np.array(pvm.rows),
         weights=np.array(pvm.weights))
"""


def test_devoxelize_scalar_path_bits(seeded, seed, tmp_path, isa_child):
    """MLX_LATTICE_GEMM_ISA=scalar forces the default-target channel loops
    (the only ones on CPUs without AVX2): the same documented order."""
    pts, batch, size, origin, coords, _ = _coarse_or_fine(seeded, True)
    vf = seeded.standard_normal((len(coords), 37)).astype(np.float32)
    g = seeded.standard_normal((len(pts), 37)).astype(np.float32)
    np.savez(tmp_path / "case.npz", pts=pts, batch=batch, size=size, origin=origin,
             coords=coords, vf=vf, g=g)
    isa_child(_SCALAR_SCRIPT, "scalar", tmp_path / "case.npz", tmp_path / "out.npz")
    got = np.load(tmp_path / "out.npz")
    rows, weights = got["rows"], got["weights"]
    np.testing.assert_array_equal(
        got["out"], refs.devoxelize_f32_ref(vf, rows, weights), err_msg=f"seed={seed}"
    )
    np.testing.assert_array_equal(
        got["grad"], refs.devoxelize_transpose_f32_ref(g, rows, weights, len(coords)),
        err_msg=f"seed={seed}",
    )


@pytest.mark.parametrize("coarse", [False, True])
def test_nearest_transpose_bits(seeded, coarse):
    pts, _, _, _, coords, pvm = _coarse_or_fine(seeded, coarse)
    g = seeded.standard_normal((len(pts), 37)).astype(np.float32)
    nearest = np.array(pvm.nearest)

    def run():
        _, vjp = mx.vjp(
            lambda v: devoxelize(v, pvm, "nearest"),
            [mx.zeros((len(coords), 37))],
            [mx.array(g)],
        )
        return np.array(vjp[0])

    expected = np.zeros((len(coords), 37), np.float32)
    np.add.at(expected, nearest[nearest >= 0], g[nearest >= 0])  # ascending points
    for grad in _per_thread_count(run):
        np.testing.assert_array_equal(grad, expected)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("channels", [5, 37, 128])
def test_voxelize_sum_mean_bits_in_point_order(seeded, reduce, channels):
    pts = seeded.uniform(0.0, 2.0, (4000, 3))
    vox = quantize_points(pts, 0.3)  # about 15 points per voxel
    feats = seeded.standard_normal((len(pts), channels)).astype(np.float32)
    p2v, counts = np.array(vox.point_to_voxel), np.array(vox.counts)
    expected = np.zeros((vox.num_voxels, channels), np.float32)
    np.add.at(expected, p2v, feats)  # ascending points per voxel, float32
    if reduce == "mean":
        expected = (expected * (np.float32(1) / counts.astype(np.float32))[:, None]).astype(
            np.float32
        )
    results = _per_thread_count(lambda: np.array(voxelize(mx.array(feats), vox, reduce)))
    for out in results:
        np.testing.assert_array_equal(out, expected)
    mean64 = np.zeros((vox.num_voxels, channels))
    np.add.at(mean64, p2v, feats.astype(np.float64))
    if reduce == "mean":
        mean64 /= counts[:, None]
    np.testing.assert_allclose(results[0], mean64, rtol=1e-5, atol=1e-5)


# -- corner lookups in sorted coordinates; the grouping of entries by voxel --------------------


def test_sorted_coords_next_row_shortcut_gives_the_same_map(seeded):
    # Coordinates sorted (batch, x, y, z), as tensors hold them: corner c + 1
    # (one step along z) is often the row after corner c's and is taken from
    # there; elsewhere the next row holds another voxel and the hash decides.
    pts, batch, size, origin, coords = _scene(seeded, 600, 3, True)
    order = np.lexsort(coords[:, ::-1].T)
    ordered = coords[order]
    raw = _raw(pts, batch, ordered, size, origin)
    _check_ref(raw, pts, batch, ordered, size, origin)
    rows = np.array(raw["rows"])
    hits = (rows[:, 0::2] >= 0) & (rows[:, 1::2] == rows[:, 0::2] + 1)
    assert hits.any() and (rows[:, 0::2] >= 0).sum() > hits.sum(), f"{hits.sum()} adjacent pairs"
    # The same map as from the shuffled rows, renamed.
    shuffled = _raw(pts, batch, coords, size, origin)
    rename = np.empty(len(coords) + 1, np.int64)
    rename[order] = np.arange(len(coords))
    rename[-1] = -1  # row -1 stays -1
    np.testing.assert_array_equal(rows, rename[np.array(shuffled["rows"])])
    np.testing.assert_array_equal(np.array(raw["weights"]), np.array(shuffled["weights"]))
    np.testing.assert_array_equal(np.array(raw["nearest"]), rename[np.array(shuffled["nearest"])])


def test_entry_grouping_for_any_thread_count(seeded):
    # 80000 points: 640000 entries, counted in up to 8 slices (one histogram
    # each); every thread count gives the stable grouping by voxel.
    pts, batch, size, origin, coords = _scene(seeded, 80000, 2, False)
    results = _per_thread_count(lambda: _raw(pts, batch, coords, size, origin))
    for r in results[1:]:
        _same(results[0], r)
    rows = np.array(results[0]["rows"]).reshape(-1)
    valid = np.flatnonzero(rows >= 0)
    expect = valid[np.argsort(rows[valid], kind="stable")]
    counts = np.bincount(rows[valid], minlength=len(coords))
    np.testing.assert_array_equal(np.array(results[0]["voxel_entries"]), expect)
    np.testing.assert_array_equal(
        np.array(results[0]["voxel_offsets"]), np.concatenate([[0], np.cumsum(counts)])
    )


# -- half-precision features and the output dtype of devoxelize -----------------------------

_HALF_TOL = {mx.float32: 1e-5, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}


@pytest.mark.parametrize("mode", ["linear", "nearest"])
@pytest.mark.parametrize("out_dtype", [mx.float32, mx.float16, mx.bfloat16, None])
@pytest.mark.parametrize("feat_dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_devoxelize_dtypes_equal_the_casts_and_float64(seeded, seed, feat_dtype, out_dtype, mode):
    # The kernel widens half rows and rounds its output once: the bits of
    # casting the features to float32, devoxelizing and casting the result;
    # the gradient (the transpose of a cotangent in the output dtype) comes
    # back in the features' dtype with the casts' bits too.
    pts, batch, size, origin, coords, pvm = _coarse_or_fine(seeded, False)
    channels = 37  # 16-wide blocks and a scalar tail
    vf = mx.array(seeded.standard_normal((len(coords), channels)).astype(np.float32))
    vf = vf.astype(feat_dtype)
    want = feat_dtype if out_dtype is None else out_dtype
    g = mx.array(seeded.standard_normal((len(pts), channels)).astype(np.float32)).astype(want)
    t = mx.array(seeded.standard_normal(vf.shape).astype(np.float32)).astype(feat_dtype)
    msg = f"seed {seed}, {feat_dtype} -> {out_dtype}, {mode}"

    def native(v):
        return devoxelize(v, pvm, mode, dtype=out_dtype)

    def cast(v):
        return devoxelize(v.astype(mx.float32), pvm, mode).astype(want)

    (out,), (grad,) = mx.vjp(native, [vf], [g])
    (out_c,), (grad_c,) = mx.vjp(cast, [vf], [g])
    assert out.dtype == want and grad.dtype == feat_dtype, msg
    f32 = mx.float32
    np.testing.assert_array_equal(np.array(out.astype(f32)), np.array(out_c.astype(f32)), msg)
    np.testing.assert_array_equal(np.array(grad.astype(f32)), np.array(grad_c.astype(f32)), msg)
    (jt,) = mx.jvp(native, [vf], [t])[1]
    (jt_c,) = mx.jvp(cast, [vf], [t])[1]
    assert jt.dtype == want, msg
    np.testing.assert_array_equal(np.array(jt.astype(f32)), np.array(jt_c.astype(f32)), msg)
    compiled = mx.compile(native)(vf)
    np.testing.assert_array_equal(np.array(compiled.astype(f32)), np.array(out.astype(f32)), msg)
    # Against float64 from the loop reference's map (one rounding to `want`).
    rows64, weights64, nearest64 = pvm_ref(pts, coords, size, origin, batch)
    v64 = np.array(vf.astype(f32)).astype(np.float64)
    g64 = np.array(g.astype(f32)).astype(np.float64)
    if mode == "linear":
        w = weights64 * (rows64 >= 0)
        ref = (v64[np.maximum(rows64, 0)] * w[..., None]).sum(1)
        grad64 = np.zeros_like(v64)
        spread = w.reshape(-1, 1) * np.repeat(g64, 8, 0)
        np.add.at(grad64, np.maximum(rows64, 0).reshape(-1), spread)
    else:
        ref = np.where((nearest64 >= 0)[:, None], v64[np.maximum(nearest64, 0)], 0.0)
        grad64 = np.zeros_like(v64)
        keep = nearest64 >= 0
        np.add.at(grad64, nearest64[keep], g64[keep])
    tol = _HALF_TOL[want]
    np.testing.assert_allclose(np.array(out.astype(f32)), ref, rtol=tol, atol=tol, err_msg=msg)
    gtol = max(_HALF_TOL[feat_dtype], 1e-4)  # float32 transpose sums: 1e-4 as above
    got = np.array(grad.astype(f32))
    np.testing.assert_allclose(got, grad64, rtol=gtol, atol=gtol, err_msg=msg)


def test_half_devoxelize_same_bits_for_any_thread_count(seeded):
    pts, *_, coords, pvm = _coarse_or_fine(seeded, True)
    vf = mx.array(seeded.standard_normal((len(coords), 24)).astype(np.float32)).astype(mx.float16)
    g = mx.array(seeded.standard_normal((len(pts), 24)).astype(np.float32))

    def run():
        (out,), (grad,) = mx.vjp(lambda v: devoxelize(v, pvm, dtype=mx.float32), [vf], [g])
        return np.array(out), np.array(grad.astype(mx.float32))

    results = _per_thread_count(run)
    for out, grad in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(grad, results[0][1])


def test_devoxelize_rejects_a_bad_dtype(seeded):
    *_, coords, pvm = _coarse_or_fine(seeded, False)
    vf = mx.zeros((len(coords), 2))
    with pytest.raises(GeometryError, match="dtype must be float32, float16 or bfloat16"):
        devoxelize(vf, pvm, dtype=mx.int32)
    with pytest.raises(ValueError, match="devoxelize: dtype must be float32, float16 or bfloat16"):
        ext.geometry_devoxelize(
            vf, pvm.rows, pvm.weights, pvm.nearest, pvm.voxel_offsets, pvm.voxel_entries, False,
            out_dtype="float64",
        )
