"""One-file ``jax.export`` artifacts of (quantized) NNX models.

The file is a NumPy ``.npz`` archive (a zip with a CRC per member):

- ``meta``: UTF-8 JSON, ``{"format": "taktiny_ops.jax_export", "version": 1,
  "weights": [{"name", "dtype", "shape", "encoding"}, ...], "input": {...},
  "layers": [...], "platforms": [...], "matmul_precision": ...}`` (the last
  two are informational: files written before they existed load the same);
- ``module``: the bytes of ``jax.export.Exported.serialize()``, a StableHLO
  module whose first arguments are the weights (in ``meta`` order) and whose
  last is the input, with a symbolic batch axis, lowered for each of
  ``platforms`` (it runs on any of them);
- ``w0``, ``w1``, ...: each weight as ``uint8`` bytes. ``encoding`` is
  ``"raw"`` (the dtype's bytes, little-endian) or ``"nibbles"`` (int4/uint4
  packed two to a byte, low nibble first).

Weights are what the model holds: a PTQ layer's packed integer values and
its scales, float kernels elsewhere. Loading needs only JAX and NumPy (see
:data:`LOADER`); :func:`load_model` is the same loader with checks.

The module fixes the precision of its float matmuls when it is exported
(asking for another when loading changes nothing): ``export_model`` traces
under ``jax.default_matmul_precision(matmul_precision)``, ``"highest"`` by
default, so that float32 products are float32 products on every backend (a
TPU's default rounds float32 operands to bfloat16). Integer contractions
(w8a8) are exact either way.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from taktiny_ops import _pallas_blocks
from taktiny_ops._common import TaktinyOpsError

__all__ = ["FORMAT", "FORMAT_VERSION", "LOADER", "ArtifactError", "export_model", "load_model"]

#: The ``format`` field of an artifact's ``meta``.
FORMAT = "taktiny_ops.jax_export"
#: The artifact format version this taktiny_ops writes and reads.
FORMAT_VERSION = 1

#: A loader in plain JAX and NumPy: ``load(path)`` returns the model as a function.
LOADER = '''\
import json
import jax
import numpy as np

def load(path):
    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes())
        assert meta["format"] == "taktiny_ops.jax_export" and meta["version"] == 1
        exported = jax.export.deserialize(bytearray(z["module"].tobytes()))
        weights = []
        for w in meta["weights"]:
            data, dtype = z[w["name"]], jax.numpy.dtype(w["dtype"])
            if w["encoding"] == "nibbles":  # two 4-bit values per byte, low first
                n = int(np.prod(w["shape"]))
                data = np.stack([data & 15, data >> 4], axis=-1).reshape(-1)[:n]
                if dtype.name == "int4":
                    data = (data.astype(np.int8) ^ 8) - 8  # sign-extend
                data = data.astype(dtype)
            else:
                data = data.view(dtype)
            weights.append(jax.numpy.asarray(data.reshape(w["shape"])))  # on the device once
    run = jax.jit(exported.call)  # traced once: a bare exported.call re-traces every call
    return lambda x: run(*weights, x)
'''


class ArtifactError(TaktinyOpsError):
    """A file that is not a readable taktiny_ops JAX artifact of a supported version."""


def _encode(array: np.ndarray) -> tuple[np.ndarray, str]:
    if array.dtype.name in ("int4", "uint4"):
        nibbles = array.astype(np.int8).reshape(-1).view(np.uint8) & 15
        if nibbles.size % 2:
            nibbles = np.concatenate([nibbles, np.zeros(1, np.uint8)])
        return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8), "nibbles"
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8), "raw"


def _decode(data: np.ndarray, spec: dict) -> np.ndarray:
    dtype = jnp.dtype(spec["dtype"])
    shape = tuple(spec["shape"])
    count = int(np.prod(shape, dtype=np.int64))
    if spec["encoding"] == "nibbles":
        if data.size != (count + 1) // 2:
            raise ArtifactError(f"weight {spec['name']}: {data.size} bytes for {count} nibbles")
        values = np.stack([data & 15, data >> 4], axis=-1).reshape(-1)[:count]
        if dtype.name == "int4":
            values = (values.astype(np.int8) ^ 8) - 8
        return values.astype(dtype).reshape(shape)
    if spec["encoding"] != "raw" or data.size != count * dtype.itemsize:
        raise ArtifactError(
            f"weight {spec['name']}: {data.size} bytes do not hold {shape} {dtype.name} "
            f"({spec['encoding']!r} encoding)"
        )
    return data.view(dtype).reshape(shape)


#: The platforms :func:`export_model` lowers for unless told otherwise.
PLATFORMS = ("cpu", "tpu")
_PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")


def export_model(model: nnx.Module, example_input: Any, path: str | os.PathLike, *,
                 batch_axis: int = 0, platforms: Sequence[str] = PLATFORMS,
                 matmul_precision: str = "highest") -> int:
    """Write ``model`` (any NNX model, typically quantized) as one ``jax.export`` file.

    The model's forward pass on inputs like ``example_input`` is exported
    with a symbolic size for ``batch_axis``, so the artifact runs any batch
    size; the weights travel as the model holds them (a PTQ layer's packed
    integer values and scales). Returns the file's size in bytes. The format
    is described in this module's docstring; :data:`LOADER` loads it with
    only JAX and NumPy, and :func:`load_model` does the same with checks.

    The module is lowered for each of ``platforms`` (JAX platform names, by
    default CPU and TPU, whichever backend exports), and its float matmuls
    run at ``matmul_precision`` (a ``jax.default_matmul_precision`` value,
    ``"highest"`` by default: float32 products on every backend). Loaded on
    the backend that exported it, the artifact returns bit for bit what the
    model returns in one jitted program under that precision; on another
    backend, within the bounds of docs/topics/export.rst.

    Writing (and reading) needs the ``flatbuffers`` package, which
    ``jax.export`` uses to serialize; the wheel requires it.

    Raises:
        ImportError: ``flatbuffers`` is not installed.
        TaktinyOpsError: ``example_input`` has no axis ``batch_axis``, the
            model cannot be traced with a symbolic batch size, or
            ``platforms`` / ``matmul_precision`` is not a valid value.
        ArtifactError: the model cannot be lowered for one of ``platforms``
            (e.g. a layer runs a Pallas TPU kernel and ``platforms`` names
            ``"cpu"``); the message names the layers that chose a Pallas
            kernel.

    A model quantized with ``kernels='pallas'`` exports for
    ``platforms=("tpu",)``, from any host: its layers' Pallas kernels are
    lowered to Mosaic (never to their interpreted twin) and keep the batch
    symbolic, taking the block table's large-M blocks (a batch smaller than
    a block is padded to one; export with ``kernels='qwix'`` for small
    batches, or for an artifact that also runs on the CPU).

    >>> import tempfile, quantrules as qr
    >>> from taktiny_ops import Linear, quantize
    >>> class Head(nnx.Module):
    ...     def __init__(self):
    ...         self.fc = Linear(8, 4, rngs=nnx.Rngs(0))
    ...     def __call__(self, x):
    ...         return self.fc(x)
    >>> model = Head()
    >>> _ = quantize(model, qr.Rule(weight_qtype="int8"))
    >>> path = tempfile.mkdtemp() + "/head.tkjax"
    >>> export_model(model, jnp.ones((2, 8)), path) > 0
    True
    >>> with jax.default_matmul_precision("highest"):  # the model's jitted program
    ...     y = nnx.jit(lambda m, x: m(x))(model, jnp.ones((5, 8)))
    >>> bool((load_model(path)(jnp.ones((5, 8))) == y).all())
    True
    """
    x = jnp.asarray(example_input)
    if not -x.ndim <= batch_axis < x.ndim:
        raise TaktinyOpsError(
            f"batch_axis: {batch_axis} is not an axis of example_input of shape {x.shape}"
        )
    batch_axis %= x.ndim
    if (isinstance(platforms, str) or not platforms
            or not all(isinstance(p, str) and p for p in platforms)):
        raise TaktinyOpsError(
            f"platforms: expected a non-empty sequence of JAX platform names such as "
            f"('cpu', 'tpu'), got {platforms!r}")
    platforms = tuple(dict.fromkeys(p.lower() for p in platforms))
    if matmul_precision not in _PRECISIONS:
        raise TaktinyOpsError(
            f"matmul_precision: expected one of {', '.join(map(repr, _PRECISIONS))}, "
            f"got {matmul_precision!r}")
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    leaves = [np.asarray(leaf) for leaf in leaves]

    def forward(*args: Any) -> Any:
        *weights, inputs = args
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))(inputs)

    (batch,) = jax.export.symbolic_shape("batch")
    shape = list(x.shape)
    shape[batch_axis] = batch
    specs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
    try:
        # Pallas kernels lower to Mosaic (never their interpreted twin): the
        # artifact runs the TPU kernel, and a platform other than 'tpu' refuses it.
        with jax.default_matmul_precision(matmul_precision), _pallas_blocks.mosaic():
            exported = jax.export.export(jax.jit(forward), platforms=platforms)(
                *specs, jax.ShapeDtypeStruct(tuple(shape), x.dtype))
    except Exception as err:  # lowering rules raise many types (NotImplementedError, MLIR...)
        raise _export_error(model, platforms, batch_axis, err) from err
    arrays: dict[str, np.ndarray] = {}
    weights = []
    for i, leaf in enumerate(leaves):
        data, encoding = _encode(leaf)
        arrays[f"w{i}"] = data
        weights.append({"name": f"w{i}", "dtype": leaf.dtype.name, "shape": list(leaf.shape),
                        "encoding": encoding})
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "weights": weights,
        "input": {"shape": [None if i == batch_axis else d for i, d in enumerate(x.shape)],
                  "dtype": x.dtype.name, "batch_axis": batch_axis},
        "layers": _layers(model),
        "platforms": list(platforms),
        "matmul_precision": matmul_precision,
        "jax_version": jax.__version__,
    }
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    arrays["module"] = np.frombuffer(bytes(_serialize(exported)), np.uint8)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())
    return len(buffer.getvalue())


def _export_error(model: nnx.Module, platforms: tuple[str, ...], batch_axis: int,
                  err: Exception) -> TaktinyOpsError:
    """The error for a model that jax.export refused: an ArtifactError naming
    the layers that chose a Pallas kernel (it lowers for the TPU only), else a
    TaktinyOpsError for a trace that failed (TypeError/ValueError: usually
    the symbolic batch size), else an ArtifactError for a platform's lowering."""
    first = (str(err).strip().splitlines() or [""])[0]
    pallas = [f"{layer['path']} ({layer['kernel']})" for layer in _layers(model)
              if layer["kernel"] != "qwix"]
    if pallas:
        others = [p for p in platforms if p != "tpu"]
        why = (f"which cannot lower for {', '.join(others)} (a Pallas TPU kernel lowers for "
               f"'tpu' only); export with platforms=('tpu',) or quantize with kernels='qwix'"
               if others else "which failed to lower; quantize with kernels='qwix' to export")
        return ArtifactError(
            f"platforms: cannot lower for {', '.join(platforms)}: layer(s) {', '.join(pallas)} "
            f"run a Pallas TPU kernel, {why} ({type(err).__name__}: {first})")
    if isinstance(err, TypeError | ValueError):
        return TaktinyOpsError(
            f"model: cannot export with a symbolic batch axis {batch_axis} for "
            f"{', '.join(platforms)}: {err}")
    return ArtifactError(
        f"platforms: cannot lower the model for {', '.join(platforms)} "
        f"({type(err).__name__}: {first})")


def _serialize(exported: Any) -> bytearray:
    try:
        return exported.serialize()
    except ImportError as err:  # jax.export's serialization needs the flatbuffers package
        raise ImportError(f"taktiny_ops.export_model: {err}") from err


def _layers(model: nnx.Module) -> list[dict[str, Any]]:
    """Each quantized layer's path and rule, for people reading the file."""
    out = []
    for keys, node in nnx.iter_graph(model):
        resolution = getattr(node, "resolution", None)
        if isinstance(node, nnx.Module) and resolution is not None:
            rule = resolution.rule
            out.append({"path": "/".join(map(str, keys)), "mode": resolution.mode,
                        "rule": resolution.index, "weight_qtype": rule.weight_qtype,
                        "act_qtype": rule.act_qtype, "tile_size": rule.tile_size,
                        "kernel": getattr(node, "matmul_kernel", "qwix")})
    return sorted(out, key=lambda layer: layer["path"])


def load_model(path: str | os.PathLike) -> Callable[[Any], Any]:
    """Load an :func:`export_model` artifact as a function of the input.

    The same steps as :data:`LOADER` (plain JAX and NumPy), with every check
    a damaged or foreign file needs.

    Raises:
        ArtifactError: the file is not a zip archive, a member is damaged
            (CRC) or missing, ``meta`` is not this format, the version is
            not one this reader supports, a weight does not match its
            declared shape and dtype, or the module was not lowered for this
            process's default backend.
        FileNotFoundError: no file at ``path``.
    """
    try:
        with np.load(path, allow_pickle=False) as z:
            names = set(z.files)
            for required in ("meta", "module"):
                if required not in names:
                    raise ArtifactError(f"{path}: not a taktiny_ops JAX artifact (no {required!r})")
            meta = json.loads(z["meta"].tobytes())
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise ArtifactError(f"{path}: not a taktiny_ops JAX artifact")
            if meta.get("version") != FORMAT_VERSION:
                raise ArtifactError(
                    f"{path}: format version {meta.get('version')!r}; this taktiny_ops reads "
                    f"version {FORMAT_VERSION}"
                )
            module = bytearray(z["module"].tobytes())
            weights = []
            for spec in meta["weights"]:
                if spec["name"] not in names:
                    raise ArtifactError(f"{path}: weight {spec['name']!r} is missing")
                weights.append(_decode(z[spec["name"]], spec))
    except (zipfile.BadZipFile, zlib.error, ValueError, KeyError, TypeError, EOFError,
            OSError) as err:
        if isinstance(err, ArtifactError | FileNotFoundError):
            raise
        raise ArtifactError(f"{path}: damaged or not a taktiny_ops JAX artifact: {err}") from None
    try:
        exported = jax.export.deserialize(module)
    except ImportError as err:  # jax.export's serialization needs the flatbuffers package
        raise ImportError(f"taktiny_ops.load_model: {err}") from err
    except Exception as err:  # flatbuffer and MLIR errors share no narrower type
        raise ArtifactError(f"{path}: the StableHLO module cannot be read: {err}") from None
    backend = jax.default_backend()
    if backend not in exported.platforms:
        raise ArtifactError(
            f"{path}: lowered for {', '.join(exported.platforms)}; this process runs {backend} "
            f"(export with platforms=(..., {backend!r}), or run with JAX_PLATFORMS set to one "
            f"of those)")
    if len(exported.in_avals) != len(weights) + 1:
        raise ArtifactError(
            f"{path}: the module takes {len(exported.in_avals) - 1} weights, the file has "
            f"{len(weights)}"
        )
    for spec, weight, aval in zip(meta["weights"], weights, exported.in_avals, strict=False):
        if weight.shape != aval.shape or weight.dtype != aval.dtype:
            raise ArtifactError(
                f"{path}: weight {spec['name']} is {weight.shape} {weight.dtype}, the module "
                f"expects {aval.shape} {aval.dtype}"
            )
    run = jax.jit(exported.call)  # traced once: a bare exported.call re-traces every call
    device_weights = [jnp.asarray(w) for w in weights]
    return lambda x: run(*device_weights, x)
