"""Feature layers, norms, dropout, global pooling and containers on SparseTensor.

References: NumPy/SciPy formulas and ``mlx.nn`` applied to the bare features;
gradients against central finite differences.
"""

import math

import mlx.core as mx
import mlx.nn as mnn
import numpy as np
import pytest
from scipy import special

from mlx_lattice import SparseTensor, SparseTensorError, fused, nn, ops


@pytest.fixture(params=[11, 12])
def seeded(request):
    """A seeded generator; the seed is printed so a failure shows it."""
    print(f"seed={request.param}")
    mx.random.seed(request.param)
    return np.random.default_rng(request.param)


def tensor(rng, ref, n=200, channels=6, batches=2, grid=8):
    coords = ref.random_coords(rng, n, grid, batches=batches)
    feats = mx.array(rng.standard_normal((len(coords), channels)).astype(np.float32) * 2)
    return SparseTensor(coords, feats), coords


def np_gelu(f, approximate):
    if approximate == "none":
        return f * 0.5 * (1 + special.erf(f / math.sqrt(2)))
    return 0.5 * f * (1 + np.tanh(math.sqrt(2 / math.pi) * (f + 0.044715 * f**3)))


ACTIVATIONS = {
    "gelu": (lambda x: ops.gelu(x), nn.GELU(), lambda f: np_gelu(f, "none")),
    "gelu_tanh": (
        lambda x: ops.gelu(x, approximate="tanh"),
        nn.GELU("tanh"),
        lambda f: np_gelu(f, "tanh"),
    ),
    "silu": (ops.silu, nn.SiLU(), lambda f: f * special.expit(f)),
    "leaky_relu": (
        lambda x: ops.leaky_relu(x, 0.2),
        nn.LeakyReLU(0.2),
        lambda f: np.where(f > 0, f, 0.2 * f),
    ),
    "sigmoid": (ops.sigmoid, nn.Sigmoid(), special.expit),
    "tanh": (ops.tanh, nn.Tanh(), np.tanh),
    "softplus": (
        lambda x: ops.softplus(x, 2.0),
        nn.Softplus(2.0),
        lambda f: np.logaddexp(2 * f, 0) / 2,
    ),
    "relu": (ops.relu, nn.ReLU(), lambda f: np.maximum(f, 0)),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations_match_numpy(seeded, ref, name):
    fn, module, reference = ACTIVATIONS[name]
    x, _ = tensor(seeded, ref)
    f = np.array(x.feats).astype(np.float64)
    y = fn(x)
    assert y.coords is x.coords and y.coordinate_key == x.coordinate_key
    np.testing.assert_allclose(np.array(y.feats), reference(f), rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(np.array(module(x).feats), np.array(y.feats))


def test_gelu_approximations_differ_and_bad_mode_raises(seeded, ref):
    x, _ = tensor(seeded, ref)
    exact, approx = ops.gelu(x).feats, ops.gelu(x, approximate="tanh").feats
    diff = float(mx.abs(exact - approx).max())
    assert 1e-5 < diff < 1e-2  # the tanh form is close to, but not, the exact GELU
    with pytest.raises(SparseTensorError, match="approximate must be"):
        ops.gelu(x, approximate="sigmoid")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="approximate must be"):
        nn.GELU("fast")


def test_softplus_does_not_overflow():
    x = SparseTensor(np.array([[0, 0, 0, 0]], np.int32), mx.array([[200.0, -200.0]]))
    np.testing.assert_allclose(np.array(ops.softplus(x).feats), [[200.0, 0.0]], atol=1e-6)


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu", "softplus", "tanh", "sigmoid"])
def test_activation_gradients_match_finite_differences(seeded, ref, name):
    fn = ACTIVATIONS[name][0]
    x, _ = tensor(seeded, ref, n=40, channels=3)
    direction = mx.array(seeded.standard_normal(x.feats.shape).astype(np.float32))

    def loss(f):
        return (fn(x.replace(f)).feats * direction).sum()

    grad = mx.grad(loss)(x.feats)
    v = mx.array(seeded.standard_normal(x.feats.shape).astype(np.float32))
    h = 1e-2
    fd = (loss(x.feats + h * v) - loss(x.feats - h * v)).item() / (2 * h)
    assert (grad * v).sum().item() == pytest.approx(fd, rel=5e-3, abs=5e-3)


def test_dropout_train_and_eval(seeded, ref):
    x, _ = tensor(seeded, ref, n=400, channels=16)
    x = x.replace(mx.abs(x.feats) + 1.0)  # no zero features, so dropped entries are visible
    y = ops.dropout(x, 0.25, key=mx.random.key(5))
    f, g = np.array(x.feats), np.array(y.feats)
    dropped = g == 0
    # 25% of ~6000 entries dropped: binomial std ~34 entries, bound at ~7 std.
    assert abs(dropped.mean() - 0.25) < 0.04
    np.testing.assert_allclose(g[~dropped], f[~dropped] / 0.75, rtol=1e-6)
    # The same key gives the same mask; eval mode and p=0 are the identity.
    np.testing.assert_array_equal(np.array(ops.dropout(x, 0.25, key=mx.random.key(5)).feats), g)
    assert ops.dropout(x, 0.25, training=False) is x
    layer = nn.Dropout(0.5)
    assert np.mean(np.array(layer(x).feats) == 0) > 0.4
    layer.eval()
    np.testing.assert_array_equal(np.array(layer(x).feats), f)
    with pytest.raises(SparseTensorError, match=r"p must be in \[0, 1\)"):
        ops.dropout(x, 1.0)
    with pytest.raises(ValueError, match="p must be"):
        nn.Dropout(-0.1)


def test_norms_match_mlx_nn(seeded, ref):
    x, _ = tensor(seeded, ref, channels=8)
    w = mx.array(seeded.standard_normal(8).astype(np.float32))
    b = mx.array(seeded.standard_normal(8).astype(np.float32))
    reference = mnn.LayerNorm(8, eps=1e-5)
    reference.weight, reference.bias = w, b
    expected = np.array(reference(x.feats))
    np.testing.assert_allclose(
        np.array(ops.layer_norm(x, w, b).feats), expected, rtol=1e-5, atol=1e-5
    )
    layer = nn.LayerNorm(8)
    layer.weight, layer.bias = w, b
    np.testing.assert_allclose(np.array(layer(x).feats), expected, rtol=1e-5, atol=1e-5)
    # And against the formula in float64.
    f = np.array(x.feats).astype(np.float64)
    formula = (f - f.mean(1, keepdims=True)) / np.sqrt(f.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(expected, formula * np.array(w) + np.array(b), rtol=1e-4, atol=1e-4)

    rms = mnn.RMSNorm(8, eps=1e-5)
    rms.weight = w
    expected = np.array(rms(x.feats))
    np.testing.assert_allclose(np.array(ops.rms_norm(x, w).feats), expected, rtol=1e-5, atol=1e-5)
    layer = nn.RMSNorm(8)
    layer.weight = w
    np.testing.assert_allclose(np.array(layer(x).feats), expected, rtol=1e-5, atol=1e-5)
    formula = f / np.sqrt((f * f).mean(1, keepdims=True) + 1e-5) * np.array(w)
    np.testing.assert_allclose(expected, formula, rtol=1e-4, atol=1e-4)
    with pytest.raises(SparseTensorError, match=r"weight must have shape \(8,\)"):
        ops.layer_norm(x, mx.ones((7,)))


def test_norm_gradients_match_finite_differences(seeded, ref):
    x, _ = tensor(seeded, ref, n=30, channels=5)
    w = mx.array(seeded.standard_normal(5).astype(np.float32))
    direction = mx.array(seeded.standard_normal(x.feats.shape).astype(np.float32))
    for fn in (lambda f: ops.layer_norm(x.replace(f), w), lambda f: ops.rms_norm(x.replace(f), w)):

        def loss(f, fn=fn):
            return (fn(f).feats * direction).sum()

        grad = mx.grad(loss)(x.feats)
        v = mx.array(seeded.standard_normal(x.feats.shape).astype(np.float32))
        h = 1e-2
        fd = (loss(x.feats + h * v) - loss(x.feats - h * v)).item() / (2 * h)
        assert (grad * v).sum().item() == pytest.approx(fd, rel=1e-2, abs=1e-2)


def test_global_pools_with_batch_size(seeded, ref):
    coords = ref.random_coords(seeded, 150, 8, batches=4)
    coords = coords[coords[:, 0] != 1]  # batch entry 1 is empty
    feats = mx.array(seeded.standard_normal((len(coords), 3)).astype(np.float32) - 5)
    x = SparseTensor(coords, feats)
    f = np.array(feats)
    sums, avgs, maxs = (
        np.array(ops.global_sum_pool(x, batch_size=6)),
        np.array(ops.global_avg_pool(x, batch_size=6)),
        np.array(ops.global_max_pool(x, batch_size=6)),
    )
    assert sums.shape == avgs.shape == maxs.shape == (6, 3)
    for b in range(6):
        rows = coords[:, 0] == b
        if rows.any():
            np.testing.assert_allclose(sums[b], f[rows].sum(0), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(avgs[b], f[rows].mean(0), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(maxs[b], f[rows].max(0))
        else:  # empty entries (1, 4, 5): sums and means 0, maxima the documented fill
            np.testing.assert_array_equal(sums[b], 0)
            np.testing.assert_array_equal(avgs[b], 0)
            np.testing.assert_array_equal(maxs[b], 0)
    np.testing.assert_array_equal(np.array(ops.global_max_pool(x, 6, empty=-1.0))[4], -1.0)
    with pytest.raises(SparseTensorError, match="batch entry 1 has no rows"):
        ops.global_max_pool(x, empty=None)
    with pytest.raises(SparseTensorError, match="batch_size 2 is smaller"):
        ops.global_sum_pool(x, batch_size=2)
    np.testing.assert_array_equal(np.array(nn.GlobalSumPool(6)(x)), sums)
    np.testing.assert_array_equal(np.array(nn.GlobalAvgPool(6)(x)), avgs)
    np.testing.assert_array_equal(np.array(nn.GlobalMaxPool(6)(x)), maxs)


def test_sequential_of_sparse_layers_trains_and_round_trips(seeded, ref, tmp_path):
    x, coords = tensor(seeded, ref, n=300, channels=2)
    model = mnn.Sequential(
        nn.SubMConv3d(2, 8),
        nn.LayerNorm(8),
        nn.GELU(),
        nn.Features(mnn.Linear(8, 8)),
        nn.Dropout(0.1),
        nn.SiLU(),
        nn.Linear(8, 1),
    )
    target = mx.array((coords[:, 1:2] >= 4).astype(np.float32))

    def loss_fn(m):
        return mnn.losses.binary_cross_entropy(m(x).feats, target, with_logits=True)

    import mlx.optimizers as optim

    opt = optim.Adam(learning_rate=1e-2)
    step = mnn.value_and_grad(model, loss_fn)
    losses = []
    for _ in range(30):
        loss, grads = step(model)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    model.eval()
    out = np.array(model(x).feats)
    path = tmp_path / "seq.safetensors"
    model.save_weights(str(path))
    clone = mnn.Sequential(
        nn.SubMConv3d(2, 8),
        nn.LayerNorm(8),
        nn.GELU(),
        nn.Features(mnn.Linear(8, 8)),
        nn.Dropout(0.1),
        nn.SiLU(),
        nn.Linear(8, 1),
    )
    clone.load_weights(str(path))
    clone.eval()
    np.testing.assert_array_equal(np.array(clone(x).feats), out)


def test_linear_function_matches_numpy(seeded, ref):
    x, _ = tensor(seeded, ref, channels=6)
    w = mx.array(seeded.standard_normal((4, 6)).astype(np.float32))
    b = mx.array(seeded.standard_normal(4).astype(np.float32))
    expected = np.array(x.feats).astype(np.float64) @ np.array(w).T.astype(np.float64) + np.array(b)
    np.testing.assert_allclose(np.array(ops.linear(x, w, b).feats), expected, rtol=1e-5, atol=1e-5)
    layer = nn.Linear(6, 4)
    layer.weight, layer.bias = w, b
    np.testing.assert_allclose(np.array(layer(x).feats), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(SparseTensorError, match=r"weight must be \(Cout, 6\)"):
        ops.linear(x, mx.ones((4, 5)))


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_half_precision_features_keep_their_dtype(seeded, ref, name):
    fn = ACTIVATIONS[name][0]
    x, _ = tensor(seeded, ref)
    for dtype in (mx.float16, mx.bfloat16):
        half = x.astype(dtype)
        y = fn(half)
        assert y.dtype == dtype
        # Computed in float32 from the rounded inputs, then rounded once.
        expected = np.array(fn(half.astype(mx.float32)).feats.astype(dtype).astype(mx.float32))
        np.testing.assert_array_equal(np.array(y.feats.astype(mx.float32)), expected)


def test_half_precision_norms(seeded, ref):
    x, _ = tensor(seeded, ref, channels=8)
    half = x.astype(mx.float16)
    w = mx.array(seeded.standard_normal(8).astype(np.float32))
    for fn in (lambda t: ops.layer_norm(t, w, w), lambda t: ops.rms_norm(t, w)):
        y = fn(half)
        assert y.dtype == mx.float16
        expected = np.array(fn(half.astype(mx.float32)).feats)
        np.testing.assert_allclose(
            np.array(y.feats.astype(mx.float32)), expected, rtol=1e-3, atol=1e-2
        )
    bn = nn.BatchNorm(8)
    bn.apply(lambda p: p.astype(mx.float16))
    ref_bn = nn.BatchNorm(8)
    y = bn(half)
    assert y.dtype == mx.float16 and bn.running_mean.dtype == mx.float16
    expected = np.array(ref_bn(half.astype(mx.float32)).feats)
    np.testing.assert_allclose(np.array(y.feats.astype(mx.float32)), expected, rtol=1e-3, atol=1e-2)
    np.testing.assert_allclose(
        np.array(bn.running_mean.astype(mx.float32)), np.array(ref_bn.running_mean), atol=1e-3
    )


def test_linear_gradients_match_finite_differences(seeded, ref):
    x, _ = tensor(seeded, ref, n=50, channels=5)
    w = mx.array(seeded.standard_normal((3, 5)).astype(np.float32))
    b = mx.array(seeded.standard_normal(3).astype(np.float32))
    direction = mx.array(seeded.standard_normal((x.num_points, 3)).astype(np.float32))

    def loss(f, weight, bias):
        return (ops.linear(x.replace(f), weight, bias).feats * direction).sum()

    grads = mx.grad(loss, argnums=(0, 1, 2))(x.feats, w, b)
    vs = [mx.array(seeded.standard_normal(a.shape).astype(np.float32)) for a in (x.feats, w, b)]
    h = 1e-2
    plus = loss(*[a + h * v for a, v in zip((x.feats, w, b), vs, strict=True)]).item()
    minus = loss(*[a - h * v for a, v in zip((x.feats, w, b), vs, strict=True)]).item()
    analytic = sum((g * v).sum().item() for g, v in zip(grads, vs, strict=True))
    assert analytic == pytest.approx((plus - minus) / (2 * h), rel=1e-3, abs=1e-3)


# -- fused training ops (mlx_lattice.fused) against the unfused MLX reference -----------------------


def _unfused_bn(x, w, b, relu, eps=1e-5):
    """mlx.nn.BatchNorm (training mode) and mx.maximum, differentiated by MLX."""
    ref = mnn.BatchNorm(int(x.shape[1]), eps=eps)
    ref.weight, ref.bias = w, b
    y = ref(x)
    return (mx.maximum(y, 0) if relu else y), ref


@pytest.mark.parametrize("relu", [False, True])
def test_fused_batch_norm_matches_unfused_mlx(seeded, relu):
    n, c = 300, 7
    f = mx.array(seeded.standard_normal((n, c)).astype(np.float32) * 3 + 1)
    w = mx.array(seeded.standard_normal(c).astype(np.float32))
    b = mx.array(seeded.standard_normal(c).astype(np.float32))
    y, mean, var = fused.batch_norm_train(f, w, b, relu=relu)
    expected, _ = _unfused_bn(f, w, b, relu)
    np.testing.assert_allclose(np.array(y), np.array(expected), rtol=1e-5, atol=1e-5)
    f64 = np.array(f).astype(np.float64)
    np.testing.assert_allclose(np.array(mean), f64.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(var), f64.var(0), rtol=1e-5, atol=1e-5)

    direction = mx.array(seeded.standard_normal((n, c)).astype(np.float32))

    def ours(x, w, b):
        return (fused.batch_norm_train(x, w, b, relu=relu)[0] * direction).sum()

    def theirs(x, w, b):
        return (_unfused_bn(x, w, b, relu)[0] * direction).sum()

    got = mx.grad(ours, argnums=(0, 1, 2))(f, w, b)
    want = mx.grad(theirs, argnums=(0, 1, 2))(f, w, b)
    for name, g, r in zip(("x", "weight", "bias"), got, want, strict=True):
        np.testing.assert_allclose(
            np.array(g), np.array(r), rtol=1e-4, atol=1e-4, err_msg=f"d{name}"
        )


def test_fused_batch_norm_layer_running_statistics_match_mlx(seeded, ref):
    x, _ = tensor(seeded, ref, channels=8)
    w = mx.array(seeded.standard_normal(8).astype(np.float32))
    b = mx.array(seeded.standard_normal(8).astype(np.float32))
    layer = nn.BatchNorm(8, momentum=0.3)
    layer.weight, layer.bias = w, b
    reference = mnn.BatchNorm(8, momentum=0.3)
    reference.weight, reference.bias = w, b
    for _ in range(2):
        y = layer.relu(x)
        expected = mx.maximum(reference(x.feats), 0)
        np.testing.assert_allclose(np.array(y.feats), np.array(expected), rtol=1e-5, atol=1e-5)
    for key in ("running_mean", "running_var"):
        np.testing.assert_allclose(
            np.array(layer[key]), np.array(reference[key]), rtol=1e-5, atol=1e-6, err_msg=key
        )
    layer.eval()
    reference.eval()
    np.testing.assert_allclose(
        np.array(layer.relu(x).feats),
        np.array(mx.maximum(reference(x.feats), 0)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_fused_batch_norm_gradients_match_finite_differences(seeded):
    n, c = 40, 5
    f = mx.array(seeded.standard_normal((n, c)).astype(np.float32) * 2)
    w = mx.array(seeded.uniform(0.5, 2.0, c).astype(np.float32))
    b = mx.array(seeded.standard_normal(c).astype(np.float32))
    direction = mx.array(seeded.standard_normal((n, c)).astype(np.float32))

    def loss(x, w, b):
        return (fused.batch_norm_train(x, w, b, relu=True)[0] * direction).sum()

    args = (f, w, b)
    grads = mx.grad(loss, argnums=(0, 1, 2))(*args)
    vs = [mx.array(seeded.standard_normal(a.shape).astype(np.float32)) for a in args]
    h = 1e-3
    plus = loss(*[a + h * v for a, v in zip(args, vs, strict=True)]).item()
    minus = loss(*[a - h * v for a, v in zip(args, vs, strict=True)]).item()
    analytic = sum((g * v).sum().item() for g, v in zip(grads, vs, strict=True))
    # float32 central differences of a sum over 200 terms: ~1e-2 absolute noise.
    assert analytic == pytest.approx((plus - minus) / (2 * h), rel=1e-2, abs=2e-2)


def test_fused_batch_norm_half_precision_and_errors(seeded):
    f = mx.array(seeded.standard_normal((64, 4)).astype(np.float32))
    w, b = mx.ones((4,)), mx.zeros((4,))
    half = f.astype(mx.float16)
    y, mean, _ = fused.batch_norm_train(half, w, b, relu=True)
    assert y.dtype == mx.float16 and mean.dtype == mx.float32
    # Computed in float32 from the rounded inputs, rounded once.
    y32, _, _ = fused.batch_norm_train(half.astype(mx.float32), w, b, relu=True)
    np.testing.assert_array_equal(np.array(y), np.array(y32.astype(mx.float16)))
    dx = mx.grad(lambda x: fused.batch_norm_train(x, w, b)[0].astype(mx.float32).sum())(half)
    assert dx.dtype == mx.float16
    with pytest.raises(ValueError, match=r"x must be \(N, C\) with N >= 1"):
        fused.batch_norm_train(f[:0], w, b)
    with pytest.raises(ValueError, match=r"weight must be \(4,\)"):
        fused.batch_norm_train(f, mx.ones((3,)), b)


def test_dense_linear_matches_numpy_and_matmul_gradients(seeded):
    n = nn.DENSE_NATIVE_ROWS + 37
    x = mx.array(seeded.standard_normal((n, 24)).astype(np.float32))
    w = mx.array(seeded.standard_normal((16, 24)).astype(np.float32))
    b = mx.array(seeded.standard_normal(16).astype(np.float32))
    expected = np.array(x).astype(np.float64) @ np.array(w).T.astype(np.float64) + np.array(b)
    np.testing.assert_allclose(np.array(fused.dense_linear(x, w, b)), expected, rtol=1e-4, atol=1e-4)
    rel = fused.identity_relation(n)
    np.testing.assert_array_equal(np.array(rel.edges.in_rows), np.arange(n))
    np.testing.assert_array_equal(np.array(rel.edges.out_rows), np.arange(n))
    layer = nn.Linear(24, 16)
    layer.weight, layer.bias = w, b
    np.testing.assert_allclose(np.array(layer(x)), expected, rtol=1e-4, atol=1e-4)

    direction = mx.array(seeded.standard_normal((n, 16)).astype(np.float32))
    got = mx.grad(lambda *a: (fused.dense_linear(*a) * direction).sum(), argnums=(0, 1, 2))(x, w, b)
    want = mx.grad(lambda x, w, b: ((x @ w.T + b) * direction).sum(), argnums=(0, 1, 2))(x, w, b)
    for name, g, r in zip(("x", "weight", "bias"), got, want, strict=True):
        np.testing.assert_allclose(
            np.array(g), np.array(r), rtol=1e-4, atol=1e-3, err_msg=f"d{name}"
        )
    assert fused.dense_linear(x[:0], w, b).shape == (0, 16)
    with pytest.raises(ValueError, match=r"weight \(Cout, Cin\)"):
        fused.dense_linear(x, w.T)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", [(3, 1), (0, 1), (2, 3)])
def test_batch_norm_rejects_another_channel_count(training, shape):
    """Regression (fuzz): a BatchNorm(2) broadcast its statistics over
    1-channel features ((N, 1) -> (N, 2)) instead of raising."""
    from mlx_lattice import MlxLatticeError

    norm = nn.BatchNorm(2)
    norm.train(training)
    n = shape[0]
    coords = np.stack([np.zeros(n), np.arange(n), np.zeros(n), np.zeros(n)], 1).astype(np.int32)
    x = SparseTensor(coords, mx.ones(shape))
    with pytest.raises(MlxLatticeError, match=r"BatchNorm weight has shape \(2,\), the features"):
        norm(x)
    with pytest.raises(MlxLatticeError, match="BatchNorm weight"):
        norm.relu(x)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("rows", [0, 1])
def test_batch_norm_training_on_fewer_than_two_rows(affine, rows):
    """Regression (fuzz): training on one row raised mlx.nn's plain
    ValueError instead of the package's error."""
    from mlx_lattice import MlxLatticeError

    norm = nn.BatchNorm(2, affine=affine)
    coords = np.zeros((rows, 4), np.int32)
    x = SparseTensor(coords, mx.ones((rows, 2)))
    with pytest.raises(MlxLatticeError, match=f"at least two rows .* got {rows}"):
        norm(x)
    norm.eval()  # running statistics: any row count
    assert norm(x).feats.shape == (rows, 2)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("rows", "channels"), [(1, 0), (3, 0), (0, 0), (0, 2)])
def test_norms_and_fake_quantization_of_empty_features_never_reduce(monkeypatch, dtype, rows,
                                                                   channels):
    """Regression (fuzz): LayerNorm on one row of zero channels hung in about
    one run in six. MLX 0.32's CPU reduction over an empty axis into a
    non-empty result (what mx.fast.layer_norm/rms_norm and an empty row max
    run) can loop forever; empty features now return the empty array
    itself, without calling any MLX reduction (patched here to fail)."""

    def no_reduction(*args, **kwargs):
        raise AssertionError("an MLX reduction ran on empty features")

    monkeypatch.setattr(mx.fast, "layer_norm", no_reduction)
    monkeypatch.setattr(mx.fast, "rms_norm", no_reduction)
    monkeypatch.setattr(mx, "max", no_reduction)
    coords = np.stack([np.zeros(rows), np.arange(rows), np.zeros(rows), np.zeros(rows)], 1)
    x = SparseTensor(coords.astype(np.int32), mx.zeros((rows, channels), dtype))
    for out in (nn.LayerNorm(channels, affine=False)(x), ops.layer_norm(x), ops.rms_norm(x),
                nn.RMSNorm(channels)(x)):
        assert out.feats.shape == (rows, channels) and out.feats.dtype == dtype
    quantized = nn.fake_quantize_rows(x.feats, 8)
    assert quantized.shape == (rows, channels) and quantized.dtype == dtype
