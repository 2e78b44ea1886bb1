"""Skip additions fused into a folded linear layer's epilogue
(``mlx_lattice.compile``, ``fuse_skips`` on by default) and the one-pass epilogue
they run, :func:`mlx_lattice.fused.bias_relu_add`.

* ``bias_relu_add`` against NumPy's float32 ``max(x + b, 0) + r`` (each
  operation rounded once, in that order), bit for bit, with NaN, infinities,
  negative zeros and values whose sum is exactly zero; the same bits as
  ``bias_relu`` followed by ``+``; the two-pass route for other dtypes.
* The graph: SPVCNN's two point-branch adds are fused (each into the point
  MLP's folded linear layer, float and quantized), nothing else changes, and
  the network's output is the unfused compiled graph's, bit for bit (the
  fused pass performs the same float32 operations in the same order).
  MinkUNet has no add: its graph is unchanged.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice import fused


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


data = _load("inference_data")


def _ref(x: np.ndarray, b: np.ndarray, r: np.ndarray, relu: bool) -> np.ndarray:
    """float32 throughout: NumPy rounds each operation once."""
    v = x + b
    if relu:
        v = np.where(v < 0, np.float32(0), v)  # NaN stays (NaN < 0 is false)
    return v + r


def _bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (300, 64), (1000, 17), (0, 8)])
@pytest.mark.parametrize("relu", [True, False])
def test_bias_relu_add_is_numpy_bit_for_bit(rng, shape, relu):
    n, c = shape
    x = rng.standard_normal((n, c)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    r = rng.standard_normal((n, c)).astype(np.float32)
    if n >= 7 and c >= 3:
        x[0, :3] = [np.nan, np.inf, -np.inf]
        x[1, 0], b[0] = np.float32(-0.5), np.float32(0.5)  # x + b == +0 exactly
        x[2, 1], r[2, 1] = -np.float32(0.0), -np.float32(0.0)  # signed zeros
        r[3, 2] = np.nan
    got = fused.bias_relu_add(mx.array(x), mx.array(b), mx.array(r), relu=relu)
    assert got.dtype == mx.float32 and got.shape == (n, c)
    want = _ref(x, b, r, relu)
    np.testing.assert_array_equal(_bits(np.array(got)), _bits(want))
    two = fused.bias_relu(mx.array(x), mx.array(b), relu=relu) + mx.array(r)
    np.testing.assert_array_equal(_bits(np.array(got)), _bits(np.array(two)))


def test_bias_relu_add_other_dtypes_take_two_passes(rng):
    x = mx.array(rng.standard_normal((50, 8)).astype(np.float32)).astype(mx.float16)
    b = mx.array(rng.standard_normal(8).astype(np.float32))
    r = mx.array(rng.standard_normal((50, 8)).astype(np.float32)).astype(mx.float16)
    got = fused.bias_relu_add(x, b, r)
    want = fused.bias_relu(x, b) + r
    assert got.dtype == mx.float16
    assert mx.array_equal(got, want)


def test_bias_relu_add_bad_arguments_name_them():
    x, b, r = mx.zeros((4, 3)), mx.zeros((3,)), mx.zeros((4, 3))
    bad = [
        ((mx.zeros((4,)), b, r), "x"),
        (([[0.0]], b, r), "x"),
        ((x, mx.zeros((2,)), r), "bias"),
        ((x, None, r), "bias"),
        ((x, b, mx.zeros((4, 2))), "residual"),
        ((x, b, mx.zeros((3,))), "residual"),
    ]
    for args, name in bad:
        with pytest.raises(mlx_lattice.MlxLatticeError, match=name):
            fused.bias_relu_add(*args)
    from mlx_lattice._native import ext

    with pytest.raises(mlx_lattice.MlxLatticeError, match="residual"):
        ext.bias_relu_add(x, b, r.astype(mx.float16))
    with pytest.raises(mlx_lattice.MlxLatticeError, match="x must be"):
        ext.bias_relu_add(x.astype(mx.int32), b, r)
    with pytest.raises(mlx_lattice.MlxLatticeError, match="bias"):
        ext.bias_relu_add(x, mx.zeros((3,), dtype=mx.int32), r)


@pytest.mark.parametrize("form", ["float", "int8", "w8a8", "w8a8-static"])
def test_spvcnn_point_adds_fuse_and_give_the_same_bits(rng, form):
    model = data.model("SPVCNN", form, rng, data.points(rng, 900, 4.0))
    x = data.model_input("SPVCNN", *data.points(rng, 1200, 5.0))
    plain = mlx_lattice.compile(model, fuse_skips=False)
    net = mlx_lattice.compile(model)
    adds = [n for n in plain.graph["nodes"] if n["op"] == "add"]
    assert len(adds) == 2 and not any(n["op"] == "add" for n in net.graph["nodes"])
    skips = [n for n in net.graph["nodes"] if (n.get("epilogue") or {}).get("residual")]
    assert {n["output"] for n in skips} == {n["output"] for n in adds}
    made = {n["output"]: n for n in plain.graph["nodes"]}
    mlps = set()
    for node in skips:
        add = made[node["output"]]
        residual = node["epilogue"]["residual"]
        (m,) = [v for v in add["inputs"] if v != residual]
        mlp = made[m]  # the point MLP's folded linear layer, unfused
        mlps.add(m)
        assert node["op"] == mlp["op"] == "linear" and made[residual]["op"] == "to_points"
        assert node["inputs"] == [*mlp["inputs"], residual]
        assert node["epilogue"] == {**mlp["epilogue"], "residual": residual}
        same = ("inputs", "output", "epilogue")
        assert {k: v for k, v in node.items() if k not in same} == {
            k: v for k, v in mlp.items() if k not in same
        }
        assert (node.get("quant") is None) == (form == "float")  # float or quantized linear
    # Every other node is the unfused compiled graph's.
    assert [n for n in net.graph["nodes"] if n not in skips] == [
        n for n in plain.graph["nodes"] if n["op"] != "add" and n["output"] not in mlps
    ]
    want, got = plain._run(x), net._run(x)
    assert got.dtype == want.dtype == mx.float32
    np.testing.assert_array_equal(_bits(np.array(got)), _bits(np.array(want)))


def test_minkunet_has_no_add_to_fuse(rng):
    model = data.model("MinkUNet", "float", rng, data.points(rng, 900, 4.0))
    assert (
        mlx_lattice.compile(model).graph["nodes"]
        == mlx_lattice.compile(model, fuse_skips=False).graph["nodes"]
    )
