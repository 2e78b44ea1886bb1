"""Rule-based quantization of whole sparse models, through quantrules.

Convolution layers resolve for op ``sparse_conv``, linear layers
(``mlx.nn.Linear`` and :class:`mlx_lattice.nn.Linear`) for op
``dot_general`` (as in ``taktiny_ops``), each at its ``/``-joined module path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import mlx.nn as mlx_nn

import quantrules as qr
from mlx_lattice.nn import QuantizedConv, QuantizedLinear, is_sparse_conv

__all__ = ["LINEAR_OP", "SPARSE_CONV_OP", "LayerQuantization", "QuantizationReport", "quantize"]

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
    makes the layer fake-quantize its input per row (symmetric, dynamic
    scale; :func:`mlx_lattice.nn.fake_quantize_rows`) before the quantized
    product; the report's ``act_bits`` and ``activations_quantized`` say so.
    The arithmetic stays in float. An act-only rule (no ``weight_qtype``)
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
        quantrules.RuleError: a selected rule sets ``act_static_scale`` or
            stochastic rounding (they need stored statistics or a key).
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
        for unsupported in rule.unsupported_stateless_fields():
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
                module, bits=args["bits"], group_size=args["group_size"], act_bits=act_bits
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
