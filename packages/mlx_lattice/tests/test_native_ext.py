"""The native extension's plumbing: a real MLX primitive across nanobind."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lattice._native import ext


@pytest.fixture
def rng():
    return np.random.default_rng()


def test_scaled_add_matches_numpy(rng):
    x = rng.standard_normal((5, 7)).astype(np.float32)
    y = rng.standard_normal((5, 7)).astype(np.float32)
    out = ext.scaled_add(mx.array(x), mx.array(y), alpha=1.5, beta=-0.25)
    assert isinstance(out, mx.array)
    assert out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), 1.5 * x - 0.25 * y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_scaled_add_half_dtypes(rng, dtype):
    x = mx.array(rng.standard_normal(64).astype(np.float32)).astype(dtype)
    y = mx.array(rng.standard_normal(64).astype(np.float32)).astype(dtype)
    out = ext.scaled_add(x, y, alpha=2.0, beta=3.0)
    assert out.dtype == dtype
    ref = 2.0 * np.array(x.astype(mx.float32)) + 3.0 * np.array(y.astype(mx.float32))
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), ref, rtol=1e-2, atol=1e-2)


def test_scaled_add_non_contiguous_input(rng):
    x = mx.array(rng.standard_normal((4, 6)).astype(np.float32))
    y = mx.array(rng.standard_normal((6, 4)).astype(np.float32))
    out = ext.scaled_add(x, y.T, alpha=1.0, beta=2.0)
    np.testing.assert_allclose(np.array(out), np.array(x) + 2.0 * np.array(y).T, rtol=1e-6)


def test_grad_through_primitive(rng):
    x = mx.array(rng.standard_normal(10).astype(np.float32))
    y = mx.array(rng.standard_normal(10).astype(np.float32))

    def loss(a, b):
        return (ext.scaled_add(a, b, alpha=3.0, beta=-2.0) ** 2).sum()

    gx, gy = mx.grad(loss, argnums=(0, 1))(x, y)
    z = 3.0 * np.array(x) - 2.0 * np.array(y)
    np.testing.assert_allclose(np.array(gx), 2 * z * 3.0, rtol=1e-5)
    np.testing.assert_allclose(np.array(gy), 2 * z * -2.0, rtol=1e-5)


def test_jvp_vmap_and_compile(rng):
    x = mx.array(rng.standard_normal(8).astype(np.float32))
    y = mx.array(rng.standard_normal(8).astype(np.float32))
    tx = mx.array(rng.standard_normal(8).astype(np.float32))
    ty = mx.array(rng.standard_normal(8).astype(np.float32))
    _, (t,) = mx.jvp(lambda a, b: ext.scaled_add(a, b, alpha=0.5, beta=4.0), [x, y], [tx, ty])
    np.testing.assert_allclose(np.array(t), 0.5 * np.array(tx) + 4.0 * np.array(ty), rtol=1e-6)

    xs = mx.array(rng.standard_normal((3, 8)).astype(np.float32))
    out = mx.vmap(lambda a: ext.scaled_add(a, y, alpha=2.0, beta=1.0))(xs)
    np.testing.assert_allclose(np.array(out), 2.0 * np.array(xs) + np.array(y), rtol=1e-6)

    compiled = mx.compile(lambda a, b: ext.scaled_add(a, b, alpha=2.0, beta=-1.0))
    np.testing.assert_allclose(np.array(compiled(x, y)), 2 * np.array(x) - np.array(y), rtol=1e-6)


def test_shape_mismatch_raises_value_error():
    with pytest.raises(ValueError, match=r"same shape.*\(2, 3\).*\(3, 2\)"):
        ext.scaled_add(mx.zeros((2, 3)), mx.zeros((3, 2)))


def test_integer_dtype_raises_value_error():
    with pytest.raises(ValueError, match="x must be float32, float16 or bfloat16"):
        ext.scaled_add(mx.zeros((2,), dtype=mx.int32), mx.zeros((2,), dtype=mx.int32))


def test_gpu_stream_reports_missing_metal():
    if mx.metal.is_available():
        pytest.skip("real Metal device present")
    with pytest.raises((RuntimeError, ValueError)):
        mx.eval(ext.scaled_add(mx.ones(2), mx.ones(2), stream=mx.gpu))
