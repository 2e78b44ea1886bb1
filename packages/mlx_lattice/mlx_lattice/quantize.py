"""Rule-based weight quantization of sparse models, through quantrules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.nn as mlx_nn

import quantrules as qr
from mlx_lattice.nn import QuantizedConv, is_sparse_conv

__all__ = ["LayerQuantization", "QuantizationReport", "quantize"]

#: The quantrules op name of every sparse convolution layer.
SPARSE_CONV_OP = "sparse_conv"


@dataclass(frozen=True)
class LayerQuantization:
    """What :func:`quantize` did to one convolution layer."""

    path: str
    rule: str  # quantrules.explain summary
    bits: int | None  # None: kept in float
    group_size: int | None
    bytes_before: int
    bytes_after: int


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
        """Paths of the layers that were quantized."""
        return [layer.path for layer in self.layers if layer.bits is not None]

    def __str__(self) -> str:
        lines = [f"{'layer':32s} {'bits':>4s} {'group':>5s} {'bytes':>10s}  rule"]
        for layer in self.layers:
            bits = "-" if layer.bits is None else str(layer.bits)
            group = "-" if layer.group_size is None else str(layer.group_size)
            lines.append(
                f"{layer.path:32s} {bits:>4s} {group:>5s} {layer.bytes_after:>10d}  {layer.rule}"
            )
        lines.append(f"weights: {self.bytes_before} -> {self.bytes_after} bytes")
        return "\n".join(lines)


def _module_path(name: str) -> str:
    return name.replace(".", "/")


def quantize(model: mlx_nn.Module, quant: Any) -> QuantizationReport:
    """Quantize the convolution weights of ``model`` that ``quant``'s rules select, in place.

    ``quant`` is anything :func:`quantrules.resolve` accepts. Each convolution
    layer is resolved at its module path (``encoder/block1/conv`` for the
    module ``model.encoder.block1.conv``) for op ``sparse_conv``; a matching
    rule with a ``weight_qtype`` replaces the layer by a
    :class:`~mlx_lattice.nn.QuantizedConv` with the qtype's bits and the
    rule's ``tile_size`` as group size (MLX's default group size without
    one). Unmatched layers, and rules without a qtype, stay float. MLX
    quantizes weights only: ``act_qtype`` is not applied (the report's rule
    text shows it).

    Raises:
        quantrules.UnsupportedQTypeError: a selected qtype MLX cannot
            represent (float8, nf4) or a non-affine format.
    """
    report = QuantizationReport()
    replacements = []
    for name, module in reversed(model.named_modules()):  # definition order
        if not name or not is_sparse_conv(module):
            continue
        path = _module_path(name)
        summary = qr.explain(quant, module_path=path, op=SPARSE_CONV_OP).summary
        before = int(module.weight.nbytes)
        if isinstance(module, QuantizedConv):
            report.layers.append(
                LayerQuantization(
                    path,
                    summary + " (already quantized)",
                    module.quantization.bits,
                    module.quantization.group_size,
                    module.nbytes,
                    module.nbytes,
                )
            )
            continue
        res = qr.resolve(quant, module_path=path, op=SPARSE_CONV_OP)
        if res is None or res.disabled or res.rule.weight_qtype is None:
            report.layers.append(LayerQuantization(path, summary, None, None, before, before))
            continue
        args = qr.get_qtype(res.rule.weight_qtype).mlx_quantize_args(res.rule.tile_size)
        if args["mode"] != "affine":
            raise qr.UnsupportedQTypeError(
                f"{path}: qtype {res.rule.weight_qtype!r} uses MLX mode {args['mode']!r}; sparse "
                "convolutions support affine integer qtypes (int2..int8, uint4, uint8)."
            )
        layer = QuantizedConv.from_conv(module, bits=args["bits"], group_size=args["group_size"])
        replacements.append((name, layer))
        report.layers.append(
            LayerQuantization(path, summary, args["bits"], args["group_size"], before, layer.nbytes)
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
