"""Quantized convolution against the dequantized float path; pooling against
brute force."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lattice.core import QuantizedWeight, build_kernel_relation, ops


@pytest.mark.parametrize(
    ("bits", "group_size", "cin", "cout"),
    [
        (2, 32, 32, 8),
        (3, 32, 14, 5),
        (4, 64, 64, 64),
        (5, 32, 40, 3),
        (6, 32, 32, 7),
        (8, 128, 96, 16),
    ],
)
def test_quantized_matches_dequantized_float(rng, ref, bits, group_size, cin, cout):
    coords = ref.random_coords(rng, 200, 7, batches=2)
    rel = build_kernel_relation(coords)
    w = mx.array(rng.standard_normal((cout, 3, 3, 3, cin)).astype(np.float32))
    qw = QuantizedWeight.from_float(w, bits=bits, group_size=group_size)
    assert qw.storage_in_channels % group_size == 0 and qw.in_channels == cin
    deq = qw.dequantize()
    assert deq.shape == (27, cin, cout)
    # Quantization error stays within one step (|scale|) of each group.
    step = np.abs(np.repeat(np.array(qw.scales), group_size, axis=2)[:, :, :cin].transpose(0, 2, 1))
    assert np.all(np.abs(np.array(deq) - np.array(ops.mapped_conv_weight(w))) <= step + 1e-5)
    f = mx.array(rng.standard_normal((len(coords), cin)).astype(np.float32))
    out = ops.sparse_quantized_conv_features_from_relation(f, qw, rel)
    expected = ops.sparse_conv_features_from_relation(f, deq, rel)
    np.testing.assert_allclose(
        np.array(out), np.array(expected), rtol=1e-4, atol=1e-4 * float(mx.abs(expected).max())
    )
    # Feature gradients equal those of the dequantized float convolution.
    probe = mx.array(rng.standard_normal(out.shape).astype(np.float32))
    g = mx.grad(
        lambda a: (ops.sparse_quantized_conv_features_from_relation(a, qw, rel) * probe).sum()
    )(f)
    g_ref = mx.grad(lambda a: (ops.sparse_conv_features_from_relation(a, deq, rel) * probe).sum())(
        f
    )
    np.testing.assert_allclose(
        np.array(g), np.array(g_ref), rtol=1e-4, atol=1e-4 * float(mx.abs(g_ref).max())
    )
    t = mx.array(rng.standard_normal(f.shape).astype(np.float32))
    _, (tan,) = mx.jvp(
        lambda a: ops.sparse_quantized_conv_features_from_relation(a, qw, rel), [f], [t]
    )
    np.testing.assert_allclose(
        np.array(tan),
        np.array(ops.sparse_quantized_conv_features_from_relation(t, qw, rel)),
        rtol=1e-6,
    )


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_quantized_half_features_and_sorted_view(rng, ref, dtype):
    coords = ref.random_coords(rng, 300, 7)
    rel = build_kernel_relation(coords)
    w = mx.array(rng.standard_normal((32, 3, 3, 3, 32)).astype(np.float32) * 0.05).astype(
        mx.float16
    )
    qw = QuantizedWeight.from_float(w, bits=4, group_size=32)
    f = mx.array(rng.standard_normal((len(coords), 32)).astype(np.float32)).astype(dtype)
    out = ops.sparse_quantized_conv_features_from_relation(f, qw, rel)
    assert out.dtype == dtype
    expected = ops.sparse_conv_features_from_relation(
        f.astype(mx.float32), qw.dequantize().astype(mx.float32), rel
    )
    np.testing.assert_allclose(
        np.array(out.astype(mx.float32)), np.array(expected), rtol=2e-2, atol=2e-2
    )


def test_quantized_errors(rng, ref):
    rel = build_kernel_relation(ref.random_coords(rng, 30, 4), kernel_size=2)
    qw = QuantizedWeight.from_float(mx.zeros((27, 32, 4)), bits=4, group_size=32)
    with pytest.raises(ValueError, match="kernel rows must match"):
        ops.sparse_quantized_conv_features_from_relation(mx.zeros((rel.n_in, 32)), qw, rel)
    with pytest.raises(ValueError, match="features must be"):
        ops.sparse_quantized_conv_features_from_relation(
            mx.zeros((rel.n_in, 32), mx.int32), qw, rel
        )
    with pytest.raises(ValueError, match="bits must be one of"):
        QuantizedWeight.from_float(mx.zeros((8, 32, 4)), bits=7)
    with pytest.raises(ValueError, match="group_size must be one of"):
        QuantizedWeight.from_float(mx.zeros((8, 32, 4)), group_size=16)
    good = QuantizedWeight.from_float(mx.zeros((8, 32, 4)), bits=4, group_size=32)
    f = mx.zeros((rel.n_in, 32))
    with pytest.raises(ValueError, match="gradients with respect to the quantized weight"):
        mx.grad(lambda s: ops.sparse_quantized_conv_features_from_relation(
            f, QuantizedWeight(good.weight, s, good.biases, 32, 4, 32, 32, 4), rel).sum())(good.scales)  # fmt: skip


@pytest.mark.parametrize("mode", ["max", "avg", "sum"])
@pytest.mark.parametrize(("ks", "stride"), [(2, 2), (3, 2), (3, 1)])
def test_pooling_matches_brute_force(rng, ref, mode, ks, stride):
    coords = ref.random_coords(rng, 300, 8, batches=2)
    kind = "forward"
    rel = build_kernel_relation(coords, kernel_size=ks, stride=stride, kind=kind)
    f = mx.array(rng.standard_normal((len(coords), 6)).astype(np.float32))
    exclusive = ks == stride
    out = ops.sparse_pool_features_from_relation(f, rel, input_exclusive=exclusive, mode=mode)
    edges = ref.brute_force_edges(
        coords, np.array(rel.out_coords), ref.offsets((ks,) * 3, (1, 1, 1), (1, 1, 1))
    )
    expected = ref.brute_force_pool(np.array(f), edges, rel.n_out_capacity, mode)
    np.testing.assert_allclose(np.array(out), expected, rtol=1e-5, atol=1e-5)
    # Gradient against a brute-force adjoint.
    probe = rng.standard_normal(out.shape).astype(np.float32)
    g = mx.grad(
        lambda a: (
            ops.sparse_pool_features_from_relation(a, rel, input_exclusive=exclusive, mode=mode)
            * mx.array(probe)
        ).sum()
    )(f)
    g_ref = np.zeros(f.shape)
    fn = np.array(f)
    groups: dict[int, list[int]] = {}
    for i, o, _ in sorted(edges, key=lambda e: (e[1], e[2])):
        groups.setdefault(o, []).append(i)
    for o, rows in groups.items():
        if mode == "max":
            winner = np.array(rows)[np.argmax(fn[rows], axis=0)]
            g_ref[winner, np.arange(6)] += probe[o]
        else:
            for i in rows:
                g_ref[i] += probe[o] / (len(rows) if mode == "avg" else 1)
    np.testing.assert_allclose(np.array(g), g_ref, rtol=1e-5, atol=1e-5)
    t = mx.array(rng.standard_normal(f.shape).astype(np.float32))
    _, (tan,) = mx.jvp(
        lambda a: ops.sparse_pool_features_from_relation(
            a, rel, input_exclusive=exclusive, mode=mode
        ),
        [f],
        [t],
    )
    tn = np.array(t)
    if mode == "max":  # the tangent at each window's (first) maximum
        tan_ref = np.zeros(out.shape)
        for o, rows in groups.items():
            winner = np.array(rows)[np.argmax(fn[rows], axis=0)]
            tan_ref[o] = tn[winner, np.arange(6)]
    else:  # linear: the pooled tangent
        tan_ref = ref.brute_force_pool(tn, edges, rel.n_out_capacity, mode)
    np.testing.assert_allclose(np.array(tan), tan_ref, rtol=1e-5, atol=1e-5)


def test_pooling_half_dtype_and_errors(rng, ref):
    coords = ref.random_coords(rng, 100, 6)
    rel = build_kernel_relation(coords, kernel_size=3, stride=2, kind="forward")
    f = mx.array(rng.standard_normal((len(coords), 4)).astype(np.float32)).astype(mx.bfloat16)
    out = ops.sparse_pool_features_from_relation(f, rel, input_exclusive=False, mode="max")
    assert out.dtype == mx.bfloat16
    with pytest.raises(ValueError, match="mode must be"):
        ops.sparse_pool_features_from_relation(f, rel, input_exclusive=False, mode="median")
    with pytest.raises(ValueError, match="input_exclusive=True but input row"):
        ops.sparse_pool_features_from_relation(f, rel, input_exclusive=True, mode="sum")
    # Second-order: the pooling gradient is itself differentiable.
    g2 = mx.grad(
        lambda a: (
            mx.grad(
                lambda b: (
                    ops.sparse_pool_features_from_relation(
                        b, rel, input_exclusive=False, mode="avg"
                    )
                    ** 2
                ).sum()
            )(a)
            ** 2
        ).sum()
    )(f.astype(mx.float32))
    # avg pooling is linear, pool(b) = P @ b with P[o, i] = 1 / |window(o)|,
    # so g(a) = 2 P^T P a and the outer gradient is 8 (P^T P)^2 a.
    pmat = np.zeros((rel.n_out_capacity, rel.n_in))
    out_rows, in_rows = np.array(rel.edges.out_rows), np.array(rel.edges.in_rows)
    sizes = np.bincount(out_rows, minlength=rel.n_out_capacity)
    pmat[out_rows, in_rows] = 1.0 / sizes[out_rows]
    gram = pmat.T @ pmat
    expected = 8 * gram @ gram @ np.array(f.astype(mx.float32), dtype=np.float64)
    np.testing.assert_allclose(np.array(g2), expected, rtol=1e-4, atol=1e-5)


def test_compile_through_pool_quantized_and_sorted(rng, ref):
    coords = ref.random_coords(rng, 200, 7)
    rel = build_kernel_relation(coords)
    down = build_kernel_relation(coords, kernel_size=2, stride=2, kind="forward")
    qw = QuantizedWeight.from_float(
        mx.array(rng.standard_normal((27, 32, 32)).astype(np.float32) * 0.05), bits=4, group_size=32
    )
    w16 = mx.array(rng.standard_normal((27, 32, 32)).astype(np.float32) * 0.05).astype(mx.float16)

    def step(f):
        q = ops.sparse_quantized_conv_features_from_relation(f, qw, rel)
        s = ops.sparse_conv_features_sorted_from_relation(q.astype(mx.float16), w16, rel).astype(
            mx.float32
        )
        pooled = ops.sparse_pool_features_from_relation(s, down, input_exclusive=True, mode="max")
        return pooled, mx.grad(
            lambda a: ops.sparse_pool_features_from_relation(
                ops.sparse_quantized_conv_features_from_relation(a, qw, rel),
                down,
                input_exclusive=True,
                mode="avg",
            ).sum()
        )(f)

    f = mx.array(rng.standard_normal((len(coords), 32)).astype(np.float32))
    for a, b in zip(step(f), mx.compile(step)(f), strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
