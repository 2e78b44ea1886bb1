"""SPVCNN's point branch (Linear, batch norm, ReLU) against float64 NumPy:
the closed-form forward and backward pass of Linear -> BatchNorm (batch
statistics) -> ReLU, the running statistics against their float64 updates,
and eval mode against the running-statistics formula. Inputs come from the
repository's seeded generator (``rng``; printed on failure, replayed with
``TEST_SEED=<seed>``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lattice.models import PointBranch


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
