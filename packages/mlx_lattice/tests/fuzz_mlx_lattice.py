"""Fuzz targets of mlx_lattice's public entry points (Hypothesis).

These run in a child process (``test_fuzz_native.py``), so a crash of the
native layer is a failing test that names its input. Every target accepts
two outcomes: a valid result equal to an independent reference (brute
force, NumPy), or an :class:`~mlx_lattice.MlxLatticeError`. Budget and
replay: ``tools/fuzzing.py``.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import mlx.core as mx
import numpy as np
from fuzzing import fuzz
from hypothesis import event
from hypothesis import strategies as st

import mlx_lattice
from mlx_lattice import MlxLatticeError, SparseTensor
from mlx_lattice.coords import intersection_coords, lookup_coords, union_coords
from mlx_lattice.core import QuantizedWeight, build_kernel_relation
from mlx_lattice.geometry import (
    devoxelize,
    knn_relation,
    point_voxel_map,
    quantize_points,
    radius_relation,
    voxelize,
)


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


geometry_refs = _load(Path(__file__).with_name("geometry_refs.py"), "geometry_refs")
int8_refs = _load(Path(__file__).with_name("int8_refs.py"), "int8_refs")
relation_refs = _load(Path(__file__).with_name("relation_refs.py"), "relation_refs")

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
# Small values, and values at the int32 limits (neighbours there overflow).
coordinate_values = st.integers(-3, 3) | st.sampled_from(
    [I32_MIN, I32_MIN + 1, I32_MAX - 1, I32_MAX]
)
coordinate_rows = st.lists(
    st.tuples(st.integers(0, 1), coordinate_values, coordinate_values, coordinate_values),
    max_size=10,
)
float_values = st.integers(-4, 4).map(float) | st.sampled_from(
    [0.5, -0.25, 1e-3, 1e12, -1e12, 3e38, float("nan"), float("inf"), -float("inf")]
)
points = st.lists(st.tuples(float_values, float_values, float_values), max_size=10)
DTYPES = [np.int32, np.int64, np.int16, np.float32, np.uint32, np.bool_]


def _offsets(kernel_size: tuple[int, int, int], dilation: int) -> list[tuple[int, int, int]]:
    """x-major kernel offsets, from the documented formula."""
    return [
        tuple((i[a] - (kernel_size[a] - 1) // 2) * dilation for a in range(3))
        for i in itertools.product(*(range(k) for k in kernel_size))
    ]


def _edge_set(rel) -> set[tuple[int, int, int]]:
    e = rel.edges
    return set(
        zip(e.in_rows.tolist(), e.out_rows.tolist(), e.kernel_ids.tolist(), strict=True)
    )


@fuzz(
    150,
    rows=coordinate_rows,
    kernel_size=st.tuples(*[st.integers(0, 4)] * 3) | st.integers(-1, 8),
    dilation=st.integers(0, 3),
    dtype=st.sampled_from(DTYPES),
    ordered=st.booleans(),
)
def test_submanifold_relation_matches_brute_force(rows, kernel_size, dilation, dtype, ordered):
    """build_kernel_relation(kind='submanifold') on any coordinates (empty,
    duplicate, at the int32 limits, any dtype, in any order or sorted by
    (batch, x, y, z) as the sorted walk takes them), kernel size and
    dilation returns exactly the brute-force edge set (int64 arithmetic: a
    neighbour outside int32 does not exist), or raises MlxLatticeError."""
    given = np.array(rows, dtype=np.int64).reshape(-1, 4)
    if ordered:
        given = given[np.lexsort(given.T[::-1])]
    given = given.astype(dtype)
    try:
        rel = build_kernel_relation(given, kernel_size=kernel_size, dilation=dilation)
    except MlxLatticeError:
        return
    coords = given.astype(np.int64)
    assert len(np.unique(coords, axis=0)) == len(coords), "duplicates were accepted"
    size = (kernel_size,) * 3 if isinstance(kernel_size, int) else kernel_size
    expected = set()
    for k, off in enumerate(_offsets(size, dilation)):
        for i, j in itertools.product(range(len(coords)), repeat=2):
            a, b = coords[i], coords[j]
            if a[0] == b[0] and all(int(a[1 + d]) - int(b[1 + d]) == off[d] for d in range(3)):
                expected.add((i, j, k))
    assert _edge_set(rel) == expected


def _brute_neighbours(q, qb, s, sb, limit_k=None, r=None):
    out = []
    for qi in range(len(q)):
        cands = []
        for si in range(len(s)):
            if qb[qi] != sb[si]:
                continue
            d2 = float(np.sum((q[qi] - s[si]) ** 2))
            if r is None or d2 <= r * r:
                cands.append((d2, si))
        cands.sort()
        if limit_k is not None:
            cands = cands[:limit_k]
        out.append(cands)
    return out


def _relation_rows(rel, n_query):
    e = rel.edges
    got = [[] for _ in range(n_query)]
    for i, o, k in zip(
        e.in_rows.tolist(), e.out_rows.tolist(), e.kernel_ids.tolist(), strict=True
    ):
        got[o].append((k, i))
    return [[i for _, i in sorted(g)] for g in got]


@fuzz(
    150,
    query=points,
    support=points,
    k=st.integers(-1, 12),
    qb=st.lists(st.integers(0, 2), min_size=10, max_size=10),
    sb=st.lists(st.integers(0, 2), min_size=10, max_size=10),
)
def test_knn_matches_brute_force(query, support, k, qb, sb):
    """knn_relation on points with NaN/inf/huge values, duplicates, batches
    in any order and k at its edges returns, per query, the brute-force k
    nearest (float64 squared distance, then row) of its batch, or raises
    MlxLatticeError (non-finite points, k < 1)."""
    q = np.array(query, np.float64).reshape(-1, 3)
    s = np.array(support, np.float64).reshape(-1, 3)
    qbatch, sbatch = np.array(qb[: len(q)], np.int32), np.array(sb[: len(s)], np.int32)
    try:
        rel = knn_relation(q, s, k, query_batch=qbatch, support_batch=sbatch)
    except MlxLatticeError:
        return
    assert k >= 1 and np.isfinite(q).all() and np.isfinite(s).all()
    want = _brute_neighbours(q, qbatch, s, sbatch, limit_k=k)
    got = _relation_rows(rel, len(q))
    for row, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g == [si for _, si in w], f"query row {row}"


@fuzz(
    150,
    query=points,
    support=points,
    r=st.sampled_from([0.0, -1.0, float("nan"), float("inf"), 1e-9, 0.5, 1.0, 2.0, 1e30]),
    max_neighbors=st.none() | st.integers(-1, 4),
)
def test_radius_matches_brute_force(query, support, r, max_neighbors):
    """radius_relation returns, per query, the supports within r (inclusive,
    float64), nearest first, at most max_neighbors, or raises MlxLatticeError
    (r not positive and finite, non-finite points, max_neighbors < 1)."""
    q = np.array(query, np.float64).reshape(-1, 3)
    s = np.array(support, np.float64).reshape(-1, 3)
    try:
        rel = radius_relation(q, s, r, max_neighbors)
    except MlxLatticeError:
        return
    assert np.isfinite(q).all() and np.isfinite(s).all() and 0 < r < float("inf")
    zeros_q, zeros_s = np.zeros(len(q), np.int32), np.zeros(len(s), np.int32)
    want = _brute_neighbours(q, zeros_q, s, zeros_s, limit_k=max_neighbors, r=r)
    got = _relation_rows(rel, len(q))
    for row, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g == [si for _, si in w], f"query row {row}"


@fuzz(
    150,
    pts=points,
    voxel_size=st.sampled_from([0.0, -1.0, float("nan"), 1e-30, 0.25, 1.0, 3.0])
    | st.tuples(*[st.sampled_from([0.5, 1.0, 0.0])] * 3),
)
def test_quantize_points_matches_numpy(pts, voxel_size):
    """quantize_points maps every point to the voxel floor(p / size) of NumPy
    (float64), lists each voxel once with its point count, or raises
    MlxLatticeError (non-finite points, size <= 0, voxels outside int32)."""
    p = np.array(pts, np.float64).reshape(-1, 3)
    try:
        vox = quantize_points(p, voxel_size)
    except MlxLatticeError:
        return
    size = np.broadcast_to(np.asarray(voxel_size, np.float64), (3,))
    assert np.isfinite(p).all() and (size > 0).all()
    idx = np.floor(p / size)
    assert (np.abs(idx) <= 2**31).all()
    coords = np.array(vox.coords)
    p2v = np.array(vox.point_to_voxel)
    assert len(np.unique(coords, axis=0)) == len(coords)
    np.testing.assert_array_equal(coords[p2v][:, 1:], idx.astype(np.int64).reshape(-1, 3))
    np.testing.assert_array_equal(np.array(vox.counts), np.bincount(p2v, minlength=len(coords)))


@fuzz(150, a=coordinate_rows, b=coordinate_rows)
def test_coordinate_joins_match_sets(a, b):
    """union_coords / intersection_coords / lookup_coords agree with Python
    sets (row indices into each input, -1 where absent), or raise
    MlxLatticeError (duplicate rows)."""
    ca = np.array(a, np.int32).reshape(-1, 4)
    cb = np.array(b, np.int32).reshape(-1, 4)
    try:
        union = union_coords(ca, cb)
        inter = intersection_coords(ca, cb)
        found = lookup_coords(ca, cb)
    except MlxLatticeError:
        assert len(set(a)) < len(a) or len(set(b)) < len(b)
        return
    rows_a = {r: i for i, r in enumerate(a)}
    rows_b = {r: i for i, r in enumerate(b)}
    for join, keys in ((union, set(a) | set(b)), (inter, set(a) & set(b))):
        got = [tuple(r) for r in np.array(join.coords).tolist()]
        assert sorted(got) == got and set(got) == keys and len(got) == len(keys)
        assert np.array(join.a_rows).tolist() == [rows_a.get(r, -1) for r in got]
        assert np.array(join.b_rows).tolist() == [rows_b.get(r, -1) for r in got]
    assert np.array(found).tolist() == [rows_a.get(r, -1) for r in b]


@fuzz(
    150,
    n=st.integers(0, 5),
    width=st.integers(0, 5),
    channels=st.integers(0, 3),
    coord_dtype=st.sampled_from(DTYPES),
    feat_dtype=st.sampled_from(["float32", "float16", "bfloat16", "int32", "bool_"]),
    feat_rows=st.integers(0, 6),
    transpose=st.booleans(),
)
def test_sparse_tensor_constructor(n, width, channels, coord_dtype, feat_dtype, feat_rows,
                                   transpose):
    """SparseTensor(coords, feats) with any shapes, dtypes and (non-)
    contiguous arrays holds exactly the given coordinates and features, or
    raises MlxLatticeError."""
    coords = (np.arange(n * width).reshape(n, width) % 3).astype(coord_dtype)
    if transpose:
        coords = np.ascontiguousarray(coords.T).T  # a Fortran-ordered view
    feats = mx.arange(feat_rows * channels).reshape(feat_rows, channels).astype(
        getattr(mx, feat_dtype)
    )
    try:
        st_ = SparseTensor(coords, feats)
    except MlxLatticeError:
        return
    assert width == 4 and feat_rows == n
    np.testing.assert_array_equal(np.array(st_.coords), coords.astype(np.int64))
    assert st_.feats.shape == feats.shape
    assert mx.array_equal(st_.feats, feats).item()


def _conv_ref(feats: np.ndarray, weight: np.ndarray, edges, n_out: int) -> np.ndarray:
    """out[o] = sum over edges (i, o, k) of feats[i] @ weight[k], in float64."""
    out = np.zeros((n_out, weight.shape[2]))
    for i, o, k in edges:
        out[o] += feats[i].astype(np.float64) @ weight[k].astype(np.float64)
    return out


def _pool_ref(feats: np.ndarray, edges, n_out: int, mode: str) -> np.ndarray:
    out = np.zeros((n_out, feats.shape[1]))
    groups: dict[int, list[int]] = {}
    for i, o, _ in edges:
        groups.setdefault(o, []).append(i)
    for o, rows in groups.items():
        vals = feats[rows].astype(np.float64)
        out[o] = vals.max(0) if mode == "max" else vals.sum(0) / (len(rows) if mode == "avg" else 1)
    return out


TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


@fuzz(
    100,
    rows=st.lists(st.tuples(st.just(0), *[st.integers(0, 3)] * 3), unique=True, max_size=8),
    channels=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    dtype=st.sampled_from(["float32", "float16", "bfloat16", "int32"]),
    kernel_size=st.sampled_from([3, 3, 1, 2, 4, 5, 7]),
    weight_kernels_delta=st.sampled_from([0, 0, 0, -1, 1]),
    weight_cin_delta=st.sampled_from([0, 0, 1]),
    feat_rows_delta=st.sampled_from([0, 0, 0, -1, 1]),
    layout=st.sampled_from(["contiguous", "transposed", "strided", "aliased", "donated"]),
    l2=st.sampled_from([None, None, 1]),
    data_seed=st.integers(0, 2**32 - 1),
)
def test_conv_and_pool_match_brute_force(rows, channels, dtype, kernel_size, weight_kernels_delta,
                                         weight_cin_delta, feat_rows_delta, layout, l2, data_seed):
    """sparse_conv_features_from_relation and sparse_pool_features_from_relation
    (max/avg/sum) on a k x k x k relation (k 1 to 5 or 7) with any dtype,
    mismatched weight or feature shapes, empty sets and channels, transposed
    or strided (non-contiguous) feature arrays, features and weights that are
    overlapping views of one buffer, or features only the graph holds (a
    buffer MLX may donate to the output) equal the float64 brute force
    over the relation's edges within the dtype's rounding, or raise
    MlxLatticeError. With ``l2`` a 1-byte L2 size, float32 outputs of more
    than one row are summed in per-thread windows and streamed out
    (cpu/output_window.h)."""
    from mlx_lattice.core import ops as core_ops

    cin, cout = channels
    coords = np.array(rows, np.int32).reshape(-1, 4)
    rel = build_kernel_relation(coords, kernel_size=kernel_size)
    weight_kernels = kernel_size**3 + weight_kernels_delta
    rng = np.random.default_rng(data_seed)
    n = max(len(coords) + feat_rows_delta, 0)
    f_np = rng.standard_normal((n, cin)).astype(np.float32)
    w_np = rng.standard_normal((weight_kernels, cin + weight_cin_delta, cout)).astype(np.float32)
    f = mx.array(f_np).astype(getattr(mx, dtype))
    if layout == "transposed":
        f = mx.array(np.ascontiguousarray(f_np.T)).astype(getattr(mx, dtype)).T
    w = mx.array(w_np).astype(getattr(mx, dtype))
    if layout == "strided":
        wide = np.repeat(f_np, 2, axis=1)
        f = mx.array(wide).astype(getattr(mx, dtype))[:, ::2]
    if layout == "aliased":
        # Features and weights are overlapping views of one buffer.
        base = mx.array(rng.standard_normal(f_np.size + w_np.size).astype(np.float32))
        base = base.astype(getattr(mx, dtype))
        start = f_np.size // 2
        f = base[: f_np.size].reshape(f_np.shape)
        w = base[start : start + w_np.size].reshape(w_np.shape)
    edges = sorted(_edge_set(rel))
    f_exact = np.array(f.astype(mx.float32))
    w_exact = np.array(w.astype(mx.float32))
    tol = TOLERANCE.get(dtype, 0.0)
    mlx_lattice.set_kernel_l2_bytes(l2)
    try:
        # "donated": the features are a temporary only the graph holds, whose
        # buffer MLX may hand to an output.
        out = core_ops.sparse_conv_features_from_relation(
            f * 1 if layout == "donated" else f, w, rel)
        mx.eval(out)
    except MlxLatticeError:
        out = None
    finally:
        mlx_lattice.set_kernel_l2_bytes(None)
    if out is not None:
        assert dtype in TOLERANCE and n == len(coords) and weight_kernels_delta == 0
        assert weight_cin_delta == 0 and out.dtype == f.dtype
        ref = _conv_ref(f_exact, w_exact, edges, len(coords))
        scale = _conv_ref(np.abs(f_exact), np.abs(w_exact), edges, len(coords))
        got = np.array(out.astype(mx.float32))
        assert got.shape == ref.shape
        assert (np.abs(got - ref) <= tol * (scale + 1) * max(cin, 1) * 4).all()
    for mode in ("max", "avg", "sum"):
        try:
            pooled = core_ops.sparse_pool_features_from_relation(
                f * 1 if layout == "donated" else f, rel, input_exclusive=False, mode=mode
            )
            mx.eval(pooled)
        except MlxLatticeError:
            continue
        assert dtype in TOLERANCE and n == len(coords)
        ref = _pool_ref(f_exact, edges, len(coords), mode)
        got = np.array(pooled.astype(mx.float32))
        assert got.shape == ref.shape
        bound = tol * (_pool_ref(np.abs(f_exact), edges, len(coords), "sum") + 1) * 2
        assert (np.abs(got - ref) <= bound).all(), mode


# The unit roundoff of each storage format (the output's one rounding).
_UNIT = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}
TILE_CHANNELS = st.sampled_from([1, 3, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 70])


@fuzz(
    40,
    n_points=st.integers(0, 300),
    side=st.sampled_from([3, 5, 8]),
    kernel_size=st.sampled_from([1, 2, 3, 3, 4, 5, (3, 3, 1), (1, 1, 7), (2, 3, 1)]),
    stride=st.sampled_from([1, 1, 2, 3]),
    transposed=st.booleans(),
    cin=TILE_CHANNELS,
    cout=TILE_CHANNELS,
    kind=st.sampled_from(["float32", "float16", "bfloat16", "w8a8", "w4a8", "w8a8-static"]),
    l2=st.sampled_from([None, None, 1024]),
    data_seed=st.integers(0, 2**32 - 1),
)
def test_conv_and_pool_tile_edge_shapes(n_points, side, kernel_size, stride, transposed, cin,
                                        cout, kind, l2, data_seed):
    """The shapes where the tile drivers have tails: channels not a multiple
    of 16, 32 or 64, row counts not a multiple of 16, one row, empty sets,
    cubic and non-cubic kernels, strides 1-3 and their transposes, two batch
    entries, output windows streamed under a 1 KiB L2. Float convolutions
    stay within the float32 summation bound of the float64 sums of the
    rounded inputs (``n`` terms per output: ``n u sum|products|``, ``u`` =
    2^-24, ``n`` = K * Cin + K + 1 for each edge's products, each offset's
    sum added in and the zero start) plus the output format's one rounding;
    w8a8 / w4a8 (dynamic and static activation scales) give the bits of the
    NumPy model of the integer math (``int8_refs.py``); pooling gives the
    max exactly and sums / averages within the same summation bound."""
    from mlx_lattice.core import ops as core_ops

    rel = relation_refs.grid_relation(
        n_points, side, kernel_size, stride, transposed, data_seed, batches=2
    )
    rng = np.random.default_rng(data_seed)
    n_in, n_out, k = int(rel.n_in), int(rel.n_out_capacity or 0), int(rel.n_kernels)
    f_np = rng.standard_normal((n_in, cin)).astype(np.float32)
    w_np = (rng.standard_normal((k, cin, cout)) / np.sqrt(cin)).astype(np.float32)
    dtype = kind if kind in _UNIT else "float32"
    f = mx.array(f_np).astype(getattr(mx, dtype))
    fe = np.array(f.astype(mx.float32)).astype(np.float64)
    edges = _edge_set(rel)
    mlx_lattice.set_kernel_l2_bytes(l2)
    try:
        if kind in _UNIT:
            w = mx.array(w_np).astype(getattr(mx, dtype))
            out = core_ops.sparse_conv_features_from_relation(f, w, rel)
            got = np.array(out.astype(mx.float32)).astype(np.float64)
            we = np.array(w.astype(mx.float32)).astype(np.float64)
            exact = _conv_ref(fe, we, edges, n_out)
            mag = _conv_ref(np.abs(fe), np.abs(we), edges, n_out)
            n_terms = k * cin + k + 1
            # The last term: half of float16's smallest subnormal.
            bound = (_UNIT[dtype] * np.abs(exact) + (1 + _UNIT[dtype]) * n_terms * 2.0**-24 * mag
                     + 2.0**-25)
            assert out.dtype == f.dtype and got.shape == (n_out, cout)
            assert (np.abs(got - exact) <= bound).all(), kind
        else:
            bits = 4 if kind.startswith("w4") else 8
            group = 32 if cin <= 32 else 64
            qw = QuantizedWeight.from_float(mx.array(w_np), bits=bits, group_size=group)
            scale = np.float32(np.abs(f_np).max(initial=1.0) / 127) if "static" in kind else None
            out = core_ops.sparse_quantized_conv_features_from_relation(
                f, qw, rel, act_bits=8, act_scale=scale
            )
            want = int8_refs.int8_conv_ref(f_np, qw, rel, scale)
            np.testing.assert_array_equal(np.array(out), want)
        for mode in ("max", "avg", "sum"):
            pooled = core_ops.sparse_pool_features_from_relation(
                f, rel, input_exclusive=False, mode=mode
            )
            got = np.array(pooled.astype(mx.float32)).astype(np.float64)
            ref = _pool_ref(fe, edges, n_out, mode)
            if mode == "max":
                np.testing.assert_array_equal(got, ref)
                continue
            total = _pool_ref(np.abs(fe), edges, n_out, "sum")
            # k + 1 terms of a sum; avg: one division more.
            bound = (2 * _UNIT[dtype] * np.abs(ref) + (k + 3) * 2.0**-24 * total + 2.0**-25)
            assert (np.abs(got - ref) <= bound).all(), mode
    finally:
        mlx_lattice.set_kernel_l2_bytes(None)


FLOAT_DTYPES = ["float32", "float16", "bfloat16"]
POINT_DTYPES = [np.float64, np.float32, np.float16, np.float64, np.int32]
# Mostly finite points (so most examples reach the reference), sometimes the
# NaN/inf/huge values of ``points``.
finite_points = st.lists(
    st.tuples(*[st.integers(-4, 4).map(float) | st.sampled_from([0.5, -0.25, 1e-3, 2.75])] * 3),
    max_size=10,
)
any_points = finite_points | finite_points | points
batches = st.lists(st.integers(0, 3), min_size=10, max_size=10) | st.lists(
    st.integers(-1, 3), min_size=10, max_size=10
)


def _reduce_ref(f: np.ndarray, p2v: np.ndarray, n_voxels: int, mode: str) -> np.ndarray:
    """Per-voxel sum/mean/max/first of the point rows, in float64."""
    out = np.zeros((n_voxels, f.shape[1]))
    for v in range(n_voxels):
        rows = np.flatnonzero(p2v == v)
        vals = f[rows].astype(np.float64)
        if mode == "sum":
            out[v] = vals.sum(0)
        elif mode == "mean":
            out[v] = vals.mean(0)
        elif mode == "max":
            out[v] = vals.max(0)
        else:
            out[v] = vals[0]
    return out


@fuzz(
    300,
    pts=any_points,
    point_dtype=st.sampled_from(POINT_DTYPES),
    voxel_size=st.sampled_from([0.25, 1.0, 3.0, 0.5])
    | st.sampled_from([0.0, -1.0, float("nan"), 1e-30])
    | st.tuples(*[st.sampled_from([0.5, 1.0, 2.0, 0.0])] * 3),
    batch=batches,
    channels=st.integers(0, 3),
    feat_dtype=st.sampled_from([*FLOAT_DTYPES, "int32"]),
    feat_rows_delta=st.sampled_from([0, 0, 0, 1, -1]),
    reduce=st.sampled_from(["sum", "mean", "max", "first", "median"]),
    data_seed=st.integers(0, 2**32 - 1),
)
def test_voxelize_matches_numpy(pts, point_dtype, voxel_size, batch, channels, feat_dtype,
                                feat_rows_delta, reduce, data_seed):
    """quantize_points + voxelize on points with NaN/inf/huge values,
    duplicates, batches in any order (or negative), every point dtype and
    every feature dtype: per voxel the float64 NumPy sum, mean, max or first
    point row (the voxel of each point being floor(p / size) in float64) in
    the features' dtype within its rounding, or MlxLatticeError (non-finite
    points, size <= 0, negative batch, voxels outside int32, integer points
    or features, a feature row count other than P, an unknown reduce)."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/huge values in a narrow dtype
        p = np.array(pts, np.float64).reshape(-1, 3).astype(point_dtype)
    b = np.array(batch[: len(p)], np.int64)
    try:
        vox = quantize_points(p, voxel_size, batch=b)
    except MlxLatticeError:
        event("quantize_points: error")
        vox = None
    p64 = p.astype(np.float64)
    size = np.broadcast_to(np.asarray(voxel_size, np.float64), (3,))
    if vox is None:
        return
    assert np.issubdtype(p.dtype, np.floating) and np.isfinite(p64).all()
    assert (size > 0).all() and (b >= 0).all()
    idx = np.floor(p64 / size)
    assert (np.abs(idx) <= 2**31).all()
    coords = np.array(vox.coords).astype(np.int64)
    p2v = np.array(vox.point_to_voxel)
    want = np.concatenate([b[:, None], idx.astype(np.int64)], axis=1).reshape(-1, 4)
    np.testing.assert_array_equal(coords[p2v], want)
    assert sorted(map(tuple, coords.tolist())) == list(map(tuple, coords.tolist()))
    rng = np.random.default_rng(data_seed)
    n = max(len(p) + feat_rows_delta, 0)
    f = mx.array(rng.standard_normal((n, channels)).astype(np.float32)).astype(
        getattr(mx, feat_dtype)
    )
    try:
        out = voxelize(f, vox, reduce)
        mx.eval(out)
    except MlxLatticeError:
        event("voxelize: error")
        return
    event(f"voxelize: checked {reduce}")
    assert feat_dtype in FLOAT_DTYPES and n == len(p) and reduce != "median"
    assert out.dtype == f.dtype
    f_exact = np.array(f.astype(mx.float32)).astype(np.float64)
    ref = _reduce_ref(f_exact, p2v, len(coords), reduce)
    scale = _reduce_ref(np.abs(f_exact), p2v, len(coords), "sum" if reduce == "sum" else "max")
    got = np.array(out.astype(mx.float32))
    assert got.shape == ref.shape
    # float32 accumulation of <= 10 rows, then one rounding to the dtype.
    tol = TOLERANCE[feat_dtype]
    assert (np.abs(got - ref) <= tol * scale).all(), reduce


# A length-prefixed file (model file or artifact) damaged by a few byte edits,
# each in the length prefix and JSON header or anywhere, and a cut anywhere.
_DAMAGE = dict(
    cut=st.none() | st.integers(0, 2**31),
    edits=st.lists(
        st.tuples(
            st.integers(0, 2**31),  # position (mod file length), biased to the header below
            st.booleans(),
            st.integers(0, 255),
        ),
        max_size=4,
    ),
)


def _damaged(data: bytes, cut, edits) -> bytes:
    """``data`` with ``edits`` (position, in the header?, byte) applied, then cut."""
    data = bytearray(data)
    header_end = 8 + int.from_bytes(data[:8], "little")
    for pos, in_header, value in edits:
        where = pos % (header_end if in_header else len(data))
        data[where] = value
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    return bytes(data)


@fuzz(
    300,
    pts=any_points,
    point_dtype=st.sampled_from(POINT_DTYPES),
    vox_rows=st.lists(
        st.tuples(st.integers(0, 1), *[st.integers(-2, 2)] * 3), max_size=16, unique=True
    )
    | st.lists(st.tuples(st.integers(0, 1), *[st.integers(-1, 1)] * 3), max_size=6),
    voxel_size=st.sampled_from([0.25, 1.0, 2.0, 0.5])
    | st.sampled_from([0.0, -1.0, float("inf"), 1e-30])
    | st.tuples(*[st.sampled_from([0.5, 1.0, 2.0])] * 3),
    origin=st.none()
    | st.tuples(*[st.sampled_from([0.0, -0.5, 0.3])] * 3)
    | st.tuples(*[st.sampled_from([0.0, float("nan")])] * 3),
    batch=st.lists(st.integers(0, 1), min_size=10, max_size=10)
    | st.lists(st.integers(-1, 1), min_size=10, max_size=10),
    channels=st.integers(0, 3),
    feat_dtype=st.sampled_from([*FLOAT_DTYPES, "int32"]),
    out_dtype=st.sampled_from([None, None, *FLOAT_DTYPES, "int32"]),
    feat_rows_delta=st.sampled_from([0, 0, 0, 1, -1]),
    interpolation=st.sampled_from(["linear", "nearest", "cubic"]),
    data_seed=st.integers(0, 2**32 - 1),
)
def test_point_voxel_map_and_devoxelize_match_numpy(
    pts, point_dtype, vox_rows, voxel_size, origin, batch, channels, feat_dtype, out_dtype,
    feat_rows_delta, interpolation, data_seed,
):
    """point_voxel_map on points with NaN/inf/huge values, duplicate or
    out-of-order voxel coordinates and batches: the rows, trilinear weights
    (renormalised over present voxels) and nearest voxel of the documented
    float64 formulas; devoxelize (linear, nearest) in every float dtype: the
    float64 interpolation within the output dtype's rounding. Otherwise
    MlxLatticeError (non-finite points, bad size or origin, negative batch,
    duplicate coordinates, integer features, wrong row count, unknown
    interpolation or dtype)."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/huge values in a narrow dtype
        p = np.array(pts, np.float64).reshape(-1, 3).astype(point_dtype)
    coords = np.array(vox_rows, np.int32).reshape(-1, 4)
    b = np.array(batch[: len(p)], np.int64)
    try:
        pvm = point_voxel_map(p, coords, voxel_size, origin=origin, batch=b)
    except MlxLatticeError:
        event("point_voxel_map: error")
        return
    event("point_voxel_map: checked")
    p64 = p.astype(np.float64)
    size = np.broadcast_to(np.asarray(voxel_size, np.float64), (3,))
    assert np.issubdtype(p.dtype, np.floating) and np.isfinite(p64).all()
    assert (size > 0).all() and np.isfinite(size).all() and (b >= 0).all()
    assert origin is None or np.isfinite(origin).all()
    assert len(set(vox_rows)) == len(vox_rows), "duplicate coordinates were accepted"
    rows, weights, nearest = geometry_refs.pvm_ref(p64, coords, size, origin, b)
    got_rows = np.array(pvm.rows)
    np.testing.assert_array_equal(got_rows, rows)
    got_w = np.array(pvm.weights)
    np.testing.assert_allclose(got_w, weights, atol=1e-6)
    got_near = np.array(pvm.nearest)
    for i in np.flatnonzero(got_near != nearest):
        # Only a tie of weights (within float32 rounding) may pick another corner.
        w_got = weights[i][rows[i] == got_near[i]]
        w_ref = weights[i][rows[i] == nearest[i]]
        assert len(w_got) and len(w_ref) and abs(w_got.max() - w_ref.max()) <= 1e-6, f"nearest of point {i}"
    rng = np.random.default_rng(data_seed)
    n = max(len(coords) + feat_rows_delta, 0)
    vf = mx.array(rng.standard_normal((n, channels)).astype(np.float32)).astype(
        getattr(mx, feat_dtype)
    )
    dtype = None if out_dtype is None else getattr(mx, out_dtype)
    try:
        out = devoxelize(vf, pvm, interpolation, dtype=dtype)
        mx.eval(out)
    except MlxLatticeError:
        event("devoxelize: error")
        return
    event(f"devoxelize: checked {interpolation}")
    assert feat_dtype in FLOAT_DTYPES and n == len(coords) and interpolation != "cubic"
    assert out_dtype in (None, *FLOAT_DTYPES)
    assert out.dtype == (vf.dtype if dtype is None else dtype)
    f = np.array(vf.astype(mx.float32)).astype(np.float64)
    f_pad = np.concatenate([f, np.zeros((1, channels))])  # row -1: zeros
    if interpolation == "linear":
        ref = np.einsum("pc,pck->pk", got_w, f_pad[got_rows])
        scale = np.einsum("pc,pck->pk", got_w, np.abs(f_pad[got_rows]))
    else:
        ref = f_pad[got_near]
        scale = np.abs(ref)
    got = np.array(out.astype(mx.float32))
    assert got.shape == ref.shape
    tol = TOLERANCE[out_dtype or feat_dtype]
    assert (np.abs(got - ref) <= tol * scale + 1e-30).all(), interpolation


_MODEL_FILE: dict[str, bytes] = {}


def _saved_model_bytes(tmp: Path) -> bytes:
    """The bytes of a small saved MinkUNet (built and written once per process)."""
    if "bytes" not in _MODEL_FILE:
        from mlx_lattice.models import MinkUNet, save_model

        mx.random.seed(0)
        model = MinkUNet(2, 3, widths=(4, 8))
        path = tmp / "original.safetensors"
        save_model(path, model, voxel_size=0.5, class_names=["a", "b", "c"])
        _MODEL_FILE["bytes"] = path.read_bytes()
        _MODEL_FILE["arrays"] = dict(mx.load(str(path)))
    return _MODEL_FILE["bytes"]


@fuzz(150, **_DAMAGE)
def test_load_model_on_damaged_files(tmp_path_factory, cut, edits):
    """load_model on a saved model file with bytes replaced (in the length
    prefix, the JSON header or the arrays) and/or truncated anywhere: the
    model loads with every array bit-identical to the saved one, or
    ModelFileError (an MlxLatticeError) is raised; never another exception
    or a crash."""
    from mlx.utils import tree_flatten

    from mlx_lattice.models import ModelFileError, load_model

    assert issubclass(ModelFileError, MlxLatticeError)
    tmp = tmp_path_factory.mktemp("model")
    data = _damaged(_saved_model_bytes(tmp), cut, edits)
    path = tmp / "damaged.safetensors"
    path.write_bytes(data)
    try:
        loaded = load_model(path)
    except ModelFileError:
        event("load_model: error")
        return
    event("load_model: loaded")
    got = dict(tree_flatten(loaded.model.parameters()))
    want = _MODEL_FILE["arrays"]
    assert set(got) == set(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert np.array_equal(np.array(got[name]).view(np.uint8), np.array(array).view(np.uint8)), name
    assert loaded.architecture == "MinkUNet" and loaded.class_names == ("a", "b", "c")
    assert loaded.voxel_size == 0.5


_ARTIFACT: dict[str, object] = {}


def _artifact_bytes(tmp: Path) -> bytes:
    """The bytes of a small exported SPVCNN, int4 weight-only and w8a8 with a
    calibrated static scale (built and written once per process)."""
    if "bytes" not in _ARTIFACT:
        import quantrules as qr
        from mlx_lattice import calibrate_activation_scales, export, quantize
        from mlx_lattice.models import SPVCNN, point_cloud_input

        mx.random.seed(0)
        model = SPVCNN(2, 3, widths=(4, 8)).eval()
        rules = [
            qr.Rule(module_path="encoder/.*", weight_qtype="int8", act_qtype="int8",
                    act_static_scale=True, tile_size=32),
            qr.Rule(weight_qtype="int4", tile_size=32),
        ]
        quantize(model, rules, allow_growth=True)
        pts = np.random.default_rng(0).uniform(0, 2, (60, 3)).astype(np.float32)
        calibrate_activation_scales(model, [point_cloud_input(pts, np.ones((60, 2), np.float32), 0.5)])
        path = tmp / "original.mlxl"
        export.export_model(model, path, voxel_size=0.5, features="occupancy,height")
        _ARTIFACT["bytes"] = path.read_bytes()
        loaded = export.load(path)
        _ARTIFACT["tensors"] = loaded.tensors
        _ARTIFACT["graph"] = loaded.graph
        _ARTIFACT["points"] = pts
        _ARTIFACT["scores"] = np.array(loaded.predict_points(pts, np.ones((60, 2), np.float32)))
    return _ARTIFACT["bytes"]  # type: ignore[return-value]


@fuzz(150, **_DAMAGE)
def test_export_load_on_damaged_artifacts(tmp_path_factory, cut, edits):
    """export.load on an exported artifact with bytes replaced (in the length
    prefix, the JSON header with the graph, or the tensors) and/or truncated
    anywhere: it loads with the same graph and every tensor bit-identical,
    and scores points as the original did, or ExportError (an
    MlxLatticeError) is raised; never another exception or a crash."""
    from mlx_lattice import export

    assert issubclass(export.ExportError, MlxLatticeError)
    tmp = tmp_path_factory.mktemp("artifact")
    data = _damaged(_artifact_bytes(tmp), cut, edits)
    path = tmp / "damaged.mlxl"
    path.write_bytes(data)
    try:
        net = export.load(path)
    except export.ExportError:
        event("export.load: error")
        return
    event("export.load: loaded")
    want = _ARTIFACT["tensors"]
    assert net.graph == _ARTIFACT["graph"]
    assert set(net.tensors) == set(want)
    for name, array in want.items():
        got = net.tensors[name]
        assert got.dtype == array.dtype and got.shape == array.shape, name
        same = np.array(got.reshape(-1).view(mx.uint8)) == np.array(array.reshape(-1).view(mx.uint8))
        assert same.all(), name
    scores = net.predict_points(_ARTIFACT["points"], np.ones((60, 2), np.float32))
    assert np.array_equal(np.array(scores), _ARTIFACT["scores"])


def _norm_ref(kind, x, w, b, eps, training, relu):
    """The documented norm in float64: batch norm over rows (biased variance
    in training, running statistics 0 and 1 in eval), layer norm and RMS norm
    over each row's channels; then the affine map and the optional ReLU."""
    if kind == "batch":
        mean, var = (x.mean(0), x.var(0)) if training else (0.0, 1.0)
        y = (x - mean) / np.sqrt(var + eps)
    elif kind == "layer":
        y = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + eps)
    else:
        y = x / np.sqrt((x * x).mean(1, keepdims=True) + eps)
    y = y * (1.0 if w is None else w) + (0.0 if b is None else b)
    return np.maximum(y, 0.0) if relu else y


@fuzz(
    200,
    kind=st.sampled_from(["batch", "layer", "rms"]),
    rows=st.integers(0, 6),
    channels=st.integers(0, 4),
    layer_channels_delta=st.sampled_from([0, 0, 0, 1]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    affine=st.booleans(),
    training=st.booleans(),
    relu=st.booleans(),
    feat_scale=st.sampled_from([1.0, 1e-3, 1e3]),
    data_seed=st.integers(0, 2**32 - 1),
)
def test_norm_layers_match_numpy(kind, rows, channels, layer_channels_delta, dtype, affine,
                                 training, relu, feat_scale, data_seed):
    """nn.BatchNorm (training and eval, with its fused ReLU), nn.LayerNorm and
    nn.RMSNorm on sparse tensors with any row and channel count (empty
    included), every float dtype and affine or not: the float64 NumPy norm
    of the features' exact values in the features' dtype, within float32
    rounding amplified by 1/sqrt(var + eps) plus one rounding to the dtype;
    BatchNorm's running statistics move by the documented momentum
    (unbiased variance). A layer built for another channel count, and
    BatchNorm training on fewer than two rows, raise MlxLatticeError."""
    from mlx_lattice import nn as lnn

    rng = np.random.default_rng(data_seed)
    width = channels + layer_channels_delta
    eps = 1e-5
    if kind == "batch":
        layer = lnn.BatchNorm(width, affine=affine) if width else None
    elif kind == "layer":
        layer = lnn.LayerNorm(width, affine=affine)
    else:
        layer = lnn.RMSNorm(width)
        affine = True
    if layer is None:
        return  # mlx.nn.BatchNorm(0) is MLX's own constructor
    if kind == "layer" and not affine:
        layer_channels_delta = 0  # no parameters: any channel count fits
    w = b = None
    if affine:
        # Multiples of 1/8: exact in every float dtype (the layers cast them).
        w = rng.integers(-8, 9, width) / 8.0
        layer.weight = mx.array(w.astype(np.float32))
        if kind != "rms":
            b = rng.integers(-8, 9, width) / 8.0
            layer.bias = mx.array(b.astype(np.float32))
    layer.train(training)
    coords = np.stack([np.zeros(rows), np.arange(rows), np.zeros(rows), np.zeros(rows)], 1)
    feats = mx.array((rng.standard_normal((rows, channels)) * feat_scale).astype(np.float32))
    feats = feats.astype(getattr(mx, dtype))
    x = SparseTensor(coords.astype(np.int32), feats)
    use_relu = relu and kind == "batch"
    try:
        out = layer.relu(x) if use_relu else layer(x)
        mx.eval(out.feats)
    except MlxLatticeError:
        event("norm: error")
        assert layer_channels_delta != 0 or channels == 0 or (kind == "batch" and training and rows < 2)
        return
    assert layer_channels_delta == 0
    event(f"norm: checked {kind}")
    f = np.array(feats.astype(mx.float32)).astype(np.float64)
    got = np.array(out.feats.astype(mx.float32))
    assert out.feats.dtype == feats.dtype and got.shape == f.shape
    if rows == 0 or channels == 0:
        return
    stats_training = training and kind == "batch"
    ref = _norm_ref(kind, f, w, b, eps, stats_training, use_relu)
    if kind == "batch":
        var = f.var(0) if stats_training else np.ones(channels)
    elif kind == "layer":
        var = f.var(1, keepdims=True)
    else:
        var = (f * f).mean(1, keepdims=True)
    amplify = np.abs(f).max() / np.sqrt(var + eps) * (1.0 if w is None else np.abs(w).max())
    # Half-precision norms apply weight and bias in the features' dtype: a
    # rounding relative to each term, not to their (cancelling) sum.
    terms = np.abs(_norm_ref(kind, f, None, None, eps, stats_training, False))
    terms = terms * (1.0 if w is None else np.abs(w)) + (0.0 if b is None else np.abs(b))
    bound = TOLERANCE[dtype] * (terms + np.abs(ref)) + 1e-6 * (amplify + 1)
    assert (np.abs(got - ref) <= bound).all(), (np.abs(got - ref) - bound).max()
    if stats_training and rows > 1:
        mean_ref = 0.1 * f.mean(0)
        var_ref = 0.9 + 0.1 * f.var(0, ddof=1)
        np.testing.assert_allclose(np.array(layer.running_mean), mean_ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.array(layer.running_var), var_ref, rtol=1e-5, atol=1e-6)


def _offset_triples(size, dilation, tensor_stride):
    """x-major kernel offsets ``(i - (size - 1) // 2) * dilation * tensor_stride``."""
    return [
        tuple((i[a] - (size[a] - 1) // 2) * dilation[a] * tensor_stride[a] for a in range(3))
        for i in itertools.product(*(range(s) for s in size))
    ]


def _triple(value):
    return (value,) * 3 if isinstance(value, int) else tuple(value)


@fuzz(
    150,
    rows=coordinate_rows,
    out_rows=st.none() | coordinate_rows,
    kind=st.sampled_from(["forward", "target"]),
    kernel_size=st.integers(1, 3) | st.integers(4, 7) | st.tuples(*[st.integers(1, 7)] * 3),
    stride=st.integers(1, 3) | st.tuples(*[st.integers(1, 3)] * 3),
    dilation=st.integers(1, 2),
    tensor_stride=st.sampled_from([1, 1, 2, (1, 2, 1)]),
    ordered=st.booleans(),
)
def test_forward_and_target_relations_match_brute_force(rows, out_rows, kind, kernel_size,
                                                        stride, dilation, tensor_stride, ordered):
    """build_kernel_relation(kind='forward') (strides 1-3, kernel sizes 1-7,
    dilations 1-2, given or computed outputs) and kind='target' (the
    transpose, onto given outputs) on coordinates that are empty, duplicated
    or at the int32 limits: the computed outputs are the inputs floored to
    multiples of tensor_stride * stride, unique and ascending by (batch,
    x, y, z) (the inputs themselves with stride 1), and
    the edges are exactly the brute-force set (forward: p == q + offset,
    target: p == q - offset, same batch, int64 arithmetic), or
    MlxLatticeError (duplicate rows, target without outputs). ``ordered``
    sorts the inputs first (ascending inputs take the merge of slabs instead
    of the radix sort)."""
    if ordered:
        rows = sorted(rows)
    given = np.array(rows, np.int64).reshape(-1, 4).astype(np.int32)
    outs = None if out_rows is None else np.array(out_rows, np.int64).reshape(-1, 4).astype(np.int32)
    strides = stride if kind == "forward" else 1
    try:
        rel = build_kernel_relation(given, outs, kernel_size=kernel_size, stride=strides,
                                    dilation=dilation, tensor_stride=tensor_stride, kind=kind)
        mx.eval(rel.edges.in_rows, rel.edges.out_rows, rel.edges.kernel_ids, rel.out_coords)
    except MlxLatticeError:
        event(f"{kind}: error")
        return
    event(f"{kind}: checked ({'given' if outs is not None else 'computed'} outputs)")
    assert len(set(rows)) == len(rows), "duplicate inputs were accepted"
    size, dil, ts = _triple(kernel_size), _triple(dilation), _triple(tensor_stride)
    step = [t * s for t, s in zip(ts, _triple(strides), strict=True)]
    if outs is None:
        assert kind == "forward", "target without outputs was accepted"
        # Stride 1: the outputs are the inputs (not floored to tensor_stride);
        # else the floored inputs, unique and ascending.
        want_out = sorted(
            {(r[0], *(r[1 + a] // step[a] * step[a] for a in range(3))) for r in rows}
        )
        if step == list(ts):
            want_out = list(rows)
    else:
        assert len(set(out_rows)) == len(out_rows), "duplicate outputs were accepted"
        want_out = list(out_rows)
    got_out = [tuple(r) for r in np.array(rel.out_coords).astype(np.int64).tolist()]
    assert got_out == want_out
    sign = 1 if kind == "forward" else -1
    expected = set()
    for k, off in enumerate(_offset_triples(size, dil, ts)):
        for i, p in enumerate(rows):
            for o, q in enumerate(want_out):
                if p[0] == q[0] and all(p[1 + a] == q[1 + a] + sign * off[a] for a in range(3)):
                    expected.add((i, o, k))
    assert _edge_set(rel) == expected
    assert rel.n_out_capacity == len(want_out) and rel.n_kernels == len(_offset_triples(size, dil, ts))
    if kind == "forward":
        # Its transpose (KernelRelation.transposed): the same edges reversed.
        up = rel.transposed()
        assert _edge_set(up) == {(o, i, k) for i, o, k in expected}
        assert (up.n_in, up.n_out_capacity) == (len(want_out), len(rows))


# Fields of a KernelRelation the native ops read (validated unless built).
RELATION_FIELDS = [
    "in_rows", "out_rows", "kernel_ids",
    "output_offsets", "input_offsets", "input_edge_ids", "kernel_offsets", "kernel_edge_ids",
]


def _corrupt(array: mx.array, how: str, where: int, bound: int) -> mx.array:
    """``array`` with one defect: a value out of range, another dtype, or
    one element too few or too many."""
    a = np.array(array).astype(np.int64)
    if how == "dtype":
        return mx.array(a.astype([np.int64, np.float32, np.uint32, np.int16][where % 4]))
    if how == "shorter":
        return mx.array(a[:-1].astype(np.int32)) if len(a) else mx.array(np.array([0], np.int32))
    if how == "longer":
        return mx.array(np.append(a, a[-1] if len(a) else 0).astype(np.int32))
    if how == "2d":
        return mx.array(a.astype(np.int32).reshape(1, -1))
    value = {"negative": -1, "bound": bound, "big": bound + 1000, "min": I32_MIN, "max": I32_MAX}[how]
    if not len(a):
        return mx.array(np.array([value], np.int32))
    a[where % len(a)] = value
    return mx.array(a.astype(np.int32))


@fuzz(
    200,
    rows=st.lists(st.tuples(st.just(0), *[st.integers(0, 2)] * 3), unique=True, min_size=1,
                  max_size=8),
    kind=st.sampled_from(["submanifold", "forward"]),
    field_name=st.sampled_from(RELATION_FIELDS),
    how=st.sampled_from(["negative", "bound", "big", "min", "max", "dtype", "shorter", "longer",
                         "2d"]),
    where=st.integers(0, 2**16),
    op=st.sampled_from(["conv", "pool", "quantized", "transposed"]),
)
def test_corrupted_relation_raises(rows, kind, field_name, how, where, op):
    """A valid relation with one index array corrupted (a negative, out of
    range or int32-limit value, another dtype, one element too few or too
    many, a 2-D array), rebuilt with dataclasses.replace, makes the float
    convolution, the pooling, the quantized convolution and the transpose
    raise MlxLatticeError: never a result, never a crash."""
    import dataclasses

    from mlx_lattice.core import QuantizedWeight
    from mlx_lattice.core import ops as core_ops

    coords = np.array(rows, np.int32).reshape(-1, 4)
    rel = build_kernel_relation(coords, kernel_size=3, stride=2 if kind == "forward" else 1,
                                kind=kind)
    n_out, n_edges = int(rel.n_out_capacity), rel.n_edges
    csr = {"output": rel.output_csr, "input": rel.input_csr, "kernel": rel.kernel_csr}
    bounds = {
        "in_rows": len(coords), "out_rows": n_out, "kernel_ids": 27,
        "output_offsets": n_edges + 1, "input_offsets": n_edges + 1, "kernel_offsets": n_edges + 1,
        "input_edge_ids": n_edges, "kernel_edge_ids": n_edges,
    }
    if field_name in ("in_rows", "out_rows", "kernel_ids"):
        bad = _corrupt(getattr(rel.edges, field_name), how, where, bounds[field_name])
        changes = {"edges": dataclasses.replace(rel.edges, **{field_name: bad})}
    else:
        group, part = field_name.split("_", 1)
        old = csr[group]
        key = "row_offsets" if part == "offsets" else "edge_ids"
        bad = _corrupt(getattr(old, key), how, where, bounds[field_name])
        changes = {f"{group}_csr": dataclasses.replace(old, **{key: bad})}
    broken = dataclasses.replace(rel, **changes)
    feats = mx.ones((len(coords), 32))
    try:
        if op == "conv":
            out = core_ops.sparse_conv_features_from_relation(feats, mx.ones((27, 32, 4)), broken)
        elif op == "pool":
            out = core_ops.sparse_pool_features_from_relation(
                feats, broken, input_exclusive=False, mode="max"
            )
        elif op == "transposed":
            out = broken.transposed().edges.in_rows
        else:
            qw = QuantizedWeight.from_float(mx.ones((27, 32, 4)), bits=8, group_size=32)
            out = core_ops.sparse_quantized_conv_features_from_relation(feats, qw, broken)
        mx.eval(out)
    except MlxLatticeError:
        event(f"corrupt {field_name}: error")
        return
    raise AssertionError(f"{op} returned a result on a relation with {field_name} corrupted ({how})")


@fuzz(
    150,
    rows=st.lists(st.tuples(st.just(0), *[st.integers(0, 2)] * 3), unique=True, max_size=6),
    cin=st.integers(1, 40),
    cout=st.integers(1, 3),
    bits=st.sampled_from([2, 4, 8]),
    group_size=st.sampled_from([32, 64]),
    field_name=st.sampled_from(["none", "bits", "group_size", "in_channels", "out_channels",
                                "storage_in_channels", "scales", "biases", "weight"]),
    new_bits=st.integers(0, 9),
    new_size=st.sampled_from([0, 16, 32, 64, 128, 256]),
    delta=st.sampled_from([-1, 1, 32, -32]),
    array_change=st.sampled_from(["shape", "dtype", "transpose"]),
    data_seed=st.integers(0, 2**32 - 1),
)
def test_quantized_weight_with_inconsistent_fields(rows, cin, cout, bits, group_size, field_name,
                                                   new_bits, new_size, delta, array_change,
                                                   data_seed):
    """A QuantizedWeight whose bits, group size, channel counts, packed
    weight, scales or biases do not match one another (another value,
    shape, dtype or layout) either raises MlxLatticeError (at construction
    or in sparse_quantized_conv_features_from_relation), or the convolution
    equals the float64 convolution with mx.dequantize of the accepted
    fields, within float32 rounding."""
    from mlx_lattice.core import QuantizedWeight
    from mlx_lattice.core import ops as core_ops

    rng = np.random.default_rng(data_seed)
    good = QuantizedWeight.from_float(
        mx.array(rng.standard_normal((27, cin, cout)).astype(np.float32)),
        bits=bits, group_size=group_size,
    )
    fields = {f: getattr(good, f) for f in ("weight", "scales", "biases", "in_channels",
                                             "out_channels", "storage_in_channels", "group_size",
                                             "bits")}
    if field_name == "bits":
        fields["bits"] = new_bits
    elif field_name == "group_size":
        fields["group_size"] = new_size
    elif field_name in ("in_channels", "out_channels", "storage_in_channels"):
        fields[field_name] = fields[field_name] + delta
    elif field_name in ("scales", "biases", "weight"):
        a = fields[field_name]
        if array_change == "shape":
            a = a[:, :, :-1] if a.shape[2] > 1 else mx.concatenate([a, a], axis=2)
        elif array_change == "dtype":
            a = a.astype(mx.float16 if field_name != "weight" else mx.int32)
        else:
            a = mx.swapaxes(a, 0, 1)
        fields[field_name] = a
    coords = np.array(rows, np.int32).reshape(-1, 4)
    rel = build_kernel_relation(coords, kernel_size=3)
    feats_np = rng.standard_normal((len(coords), max(fields["in_channels"], 0))).astype(np.float32)
    try:
        qw = QuantizedWeight(**fields)
        out = core_ops.sparse_quantized_conv_features_from_relation(mx.array(feats_np), qw, rel)
        mx.eval(out)
    except MlxLatticeError:
        event(f"quantized {field_name}: error")
        return
    event(f"quantized {field_name}: checked")
    full = mx.dequantize(qw.weight, qw.scales, qw.biases, group_size=qw.group_size, bits=qw.bits)
    w = np.array(full.astype(mx.float32))[:, :, : qw.in_channels].transpose(0, 2, 1)
    # Features are cast to the scales' dtype (exact for float32 scales).
    f = np.array(mx.array(feats_np).astype(qw.scales.dtype).astype(mx.float32))
    edges = sorted(_edge_set(rel))
    ref = _conv_ref(f, w, edges, len(coords))
    scale = _conv_ref(np.abs(f), np.abs(w), edges, len(coords))
    got = np.array(out.astype(mx.float32))
    assert got.shape == ref.shape
    tol = TOLERANCE[str(qw.scales.dtype).removeprefix("mlx.core.")]
    assert (np.abs(got - ref) <= tol * (scale + 1) * 4).all()
