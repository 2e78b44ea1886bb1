"""A deployable artifact of a trained sparse network: one safetensors file.

``mx.export_function`` cannot carry these models. MLX serialises a traced
graph primitive by primitive, by name, through a table of MLX's own
primitives, and its public API (``mlx/export.h``) has no hook to register
an extension's primitives (the sparse convolution, geometry and norm
kernels of ``mlx_lattice._native``) for import. In MLX 0.32.4 the export
stops even before reaching them: the extension's ops make their inputs
contiguous, and MLX cannot serialise its own ``Contiguous`` primitive
(``ValueError: [export_function] Unable to serialize primitive
Contiguous``). Tracing would also freeze the kernel relations: they are
built from the coordinates outside the graph, so an exported trace would
only run on the coordinates it was traced with.

Instead :func:`export_model` writes the weights as safetensors tensors
(quantized layers as they are: packed codes, scales and biases, and a
calibrated static activation scale) and, in the same file's metadata, a
JSON graph over a fixed vocabulary of sparse ops, with a SHA-256 digest
over the graph and every tensor. :func:`load` checks the file and returns
an :class:`ExportedModel`, a small interpreter that runs the graph on any
coordinates with the layers of :mod:`mlx_lattice.nn` and the point moves of
SPVCNN, needing none of the classes of :mod:`mlx_lattice.models`. It
executes the same ops, on the same native kernels, in the same order as
the model's ``eval()`` forward pass, so outputs match bit for bit.

The format (version :data:`VERSION`) is described in the documentation's
"Exporting a trained model" topic.

>>> import tempfile, os
>>> from mlx_lattice.models import MinkUNet
>>> from mlx_lattice.tensor import SparseTensor
>>> model = MinkUNet(2, 3, widths=(4, 8)).eval()
>>> coords = mx.array([[0, i, j, 0] for i in range(3) for j in range(3)], dtype=mx.int32)
>>> x = SparseTensor(coords, mx.ones((9, 2)))
>>> path = os.path.join(tempfile.mkdtemp(), "net.mlxl")
>>> export_model(model, path, voxel_size=0.5, features=["occupancy", "height"])
>>> net = load(path)
>>> bool(mx.array_equal(net(x).feats, model(SparseTensor(coords, mx.ones((9, 2)))).feats))
True
>>> net.features, net.voxel_size
(('occupancy', 'height'), 0.5)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as mlx_nn
import numpy as np

from mlx_lattice import ops
from mlx_lattice._errors import MlxLatticeError
from mlx_lattice._files import replacing
from mlx_lattice.tensor import SparseTensor

__all__ = [
    "DIGEST_KEY",
    "FORMAT",
    "READABLE_VERSIONS",
    "VERSION",
    "ExportError",
    "ExportedModel",
    "export_model",
    "load",
    "lower",
]

#: The metadata key and ``format`` value of the graph.
FORMAT = "mlx_lattice.graph"
#: The metadata key of the SHA-256 digest over the graph and the tensors.
DIGEST_KEY = "mlx_lattice.digest"
#: The graph format's version that :func:`export_model` writes.
VERSION = 2
#: The versions :func:`load` reads (1: float MinkUNet graphs, no digest).
READABLE_VERSIONS = (1, 2)

_CONV_OPS = ("subm_conv", "conv", "conv_transpose")
_OPS_V1 = (*_CONV_OPS, "batch_norm", "cat", "linear")
_OPS = (*_OPS_V1, "voxels", "to_points", "to_voxels", "add")
_KIND = {"subm_conv": "subm", "conv": "conv", "conv_transpose": "transpose"}


class ExportError(MlxLatticeError):
    """A model cannot be exported, a path cannot be written or read, or a
    file is not a valid artifact (the message says which part). An
    :class:`~mlx_lattice.MlxLatticeError` (a ``ValueError``)."""


# -- export -------------------------------------------------------------------------------


def _int_list(values: Sequence[int] | None) -> list[int] | None:
    return None if values is None else [int(v) for v in values]


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[dict[str, Any]] = []
        self.tensors: dict[str, mx.array] = {}
        self._count = 0

    def tensor(self, name: str, array: mx.array) -> str:
        self.tensors[name] = array
        return name

    def add(self, op: str, inputs: list[str], **attrs: Any) -> str:
        self._count += 1
        out = f"v{self._count}"
        self.nodes.append({"op": op, "inputs": inputs, "output": out, **attrs})
        return out

    def conv(self, layer: mlx_nn.Module, path: str, x: str) -> str:
        from mlx_lattice import nn

        plain = (nn.SubMConv3d, nn.Conv3d, nn.ConvTranspose3d, nn.QuantizedConv)
        if type(layer) not in plain:
            raise ExportError(
                f"{path}: {type(layer).__name__} is not in the export vocabulary (SubMConv3d, "
                "Conv3d, ConvTranspose3d and their QuantizedConv)."
            )
        c = layer.config
        if c.eps is not None or c.kind not in ("subm", "conv", "transpose"):
            raise ExportError(f"{path}: a {c.kind} convolution is not in the export vocabulary.")
        op = {"subm": "subm_conv", "conv": "conv", "transpose": "conv_transpose"}[c.kind]
        bias = self.tensor(f"{path}.bias", layer.bias) if "bias" in layer else None
        attrs: dict[str, Any] = {
            "weight": self.tensor(f"{path}.weight", layer.weight),
            "bias": bias,
            "in_channels": c.in_channels,
            "out_channels": c.out_channels,
            "kernel_size": list(c.kernel_size),
            "stride": list(c.stride),
            "dilation": list(c.dilation),
            "padding": _int_list(c.padding),
        }
        if isinstance(layer, nn.QuantizedConv):
            q = layer.quantization
            attrs["quant"] = {
                "bits": q.bits,
                "group_size": q.group_size,
                "storage_in_channels": q.storage_in_channels,
                "act_bits": q.act_bits,
                "act_static": q.act_static,
                "scales": self.tensor(f"{path}.scales", layer.scales),
                "biases": self.tensor(f"{path}.biases", layer.biases),
                "act_scale": self.tensor(f"{path}.act_scale", layer.act_scale)
                if q.act_static
                else None,
            }
            if q.act_static and float(layer.act_scale.item()) == 0.0:
                raise ExportError(
                    f"{path}: its static activation scale is not calibrated (run "
                    "mlx_lattice.calibrate_activation_scales before exporting)."
                )
        return self.add(op, [x], **attrs)

    def linear(self, layer: mlx_nn.Module, path: str, x: str) -> str:
        from mlx_lattice import nn

        if type(layer) not in (nn.Linear, nn.QuantizedLinear):
            raise ExportError(
                f"{path}: {type(layer).__name__} is not in the export vocabulary "
                "(mlx_lattice.nn.Linear and QuantizedLinear)."
            )
        bias = self.tensor(f"{path}.bias", layer.bias) if "bias" in layer else None
        attrs: dict[str, Any] = {
            "weight": self.tensor(f"{path}.weight", layer.weight),
            "bias": bias,
        }
        if isinstance(layer, nn.QuantizedLinear):
            q = layer.quantization
            attrs["in_channels"], attrs["out_channels"] = layer.in_features, layer.out_features
            attrs["quant"] = {
                "bits": q.bits,
                "group_size": q.group_size,
                "storage_in_channels": q.storage_in_channels,
                "act_bits": q.act_bits,
                "act_static": False,
                "scales": self.tensor(f"{path}.scales", layer.scales),
                "biases": self.tensor(f"{path}.biases", layer.biases),
                "act_scale": None,
            }
        else:
            attrs["out_channels"], attrs["in_channels"] = (int(d) for d in layer.weight.shape)
        return self.add("linear", [x], **attrs)

    def norm(self, norm: mlx_nn.Module, path: str, x: str, relu: bool) -> str:
        if not isinstance(norm, mlx_nn.BatchNorm) or "running_mean" not in norm:
            raise ExportError(f"{path}: only batch norms with running statistics are exported.")
        names = {
            key: self.tensor(f"{path}.{key}", norm[key])
            for key in ("weight", "bias", "running_mean", "running_var")
            if key in norm
        }
        return self.add(
            "batch_norm",
            [x],
            eps=float(norm.eps),
            momentum=float(norm.momentum),
            relu=relu,
            num_features=int(norm.running_mean.shape[0]),
            affine="weight" in norm,
            **names,
        )

    def units(self, stage: mlx_nn.Module, path: str, x: str) -> str:
        for i in range(stage.depth):
            suffix = "" if i == 0 else str(i + 1)
            x = self.conv(stage["conv" + suffix], f"{path}.conv{suffix}", x)
            x = self.norm(stage["norm" + suffix], f"{path}.norm{suffix}", x, relu=True)
        return x

    def encoder(self, stage: mlx_nn.Module, path: str, x: str) -> str:
        x = self.conv(stage.down, f"{path}.down", x)
        x = self.norm(stage.down_norm, f"{path}.down_norm", x, relu=True)
        return self.units(stage, path, x)

    def decoder(self, stage: mlx_nn.Module, path: str, x: str, skip: str) -> str:
        x = self.conv(stage.up, f"{path}.up", x)
        x = self.norm(stage.up_norm, f"{path}.up_norm", x, relu=True)
        return self.units(stage, path, self.add("cat", [x, skip]))

    def point_mlp(self, branch: mlx_nn.Module, path: str, z: str) -> str:
        z = self.linear(branch.linear, f"{path}.linear", z)
        return self.norm(branch.norm, f"{path}.norm", z, relu=True)


def _lower_minkunet(model: mlx_nn.Module) -> _Builder:
    """MinkUNet.__call__ as graph nodes, in its order of operations."""
    b = _Builder()
    x = b.units(model.stem, "stem", "input")
    skips = []
    for i, stage in enumerate(model.encoder.stages()):
        skips.append(x)
        x = b.encoder(stage, f"encoder.block{i + 1}", x)
    for i, stage in enumerate(model.decoder.stages()):
        x = b.decoder(stage, f"decoder.block{i + 1}", x, skips.pop())
    b.linear(model.head, "head", x)
    return b


def _lower_spvcnn(model: mlx_nn.Module) -> _Builder:
    """SPVCNN.__call__ as graph nodes: the voxel U-Net with the point branch
    (devoxelize to the points, point MLPs, voxelize back) and the point head."""
    b = _Builder()
    x = b.units(model.stem, "stem", b.add("voxels", ["input"]))
    z0 = b.add("to_points", [x])
    x = b.add("to_voxels", [x, z0])
    skips = []
    for i, stage in enumerate(model.encoder.stages()):
        skips.append(x)
        x = b.encoder(stage, f"encoder.block{i + 1}", x)
    z1 = b.add("add", [b.add("to_points", [x]), b.point_mlp(model.point.mlp1, "point.mlp1", z0)])
    x = b.add("to_voxels", [x, z1])
    for i, stage in enumerate(model.decoder.stages()):
        x = b.decoder(stage, f"decoder.block{i + 1}", x, skips.pop())
    z2 = b.add("add", [b.add("to_points", [x]), b.point_mlp(model.point.mlp2, "point.mlp2", z1)])
    b.linear(model.head, "head", z2)
    return b


def _tensor_bytes(a: mx.array) -> bytes:
    flat = a.reshape(-1)
    return np.array(flat.view(mx.uint8)).tobytes() if flat.size else b""


def _digest(graph_json: str, tensors: Mapping[str, mx.array]) -> str:
    """SHA-256 over the graph's JSON text and every tensor (name, dtype,
    shape, bytes), in name order."""
    h = hashlib.sha256(graph_json.encode())
    for name in sorted(tensors):
        a = tensors[name]
        h.update(f"\0{name}\0{a.dtype}\0{tuple(a.shape)}\0".encode())
        h.update(_tensor_bytes(a))
    return h.hexdigest()


def _check_path_for_writing(path: str | os.PathLike[str]) -> Path:
    try:
        out = Path(os.fspath(path))
    except TypeError:
        raise ExportError(
            f"path must be a str or os.PathLike, got {type(path).__name__}."
        ) from None
    if out.is_dir():
        raise ExportError(f"path: {os.fspath(out)!r} is a directory, not a file name.")
    parent = out.parent
    if not parent.is_dir():
        raise ExportError(f"path: the directory {os.fspath(parent)!r} does not exist.")
    if not os.access(parent, os.W_OK):
        raise ExportError(f"path: the directory {os.fspath(parent)!r} is not writable.")
    return out


def _write(out: Path, tensors: Mapping[str, mx.array], metadata: Mapping[str, str]) -> None:
    """Write the safetensors file at ``out`` whatever its suffix: MLX picks
    the format by suffix (and appends ``.safetensors``), so the file is
    written next to ``out`` under a temporary ``.safetensors`` name and
    renamed onto it (a reader never sees half a file)."""
    try:
        with replacing(out, ".safetensors") as tmp:
            mx.save_safetensors(tmp, dict(tensors), metadata=dict(metadata))
    except (OSError, RuntimeError, ValueError) as err:
        raise ExportError(f"path: cannot write {os.fspath(out)!r} ({err}).") from None


def _check_names(value: Sequence[str] | None, what: str, count: int, counted: str) -> list | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [n.strip() for n in value.split(",")]
    names = list(value)
    if not all(isinstance(n, str) and n.strip() and n == n.strip() for n in names):
        raise ExportError(
            f"{what} must be non-empty strings without surrounding spaces, got {names!r}."
        )
    if len(names) != count:
        raise ExportError(f"{what} has {len(names)} names, the model has {count} {counted}.")
    if what == "features" and len(set(names)) != len(names):
        raise ExportError(f"features must be distinct, got {names!r}.")
    return names


def lower(
    model: mlx_nn.Module,
    *,
    voxel_size: float | None = None,
    features: Sequence[str] | str | None = None,
    class_names: Sequence[str] | None = None,
) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """The graph (as :func:`export_model` writes it) and the tensors of a
    :class:`~mlx_lattice.models.MinkUNet` or
    :class:`~mlx_lattice.models.SPVCNN`, without writing a file; arguments
    as :func:`export_model`'s. Raises :class:`ExportError` naming a layer
    outside the vocabulary.

    >>> from mlx_lattice.models import MinkUNet
    >>> graph, tensors = lower(MinkUNet(2, 3, widths=(4, 8)))
    >>> [node["op"] for node in graph["nodes"]][:3], graph["version"]
    (['subm_conv', 'batch_norm', 'conv'], 2)
    """
    from mlx_lattice.models import SPVCNN, MinkUNet

    if type(model) is MinkUNet:
        builder, kind = _lower_minkunet(model), "voxels"
    elif type(model) is SPVCNN:
        builder, kind = _lower_spvcnn(model), "points"
    else:
        raise ExportError(f"model must be a MinkUNet or an SPVCNN, got {type(model).__name__}.")
    if voxel_size is not None and not (
        isinstance(voxel_size, int | float)
        and not isinstance(voxel_size, bool)
        and math.isfinite(voxel_size)
        and voxel_size > 0
    ):
        raise ExportError(f"voxel_size must be a positive finite number, got {voxel_size!r}.")
    feature_names = _check_names(features, "features", model.in_channels, "input channels")
    classes = _check_names(class_names, "class_names", model.num_classes, "classes")
    graph = {
        "format": FORMAT,
        "version": VERSION,
        "model": type(model).__name__,
        "input_kind": kind,
        "in_channels": model.in_channels,
        "num_classes": model.num_classes,
        "voxel_size": None if voxel_size is None else float(voxel_size),
        "features": feature_names,
        "class_names": classes,
        "input": "input",
        "output": builder.nodes[-1]["output"],
        "nodes": builder.nodes,
    }
    return graph, builder.tensors


def export_model(
    model: mlx_nn.Module,
    path: str | os.PathLike[str],
    *,
    voxel_size: float | None = None,
    features: Sequence[str] | str | None = None,
    class_names: Sequence[str] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``model`` (a :class:`~mlx_lattice.models.MinkUNet` or
    :class:`~mlx_lattice.models.SPVCNN`, float or quantized by
    :func:`mlx_lattice.quantize`) to ``path`` as one safetensors file: its
    weights (quantized ones as packed codes, scales and biases), running
    statistics and calibrated activation scales, and the graph of its
    ``eval()`` forward pass (see the module docstring).

    The file is written at ``path`` exactly, whatever its suffix, replacing
    a file there. ``voxel_size`` (metres per voxel) is stored for
    :meth:`ExportedModel.predict_points`; ``features`` names the input
    feature channels in order (a list or a comma-separated string, e.g.
    ``"occupancy,height,intensity"``; one per input channel) and
    ``class_names`` the output classes (one per class); ``metadata`` adds
    string entries to the file's metadata.

    Raises:
        ExportError: a layer outside the vocabulary (named), an uncalibrated
            static activation scale, a bad argument, or a ``path`` that is a
            directory or cannot be written.

    The model is not changed; the artifact always runs in inference mode.
    """
    graph, tensors = lower(model, voxel_size=voxel_size, features=features, class_names=class_names)
    extra = dict(metadata or {})
    for key, value in extra.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ExportError("metadata must map strings to strings.")
        if key in (FORMAT, DIGEST_KEY):
            raise ExportError(f"metadata must not set the reserved key {key!r}.")
    out = _check_path_for_writing(path)
    graph_json = json.dumps(graph)
    mx.eval(list(tensors.values()))
    meta = {**extra, FORMAT: graph_json, DIGEST_KEY: _digest(graph_json, tensors)}
    _write(out, tensors, meta)


# -- load ---------------------------------------------------------------------------------


def _fail(i: int, node: Any, message: str) -> ExportError:
    op = node.get("op") if isinstance(node, dict) else None
    return ExportError(f"file: node {i} ({op}): {message}")


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _triple(node: dict, key: str, i: int, low: int, *, optional: bool = False) -> None:
    value = node.get(key)
    if optional and value is None:
        return
    if not (isinstance(value, list) and len(value) == 3 and all(_is_int(v, low) for v in value)):
        raise _fail(i, node, f"{key} must be three ints >= {low}, got {value!r}.")


def _tensor(
    node: dict,
    key: str,
    i: int,
    tensors: Mapping[str, mx.array],
    *,
    shape: tuple | None = None,
    optional: bool = False,
) -> None:
    name = node.get(key)
    if name is None and optional:
        return
    if not isinstance(name, str) or name not in tensors:
        raise _fail(i, node, f"needs tensor {name!r} ({key}), absent from the file.")
    a = tensors[name]
    if shape is not None and tuple(a.shape) != shape:
        raise _fail(
            i, node, f"tensor {name!r} ({key}) has shape {tuple(a.shape)}, expected {shape}."
        )
    packed = key == "weight" and "quant" in node  # uint32 codes, checked by the caller
    if not packed and a.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        raise _fail(i, node, f"tensor {name!r} ({key}) has dtype {a.dtype}, not a float.")


def _check_quant(
    node: dict, i: int, tensors: Mapping[str, mx.array], cin: int, cout: int, kernels: int
) -> None:
    from mlx_lattice.core.quantized import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

    q = node["quant"]
    if not isinstance(q, dict):
        raise _fail(i, node, f"quant must be an object, got {q!r}.")
    bits, group, storage = q.get("bits"), q.get("group_size"), q.get("storage_in_channels")
    act_bits, static = q.get("act_bits"), q.get("act_static")
    if bits not in SUPPORTED_BITS or group not in SUPPORTED_GROUP_SIZES:
        raise _fail(i, node, f"quant bits {bits!r} / group_size {group!r} are not supported.")
    if not _is_int(storage, cin) or storage % group:
        raise _fail(
            i, node, f"quant storage_in_channels {storage!r} is not a multiple of {group} >= {cin}."
        )
    if act_bits is not None and not (_is_int(act_bits) and 2 <= act_bits <= 8):
        raise _fail(i, node, f"quant act_bits {act_bits!r} is not None or 2..8.")
    if not isinstance(static, bool) or (static and (act_bits is None or node["op"] == "linear")):
        raise _fail(i, node, f"quant act_static {static!r} does not fit this layer.")
    lead = () if kernels == 0 else (kernels,)
    packed = (*lead, cout, storage * bits // 32)
    groups = (*lead, cout, storage // group)
    _tensor(node, "weight", i, tensors, shape=packed)
    if tensors[node["weight"]].dtype != mx.uint32:
        raise _fail(
            i, node, f"the packed weight must be uint32, got {tensors[node['weight']].dtype}."
        )
    _tensor(q | {"op": node["op"]}, "scales", i, tensors, shape=groups)
    _tensor(q | {"op": node["op"]}, "biases", i, tensors, shape=groups)
    if static:
        _tensor(q | {"op": node["op"]}, "act_scale", i, tensors, shape=())
        value = float(tensors[q["act_scale"]].astype(mx.float32).item())
        if not (math.isfinite(value) and value > 0):
            raise _fail(i, node, f"static activation scale {value!r} is not finite and > 0.")
    elif q.get("act_scale") is not None:
        raise _fail(i, node, "an act_scale without act_static.")


def _check_graph(graph: Any, tensors: Mapping[str, mx.array]) -> None:
    """Every node: a known op, inputs made before they are read and of the
    right kind (voxels or points) and width, tensors present with the
    shapes the attributes imply."""
    if not isinstance(graph, dict) or graph.get("format") != FORMAT:
        raise ExportError(f"file: the {FORMAT!r} metadata is not a graph of this format.")
    version = graph.get("version")
    if version not in READABLE_VERSIONS:
        raise ExportError(
            f"file: graph version {version!r}; this mlx_lattice reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))} (a newer version wrote it?)."
        )
    nodes = graph.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ExportError("file: the graph has no nodes.")
    kind = graph.get("input_kind", "voxels")
    if kind not in ("voxels", "points"):
        raise ExportError(f"file: input_kind {kind!r} is not 'voxels' or 'points'.")
    known_ops = _OPS_V1 if version == 1 else _OPS
    # value name -> (kind, channels); None channels: not known yet (v1 input).
    values: dict[Any, tuple[str, int | None]] = {
        graph.get("input"): ("input" if kind == "points" else "voxels", graph.get("in_channels"))
    }
    for i, node in enumerate(nodes):
        if not isinstance(node, dict) or node.get("op") not in known_ops:
            op = node.get("op") if isinstance(node, dict) else node
            raise ExportError(f"file: node {i} has op {op!r}, not one of {known_ops}.")
        op = node["op"]
        inputs = node.get("inputs")
        if not isinstance(inputs, list):
            raise _fail(i, node, f"inputs must be a list, got {inputs!r}.")
        for name in inputs:
            if not isinstance(name, str) or name not in values:
                raise ExportError(f"file: node {i} ({op}) reads {name!r} before it is made.")
        args = [values[name] for name in inputs]
        arity = {"cat": 2, "add": 2, "to_voxels": 2}.get(op, 1)
        if len(args) != arity:
            raise _fail(i, node, f"takes {arity} input(s), got {len(args)}.")
        out = node.get("output")
        if not isinstance(out, str) or out in values:
            raise _fail(i, node, f"output {out!r} is not a new value name.")
        values[out] = _check_node(i, node, args, tensors, kind)
    output = graph.get("output")
    if output not in values:
        raise ExportError("file: the graph's output is never made.")
    out_kind, out_channels = values[output]
    expected = "points" if kind == "points" else "voxels"
    if out_kind != expected:
        raise ExportError(f"file: the graph's output is {out_kind}, expected {expected}.")
    if graph.get("num_classes") is not None and out_channels != graph.get("num_classes"):
        raise ExportError(
            f"file: the graph's output has {out_channels} channels, num_classes is "
            f"{graph.get('num_classes')!r}."
        )


def _width(
    i: int, node: dict, arg: tuple[str, int | None], kinds: tuple[str, ...], channels: int | None
) -> None:
    if arg[0] not in kinds:
        raise _fail(i, node, f"reads {arg[0]}, expected {' or '.join(kinds)}.")
    if arg[1] is not None and channels is not None and arg[1] != channels:
        raise _fail(i, node, f"reads {arg[1]} channels, its tensors take {channels}.")


def _check_node(
    i: int, node: dict, args: list, tensors: Mapping[str, mx.array], kind: str
) -> tuple[str, int | None]:
    op = node["op"]
    if op in _CONV_OPS:
        _triple(node, "kernel_size", i, 1)
        _triple(node, "stride", i, 1)
        _triple(node, "dilation", i, 1)
        _triple(node, "padding", i, 0, optional=True)
        if max(node["kernel_size"]) > 7:
            raise _fail(i, node, f"kernel_size {node['kernel_size']} is over 7.")
        if op == "subm_conv" and (node["stride"] != [1, 1, 1] or node.get("padding") is not None):
            raise _fail(i, node, "a submanifold convolution has stride 1 and no padding.")
        k = node["kernel_size"]
        volume = k[0] * k[1] * k[2]
        weight = tensors.get(node.get("weight")) if isinstance(node.get("weight"), str) else None
        if "quant" in node:
            cin, cout = node.get("in_channels"), node.get("out_channels")
            if not (_is_int(cin, 1) and _is_int(cout, 1)):
                raise _fail(i, node, "in_channels and out_channels must be ints >= 1.")
            _check_quant(node, i, tensors, cin, cout, volume)
        else:
            if weight is None:
                raise _fail(
                    i, node, f"needs tensor {node.get('weight')!r} (weight), absent from the file."
                )
            if weight.ndim != 5 or tuple(weight.shape[1:4]) != tuple(k):
                raise _fail(
                    i,
                    node,
                    f"weight has shape {tuple(weight.shape)}, expected "
                    f"(Cout, {k[0]}, {k[1]}, {k[2]}, Cin).",
                )
            cout, cin = int(weight.shape[0]), int(weight.shape[4])
            _tensor(node, "weight", i, tensors)
            for key, value in (("in_channels", cin), ("out_channels", cout)):
                if node.get(key, value) != value:
                    raise _fail(
                        i, node, f"{key} {node.get(key)!r} does not match the weight's {value}."
                    )
        _tensor(node, "bias", i, tensors, shape=(cout,), optional=True)
        _width(i, node, args[0], ("voxels",), cin)
        return ("voxels", cout)
    if op == "linear":
        if "quant" in node:
            cin, cout = node.get("in_channels"), node.get("out_channels")
            if not (_is_int(cin, 1) and _is_int(cout, 1)):
                raise _fail(i, node, "in_channels and out_channels must be ints >= 1.")
            _check_quant(node, i, tensors, cin, cout, 0)
        else:
            _tensor(node, "weight", i, tensors)
            weight = tensors[node["weight"]]
            if weight.ndim != 2:
                raise _fail(
                    i, node, f"weight has shape {tuple(weight.shape)}, expected (Cout, Cin)."
                )
            cout, cin = int(weight.shape[0]), int(weight.shape[1])
        _tensor(node, "bias", i, tensors, shape=(cout,), optional=True)
        _width(i, node, args[0], ("voxels", "points"), cin)
        return (args[0][0], cout)
    if op == "batch_norm":
        n = node.get("num_features")
        if not _is_int(n, 1):
            raise _fail(i, node, f"num_features must be an int >= 1, got {n!r}.")
        for key in ("eps", "momentum"):
            v = node.get(key)
            if (
                not isinstance(v, int | float)
                or isinstance(v, bool)
                or not (math.isfinite(v) and v >= 0)
            ):
                raise _fail(i, node, f"{key} must be a finite number >= 0, got {v!r}.")
        if not isinstance(node.get("relu"), bool) or not isinstance(node.get("affine"), bool):
            raise _fail(i, node, "relu and affine must be booleans.")
        for key in ("running_mean", "running_var"):
            _tensor(node, key, i, tensors, shape=(n,))
        for key in ("weight", "bias"):
            _tensor(node, key, i, tensors, shape=(n,), optional=not node["affine"])
            if not node["affine"] and node.get(key) is not None:
                raise _fail(i, node, f"a non-affine norm with a {key}.")
        _width(i, node, args[0], ("voxels", "points"), n)
        return (args[0][0], n)
    if op == "cat":
        for arg in args:
            _width(i, node, arg, ("voxels",), None)
        a, b = args[0][1], args[1][1]
        return ("voxels", None if a is None or b is None else a + b)
    if kind != "points":
        raise _fail(i, node, "a point op in a graph whose input is not points.")
    if op == "voxels":
        _width(i, node, args[0], ("input",), None)
        return ("voxels", args[0][1])
    if op == "to_points":
        _width(i, node, args[0], ("voxels",), None)
        return ("points", args[0][1])
    if op == "to_voxels":
        _width(i, node, args[0], ("voxels",), None)
        _width(i, node, args[1], ("points",), args[0][1])
        return ("voxels", args[0][1])
    # add
    _width(i, node, args[0], ("points",), None)
    _width(i, node, args[1], ("points",), args[0][1])
    return ("points", args[0][1])


# -- run ----------------------------------------------------------------------------------


def _norm(node: dict[str, Any], tensors: Mapping[str, mx.array]) -> mlx_nn.BatchNorm:
    norm = mlx_nn.BatchNorm(
        node["num_features"], eps=node["eps"], momentum=node["momentum"], affine=node["affine"]
    )
    for key in ("weight", "bias", "running_mean", "running_var"):
        if node.get(key) is not None:
            norm[key] = tensors[node[key]]
    return norm.eval()


def _quantized_weight(node: dict[str, Any], t: Mapping[str, mx.array]) -> Any:
    """The quantized node's :class:`~mlx_lattice.core.quantized.QuantizedWeight`
    from the graph's tensors (the op-by-op layer and the compiled graph's step)."""
    from mlx_lattice.core.quantized import QuantizedWeight

    q = node["quant"]
    return QuantizedWeight(
        t[node["weight"]],
        t[q["scales"]],
        t[q["biases"]],
        node["in_channels"],
        node["out_channels"],
        q["storage_in_channels"],
        q["group_size"],
        q["bits"],
    )


def _conv_layer(node: dict[str, Any], t: Mapping[str, mx.array]) -> Callable:
    """The node's convolution: a float one through :mod:`mlx_lattice.ops`
    (as the float layers call it), a quantized one as the
    :class:`~mlx_lattice.nn.QuantizedConv` the model held."""
    from mlx_lattice import nn

    op = node["op"]
    bias = None if node.get("bias") is None else t[node["bias"]]
    kernel, stride = tuple(node["kernel_size"]), tuple(node["stride"])
    dilation = tuple(node["dilation"])
    padding = None if node.get("padding") is None else tuple(node["padding"])
    q = node.get("quant")
    if q is None:
        weight = t[node["weight"]]
        if op == "subm_conv":
            return lambda x: ops.subm_conv3d(x, weight, bias, dilation=dilation, kernel_size=kernel)
        fn = ops.conv3d if op == "conv" else ops.conv_transpose3d
        return lambda x: fn(
            x, weight, bias, stride=stride, padding=padding, dilation=dilation, kernel_size=kernel
        )
    cin, cout = node["in_channels"], node["out_channels"]
    config = nn.ConvConfig(cin, cout, kernel, stride, dilation, _KIND[op], padding)
    layer = nn.QuantizedConv(config, _quantized_weight(node, t), bias, q["act_bits"], q["act_static"])
    if q["act_static"]:
        layer.act_scale = t[q["act_scale"]]
    return layer


def _linear_layer(node: dict[str, Any], t: Mapping[str, mx.array]) -> Callable:
    """The node's linear layer as the :class:`~mlx_lattice.nn.Linear` or
    :class:`~mlx_lattice.nn.QuantizedLinear` the model held (so plain point
    arrays take the same route: native GEMM or MLX matmul)."""
    from mlx_lattice import nn

    bias = None if node.get("bias") is None else t[node["bias"]]
    q = node.get("quant")
    if q is None:
        layer = nn.Linear.__new__(nn.Linear)
        mlx_nn.Module.__init__(layer)  # no random initial weights drawn
        layer.weight = t[node["weight"]]
        if bias is not None:
            layer.bias = bias
        return layer
    settings = nn.QuantSettings(q["group_size"], q["bits"], q["storage_in_channels"], q["act_bits"])
    return nn.QuantizedLinear(
        node["in_channels"],
        node["out_channels"],
        t[node["weight"]],
        t[q["scales"]],
        t[q["biases"]],
        bias,
        settings,
    )


def _norm_layer(node: dict[str, Any], t: Mapping[str, mx.array]) -> Callable:
    from mlx_lattice.nn import batch_norm_features

    norm, relu = _norm(node, t), node["relu"]

    def run(x: SparseTensor | mx.array) -> SparseTensor | mx.array:
        if isinstance(x, SparseTensor):
            return x.replace(batch_norm_features(norm, x.feats, relu=relu))
        return batch_norm_features(norm, x, relu=relu).astype(x.dtype)

    return run


def _epilogue(node: dict[str, Any], t: Mapping[str, mx.array], layer: Callable) -> Callable:
    """``layer``, then the node's epilogue if it has one (a compiled graph's
    folded norm: its bias and ReLU in one pass, :func:`~mlx_lattice.fused.bias_relu`)."""
    from mlx_lattice.fused import bias_relu

    epilogue = node.get("epilogue")
    if epilogue is None:
        return layer
    bias, relu = t[epilogue["bias"]], bool(epilogue["relu"])

    def run(x: SparseTensor | mx.array) -> SparseTensor | mx.array:
        y = layer(x)
        if isinstance(y, SparseTensor):
            return y.replace(bias_relu(y.feats, bias, relu=relu))
        return bias_relu(y, bias, relu=relu)

    return run


def _build(graph: dict[str, Any], t: Mapping[str, mx.array]) -> list[Callable]:
    steps: list[Callable] = []
    f32 = mx.float32
    for i, node in enumerate(graph["nodes"]):
        op = node["op"]
        try:
            if op in _CONV_OPS:
                steps.append(_epilogue(node, t, _conv_layer(node, t)))
            elif op == "linear":
                steps.append(_epilogue(node, t, _linear_layer(node, t)))
            elif op == "batch_norm":
                steps.append(_norm_layer(node, t))
            elif op == "cat":
                steps.append(ops.cat)
            elif op == "voxels":
                steps.append(lambda inp: inp.tensor)
            elif op == "to_points":
                steps.append(lambda inp, x: inp.to_points(x, f32))
            elif op == "to_voxels":
                steps.append(lambda inp, x, z: inp.to_voxels(x, z))
            else:  # add
                steps.append(lambda a, b: a + b)
        except (MlxLatticeError, ValueError, TypeError, KeyError) as err:
            raise _fail(i, node, f"cannot build its layer ({err}).") from None
    return steps


_POINT_OPS = ("to_points", "to_voxels")


@dataclass(frozen=True)
class ExportedModel:
    """A loaded artifact.

    For a voxel model (MinkUNet) ``model(x)`` runs its graph on a sparse
    tensor; for every model :meth:`predict_points` scores points.
    ``graph`` is the parsed graph, ``tensors`` its weights, ``metadata`` the
    file's other metadata entries; :attr:`features`, :attr:`voxel_size` and
    :attr:`class_names` are what the model was exported with.
    """

    graph: dict[str, Any]
    tensors: dict[str, mx.array]
    metadata: dict[str, str]
    _steps: list[Callable] = field(default_factory=list, repr=False, compare=False)

    @property
    def model_type(self) -> str:
        """``"MinkUNet"`` or ``"SPVCNN"``: the architecture that was exported."""
        return str(self.graph.get("model"))

    @property
    def features(self) -> tuple[str, ...] | None:
        """The input features' names, in channel order (``None``: not declared)."""
        names = self.graph.get("features")
        return None if names is None else tuple(names)

    @property
    def class_names(self) -> tuple[str, ...] | None:
        """The output classes' names (``None``: not declared)."""
        names = self.graph.get("class_names")
        return None if names is None else tuple(names)

    @property
    def voxel_size(self) -> float | None:
        """The voxel size given at export (``None``: pass it to :meth:`predict_points`)."""
        return self.graph.get("voxel_size")

    @property
    def in_channels(self) -> int | None:
        """Input feature channels (``None`` for a version 1 file)."""
        return self.graph.get("in_channels")

    @property
    def compiled(self) -> bool:
        """Whether this is a compiled inference graph (:func:`mlx_lattice.compile`:
        norms folded into the convolutions, fused epilogues) rather than the
        artifact's op-for-op interpretation of the ``eval()`` forward pass."""
        return bool(self.graph.get("compiled", False))

    def _values(self, x: Any) -> dict[str, Any]:
        """Every value the graph makes on ``x``, by name (the input included)."""
        if not self._steps:  # built directly rather than by load()
            self._steps.extend(_build(self.graph, self.tensors))
        values: dict[str, Any] = {self.graph["input"]: x}
        for node, step in zip(self.graph["nodes"], self._steps, strict=True):
            args = [values[name] for name in node["inputs"]]
            if node["op"] in _POINT_OPS:  # the point-voxel maps live on the input
                args.insert(0, x)
            values[node["output"]] = step(*args)
        return values

    def _run(self, x: Any) -> Any:
        return self._values(x)[self.graph["output"]]

    def __call__(self, x: SparseTensor) -> SparseTensor:
        """The graph's output on the sparse tensor ``x`` (inference mode);
        voxel models only (an SPVCNN scores points: :meth:`predict_points`)."""
        if self.graph.get("input_kind", "voxels") != "voxels":
            raise ExportError(
                f"x: a {self.model_type} artifact scores points; call predict_points(points, "
                "features)."
            )
        if not isinstance(x, SparseTensor):
            raise ExportError(f"x must be a SparseTensor, got {type(x).__name__}.")
        self._check_channels("x", x.num_channels)
        return self._run(x)

    def _check_channels(self, name: str, channels: int) -> None:
        expected = self.in_channels
        if expected is not None and channels != expected:
            named = "" if self.features is None else f" ({','.join(self.features)})"
            raise ExportError(
                f"{name} has {channels} feature channels, the model takes {expected}{named}."
            )

    def predict_points(
        self,
        points: np.ndarray | mx.array,
        features: np.ndarray | mx.array,
        *,
        voxel_size: float | None = None,
    ) -> mx.array:
        """Per-point class scores ``(P, num_classes)`` for ``(P, 3)`` points
        with ``(P, C)`` features (one batch).

        The points are voxelized at the voxel size stored in the artifact,
        or ``voxel_size`` when none was stored (one given here must then
        match the stored one). An SPVCNN returns its point head's scores;
        a voxel model scores the voxels (features averaged per voxel) and
        every point gets its voxel's scores.

        >>> import tempfile, os
        >>> from mlx_lattice.models import SPVCNN
        >>> path = os.path.join(tempfile.mkdtemp(), "spvcnn.mlxl")
        >>> export_model(SPVCNN(2, 3, widths=(4, 8)).eval(), path, voxel_size=0.25)
        >>> pts = np.random.default_rng(0).uniform(0, 2, (50, 3)).astype(np.float32)
        >>> load(path).predict_points(pts, np.ones((50, 2), np.float32)).shape
        (50, 3)
        """
        from mlx_lattice._pointcloud import point_cloud_input

        stored = self.voxel_size
        if stored is not None and voxel_size is not None and float(voxel_size) != stored:
            raise ExportError(
                f"voxel_size: the artifact was exported for voxel size {stored}, got {voxel_size!r}."
            )
        size = stored if stored is not None else voxel_size
        if size is None:
            raise ExportError("voxel_size: the artifact stores none; pass voxel_size=.")
        if (
            isinstance(size, bool)
            or not isinstance(size, int | float)
            or not (math.isfinite(size) and size > 0)
        ):
            raise ExportError(f"voxel_size must be a positive finite number, got {size!r}.")
        pts = np.asarray(points, np.float32)
        if pts.ndim != 2 or pts.shape[1] != 3:
            raise ExportError(f"points must be (P, 3), got shape {pts.shape}.")
        feats = features if isinstance(features, mx.array) else mx.array(np.asarray(features))
        if feats.ndim != 2 or int(feats.shape[0]) != len(pts):
            raise ExportError(
                f"features must be ({len(pts)}, C) (one row per point), got {tuple(feats.shape)}."
            )
        if feats.dtype not in (mx.float32, mx.float16, mx.bfloat16):
            raise ExportError(f"features must be float32, float16 or bfloat16, got {feats.dtype}.")
        self._check_channels("features", int(feats.shape[1]))
        if len(pts) == 0:
            raise ExportError("points: no points to score.")
        if not np.isfinite(pts).all():
            raise ExportError("points: not all coordinates are finite.")
        inp = point_cloud_input(pts, feats, float(size))
        if self.graph.get("input_kind") == "points":
            return self._run(inp)
        scores = self._run(inp.tensor).feats
        return mx.take(scores, inp.voxels.point_to_voxel, axis=0)


def _read(name: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    if not Path(name).is_file():
        raise ExportError(f"path: {name!r} is not a file.")
    try:
        tensors, metadata = mx.load(name, format="safetensors", return_metadata=True)
    except Exception as err:  # MLX raises several types for damaged files
        raise ExportError(f"path: cannot read {name!r} as safetensors ({err}).") from None
    if not isinstance(tensors, dict) or not isinstance(metadata, dict):
        raise ExportError(f"path: {name!r} is not a safetensors file of named tensors.")
    return tensors, metadata


def load(path: str | os.PathLike[str], *, compiled: bool = False) -> ExportedModel:
    """Read an artifact written by :func:`export_model` (any suffix).

    By default the model runs the file's graph op for op, as the exported
    model's ``eval()`` forward pass (bit for bit); ``compiled=True`` returns
    its compiled inference graph instead (:func:`mlx_lattice.compile`: each
    batch norm folded into the convolution or linear layer before it, bias
    and ReLU fused into one epilogue pass), which is computed from the
    file's tensors when it is loaded, so every version this reads compiles.

    Raises:
        ExportError: the path is not a readable safetensors file, has no
            graph, its version is not one of :data:`READABLE_VERSIONS` (the
            message names it), the digest does not match (a damaged or edited
            file), or the graph is inconsistent: unknown ops, values read
            before they are made, missing tensors or tensors whose shapes do
            not fit their layer (the message names the node).
    """
    try:
        name = os.fspath(path)
    except TypeError:
        raise ExportError(
            f"path must be a str or os.PathLike, got {type(path).__name__}."
        ) from None
    tensors, metadata = _read(name)
    if FORMAT not in metadata:
        raise ExportError(f"path: {name!r} has no {FORMAT!r} metadata.")
    graph_json = metadata[FORMAT]
    try:
        graph = json.loads(graph_json)
    except json.JSONDecodeError as err:
        raise ExportError(f"file: the graph is not valid JSON ({err}).") from None
    version = graph.get("version") if isinstance(graph, dict) else None
    if version in READABLE_VERSIONS and version >= 2:
        try:
            digest = _digest(graph_json, tensors)
        except Exception as err:
            raise ExportError(f"file: the tensors cannot be read ({err}).") from None
        if digest != metadata.get(DIGEST_KEY):
            raise ExportError(
                f"file: {name!r}: the digest does not match the graph and tensors: the file was "
                "damaged or edited after it was exported."
            )
    _check_graph(graph, tensors)
    rest = {k: v for k, v in metadata.items() if k not in (FORMAT, DIGEST_KEY)}
    model = ExportedModel(graph=graph, tensors=dict(tensors), metadata=rest)
    if compiled:
        from mlx_lattice.inference import compile as compile_graph

        return compile_graph(model)
    model._steps.extend(_build(graph, model.tensors))
    return model
