"""Model files: a model's weights with its configuration in one ``.safetensors`` file.

:func:`save_model` writes the arrays of a :class:`MinkUNet` or
:class:`SPVCNN` (float, or quantized by :func:`mlx_lattice.quantize`) and,
in the file's metadata, everything needed to rebuild it: the architecture
and its constructor arguments, the voxel size, the class names, the input
features, the quantization rules with the per-layer report, and the package
version. :func:`load_model` rebuilds the model from that alone.

The metadata also holds a SHA-256 digest over the configuration and every
array (name, dtype, shape, bytes): an edited configuration, a changed array
or a truncated file raises :class:`ModelFileError` (an ``MlxLatticeError``) instead
of loading a different model. (The digest detects accidents and edits, it
is not a signature.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as mlx_nn
import numpy as np
from mlx.utils import tree_flatten

import quantrules as qr
from mlx_lattice._errors import MlxLatticeError
from mlx_lattice._version import __version__
from mlx_lattice.data.segmentation import (
    DEFAULT_FEATURES,
    HEIGHT_SCALE,
    parse_features,
    point_feature_columns,
)
from mlx_lattice.models.minkunet import MinkUNet
from mlx_lattice.models.spvcnn import SPVCNN, PointCloudInput, point_cloud_input
from mlx_lattice.nn import QuantizedConv, QuantizedLinear
from mlx_lattice.quantize import QuantizationReport, quantize
from mlx_lattice.tensor import SparseTensor

__all__ = ["FORMAT", "ModelFileError", "SavedModel", "load_model", "point_features", "save_model"]

#: The metadata ``format`` value of files this module writes.
FORMAT = "mlx_lattice.model/1"
#: The input features of a model saved without ``features`` (see :func:`point_features`).
INPUT_FEATURES = ",".join(DEFAULT_FEATURES)
_ARCHITECTURES: dict[str, type[MinkUNet]] = {"MinkUNet": MinkUNet, "SPVCNN": SPVCNN}


class ModelFileError(MlxLatticeError):
    """A model file that is missing, truncated, edited or does not match its configuration.

    Part of the package's error family (an :class:`~mlx_lattice.MlxLatticeError`,
    itself a ``ValueError``).
    """


def point_features(points: np.ndarray) -> np.ndarray:
    """The per-point input features of a saved model: ``(P, 2)`` float32
    occupancy (1) and height ``z / HEIGHT_SCALE`` (as
    :func:`mlx_lattice.data.make_batch` averages per voxel).

    >>> point_features(np.array([[0, 0, 2.0]])).tolist()
    [[1.0, 0.5]]
    """
    pts = np.asarray(points, np.float64)
    return np.stack([np.ones(len(pts)), pts[:, 2] / HEIGHT_SCALE], axis=1).astype(np.float32)


@dataclass
class _VoxelInput:
    """A MinkUNet's input for one scan: the voxels and each point's voxel row."""

    tensor: SparseTensor
    point_to_voxel: np.ndarray


@dataclass
class SavedModel:
    """A loaded model (in ``eval()`` mode) and the configuration it was saved with."""

    model: MinkUNet
    architecture: str
    voxel_size: float
    class_names: tuple[str, ...]
    report: QuantizationReport | None
    rules: Any
    version: str
    metadata: dict[str, Any]
    #: The input features the model takes, in channel order.
    features: tuple[str, ...] = DEFAULT_FEATURES

    def prepare(
        self,
        points: np.ndarray,
        values: dict[str, np.ndarray] | None = None,
        *,
        source: str = "points",
    ) -> _VoxelInput | PointCloudInput:
        """The model's input for ``(P, 3)`` points of one scan (its ``tensor``
        holds the voxels), with the declared :attr:`features` built by
        :func:`~mlx_lattice.data.point_feature_columns` from the points and
        ``values`` (the file's per-point fields by name; a missing one
        raises naming the feature and ``source``)."""
        pts = np.asarray(points, np.float32)
        if pts.ndim != 2 or pts.shape[1] != 3 or len(pts) == 0:
            raise ValueError(f"points must be a non-empty (P, 3) array, got shape {pts.shape}.")
        if self.architecture == "SPVCNN":
            feats = point_feature_columns(pts, self.features, values, source=source)
            return point_cloud_input(pts, feats, self.voxel_size)
        from mlx_lattice.data.segmentation import _columns64, _voxel_means

        columns = _columns64(pts, self.features, values, source)
        tensor, inverse = _voxel_means([pts], [columns], self.voxel_size)
        return _VoxelInput(tensor, inverse.astype(np.int32))

    def predict(self, inp: _VoxelInput | PointCloudInput) -> np.ndarray:
        """The class index (into ``class_names``) of every point, ``(P,)`` int32."""
        if isinstance(inp, _VoxelInput):
            scores = self.model(inp.tensor).feats
            per_voxel = np.array(mx.argmax(scores, axis=1)).astype(np.int32)
            return per_voxel[inp.point_to_voxel]
        scores = self.model(inp)
        return np.array(mx.argmax(scores, axis=1)).astype(np.int32)


def _arrays(model: mlx_nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


def _digest(config_json: str, arrays: Mapping[str, mx.array]) -> str:
    h = hashlib.sha256(config_json.encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"\0{name}\0{a.dtype}\0{tuple(a.shape)}\0".encode())
        flat = a.reshape(-1)
        if flat.size:
            h.update(np.array(flat.view(mx.uint8)).tobytes())
    return h.hexdigest()


def _architecture(model: mlx_nn.Module) -> str:
    for name, cls in reversed(_ARCHITECTURES.items()):  # SPVCNN before its base MinkUNet
        if type(model) is cls:
            return name
    raise TypeError(f"model must be a MinkUNet or SPVCNN, got {type(model).__name__}.")


def _build(
    architecture: str, arguments: dict, rules: Any, allow_growth: bool
) -> tuple[MinkUNet, QuantizationReport | None]:
    model = _ARCHITECTURES[architecture](**arguments)
    report = quantize(model, rules, allow_growth=allow_growth) if rules is not None else None
    return model, report


def _layer_dicts(report: QuantizationReport | None) -> list[dict] | None:
    return None if report is None else [dataclasses.asdict(layer) for layer in report.layers]


def save_model(
    path: str | os.PathLike[str],
    model: MinkUNet,
    *,
    voxel_size: float,
    class_names: Sequence[str],
    rules: Any = None,
    allow_growth: bool = False,
    metadata: Mapping[str, Any] | None = None,
    features: str | Sequence[str] = DEFAULT_FEATURES,
) -> None:
    """Write ``model`` and its configuration to a ``.safetensors`` file.

    ``features`` names the model's input channels in order
    (``"occupancy,height,intensity"`` or a list; one per input channel; see
    :func:`~mlx_lattice.data.point_feature_columns`).

    ``rules`` are the rules the model was quantized with
    (:func:`mlx_lattice.quantize`; with its ``allow_growth``), ``None`` for a
    float model; the file is checked to load back into the same structure
    before it is written. ``metadata`` (JSON values) is stored as it is.

    >>> import tempfile
    >>> model = MinkUNet(2, 3, widths=(4, 8))
    >>> path = tempfile.mkdtemp() + "/m.safetensors"
    >>> save_model(path, model, voxel_size=0.5, class_names=["a", "b", "c"])
    >>> loaded = load_model(path)
    >>> loaded.architecture, loaded.voxel_size, loaded.class_names, loaded.model.widths
    ('MinkUNet', 0.5, ('a', 'b', 'c'), (4, 8))
    """
    architecture = _architecture(model)
    out = Path(path)
    if out.suffix != ".safetensors":
        raise ValueError(f"path must end in .safetensors, got {os.fspath(path)!r}.")
    if not (isinstance(voxel_size, int | float) and np.isfinite(voxel_size) and voxel_size > 0):
        raise ValueError(f"voxel_size must be a positive finite number, got {voxel_size!r}.")
    try:
        feature_names = parse_features(features)
    except MlxLatticeError as e:
        raise ValueError(str(e)) from None
    if len(feature_names) != model.in_channels:
        raise ValueError(
            f"features has {len(feature_names)} names, the model takes {model.in_channels} "
            "input channels."
        )
    names = tuple(str(n) for n in class_names)
    if len(names) != model.num_classes:
        raise ValueError(
            f"class_names has {len(names)} names, the model scores {model.num_classes} classes."
        )
    arguments = {
        "in_channels": model.in_channels,
        "num_classes": model.num_classes,
        "widths": list(model.widths),
        "depths": list(model.depths),
    }
    quantized = any(
        isinstance(m, QuantizedConv | QuantizedLinear) for _, m in model.named_modules()
    )
    if quantized and rules is None:
        raise ValueError(
            "model has quantized layers: pass the rules it was quantized with (rules=...)."
        )
    rules_config = None
    if rules is not None:
        plain = isinstance(rules, qr.Rule | list | tuple | qr.PtqProvider | qr.QtProvider)
        rules_config = qr.rules_to_config(rules if plain else qr.as_rules(rules)[0])
    replica, report = _build(architecture, arguments, rules, allow_growth)
    arrays = _arrays(model)
    expected = {k: (tuple(v.shape), str(v.dtype)) for k, v in _arrays(replica).items()}
    got = {k: (tuple(v.shape), str(v.dtype)) for k, v in arrays.items()}
    if expected != got:
        diff = sorted(set(expected.items()) ^ set(got.items()))[:3]
        raise ValueError(
            "model does not match a fresh model quantized with these rules (was it quantized with "
            f"other rules or allow_growth?); first differences: {diff}."
        )
    config = {
        "architecture": architecture,
        "arguments": arguments,
        "voxel_size": float(voxel_size),
        "class_names": list(names),
        "input_features": ",".join(feature_names),
        "height_scale": HEIGHT_SCALE,
        "quantization": None
        if rules is None
        else {
            "rules": rules_config,
            "allow_growth": bool(allow_growth),
            "layers": _layer_dicts(report),
        },
        "version": __version__,
        "metadata": dict(metadata or {}),
    }
    config_json = json.dumps(config, sort_keys=True)
    mx.save_safetensors(
        os.fspath(out),
        arrays,
        metadata={"format": FORMAT, "config": config_json, "digest": _digest(config_json, arrays)},
    )


def load_model(path: str | os.PathLike[str]) -> SavedModel:
    """Rebuild the model saved by :func:`save_model` (in ``eval()`` mode).

    Raises:
        ModelFileError: the file is missing, not a model file, truncated,
            its configuration or arrays were changed after saving, or its
            arrays do not fit the configured model.
    """
    name = os.fspath(path)
    if not Path(name).is_file():
        raise ModelFileError(f"{name}: no such file.")
    try:
        arrays, meta = mx.load(name, return_metadata=True)
    except Exception as e:
        raise ModelFileError(f"{name}: not a readable .safetensors file ({e}).") from None
    if not isinstance(arrays, dict) or meta.get("format") != FORMAT:
        raise ModelFileError(
            f"{name}: not an mlx_lattice model file (metadata format {meta.get('format')!r}, "
            f"expected {FORMAT!r}; plain weights load with model.load_weights)."
        )
    config_json = meta.get("config", "")
    try:
        digest = _digest(config_json, arrays)
    except Exception as e:
        raise ModelFileError(f"{name}: arrays cannot be read ({e}).") from None
    if digest != meta.get("digest"):
        raise ModelFileError(
            f"{name}: the digest does not match the configuration and arrays: the file was edited "
            "or damaged after it was saved."
        )
    try:
        config = json.loads(config_json)
        architecture = config["architecture"]
        arguments = config["arguments"]
        voxel_size = float(config["voxel_size"])
        class_names = tuple(config["class_names"])
        quant = config["quantization"]
        features = config["input_features"]
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFileError(f"{name}: bad configuration ({type(e).__name__}: {e}).") from None
    if architecture not in _ARCHITECTURES:
        raise ModelFileError(f"{name}: unknown architecture {architecture!r}.")
    if not (np.isfinite(voxel_size) and voxel_size > 0):
        raise ModelFileError(f"{name}: bad configuration (voxel_size {voxel_size!r}).")
    if not isinstance(arguments, dict) or len(class_names) != arguments.get("num_classes"):
        raise ModelFileError(
            f"{name}: bad configuration ({len(class_names)} class names for "
            f"{arguments.get('num_classes') if isinstance(arguments, dict) else '?'} classes)."
        )
    try:
        feature_names = parse_features(features)
    except (MlxLatticeError, AttributeError) as e:
        raise ModelFileError(f"{name}: bad input features {features!r} ({e}).") from None
    if len(feature_names) != arguments.get("in_channels") or config.get("height_scale") != HEIGHT_SCALE:
        raise ModelFileError(
            f"{name}: input features {features!r} (height scale {config.get('height_scale')!r}) do "
            f"not fit the model's {arguments.get('in_channels')!r} input channels and this "
            f"version's height scale {HEIGHT_SCALE}."
        )
    rules = None
    allow_growth = False
    if quant is not None:
        try:
            rules = qr.rules_from_config(quant["rules"], source=f"{name} (metadata)")
            allow_growth = bool(quant["allow_growth"])
        except (KeyError, TypeError, qr.QuantRulesError) as e:
            raise ModelFileError(f"{name}: bad quantization rules ({e}).") from None
    try:
        model, report = _build(architecture, arguments, rules, allow_growth)
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{name}: cannot build {architecture}({arguments}): {e}") from None
    if quant is not None and _layer_dicts(report) != quant.get("layers"):
        raise ModelFileError(
            f"{name}: the rules quantize the model differently from the saved report "
            "(another mlx_lattice version?)."
        )
    try:
        model.load_weights(list(arrays.items()), strict=True)
    except ValueError as e:
        detail = " ".join(str(e).split())  # MLX's message spans lines
        raise ModelFileError(
            f"{name}: arrays do not fit {architecture}({arguments}): {detail}"
        ) from None
    model.eval()
    return SavedModel(
        model,
        architecture,
        voxel_size,
        class_names,
        report,
        rules,
        str(config.get("version", "")),
        dict(config.get("metadata", {})),
        feature_names,
    )
