"""Compiled inference graphs: batch norms folded into the layers before
them, fused epilogues, and static activation scales calibrated from scans.

:func:`compile` walks an ``eval()``-mode :class:`~mlx_lattice.models.MinkUNet`
or :class:`~mlx_lattice.models.SPVCNN` (float or quantized by
:func:`mlx_lattice.quantize`), or a loaded artifact
(:class:`~mlx_lattice.export.ExportedModel`), once, and returns an
:class:`~mlx_lattice.export.ExportedModel` that runs the compiled graph:

* each batch norm that reads only a convolution's (or a linear layer's)
  output is folded into that layer. With the norm's per-channel factor
  ``s = gamma / sqrt(running_var + eps)`` (formed in float32, as the eval
  norm forms it) and ``beta`` its bias, the layer's weight rows become
  ``s[o] * W[o]`` and its bias ``(b[o] - running_mean[o]) * s[o] + beta[o]``.
  A float layer's weight is scaled before it runs. A quantized layer keeps
  its integer codes: its group scales and group biases (per output channel
  and input group: ``w = scale * code + bias``) are multiplied by ``s[o]``,
  which is the same map as scaling the dequantized weight, so folding
  needs no float weight and adds no quantization error (it is folded into
  the per-channel scales, not before quantizing; a model quantized from
  float can be folded either way, a loaded artifact only this way);
* the folded bias and the ReLU that follows the norm run as one epilogue
  pass (:func:`mlx_lattice.fused.bias_relu`) instead of the norm's pass;
* (``fuse_skips``, the default) a skip addition of a folded linear layer's
  output (SPVCNN's point branch) joins that epilogue
  (:func:`mlx_lattice.fused.bias_relu_add`);
* everything else (concatenations, the point moves of SPVCNN, the head)
  runs as in the artifact interpreter.

The compiled graph computes the same function as the ``eval()`` forward
pass up to float32 rounding (folding reorders the products: the bound is
derived in ``tests/test_inference.py``). Static activation scales are what
the layers were calibrated with: a folded norm changes its own layer's
output scale, not the input the next layer's static scale was measured
on. :func:`calibrate` sets those scales from a few scans.

>>> from mlx_lattice.models import MinkUNet
>>> from mlx_lattice.tensor import SparseTensor
>>> model = MinkUNet(2, 3, widths=(4, 8)).eval()
>>> coords = mx.array([[0, i, j, 0] for i in range(3) for j in range(3)], dtype=mx.int32)
>>> net = compile(model)
>>> [n["op"] for n in net.graph["nodes"]][:3], net.compiled
(['subm_conv', 'conv', 'subm_conv'], True)
>>> y = net(SparseTensor(coords, mx.ones((9, 2)))).feats
>>> ref = model(SparseTensor(coords, mx.ones((9, 2)))).feats
>>> bool(mx.allclose(y, ref, rtol=1e-5, atol=1e-5))
True
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as mlx_nn

from mlx_lattice._arena import with_arena
from mlx_lattice._errors import MlxLatticeError
from mlx_lattice.export import (
    _CONV_OPS,
    ExportedModel,
    ExportError,
    _build,
    _quantized_weight,
    lower,
)
from mlx_lattice.quantize import calibrate_activation_scales
from mlx_lattice.tensor import SparseTensor

__all__ = ["calibrate", "compile"]

_F32 = mx.float32


def _path(node: Mapping[str, Any]) -> str:
    """The layer's name in the tensors (``encoder.block1.down``)."""
    name = node["weight"]
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _fold_norm(
    node: dict[str, Any], norm: dict[str, Any], t: dict[str, mx.array]
) -> dict[str, Any]:
    """``node`` (a convolution or linear layer) with ``norm`` folded in. The
    folded weights, group scales and biases are float32 whatever the model's
    dtype: each is one float32 rounding of the exact product."""
    path = _path(node)
    s = mx.rsqrt(t[norm["running_var"]].astype(_F32) + norm["eps"])
    if norm.get("weight") is not None:
        s = t[norm["weight"]].astype(_F32) * s
    centred = -t[norm["running_mean"]].astype(_F32)
    if node.get("bias") is not None:
        centred = t[node["bias"]].astype(_F32) + centred
    bias = centred * s
    if norm.get("bias") is not None:
        bias = bias + t[norm["bias"]].astype(_F32)
    out = {**node, "output": norm["output"], "bias": None}
    q = node.get("quant")
    if q is not None:
        # scales / biases: (K, Cout, groups) for a convolution, (Cout, groups) for a linear layer
        q = dict(q)
        for key in ("scales", "biases"):
            a = t[q[key]]
            factor = s.reshape(-1, 1) if a.ndim == 2 else s.reshape(1, -1, 1)
            q[key] = f"{path}.{key}.folded"
            t[q[key]] = a.astype(_F32) * factor
        out["quant"] = q
    else:
        w = t[node["weight"]]
        factor = s.reshape((-1,) + (1,) * (w.ndim - 1))
        out["weight"] = f"{path}.weight.folded"
        t[out["weight"]] = w.astype(_F32) * factor
    t[f"{path}.epilogue.bias"] = bias
    out["epilogue"] = {"bias": f"{path}.epilogue.bias", "relu": bool(norm["relu"])}
    return out


def _fold(
    nodes: list[dict[str, Any]], tensors: Mapping[str, mx.array]
) -> tuple[list[dict[str, Any]], dict[str, mx.array]]:
    """The nodes with every foldable norm folded, and the tensors they read."""
    uses = Counter(name for node in nodes for name in node["inputs"])
    t = dict(tensors)
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(nodes):
        node = nodes[i]
        nxt = nodes[i + 1] if i + 1 < len(nodes) else None
        if (
            node["op"] in (*_CONV_OPS, "linear")
            and "epilogue" not in node
            and nxt is not None
            and nxt["op"] == "batch_norm"
            and nxt["inputs"] == [node["output"]]
            and uses[node["output"]] == 1
        ):
            out.append(_fold_norm(node, nxt, t))
            i += 2
        else:
            out.append(node)
            i += 1
    read = {name for node in out for name in _tensor_names(node)}
    return out, {name: a for name, a in t.items() if name in read}


def _fuse_skips(nodes: list[dict[str, Any]], output: str) -> list[dict[str, Any]]:
    """The nodes with each skip addition the graph allows fused into a
    linear layer's epilogue: an ``add`` of ``m``, made by a linear layer
    with a folded norm and read by nothing else, and ``p``, made before that
    layer (or the graph's input). The layer then reads ``p`` as its second
    input (``epilogue["residual"]``) and makes the add's output,
    ``relu(x W' + b') + p`` in one pass
    (:func:`mlx_lattice.fused.bias_relu_add`: the add after the ReLU, as the
    graph has it). In the zoo these are SPVCNN's point branch sums
    ``to_points(x) + point_mlp(z)``; MinkUNet's skips are concatenations,
    and no add follows a convolution in either."""
    uses = Counter(name for node in nodes for name in node["inputs"])
    made_at = {node["output"]: i for i, node in enumerate(nodes)}
    fused: dict[int, dict[str, Any]] = {}
    dropped: set[int] = set()
    for j, node in enumerate(nodes):
        if node["op"] != "add":
            continue
        for m, p in (node["inputs"], node["inputs"][::-1]):
            i = made_at.get(m, -1)
            layer = nodes[i] if i >= 0 else {}
            if (
                layer.get("op") == "linear"
                and layer.get("epilogue") is not None
                and i not in fused
                and uses[m] == 1
                and m != output
                and m != p
                and made_at.get(p, -1) < i
            ):
                epilogue = {**layer["epilogue"], "residual": p}
                fused[i] = {
                    **layer, "inputs": [*layer["inputs"], p], "output": node["output"],
                    "epilogue": epilogue,
                }
                dropped.add(j)
                break
    return [fused.get(i, node) for i, node in enumerate(nodes) if i not in dropped]


def _skip_step(node: Mapping[str, Any], t: Mapping[str, mx.array]) -> Callable:
    """A linear layer with a folded norm and a skip addition in its epilogue
    (:func:`_fuse_skips`): ``(z, p) -> relu(layer(z) + bias) + p``."""
    from mlx_lattice.export import _linear_layer
    from mlx_lattice.fused import bias_relu_add

    layer = _linear_layer(dict(node), t)
    bias, relu = t[node["epilogue"]["bias"]], bool(node["epilogue"]["relu"])

    def run(z: Any, p: Any) -> Any:
        y = layer(z)
        if isinstance(y, SparseTensor):
            return y.replace(bias_relu_add(y.feats, bias, p.feats, relu=relu))
        return bias_relu_add(y, bias, p, relu=relu)

    return run


def _tensor_names(node: Mapping[str, Any]) -> Iterable[str]:
    for key in ("weight", "bias", "running_mean", "running_var"):
        if isinstance(node.get(key), str):
            yield node[key]
    for part in ("quant", "epilogue"):
        for value in (node.get(part) or {}).values():
            if isinstance(value, str):
                yield value


def _is_static(node: Mapping[str, Any]) -> bool:
    """A convolution with int8 activations at one calibrated static scale."""
    q = node.get("quant")
    return node["op"] in _CONV_OPS and bool(q) and q["act_bits"] == 8 and bool(q["act_static"])


def _int8_values(nodes: list[dict[str, Any]], output: str, t: Mapping[str, mx.array]) -> dict:
    """The values that stay int8 codes, each with its scale.

    Values joined by a concatenation form one group (a concatenation of
    codes needs one scale), its inputs included. A group stays int8 when
    every value in it is made by a static-scale convolution (or such a
    concatenation; the graph's input is made by none) and read
    only by static-scale convolutions (or the group's concatenations), and
    it is not the graph's output. Its scale is the largest calibrated input
    scale among the convolutions that read it: a reader calibrated lower
    reads codes at that scale (no value saturates; the codes are at most
    that ratio coarser), and the producers' epilogues requantize once to it.
    """
    parent: dict[str, str] = {}

    def root(v: str) -> str:
        while parent.get(v, v) != v:
            v = parent[v]
        return v

    for node in nodes:
        if node["op"] == "cat":
            for name in node["inputs"]:
                parent[root(name)] = root(node["output"])
    producer = {node["output"]: node for node in nodes}
    readers: dict[str, list[dict[str, Any]]] = {}
    for node in nodes:
        for name in node["inputs"]:
            readers.setdefault(name, []).append(node)
    groups: dict[str, list[str]] = {}
    # Every value, a concatenation's inputs included (the graph's input,
    # which no node makes, keeps its group float).
    values = [node["output"] for node in nodes]
    values += [name for node in nodes if node["op"] == "cat" for name in node["inputs"]]
    for v in dict.fromkeys(values):
        groups.setdefault(root(v), []).append(v)
    plan: dict[str, float] = {}
    for members in groups.values():
        demands, ok = [], True
        for v in members:
            made = producer.get(v)
            ok = ok and made is not None and v != output
            ok = ok and (_is_static(made) or made["op"] == "cat")
            for reader in readers.get(v, []):
                if _is_static(reader):
                    demands.append(float(t[reader["quant"]["act_scale"]].astype(_F32).item()))
                elif reader["op"] != "cat":
                    ok = False
        if ok and demands:
            plan.update(dict.fromkeys(members, max(demands)))
    return plan


def _relation_of(node: Mapping[str, Any]) -> Callable[[SparseTensor], tuple[Any, Any]]:
    """The relation (and output key) a convolution node runs on, as
    :mod:`mlx_lattice.ops` chooses it for the same layer, decided once per
    node: the returned function only looks it up (or builds it)."""
    from mlx_lattice import ops
    from mlx_lattice.export import _KIND

    padding = None if node.get("padding") is None else tuple(node["padding"])
    return ops._relation_for(
        _KIND[node["op"]],
        tuple(node["kernel_size"]),
        tuple(node["stride"]),
        padding,
        tuple(node["dilation"]),
    )


def _fused_step(
    node: Mapping[str, Any], t: Mapping[str, mx.array], in_scale: float, out_scale: float
) -> Callable[[SparseTensor], SparseTensor]:
    """A static-scale convolution with its epilogue in the native fused op
    (``ext.sparse_quantized_conv_fused``): int8 codes at ``in_scale`` or
    float rows in, and int8 codes at ``out_scale`` (> 0) or float32 out."""
    from mlx_lattice._native import ext
    from mlx_lattice.core.quantized import with_float32_scales

    weight = with_float32_scales(_quantized_weight(node, t))
    epilogue = node.get("epilogue") or {}
    # A folded norm's epilogue bias already holds the layer's own bias
    # (_fold_norm sets the node's to None); a layer without a folded norm
    # adds its own.
    name = epilogue.get("bias") or node.get("bias")
    bias = t[name] if name else None
    relu = bool(epilogue.get("relu", False))
    relation = _relation_of(node)

    def run(x: SparseTensor) -> SparseTensor:
        rel, out_key = relation(x)
        feats = ext.sparse_quantized_conv_fused(
            x.feats,
            weight,
            rel,
            in_scale=in_scale,
            bias=bias,
            relu=relu,
            out_scale=out_scale,
        )
        return x.at(out_key, feats)

    return run


def _int8_steps(
    graph: Mapping[str, Any], t: Mapping[str, mx.array], steps: list[Callable]
) -> dict[str, float]:
    """Replace the steps of static-scale convolutions by the fused native op,
    keeping int8 codes between them where :func:`_int8_values` allows;
    returns the int8 values' scales."""
    from mlx_lattice._native import ext

    if not hasattr(ext, "sparse_quantized_conv_fused"):
        return {}
    nodes = graph["nodes"]
    plan = _int8_values(nodes, graph["output"], t)
    # A concatenation of codes stays ops.cat: its native row copy joins
    # bytes of any dtype.
    for i, node in enumerate(nodes):
        if _is_static(node):
            own = float(t[node["quant"]["act_scale"]].astype(_F32).item())
            in_scale = plan.get(node["inputs"][0], own)
            steps[i] = _fused_step(node, t, in_scale, plan.get(node["output"], 0.0))
    return plan


def compile(
    model: mlx_nn.Module | ExportedModel,
    *,
    voxel_size: float | None = None,
    features: Any = None,
    class_names: Any = None,
    int8: bool = True,
    fuse_skips: bool = True,
    arena: bool = True,
) -> ExportedModel:
    """The compiled inference graph of ``model``: an ``eval()``-mode
    :class:`~mlx_lattice.models.MinkUNet` or
    :class:`~mlx_lattice.models.SPVCNN` (float or quantized), or a loaded
    :class:`~mlx_lattice.export.ExportedModel` (see the module docstring
    for what is folded and fused).

    Returns an :class:`~mlx_lattice.export.ExportedModel` whose
    :attr:`~mlx_lattice.export.ExportedModel.compiled` is true: call it on a
    sparse tensor (voxel models) or use ``predict_points``.

    ``int8`` (default): where the extension has the fused int8 convolution
    (``ext.sparse_quantized_conv_fused``), every static-scale w8a8 / w4a8
    convolution runs it, its folded bias and ReLU in the kernel's epilogue,
    and consecutive ones keep int8 codes between them: an epilogue
    requantizes its output once to the scale its readers take (the largest
    calibrated scale among them; a concatenation's two inputs share it, so
    the concatenation joins codes). The chosen scales are
    ``graph["int8_values"]`` (value name -> scale). ``int8=False`` keeps
    float values between layers. ``fuse_skips`` (default) also fuses each skip
    addition that reads a folded linear layer's output into that layer's
    epilogue (SPVCNN's point branch: ``relu(x W' + b') + to_points(v)`` in
    one pass, :func:`mlx_lattice.fused.bias_relu_add`, the unfused graph's
    bits; ``fuse_skips=False`` keeps the adds as their own step); no add in these
    models follows a convolution, so the fused convolution's ``residual``
    has no reader in them. ``arena`` (default) runs the graph in an
    activation arena of its own: its buffers are planned once per
    coordinate set and reused across layers and calls, so a steady forward
    maps no fresh page, and the forward returns evaluated features;
    ``arena=False`` leaves every output to MLX's allocator.
    For a model,
    ``voxel_size``, ``features`` and ``class_names`` are recorded as
    :func:`~mlx_lattice.export.export_model` records them (an artifact keeps
    its own). The model is not changed, and its training path is untouched.

    Raises:
        ExportError: ``model`` is in training mode, is not one of these
            models, or has a layer outside the export vocabulary (the
            message names the layer).
    """
    if isinstance(model, ExportedModel):
        if model.compiled:
            return model
        graph, tensors, metadata = model.graph, model.tensors, dict(model.metadata)
    elif isinstance(model, mlx_nn.Module):
        if model.training:
            raise ExportError(
                "model is in training mode; compile an eval() model (its norms fold their "
                "running statistics)."
            )
        graph, tensors = lower(
            model, voxel_size=voxel_size, features=features, class_names=class_names
        )
        metadata = {}
    else:
        raise ExportError(
            f"model must be a MinkUNet, an SPVCNN or an ExportedModel, got {type(model).__name__}."
        )
    nodes, folded = _fold(graph["nodes"], tensors)
    if fuse_skips:
        nodes = _fuse_skips(nodes, graph["output"])
    compiled_graph = {**graph, "compiled": True, "nodes": nodes}
    mx.eval(list(folded.values()))
    net = ExportedModel(graph=compiled_graph, tensors=folded, metadata=metadata)
    steps = _build(compiled_graph, net.tensors)
    for i, node in enumerate(nodes):
        if (node.get("epilogue") or {}).get("residual") is not None:
            steps[i] = _skip_step(node, net.tensors)
    if int8:
        compiled_graph["int8_values"] = _int8_steps(compiled_graph, net.tensors, steps)
    # Activation buffers planned once: the steps run in one arena (_arena.py).
    net._steps.extend(with_arena(compiled_graph, steps) if arena else steps)
    return net


def _scan_input(scan: Any) -> Any:
    from mlx_lattice._pointcloud import PointCloudInput

    if isinstance(scan, SparseTensor | PointCloudInput):
        return scan
    tensor = getattr(scan, "tensor", None)  # a labelled batch (mlx_lattice.data.make_batch)
    if isinstance(tensor, SparseTensor):
        return tensor
    raise MlxLatticeError(
        "scans must hold SparseTensors, PointCloudInputs or batches with a .tensor, got "
        f"{type(scan).__name__}."
    )


def calibrate(
    model: mlx_nn.Module,
    scans: Iterable[Any],
    forward: Callable[[mlx_nn.Module, Any], Any] | None = None,
) -> dict[str, float]:
    """Set the static activation scales of ``model`` from a few scans, for
    deployment: every convolution quantized with a static scale (a rule
    with ``act_qtype`` and ``act_static_scale=True``, see
    :func:`mlx_lattice.quantize`) gets ``max|x| / 127`` (for int8) over the
    inputs it sees on ``scans``. Returns the scales by module path.

    ``scans`` are :class:`~mlx_lattice.SparseTensor` inputs (MinkUNet),
    ``PointCloudInput`` inputs (SPVCNN, see
    :func:`~mlx_lattice.models.point_cloud_input`), or labelled batches of
    :func:`mlx_lattice.data.make_batch` (their ``.tensor``). The model runs
    in ``eval()`` mode meanwhile, so running statistics are read, never
    updated; its mode is restored afterwards. ``forward(model, scan)``
    replaces ``model(scan)`` (as in
    :func:`~mlx_lattice.calibrate_activation_scales`, which this calls).
    Calibrate before :func:`compile` or :func:`~mlx_lattice.export.export_model`:
    both carry the scales.

    Raises:
        MlxLatticeError: no static-scale layer, no scans, a scan of
            another type, or a layer that saw only zeros.

    >>> import quantrules as qr
    >>> from mlx_lattice import quantize
    >>> from mlx_lattice.models import MinkUNet
    >>> model = MinkUNet(2, 3, widths=(32, 32))
    >>> rule = qr.Rule(op_names=("sparse_conv",), weight_qtype="int8", act_qtype="int8",
    ...                act_static_scale=True, tile_size=32)
    >>> _ = quantize(model, [qr.Rule(module_path="stem/.*"), rule])
    >>> coords = mx.array([[0, i, j, 0] for i in range(4) for j in range(4)], dtype=mx.int32)
    >>> scales = calibrate(model, [SparseTensor(coords, mx.ones((16, 2)))])
    >>> sorted(scales)[:2], model.training
    (['decoder/block1/conv', 'decoder/block1/up'], True)
    """
    inputs = [_scan_input(scan) for scan in scans]
    if not inputs:
        raise MlxLatticeError("scans is empty: calibration needs at least one scan.")
    was_training = model.training
    model.eval()
    try:
        return calibrate_activation_scales(model, inputs, forward)
    finally:
        if was_training:
            model.train()
