"""Sparse convolution against MLX's dense convolution, and its gradients."""


import mlx.core as mx
import numpy as np
import pytest

from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation, ops

GRID = 8


def weight5(rng, cout, ks, cin, dtype=mx.float32):
    return mx.array(
        rng.standard_normal((cout, *ks, cin)).astype(np.float32) / np.sqrt(cin * np.prod(ks))
    ).astype(dtype)


def feats(rng, n, c, dtype=mx.float32):
    return mx.array(rng.standard_normal((n, c)).astype(np.float32)).astype(dtype)


def close(a, b, tol=1e-4):
    a = np.array(a.astype(mx.float32))
    b = np.array(b.astype(mx.float32))
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()))


@pytest.mark.parametrize(
    ("ks", "dilation", "cin", "cout"),
    [
        ((3, 3, 3), (1, 1, 1), 3, 14),
        ((1, 1, 1), (1, 1, 1), 1, 1),
        ((2, 2, 2), (1, 1, 1), 14, 32),
        ((5, 5, 5), (1, 1, 1), 3, 3),
        ((3, 1, 5), (1, 1, 1), 32, 64),
        ((3, 3, 3), (2, 2, 2), 64, 96),
        ((3, 3, 3), (1, 1, 1), 96, 64),
    ],
)
def test_submanifold_matches_dense(rng, ref, ks, dilation, cin, cout):
    coords = ref.random_coords(rng, 250, GRID, batches=2)
    rel = build_kernel_relation(coords, kernel_size=ks, dilation=dilation)
    f, w = feats(rng, len(coords), cin), weight5(rng, cout, ks, cin)
    expected = ref.dense_conv(
        coords, f, w, grid=(GRID,) * 3, batches=2, out_coords=coords, dilation=dilation
    )
    close(ops.sparse_conv_features_from_relation(f, w, rel), expected)
    # The mapped (K, Cin, Cout) layout gives the same result.
    close(ops.sparse_conv_features_from_relation(f, ops.mapped_conv_weight(w), rel), expected)


@pytest.mark.parametrize(
    ("ks", "stride"), [((2, 2, 2), (2, 2, 2)), ((3, 3, 3), (2, 2, 2)), ((3, 2, 1), (1, 2, 2))]
)
def test_forward_strided_matches_dense(rng, ref, ks, stride):
    coords = ref.random_coords(rng, 300, GRID, batches=2)
    rel = build_kernel_relation(coords, kernel_size=ks, stride=stride, kind="forward")
    f, w = feats(rng, len(coords), 3), weight5(rng, 32, ks, 3)
    out = np.array(rel.out_coords)
    expected = ref.dense_conv(
        coords, f, w, grid=(GRID,) * 3, batches=2, out_coords=out, stride=stride
    )
    close(ops.sparse_conv_features_from_relation(f, w, rel), expected)


def test_transposed_conv_through_target_relation(rng, ref):
    fine = ref.random_coords(rng, 300, GRID, batches=2)
    down = build_kernel_relation(fine, kernel_size=2, stride=2, kind="forward")
    up = build_kernel_relation(down.out_coords, fine, kernel_size=2, kind="target")
    coarse = np.array(down.out_coords)
    f, w = feats(rng, len(coarse), 14), weight5(rng, 3, (2, 2, 2), 14)
    # Reference: scatter each coarse row to the fine cells it covers.
    wk = np.array(ops.mapped_conv_weight(w))
    offsets = ref.offsets((2, 2, 2), (1, 1, 1), (1, 1, 1))
    index = {tuple(r): i for i, r in enumerate(fine.tolist())}
    expected = np.zeros((len(fine), 3))
    for q, row in enumerate(coarse):
        for k, off in enumerate(offsets):
            p = index.get((row[0], *(row[1:] + off)))
            if p is not None:
                expected[p] += np.array(f[q]) @ wk[k]
    close(ops.sparse_conv_features_from_relation(f, w, up), mx.array(expected.astype(np.float32)))


def test_empty_inputs_and_outputs_without_neighbours(rng, ref):
    empty = build_kernel_relation(np.zeros((0, 4), np.int32))
    out = ops.sparse_conv_features_from_relation(mx.zeros((0, 5)), mx.zeros((27, 5, 7)), empty)
    assert out.shape == (0, 7)
    coords = ref.random_coords(rng, 50, 4)
    lonely = build_kernel_relation(coords, np.array([[0, 90, 90, 90]], np.int32), kind="forward")
    out = ops.sparse_conv_features_from_relation(
        feats(rng, len(coords), 5), weight5(rng, 7, (3, 3, 3), 5), lonely
    )
    np.testing.assert_array_equal(np.array(out), np.zeros((1, 7)))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_dtypes_return_feature_dtype(rng, ref, dtype):
    coords = ref.random_coords(rng, 200, GRID)
    rel = build_kernel_relation(coords)
    f, w = feats(rng, len(coords), 14, dtype), weight5(rng, 14, (3, 3, 3), 14, dtype)
    out = ops.sparse_conv_features_from_relation(f, w, rel)
    assert out.dtype == dtype
    expected = ref.dense_conv(
        coords,
        f.astype(mx.float32),
        w.astype(mx.float32),
        grid=(GRID,) * 3,
        batches=1,
        out_coords=coords,
    )
    close(out, expected, tol=1e-2)


@pytest.mark.parametrize("threads", [1, 2])
def test_float16_forward_is_the_float32_result_rounded(rng, ref, threads):
    """float16 rows are widened inside each register block (exactly) and
    each output tile is rounded once: the result is the float32 convolution of the same values
    rounded to float16, bit for bit, for any thread count; outputs without
    edges are zero."""
    import mlx_lattice

    coords = ref.random_coords(rng, 300, GRID)
    out_coords = np.concatenate([coords, np.array([[0, 90, 90, 90]], np.int32)])
    rel = build_kernel_relation(coords, out_coords, kind="forward")
    f, w = feats(rng, len(coords), 24, mx.float16), weight5(rng, 20, (3, 3, 3), 24, mx.float16)
    before = mlx_lattice.get_num_threads()
    mlx_lattice.set_num_threads(threads)
    try:
        out = ops.sparse_conv_features_from_relation(f, w, rel)
        wide = ops.sparse_conv_features_from_relation(
            f.astype(mx.float32), w.astype(mx.float32), rel
        )
        mx.eval(out, wide)
    finally:
        mlx_lattice.set_num_threads(before)
    assert out.dtype == mx.float16
    got = np.array(out.astype(mx.float32))
    np.testing.assert_array_equal(got, np.array(wide).astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(got[-1], np.zeros(20, np.float32))


def dense_loss(ref, coords, rel_out, stride, probe):
    def loss(f, w):
        out = ref.dense_conv(
            coords, f, w, grid=(GRID,) * 3, batches=2, out_coords=rel_out, stride=stride
        )
        return (out * probe).sum() + 0.5 * (out**2).sum()

    return loss


@pytest.mark.parametrize(
    ("kind", "ks", "stride"), [("submanifold", 3, 1), ("forward", 2, 2), ("forward", 3, 2)]
)
def test_gradients_match_dense_autodiff(rng, ref, kind, ks, stride):
    coords = ref.random_coords(rng, 200, GRID, batches=2)
    rel = build_kernel_relation(coords, kernel_size=ks, stride=stride, kind=kind)
    f, w = feats(rng, len(coords), 5), weight5(rng, 6, (ks,) * 3, 5)
    probe = feats(rng, rel.n_out_capacity, 6)

    def sparse_loss(f, w):
        out = ops.sparse_conv_features_from_relation(f, w, rel)
        return (out * probe).sum() + 0.5 * (out**2).sum()

    got = mx.grad(sparse_loss, argnums=(0, 1))(f, w)
    expected = mx.grad(
        dense_loss(ref, coords, np.array(rel.out_coords), (stride,) * 3, probe), argnums=(0, 1)
    )(f, w)
    close(got[0], expected[0])
    close(got[1], expected[1])


def test_gradients_match_finite_differences(rng, ref):
    coords = ref.random_coords(rng, 150, 6)
    rel = build_kernel_relation(coords)
    f, w = feats(rng, len(coords), 4), weight5(rng, 3, (3, 3, 3), 4)
    probe = feats(rng, len(coords), 3)

    def loss(f, w):
        return (ops.sparse_conv_features_from_relation(f, w, rel) * probe).sum()

    gf, gw = mx.grad(loss, argnums=(0, 1))(f, w)
    eps = 1e-2
    for x, g, arg in ((f, gf, 0), (w, gw, 1)):
        v = mx.array(rng.standard_normal(x.shape).astype(np.float32))
        plus = [f, w]
        minus = [f, w]
        plus[arg] = x + eps * v
        minus[arg] = x - eps * v
        fd = (loss(*plus) - loss(*minus)) / (2 * eps)  # exact for a bilinear loss, up to rounding
        np.testing.assert_allclose(float(fd), float((g * v).sum()), rtol=2e-3, atol=2e-3)


def test_jvp_and_second_order(rng, ref):
    coords = ref.random_coords(rng, 150, 6, batches=2)
    rel = build_kernel_relation(coords)
    f, w = feats(rng, len(coords), 4), weight5(rng, 5, (3, 3, 3), 4)
    tf, tw = feats(rng, len(coords), 4), weight5(rng, 5, (3, 3, 3), 4)
    conv = lambda f, w: ops.sparse_conv_features_from_relation(f, w, rel)  # noqa: E731
    dense = lambda f, w: ref.dense_conv(coords, f, w, grid=(6,) * 3, batches=2, out_coords=coords)  # noqa: E731
    _, (t,) = mx.jvp(conv, [f, w], [tf, tw])
    close(t, dense(tf, w) + dense(f, tw))  # bilinear: the exact directional derivative

    # Gradient of a gradient norm exercises the vjp of the gradient primitives.
    def grad_norm(fn):
        return lambda f, w: (
            mx.grad(lambda a, b: (fn(a, b) ** 2).sum(), argnums=1)(f, w) ** 2
        ).sum()

    close(mx.grad(grad_norm(conv))(f, w), mx.grad(grad_norm(dense))(f, w), tol=1e-3)


def test_compile_and_repeated_calls_are_bitwise_stable(rng, ref):
    coords = ref.random_coords(rng, 300, GRID, batches=2)
    rel = build_kernel_relation(coords)
    f, w = feats(rng, len(coords), 32), weight5(rng, 32, (3, 3, 3), 32)

    def step(f, w):
        return mx.grad(
            lambda a, b: (ops.sparse_conv_features_from_relation(a, b, rel) ** 2).sum(),
            argnums=(0, 1),
        )(f, w)

    eager = step(f, w)
    compiled = mx.compile(step)(f, w)
    for a, b in zip(eager, compiled, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    again = step(f, w)
    for a, b in zip(eager, again, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_outputs_start_on_a_cache_line_and_behave_as_arrays(rng, ref, tmp_path):
    """MLX's CPU buffers start 8 bytes into a cache line; the extension puts
    its outputs of a page or more at an offset into a buffer one line longer
    (cpu/eval.h), so the kernels' 64-byte stores each land in one line. Such
    an output must still behave as any array: its values against the dense
    reference, then a slice, an elementwise op that may take its buffer,
    NumPy and a save/load round trip."""
    coords = ref.random_coords(rng, 600, GRID, batches=2)
    rel = build_kernel_relation(coords)
    f, w = feats(rng, len(coords), 16), weight5(rng, 32, (3, 3, 3), 16)
    out = ops.sparse_conv_features_from_relation(f, w, rel)
    mx.eval(out)
    assert out.nbytes >= 4096
    if mx.default_device() == mx.cpu:
        assert np.asarray(memoryview(out)).ctypes.data % 64 == 0
    expected = ref.dense_conv(coords, f, w, grid=(GRID,) * 3, batches=2, out_coords=coords)
    close(out, expected)
    values = np.array(out)
    np.testing.assert_array_equal(np.array(out[5:9, 3:]), values[5:9, 3:])
    # The conv's output is referenced by nothing else: the add may reuse it.
    shifted = ops.sparse_conv_features_from_relation(f, w, rel) + 1.0
    np.testing.assert_array_equal(np.array(shifted), values + np.float32(1.0))
    mx.save(str(tmp_path / "out.npy"), out)
    np.testing.assert_array_equal(np.array(mx.load(str(tmp_path / "out.npy"))), values)


@pytest.mark.parametrize(("cin", "cout"), [(32, 32), (16, 16), (40, 3), (32, 64)])
def test_narrow_rows_across_tiles_match_float64(rng, seed, ref, cin, cout):
    """Outputs narrower than 64 values run in larger tiles (up to 512 rows)
    and C <= 32 blocks use embedded-broadcast FMAs: on ~5000 rows (several
    tiles) the result is within float32 accumulation error of a float64
    reference and bitwise the same for 1, 2 and 3 threads."""
    import mlx_lattice

    coords = ref.random_coords(rng, 6000, 20, batches=2)
    rel = build_kernel_relation(coords, kernel_size=3)
    f = rng.standard_normal((len(coords), cin)).astype(np.float32)
    w = rng.standard_normal((27, cin, cout)).astype(np.float32) / np.sqrt(27 * cin)
    in_rows = np.array(rel.edges.in_rows)
    out_rows = np.array(rel.edges.out_rows)
    k_ids = np.array(rel.edges.kernel_ids)
    exact = np.zeros((len(coords), cout))
    mag = np.zeros((len(coords), cout))
    for k in range(27):
        sel = k_ids == k
        np.add.at(exact, out_rows[sel], f[in_rows[sel]].astype(np.float64) @ w[k])
        np.add.at(mag, out_rows[sel], np.abs(f[in_rows[sel]]).astype(np.float64) @ np.abs(w[k]))
    before = mlx_lattice.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            mlx_lattice.set_num_threads(threads)
            out = ops.sparse_conv_features_from_relation(mx.array(f), mx.array(w), rel)
            results.append(np.array(out))
    finally:
        mlx_lattice.set_num_threads(before)
    # float32 sums of at most 27 * cin products: |error| <= n * eps * sum|terms|.
    bound = 1.01 * 27 * cin * 2.0**-24 * mag + 1e-30
    assert np.all(np.abs(results[0] - exact) <= bound), f"seed {seed}"
    for threads, r in zip((2, 3), results[1:], strict=True):
        np.testing.assert_array_equal(r, results[0], err_msg=f"seed {seed}, {threads} threads")


WIDTHS = (1, 17, 31, 32, 33, 64)

# One child per forced micro-kernel (MLX_LATTICE_GEMM_ISA): the forward and
# the feature gradient (the stationary tiles over inputs, through edge ids)
# at every width of WIDTHS, for 1, 2 and 3 threads. The outputs are sparse
# points on a 40^3 grid (many tiles hold offsets without edges) followed by
# 600 rows far from every input (whole tiles without edges).
_BUCKET_SCRIPT = """
import sys
import mlx.core as mx
import numpy as np
import mlx_lattice
from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation, ops

path, seed = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(seed)
pts = np.concatenate([rng.integers(0, 2, (2600, 1)), rng.integers(0, 40, (2600, 3))], 1)
coords = np.unique(pts, axis=0).astype(np.int32)
coords = coords[rng.permutation(len(coords))]
far = np.stack([np.zeros(600), np.arange(600) * 3 + 500, np.full(600, 500), np.full(600, 500)], 1)
out_coords = np.concatenate([coords, far.astype(np.int32)])
rel = build_kernel_relation(coords, out_coords, kind="forward")
saved = dict(
    isa=ext.gemm_isa(),
    in_rows=np.array(rel.edges.in_rows),
    out_rows=np.array(rel.edges.out_rows),
    kernel_ids=np.array(rel.edges.kernel_ids),
)
for c in (1, 17, 31, 32, 33, 64):
    f = rng.standard_normal((len(coords), c)).astype(np.float32)
    w = (rng.standard_normal((27, c, c)) / np.sqrt(27 * c)).astype(np.float32)
    cot = rng.standard_normal((len(out_coords), c)).astype(np.float32)
    saved.update({f"f{c}": f, f"w{c}": w, f"cot{c}": cot})
    conv = lambda a: ops.sparse_conv_features_from_relation(a, mx.array(w), rel)
    for threads in (1, 2, 3):
        mlx_lattice.set_num_threads(threads)
        out, vjp = mx.vjp(conv, [mx.array(f)], [mx.array(cot)])
        saved[f"out{c}_{threads}"] = np.array(out[0])
        saved[f"gf{c}_{threads}"] = np.array(vjp[0])
np.savez(path, **saved)
"""


def test_bucketed_tiles_every_width_isa_and_thread_count(tmp_path, seed, isa_child):
    """The one-pass per-offset buckets of the float32 tiles (forward over
    outputs, feature gradient over inputs through edge ids) at C in
    {1, 17, 31, 32, 33, 64}, with offsets and whole tiles without edges:
    every forced micro-kernel is within float32 accumulation error of a
    float64 reference, the FMA kernels give the same bits as each other,
    and 1, 2 and 3 threads give the same bits; rows without edges are 0."""
    results = {}
    for isa in ext.gemm_isas():
        path = tmp_path / f"{isa}.npz"
        isa_child(_BUCKET_SCRIPT, isa, path, seed)
        results[isa] = np.load(path)
        assert str(results[isa]["isa"]) == isa, f"seed {seed}"
    first = results[ext.gemm_isas()[0]]
    in_rows, out_rows, k_ids = first["in_rows"], first["out_rows"], first["kernel_ids"]
    n_in, n_out = len(first["f1"]), len(first["cot1"])
    lonely = np.setdiff1d(np.arange(n_out), out_rows)
    assert len(lonely) >= 600, f"seed {seed}"
    # Offsets missing from some 128-row tile of outputs (the widest tiles').
    tiles = out_rows // 128
    assert len(np.unique(tiles * 27 + k_ids)) < 27 * len(np.unique(tiles)), f"seed {seed}"
    for c in WIDTHS:
        f, w, cot = first[f"f{c}"], first[f"w{c}"], first[f"cot{c}"]
        exact = np.zeros((n_out, c))
        mag = np.zeros((n_out, c))
        g_exact = np.zeros((n_in, c))
        g_mag = np.zeros((n_in, c))
        for k in range(27):
            sel = k_ids == k
            fi, co = f[in_rows[sel]].astype(np.float64), cot[out_rows[sel]].astype(np.float64)
            np.add.at(exact, out_rows[sel], fi @ w[k])
            np.add.at(mag, out_rows[sel], np.abs(fi) @ np.abs(w[k]))
            np.add.at(g_exact, in_rows[sel], co @ w[k].T)
            np.add.at(g_mag, in_rows[sel], np.abs(co) @ np.abs(w[k]).T)
        # float32 sums of at most 27 * c products: |error| <= n * eps * sum|terms|.
        bound = 1.01 * 27 * c * 2.0**-24 * mag + 1e-30
        g_bound = 1.01 * 27 * c * 2.0**-24 * g_mag + 1e-30
        for isa, r in results.items():
            msg = f"seed {seed}, C{c}, {isa}"
            out, gf = r[f"out{c}_1"], r[f"gf{c}_1"]
            assert np.all(np.abs(out - exact) <= bound), msg
            assert np.all(np.abs(gf - g_exact) <= g_bound), msg
            np.testing.assert_array_equal(out[lonely], 0.0, err_msg=msg)
            for threads in (2, 3):
                np.testing.assert_array_equal(r[f"out{c}_{threads}"], out, err_msg=msg)
                np.testing.assert_array_equal(r[f"gf{c}_{threads}"], gf, err_msg=msg)
            if isa != "scalar":
                np.testing.assert_array_equal(out, first[f"out{c}_1"], err_msg=msg)
                np.testing.assert_array_equal(gf, first[f"gf{c}_1"], err_msg=msg)
