"""Smoke runs of ``tpu_matmul`` and ``tpu_train`` on the CPU (``--small``),
as child processes (each program defines its own absl flags), checking that
each printed row is consistent, not only that it printed: rates and ratios
recomputed from the times, weight bytes from the formats, each error within
the rounding model's bound and near the model (so the mode quantized as it
says), our rows bit for bit Qwix's (one backend, the same computation), and
QT training that learns and tracks bf16.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys

import pytest

import taktiny_ops as tk

K, N = 256, 512  # one small shape (two int4 tiles along K)
MS = (16, 256)  # one loop-timed M, one timed call by call


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    script = importlib.util.find_spec(module).origin
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("host class: backend cpu"), proc.stdout[:300]
    return proc


def _expected_bytes(mode: str, impl: str) -> int:
    """Weights as held: values at their bit width plus bf16 scales (the kernel is bf16)."""
    if mode == "bf16" or impl == "stateless float w":
        return 2 * K * N
    if mode == "int4":
        return K * N // 2 + 2 * (K // 128) * N
    return K * N + 2 * N  # int8 / fp8: one byte each, one scale per output channel


@pytest.fixture
def matmul(seed, tmp_path):
    out = tmp_path / "matmul.json"
    proc = _run("benchmarks.tpu_matmul", "--small", f"--shapes={K}x{N}",
                f"--ms={','.join(map(str, MS))}", "--repeats=1", "--target-ms=1",
                f"--seed={seed}", f"--json={out}")
    return proc.stdout, json.loads(out.read_text())


def test_tpu_matmul_rows(matmul):
    stdout, data = matmul
    rows = data["rows"]
    assert data["small"] and data["limits"] is None  # no v5e footer on a CPU
    available = {
        "ours pallas": "kernels" in inspect.signature(tk.quantize).parameters,
        "stateless w once": hasattr(tk, "quantize_weight"),
    }
    # Every mode, every implementation, every M: one row each.
    seen = {(r["mode"], r["impl"], r["m"]) for r in rows}
    for mode, impls in (("bf16", ["jax"]),
                        ("int8", ["ours", "ours pallas", "stateless float w",
                                  "stateless w once", "qwix"]),
                        ("int4", ["ours", "ours pallas", "qwix"]),
                        ("fp8", ["ours", "ours pallas", "qwix"]),
                        ("w8a8", ["ours", "ours pallas", "stateless float w",
                                  "stateless w once", "qwix"])):
        for impl in impls:
            assert {(mode, impl, m) for m in MS} <= seen, (mode, impl)
    assert len(rows) == len(seen)
    bf16 = {r["m"]: r["us"] for r in rows if r["mode"] == "bf16"}
    by_key = {(r["mode"], r["impl"], r["m"]): r for r in rows}
    for r in rows:
        line = f"{r['m']:>6d} {r['mode']:>5s} {r['impl']:<18s}"
        assert line in stdout, line
        if r["na"] is not None:
            # Only what the checkout lacks may be n/a, and it says so.
            assert not available.get(r["impl"], True), (r["impl"], r["na"])
            assert "not in this checkout" in r["na"] or "no kernels= option" in r["na"], r["na"]
            continue
        us, m = r["us"], r["m"]
        assert us > 0
        assert math.isclose(r["rate"], 2 * m * K * N / us / 1e6, rel_tol=1e-9)
        assert math.isclose(r["gbs"], r["weight_bytes"] / us / 1e3, rel_tol=1e-9)
        assert math.isclose(r["x_bf16"], bf16[m] / us, rel_tol=1e-9)
        assert r["unit"] == ("TOP/s" if r["mode"] == "w8a8" else "TFLOP/s")
        assert r["timed"].startswith("loop n=" if m <= 128 else "calls n=")
        if r["impl"] != "ours pallas":  # a kernel may hold its own layout
            assert r["weight_bytes"] == _expected_bytes(r["mode"], r["impl"]), r
        # The error is within the printed bound (1.25 x the rounding model with
        # room for 12 bf16 roundings; see tpu_matmul's docstring) ...
        assert r["bound"] == pytest.approx(1.25 * math.hypot(r["q_model"], 2.0**-7))
        assert r["rel_err"] <= r["bound"], r
        if r["mode"] == "bf16":
            # one rounding of the output to bf16: relative error <= 2^-8 per element
            assert r["q_model"] == 0 and r["rel_err"] <= 2.0**-8
        else:
            # ... and near the model from below: the mode did quantize as it says
            # (the model is within a few % of the measured error at these sizes;
            # an unquantized or finer path would be far below it).
            assert r["rel_err"] >= 0.8 * r["q_model"], r
        printed = f"{r['rel_err']:>9.2e} {r['bound']:>9.2e}"
        assert printed in stdout
    # One backend, the same computation: ours (layer, stateless with float or
    # once-quantized weights) give Qwix's bits, so the same error.
    for mode in ("int8", "int4", "fp8", "w8a8"):
        for m in MS:
            theirs = by_key[(mode, "qwix", m)]["rel_err"]
            for impl in ("ours", "stateless float w", "stateless w once"):
                row = by_key.get((mode, impl, m))
                if row is not None and row["na"] is None:
                    assert row["rel_err"] == theirs, (mode, impl, m)


@pytest.fixture
def train(seed, tmp_path):
    out, png = tmp_path / "train.json", tmp_path / "loss.png"
    proc = _run("benchmarks.tpu_train", "--small", "--steps=30", "--repeats=1",
                "--target-ms=1", f"--seed={seed}", f"--json={out}", f"--png={png}")
    return proc.stdout, json.loads(out.read_text()), png


def test_tpu_train_steps_and_curves(train):
    stdout, data, png = train
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    variants = ["bf16", "int8 QT (ours)", "int8 QT (qwix)"]
    for model in ("mlp", "transformer"):
        steps = data["steps"][model]
        assert list(steps) == variants
        for variant, entry in steps.items():
            assert entry["ms"] > 0
            assert math.isclose(entry["bf16_over_this"], steps["bf16"]["ms"] / entry["ms"],
                                rel_tol=1e-9)
            assert f"{model:<12s} {variant:<16s} {entry['ms']:9.3f}" in stdout
        assert f"{model:<12s} step ratio bf16 / int8 QT: ours" in stdout
    curves = data["curves"]
    assert list(curves) == variants and all(len(c) == 30 for c in curves.values())
    assert all(math.isfinite(v) for c in curves.values() for v in c)
    # Both int8 QT variants compile to the same computation: the same bits on
    # one backend, every step.
    assert curves["int8 QT (ours)"] == curves["int8 QT (qwix)"]
    assert data["int8_ours_equals_qwix"] is True
    late = data["late_mean"]
    for variant in variants:
        # It learns: the last 3 steps' mean is below the first step's loss by
        # more than the batch-to-batch spread (the first batches' losses differ
        # by a few %; 30 Adam steps at lr 3e-3 lower it by > 15% here).
        assert late[variant] < 0.9 * curves[variant][0], (variant, late[variant])
    # QT tracks bf16: every int8 product carries ~1% relative error (the w8a8
    # rows of tpu_matmul), which moves a step's loss by about that much; 5% is
    # several times that, while a wrong backward scale or a broken gradient
    # leaves the loss far from bf16's.
    assert late["int8 QT (ours)"] == pytest.approx(late["bf16"], rel=0.05)


def test_tpu_train_one_model_at_another_batch(seed, tmp_path):
    out = tmp_path / "train.json"
    proc = _run("benchmarks.tpu_train", "--small", "--models=transformer", "--tf-batch=3",
                "--repeats=1", "--target-ms=1", f"--seed={seed}", f"--json={out}")
    data = json.loads(out.read_text())
    # Only the transformer was timed, at the batch asked for, and no loss
    # curve was drawn (it trains the mlp).
    assert list(data["steps"]) == ["transformer"]
    assert data["sizes"]["tf_batch"] == 3
    assert "batch 3;" in proc.stdout and "loss curve" not in proc.stdout
    assert "curves" not in data
