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


# ------------------------------------------------ half-precision features and cotangents
#
# A float16 / bfloat16 weight gradient widens each gathered feature and
# cotangent row per chunk of edges inside the kernel. Widening is exact, and
# the micro-kernel and its order are the float32 path's, so dW is bit for bit
# the float32 path on the inputs cast to float32 first: float32 beside a
# float32 weight (mixed precision), that result rounded once beside a half
# weight.

HALF = {"float16": mx.float16, "bfloat16": mx.bfloat16}


def half_case(rng, rel, cin: int, cout: int, k: int, dtype: mx.Dtype):
    f, g, w = inputs(rng, rel.n_in, rel.n_out_capacity, cin, cout, k)
    return f.astype(dtype), g.astype(dtype), w


def weight_grad_array(f: mx.array, g: mx.array, w: mx.array, rel) -> mx.array:
    with use_dataflow("generic"):
        _, (dw,) = mx.vjp(lambda w: ops.sparse_conv_features_from_relation(f, w, rel), [w], [g])
    mx.eval(dw)
    return dw


def bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint32 if a.dtype == mx.float32 else mx.uint16))


# Where bfloat16 has a weight-gradient driver (the amx-bf16 tile driver,
# cpu/amx_bf16_wgrad.h; the avx512-bf16 one, cpu/gemm_bf16.h, whose order
# test_bf16_conv.py emulates bit for bit), bfloat16 dW runs on it: its own
# order, so a bound here instead of the float32 path's bits.
BF16_WGRAD = ext.bf16_isa() in ("amx-bf16", "avx512-bf16")


def assert_bf16_driver_weight_grad(f, g, w, rel, seed, threads, expected):
    """The bf16 driver's dW: the same bits at every thread count, within the
    driver's bound (n u sum |products|, n the offset's edges, for any order
    of the additions; x 1.01 for the first-order bound's higher terms; plus
    one bf16 rounding for a bf16 weight) of float64."""
    k = w.shape[0]
    dw, mag = reference_add_at(f.astype(mx.float32), g.astype(mx.float32), rel, k)
    n = np.bincount(np.asarray(edges_of(rel)[2]), minlength=k)[:, None, None]
    bound = 1.01 * n * 2.0**-24 * mag + 1e-30
    first = {}
    for t in threads:
        for name, weight in (("mixed", w), ("half", w.astype(f.dtype))):
            got = with_threads(t, lambda weight=weight: weight_grad_array(f, g, weight, rel))
            assert got.dtype == weight.dtype, f"seed {seed}: {name} dW is {got.dtype}"
            got64 = np.array(got.astype(mx.float32)).astype(np.float64)
            limit = bound
            if name == "half":
                limit = (1 + 2.0**-8) * bound + 2.0**-8 * np.abs(dw)
            assert np.all(np.abs(got64 - dw) <= limit), f"seed {seed}: {name}, {t} threads"
            if name in first:
                np.testing.assert_array_equal(bits(got), first[name], err_msg=f"seed {seed}")
            first[name] = bits(got)
    return expected


def assert_half_path_is_the_widened_float32_path(f, g, w, rel, seed, threads=(1, 2, 3)):
    """Mixed (float32 weight) and all-half (weight in f's dtype) weight
    gradients of half f, g at every thread count against the float32 path on
    f, g cast to float32 (float32 dW, rounded once for a half weight)."""
    f32, g32 = f.astype(mx.float32), g.astype(mx.float32)
    expected = with_threads(1, lambda: weight_grad_array(f32, g32, w, rel))
    if BF16_WGRAD and f.dtype == mx.bfloat16:
        return assert_bf16_driver_weight_grad(f, g, w, rel, seed, threads, expected)
    expected_half = expected.astype(f.dtype)
    for n in threads:
        mixed = with_threads(n, lambda: weight_grad_array(f, g, w, rel))
        assert mixed.dtype == mx.float32, f"seed {seed}: mixed dW is {mixed.dtype}"
        np.testing.assert_array_equal(
            bits(mixed), bits(expected), err_msg=f"seed {seed}: mixed {f.dtype}, {n} threads"
        )
        half = with_threads(n, lambda: weight_grad_array(f, g, w.astype(f.dtype), rel))
        assert half.dtype == f.dtype, f"seed {seed}: half dW is {half.dtype}"
        np.testing.assert_array_equal(
            bits(half), bits(expected_half), err_msg=f"seed {seed}: {f.dtype}, {n} threads"
        )
    return expected


@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize(
    ("cin", "cout", "kernel_size"),
    [
        (1, 1, 3),
        (3, 17, 3),
        (17, 3, 3),
        (33, 64, 3),
        (64, 33, 3),
        (130, 130, 3),
        (33, 130, 1),
        (130, 17, 1),
    ],
)
def test_half_rows_are_the_float32_path_on_widened_inputs(
    rng, seed, ref, dtype, cin, cout, kernel_size
):
    # Pointwise layers (kernel_size 1) split dW's rows into blocks over the
    # threads: each block widens only its columns of the feature rows.
    coords = ref.random_coords(rng, 1500, 12, batches=2)
    rel = build_kernel_relation(coords, kernel_size=kernel_size)
    k = kernel_size**3
    f, g, w = half_case(rng, rel, cin, cout, k, HALF[dtype])
    assert_half_path_is_the_widened_float32_path(f, g, w, rel, seed)


@pytest.mark.parametrize("dtype", sorted(HALF))
def test_half_rows_with_several_slabs(rng, seed, ref, dtype):
    _, rel = large_relation(rng, ref)
    f, g, w = half_case(rng, rel, 24, 40, 27, HALF[dtype])
    assert_half_path_is_the_widened_float32_path(f, g, w, rel, seed)


@pytest.mark.parametrize("dtype", sorted(HALF))
def test_half_rows_offsets_without_edges_and_empty_relations(rng, seed, ref, dtype):
    coords = ref.random_coords(rng, 150, 5, step=2)
    rel = build_kernel_relation(coords, kernel_size=5)
    counts = np.array(rel.counts)
    assert (counts == 0).sum() > 50 and (counts > 0).sum() > 5, f"seed {seed}: {counts}"
    f, g, w = half_case(rng, rel, 9, 20, 125, HALF[dtype])
    got = assert_half_path_is_the_widened_float32_path(f, g, w, rel, seed)
    np.testing.assert_array_equal(np.array(got)[counts == 0], 0.0, err_msg=f"seed {seed}")
    empty = build_kernel_relation(np.zeros((0, 4), np.int32))
    z_f, z_g = mx.zeros((0, 5), HALF[dtype]), mx.zeros((0, 7), HALF[dtype])
    for weight in (mx.ones((27, 5, 7)), mx.ones((27, 5, 7), HALF[dtype])):
        got = weight_grad_array(z_f, z_g, weight, empty)
        assert got.dtype == weight.dtype, f"seed {seed}: {got.dtype}"
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), 0.0)


def shuffled_grouping(rng, rel):
    """The relation with each offset's edges listed in a random order."""
    offsets = np.array(rel.kernel_csr.row_offsets)
    ids = np.array(rel.kernel_csr.edge_ids)
    for k in range(len(offsets) - 1):
        ids[offsets[k] : offsets[k + 1]] = rng.permutation(ids[offsets[k] : offsets[k + 1]])
    return dataclasses.replace(
        rel,
        kernel_csr=RelationCSR(rel.kernel_csr.row_offsets, mx.array(ids)),
        _native=None,
        _sorted=[],
    )


@pytest.mark.parametrize("dtype", sorted(HALF))
def test_half_rows_in_any_edge_order(rng, seed, ref, dtype):
    # Unsorted offset lists put cotangent rows outside a band's row range:
    # those are widened with their chunk instead of with the band.
    _, rel = large_relation(rng, ref)
    f, g, w = half_case(rng, rel, 16, 24, 27, HALF[dtype])
    assert_half_path_is_the_widened_float32_path(f, g, w, shuffled_grouping(rng, rel), seed)


def test_half_rows_match_float64_add_at(rng, seed, ref):
    """The mixed float16 dW against float64 np.add.at over the float16 values."""
    coords = ref.random_coords(rng, 400, 8, batches=2)
    rel = build_kernel_relation(coords, kernel_size=3)
    f, g, w = half_case(rng, rel, 19, 70, 27, mx.float16)
    dw, mag = reference_add_at(f.astype(mx.float32), g.astype(mx.float32), rel, 27)
    assert_close(np.array(weight_grad_array(f, g, w, rel)), dw, mag, seed)


_HALF_ISA_SCRIPT = """
import sys
import mlx.core as mx
import numpy as np
from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation, ops, use_dataflow

data = np.load(sys.argv[1])
rel = build_kernel_relation(mx.array(data["coords"]), kernel_size=3)
f, g, w = (mx.array(data[k]) for k in ("f", "g", "w"))

def dw(f, g, w):
    with use_dataflow("generic"):
        _, (d,) = mx.vjp(lambda w: ops.sparse_conv_features_from_relation(f, w, rel), [w], [g])
    return np.array(d.astype(mx.float32))

out = {"isa": ext.gemm_isa(), "float32": dw(f, g, w)}
for name, dtype in (("float16", mx.float16), ("bfloat16", mx.bfloat16)):
    fh, gh = f.astype(dtype), g.astype(dtype)
    out[name + "_widened"] = dw(fh.astype(mx.float32), gh.astype(mx.float32), w)
    out[name + "_mixed"] = dw(fh, gh, w)
    out[name + "_half"] = dw(fh, gh, w.astype(dtype))
    out[name + "_half_widened"] = np.array(
        mx.array(out[name + "_widened"]).astype(dtype).astype(mx.float32)
    )
np.savez(sys.argv[2], **out)
"""


def test_half_rows_on_every_micro_kernel_path(rng, seed, ref, tmp_path, isa_child):
    """Each forced ISA (its widening and its micro-kernel) on a relation of
    several slabs: the half-precision dW is the float32 path's on the
    widened inputs, in the same child, bit for bit."""
    coords, rel = large_relation(rng, ref)
    f, g, w = inputs(rng, rel.n_in, rel.n_in, 19, 70, 27)
    inputs_path = tmp_path / "inputs.npz"
    np.savez(inputs_path, coords=coords, f=np.array(f), g=np.array(g), w=np.array(w))
    for isa in ext.gemm_isas():
        path = tmp_path / f"{isa}.npz"
        isa_child(_HALF_ISA_SCRIPT, isa, inputs_path, path)
        result = np.load(path)
        assert str(result["isa"]) == isa, f"seed {seed}: asked {isa}, ran {result['isa']}"
        for name in HALF:
            widened = result[name + "_widened"]
            np.testing.assert_array_equal(
                result[name + "_mixed"], widened, err_msg=f"seed {seed}: {isa} {name} mixed"
            )
            np.testing.assert_array_equal(
                result[name + "_half"],
                result[name + "_half_widened"],
                err_msg=f"seed {seed}: {isa} {name} half weight",
            )
            # The cast really rounded: the widened inputs are not the float32 ones.
            assert not np.array_equal(widened, result["float32"]), f"seed {seed}: {isa} {name}"
