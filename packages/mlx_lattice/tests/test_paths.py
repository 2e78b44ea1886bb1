"""All convolution dataflows agree: generic, sorted implicit GEMM, direct
reference, the implicit-GEMM view in plain MLX, the padded C16 head and the
normalization denominator; the automatic choice and a forced one are
observed (record_dataflows), not assumed."""

import gc
import weakref

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice._native import ext
from mlx_lattice.core import (
    DataflowError,
    build_kernel_relation,
    ops,
    record_dataflows,
    use_dataflow,
    weights,
)


def half(rng, shape, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(mx.float16)


def f32(a):
    return np.array(a.astype(mx.float32))


def generic(f, w, rel):
    """The generic native kernel, forced (and checked to have run)."""
    with use_dataflow("generic"), record_dataflows() as runs:
        out = ops.sparse_conv_features_from_relation(f, w, rel)
    assert runs == [("sparse_conv_features", "generic")]
    return out


def auto(f, w, rel):
    """The automatic choice: (result, dataflow that ran)."""
    with record_dataflows() as runs:
        out = ops.sparse_conv_features_from_relation(f, w, rel)
    assert len(runs) == 1 and runs[0][0] == "sparse_conv_features"
    return out, runs[0][1]


@pytest.mark.parametrize("channels", [32, 64])
@pytest.mark.parametrize("kind", ["submanifold", "forward"])
def test_sorted_paths_agree(rng, ref, channels, kind):
    coords = ref.random_coords(rng, 400, 8, batches=2)
    stride = 2 if kind == "forward" else 1
    rel = build_kernel_relation(coords, kernel_size=3, stride=stride, kind=kind)
    f = half(rng, (len(coords), channels))
    w = half(rng, (channels, 3, 3, 3, channels), 1 / np.sqrt(27 * channels))
    dense = ref.dense_conv(
        coords, f.astype(mx.float32), w.astype(mx.float32), grid=(8, 8, 8), batches=2,
        out_coords=np.array(rel.out_coords), stride=(stride,) * 3,
    )  # fmt: skip
    sorted_out = ops.sparse_conv_features_sorted_from_relation(f, w, rel)
    assert sorted_out.dtype == mx.float16
    # The automatic choice: the sorted path on a GPU stream; on the CPU the
    # generic kernel (the benchmark shows it faster there).
    chosen, flow = auto(f, w, rel)
    assert flow == ("sorted" if mx.default_device() == mx.gpu else "generic")
    np.testing.assert_array_equal(f32(chosen), f32(sorted_out))
    # Same reduction order as the generic kernel: identical bits.
    np.testing.assert_array_equal(f32(generic(f, w, rel)), f32(sorted_out))
    direct = ops.sparse_conv_features_sorted_direct_reference_from_relation(f, w, rel)
    view = ops.sparse_conv_features_from_implicit_gemm_view(
        f.astype(mx.float32), w.astype(mx.float32), rel.out_in_map()
    )
    for got in (sorted_out, direct, view):
        np.testing.assert_allclose(f32(got), np.array(dense), rtol=1e-2, atol=1e-2)
    # store_sorted keeps rows in sorted order.
    perm = np.array(rel.require_sorted_implicit_gemm().reorder_rows)
    stored = ops.sparse_conv_features_sorted_from_relation(f, w, rel, store_sorted=True)
    np.testing.assert_array_equal(f32(stored), f32(sorted_out)[perm])
    stored_direct = ops.sparse_conv_features_sorted_direct_reference_from_relation(
        f, w, rel, store_sorted=True
    )
    np.testing.assert_array_equal(f32(stored_direct), f32(direct)[perm])


@pytest.mark.parametrize("store_sorted", [False, True])
def test_sorted_path_gradients(rng, ref, store_sorted):
    coords = ref.random_coords(rng, 300, 7)
    rel = build_kernel_relation(coords)
    f = half(rng, (len(coords), 32))
    w = half(rng, (27, 32, 32), 0.03)
    probe = half(rng, (len(coords), 32))
    paths = {
        "sorted": lambda a, b: ops.sparse_conv_features_sorted_from_relation(
            a, b, rel, store_sorted=store_sorted
        ),
        "direct": lambda a, b: ops.sparse_conv_features_sorted_direct_reference_from_relation(
            a, b, rel, store_sorted=store_sorted
        ),
    }
    perm = np.array(rel.require_sorted_implicit_gemm().reorder_rows)
    p = probe[mx.array(perm)] if store_sorted else probe
    ref_grads = mx.grad(
        lambda a, b: (generic(a, b, rel).astype(mx.float32) * probe).sum(), argnums=(0, 1)
    )(f, w)
    for fn in paths.values():
        grads = mx.grad(
            lambda a, b, fn=fn: (fn(a, b).astype(mx.float32) * p).sum(), argnums=(0, 1)
        )(f, w)
        for g, r in zip(grads, ref_grads, strict=True):
            np.testing.assert_allclose(f32(g), f32(r), rtol=2e-2, atol=2e-2)
    tf, tw = half(rng, f.shape), half(rng, w.shape, 0.03)
    _, (t,) = mx.jvp(paths["sorted"], [f, w], [tf, tw])
    expected = paths["sorted"](tf, w).astype(mx.float32) + paths["sorted"](f, tw).astype(mx.float32)
    np.testing.assert_allclose(f32(t), np.array(expected), rtol=2e-2, atol=2e-2)


def test_sorted_path_refuses_other_shapes(rng, ref):
    rel = build_kernel_relation(ref.random_coords(rng, 50, 5))
    with pytest.raises(ValueError, match="sorted implicit GEMM is not supported"):
        ops.sparse_conv_features_sorted_from_relation(
            mx.zeros((rel.n_in, 16), mx.float16), mx.zeros((27, 16, 16), mx.float16), rel
        )
    with pytest.raises(ValueError, match="sorted direct convolution reference is not supported"):
        ops.sparse_conv_features_sorted_direct_reference_from_relation(
            mx.zeros((rel.n_in, 32)), mx.zeros((27, 32, 32), mx.float16), rel
        )


def test_c64_to_c14_head_padded_to_c16(rng, ref):
    coords = ref.random_coords(rng, 6000, 24)
    rel = build_kernel_relation(coords)
    f = half(rng, (len(coords), 64))
    w = half(rng, (14, 3, 3, 3, 64), 0.02)
    # The automatic choice stays generic (padding measured within noise).
    out, flow = auto(f, w, rel)
    assert flow == "generic" and out.dtype == mx.float16
    with use_dataflow("padded_c16"), record_dataflows() as runs:
        padded_out = ops.sparse_conv_features_from_relation(f, w, rel)
    assert runs == [("sparse_conv_features", "padded_c16")]
    # Zero columns change no sum: the same bits as the generic kernel.
    np.testing.assert_array_equal(f32(padded_out), f32(out))
    padded = ops._padded_weight(w)
    np.testing.assert_array_equal(
        np.array(padded), np.pad(np.array(ops.mapped_conv_weight(w)), [(0, 0), (0, 0), (0, 2)])
    )
    assert ops._padded_weight(w) is padded


def test_mapped_weight_cache_is_never_stale_and_never_keeps_weights_alive(rng):
    w = mx.array(rng.standard_normal((4, 3, 3, 3, 2)).astype(np.float32))
    mapped = ops.mapped_conv_weight(w)
    assert ops.mapped_conv_weight(w) is mapped
    np.testing.assert_array_equal(
        np.array(mapped), np.array(w).transpose(1, 2, 3, 4, 0).reshape(27, 2, 4)
    )
    w[0] = 7.0  # in-place update: same object, new value
    fresh = ops.mapped_conv_weight(w)
    assert fresh is not mapped
    np.testing.assert_array_equal(np.array(fresh)[:, :, 0], np.full((27, 2), 7.0))
    alive = weakref.ref(w)
    key = id(w)
    del w, mapped, fresh
    gc.collect()
    assert alive() is None
    assert key not in weights._MAPPED_WEIGHT_CACHE


def test_normalization_denominator(rng, ref):
    coords = ref.random_coords(rng, 90000, 48, batches=2)
    rel = build_kernel_relation(coords)
    assert rel.n_out_capacity >= 1 << 16
    ones = mx.ones((len(coords), 16), mx.float16)
    sq = half(rng, (27, 16, 8), 0.1) ** 2
    with record_dataflows() as runs:
        den = ops.sparse_conv_normalization_denominator_from_relation(ones, sq, rel)
    assert runs == [("sparse_conv_normalization_denominator", "denominator_csr")]
    assert den is not None and den.dtype == mx.float16
    full = generic(ones, sq, rel)
    np.testing.assert_allclose(f32(den), f32(full), rtol=2e-3, atol=2e-3)
    # Gradients and tangents are those of the full convolution.
    probe = half(rng, (len(coords), 8))
    g_den = mx.grad(
        lambda a, b: (
            (ops.sparse_conv_normalization_denominator_from_relation(a, b, rel) * probe)
            .astype(mx.float32)
            .sum()
        ),
        argnums=(0, 1),
    )(ones, sq)
    g_full = mx.grad(
        lambda a, b: (generic(a, b, rel) * probe).astype(mx.float32).sum(), argnums=(0, 1)
    )(ones, sq)
    for a, b in zip(g_den, g_full, strict=True):
        np.testing.assert_array_equal(f32(a), f32(b))
    t = half(rng, sq.shape, 0.1)
    _, (tan,) = mx.jvp(
        lambda b: ops.sparse_conv_normalization_denominator_from_relation(ones, b, rel), [sq], [t]
    )
    np.testing.assert_array_equal(f32(tan), f32(generic(ones, t, rel)))
    # Cases outside the specialised reduction return None.
    small = build_kernel_relation(coords[:100])
    assert ops.sparse_conv_normalization_denominator_from_relation(ones[:100], sq, small) is None
    assert (
        ops.sparse_conv_normalization_denominator_from_relation(ones.astype(mx.float32), sq, rel)
        is None
    )
    # float32 takes the specialised reduction too.
    ones32, sq32 = ones.astype(mx.float32), sq.astype(mx.float32)
    with record_dataflows() as runs:
        den32 = ops.sparse_conv_normalization_denominator_from_relation(ones32, sq32, rel)
    assert runs == [("sparse_conv_normalization_denominator", "denominator_csr")]
    np.testing.assert_allclose(
        np.array(den32), np.array(generic(ones32, sq32, rel)), rtol=1e-5, atol=1e-5
    )


def test_native_denominator_primitive_autodiff(rng, ref):
    coords = ref.random_coords(rng, 200, 6)
    rel = build_kernel_relation(coords)
    w = mx.array(rng.standard_normal((27, 4, 3)).astype(np.float32))
    den = ext.sparse_conv_normalization_denominator(w, rel)
    full = generic(mx.ones((len(coords), 4)), w, rel)
    np.testing.assert_allclose(np.array(den), np.array(full), rtol=1e-5, atol=1e-5)
    probe = mx.array(rng.standard_normal(den.shape).astype(np.float32))
    g = mx.grad(lambda b: (ext.sparse_conv_normalization_denominator(b, rel) * probe).sum())(w)
    g_ref = mx.grad(lambda b: (generic(mx.ones((len(coords), 4)), b, rel) * probe).sum())(w)
    np.testing.assert_allclose(np.array(g), np.array(g_ref), rtol=1e-4, atol=1e-4)
    t = mx.array(rng.standard_normal(w.shape).astype(np.float32))
    _, (tan,) = mx.jvp(lambda b: ext.sparse_conv_normalization_denominator(b, rel), [w], [t])
    np.testing.assert_allclose(
        np.array(tan), np.array(ext.sparse_conv_normalization_denominator(t, rel)), rtol=1e-6
    )


def test_forced_dataflows_run_and_agree(rng, ref):
    """Every dataflow that applies, forced, runs (observed) and agrees with the
    dense reference; forcing one that cannot apply raises naming it."""
    coords = ref.random_coords(rng, 300, 7)
    rel = build_kernel_relation(coords)
    for dtype, tol in ((mx.float32, 1e-4), (mx.float16, 1e-2), (mx.bfloat16, 5e-2)):
        f = mx.array(rng.standard_normal((len(coords), 32)).astype(np.float32)).astype(dtype)
        w = mx.array((rng.standard_normal((32, 3, 3, 3, 32)) * 0.05).astype(np.float32))
        w = w.astype(dtype)
        dense = np.array(
            ref.dense_conv(
                coords, f.astype(mx.float32), w.astype(mx.float32), grid=(7, 7, 7), batches=1,
                out_coords=np.array(rel.out_coords),
            )
        )  # fmt: skip
        for flow in ("generic", "sorted"):
            with use_dataflow(flow), record_dataflows() as runs:
                out = ops.sparse_conv_features_from_relation(f, w, rel)
            assert runs == [("sparse_conv_features", flow)]
            np.testing.assert_allclose(f32(out), dense, rtol=tol, atol=tol, err_msg=f"{flow}")
        w14 = w[:14]
        with use_dataflow("padded_c16"), record_dataflows() as runs:
            out = ops.sparse_conv_features_from_relation(f, w14, rel)
        assert runs == [("sparse_conv_features", "padded_c16")]
        np.testing.assert_allclose(f32(out), dense[:, :14], rtol=tol, atol=tol)
    with use_dataflow("sorted"), pytest.raises(DataflowError, match="dataflow 'sorted' needs"):
        ops.sparse_conv_features_from_relation(f[:, :16], w[:, :, :, :, :16], rel)
    with use_dataflow("padded_c16"), pytest.raises(DataflowError, match="'padded_c16' needs"):
        ops.sparse_conv_features_from_relation(f, w, rel)
    with pytest.raises(DataflowError, match="dataflow must be one of"), use_dataflow("fastest"):
        pass


def test_tiles_sized_from_any_l2_keep_the_bits(rng, ref):
    """The float32 and bfloat16 forwards and feature gradients
    give the same bits whatever L2 size the tile drivers are told
    (set_kernel_l2_bytes: hosts with a small L2 run the grown tiles too, and
    large hosts the small ones; told of 64 KiB, the float32 forward's 2.8 MB
    output is summed in per-thread windows and streamed out,
    cpu/output_window.h); float32 also against float64 NumPy."""
    coords = ref.random_coords(rng, 30000, 36)
    rel = build_kernel_relation(coords, kernel_size=3)
    assert rel.n_out_capacity >= 8 * 4 * 512
    channels = 32
    f = rng.standard_normal((len(coords), channels)).astype(np.float32)
    w = (rng.standard_normal((27, channels, channels)) / np.sqrt(27 * channels)).astype(np.float32)

    def run():
        outs = []
        for dtype in (mx.float32, mx.bfloat16):
            fx, wx = mx.array(f).astype(dtype), mx.array(w).astype(dtype)
            with use_dataflow("generic"):
                y = ops.sparse_conv_features_from_relation(fx, wx, rel)
                cot = mx.ones_like(y)
                grad = mx.vjp(
                    lambda a, wx=wx: ops.sparse_conv_features_from_relation(a, wx, rel), [fx], [cot]
                )[1][0]
            outs += [np.array(y.astype(mx.float32)), np.array(grad.astype(mx.float32))]
        return outs

    results = {}
    for l2 in (0, 64 << 10, 2 << 20, 64 << 20):
        mlx_lattice.set_kernel_l2_bytes(l2)
        try:
            results[l2] = run()
        finally:
            mlx_lattice.set_kernel_l2_bytes(None)
    for l2, outs in results.items():
        for j, (got, want) in enumerate(zip(outs, results[0], strict=True)):
            np.testing.assert_array_equal(got, want, err_msg=f"L2 {l2} bytes, output {j}")
    expect = np.zeros((rel.n_out_capacity, channels))
    e = rel.edges
    i, o, k = np.array(e.in_rows), np.array(e.out_rows), np.array(e.kernel_ids)
    np.add.at(expect, o, np.einsum("ec,ecd->ed", f[i].astype(np.float64), w[k].astype(np.float64)))
    np.testing.assert_allclose(results[0][0], expect, rtol=1e-4, atol=1e-4)
