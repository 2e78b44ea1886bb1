"""Rule-based quantization of whole sparse models, through quantrules.

Convolution layers resolve for op ``sparse_conv``, linear layers
(``mlx.nn.Linear`` and :class:`mlx_lattice.nn.Linear`) for op
``dot_general`` (as in ``taktiny_ops``), each at its ``/``-joined module path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import mlx.nn as mlx_nn

import quantrules as qr
from mlx_lattice._errors import MlxLatticeError
from mlx_lattice.nn import QuantizedConv, QuantizedLinear, calibrating_activations, is_sparse_conv

__all__ = [
    "LINEAR_OP",
    "SPARSE_CONV_OP",
    "LayerQuantization",
    "QuantizationReport",
    "calibrate_activation_scales",
    "quantize",
]

#: The quantrules op name of every sparse convolution layer.
SPARSE_CONV_OP = "sparse_conv"
#: The quantrules op name of every linear layer (as ``taktiny_ops``' dense ops).
LINEAR_OP = "dot_general"


@dataclass(frozen=True)
class LayerQuantization:
    """What :func:`quantize` did to one layer.

    ``bits`` is ``None`` when the weights stay float; ``act_bits`` is the
    activation fake-quantization (``None``: activations stay float);
    ``reason`` says why a selected rule was not applied (or is empty).
    """

    path: str
    rule: str  # quantrules.explain summary
    bits: int | None  # None: kept in float
    group_size: int | None
    bytes_before: int
    bytes_after: int
    op: str = SPARSE_CONV_OP
    act_bits: int | None = None
    reason: str = ""
    act_static: bool = False  # one calibrated activation scale (act_static_scale)


@dataclass
class QuantizationReport:
    """Per-layer decisions and the weight bytes before and after."""

    layers: list[LayerQuantization] = field(default_factory=list)

    @property
    def bytes_before(self) -> int:
        return sum(layer.bytes_before for layer in self.layers)

    @property
    def bytes_after(self) -> int:
        return sum(layer.bytes_after for layer in self.layers)

    @property
    def quantized(self) -> list[str]:
        """Paths of the layers whose weights were quantized."""
        return [layer.path for layer in self.layers if layer.bits is not None]

    @property
    def activations_quantized(self) -> list[str]:
        """Paths of the layers whose input activations are fake-quantized."""
        return [layer.path for layer in self.layers if layer.act_bits is not None]

    @property
    def skipped(self) -> dict[str, str]:
        """Layers a rule selected but that were left float, with the reason."""
        return {layer.path: layer.reason for layer in self.layers if layer.reason}

    def __str__(self) -> str:
        lines = [
            f"{'layer':32s} {'op':11s} {'bits':>4s} {'group':>5s} {'act':>4s} {'bytes':>10s}  rule"
        ]
        for layer in self.layers:
            bits = "-" if layer.bits is None else str(layer.bits)
            group = "-" if layer.group_size is None else str(layer.group_size)
            act = "-" if layer.act_bits is None else str(layer.act_bits)
            note = f"  [{layer.reason}]" if layer.reason else ""
            lines.append(
                f"{layer.path:32s} {layer.op:11s} {bits:>4s} {group:>5s} {act:>4s} "
                f"{layer.bytes_after:>10d}  {layer.rule}{note}"
            )
        acts = self.activations_quantized
        lines.append(
            f"weights: {self.bytes_before} -> {self.bytes_after} bytes; activations quantized: "
            + (f"{len(acts)} layer(s), int per-row dynamic fake-quantization" if acts else "no")
        )
        return "\n".join(lines)


def _module_path(name: str) -> str:
    return name.replace(".", "/")


def _act_bits(path: str, rule: qr.Rule) -> int | None:
    if rule.act_qtype is None:
        return None
    qtype = qr.get_qtype(rule.act_qtype)
    if qtype.kind != "integer" or not qtype.signed or qtype.bits > 8:
        raise qr.UnsupportedQTypeError(
            f"{path}: act_qtype {rule.act_qtype!r} is not supported; activations are "
            "fake-quantized to signed integers (int2..int8) only."
        )
    return qtype.bits


def _float_bytes(module: mlx_nn.Module) -> int:
    return int(module.weight.nbytes)


def quantize(model: mlx_nn.Module, quant: Any, *, allow_growth: bool = False) -> QuantizationReport:
    """Quantize the convolution and linear layers of ``model`` that ``quant``'s rules select, in place.

    ``quant`` is anything :func:`quantrules.resolve` accepts. Each layer is
    resolved at its module path (``encoder/block1/conv`` for the module
    ``model.encoder.block1.conv``): sparse convolutions for op
    ``sparse_conv``, linear layers for op ``dot_general``. A matching rule
    with a ``weight_qtype`` replaces the layer by a
    :class:`~mlx_lattice.nn.QuantizedConv` or
    :class:`~mlx_lattice.nn.QuantizedLinear` with the qtype's bits and the
    rule's ``tile_size`` as group size (MLX's default group size without one).

    Activations: a rule that also sets ``act_qtype`` (a signed integer qtype)
    makes the layer quantize its input per row (symmetric, dynamic scale)
    before the quantized product: int8 on the CPU runs the integer kernel,
    other widths and devices fake-quantize
    (:func:`mlx_lattice.nn.fake_quantize_rows`); the report's ``act_bits``
    and ``activations_quantized`` say so. With ``act_static_scale=True`` a
    convolution uses one static activation scale instead, which
    :func:`calibrate_activation_scales` records before use (the scale is an
    array of the layer, saved with the model). An act-only rule (no ``weight_qtype``)
    leaves the layer float, and the report gives that reason (as Qwix, which
    treats act-only rules as no-ops).

    Growth: quantized storage pads the input channels to a multiple of the
    group size, so a narrow layer (e.g. a ``Cin=1`` stem with group 64) can
    get *larger*. Such a layer is skipped, with the reason in the report,
    unless ``allow_growth=True``. Weight-normalized convolutions stay float.

    Raises:
        quantrules.UnsupportedQTypeError: a selected qtype MLX cannot
            represent (float8, nf4), a non-affine format, or an unsupported
            ``act_qtype``.
        quantrules.RuleError: a selected rule sets stochastic rounding (it
            needs a key), or ``act_static_scale`` on a linear layer.
    """
    report = QuantizationReport()
    replacements = []
    for name, module in reversed(model.named_modules()):  # definition order
        if not name:
            continue
        if is_sparse_conv(module):
            op = SPARSE_CONV_OP
        elif isinstance(module, mlx_nn.Linear | QuantizedLinear):
            op = LINEAR_OP
        else:
            continue
        path = _module_path(name)
        summary = qr.explain(quant, module_path=path, op=op).summary
        if isinstance(module, QuantizedConv | QuantizedLinear):
            q = module.quantization
            report.layers.append(
                LayerQuantization(
                    path,
                    summary + " (already quantized)",
                    q.bits,
                    q.group_size,
                    module.nbytes,
                    module.nbytes,
                    op,
                    q.act_bits,
                )
            )
            continue
        before = _float_bytes(module)
        res = qr.resolve(quant, module_path=path, op=op)

        kept = LayerQuantization(path, summary, None, None, before, before, op)
        if res is None or res.disabled:
            report.layers.append(kept)
            continue
        rule = res.rule
        act_static = bool(rule.act_static_scale) and op == SPARSE_CONV_OP
        for unsupported in rule.unsupported_stateless_fields():
            if unsupported == "act_static_scale" and act_static:
                continue  # a calibrated scale stored in the layer
            raise qr.RuleError(
                f"{path}: rule #{res.index} sets {unsupported}, which mlx_lattice.quantize does "
                "not support (it needs stored calibration statistics or a random key)."
            )
        act_bits = _act_bits(path, rule)
        if rule.weight_qtype is None:
            report.layers.append(
                replace(kept, reason="act-only rule: weights and activations stay float")
            )
            continue
        if op == SPARSE_CONV_OP and module.config.eps is not None:
            report.layers.append(replace(kept, reason="weight-normalized convolution: stays float"))
            continue
        args = qr.get_qtype(rule.weight_qtype).mlx_quantize_args(rule.tile_size)
        if args["mode"] != "affine":
            raise qr.UnsupportedQTypeError(
                f"{path}: qtype {rule.weight_qtype!r} uses MLX mode {args['mode']!r}; sparse "
                "layers support affine integer qtypes (int2..int8, uint4, uint8)."
            )
        if op == SPARSE_CONV_OP:
            layer = QuantizedConv.from_conv(
                module,
                bits=args["bits"],
                group_size=args["group_size"],
                act_bits=act_bits,
                act_static=act_static,
            )
        else:
            layer = QuantizedLinear.from_linear(
                module, bits=args["bits"], group_size=args["group_size"], act_bits=act_bits
            )
        if layer.nbytes > before and not allow_growth:
            report.layers.append(
                replace(
                    kept,
                    reason=f"skipped: {rule.weight_qtype} group {args['group_size']} would grow the weights "
                    f"from {before} to {layer.nbytes} bytes (input channels padded to the group "
                    "size); allow_growth=True overrides",
                )
            )
            continue
        replacements.append((name, layer))
        report.layers.append(
            LayerQuantization(
                path,
                summary,
                args["bits"],
                args["group_size"],
                before,
                layer.nbytes,
                op,
                act_bits,
                act_static=act_static,
            )
        )
    for name, layer in replacements:
        _replace(model, name, layer)
    return report


def _replace(model: mlx_nn.Module, name: str, layer: mlx_nn.Module) -> None:
    """Put ``layer`` at the dotted ``name`` (attributes and list indices)."""
    *parents, last = name.split(".")
    node: Any = model
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(last)] = layer
    elif isinstance(node, mlx_nn.Module):
        setattr(node, last, layer)
    else:  # a plain dict of layers
        node[last] = layer


def calibrate_activation_scales(
    model: mlx_nn.Module,
    batches: Iterable[Any],
    forward: Callable[[mlx_nn.Module, Any], Any] | None = None,
) -> dict[str, float]:
    """Set the static activation scale of every ``act_static`` layer of ``model``.

    Runs ``forward(model, batch)`` (default ``model(batch)``) for each batch,
    records the largest ``|x|`` each such :class:`~mlx_lattice.nn.QuantizedConv`
    sees at its input (the layers use dynamic scales meanwhile) and sets its
    ``act_scale`` to ``max|x| / (2**(act_bits-1) - 1)``. Returns the scales by
    module path.

    Raises:
        ValueError: no layer has a static scale, a layer saw no (or only
            zero) input, or an input was not finite.

    >>> import mlx_lattice.nn as nn
    >>> from mlx_lattice.tensor import SparseTensor
    >>> model = nn.Sequential(nn.SubMConv3d(32, 8))
    >>> rule = qr.Rule(weight_qtype="int8", act_qtype="int8", act_static_scale=True, tile_size=32)
    >>> _ = quantize(model, rule)
    >>> coords = mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32)
    >>> x = SparseTensor(coords, mx.full((2, 32), 2.54))
    >>> calibrate_activation_scales(model, [x])
    {'layers/0': 0.019999999552965164}
    """
    layers = {
        _module_path(name): module
        for name, module in model.named_modules()
        if isinstance(module, QuantizedConv) and module.quantization.act_static
    }
    if not layers:
        raise MlxLatticeError(
            "model has no layer with a static activation scale (quantize it with a rule that "
            "sets act_qtype and act_static_scale=True)."
        )
    with calibrating_activations(list(layers.values())) as maxima:
        seen = False
        for batch in batches:
            seen = True
            mx.eval(forward(model, batch) if forward is not None else model(batch))
        if not seen:
            raise MlxLatticeError("batches is empty: calibration needs at least one batch.")
        peaks = {path: maxima[id(layer)] for path, layer in layers.items()}
    scales = {}
    for path, layer in layers.items():
        if peaks[path] <= 0.0:
            raise MlxLatticeError(
                f"{path}: saw no non-zero input during calibration; its static scale is unset."
            )
        qmax = 2 ** (layer.quantization.act_bits - 1) - 1
        layer.act_scale = mx.array(peaks[path] / qmax, dtype=mx.float32)
        scales[path] = float(layer.act_scale.item())
    return scales
