"""The Metal kernels, run on the CPU through the MSL harness, against the CPU
kernels (eval_cpu) on seeded random relations. The harness is a test-only
extension (tests/harness_ext.so: the product's sources with eval_cpu running
the Metal encode bodies); the ops layer and mlx_lattice.geometry are pointed
at it for the Metal half of each comparison. With MLX_LATTICE_TEST_GPU=1 (the macOS target
:metal_gpu_tests) the same tests run the Metal kernels on the GPU stream
instead.

Tolerances: float32 paths 1e-5 relative; half inputs 1e-2 (inputs rounded to
half; sums in float32 in another order); the sorted implicit GEMM stages
inputs as half (1e-2). The training batch norm has its own bounds (see
_BN_TOL).
"""

import importlib.util
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_lattice import coords, fused, geometry
from mlx_lattice._native import ext
from mlx_lattice.core import QuantizedWeight, build_kernel_relation, ops

ON_GPU = os.environ.get("MLX_LATTICE_TEST_GPU") == "1"


def _load_harness():
    path = Path(__file__).with_name("harness_ext.so")
    if ON_GPU and not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("harness_ext", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


harness_ext = _load_harness()


@pytest.fixture
def harness():
    """Runs a function with the Metal kernels (harness, or the GPU stream) and
    with the CPU kernels, and returns both results."""

    def on_gpu(fn, expect_groups=True):
        with mx.stream(mx.cpu):
            cpu = fn()
            mx.eval(cpu)
        with mx.stream(mx.gpu):
            gpu = fn()
            mx.eval(gpu)
        return cpu, gpu

    def both(fn, expect_groups=True):
        assert ops.ext is ext and geometry.ext is ext and coords.ext is ext and fused.ext is ext
        cpu = fn()
        mx.eval(cpu)
        before = harness_ext.harness_groups_run()
        ops.ext = geometry.ext = coords.ext = fused.ext = harness_ext
        try:
            gpu = fn()
            mx.eval(gpu)
        finally:
            ops.ext = geometry.ext = coords.ext = fused.ext = ext
        assert (harness_ext.harness_groups_run() > before) == expect_groups  # Metal kernels ran
        return cpu, gpu

    if ON_GPU:
        assert mx.metal.is_available(), "MLX_LATTICE_TEST_GPU=1 needs a Metal device"
        yield on_gpu
    else:
        yield both


def close(a, b, tol):
    a = [a] if isinstance(a, mx.array) else list(a)
    b = [b] if isinstance(b, mx.array) else list(b)
    for x, y in zip(a, b, strict=True):
        x, y = np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))
        assert x.shape == y.shape
        np.testing.assert_allclose(
            y, x, rtol=tol, atol=tol * max(1.0, float(np.abs(x).max(initial=0)))
        )


def rand(rng, shape, dtype=mx.float32, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize(
    ("kind", "ks", "stride"),
    [("submanifold", 3, 1), ("forward", 2, 2), ("forward", 3, 2), ("target", 2, 1)],
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_generic_conv_and_gradients(rng, ref, harness, kind, ks, stride, dtype):
    fine = ref.random_coords(rng, 120, 6, batches=2)
    if kind == "target":
        coarse = build_kernel_relation(fine, kernel_size=2, stride=2, kind="forward").out_coords
        rel = build_kernel_relation(coarse, fine, kernel_size=2, kind="target")
    else:
        rel = build_kernel_relation(fine, kernel_size=ks, stride=stride, kind=kind)
    f = rand(rng, (rel.n_in, 5), dtype)
    w = rand(rng, (rel.n_kernels, 5, 7), dtype, 0.3)
    probe = rand(rng, (rel.n_out_capacity, 7))

    def run():
        out = ops.sparse_conv_features_from_relation(f, w, rel)
        grads = mx.grad(
            lambda a, b: (
                ops.sparse_conv_features_from_relation(a, b, rel).astype(mx.float32) * probe
            ).sum(),
            argnums=(0, 1),
        )(f, w)
        return [out, *grads]

    cpu, gpu = harness(run)
    close(cpu, gpu, 1e-5 if dtype == mx.float32 else 2e-2)


def test_empty_relation_and_rows_without_edges(rng, ref, harness):
    empty = build_kernel_relation(np.zeros((0, 4), np.int32))
    cpu, gpu = harness(
        lambda: ops.sparse_conv_features_from_relation(
            mx.zeros((0, 3)), mx.zeros((27, 3, 4)), empty
        ),
        expect_groups=False,  # nothing to run
    )
    assert gpu.shape == (0, 4)
    coords = ref.random_coords(rng, 30, 4)
    lonely = build_kernel_relation(
        coords, np.array([[0, 50, 50, 50], [0, 0, 0, 0]], np.int32), kind="forward"
    )
    f = rand(rng, (len(coords), 3))
    cpu, gpu = harness(
        lambda: ops.sparse_conv_features_from_relation(f, rand(rng, (27, 3, 4)) * 0 + 1, lonely)
    )
    close(cpu, gpu, 1e-5)
    assert np.all(np.array(gpu)[0] == 0)


@pytest.mark.parametrize("channels", [32, 64])
@pytest.mark.parametrize("store_sorted", [False, True])
def test_sorted_implicit_gemm_with_simdgroup_mma(rng, ref, harness, channels, store_sorted):
    # Exactly 33 and 65 rows: a last tile with a single row. 32 isolated
    # voxels (only the centre offset) sort into one tile: offsets absent from
    # a whole tile.
    isolated = np.array([[0, 100 + 10 * i, 100, 100] for i in range(32)], np.int32)
    for n in (33, 65):
        cells = rng.choice(9**3, n - 32, replace=False)
        grid = np.stack([np.zeros(n - 32), cells // 81, cells // 9 % 9, cells % 9], 1)
        coords = np.concatenate([isolated, grid.astype(np.int32)])
        rel = build_kernel_relation(coords)
        assert rel.n_out_capacity == n
        masks = np.array(rel.require_sorted_implicit_gemm().tile_masks).astype(np.uint32)
        assert any(bin(int(m)).count("1") < 27 for m in masks)
        f = rand(rng, (rel.n_in, channels), mx.float16)
        w = rand(rng, (27, channels, channels), mx.float16, 0.05)

        def run(f=f, w=w, rel=rel):
            return ops.sparse_conv_features_sorted_from_relation(
                f, w, rel, store_sorted=store_sorted
            )

        cpu, gpu = harness(run)
        close(cpu, gpu, 1e-2)
        # And against the reference built from MLX ops over the same view.
        reference = ops.sparse_conv_features_sorted_direct_reference_from_relation(
            f, w, rel, store_sorted=store_sorted
        )
        close(reference, gpu, 1e-2)
    # Gradients through the GPU path (the sorted vjp runs the generic kernels).
    probe = rand(rng, (rel.n_out_capacity, channels))

    def grads():
        return mx.grad(
            lambda a: (
                ops.sparse_conv_features_sorted_from_relation(a, w, rel).astype(mx.float32) * probe
            ).sum()
        )(f)

    cpu, gpu = harness(grads)
    close(cpu, gpu, 2e-2)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_conv(rng, ref, harness, bits):
    coords = ref.random_coords(rng, 150, 6, batches=2)
    rel = build_kernel_relation(coords)
    qw = QuantizedWeight.from_float(rand(rng, (27, 40, 6)), bits=bits, group_size=32)
    f = rand(rng, (rel.n_in, 40))
    probe = rand(rng, (rel.n_out_capacity, 6))

    def run():
        out = ops.sparse_quantized_conv_features_from_relation(f, qw, rel)
        g = mx.grad(
            lambda a: (ops.sparse_quantized_conv_features_from_relation(a, qw, rel) * probe).sum()
        )(f)
        return [out, g]

    cpu, gpu = harness(run)
    close(cpu, gpu, 1e-5)


def test_denominator_and_its_gradient(rng, ref, harness):
    coords = ref.random_coords(rng, 150, 6)
    rel = build_kernel_relation(coords)
    w = rand(rng, (27, 4, 3))
    probe = rand(rng, (rel.n_out_capacity, 3))

    def run():
        native = ops.ext  # the product or the harness extension
        den = native.sparse_conv_normalization_denominator(w, rel)
        g = mx.grad(lambda b: (native.sparse_conv_normalization_denominator(b, rel) * probe).sum())(
            w
        )
        return [den, g]

    cpu, gpu = harness(run)
    close(cpu, gpu, 1e-5)


@pytest.mark.parametrize("mode", ["max", "avg", "sum"])
def test_pooling_and_gradients(rng, ref, harness, mode):
    coords = ref.random_coords(rng, 150, 6, batches=2)
    rel = build_kernel_relation(coords, kernel_size=3, stride=2, kind="forward")
    f = rand(rng, (rel.n_in, 5))
    t = rand(rng, (rel.n_in, 5))
    probe = rand(rng, (rel.n_out_capacity, 5))

    def pool(a):
        return ops.sparse_pool_features_from_relation(a, rel, input_exclusive=False, mode=mode)

    def run():
        out = pool(f)
        g = mx.grad(lambda a: (pool(a) * probe).sum())(f)
        _, (tan,) = mx.jvp(pool, [f], [t])
        return [out, g, tan]

    cpu, gpu = harness(run)
    close(cpu, gpu, 1e-5)


@pytest.mark.parametrize(
    ("n_points", "batches", "channels", "drop"),
    [(1, 1, 3, 0.0), (300, 2, 5, 0.3), (200, 3, 40, 0.6)],
)
def test_geometry_voxelize_and_devoxelize(rng, harness, n_points, batches, channels, drop):
    """geometry.metal against the CPU kernels: the voxel reduction in every
    mode (values, gradient, and the point each max/first picked, read from
    the jvp of a tangent holding point index + 1), devoxelize (linear and
    nearest) and its transpose (the vjp). Cases: a single point; several
    batches with voxels dropped from the map (missing corners, points with no
    voxel at all); channels across threadgroups (40 > 32)."""
    points = rng.uniform(-2.0, 2.0, (n_points, 3))
    batch = rng.integers(0, batches, n_points).astype(np.int32)
    size, origin = (0.5, 0.7, 0.6), (0.1, -0.2, 0.0)
    vox = geometry.quantize_points(points, size, origin=origin, batch=batch)
    coords = np.array(vox.coords)
    kept = coords[rng.uniform(size=len(coords)) >= drop]
    pvm = geometry.point_voxel_map(points, kept, size, origin=origin, batch=batch)
    feats = rand(rng, (n_points, channels))
    probe = rand(rng, (vox.num_voxels, channels))
    index_plus_one = mx.broadcast_to(
        mx.arange(1, n_points + 1, dtype=mx.float32)[:, None], (n_points, channels)
    )
    vf = rand(rng, (len(kept), channels))
    g = rand(rng, (n_points, channels))
    reduces = ("sum", "mean", "max", "first")

    def run():
        out = []
        for reduce in reduces:

            def voxelize(f, reduce=reduce):
                return geometry.voxelize(f, vox, reduce)

            out.append(voxelize(feats))
            out.append(mx.grad(lambda f, v=voxelize: (v(f) * probe).sum())(feats))
            out.append(mx.jvp(voxelize, [feats], [index_plus_one])[1][0])
        for interpolation in ("linear", "nearest"):

            def devoxelize(v, interpolation=interpolation):
                return geometry.devoxelize(v, pvm, interpolation)

            out.append(devoxelize(vf))
            out.append(mx.vjp(devoxelize, [vf], [g])[1][0])
        return out

    cpu, gpu = harness(run)
    close(cpu, gpu, 1e-6)
    for i, reduce in enumerate(reduces):
        if reduce in ("max", "first"):  # the picked points, exactly
            picks = np.array(gpu[3 * i + 2])
            np.testing.assert_array_equal(picks, np.array(cpu[3 * i + 2]))
            assert picks.min(initial=1) >= 1 and picks.max(initial=n_points) <= n_points


def _knn_reference(q, qb, s, sb, k):
    """Brute force in float64: per query, (squared distance, row) of the k
    nearest support points of its batch."""
    out = []
    for i in range(len(q)):
        rows = np.flatnonzero(sb == qb[i])
        d = ((s[rows] - q[i]) ** 2).sum(1)
        out.append(sorted(zip(d.tolist(), rows.tolist(), strict=True))[:k])
    return out


def _knn_arrays(q, s, k, qb, sb):
    rel = geometry.knn_relation(q, s, k, query_batch=qb, support_batch=sb)
    return [
        rel.edges.in_rows,
        rel.edges.out_rows,
        rel.edges.kernel_ids,
        rel.output_csr.row_offsets,
        rel.input_csr.row_offsets,
        rel.counts,
    ]


@pytest.mark.parametrize(("k", "batches"), [(1, 1), (5, 2), (16, 3), (64, 2)])
def test_geometry_knn_on_lattice_points(rng, harness, k, batches):
    """geometry_search.metal's grid kNN against the CPU kernel and brute
    force on lattice points, where float32 squared distances are exact: the
    results must be identical, ties (many: small integer lattice, duplicate
    points) broken by (distance, row). Also: a query batch without support,
    batches with fewer than k points, and queries far outside the grid."""
    s = rng.integers(-6, 7, (260, 3)).astype(np.float64)
    q = rng.integers(-8, 9, (90, 3)).astype(np.float64) + rng.choice([0.0, 0.5], (90, 3))
    q[:3] = [[400.0, -3.0, 2.5], [-1000.0, 1000.0, 0.0], [2.5, 2.5, -64.0]]
    sb = rng.integers(0, batches, len(s)).astype(np.int32)
    sb[:4] = batches  # a batch of 4 support points
    qb = rng.integers(0, batches + 2, len(q)).astype(np.int32)  # batches + 1 has no support
    cpu, gpu = harness(lambda: _knn_arrays(q, s, k, qb, sb))
    for a, b in zip(cpu, gpu, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    ref = _knn_reference(q, qb, s, sb, k)
    in_rows, out_rows, kernel_ids = (np.array(a) for a in gpu[:3])
    got = [[] for _ in q]
    for i, o, r in zip(in_rows.tolist(), out_rows.tolist(), kernel_ids.tolist(), strict=True):
        assert r == len(got[o])
        got[o].append(i)
    assert got == [[r for _, r in row] for row in ref]


def test_geometry_knn_on_float_points(rng, harness):
    """Random float points: the kernel computes in float32, the CPU in
    float64. Neighbour lists agree exactly wherever the reference's
    consecutive distances (up to rank k + 1) differ by more than float32
    rounding (1e-5 relative); the few queries with closer gaps are skipped."""
    k = 12
    s = rng.normal(0.0, 3.0, (500, 3)) * [4.0, 4.0, 0.5]  # a flat, surface-like cloud
    q = rng.normal(0.0, 3.5, (120, 3)) * [4.0, 4.0, 0.5]
    qb = rng.integers(0, 2, len(q)).astype(np.int32)
    sb = rng.integers(0, 2, len(s)).astype(np.int32)
    cpu, gpu = harness(lambda: _knn_arrays(q, s, k, qb, sb))
    ref = _knn_reference(q, qb, s, sb, k + 1)
    rows_of = {}
    for name, arrays in (("cpu", cpu), ("gpu", gpu)):
        in_rows, out_rows = np.array(arrays[0]), np.array(arrays[1])
        rows_of[name] = [in_rows[out_rows == i].tolist() for i in range(len(q))]
    compared = 0
    for i, row in enumerate(ref):
        d = np.array([x for x, _ in row])
        if len(d) > 1 and np.min(np.diff(d) / np.maximum(d[1:], 1e-30)) < 1e-5:
            continue
        expected = [r for _, r in row[:k]]
        assert rows_of["cpu"][i] == expected and rows_of["gpu"][i] == expected, i
        compared += 1
    assert compared > 100


def test_geometry_knn_gpu_limits(harness):
    """The Metal kernel keeps at most 64 neighbours per query: larger k raise
    the library's error where it would run (CPU streams have no limit). An
    empty support gives every query no neighbour on both paths."""
    pts = np.zeros((70, 3))
    with pytest.raises(geometry.GeometryError, match="k must be <= 64"):
        harness(lambda: _knn_arrays(pts, pts, 65, None, None))
    cpu, gpu = harness(lambda: _knn_arrays(pts[:5], np.zeros((0, 3)), 3, None, None))
    for a, b in zip(cpu, gpu, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    assert np.array(gpu[0]).size == 0 and np.array(gpu[3]).tolist() == [0] * 6


@pytest.mark.parametrize(("r", "cap"), [(1.5, 8), (2.5, 64)])
def test_geometry_radius_with_cap_on_lattice_points(rng, harness, r, cap):
    """radius_relation with max_neighbors runs the kNN kernel bounded by the
    radius: identical to the CPU kernel and to brute force (the nearest
    ``cap`` within ``r``, by distance then row) on lattice points."""
    s = rng.integers(-5, 6, (220, 3)).astype(np.float64)
    q = rng.integers(-7, 8, (80, 3)).astype(np.float64) + rng.choice([0.0, 0.5], (80, 3))
    sb = rng.integers(0, 2, len(s)).astype(np.int32)
    qb = rng.integers(0, 3, len(q)).astype(np.int32)  # batch 2 has no support

    def run():
        rel = geometry.radius_relation(q, s, r, cap, query_batch=qb, support_batch=sb)
        return [rel.edges.in_rows, rel.edges.out_rows, rel.edges.kernel_ids, rel.counts]

    cpu, gpu = harness(run)
    for a, b in zip(cpu, gpu, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    in_rows, out_rows = np.array(gpu[0]), np.array(gpu[1])
    ref = _knn_reference(q, qb, s, sb, len(s))
    for i, row in enumerate(ref):
        expected = [j for d, j in row if d <= r * r][:cap]
        assert in_rows[out_rows == i].tolist() == expected, i


@pytest.mark.parametrize(("r", "cap"), [(1.5, None), (2.5, None), (3.0, 100), (0.25, None)])
def test_geometry_radius_uncapped_on_lattice_points(rng, harness, r, cap):
    """radius_relation without a cap (or with one above 64): the two-pass
    radius kernel (count, prefix sum read back, sorted fill) identical to the
    CPU kernel and to brute force on lattice points (float32 distances exact
    there), ties by distance then row; a batch without support, queries far
    outside the grid, duplicate support points."""
    s = rng.integers(-5, 6, (240, 3)).astype(np.float64)
    s[200:] = s[:40]  # duplicates: equal distances, ordered by row
    q = rng.integers(-7, 8, (90, 3)).astype(np.float64) + rng.choice([0.0, 0.5], (90, 3))
    q[:2] = [[500.0, 0.0, 0.0], [-3.0, 2.0, -900.0]]
    sb = rng.integers(0, 2, len(s)).astype(np.int32)
    qb = rng.integers(0, 3, len(q)).astype(np.int32)  # batch 2 has no support

    def run():
        rel = geometry.radius_relation(q, s, r, cap, query_batch=qb, support_batch=sb)
        return [rel.edges.in_rows, rel.edges.out_rows, rel.edges.kernel_ids, rel.counts]

    cpu, gpu = harness(run)
    _equal(cpu, gpu)
    in_rows, out_rows = np.array(gpu[0]), np.array(gpu[1])
    ref = _knn_reference(q, qb, s, sb, len(s))
    total = 0
    for i, row in enumerate(ref):
        expected = [j for d, j in row if d <= r * r][: cap or len(s)]
        assert in_rows[out_rows == i].tolist() == expected, i
        total += len(expected)
    assert total == len(in_rows) and (total > 0 or r < 1)


def _morton_reference(x, y, z):
    code = 0
    for bit in range(21):
        for shift, v in ((2, x), (1, y), (0, z)):
            code |= (((v + 2**20) >> bit) & 1) << (3 * bit + shift)
    return code


@pytest.mark.parametrize("n", [0, 1, 700])
def test_geometry_morton_codes(rng, harness, n):
    """geometry_search.metal's Morton codes against the CPU kernel and a
    bit-interleaving reference (range ends and negatives included)."""
    c = np.concatenate(
        [rng.integers(0, 3, (n, 1)), rng.integers(-(2**20), 2**20, (n, 3))], 1
    ).astype(np.int32)
    ends = np.array([[-(2**20)] * 3, [2**20 - 1] * 3, [-1, 0, 1], [0, 0, 0]], np.int32)
    c[:4, 1:] = ends[: len(c)]
    cpu, gpu = harness(lambda: coords.morton_codes(c), expect_groups=n > 0)
    assert np.array(gpu).dtype == np.int64
    np.testing.assert_array_equal(np.array(cpu), np.array(gpu))
    assert np.array(gpu).tolist() == [_morton_reference(*r[1:]) for r in c.tolist()]
    with pytest.raises(coords.CoordinateError, match="Morton range"):
        harness(lambda: coords.morton_codes(np.array([[0, 2**20, 0, 0]])))


def _distinct_rows(rng, n, batches, lo=-40, hi=40):
    c = np.concatenate(
        [rng.integers(0, batches, (3 * n, 1)), rng.integers(lo, hi, (3 * n, 3))], 1
    ).astype(np.int32)
    _, first = np.unique(c, axis=0, return_index=True)
    return c[np.sort(first)][:n]  # distinct, in random order


def _equal(cpu, gpu):
    for a, b in zip(cpu, gpu, strict=True):
        a, b = np.array(a), np.array(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("n", "batches"), [(0, 1), (1, 1), (600, 3)])
def test_geometry_hash_lookup_and_contains(rng, harness, n, batches):
    """geometry_hash.metal (compare-exchange insertion, exact comparisons)
    behind lookup_coords / contains_coords: identical to the CPU route and
    to a dictionary reference; queries repeat rows, cross batches and carry
    negative coordinates."""
    c = _distinct_rows(rng, n, batches)
    absent = np.concatenate([rng.integers(0, batches + 1, (50, 1)), rng.integers(-45, 45, (50, 3))], 1)
    q = np.concatenate([c[rng.integers(0, max(n, 1), 80)] if n else c, absent]).astype(np.int32)
    q = q[rng.permutation(len(q))]
    cpu, gpu = harness(lambda: [coords.lookup_coords(c, q), coords.contains_coords(c, q)])
    _equal(cpu, gpu)
    index = {tuple(r): i for i, r in enumerate(c.tolist())}
    assert np.array(gpu[0]).tolist() == [index.get(tuple(r), -1) for r in q.tolist()]
    assert np.array(gpu[1]).tolist() == [tuple(r) in index for r in q.tolist()]


@pytest.mark.skipif(ON_GPU, reason="switches the harness extension in directly")
def test_geometry_hash_duplicates_raise_the_same_error(rng):
    """Duplicate rows in the indexed set: both routes raise CoordinateError
    naming the same pair of rows (the first repeat and its first row)."""
    c = _distinct_rows(rng, 300, 2)
    c[200] = c[17]
    c[250] = c[3]
    messages = []
    for use_harness in (False, True):
        coords.ext = harness_ext if use_harness else ext
        try:
            with pytest.raises(coords.CoordinateError) as err:
                coords.lookup_coords(c, c[:5])
            messages.append(str(err.value))
        finally:
            coords.ext = ext
    assert messages[0] == messages[1]
    assert "at rows 17 and 200" in messages[0], messages[0]


@pytest.mark.parametrize(("na", "nb", "batches"), [(0, 40, 1), (1, 1, 1), (400, 300, 3)])
def test_geometry_union_and_intersection(rng, harness, na, nb, batches):
    """union_coords / intersection_coords on the GPU route (hash, first
    occurrences, compaction, lexicographic order from dense ranks) against
    the CPU merge and a Python-set reference, row order included."""
    pool = _distinct_rows(rng, na + nb, batches)
    a = pool[:na]
    shared = pool[rng.choice(na, min(na, nb // 2), replace=False)] if na else pool[:0]
    b = np.concatenate([shared, pool[na : na + nb - len(shared)]])[rng.permutation(nb)]
    cpu, gpu = harness(
        lambda: [
            x
            for j in (coords.union_coords(a, b), coords.intersection_coords(a, b))
            for x in (j.coords, j.a_rows, j.b_rows)
        ]
    )
    _equal(cpu, gpu)
    ia = {tuple(r): i for i, r in enumerate(a.tolist())}
    ib = {tuple(r): i for i, r in enumerate(b.tolist())}
    union = sorted(set(ia) | set(ib))
    inter = sorted(set(ia) & set(ib))
    got = [np.array(x).tolist() for x in gpu]
    assert [tuple(r) for r in got[0]] == union
    assert got[1] == [ia.get(r, -1) for r in union] and got[2] == [ib.get(r, -1) for r in union]
    assert [tuple(r) for r in got[3]] == inter
    assert got[4] == [ia[r] for r in inter] and got[5] == [ib[r] for r in inter]


@pytest.mark.parametrize(("n", "stride"), [(1, 2), (700, 2), (700, (3, 1, 4))])
def test_geometry_downsample_coords(rng, harness, n, stride):
    """downsample_coords on the GPU route (many rows share a coarse cell)
    against the CPU route and np.unique(axis=0, return_inverse=True)."""
    c = np.concatenate([rng.integers(0, 3, (n, 1)), rng.integers(-30, 30, (n, 3))], 1).astype(
        np.int32
    )
    cpu, gpu = harness(lambda: list(coords.downsample_coords(c, stride)))
    _equal(cpu, gpu)
    step = np.broadcast_to(np.asarray(stride), (3,))
    floored = c.copy()
    floored[:, 1:] = np.floor_divide(c[:, 1:], step) * step
    want, inverse = np.unique(floored, axis=0, return_inverse=True)
    np.testing.assert_array_equal(np.array(gpu[0]), want)
    np.testing.assert_array_equal(np.array(gpu[1]), inverse.reshape(-1))


@pytest.mark.parametrize(("n", "batches"), [(2, 1), (500, 3)])
def test_geometry_morton_order(rng, harness, n, batches):
    """morton_order on the GPU route (codes, dense ranks, one sort of unique
    keys) against the CPU route and np.lexsort of (batch, reference code,
    row): duplicate rows (ties go to the lower row), negatives, batches."""
    c = np.concatenate(
        [rng.integers(0, batches, (n, 1)), rng.integers(-(2**20), 2**20, (n, 3))], 1
    ).astype(np.int32)
    c[n // 2 :, 1:] = rng.integers(-3, 3, (n - n // 2, 3))  # many equal codes
    c[-1] = c[0]
    cpu, gpu = harness(lambda: [coords.morton_order(c), coords.morton_sort_coords(c)[0]])
    _equal(cpu, gpu)
    ref = [_morton_reference(*r[1:]) for r in c.tolist()]
    want = sorted(range(n), key=lambda i: (int(c[i, 0]), ref[i], i))
    assert np.array(gpu[0]).tolist() == want


@pytest.mark.parametrize(("n", "batches", "size"), [(1, 1, 0.5), (900, 3, (0.25, 0.5, 1.0))])
def test_geometry_quantize_points(rng, harness, n, batches, size):
    """quantize_points on the GPU route (float32 voxel indices, the hash,
    dense-rank order, the map from MLX ops) against the CPU route and a
    NumPy reference: coordinates, point->voxel map, counts, offsets and the
    points of each voxel in ascending order. Points sit off voxel faces
    (cell centres plus a bounded jitter), so float32 and float64 agree;
    negatives, duplicates, batches."""
    step = np.broadcast_to(np.asarray(size, np.float64), (3,))
    cell = rng.integers(-20, 20, (n, 3))
    pts = (cell + 0.5 + rng.uniform(-0.4, 0.4, (n, 3))) * step
    b = rng.integers(0, batches, n).astype(np.int32)

    def run():
        v = geometry.quantize_points(pts, size, batch=b)
        return [v.coords, v.point_to_voxel, v.counts, v.voxel_offsets, v.voxel_points]

    cpu, gpu = harness(run)
    _equal(cpu, gpu)
    keys = np.concatenate([b[:, None], cell], 1)
    want, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    got = [np.array(x) for x in gpu]
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_array_equal(got[1], inverse.reshape(-1))
    np.testing.assert_array_equal(got[2], counts)
    np.testing.assert_array_equal(got[3], np.concatenate([[0], np.cumsum(counts)]))
    np.testing.assert_array_equal(got[4], np.argsort(inverse.reshape(-1), kind="stable"))


@pytest.mark.skipif(ON_GPU, reason="switches the harness extension in directly")
def test_geometry_quantize_points_out_of_int32():
    """A point whose voxel index leaves int32 raises GeometryError on both
    routes, naming the same row."""
    pts = np.array([[0.0, 0.0, 0.0], [1.0, 3e9, 0.0]])
    messages = []
    for use_harness in (False, True):
        geometry.ext = coords.ext = harness_ext if use_harness else ext
        try:
            with pytest.raises(geometry.GeometryError, match="int32") as err:
                geometry.quantize_points(pts, 1.0)
            messages.append(str(err.value))
        finally:
            geometry.ext = coords.ext = ext
    assert messages[0] == messages[1] == (
        "points row 1 falls in voxel index 3e+09, outside the int32 coordinate range."
    )


@pytest.mark.skipif(ON_GPU, reason="calls the harness extension directly")
def test_geometry_hash_primitive_contract():
    """GeometryHash directly: evaluates eagerly and under mx.compile to the
    same rows; vmap is refused with a clear error; bad operand shapes are
    refused before a node is built."""
    c = mx.array(np.array([[0, 1, 2, 3], [1, 1, 2, 3], [0, 1, 2, 3]], np.int32))

    def rows_of(x):
        raw = harness_ext.coords_hash(x, x)
        return raw["first"], raw["rows"]

    for fn in (rows_of, mx.compile(rows_of)):
        first, rows = fn(c)
        assert np.array(first).tolist() == [0, 1, 0] and np.array(rows).tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="vmap is not supported"):
        mx.vmap(lambda x: rows_of(x)[0])(mx.stack([c, c]))
    with pytest.raises(ValueError, match=r"\(N, 4\) int32"):
        harness_ext.coords_hash(mx.zeros((3, 3), mx.int32), c)


def test_product_extension_carries_no_harness():
    import mlx_lattice

    for name in ("set_metal_harness", "metal_harness_enabled", "harness_groups_run", "scaled_add"):
        assert not hasattr(ext, name), name
        assert not hasattr(mlx_lattice, name), name


@pytest.mark.skipif(ON_GPU, reason="the message is for builds without Metal kernels")
def test_builds_without_metal_kernels_say_so():
    """eval_gpu of the product's no_metal.cpp (compiled into the harness
    extension too), called directly: MLX's CPU-only build refuses a GPU
    stream before a primitive could be asked, so Python cannot reach it."""
    message = harness_ext.no_metal_eval_gpu_error()
    assert message == (
        "SparseConv: mlx_lattice was built without Metal kernels; run it on the CPU stream "
        "(mx.cpu)."
    )


# ------------------------------------------------------------ training batch norm
#
# The Metal kernels sum fixed 256-row blocks in compensated float32 where the
# CPU sums them in double; both round the same float32 expressions for the
# affine maps. Bounds, relative to the largest magnitude of each result: the
# statistics and float32 outputs to 1e-6 (a few float32 ulps: the scale and
# the backward coefficients are rounded from float32 instead of double
# arithmetic), half-precision outputs to one ulp of their format (a float32
# value a few ulps away can round to the neighbouring half).
_BN_TOL = {mx.float32: 1e-6, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}


def _bn_inputs(rng, n, c, dtype, constant_channels=()):
    # A large common offset per channel: the statistics must not cancel.
    x = rng.standard_normal((n, c)) * rng.uniform(0.5, 3.0, c) + rng.uniform(-40, 40, c)
    for j in constant_channels:
        x[:, j] = x[0, j]  # zero variance
    w = rng.uniform(0.5, 1.5, c) * rng.choice([-1.0, 1.0], c)
    b = rng.standard_normal(c)
    g = rng.standard_normal((n, c))
    return (
        mx.array(x.astype(np.float32)).astype(dtype),
        mx.array(w.astype(np.float32)),
        mx.array(b.astype(np.float32)),
        mx.array(g.astype(np.float32)).astype(dtype),
    )


def _bn_reference(x, w, b, g, y_native, eps, relu):
    """float64 NumPy: (y, mean, var, dx, dweight, dbias); the ReLU's mask is
    the primitive's documented one (y > 0 of the y it returned)."""
    x, w, b, g = (np.array(a.astype(mx.float32)).astype(np.float64) for a in (x, w, b, g))
    n = x.shape[0]
    mean = x.mean(axis=0)
    xc = x - mean
    var = (xc * xc).mean(axis=0)
    rstd = 1.0 / np.sqrt(var + eps)
    y = xc * rstd * w + b
    if relu:
        y = np.maximum(y, 0.0)
        g = np.where(np.array(y_native.astype(mx.float32)) > 0, g, 0.0)
    # The backward pass reads the float32 statistics the forward returned
    # (its contract): at offsets ~40 the float32 mean's rounding (~2e-6)
    # times sum(g) would otherwise dominate dweight's difference.
    xc = x - mean.astype(np.float32).astype(np.float64)
    rstd = 1.0 / np.sqrt(var.astype(np.float32).astype(np.float64) + eps)
    dbias = g.sum(axis=0)
    dweight = (g * xc).sum(axis=0) * rstd
    dx = w * rstd * (g - dbias / n - xc * rstd * dweight / n)
    return y, mean, var, dx, dweight, dbias


def _bn_run(x, w, b, g, eps, relu):
    def y_of(x, w, b):
        return fused.batch_norm_train(x, w, b, eps=eps, relu=relu)[0]

    y, mean, var = fused.batch_norm_train(x, w, b, eps=eps, relu=relu)
    _, (dx, dw, db) = mx.vjp(lambda x, w, b: [y_of(x, w, b)], [x, w, b], [g])
    return [y, mean, var, dx, dw, db]


_BN_NAMES = ("y", "mean", "var", "dx", "dweight", "dbias")


def _bn_assert_close(got, want, tol, what, seed, names=_BN_NAMES):
    for name, a, r in zip(names, got, want, strict=True):
        a, r = (
            np.array(v.astype(mx.float32)).astype(np.float64)
            if isinstance(v, mx.array)
            else np.asarray(v, np.float64)
            for v in (a, r)
        )
        assert a.shape == r.shape, (name, a.shape, r.shape)
        bound = tol * max(1.0, float(np.abs(r).max(initial=0)))
        err = float(np.abs(a - r).max(initial=0))
        assert err <= bound, f"{what}: {name} off by {err:.3g} > {bound:.3g} (seed {seed})"


@pytest.mark.parametrize(
    ("n", "c"),
    [(1, 1), (1, 5), (7, 130), (256, 3), (257, 33), (600, 64), (300, 2)],
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("relu", [False, True])
def test_batch_norm_train_forward_and_backward(rng, seed, harness, n, c, dtype, relu):
    """The forward (block sums, statistics, map) and backward (two reductions,
    coefficients, map) kernels against the CPU primitive and float64 NumPy:
    one row, rows that are not a multiple of the 256-row block (one and
    several blocks), 1 to 130 channels, and zero-variance channels."""
    constant = [j for j in (0, c // 2) if c > 1 and n > 1]
    x, w, b, g = _bn_inputs(rng, n, c, dtype, constant)
    eps = 1e-5
    cpu, gpu = harness(lambda: _bn_run(x, w, b, g, eps, relu))
    tol = _BN_TOL[dtype]
    # Statistics and parameter gradients are float32 whatever the dtype.
    stats_tol = _BN_TOL[mx.float32]
    float32_outputs = [1, 2, 4, 5]
    _bn_assert_close(
        [gpu[i] for i in float32_outputs],
        [cpu[i] for i in float32_outputs],
        stats_tol,
        "metal vs cpu",
        seed,
        names=[_BN_NAMES[i] for i in float32_outputs],
    )
    _bn_assert_close(gpu, cpu, tol, "metal vs cpu", seed)
    if dtype != mx.float32:
        # Both round the same float32 expressions to half: differences in the
        # float32 statistics (a few ulps) rarely move a value across a half
        # rounding boundary (measured: at least 99.85% of elements identical).
        for i in (0, 3):
            same = np.mean(
                np.array(gpu[i].astype(mx.float32)) == np.array(cpu[i].astype(mx.float32))
            )
            assert same >= 0.99, f"{_BN_NAMES[i]}: {same:.4f} identical (seed {seed})"
    ref = _bn_reference(x, w, b, g, cpu[0], eps, relu)
    for what, got in (("cpu vs float64", cpu), ("metal vs float64", gpu)):
        # Half outputs: one ulp of the format for the rounding, plus the
        # float32 error of the inputs' large offsets (mean ~40: 1e-6).
        _bn_assert_close(got, ref, max(tol, 1e-5), what, seed)
    for j in constant:
        assert float(gpu[2][j]) <= 1e-10 * float(gpu[1][j]) ** 2, (j, seed)
        np.testing.assert_array_equal(
            np.array(gpu[0][:, j].astype(mx.float32)),
            np.array(cpu[0][:, j].astype(mx.float32)),
            err_msg=f"zero-variance channel {j} (seed {seed})",
        )


@pytest.mark.parametrize(("n", "c"), [(1, 1), (7, 130), (257, 33), (600, 64)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("relu", [False, True])
def test_batch_norm_eval(rng, seed, harness, n, c, dtype, relu):
    """The eval-mode map (given statistics) against the CPU primitive: the
    same float32 expression per element, rounded once to the dtype (one ulp
    of the format at most where the two compilers round differently)."""
    x, w, b, _ = _bn_inputs(rng, n, c, dtype)
    mean = mx.array(rng.uniform(-40, 40, c).astype(np.float32))
    var = mx.array(rng.uniform(0.25, 9.0, c).astype(np.float32))

    def run():
        return [fused.batch_norm_eval(x, mean, var, w, b, eps=1e-5, relu=relu)]

    cpu, gpu = harness(run)
    assert gpu[0].dtype == dtype
    _bn_assert_close(gpu, cpu, _BN_TOL[dtype], "metal vs cpu", seed, names=("y",))


def test_batch_norm_train_under_compile(rng, seed, harness):
    """mx.compile of the forward and backward gives the eager bits on the
    Metal kernels (the compiled function is traced afresh on each route)."""
    x, w, b, g = _bn_inputs(rng, 300, 9, mx.float16, constant_channels=[4])

    def run():
        step = mx.compile(lambda x, w, b, g: _bn_run(x, w, b, g, 1e-3, True))
        return step(x, w, b, g) + _bn_run(x, w, b, g, 1e-3, True)

    cpu, gpu = harness(run)
    for name, compiled, eager in zip(_BN_NAMES, gpu[:6], gpu[6:], strict=True):
        np.testing.assert_array_equal(
            np.array(compiled.astype(mx.float32)),
            np.array(eager.astype(mx.float32)),
            err_msg=f"{name} (seed {seed})",
        )
    _bn_assert_close(gpu[:6], cpu[:6], _BN_TOL[mx.float16], "metal vs cpu", seed)


# ------------------------------------------------------------ elementwise add


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (300, 7), (257, 33)])
def test_feature_add_kernel_matches_the_cpu_bit_for_bit(rng, seed, harness, dtype, shape):
    """The Metal add (one thread per element, a partial last threadgroup)
    against the CPU primitive and NumPy's float16 add: the same float32 sum
    rounded once, so the same bits (signed zeros and infinities included);
    its gradient passes the cotangent to both operands."""
    a = rng.standard_normal(shape) * 2.0 ** rng.integers(-26, 14, shape)
    b = rng.standard_normal(shape) * 2.0 ** rng.integers(-26, 14, shape)
    b.reshape(-1)[::3] = -a.reshape(-1)[::3]
    a.reshape(-1)[2::7] = b.reshape(-1)[2::7] = -0.0  # -0 + -0 = -0
    a.reshape(-1)[1::5] = np.inf
    ma = mx.array(a.astype(np.float32)).astype(dtype)
    mb = mx.array(b.astype(np.float32)).astype(dtype)
    g = rand(rng, shape, dtype)

    def run():
        out, (da, db) = mx.vjp(lambda x, y: [fused.add(x, y)], [ma, mb], [g])
        return [out[0], da, db]

    cpu, gpu = harness(run)
    bits = mx.uint32 if dtype == mx.float32 else mx.uint16
    for name, c, m in zip(("sum", "da", "db"), cpu, gpu, strict=True):
        np.testing.assert_array_equal(
            np.array(m.view(bits)), np.array(c.view(bits)), err_msg=f"{name} (seed {seed})"
        )
    if dtype == mx.float16:
        want = np.array(ma).astype(np.float16) + np.array(mb).astype(np.float16)
        np.testing.assert_array_equal(
            np.array(gpu[0].view(mx.uint16)), want.view(np.uint16), err_msg=f"seed {seed}"
        )


@pytest.mark.parametrize(
    ("feat_dtype", "out_dtype"),
    [(mx.float16, mx.float32), (mx.bfloat16, mx.float32), (mx.float32, mx.float16)],
)
def test_geometry_devoxelize_dtypes(rng, harness, feat_dtype, out_dtype):
    """devoxelize's dtype combinations on the Metal kernels (float32 kernels
    with casts in the graph) against the CPU kernel (which widens half rows
    and rounds its output itself): the output in out_dtype, the gradient in
    the features' dtype."""
    points = rng.uniform(-2.0, 2.0, (300, 3))
    batch = rng.integers(0, 2, 300).astype(np.int32)
    vox = geometry.quantize_points(points, 0.5, batch=batch)
    pvm = geometry.point_voxel_map(points, vox.coords, 0.5, batch=batch)
    vf = rand(rng, (vox.num_voxels, 40), feat_dtype)
    g = rand(rng, (300, 40), out_dtype)

    def run():
        out = []
        for interpolation in ("linear", "nearest"):

            def devoxelize(v, interpolation=interpolation):
                return geometry.devoxelize(v, pvm, interpolation, dtype=out_dtype)

            out.append(devoxelize(vf))
            out.append(mx.vjp(devoxelize, [vf], [g])[1][0])
        return out

    cpu, gpu = harness(run)
    for a, b in zip(cpu, gpu, strict=True):
        assert a.dtype == b.dtype
    assert [a.dtype for a in cpu] == [out_dtype, feat_dtype] * 2
    # Both are the float32 interpolation rounded once; 1e-2 where the sums'
    # order differs and a half rounding step flips.
    close(cpu, gpu, 1e-2)
