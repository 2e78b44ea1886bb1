"""mlx_lattice.compile and mlx_lattice.calibrate: the compiled inference
graph (norms folded into the layers before them, bias and ReLU as one
epilogue) against the unfused eval() forward pass, layer by layer within a
derived float32 bound; every zoo model and quantized form compiles; an
artifact compiles on load (today's committed version-2 file included) and
in a fresh process with the same bits; calibration from scans against the
inputs each layer sees.

The bound (``_fold_bound``). One folded layer computes, per output ``o``,
``y = relu(c * s + t)`` with ``c = sum_j w_j x_j`` over its ``n`` products
(``n = K * Cin``, ``K`` kernel offsets), the norm's factor
``s = gamma * rsqrt(var + eps)`` and shift ``t = beta - mean * s`` (plus the
layer bias, folded the same way). The eval forward rounds ``c`` (float32
sums: error at most ``gamma_n * A`` with ``A = sum_j |w_j| |x_j|``, Higham's
``gamma_n = n u / (1 - n u)``, ``u = 2**-24``), then the norm's map (a few
roundings, each at most ``u`` times a value of magnitude at most
``M = |s| A + |mean s| + |beta|``). The compiled graph rounds ``w_j s``
(relative ``u``, so the sum moves by at most ``u |s| A``), sums those
products (``gamma_n |s| A``), forms its bias (two roundings of values at
most ``M``) and adds it (one rounding of at most ``M``). So the two differ
by at most ``(2 gamma_n + u) |s| A + 8 u M``, with ``8 u M`` covering the
at most eight roundings outside the sums (the norm's scale itself is formed
by the same float32 ops on both sides but bounded as if not). ReLU is
1-Lipschitz. Quantized layers: a weight-only layer dequantizes
``w = scale * q + bias`` before summing, and the compiled one uses
``fl(scale s) q + fl(bias s)``, so the roundings are relative to
``|scale| q + |bias|`` (not ``|w|``, which can cancel): ``A`` is computed
with that weight. An int8-activation layer quantizes the same input to the
same codes on both sides (dynamic per-row or static scales; ``|x_q| <=
|x| + max(max|x| / 254, act_scale / 2)``, half a step: of the widest row,
or of a static layer's scale) and differs only in its float epilogue,
bounded the same way with ``x`` widened by half a step. ``A`` is computed in
float32 by the same convolution on ``|x|`` and the absolute weight, a sum
of non-negative terms, so it is at least ``(1 - gamma_n)`` times the exact
one: it is scaled up by ``(1 + 2 gamma_n)``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as mlx_nn
import numpy as np
import pytest

import mlx_lattice
import quantrules as qr
from mlx_lattice import export, nn, quantize
from mlx_lattice.export import ExportError
from mlx_lattice.models import SPVCNN, MinkUNet, point_cloud_input

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "export_v2_spvcnn.mlxl"
GOLDEN_EXPECTED = DATA / "export_v2_spvcnn_expected.npz"
VOXEL = 0.25
U = 2.0**-24

_STATIC = qr.Rule(
    op_names=("sparse_conv",),
    weight_qtype="int8",
    act_qtype="int8",
    act_static_scale=True,
    tile_size=32,
)
FORMS: dict[str, list[qr.Rule] | None] = {
    "float": None,
    "int8": [qr.Rule(weight_qtype="int8", tile_size=32)],
    "int4": [qr.Rule(weight_qtype="int4", tile_size=32)],
    "w8a8": [qr.Rule(weight_qtype="int8", act_qtype="int8", tile_size=32)],
    "w8a8-static": [_STATIC, qr.Rule(weight_qtype="int8", act_qtype="int8", tile_size=32)],
}


def _randomize_norms(model, rng: np.random.Generator) -> None:
    """Norm statistics and affine parameters away from the defaults (some
    factors negative), so every fold changes its layer."""
    for _, m in model.named_modules():
        if isinstance(m, mlx_nn.BatchNorm):
            n = int(m.running_mean.shape[0])
            m.running_mean = mx.array(rng.normal(0, 0.3, n).astype(np.float32))
            m.running_var = mx.array(rng.uniform(0.3, 3.0, n).astype(np.float32))
            sign = np.where(rng.uniform(size=n) < 0.2, -1.0, 1.0)
            m.weight = mx.array((sign * rng.uniform(0.5, 1.5, n)).astype(np.float32))
            m.bias = mx.array(rng.normal(0, 0.2, n).astype(np.float32))


def _points(rng: np.random.Generator, n: int, extent: float) -> tuple[np.ndarray, np.ndarray]:
    pts = rng.uniform(0, extent, (n, 3)).astype(np.float32)
    return pts, rng.standard_normal((n, 3)).astype(np.float32)


def _model(arch: str, form: str, rng: np.random.Generator, pts, feats):
    cls = MinkUNet if arch == "MinkUNet" else SPVCNN
    model = cls(3, 5, widths=(16, 32, 32), depths=(1, 2, 1))
    _randomize_norms(model, rng)
    model.eval()
    if FORMS[form] is not None:
        quantize(model, FORMS[form], allow_growth=True)
    if form.endswith("static"):
        mlx_lattice.calibrate(model, [_input(arch, pts, feats)])
    return model


def _input(arch: str, pts, feats):
    inp = point_cloud_input(pts, mx.array(feats), VOXEL)
    return inp if arch == "SPVCNN" else inp.tensor


def _abs_layer(node: dict, tensors: dict):
    """The node's layer with ``|weight|`` (quantized: ``|scale| q + |bias|``),
    no bias, float activations: its output on ``|x|`` is ``A``."""
    q = node.get("quant")
    if q is None:
        weight = mx.abs(tensors[node["weight"]].astype(mx.float32))
    else:
        full = mx.dequantize(
            tensors[node["weight"]],
            mx.abs(tensors[q["scales"]].astype(mx.float32)),
            mx.abs(tensors[q["biases"]].astype(mx.float32)),
            group_size=q["group_size"],
            bits=q["bits"],
        )[..., : node["in_channels"]]
        if full.ndim == 3:  # conv: (K, Cout, Cin) -> (Cout, kx, ky, kz, Cin)
            k = node["kernel_size"]
            full = full.reshape(*k, *full.shape[1:]).transpose(3, 0, 1, 2, 4)
        weight = full
    plain = {k: v for k, v in node.items() if k not in ("quant", "epilogue")}
    t = {"abs.weight": weight}
    plain.update(weight="abs.weight", bias=None)
    if node["op"] == "linear":
        return export._linear_layer(plain, t)
    return export._conv_layer(plain, t)


def _products(node: dict) -> int:
    q = node.get("quant")
    cin = q["storage_in_channels"] if q else node.get("in_channels")
    if node["op"] == "linear":
        return int(cin if cin else node["weight_shape"][1])
    k = node["kernel_size"]
    return int(k[0] * k[1] * k[2] * cin)


def _feats(v):
    return v.feats if isinstance(v, mlx_lattice.SparseTensor) else v


def _check_layers_within_bound(ref: export.ExportedModel, x, *, int8: bool = False) -> int:
    """Every folded layer of compile(ref, int8=int8) with float input and
    output, run on the input the unfused graph gave its layer, against the
    unfused layer + norm output; returns how many layers were checked."""
    net = mlx_lattice.compile(ref, int8=int8)
    chain = net.graph.get("int8_values", {})
    values = ref._values(x)
    by_output = {n["output"]: n for n in ref.graph["nodes"]}
    checked = 0
    for node, step in zip(net.graph["nodes"], net._steps, strict=True):
        if "epilogue" not in node or node["output"] in chain or node["inputs"][0] in chain:
            continue
        norm = by_output[node["output"]]
        layer = by_output[norm["inputs"][0]]
        assert norm["op"] == "batch_norm" and layer["inputs"] == node["inputs"]
        t = ref.tensors
        if layer["op"] == "linear" and "quant" not in layer:
            layer = {**layer, "in_channels": int(t[layer["weight"]].shape[1])}
        elif layer["op"] != "linear" and "quant" not in layer:
            layer = {**layer, "in_channels": int(t[layer["weight"]].shape[4])}
        x_in = values[node["inputs"][0]]
        got, want = _feats(step(x_in)), _feats(values[node["output"]])
        xa = mx.abs(_feats(x_in).astype(mx.float32))
        q = layer.get("quant") or {}
        if q.get("act_bits") is not None:
            # Half an int8 step: of the widest row (dynamic scales), or of the
            # static scale when that is larger (a static layer's step is its scale).
            half = mx.max(xa) / 254.0
            if q.get("act_static"):
                half = mx.maximum(half, t[q["act_scale"]].astype(mx.float32) / 2)
            xa = xa + half
        abs_in = x_in.replace(xa) if isinstance(x_in, mlx_lattice.SparseTensor) else xa
        n = _products(layer)
        gamma = n * U / (1 - n * U)
        a = np.array(_feats(_abs_layer(layer, t)(abs_in))) * (1 + 2 * gamma)
        s = np.array(mx.rsqrt(t[norm["running_var"]] + norm["eps"]) * t[norm["weight"]])
        m = np.abs(np.array(t[norm["running_mean"]]) * s) + np.abs(np.array(t[norm["bias"]]))
        bound = (2 * gamma + U) * np.abs(s) * a + 8 * U * (np.abs(s) * a + m)
        err = np.abs(np.array(got, np.float64) - np.array(want, np.float64))
        worst = float((err - bound).max())
        assert worst <= 0, (layer["weight"], float(err.max()), float(bound.max()))
        # The fold is not a no-op: the norm changed the layer's output.
        assert float(np.abs(np.array(want)).max()) > 0
        checked += 1
    return checked


@pytest.mark.parametrize("arch", ["MinkUNet", "SPVCNN"])
@pytest.mark.parametrize("form", list(FORMS))
def test_folded_layers_match_the_eval_forward_within_the_bound(
    arch: str, form: str, rng: np.random.Generator
) -> None:
    pts, feats = _points(rng, 900, 4.0)
    model = _model(arch, form, rng, pts, feats)
    graph, tensors = export.lower(model)
    ref = export.ExportedModel(graph=graph, tensors=tensors, metadata={})
    x = _input(arch, *_points(rng, 1200, 5.0))
    checked = _check_layers_within_bound(ref, x)
    norms = sum(isinstance(m, mlx_nn.BatchNorm) for _, m in model.named_modules())
    assert checked == norms  # every norm of these models follows its layer
    if _fused_op() and form == "w8a8-static" and arch == "SPVCNN":
        # The fused op's float epilogue: SPVCNN's stem reads the float input
        # and writes float values (read by the point branch).
        assert _check_layers_within_bound(ref, x, int8=True) >= 1
    # The whole network: the eval forward and the compiled graph score alike.
    net = mlx_lattice.compile(model)
    assert net.compiled and not any(n["op"] == "batch_norm" for n in net.graph["nodes"])
    a = model(x) if arch == "SPVCNN" else model(x).feats
    b = net._run(x) if arch == "SPVCNN" else net(x).feats
    # Rounding differences only: a flipped class needs two scores within a
    # few float32 ulps (float); int8 forms can move a code by one step at a
    # rounding boundary, so 1% of the rows may flip there.
    agree = float(mx.mean(mx.argmax(a, axis=1) == mx.argmax(b, axis=1)))
    assert agree >= (0.999 if form in ("float", "int8", "int4") else 0.99), agree


def _fused_op() -> bool:
    from mlx_lattice._native import ext

    return hasattr(ext, "sparse_quantized_conv_fused")


@pytest.mark.skipif(not _fused_op(), reason="the extension has no fused int8 convolution")
@pytest.mark.parametrize("arch", ["MinkUNet", "SPVCNN"])
def test_int8_chain_requantizes_bit_for_bit(arch: str, rng: np.random.Generator) -> None:
    """Layer by layer: each int8 value a static layer writes is its float32
    epilogue output (the same layer, same input, float out) requantized by
    NumPy: clip(round_half_even(y / scale), -127, 127), every code equal.
    Concatenations join codes of one scale. Readers read at the group's
    scale, the largest of their calibrated ones."""
    from mlx_lattice.inference import _fused_step

    pts, feats = _points(rng, 900, 4.0)
    model = _model(arch, "w8a8-static", rng, pts, feats)
    net = mlx_lattice.compile(model)
    plan = net.graph["int8_values"]
    assert plan  # the decoder's concatenations and the stages between them
    x = _input(arch, *_points(rng, 1200, 5.0))
    values = net._values(x)
    nodes = net.graph["nodes"]
    own = {
        n["output"]: float(net.tensors[n["quant"]["act_scale"]].item())
        for n in nodes
        if n.get("quant") and n["quant"]["act_static"]
    }
    # The expected shared scale, computed here: the values joined by
    # concatenations (a breadth-first walk over the cat edges, both ways),
    # and over every member the largest calibrated scale of its static
    # (non-cat) readers.
    joined: dict[str, set[str]] = {}
    for n in nodes:
        if n["op"] == "cat":
            for name in n["inputs"]:
                joined.setdefault(name, set()).add(n["output"])
                joined.setdefault(n["output"], set()).add(name)

    def group(v: str) -> set[str]:
        seen, todo = {v}, [v]
        while todo:
            for w in joined.get(todo.pop(), ()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    def shared_scale(v: str) -> float:
        return max(
            own[r["output"]]
            for m in group(v)
            for r in nodes
            if m in r["inputs"] and r["op"] != "cat" and r["output"] in own
        )

    checked = 0
    for node in nodes:
        out = node["output"]
        if out not in plan:
            continue
        got = _feats(values[out])
        assert got.dtype == mx.int8, (out, got.dtype)
        assert plan[out] == shared_scale(out), out
        if node["op"] == "cat":
            parts = [np.array(_feats(values[name])) for name in node["inputs"]]
            assert np.array_equal(np.array(got), np.concatenate(parts, axis=1))
            continue
        src = node["inputs"][0]
        in_scale = plan.get(src, own[out])
        y = _feats(_fused_step(node, net.tensors, in_scale, 0.0)(values[src]))
        assert y.dtype == mx.float32
        scale = np.float32(shared_scale(out))
        want = np.clip(np.rint(np.array(y) / scale), -127, 127).astype(np.int8)
        assert np.array_equal(np.array(got), want), out
        checked += 1
    assert checked >= 3
    # The whole network against the eval forward: codes move by at most a
    # step where a reader's scale grew, so a few rows at close scores flip.
    a = model(x) if arch == "SPVCNN" else model(x).feats
    b = net._run(x) if arch == "SPVCNN" else net(x).feats
    assert float(mx.mean(mx.argmax(a, axis=1) == mx.argmax(b, axis=1))) >= 0.97


@pytest.mark.skipif(not _fused_op(), reason="the extension has no fused int8 convolution")
def test_a_static_layer_without_a_norm_keeps_its_own_bias(rng: np.random.Generator) -> None:
    """A static w8a8 convolution with a bias and no norm after it: the fused
    int8 step adds the layer's own bias (there is no epilogue bias to take
    it from). The graph is the model's stem alone, its bias near 100.

    Bound: both sides quantize the same input with the same static scale to
    the same codes and sum integer products exactly; they differ in the float
    epilogue only (dequantizing ``scale * q + bias`` and adding the layer
    bias), bounded as in the module docstring with ``s = 1``, no mean and
    ``M = A + |b|``: ``(2 gamma_n + u) A + 8 u (A + |b|)``."""
    pts, feats = _points(rng, 900, 4.0)
    model = _model("MinkUNet", "w8a8-static", rng, pts, feats)
    graph, tensors = export.lower(model)
    stem = dict(graph["nodes"][0])
    assert stem["op"] == "subm_conv" and stem["quant"]["act_static"]
    bias = (100.0 + rng.normal(0, 1, stem["out_channels"])).astype(np.float32)
    stem["bias"] = "stem.conv.bias"
    t = {**tensors, "stem.conv.bias": mx.array(bias)}
    only = {**graph, "nodes": [stem], "output": stem["output"]}
    ref = export.ExportedModel(graph=only, tensors=t, metadata={})
    net = mlx_lattice.compile(ref)
    assert "epilogue" not in net.graph["nodes"][0]
    x = _input("MinkUNet", *_points(rng, 1200, 5.0))
    got, want = np.array(net(x).feats, np.float64), np.array(ref(x).feats, np.float64)
    xa = mx.abs(x.feats) + float(t[stem["quant"]["act_scale"]].item()) / 2  # half a static step
    n = _products(stem)
    gamma = n * U / (1 - n * U)
    a = np.array(_abs_layer(stem, t)(x.replace(xa)).feats) * (1 + 2 * gamma)
    bound = (2 * gamma + U) * a + 8 * U * (a + np.abs(bias))
    assert (np.abs(got - want) <= bound).all(), float(np.abs(got - want).max())
    assert abs(float(got.mean()) - float(want.mean())) < 1  # the bias (about 100) is there


@pytest.mark.skipif(not _fused_op(), reason="the extension has no fused int8 convolution")
def test_a_concatenation_of_the_graph_input_stays_float(rng: np.random.Generator) -> None:
    """cat(input, static conv) read by a static conv: the graph's input is
    float and made by no node, so the concatenation's group stays float (the
    convolution before it writes float too), and the graph computes what the
    interpreter does, within the epilogue bound of the stem test."""
    from mlx_lattice.core.quantized import QuantizedWeight

    pts, feats = _points(rng, 900, 4.0)
    model = _model("MinkUNet", "w8a8-static", rng, pts, feats)
    graph, tensors = export.lower(model)
    stem = graph["nodes"][0]
    cin = 3 + stem["out_channels"]
    w = QuantizedWeight.from_float(
        mx.array(rng.normal(0, 0.2, (27, cin, 8)).astype(np.float32)), bits=8, group_size=32
    )
    t = {**tensors, "mix.weight": w.weight, "mix.scales": w.scales, "mix.biases": w.biases}
    t["mix.act_scale"] = mx.array(np.float32(0.05))
    cat = {"op": "cat", "inputs": [graph["input"], stem["output"]], "output": "joined"}
    quant = {**stem["quant"], "scales": "mix.scales", "biases": "mix.biases"}
    quant.update(act_scale="mix.act_scale", storage_in_channels=w.storage_in_channels)
    mix = {**stem, "inputs": ["joined"], "output": "mixed", "weight": "mix.weight"}
    mix.update(in_channels=cin, out_channels=8, quant=quant)
    only = {**graph, "nodes": [stem, cat, mix], "output": "mixed"}
    ref = export.ExportedModel(graph=only, tensors=t, metadata={})
    net = mlx_lattice.compile(ref)
    assert net.graph["int8_values"] == {}
    x = _input("MinkUNet", *_points(rng, 1200, 5.0))
    values = net._values(x)
    joined = values["joined"]
    assert joined.feats.dtype == mx.float32 and values[stem["output"]].feats.dtype == mx.float32
    # The last layer on the joined float rows against the interpreter's layer
    # on the same rows: the same codes at its static scale, so they differ in
    # the float epilogue only (the bound of the stem test, no layer bias).
    got = np.array(values["mixed"].feats, np.float64)
    want = np.array(export._build(only, t)[2](joined).feats, np.float64)
    n = _products(mix)
    gamma = n * U / (1 - n * U)
    xa = mx.abs(joined.feats) + 0.05 / 2  # half a static step
    a = np.array(_abs_layer(mix, t)(joined.replace(xa)).feats) * (1 + 2 * gamma)
    assert (np.abs(got - want) <= (2 * gamma + U) * a + 8 * U * a).all()


def test_the_folded_weights_are_the_scaled_ones(rng: np.random.Generator) -> None:
    """One float convolution + norm: the compiled weight is s[o] * W[o] and
    the epilogue bias (b - mean) * s + beta, computed here in float64."""
    model = MinkUNet(3, 2, widths=(8, 8))
    _randomize_norms(model, rng)
    model.stem.conv.bias = mx.array(rng.normal(0, 1, 8).astype(np.float32))
    net = mlx_lattice.compile(model.eval())
    node = net.graph["nodes"][0]
    norm = model.stem.norm
    s = np.array(norm.weight, np.float64) / np.sqrt(
        np.array(norm.running_var, np.float64) + norm.eps
    )
    w = np.array(model.stem.conv.weight, np.float64) * s[:, None, None, None, None]
    np.testing.assert_allclose(np.array(net.tensors[node["weight"]]), w, rtol=4 * U, atol=0)
    centred = (np.array(model.stem.conv.bias, np.float64) - np.array(norm.running_mean)) * s
    b = centred + np.array(norm.bias)
    got = np.array(net.tensors[node["epilogue"]["bias"]])
    # s: rsqrt and a product (3u relative with the rsqrt's own error); then
    # a difference, a product and a sum, one rounding each.
    assert (np.abs(got - b) <= 6 * U * (np.abs(centred) + np.abs(b))).all()
    assert node["epilogue"]["relu"] is True and node["bias"] is None


def test_quantized_folds_into_the_scales_and_keeps_the_codes(rng: np.random.Generator) -> None:
    model = MinkUNet(3, 2, widths=(32, 32))
    _randomize_norms(model, rng)
    quantize(model, [qr.Rule(module_path="stem/.*"), qr.Rule(weight_qtype="int4", tile_size=32)])
    net = mlx_lattice.compile(model.eval())
    node = next(n for n in net.graph["nodes"] if n.get("quant") and n["op"] == "conv")
    layer, norm = model.encoder.block1.down, model.encoder.block1.down_norm
    assert mx.array_equal(net.tensors[node["weight"]], layer.weight)  # the same codes
    s = np.array(norm.weight) / np.sqrt(np.array(norm.running_var) + norm.eps)
    for key in ("scales", "biases"):
        want = np.array(layer[key]) * s[None, :, None]
        got = np.array(net.tensors[node["quant"][key]])
        np.testing.assert_allclose(got, want, rtol=4 * U, atol=0)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_models_fold_in_float32(dtype, rng: np.random.Generator) -> None:
    """A half model's folded weights, group scales and group biases stay
    float32: the fold rounds once, in float32 (rounding them back to the
    model's half type would add a second, coarser rounding)."""
    model = MinkUNet(3, 2, widths=(32, 32))
    _randomize_norms(model, rng)
    quantize(model, [qr.Rule(module_path="stem/.*"), qr.Rule(weight_qtype="int8", tile_size=32)])
    model.set_dtype(dtype)
    net = mlx_lattice.compile(model.eval())
    stem = net.graph["nodes"][0]
    norm = model.stem.norm
    s = np.array(norm.weight.astype(mx.float32), np.float64) / np.sqrt(
        np.array(norm.running_var.astype(mx.float32), np.float64) + norm.eps
    )
    w = np.array(model.stem.conv.weight.astype(mx.float32), np.float64)
    got = net.tensors[stem["weight"]]
    assert got.dtype == mx.float32
    # s: rsqrt and a product (3u relative), the weight's product one more u.
    np.testing.assert_allclose(np.array(got), w * s[:, None, None, None, None], rtol=4 * U, atol=0)
    node = next(n for n in net.graph["nodes"] if n.get("quant") and n["op"] == "conv")
    norm = model.encoder.block1.down_norm
    s = np.array(norm.weight.astype(mx.float32), np.float64) / np.sqrt(
        np.array(norm.running_var.astype(mx.float32), np.float64) + norm.eps
    )
    for key in ("scales", "biases"):
        got = net.tensors[node["quant"][key]]
        assert got.dtype == mx.float32, key
        want = np.array(model.encoder.block1.down[key].astype(mx.float32), np.float64)
        np.testing.assert_allclose(np.array(got), want * s[None, :, None], rtol=4 * U, atol=0)


def test_every_zoo_model_compiles_or_names_the_layer(rng: np.random.Generator) -> None:
    for cls in (MinkUNet, SPVCNN):
        for depths in (1, (1, 2, 3)):
            model = cls(2, 3, widths=(8, 16, 16), depths=depths).eval()
            net = mlx_lattice.compile(model)
            assert net.model_type == cls.__name__
    model = MinkUNet(2, 3, widths=(8, 16)).eval()
    model.encoder.block1.conv = nn.NormalizedSubMConv3d(16, 16)
    with pytest.raises(ExportError, match=r"encoder\.block1\.conv"):
        mlx_lattice.compile(model)
    with pytest.raises(ExportError, match="training mode"):
        mlx_lattice.compile(MinkUNet(2, 3, widths=(8, 16)))
    with pytest.raises(ExportError, match="model must be"):
        mlx_lattice.compile(nn.SubMConv3d(2, 3).eval())


def test_training_path_is_unchanged(rng: np.random.Generator) -> None:
    """Compiling copies: the model's parameters and its forward stay as they were."""
    model = MinkUNet(2, 3, widths=(8, 16))
    _randomize_norms(model, rng)
    model.eval()
    pts, feats = _points(rng, 300, 3.0)
    x = point_cloud_input(pts, mx.array(feats[:, :2]), VOXEL).tensor
    before = model(x).feats
    weight = model.stem.conv.weight
    mlx_lattice.compile(model)
    assert model.stem.conv.weight is weight
    assert mx.array_equal(model(x).feats, before)


def test_artifact_compiles_on_load(tmp_path: Path, rng: np.random.Generator) -> None:
    pts, feats = _points(rng, 900, 4.0)
    model = _model("SPVCNN", "w8a8-static", rng, pts, feats)
    path = tmp_path / "net.mlxl"
    export.export_model(model, path, voxel_size=VOXEL, class_names=list("abcde"))
    net = export.load(path, compiled=True)
    assert net.compiled and net.class_names == tuple("abcde") and net.voxel_size == VOXEL
    direct = mlx_lattice.compile(model)
    q_pts, q_feats = _points(rng, 700, 4.0)
    a = net.predict_points(q_pts, q_feats)
    assert mx.array_equal(a, direct.predict_points(q_pts, q_feats, voxel_size=VOXEL))
    assert mlx_lattice.compile(net) is net


def test_committed_version_2_artifact_compiles() -> None:
    """Today's committed file loads compiled; each folded layer is within
    the bound of the file's own op-for-op run, and the scores are the
    recorded ones within the committed test's tolerance."""
    ref = export.load(GOLDEN)
    net = export.load(GOLDEN, compiled=True)
    with np.load(GOLDEN_EXPECTED) as case:
        inp = point_cloud_input(case["points"], case["feats"], VOXEL)
        assert _check_layers_within_bound(ref, inp) == 7  # 5 convolutions, 2 point MLPs
        got = np.array(net.predict_points(case["points"], case["feats"]))
        np.testing.assert_allclose(got, case["scores"], rtol=1e-4, atol=1e-4)


def test_damaged_and_foreign_files_raise_when_loaded_compiled(tmp_path: Path) -> None:
    """load(compiled=True) checks the file as load() does before compiling."""
    data = bytearray(GOLDEN.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a byte of a tensor
    damaged = tmp_path / "damaged.mlxl"
    damaged.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="digest does not match"):
        export.load(damaged, compiled=True)
    foreign = tmp_path / "foreign.safetensors"
    mx.save_safetensors(str(foreign), {"w": mx.zeros((2,))})
    with pytest.raises(ExportError, match=r"has no 'mlx_lattice\.graph' metadata"):
        export.load(foreign, compiled=True)


_CHILD = """
import sys
import numpy as np
import mlx.core as mx
from mlx_lattice import export

net = export.load(sys.argv[1], compiled=True)
case = np.load(sys.argv[2])
scores = net.predict_points(case["points"], case["feats"])
mx.eval(scores)
np.savez(sys.argv[3], scores=np.array(scores.view(mx.uint8)),
         models=np.array(any(m.startswith("mlx_lattice.models") for m in sys.modules)))
"""


@pytest.mark.parametrize("form", ["float", "w8a8-static"])
def test_compiled_graph_bit_for_bit_in_a_fresh_process(
    form: str, tmp_path: Path, rng: np.random.Generator
) -> None:
    pts, feats = _points(rng, 900, 4.0)
    model = _model("SPVCNN", form, rng, pts, feats)
    path = tmp_path / "net.mlxl"
    export.export_model(model, path, voxel_size=VOXEL)
    q_pts, q_feats = _points(rng, 1100, 5.0)
    np.savez(tmp_path / "case.npz", points=q_pts, feats=q_feats)
    want = export.load(path, compiled=True).predict_points(q_pts, q_feats)
    out = tmp_path / "out.npz"
    subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(tmp_path / "case.npz"), str(out)], check=True
    )
    with np.load(out) as got:
        assert not bool(got["models"])
        assert np.array_equal(got["scores"], np.array(want.view(mx.uint8)))


def test_calibrate_sets_max_abs_input_over_127(rng: np.random.Generator) -> None:
    """Each static layer's scale is the largest |input| it sees over the
    scans / 127, the inputs recorded independently from the float model's
    forward (the static layers run with dynamic scales while calibrating,
    so a layer's input depends on the layers before it: the reference
    records them from the quantized model with the dynamic rule instead)."""
    scans = [_input("MinkUNet", *_points(rng, 600, 4.0)) for _ in range(2)]
    model = MinkUNet(3, 5, widths=(32, 32))
    _randomize_norms(model, rng)
    twin = MinkUNet(3, 5, widths=(32, 32))
    twin.update(model.parameters())
    quantize(model, [qr.Rule(module_path="stem/.*"), _STATIC])
    dynamic = dataclasses.replace(_STATIC, act_static_scale=False)
    quantize(twin, [qr.Rule(module_path="stem/.*"), dynamic])
    twin.eval()
    peaks: dict[str, float] = {}

    class Recorder(mlx_nn.Module):
        def __init__(self, inner, path) -> None:
            super().__init__()
            self.inner, self.path = inner, path

        def __call__(self, x, *args):
            peaks[self.path] = max(peaks.get(self.path, 0.0), float(mx.abs(x.feats).max()))
            return self.inner(x, *args)

    for name, m in list(twin.named_modules()):
        if isinstance(m, nn.QuantizedConv):
            *parents, last = name.split(".")
            node = twin
            for p in parents:
                node = node[p]
            setattr(node, last, Recorder(m, name.replace(".", "/")))
    for x in scans:
        mx.eval(twin(x).feats)
    running = np.array(model.stem.norm.running_mean)
    scales = mlx_lattice.calibrate(model, scans)
    assert model.training  # restored
    assert np.array_equal(np.array(model.stem.norm.running_mean), running)  # not updated
    assert set(scales) == set(peaks)
    for path, scale in scales.items():
        assert scale == pytest.approx(peaks[path] / 127, rel=1e-6), path
    with pytest.raises(mlx_lattice.MlxLatticeError, match="scans is empty"):
        mlx_lattice.calibrate(model, [])
    with pytest.raises(mlx_lattice.MlxLatticeError, match="scans must hold"):
        mlx_lattice.calibrate(model, [np.zeros((3, 3))])
