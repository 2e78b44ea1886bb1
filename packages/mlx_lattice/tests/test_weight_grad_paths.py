"""The native weight gradient (dW[k] = sum over the edges of offset k of
F[in]^T G[out]) against float64 NumPy and MLX's dense convolution, on every
path of its kernel: small and large channel counts (masked tails, partial
row blocks), offsets without edges, empty relations, relations large enough
to be split into several slabs of partial sums, kernel groupings not in
output order; and the same bits for any thread count."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation, ops, use_dataflow
from mlx_lattice.core.relations import RelationCSR

EPS32 = float(np.finfo(np.float32).eps)


def weight_grad(f: mx.array, g: mx.array, w: mx.array, rel) -> np.ndarray:
    """dW of sum(conv(f, w) * g) through the generic native kernel."""
    with use_dataflow("generic"):
        _, (dw,) = mx.vjp(lambda w: ops.sparse_conv_features_from_relation(f, w, rel), [w], [g])
    return np.array(dw)


def edges_of(rel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    e = rel.edges
    return np.array(e.in_rows), np.array(e.out_rows), np.array(e.kernel_ids)


def reference_add_at(f, g, rel, k: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 dW and sum |F^T| |G| by np.add.at over the edges (small cases),
    256 edges at a time."""
    f64, g64 = np.array(f, np.float64), np.array(g, np.float64)
    ins, outs, kids = edges_of(rel)
    dw = np.zeros((k, f64.shape[1], g64.shape[1]))
    mag = np.zeros_like(dw)
    for e in range(0, len(ins), 256):
        a, b, key = f64[ins[e : e + 256]], g64[outs[e : e + 256]], kids[e : e + 256]
        np.add.at(dw, key, a[:, :, None] * b[:, None, :])
        np.add.at(mag, key, np.abs(a)[:, :, None] * np.abs(b)[:, None, :])
    return dw, mag


def reference_per_offset(f, g, rel, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The same sums offset by offset as float64 matrix products (large cases)."""
    f64, g64 = np.array(f, np.float64), np.array(g, np.float64)
    ins, outs, kids = edges_of(rel)
    dw = np.zeros((k, f64.shape[1], g64.shape[1]))
    mag = np.zeros_like(dw)
    for o in range(k):
        sel = kids == o
        dw[o] = f64[ins[sel]].T @ g64[outs[sel]]
        mag[o] = np.abs(f64[ins[sel]]).T @ np.abs(g64[outs[sel]])
    return dw, mag


def assert_close(got: np.ndarray, dw: np.ndarray, mag: np.ndarray, seed: int) -> None:
    # Float32 sums of fused multiply-adds: the error of each value is a few
    # float32 ulps of its sum of magnitudes (sum |f| |g|); 64 ulps leaves room
    # for long sums while one missing or repeated edge (about mag / edges of
    # the offset, > 64 ulps of mag for fewer than ~100k edges per offset) fails.
    assert got.shape == dw.shape, f"seed {seed}: shape {got.shape} != {dw.shape}"
    err = np.abs(got.astype(np.float64) - dw)
    bound = 64 * EPS32 * mag + 1e-30
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), (
        f"seed {seed}: dW{worst} = {got[worst]!r}, float64 {dw[worst]!r}, "
        f"error {err[worst]:.3g} > bound {bound[worst]:.3g}"
    )


def inputs(rng, n_in: int, n_out: int, cin: int, cout: int, k: int):
    f = mx.array(rng.standard_normal((n_in, cin)).astype(np.float32))
    g = mx.array(rng.standard_normal((n_out, cout)).astype(np.float32))
    w = mx.array(rng.standard_normal((k, cin, cout)).astype(np.float32))
    return f, g, w


def with_threads(n: int, fn):
    before = mlx_lattice.get_num_threads()
    mlx_lattice.set_num_threads(n)
    try:
        return fn()
    finally:
        mlx_lattice.set_num_threads(before)


@pytest.mark.parametrize(
    ("cin", "cout", "kernel_size", "kind"),
    [
        (1, 1, 3, "submanifold"),
        (3, 14, 3, "submanifold"),
        (16, 16, (3, 1, 5), "submanifold"),
        (64, 64, 3, "submanifold"),
        (130, 7, 3, "forward"),
        (7, 130, 2, "forward"),
        (33, 65, 1, "submanifold"),
    ],
)
def test_matches_float64_add_at(rng, seed, ref, cin, cout, kernel_size, kind):
    coords = ref.random_coords(rng, 400, 8, batches=2)
    stride = 2 if kind == "forward" else 1
    rel = build_kernel_relation(coords, kernel_size=kernel_size, stride=stride, kind=kind)
    k = int(np.prod(rel.contract.kernel_size))
    f, g, w = inputs(rng, rel.n_in, rel.n_out_capacity, cin, cout, k)
    dw, mag = reference_add_at(f, g, rel, k)
    assert_close(weight_grad(f, g, w, rel), dw, mag, seed)


def test_offsets_without_edges_are_zero(rng, seed, ref):
    # Points two apart on every axis: with a 5x5x5 kernel only the even
    # offsets meet a neighbour, so most offsets have no edge at all.
    coords = ref.random_coords(rng, 150, 5, step=2)
    rel = build_kernel_relation(coords, kernel_size=5)
    counts = np.array(rel.counts)
    assert (counts == 0).sum() > 50 and (counts > 0).sum() > 5, f"seed {seed}: {counts}"
    f, g, w = inputs(rng, rel.n_in, rel.n_in, 9, 20, 125)
    got = weight_grad(f, g, w, rel)
    dw, mag = reference_add_at(f, g, rel, 125)
    assert_close(got, dw, mag, seed)
    np.testing.assert_array_equal(got[counts == 0], 0.0, err_msg=f"seed {seed}")


def test_empty_relations(rng, seed, ref):
    empty = build_kernel_relation(np.zeros((0, 4), np.int32))
    got = weight_grad(mx.zeros((0, 5)), mx.zeros((0, 7)), mx.ones((27, 5, 7)), empty)
    np.testing.assert_array_equal(got, np.zeros((27, 5, 7)), err_msg=f"seed {seed}")
    coords = ref.random_coords(rng, 50, 4)
    lonely = build_kernel_relation(coords, np.array([[0, 90, 90, 90]], np.int32), kind="forward")
    assert lonely.n_edges == 0
    f, g, w = inputs(rng, len(coords), 1, 6, 3, 27)
    np.testing.assert_array_equal(weight_grad(f, g, w, lonely), 0.0, err_msg=f"seed {seed}")


def large_relation(rng, ref):
    # About 18 neighbours for each of ~24k points: over 400k edges, so the
    # kernel cuts them into several slabs and many bands.
    coords = ref.random_coords(rng, 40000, (40, 30, 30))
    rel = build_kernel_relation(coords, kernel_size=3)
    assert rel.n_edges > 4 * 65536, rel.n_edges
    return coords, rel


def test_several_slabs_match_float64_and_every_thread_count(rng, seed, ref):
    _, rel = large_relation(rng, ref)
    f, g, w = inputs(rng, rel.n_in, rel.n_in, 24, 40, 27)
    dw, mag = reference_per_offset(f, g, rel, 27)
    runs = [with_threads(n, lambda: weight_grad(f, g, w, rel)) for n in (1, 2, 3)]
    assert_close(runs[0], dw, mag, seed)
    for n, got in zip((2, 3), runs[1:], strict=True):
        np.testing.assert_array_equal(got, runs[0], err_msg=f"seed {seed}: {n} threads")


@pytest.mark.parametrize(("cin", "cout"), [(1, 1), (5, 130), (64, 64)])
def test_bitwise_across_thread_counts(rng, seed, ref, cin, cout):
    coords = ref.random_coords(rng, 3000, 16, batches=2)
    rel = build_kernel_relation(coords, kernel_size=3)
    f, g, w = inputs(rng, rel.n_in, rel.n_in, cin, cout, 27)
    runs = [with_threads(n, lambda: weight_grad(f, g, w, rel)) for n in (1, 2, 3)]
    for n, got in zip((2, 3), runs[1:], strict=True):
        np.testing.assert_array_equal(got, runs[0], err_msg=f"seed {seed}: {n} threads")


def test_kernel_grouping_in_any_order(rng, seed, ref):
    # A relation whose kernel grouping lists each offset's edges shuffled
    # (valid, but not the builder's output order): the bands are then cut
    # by binary search over unsorted rows; every edge must still count once.
    _, rel = large_relation(rng, ref)
    offsets = np.array(rel.kernel_csr.row_offsets)
    ids = np.array(rel.kernel_csr.edge_ids)
    for k in range(len(offsets) - 1):
        ids[offsets[k] : offsets[k + 1]] = rng.permutation(ids[offsets[k] : offsets[k + 1]])
    shuffled = dataclasses.replace(
        rel,
        kernel_csr=RelationCSR(rel.kernel_csr.row_offsets, mx.array(ids)),
        _native=None,
        _sorted=[],
    )
    f, g, w = inputs(rng, rel.n_in, rel.n_in, 16, 8, 27)
    dw, mag = reference_per_offset(f, g, rel, 27)
    runs = [with_threads(n, lambda: weight_grad(f, g, w, shuffled)) for n in (1, 3)]
    assert_close(runs[0], dw, mag, seed)
    np.testing.assert_array_equal(runs[1], runs[0], err_msg=f"seed {seed}: 3 threads")


def test_matches_dense_convolution_vjp(rng, seed, ref):
    # A submanifold convolution is MLX's dense convolution on the scattered
    # grid restricted to the support: the weight cotangents agree.
    grid = (40, 30, 30)
    coords, rel = large_relation(rng, ref)
    cin, cout = 8, 12
    f = mx.array(rng.standard_normal((len(coords), cin)).astype(np.float32))
    g = mx.array(rng.standard_normal((len(coords), cout)).astype(np.float32))
    w = mx.array(rng.standard_normal((cout, 3, 3, 3, cin)).astype(np.float32))

    def sparse(w):
        with use_dataflow("generic"):
            return ops.sparse_conv_features_from_relation(f, w, rel)

    def dense(w):
        return ref.dense_conv(coords, f, w, grid=grid, batches=1, out_coords=coords)

    _, (got,) = mx.vjp(sparse, [w], [g])
    _, (expected,) = mx.vjp(dense, [w], [g])
    got, expected = np.array(got), np.array(expected)
    # Both are float32 sums over the same ~16k products per value, in
    # different orders: compare against their scale, sum |F| |G| per offset.
    _, mag = reference_per_offset(f, g, rel, 27)  # (27, cin, cout)
    mag5 = mag.reshape(3, 3, 3, cin, cout).transpose(4, 0, 1, 2, 3)
    err = np.abs(got.astype(np.float64) - expected)
    assert np.all(err <= 256 * EPS32 * mag5 + 1e-30), (
        f"seed {seed}: max error {err.max():.3g}, scale {mag5.max():.3g}"
    )


_ISA_SCRIPT = """
import sys
import mlx.core as mx
import numpy as np
from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation, ops, use_dataflow

data = np.load(sys.argv[1])
rel = build_kernel_relation(mx.array(data["coords"]), kernel_size=3)
f, g, w = (mx.array(data[k]) for k in ("f", "g", "w"))
with use_dataflow("generic"):
    _, (dw,) = mx.vjp(lambda w: ops.sparse_conv_features_from_relation(f, w, rel), [w], [g])
np.savez(sys.argv[2], dw=np.array(dw), isa=ext.gemm_isa())
"""


def test_every_micro_kernel_path(rng, seed, ref, tmp_path, isa_child):
    """Each micro-kernel (forced by MLX_LATTICE_GEMM_ISA) on a relation of
    several slabs, with channel counts that leave masked tails and a partial
    row block: within the float64 bound, and the FMA paths bit for bit."""
    coords, rel = large_relation(rng, ref)
    f, g, w = inputs(rng, rel.n_in, rel.n_in, 19, 70, 27)
    inputs_path = tmp_path / "inputs.npz"
    np.savez(inputs_path, coords=coords, f=np.array(f), g=np.array(g), w=np.array(w))
    dw, mag = reference_per_offset(f, g, rel, 27)
    results = {}
    for isa in ext.gemm_isas():
        path = tmp_path / f"{isa}.npz"
        isa_child(_ISA_SCRIPT, isa, inputs_path, path)
        result = np.load(path)
        assert str(result["isa"]) == isa, f"seed {seed}: asked {isa}, ran {result['isa']}"
        results[isa] = result["dw"]
        assert_close(results[isa], dw, mag, seed)
    fma = [isa for isa in results if isa != "scalar"]
    for isa in fma[1:]:
        np.testing.assert_array_equal(results[isa], results[fma[0]], err_msg=f"seed {seed}: {isa}")
