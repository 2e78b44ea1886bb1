"""The native training-mode batch norm (``ext.batch_norm_train``, used by
``mlx_lattice.fused.batch_norm_train`` on the CPU) against independent
references: float64 NumPy statistics, ``mlx.nn.BatchNorm`` + ReLU on float32
features (values and MLX autodiff of that unfused form), MLX's own casts of
the float32 result, central finite differences; bitwise determinism across
thread counts; edge sizes and bad arguments.

Every random input comes from the per-test ``rng`` (its seed is printed on
failure and replayed with ``TEST_SEED``).
"""

import mlx.core as mx
import mlx.nn as mnn
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice import fused, nn
from mlx_lattice._native import ext

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def _inputs(rng, n=300, c=13, dtype=mx.float32):
    # A large common offset: the statistics must not cancel.
    x = rng.standard_normal((n, c)) * rng.uniform(0.5, 3.0, c) + rng.uniform(-40, 40, c)
    w = rng.uniform(0.5, 1.5, c) * rng.choice([-1.0, 1.0], c)
    b = rng.standard_normal(c)
    return (
        mx.array(x.astype(np.float32)).astype(dtype),
        mx.array(w.astype(np.float32)),
        mx.array(b.astype(np.float32)),
    )


def _unfused(x, w, b, relu, eps=1e-5):
    """mlx.nn.BatchNorm (training mode) on float32 features, ReLU, cast back."""
    norm = mnn.BatchNorm(int(x.shape[1]), eps=eps)
    norm.update({"weight": w, "bias": b})
    y = norm(x.astype(mx.float32))
    if relu:
        y = mx.maximum(y, 0)
    return y.astype(x.dtype)


def _as64(a):
    return np.array(a.astype(mx.float32)).astype(np.float64)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_numpy_statistics_and_mlx_batch_norm(rng, dtype, relu):
    x, w, b = _inputs(rng, dtype=dtype)
    y, mean, var = ext.batch_norm_train(x, w, b, eps=1e-5, relu=relu)
    assert (y.dtype, mean.dtype, var.dtype) == (dtype, mx.float32, mx.float32)
    x64 = _as64(x)
    mean64 = x64.mean(axis=0)
    var64 = ((x64 - mean64) ** 2).mean(axis=0)
    # The float32 statistics are the float64 ones rounded once.
    np.testing.assert_allclose(np.array(mean), mean64, rtol=1e-7, atol=0)
    np.testing.assert_allclose(np.array(var), var64, rtol=1e-6, atol=0)
    # y is the float32 result rounded once to the dtype by MLX's own cast.
    y32, _, _ = ext.batch_norm_train(x.astype(mx.float32), w, b, eps=1e-5, relu=relu)
    np.testing.assert_array_equal(np.array(y.view(mx.uint16 if dtype != mx.float32 else mx.uint32)),
                                  np.array(y32.astype(dtype).view(
                                      mx.uint16 if dtype != mx.float32 else mx.uint32)))
    # The float32 result against mlx.nn.BatchNorm on the same float32 values
    # (MLX's single-pass float32 variance of offset data differs by ~1e-6
    # relative; normalized values are O(1)).
    ref = _unfused(x.astype(mx.float32), w, b, relu)
    np.testing.assert_allclose(np.array(y32), np.array(ref), rtol=0, atol=2e-4)
    # ... and against the float64 formula.
    ref64 = (x64 - mean64) / np.sqrt(var64 + 1e-5) * _as64(w) + _as64(b)
    if relu:
        ref64 = np.maximum(ref64, 0)
    np.testing.assert_allclose(_as64(y32), ref64, rtol=0, atol=2e-5)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_mlx_autodiff_of_the_unfused_form(rng, dtype, relu):
    x, w, b = _inputs(rng, n=257, c=9, dtype=dtype)
    w, b = w.astype(dtype), b.astype(dtype)
    g = mx.array(rng.standard_normal((257, 9)).astype(np.float32)).astype(dtype)

    def loss(fn):
        return lambda x, w, b: (fn(x, w, b).astype(mx.float32) * g.astype(mx.float32)).sum()

    native = mx.grad(loss(lambda x, w, b: fused.batch_norm_train(x, w, b, relu=relu)[0]),
                     argnums=(0, 1, 2))(x, w, b)
    ref = mx.grad(loss(lambda x, w, b: _unfused(x, w, b, relu)), argnums=(0, 1, 2))(x, w, b)
    # float32: both are float32 evaluations of the same closed form (the
    # reference through MLX's chain rule). Half precision: the results are
    # rounded to the dtype (relative 2^-11 / 2^-8 of the largest entry).
    rel = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}[dtype]
    for got, want, name in zip(native, ref, ("dx", "dweight", "dbias"), strict=True):
        assert got.dtype == dtype, name
        got64, want64 = _as64(got), _as64(want)
        scale = np.abs(want64).max()
        np.testing.assert_allclose(got64, want64, rtol=0, atol=rel * scale, err_msg=name)


def test_gradients_match_finite_differences(rng):
    x, w, b = _inputs(rng, n=40, c=3)
    # Inputs well away from the ReLU's kink for the step below.
    direction = [mx.array(rng.standard_normal(a.shape).astype(np.float32)) for a in (x, w, b)]
    g = mx.array(rng.standard_normal((40, 3)).astype(np.float32))

    def loss(x, w, b):
        return (ext.batch_norm_train(x, w, b, eps=1e-3, relu=True)[0] * g).sum()

    grads = mx.grad(loss, argnums=(0, 1, 2))(x, w, b)
    analytic = sum((gr * d).sum().item() for gr, d in zip(grads, direction, strict=True))

    # float64 NumPy evaluation of the same function for the differences.
    def loss64(t):
        xs, ws, bs = (_as64(a) + t * _as64(d) for a, d in zip((x, w, b), direction, strict=True))
        mu = xs.mean(axis=0)
        var = ((xs - mu) ** 2).mean(axis=0)
        y = np.maximum((xs - mu) / np.sqrt(var + 1e-3) * ws + bs, 0)
        return (y * _as64(g)).sum()

    h = 1e-6
    numeric = (loss64(h) - loss64(-h)) / (2 * h)
    assert analytic == pytest.approx(numeric, rel=1e-4, abs=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_identical_for_any_thread_count(rng, dtype):
    # Enough rows for many blocks of the fixed row partition.
    x, w, b = _inputs(rng, n=5000, c=24, dtype=dtype)
    g = mx.array(rng.standard_normal((5000, 24)).astype(np.float32)).astype(dtype)

    def run():
        y, mean, var = ext.batch_norm_train(x, w, b, eps=1e-5, relu=True)
        grads = mx.grad(
            lambda x, w, b: (ext.batch_norm_train(x, w, b, eps=1e-5, relu=True)[0] * g)
            .astype(mx.float32).sum(),
            argnums=(0, 1, 2),
        )(x, w, b)
        return [np.array(a.astype(mx.float32)) for a in (y, mean, var, *grads)]

    before = mlx_lattice.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 7):
            mlx_lattice.set_num_threads(threads)
            results.append(run())
    finally:
        mlx_lattice.set_num_threads(before)
    for other in results[1:]:
        for a, c in zip(results[0], other, strict=True):
            np.testing.assert_array_equal(a, c)


def test_compile_matches_eager_bitwise(rng):
    x, w, b = _inputs(rng, n=600, c=16, dtype=mx.float16)

    def step(x, w, b):
        y, mean, var = fused.batch_norm_train(x, w, b, relu=True)
        return (y.astype(mx.float32) ** 2).sum(), mean, var

    eager = mx.value_and_grad(lambda *a: step(*a)[0], argnums=(0, 1, 2))(x, w, b)
    compiled = mx.compile(mx.value_and_grad(lambda *a: step(*a)[0], argnums=(0, 1, 2)))(x, w, b)
    for a, c in zip([eager[0], *eager[1]], [compiled[0], *compiled[1]], strict=True):
        np.testing.assert_array_equal(np.array(a.astype(mx.float32)), np.array(c.astype(mx.float32)))


def _composed(x, w, b, eps=1e-5):
    """Batch norm as plain MLX ops (mlx.nn.BatchNorm refuses a single row)."""
    mean = x.mean(axis=0)
    var = ((x - mean) ** 2).mean(axis=0)
    return (x - mean) * mx.rsqrt(var + eps) * w + b


def test_one_row_and_empty_inputs(rng):
    x, w, b = _inputs(rng, n=1, c=5)
    y, mean, var = ext.batch_norm_train(x, w, b, eps=1e-5, relu=False)
    # One row: the mean is the row, the variance 0, y the bias.
    np.testing.assert_array_equal(np.array(mean), np.array(x[0]))
    np.testing.assert_array_equal(np.array(var), np.zeros(5, np.float32))
    np.testing.assert_array_equal(np.array(y), np.array(b)[None])
    g = mx.array(rng.standard_normal((1, 5)).astype(np.float32))
    grads = mx.grad(
        lambda x, w, b: (ext.batch_norm_train(x, w, b, eps=1e-5, relu=False)[0] * g).sum(),
        argnums=(0, 1, 2),
    )(x, w, b)
    ref = mx.grad(lambda x, w, b: (_composed(x, w, b) * g).sum(), argnums=(0, 1, 2))(x, w, b)
    for got, want in zip(grads, ref, strict=True):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6)
    for fn in (fused.batch_norm_train, lambda *a: ext.batch_norm_train(*a, eps=1e-5, relu=True)):
        with pytest.raises(ValueError, match=r"x must be \(N, C\) with N >= 1"):
            fn(x[:0], w, b)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("rank1", r"x must be \(N, C\)"),
        ("rank3", r"x must be \(N, C\)"),
        ("weight_shape", r"weight must be \(4,\)"),
        ("bias_shape", r"bias must be \(4,\)"),
        ("int_x", r"x must be float32, float16 or bfloat16"),
        ("int_weight", r"weight must be float32, float16 or bfloat16"),
        ("eps", r"eps must be"),
    ],
)
def test_bad_arguments_raise_value_errors(rng, case, message):
    x, w, b = _inputs(rng, n=8, c=4)
    eps = 1e-5
    if case == "rank1":
        x = x[:, 0]
    elif case == "rank3":
        x = x[None]
    elif case == "weight_shape":
        w = mx.ones((5,))
    elif case == "bias_shape":
        b = mx.ones((4, 1))
    elif case == "int_x":
        x = x.astype(mx.int32)
    elif case == "int_weight":
        w = w.astype(mx.int32)
    else:
        eps = -1.0
    with pytest.raises(ValueError, match=message):
        fused.batch_norm_train(x, w, b, eps=eps)
    with pytest.raises(ValueError, match=message):
        ext.batch_norm_train(x, w, b, eps=eps, relu=False)


def test_transforms_without_support_raise_naming_the_op(rng):
    x, w, b = _inputs(rng, n=8, c=4)
    with pytest.raises(ValueError, match=r"BatchNormTrain \(batch_norm_train\): vmap"):
        mx.vmap(lambda x: ext.batch_norm_train(x, w, b, eps=1e-5, relu=False)[0])(
            mx.stack([x, x])
        )
    with pytest.raises(ValueError, match=r"BatchNormTrain \(batch_norm_train\): jvp"):
        mx.jvp(lambda x: ext.batch_norm_train(x, w, b, eps=1e-5, relu=False)[0], [x], [x])
    with pytest.raises(ValueError, match="second derivatives"):
        mx.grad(lambda x: mx.grad(
            lambda x: (ext.batch_norm_train(x, w, b, eps=1e-5, relu=True)[0] ** 2).sum()
        )(x).sum())(x)
    if mx.metal.is_available():  # (without a GPU backend MLX has no GPU stream to pass)
        # The GPU stream runs the Metal kernels (test_metal_harness.py holds
        # them to the CPU); here only that the stream is accepted and agrees.
        got = ext.batch_norm_train(x, w, b, eps=1e-5, relu=False, stream=mx.gpu)[0]
        want = ext.batch_norm_train(x, w, b, eps=1e-5, relu=False)[0]
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_layer_matches_mlx_batch_norm_and_running_statistics(rng, dtype):
    x, w, b = _inputs(rng, n=400, c=8)
    layer = nn.BatchNorm(8, momentum=0.3)
    reference = mnn.BatchNorm(8, momentum=0.3)
    layer.update({"weight": w, "bias": b})
    layer.set_dtype(dtype)
    # The reference normalizes with the same (rounded) parameters in float32.
    reference.update({"weight": layer.weight.astype(mx.float32),
                      "bias": layer.bias.astype(mx.float32)})
    for _ in range(2):
        y = nn.batch_norm_features(layer, x.astype(dtype), relu=True)
        want = mx.maximum(reference(x.astype(dtype).astype(mx.float32)), 0)
        assert y.dtype == dtype
        np.testing.assert_allclose(_as64(y), _as64(want.astype(dtype)), rtol=0,
                                   atol=2 * float(np.abs(np.array(want)).max()) * 2.0**-8)
    for key in ("running_mean", "running_var"):
        assert layer[key].dtype == dtype
        np.testing.assert_allclose(_as64(layer[key]), _as64(reference[key]), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "bias",
    [np.zeros(3, np.float32), mx.zeros((1, 3)), mx.array(0.0), None],
    ids=["numpy", "2-d", "0-d", "None"],
)
def test_bias_relu_names_a_bad_bias(bias) -> None:
    """A bias that is not a (C,) array is named as the bias (not reported as
    x's shape against a bias of -1 channels)."""
    with pytest.raises(mlx_lattice.MlxLatticeError, match=r"^bias must be a \(C,\) array, got "):
        fused.bias_relu(mx.zeros((2, 3)), bias)
    with pytest.raises(mlx_lattice.MlxLatticeError, match=r"^x must be \(N, 3\)"):
        fused.bias_relu(mx.zeros((2, 4)), mx.zeros((3,)))
