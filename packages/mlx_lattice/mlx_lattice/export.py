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

Instead :func:`export_model` writes the weights as safetensors tensors and,
in the same file's metadata, a JSON graph over a fixed vocabulary of sparse
ops (``subm_conv``, ``conv``, ``conv_transpose``, ``batch_norm``, ``cat``,
``linear``). :func:`load` reads it back into an :class:`ExportedModel`, a
small interpreter that runs the graph with :mod:`mlx_lattice.ops` on any
coordinates, needing none of the Python classes that built the model. It
executes the same ops in the same order as the model's ``eval()`` forward
pass, so outputs match bit for bit.

Format (``format`` = ``mlx_lattice.graph``, ``version`` = 1): metadata key
``mlx_lattice.graph`` holds ``{"format", "version", "model", "input",
"output", "nodes"}``; each node is ``{"op", "inputs", "output", ...}`` with
its attributes and the names of its tensors in the file.

>>> import tempfile, os
>>> from mlx_lattice.models import MinkUNet
>>> from mlx_lattice.tensor import SparseTensor
>>> model = MinkUNet(2, 3, widths=(4, 8)).eval()
>>> coords = mx.array([[0, i, j, 0] for i in range(3) for j in range(3)], dtype=mx.int32)
>>> x = SparseTensor(coords, mx.ones((9, 2)))
>>> path = os.path.join(tempfile.mkdtemp(), "net.safetensors")
>>> export_model(model, path)
>>> net = load(path)
>>> bool(mx.array_equal(net(x).feats, model(SparseTensor(coords, mx.ones((9, 2)))).feats))
True
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as mlx_nn

from mlx_lattice import ops
from mlx_lattice.tensor import SparseTensor

__all__ = ["FORMAT", "VERSION", "ExportError", "ExportedModel", "export_model", "load"]

#: The metadata key and ``format`` value of the graph.
FORMAT = "mlx_lattice.graph"
#: The graph format's version.
VERSION = 1

_OPS = ("subm_conv", "conv", "conv_transpose", "batch_norm", "cat", "linear")


class ExportError(ValueError):
    """A model cannot be exported, or a file is not a valid artifact (the
    message says which part)."""


# -- export -------------------------------------------------------------------------------


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[dict[str, Any]] = []
        self.tensors: dict[str, mx.array] = {}
        self._count = 0

    def value(self) -> str:
        self._count += 1
        return f"v{self._count}"

    def tensor(self, name: str, array: mx.array) -> str:
        self.tensors[name] = array
        return name

    def add(self, op: str, inputs: list[str], **attrs: Any) -> str:
        out = self.value()
        self.nodes.append({"op": op, "inputs": inputs, "output": out, **attrs})
        return out

    def conv(self, layer: mlx_nn.Module, path: str, x: str) -> str:
        from mlx_lattice import nn

        if type(layer) not in (nn.SubMConv3d, nn.Conv3d, nn.ConvTranspose3d):
            raise ExportError(
                f"{path}: {type(layer).__name__} is not in the export vocabulary "
                "(plain SubMConv3d, Conv3d and ConvTranspose3d)."
            )
        c = layer.config
        if c.eps is not None or c.kind not in ("subm", "conv", "transpose"):
            raise ExportError(f"{path}: a {c.kind} convolution is not in the export vocabulary.")
        op = {"subm": "subm_conv", "conv": "conv", "transpose": "conv_transpose"}[c.kind]
        bias = self.tensor(f"{path}.bias", layer.bias) if "bias" in layer else None
        return self.add(
            op,
            [x],
            weight=self.tensor(f"{path}.weight", layer.weight),
            bias=bias,
            kernel_size=list(c.kernel_size),
            stride=list(c.stride),
            dilation=list(c.dilation),
            padding=None if c.padding is None else list(c.padding),
        )

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


def _lower_minkunet(model: mlx_nn.Module) -> _Builder:
    """MinkUNet.__call__ as graph nodes, in its order of operations."""
    b = _Builder()
    x = b.units(model.stem, "stem", "input")
    skips = []
    for i, stage in enumerate(model.encoder.stages()):
        path = f"encoder.block{i + 1}"
        skips.append(x)
        x = b.conv(stage.down, f"{path}.down", x)
        x = b.norm(stage.down_norm, f"{path}.down_norm", x, relu=True)
        x = b.units(stage, path, x)
    for i, stage in enumerate(model.decoder.stages()):
        path = f"decoder.block{i + 1}"
        x = b.conv(stage.up, f"{path}.up", x)
        x = b.norm(stage.up_norm, f"{path}.up_norm", x, relu=True)
        x = b.add("cat", [x, skips.pop()])
        x = b.units(stage, path, x)
    head = model.head
    bias = b.tensor("head.bias", head.bias) if "bias" in head else None
    b.add("linear", [x], weight=b.tensor("head.weight", head.weight), bias=bias)
    return b


def export_model(
    model: mlx_nn.Module, path: str | Path, *, metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``model`` (a :class:`mlx_lattice.models.MinkUNet`) to ``path`` as
    one safetensors file: its weights and running statistics, and the graph
    of its ``eval()`` forward pass (see the module docstring). ``metadata``
    adds string entries to the file's metadata.

    Quantized layers and layers outside the vocabulary raise
    :class:`ExportError` naming the layer. The model is not changed; the
    artifact always runs in inference mode.
    """
    from mlx_lattice.models import MinkUNet

    if type(model) is not MinkUNet:  # subclasses (SPVCNN) run other graphs
        raise ExportError(f"model must be a MinkUNet, got {type(model).__name__}.")
    builder = _lower_minkunet(model)
    graph = {
        "format": FORMAT,
        "version": VERSION,
        "model": type(model).__name__,
        "input": "input",
        "output": builder.nodes[-1]["output"],
        "nodes": builder.nodes,
    }
    extra = dict(metadata or {})
    if FORMAT in extra:
        raise ExportError(f"metadata must not set the reserved key {FORMAT!r}.")
    for key, value in extra.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ExportError("metadata must map strings to strings.")
    mx.save_safetensors(str(path), builder.tensors, metadata={**extra, FORMAT: json.dumps(graph)})


# -- load and run -------------------------------------------------------------------------


def _check_graph(graph: Any, tensors: Mapping[str, mx.array]) -> None:
    if not isinstance(graph, dict) or graph.get("format") != FORMAT:
        raise ExportError(f"file: the {FORMAT!r} metadata is not a graph of this format.")
    if graph.get("version") != VERSION:
        raise ExportError(f"file: graph version {graph.get('version')!r}, expected {VERSION}.")
    nodes = graph.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ExportError("file: the graph has no nodes.")
    known = {graph.get("input")}
    for i, node in enumerate(nodes):
        if not isinstance(node, dict) or node.get("op") not in _OPS:
            op = node.get("op") if isinstance(node, dict) else node
            raise ExportError(f"file: node {i} has op {op!r}, not one of {_OPS}.")
        for name in node.get("inputs", []):
            if name not in known:
                raise ExportError(
                    f"file: node {i} ({node['op']}) reads {name!r} before it is made."
                )
        for key in ("weight", "bias", "running_mean", "running_var"):
            name = node.get(key)
            if name is not None and name not in tensors:
                raise ExportError(f"file: node {i} ({node['op']}) needs tensor {name!r}, absent.")
        known.add(node.get("output"))
    if graph.get("output") not in known:
        raise ExportError("file: the graph's output is never made.")


def _norm(node: dict[str, Any], tensors: Mapping[str, mx.array]) -> mlx_nn.BatchNorm:
    norm = mlx_nn.BatchNorm(
        node["num_features"], eps=node["eps"], momentum=node["momentum"], affine=node["affine"]
    )
    for key in ("weight", "bias", "running_mean", "running_var"):
        if node.get(key) is not None:
            norm[key] = tensors[node[key]]
    return norm.eval()


@dataclass(frozen=True)
class ExportedModel:
    """A loaded artifact: ``model(x)`` runs its graph on a sparse tensor.

    ``graph`` is the parsed graph, ``tensors`` its weights, ``metadata`` the
    file's other metadata entries.
    """

    graph: dict[str, Any]
    tensors: dict[str, mx.array]
    metadata: dict[str, str]

    def __call__(self, x: SparseTensor) -> SparseTensor:
        """The graph's output on ``x`` (inference mode)."""
        from mlx_lattice.nn import batch_norm_features

        if not isinstance(x, SparseTensor):
            raise ExportError(f"x must be a SparseTensor, got {type(x).__name__}.")
        values: dict[str, SparseTensor] = {self.graph["input"]: x}
        t = self.tensors
        for node in self.graph["nodes"]:
            op, args = node["op"], [values[name] for name in node["inputs"]]
            bias = None if node.get("bias") is None else t[node["bias"]]
            if op == "subm_conv":
                out = ops.subm_conv3d(
                    args[0],
                    t[node["weight"]],
                    bias,
                    dilation=tuple(node["dilation"]),
                    kernel_size=tuple(node["kernel_size"]),
                )
            elif op in ("conv", "conv_transpose"):
                fn = ops.conv3d if op == "conv" else ops.conv_transpose3d
                out = fn(
                    args[0],
                    t[node["weight"]],
                    bias,
                    stride=tuple(node["stride"]),
                    padding=None if node["padding"] is None else tuple(node["padding"]),
                    dilation=tuple(node["dilation"]),
                    kernel_size=tuple(node["kernel_size"]),
                )
            elif op == "batch_norm":
                f = batch_norm_features(_norm(node, t), args[0].feats, relu=node["relu"])
                out = args[0].replace(f)
            elif op == "cat":
                out = ops.cat(*args)
            else:  # linear
                out = ops.linear(args[0], t[node["weight"]], bias)
            values[node["output"]] = out
        return values[self.graph["output"]]


def load(path: str | Path) -> ExportedModel:
    """Read an artifact written by :func:`export_model`. Files without the
    graph, of another version, or whose graph names missing tensors or
    unknown ops raise :class:`ExportError`."""
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
    except (OSError, RuntimeError, ValueError) as err:
        raise ExportError(f"path: cannot read {str(path)!r} as safetensors ({err}).") from None
    if not isinstance(tensors, dict) or FORMAT not in metadata:
        raise ExportError(f"path: {str(path)!r} has no {FORMAT!r} metadata.")
    try:
        graph = json.loads(metadata[FORMAT])
    except json.JSONDecodeError as err:
        raise ExportError(f"file: the graph is not valid JSON ({err}).") from None
    _check_graph(graph, tensors)
    rest = {k: v for k, v in metadata.items() if k != FORMAT}
    return ExportedModel(graph=graph, tensors=dict(tensors), metadata=rest)
