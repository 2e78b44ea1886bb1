"""mlx_lattice.compile and mlx_lattice.calibrate: the compiled inference
graph (norms folded into the layers before them, bias and ReLU as one
epilogue, static int8 layers in the fused op with int8 codes between them)
against the unfused eval() forward pass; every zoo model and quantized form
compiles; an artifact compiles on load (today's committed version-2 file
included) and in a fresh process with the same bits; calibration from scans
against the inputs each layer sees.

Every step (``_check_every_step``). Each node of the compiled graph runs on
the inputs the compiled graph itself gave it, against an independent
reference on those same inputs, so the graph's output is checked as the
composition of checked steps:

* a folded layer (layer + norm in one): the unfused layer and norm of the
  eval graph, within the derived bound below;
* a static int8 layer in the fused op: ``int8_refs.py``'s NumPy model of
  the op (exact integer sums, the float32 epilogue one rounding per
  operation, the requantization ``clip(rint(y / scale), -127, 127)``), bit
  for bit: int8 codes in, int8 codes (or float32) out; and its folded
  tensors against the fold of the eval graph's computed in float64
  (``_check_fold``);
* a concatenation of int8 codes: NumPy's concatenation, bit for bit;
* anything else: the eval graph's node itself (the same node, the same
  tensors, so the same step).

The bound of one folded layer (``_epilogue_bound``). It computes, per
output ``o``, ``y = relu(c * s + t)`` with ``c = sum_j w_j x_j`` over its
``n`` products (``n = K * Cin``, ``K`` kernel offsets), the norm's factor
``s = gamma * rsqrt(var + eps)`` and shift ``t = (b - mean) * s + beta``
(``b`` the layer's bias, if any). The eval forward rounds ``c`` (float32
sums: error at most ``gamma_n * A`` with ``A = sum_j |w_j| |x_j|``,
Higham's ``gamma_n = n u / (1 - n u)``, ``u = 2**-24``), then the norm's map
(a few roundings, each at most ``u`` times a value of magnitude at most
``M = |s| A + |(b - mean) s| + |beta|``). The compiled graph rounds
``w_j s`` (relative ``u``, so the sum moves by at most ``u |s| A``), sums
those products (``gamma_n |s| A``), forms its bias (two roundings of values
at most ``M``) and adds it (one rounding of at most ``M``). So the two
differ by at most ``(2 gamma_n + u) |s| A + 8 u M``, with ``8 u M`` covering
the at most eight roundings outside the sums (the norm's factor itself is
formed by the same float32 ops on both sides but bounded as if not). ReLU
is 1-Lipschitz. A weight-only quantized layer dequantizes ``w = scale * q +
bias`` before summing, and the compiled one uses ``fl(scale s) q + fl(bias
s)``, so the roundings are relative to ``|scale| q + |bias|`` (not ``|w|``,
which can cancel): ``A`` is computed with that weight. An int8-activation
layer quantizes the same input to the same codes on both sides (dynamic
per-row or static scales; ``|x_q| <= |x| + max(max|x| / 254, act_scale /
2)``, half a step: of the widest row, or of a static layer's scale) and
differs only in its float epilogue, bounded the same way with ``x`` widened
by half a step. ``A`` is computed in float32 by the same convolution on the
magnitudes and the absolute weight (``_abs_sums``), a sum of non-negative
terms, so it is at least ``(1 - gamma_{n+2})`` times the exact one (two
more roundings: the absolute weight's dequantization): it is scaled up by
``(1 + 2 gamma_{n+2})``.

The whole network. Its output is the composition of the steps checked
above, each on the compiled graph's own values, so no step goes unchecked
and each is checked against an independent reference on the very inputs it
read. A bound of the output against the eval forward's, propagated through
the layers (each layer adds its own bound to the previous one's, carried
by ``|s| sum_j |w_j| e_j``), holds but says nothing: the absolute weights'
gain compounds over the layers, and for these models (three levels, 11 to
13 folded layers) it came out at 60 to 75 times the largest output in
float and about 5e8 times in the weight-only forms (whose ``|scale| q +
|bias|`` exceeds ``|w|``), where the actual difference is a few ulps. A
wrong product or folded bias shows in the step that makes it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from collections import Counter
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

_spec = importlib.util.spec_from_file_location(
    "data", Path(__file__).with_name("inference_data.py")
)
data = importlib.util.module_from_spec(_spec)  # the shared tests/inference_data.py
_spec.loader.exec_module(data)
int8_refs = data.load("int8_refs")
U = 2.0**-24


def _fused_op() -> bool:
    from mlx_lattice._native import ext

    return hasattr(ext, "sparse_quantized_conv_fused")


def _gamma(n: int) -> float:
    """Higham's ``gamma_n``: the relative error of a float32 sum of ``n`` products."""
    return n * U / (1 - n * U)


def _feats(v):
    return v.feats if isinstance(v, mlx_lattice.SparseTensor) else v


def _f64(v) -> np.ndarray:
    return np.array(_feats(v), np.float64)


def _f32_up(a: np.ndarray) -> mx.array:
    """Non-negative float64 values as float32 values no smaller (rounded, then one ulp up)."""
    return mx.array(np.nextafter(np.asarray(a, np.float32), np.float32(np.inf)))


def _like(x, feats: mx.array):
    """``feats`` on ``x``'s rows (a sparse tensor's coordinates, or plain point rows)."""
    return x.replace(feats) if isinstance(x, mlx_lattice.SparseTensor) else feats


def _in_channels(node: dict, t: dict) -> int:
    q = node.get("quant")
    if q is not None:
        return int(q["storage_in_channels"])
    # A float layer: (Cout, Cin) or (Cout, kx, ky, kz, Cin).
    return int(t[node["weight"]].shape[-1])


def _products(node: dict, t: dict) -> int:
    """``n``: the products one output sums."""
    if node["op"] == "linear":
        return _in_channels(node, t)
    k = node["kernel_size"]
    return int(k[0] * k[1] * k[2] * _in_channels(node, t))


def _abs_layer(node: dict, t: dict):
    """The node's layer with ``|weight|`` (quantized: ``|scale| q + |bias|``),
    no bias, float activations: its output on magnitudes is ``A``."""
    q = node.get("quant")
    if q is None:
        weight = mx.abs(t[node["weight"]].astype(mx.float32))
        cin = int(weight.shape[-1])
    else:
        cin = node["in_channels"]
        weight = mx.dequantize(
            t[node["weight"]],
            mx.abs(t[q["scales"]].astype(mx.float32)),
            mx.abs(t[q["biases"]].astype(mx.float32)),
            group_size=q["group_size"],
            bits=q["bits"],
        )[..., :cin]
        if weight.ndim == 3:  # conv: (K, Cout, Cin) -> (Cout, kx, ky, kz, Cin)
            k = node["kernel_size"]
            weight = weight.reshape(*k, *weight.shape[1:]).transpose(3, 0, 1, 2, 4)
    plain = {k: v for k, v in node.items() if k not in ("quant", "epilogue")}
    plain.update(weight="abs.weight", bias=None, in_channels=cin)
    tensors = {"abs.weight": weight}
    if node["op"] == "linear":
        return export._linear_layer(plain, tensors)
    return export._conv_layer(plain, tensors)


def _abs_sums(layer: dict, t: dict, x, mag: np.ndarray) -> np.ndarray:
    """An upper bound of ``sum_j |w_j| mag_j`` per output (float64) for
    magnitudes ``mag >= 0`` on ``x``'s rows (see the module docstring)."""
    g = _gamma(_products(layer, t) + 2)
    return _f64(_abs_layer(layer, t)(_like(x, _f32_up(mag)))) * (1 + 2 * g)


def _magnitude(layer: dict, t: dict, x) -> np.ndarray:
    """``|x|``, widened by half an int8 step where the layer quantizes its
    input: of the widest row (dynamic scales), or of the static scale when
    that is larger (a static layer's step is its scale)."""
    xa = np.abs(_f64(x))
    q = layer.get("quant") or {}
    if q.get("act_bits") is not None:
        half = xa.max(initial=0.0) / 254.0
        if q.get("act_static"):
            half = max(half, float(t[q["act_scale"]].item()) / 2)
        xa = xa + half
    return xa


def _norm_factor(layer: dict, norm: dict, t: dict) -> tuple[np.ndarray, np.ndarray]:
    """The norm's factor ``s`` (formed as float32 forms it) and the constant
    part of ``M``: ``|(b - mean) s| + |beta|``."""
    s = mx.rsqrt(t[norm["running_var"]].astype(mx.float32) + norm["eps"])
    if norm.get("weight") is not None:
        s = t[norm["weight"]].astype(mx.float32) * s
    s = np.array(s, np.float64)
    centred = -np.array(t[norm["running_mean"]], np.float64)
    if layer.get("bias") is not None:
        centred = centred + np.array(t[layer["bias"]], np.float64)
    m = np.abs(centred * s)
    if norm.get("bias") is not None:
        m = m + np.abs(np.array(t[norm["bias"]], np.float64))
    return s, m


def _epilogue_bound(layer: dict, t: dict, x, mag: np.ndarray, s, m) -> np.ndarray:
    """``(2 gamma_n + u) |s| A + 8 u (|s| A + m)`` for inputs of magnitude ``mag``."""
    g = _gamma(_products(layer, t))
    a = np.abs(s) * _abs_sums(layer, t, x, mag)
    return (2 * g + U) * a + 8 * U * (a + m)


def _fold_bound(layer: dict, norm: dict, t: dict, x, mag: np.ndarray) -> np.ndarray:
    """The bound of one folded layer (``layer`` + ``norm``) whose two sides
    read inputs of magnitude at most ``mag``."""
    s, m = _norm_factor(layer, norm, t)
    return _epilogue_bound(layer, t, x, mag, s, m)


def _is_static(node: dict) -> bool:
    q = node.get("quant")
    return node["op"] in export._CONV_OPS and bool(q) and q["act_bits"] == 8 and q["act_static"]


def _relation(node: dict, x, y):
    """The relation of a convolution node from ``x`` onto ``y`` (its output
    rows), built here from their coordinates: a submanifold one, a strided
    one (its output coordinates ``y``'s, in ``y``'s order), or a transposed
    one (the strided one from ``y`` down onto ``x``'s coordinates, transposed)."""
    from mlx_lattice.core import build_kernel_relation

    assert node.get("padding") is None, node["output"]
    size, stride, dilation = node["kernel_size"], node["stride"], node["dilation"]
    if node["op"] == "subm_conv" or stride == [1, 1, 1]:
        rel = build_kernel_relation(
            x.coords, kernel_size=size, dilation=dilation, tensor_stride=x.tensor_stride
        )
        coarse, fine = y, x
    else:
        coarse, fine = (y, x) if node["op"] == "conv" else (x, y)
        rel = build_kernel_relation(
            fine.coords,
            kernel_size=size,
            stride=stride,
            dilation=dilation,
            tensor_stride=fine.tensor_stride,
            kind="forward",
        )
    assert np.array_equal(np.array(rel.out_coords), np.array(coarse.coords)), node["output"]
    return rel.transposed() if node["op"] == "conv_transpose" else rel


def _fused_ref(node: dict, t: dict, x, y, in_scale: float, out_scale: float) -> np.ndarray:
    """int8_refs' NumPy model of the fused op from ``x`` (int8 codes at
    ``in_scale``, or float rows quantized at it) onto ``y``'s rows: the
    layer's sums, its epilogue (the folded norm's bias and ReLU, or the
    layer's own bias), then int8 codes at ``out_scale`` or float32
    (``out_scale`` 0)."""
    rel = _relation(node, x, y)
    qw = export._quantized_weight(node, t)
    feats = np.array(x.feats)
    if feats.dtype == np.int8:
        acc = int8_refs.int8_conv_ref(None, qw, rel, static=np.float32(in_scale), codes=feats)
    else:
        acc = int8_refs.int8_conv_ref(feats, qw, rel, static=np.float32(in_scale))
    epilogue = node.get("epilogue") or {}
    name = epilogue.get("bias") or node.get("bias")
    return int8_refs.fused_epilogue_ref(
        acc,
        bias=None if name is None else np.array(t[name]),
        relu=bool(epilogue.get("relu", False)),
        out_scale=np.float32(out_scale) if out_scale else None,
    )


def _np64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), np.float64)


def _check_fold(node: dict, layer: dict, norm: dict, folded: dict, t: dict) -> None:
    """A folded node's tensors against the fold of the eval graph's ones
    computed here in float64: float32 whatever the model's dtype; a float
    weight ``s[o] W[o]`` (a quantized one keeps its codes, its group scales
    and biases are ``s[o]`` times the layer's), within 4u (``s``: rsqrt and
    a product, 3u relative with the rsqrt's own error; the product with the
    weight one more u); the epilogue bias ``(b - mean) s + beta`` within
    ``6u (|(b - mean) s| + |bias|)`` (then a difference, a product and a
    sum, one rounding each)."""
    s = _np64(t[norm["weight"]]) / np.sqrt(_np64(t[norm["running_var"]]) + norm["eps"])
    q = layer.get("quant")
    if q is None:
        pairs = [(node["weight"], layer["weight"], (-1,) + (1,) * (t[layer["weight"]].ndim - 1))]
    else:
        assert mx.array_equal(folded[node["weight"]], t[layer["weight"]])  # the same codes
        shape = (-1, 1) if t[q["scales"]].ndim == 2 else (1, -1, 1)
        pairs = [(node["quant"][k], q[k], shape) for k in ("scales", "biases")]
    for name, source, shape in pairs:
        assert folded[name].dtype == mx.float32, name
        want = _np64(t[source]) * s.reshape(shape)
        assert (np.abs(_np64(folded[name]) - want) <= 4 * U * np.abs(want)).all(), name
    centred = -_np64(t[norm["running_mean"]])
    if layer.get("bias") is not None:
        centred = centred + _np64(t[layer["bias"]])
    want = centred * s + _np64(t[norm["bias"]])
    got = _np64(folded[node["epilogue"]["bias"]])
    assert (np.abs(got - want) <= 6 * U * (np.abs(centred * s) + np.abs(want))).all()


def _check_folds(model: mlx_nn.Module) -> list[dict]:
    """Every folded node of compile(model) through ``_check_fold``; returns them."""
    graph, tensors = export.lower(model)
    by_output = {n["output"]: n for n in graph["nodes"]}
    net = mlx_lattice.compile(model)
    folded = [n for n in net.graph["nodes"] if "epilogue" in n]
    for node in folded:
        norm = by_output[node["output"]]
        _check_fold(node, by_output[norm["inputs"][0]], norm, net.tensors, tensors)
    return folded


def _check_every_step(ref: export.ExportedModel, net: export.ExportedModel, x) -> Counter:
    """Every node of the compiled ``net`` on the inputs ``net`` gave it,
    against ``ref`` (the same model, op for op) or NumPy, as the module
    docstring says; returns how many nodes of each kind were checked."""
    values = net._values(x)
    plan = net.graph.get("int8_values")
    fused = plan is not None and _fused_op()
    plan = plan or {}
    by_output = {n["output"]: n for n in ref.graph["nodes"]}
    ref_steps = dict(zip(by_output, export._build(ref.graph, ref.tensors), strict=True))
    t = ref.tensors
    kinds: Counter = Counter()
    for node in net.graph["nodes"]:
        out = node["output"]
        args = [values[name] for name in node["inputs"]]
        got = values[out]
        if node["op"] == "cat" and out in plan:
            want = np.concatenate([np.array(a.feats) for a in args], axis=1)
            assert got.feats.dtype == mx.int8 and np.array_equal(np.array(got.feats), want), out
            kinds["cat codes"] += 1
        elif fused and _is_static(node):
            own = float(net.tensors[node["quant"]["act_scale"]].item())
            in_scale = plan.get(node["inputs"][0], own)
            if "epilogue" in node:
                norm = by_output[out]
                _check_fold(node, by_output[norm["inputs"][0]], norm, net.tensors, t)
            want = _fused_ref(node, net.tensors, args[0], got, in_scale, plan.get(out, 0.0))
            assert np.array(got.feats).dtype == want.dtype, (out, got.feats.dtype)
            assert np.array_equal(np.array(got.feats), want), out
            kinds["fused"] += 1
        elif (node.get("epilogue") or {}).get("residual") is not None:
            # A skip addition fused into the folded linear layer (compile's
            # fuse_skips): out = p + relu(layer(z) + bias). The reference is
            # the eval graph's layer, norm and add on the same z and p. Its
            # sum differs from ours by the folded layer's difference plus
            # the two float32 roundings of the add (u |got| + u |want|).
            add, p = by_output[out], node["epilogue"]["residual"]
            (m,) = [name for name in add["inputs"] if name != p]
            norm = by_output[m]
            layer = by_output[norm["inputs"][0]]
            assert add["op"] == "add" and norm["op"] == "batch_norm"
            assert layer["inputs"] == node["inputs"][:1] and node["inputs"][1] == p
            r = ref_steps[m](ref_steps[layer["output"]](args[0]))
            want = ref_steps[out](*[r if name == m else args[1] for name in add["inputs"]])
            bound = _fold_bound(layer, norm, t, args[0], _magnitude(layer, t, args[0]))
            got64, want64 = _f64(got), _f64(want)
            bound = bound + 2.0**-24 * (np.abs(got64) + np.abs(want64))
            err = np.abs(got64 - want64)
            assert (err <= bound).all(), (out, float(err.max()), float(bound.max()))
            kinds["folded"] += 1
            kinds["skip"] += 1
        elif "epilogue" in node:
            norm = by_output[out]
            layer = by_output[norm["inputs"][0]]
            assert norm["op"] == "batch_norm" and layer["inputs"] == node["inputs"]
            want = ref_steps[out](ref_steps[layer["output"]](args[0]))
            bound = _fold_bound(layer, norm, t, args[0], _magnitude(layer, t, args[0]))
            err = np.abs(_f64(got) - _f64(want))
            assert (err <= bound).all(), (out, float(err.max()), float(bound.max()))
            kinds["folded"] += 1
        else:
            assert node == by_output[out], out
            names = [node[k] for k in ("weight", "bias") if isinstance(node.get(k), str)]
            names += [v for v in (node.get("quant") or {}).values() if isinstance(v, str)]
            assert all(mx.array_equal(net.tensors[k], t[k]) for k in names), out
            kinds["same"] += 1
    assert not any(n["op"] == "batch_norm" for n in net.graph["nodes"])
    return kinds


@pytest.mark.parametrize("arch", ["MinkUNet", "SPVCNN"])
@pytest.mark.parametrize("form", list(data.FORMS))
def test_compiled_graph_matches_the_eval_forward(arch: str, form: str, rng) -> None:
    """Every step of the compiled graph on its own inputs against the eval
    graph's (a static form here with float values between the layers,
    ``int8=False``: the chain test below runs the int8 one)."""
    model = data.model(arch, form, rng, data.points(rng, 900, 4.0))
    graph, tensors = export.lower(model)
    ref = export.ExportedModel(graph=graph, tensors=tensors, metadata={})
    x = data.model_input(arch, *data.points(rng, 1200, 5.0))
    # The interpreter is the eval forward, to the bit (test_export: every form, other points).
    assert mx.array_equal(_feats(ref._run(x)), _feats(model(x)))
    net = mlx_lattice.compile(model, int8=not form.endswith("static"))
    assert net.compiled
    kinds = _check_every_step(ref, net, x)
    norms = sum(isinstance(m, mlx_nn.BatchNorm) for _, m in model.named_modules())
    assert kinds["folded"] == norms  # every norm of these models follows its layer


@pytest.mark.skipif(not _fused_op(), reason="the extension has no fused int8 convolution")
@pytest.mark.parametrize("arch", ["MinkUNet", "SPVCNN"])
def test_int8_chain_requantizes_bit_for_bit(arch: str, rng: np.random.Generator) -> None:
    """Layer by layer: each static layer runs the fused op, and on the
    codes (or float rows) the compiled graph gave it writes the bits of
    int8_refs' NumPy model: int8 codes at its value's scale, or float32;
    concatenations join codes of one scale (``_check_every_step``). The
    values' scales: readers read at the group's scale, the largest of their
    calibrated ones, computed here independently."""
    model = data.model(arch, "w8a8-static", rng, data.points(rng, 900, 4.0))
    graph, tensors = export.lower(model)
    ref = export.ExportedModel(graph=graph, tensors=tensors, metadata={})
    net = mlx_lattice.compile(model)
    plan = net.graph["int8_values"]
    assert plan  # the decoder's concatenations and the stages between them
    x = data.model_input(arch, *data.points(rng, 1200, 5.0))
    kinds = _check_every_step(ref, net, x)
    nodes = net.graph["nodes"]
    assert kinds["fused"] == sum(_is_static(n) for n in nodes) and kinds["cat codes"] >= 1
    assert kinds["fused"] + kinds["folded"] == sum(
        isinstance(m, mlx_nn.BatchNorm) for _, m in model.named_modules()
    )
    values = net._values(x)
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

    codes = 0
    for node in nodes:
        out = node["output"]
        if out in plan:
            assert _feats(values[out]).dtype == mx.int8, out
            assert plan[out] == shared_scale(out), out
            codes += node["op"] != "cat"
    assert codes >= 3


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
    model = data.model("MinkUNet", "w8a8-static", rng, data.points(rng, 900, 4.0))
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
    x = data.model_input("MinkUNet", *data.points(rng, 1200, 5.0))
    assert _check_every_step(ref, net, x)["fused"] == 1
    got, want = _f64(net(x)), _f64(ref(x))
    bound = _epilogue_bound(stem, t, x, _magnitude(stem, t, x), 1.0, np.abs(bias))
    assert (np.abs(got - want) <= bound).all(), float(np.abs(got - want).max())
    assert (bound < np.abs(bias)).all()  # a dropped bias (about 100) could not pass


@pytest.mark.skipif(not _fused_op(), reason="the extension has no fused int8 convolution")
def test_a_concatenation_of_the_graph_input_stays_float(rng: np.random.Generator) -> None:
    """cat(input, static conv) read by a static conv: the graph's input is
    float and made by no node, so the concatenation's group stays float (the
    convolution before it writes float too), and the graph computes what the
    interpreter does, within the epilogue bound of the stem test."""
    from mlx_lattice.core.quantized import QuantizedWeight

    model = data.model("MinkUNet", "w8a8-static", rng, data.points(rng, 900, 4.0))
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
    x = data.model_input("MinkUNet", *data.points(rng, 1200, 5.0))
    values = net._values(x)
    joined = values["joined"]
    assert joined.feats.dtype == mx.float32 and values[stem["output"]].feats.dtype == mx.float32
    assert _check_every_step(ref, net, x)["fused"] == 2
    # The last layer on the joined float rows against the interpreter's layer
    # on the same rows: the same codes at its static scale, so they differ in
    # the float epilogue only (the bound of the stem test, no layer bias).
    got = _f64(values["mixed"])
    want = _f64(export._build(only, t)[2](joined))
    bound = _epilogue_bound(mix, t, joined, _magnitude(mix, t, joined), 1.0, 0.0)
    assert (np.abs(got - want) <= bound).all()


def test_the_folded_weights_are_the_scaled_ones(rng: np.random.Generator) -> None:
    """Float convolutions + norms (the stem's convolution with a bias): the
    compiled weight is s[o] * W[o] and the epilogue bias (b - mean) * s +
    beta, computed here in float64 (``_check_fold``)."""
    model = MinkUNet(3, 2, widths=(8, 8))
    data.randomize_norms(model, rng)
    model.stem.conv.bias = mx.array(rng.normal(0, 1, 8).astype(np.float32))
    stem = _check_folds(model.eval())[0]
    assert stem["epilogue"]["relu"] is True and stem["bias"] is None


def test_quantized_folds_into_the_scales_and_keeps_the_codes(rng: np.random.Generator) -> None:
    model = MinkUNet(3, 2, widths=(32, 32))
    data.randomize_norms(model, rng)
    quantize(model, [qr.Rule(module_path="stem/.*"), qr.Rule(weight_qtype="int4", tile_size=32)])
    folded = _check_folds(model.eval())
    assert sum("quant" in n for n in folded) >= 3 and "quant" not in folded[0]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_models_fold_in_float32(dtype, rng: np.random.Generator) -> None:
    """A half model's folded weights, group scales and group biases stay
    float32: the fold rounds once, in float32 (rounding them back to the
    model's half type would add a second, coarser rounding)."""
    model = MinkUNet(3, 2, widths=(32, 32))
    data.randomize_norms(model, rng)
    quantize(model, [qr.Rule(module_path="stem/.*"), qr.Rule(weight_qtype="int8", tile_size=32)])
    model.set_dtype(dtype)
    folded = _check_folds(model.eval())
    assert sum("quant" in n for n in folded) >= 3 and "quant" not in folded[0]


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
    data.randomize_norms(model, rng)
    model.eval()
    pts, feats = data.points(rng, 300, 3.0)
    x = point_cloud_input(pts, mx.array(feats[:, :2]), data.VOXEL).tensor
    before = model(x).feats
    weight = model.stem.conv.weight
    mlx_lattice.compile(model)
    assert model.stem.conv.weight is weight
    assert mx.array_equal(model(x).feats, before)


def test_artifact_compiles_on_load(tmp_path: Path, rng: np.random.Generator) -> None:
    model = data.model("SPVCNN", "w8a8-static", rng, data.points(rng, 900, 4.0))
    path = tmp_path / "net.mlxl"
    export.export_model(model, path, voxel_size=data.VOXEL, class_names=list("abcde"))
    net = export.load(path, compiled=True)
    assert net.compiled and net.class_names == tuple("abcde") and net.voxel_size == data.VOXEL
    direct = mlx_lattice.compile(model)
    q_pts, q_feats = data.points(rng, 700, 4.0)
    a = net.predict_points(q_pts, q_feats)
    assert mx.array_equal(a, direct.predict_points(q_pts, q_feats, voxel_size=data.VOXEL))
    assert mlx_lattice.compile(net) is net


def test_committed_version_2_artifact_compiles() -> None:
    """Today's committed file loads compiled, and every step of its graph
    (with int8 codes between the static layers, and with float values) is
    checked against the file's own op-for-op run (the module docstring); that
    run gives the recorded scores (test_export)."""
    ref = export.load(data.GOLDEN)
    with np.load(data.GOLDEN_EXPECTED) as case:
        inp = point_cloud_input(case["points"], case["feats"], data.VOXEL)
    for net in (export.load(data.GOLDEN, compiled=True), mlx_lattice.compile(ref, int8=False)):
        assert net.compiled
        kinds = _check_every_step(ref, net, inp)
        # 5 convolutions and 2 point MLPs with norms; the head; the point moves
        assert kinds["folded"] + kinds["fused"] == 7, kinds


def test_damaged_and_foreign_files_raise_when_loaded_compiled(tmp_path: Path) -> None:
    """load(compiled=True) checks the file as load() does before compiling."""
    raw = bytearray(data.GOLDEN.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a byte of a tensor
    damaged = tmp_path / "damaged.mlxl"
    damaged.write_bytes(bytes(raw))
    with pytest.raises(ExportError, match="digest does not match"):
        export.load(damaged, compiled=True)
    foreign = tmp_path / "foreign.safetensors"
    mx.save_safetensors(str(foreign), {"w": mx.zeros((2,))})
    with pytest.raises(ExportError, match=r"has no 'mlx_lattice\.graph' metadata"):
        export.load(foreign, compiled=True)


# Runs in a child Python: loads each artifact (argv: artifacts, then the
# case, then the output file) compiled, scores the case's points, and writes
# the scores' bits and whether any module of mlx_lattice.models was imported.
_CHILD = """
import sys
import numpy as np
import mlx.core as mx
from mlx_lattice import export

*paths, case, out = sys.argv[1:]
case = np.load(case)
scores = {}
for i, path in enumerate(paths):
    net = export.load(path, compiled=True)
    s = net.predict_points(case["points"], case["feats"])
    mx.eval(s)
    scores[f"scores{i}"] = np.array(s.view(mx.uint8))
np.savez(out, models=np.array(any(m.startswith("mlx_lattice.models") for m in sys.modules)),
         **scores)
"""


def test_compiled_graph_bit_for_bit_in_a_fresh_process(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """A float and a static-int8 SPVCNN artifact, loaded compiled in one
    child process that never imports mlx_lattice.models, score other points
    with this process's bits."""
    paths, want = [], []
    q_pts, q_feats = data.points(rng, 1100, 5.0)
    for form in ("float", "w8a8-static"):
        model = data.model("SPVCNN", form, rng, data.points(rng, 900, 4.0))
        paths.append(tmp_path / f"{form}.mlxl")
        export.export_model(model, paths[-1], voxel_size=data.VOXEL)
        scores = export.load(paths[-1], compiled=True).predict_points(q_pts, q_feats)
        want.append(np.array(scores.view(mx.uint8)))
    np.savez(tmp_path / "case.npz", points=q_pts, feats=q_feats)
    out = tmp_path / "out.npz"
    argv = [*map(str, paths), str(tmp_path / "case.npz"), str(out)]
    subprocess.run([sys.executable, "-c", _CHILD, *argv], check=True)
    with np.load(out) as got:
        assert not bool(got["models"])
        for i, scores in enumerate(want):
            assert np.array_equal(got[f"scores{i}"], scores), paths[i].name


def test_calibrate_sets_max_abs_input_over_127(rng: np.random.Generator) -> None:
    """Each static layer's scale is the largest |input| it sees over the
    scans / 127, the inputs recorded independently from the float model's
    forward (the static layers run with dynamic scales while calibrating,
    so a layer's input depends on the layers before it: the reference
    records them from the quantized model with the dynamic rule instead)."""
    scans = [data.model_input("MinkUNet", *data.points(rng, 600, 4.0)) for _ in range(2)]
    model = MinkUNet(3, 5, widths=(32, 32))
    data.randomize_norms(model, rng)
    twin = MinkUNet(3, 5, widths=(32, 32))
    twin.update(model.parameters())
    quantize(model, [qr.Rule(module_path="stem/.*"), data.STATIC])
    dynamic = dataclasses.replace(data.STATIC, act_static_scale=False)
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
        # The same float32 peaks, divided by 127 and rounded once to float32
        # (a quotient of two float32 numbers rounds alike from float64 or float32).
        assert scale == float(np.float32(np.float32(peaks[path]) / np.float32(127))), path
    with pytest.raises(mlx_lattice.MlxLatticeError, match="scans is empty"):
        mlx_lattice.calibrate(model, [])
    with pytest.raises(mlx_lattice.MlxLatticeError, match="scans must hold"):
        mlx_lattice.calibrate(model, [np.zeros((3, 3))])
