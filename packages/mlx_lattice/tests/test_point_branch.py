"""SPVCNN's point branch (Linear, batch norm, ReLU) against float64 NumPy:
the closed-form forward and backward pass of Linear -> BatchNorm (batch
statistics) -> ReLU, the running statistics against their float64 updates,
and eval mode against the running-statistics formula; the point <-> voxel
steps of a half-precision SPVCNN (interpolation to float32 points, averaging
back to half-precision voxels) against float64 trilinear and mean
references, and its point branch running in float32. Inputs come from the
repository's seeded generator (``rng``; printed on failure, replayed with
``TEST_SEED=<seed>``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as mlx_nn
import numpy as np
import pytest

from mlx_lattice import nn, ops
from mlx_lattice.models import SPVCNN, PointBranch, point_cloud_input
from mlx_lattice.models import spvcnn as spvcnn_module


def _reference(z, w, b, gamma, beta, eps, g):
    """Outputs, parameter and input gradients of sum(relu(bn(z W^T + b)) * g), float64."""
    y = z @ w.T + b
    mean = y.mean(0)
    var = y.var(0)
    inv = 1.0 / np.sqrt(var + eps)
    xhat = (y - mean) * inv
    o = gamma * xhat + beta
    out = np.maximum(o, 0.0)
    do = g * (o > 0)
    dxhat = do * gamma
    dy = inv * (dxhat - dxhat.mean(0) - xhat * (dxhat * xhat).mean(0))
    grads = {
        "z": dy @ w,
        "w": dy.T @ z,
        "b": dy.sum(0),
        "gamma": (do * xhat).sum(0),
        "beta": do.sum(0),
    }
    return out, mean, var, grads


def _branch(rng, cin, cout):
    mx.random.seed(int(rng.integers(1 << 31)))
    branch = PointBranch(cin, cout)
    branch.norm.weight = mx.array(rng.uniform(0.5, 1.5, cout).astype(np.float32))
    branch.norm.bias = mx.array(rng.normal(0.0, 0.3, cout).astype(np.float32))
    branch.linear.bias = mx.array(rng.normal(0.0, 0.5, cout).astype(np.float32))
    return branch


# 5000 rows: the native GEMM (>= nn.DENSE_NATIVE_ROWS); 300: mlx.nn.Linear.
@pytest.mark.parametrize("rows", [300, 5000])
@pytest.mark.parametrize(("cin", "cout"), [(8, 32), (32, 128), (32, 8)])
def test_point_branch_against_float64(rng, seed, rows, cin, cout):
    branch = _branch(rng, cin, cout)
    branch.train()
    z = rng.normal(0.0, 1.0, (rows, cin)) * rng.uniform(0.2, 3.0, cin) + rng.normal(0, 2, cin)
    z = z.astype(np.float32)
    g = rng.normal(0.0, 1.0, (rows, cout)).astype(np.float32)
    params = {
        "w": branch.linear.weight,
        "b": branch.linear.bias,
        "gamma": branch.norm.weight,
        "beta": branch.norm.bias,
    }
    f64 = {k: np.array(v).astype(np.float64) for k, v in params.items()}
    rm0, rv0 = np.array(branch.norm.running_mean), np.array(branch.norm.running_var)

    def loss(zz, p):
        branch.linear.weight, branch.linear.bias = p["w"], p["b"]
        branch.norm.weight, branch.norm.bias = p["gamma"], p["beta"]
        out = branch(zz)
        return (out * mx.array(g)).sum(), out

    (_, out), (dz, dp) = mx.value_and_grad(loss, argnums=(0, 1))(mx.array(z), params)
    mx.eval(out, dz, dp)
    ref, mean, var, grads = _reference(
        z.astype(np.float64),
        f64["w"],
        f64["b"],
        f64["gamma"],
        f64["beta"],
        branch.norm.eps,
        g.astype(np.float64),
    )
    msg = f"seed {seed}, rows {rows}, {cin} -> {cout}"
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-4, atol=1e-4, err_msg=msg)
    np.testing.assert_allclose(np.array(dz), grads["z"], rtol=1e-3, atol=1e-3, err_msg=msg)
    for k in ("w", "gamma", "beta"):
        scale = np.abs(grads[k]).max()
        np.testing.assert_allclose(
            np.array(dp[k]), grads[k], rtol=1e-3, atol=1e-4 * scale, err_msg=f"{k}: {msg}"
        )
    # The linear bias cancels in the batch norm: its float64 gradient is ~0.
    assert np.abs(grads["b"]).max() < 1e-6 * np.abs(grads["beta"]).max(), msg
    np.testing.assert_allclose(np.array(dp["b"]), 0.0, atol=1e-3 * np.abs(grads["beta"]).max())
    mu = branch.norm.momentum
    np.testing.assert_allclose(
        np.array(branch.norm.running_mean),
        (1 - mu) * rm0 + mu * mean,
        rtol=1e-5,
        atol=1e-5,
        err_msg=msg,
    )
    np.testing.assert_allclose(
        np.array(branch.norm.running_var),
        (1 - mu) * rv0 + mu * var * rows / (rows - 1),
        rtol=1e-4,
        atol=1e-5,
        err_msg=msg,
    )


@pytest.mark.parametrize("rows", [300, 5000])
def test_training_skips_the_cancelled_bias_like_mlx_nn(rng, seed, rows):
    """In training the branch leaves out the linear bias (the norm cancels
    it): outputs, running statistics and input gradient as mlx.nn's Linear ->
    BatchNorm -> ReLU with the bias, the bias gradient exactly zero."""
    branch = _branch(rng, 32, 128)
    ref_linear, ref_norm = mlx_nn.Linear(32, 128), mlx_nn.BatchNorm(128)
    ref_linear.update(branch.linear.parameters())
    ref_norm.update(branch.norm.parameters())
    z = mx.array((rng.normal(0.0, 1.0, (rows, 32)) * 1.5 + 0.5).astype(np.float32))
    g = mx.array(rng.normal(0.0, 1.0, (rows, 128)).astype(np.float32))

    def ours(zz, p):
        branch.update(p)
        return (branch(zz) * g).sum()

    def reference(zz):
        return (mx.maximum(ref_norm(ref_linear(zz)), 0) * g).sum()

    (v, (dz, dp)) = mx.value_and_grad(ours, argnums=(0, 1))(z, branch.trainable_parameters())
    v_ref, dz_ref = mx.value_and_grad(reference)(z)
    mx.eval(v, dz, dp, v_ref, dz_ref, branch.norm.running_mean, ref_norm.running_mean)
    msg = f"seed {seed}, rows {rows}"
    assert abs(v.item() - v_ref.item()) <= 1e-4 * max(1.0, abs(v_ref.item())), msg
    np.testing.assert_allclose(np.array(dz), np.array(dz_ref), rtol=1e-3, atol=1e-4, err_msg=msg)
    assert not np.any(np.array(dp["linear"]["bias"])), msg
    for k in ("running_mean", "running_var"):
        np.testing.assert_allclose(
            np.array(branch.norm[k]), np.array(ref_norm[k]), rtol=1e-5, atol=1e-6,
            err_msg=f"{k}: {msg}",
        )


def test_quantized_linear_in_training_keeps_the_plain_path(rng, seed):
    """A branch whose linear layer was quantized (packed codes, no float
    weight to multiply) still trains: it equals mlx.nn's BatchNorm + ReLU of
    the quantized layer's own output, running statistics included."""
    branch = _branch(rng, 64, 32)
    branch.linear = nn.to_quantized(branch.linear, bits=8, group_size=32)
    ref_norm = mlx_nn.BatchNorm(32)
    ref_norm.update(branch.norm.parameters())
    z = mx.array(rng.normal(0.0, 1.0, (5000, 64)).astype(np.float32))
    assert branch.norm.training, seed
    got = branch(z)
    want = mx.maximum(ref_norm(branch.linear(z)), 0)
    mx.eval(got, want, branch.norm.running_mean, ref_norm.running_mean)
    msg = f"seed {seed}"
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5, err_msg=msg)
    for k in ("running_mean", "running_var"):
        np.testing.assert_allclose(
            np.array(branch.norm[k]), np.array(ref_norm[k]), rtol=1e-5, atol=1e-6,
            err_msg=f"{k}: {msg}",
        )


def test_eval_mode_uses_running_statistics(rng, seed):
    branch = _branch(rng, 8, 32)
    z = mx.array((rng.normal(0.0, 1.0, (6000, 8)) * 2 + 1).astype(np.float32))
    mx.eval(branch(z))  # one training pass moves the running statistics
    branch.eval()
    expected = np.maximum(
        (np.array(branch.linear(z)) - np.array(branch.norm.running_mean))
        / np.sqrt(np.array(branch.norm.running_var) + branch.norm.eps)
        * np.array(branch.norm.weight)
        + np.array(branch.norm.bias),
        0.0,
    )
    np.testing.assert_allclose(
        np.array(branch(z)), expected, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}"
    )


def _half_cloud(rng, dtype, n=3000, channels=6):
    pts = rng.uniform(0.0, 2.0, (n, 3)).astype(np.float32)
    feats = rng.normal(0.0, 1.0, (n, channels)).astype(np.float32)
    return point_cloud_input(pts, mx.array(feats).astype(dtype), 0.25), pts


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_voxels_interpolate_to_float32_points(rng, seed, dtype):
    inp, pts = _half_cloud(rng, dtype)
    x = inp.tensor
    # A stride-2 level (rows in the convolution's order, not the points' voxels').
    coarse = ops.conv3d(x, mx.array(rng.normal(0, 0.3, (6, 2, 2, 2, 6)).astype(np.float32)), stride=2)
    for level in (x, coarse):
        msg = f"seed {seed}, {dtype}, stride {level.tensor_stride}"
        _, _, pvm = inp.level(level)
        rows, weights = np.array(pvm.rows), np.array(pvm.weights).astype(np.float64)
        vf = np.array(level.feats.astype(mx.float32)).astype(np.float64)
        # The map itself is held by the geometry tests; here its float64 use.
        corners = np.where(rows[..., None] >= 0, vf[rows], 0.0)
        expected = np.einsum("pc,pck->pk", weights, corners)
        z = inp.to_points(level, mx.float32)
        assert z.dtype == mx.float32, msg
        np.testing.assert_allclose(np.array(z), expected, rtol=1e-5, atol=1e-5, err_msg=msg)
        # Without a dtype: the voxels' own, the float32 result rounded once.
        default = inp.to_points(level)
        assert default.dtype == dtype, msg
        rounded = np.array(z.astype(dtype).astype(mx.float32))
        assert np.array_equal(np.array(default.astype(mx.float32)), rounded), msg
        # Float32 point features averaged back: x's dtype, x's rows.
        back = inp.to_voxels(level, z)
        assert back.dtype == dtype and back.coords is level.coords, msg
        s = level.tensor_stride[0]
        cells = np.floor(pts / (0.25 * s)).astype(np.int64)
        vox = {tuple(c): i for i, c in enumerate(np.array(level.coords)[:, 1:] // s)}
        owner = np.array([vox[tuple(c)] for c in cells])
        zz = np.array(z).astype(np.float64)
        mean = np.zeros((len(vox), zz.shape[1]))
        np.add.at(mean, owner, zz)
        mean /= np.bincount(owner, minlength=len(vox))[:, None]
        # One rounding to the half type: within one of its ulps (2^-10 / 2^-7 relative).
        tol = 2.0**-10 if dtype == mx.float16 else 2.0**-7
        got = np.array(back.feats.astype(mx.float32)).astype(np.float64)
        np.testing.assert_allclose(got, mean, rtol=tol, atol=1e-6, err_msg=msg)


def _cross_entropy_of(inp, labels):
    """The model's mean softmax cross-entropy on ``inp`` against ``labels``
    (written out here, independent of the package's own loss)."""

    def loss(m):
        scores = m(inp)
        picked = mx.take_along_axis(scores, labels[:, None], 1)[:, 0]
        return mx.mean(mx.logsumexp(scores, axis=1) - picked)

    return loss


def test_half_spvcnn_runs_its_point_branch_in_float32(rng, seed, monkeypatch):
    inp, _ = _half_cloud(rng, mx.float16, n=5000, channels=2)
    seen = []
    call = PointBranch.__call__

    def spy(self, z):
        seen.append(z.dtype)
        out = call(self, z)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(spvcnn_module.PointBranch, "__call__", spy)
    voxel_dtypes = []
    to_points = spvcnn_module.PointCloudInput.to_points

    def spy_points(self, x, *args, **kwargs):
        voxel_dtypes.append(x.feats.dtype)
        return to_points(self, x, *args, **kwargs)

    monkeypatch.setattr(spvcnn_module.PointCloudInput, "to_points", spy_points)
    model = SPVCNN(2, 5, widths=(8, 16, 16))
    model.train()
    labels = mx.array(rng.integers(0, 5, inp.num_points).astype(np.int32))

    loss = _cross_entropy_of(inp, labels)

    value, grads = mlx_nn.value_and_grad(model, loss)(model)
    mx.eval(value, grads)
    msg = f"seed {seed}"
    assert seen == [mx.float32] * 4, msg
    assert np.isfinite(value.item()), msg
    for path in ("mlp1", "mlp2"):
        g = grads["point"][path]["linear"]["weight"]
        assert g.dtype == mx.float32 and float(mx.abs(g).max()) > 0, f"{path}: {msg}"
    # The voxel network stays in half precision: every voxel tensor handed to
    # the point branch (after the stem, the encoder and the decoder) is float16.
    assert voxel_dtypes == [mx.float16] * 3, msg


def test_half_spvcnn_skip_gradients_match_plain_reuse(rng, seed, monkeypatch):
    # The skips fork their tensor (MinkUNet's _skip: the two gradients summed
    # by the native fused.add, the correctly rounded sum). Reference: the same
    # model and input with the skips reusing the tensor, so autodiff sums the
    # two float16 gradients with MLX's own add: the same bits.
    inp, _ = _half_cloud(rng, mx.float16, n=4000, channels=2)
    mx.random.seed(int(rng.integers(1 << 31)))
    model = SPVCNN(2, 5, widths=(8, 16, 16))
    model.train()
    labels = mx.array(rng.integers(0, 5, inp.num_points).astype(np.int32))

    loss = _cross_entropy_of(inp, labels)

    forks = []
    skip = spvcnn_module._skip

    def counting_skip(x):
        down, across = skip(x)
        forks.append(down.feats is not x.feats)
        return down, across

    def run():
        value, grads = mlx_nn.value_and_grad(model, loss)(model)
        mx.eval(value, grads)
        return value, dict(mlx_nn.utils.tree_flatten(grads))

    state = [(k, mx.array(v)) for k, v in mlx_nn.utils.tree_flatten(model.parameters())]
    monkeypatch.setattr(spvcnn_module, "_skip", counting_skip)
    forked_value, forked = run()
    model.load_weights(state)  # the running statistics moved: restore them
    monkeypatch.setattr(spvcnn_module, "_skip", lambda x: (x, x))
    plain_value, plain = run()
    msg = f"seed {seed}"
    assert forks == [True] * 2, msg  # the stem and first encoder outputs forked
    assert forked_value.item() == plain_value.item(), msg
    assert forked.keys() == plain.keys(), msg
    for key, g in forked.items():
        assert g.dtype == plain[key].dtype, f"{key}: {msg}"
        assert np.array_equal(np.array(g), np.array(plain[key])), f"{key}: {msg}"
    # The skips carried gradients (not a vacuous comparison).
    stem = [g for k, g in forked.items() if k.startswith("stem.") and k.endswith("weight")]
    assert stem and all(float(mx.abs(g).max()) > 0 for g in stem), msg
