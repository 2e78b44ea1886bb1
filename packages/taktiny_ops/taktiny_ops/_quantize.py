"""Rule-based quantization of whole Flax NNX models, through quantrules.

The shape of ``mlx_lattice.quantize``: walk the module tree, resolve each
layer's rule at its ``/``-joined path (``mlp/fc1`` for ``model.mlp.fc1``),
swap the layer for its quantized form, and report what each layer got and
why (:func:`quantrules.explain`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
from flax import nnx

import quantrules
from taktiny_ops import _kernels as K
from taktiny_ops._common import TaktinyOpsError, canonical_rules, check_backend_support
from taktiny_ops._einsum import _plain_layout
from taktiny_ops._layers import (
    Conv,
    Einsum,
    Linear,
    QuantizedConv,
    QuantizedEinsum,
    QuantizedKernel,
    QuantizedLinear,
    _conv_config,
)

__all__ = ["LayerQuantization", "QuantizationReport", "quantize"]

_OPS = {
    Linear: "dot_general",
    nnx.Linear: "dot_general",
    Einsum: "einsum",
    nnx.Einsum: "einsum",
    Conv: "conv_general_dilated",
    nnx.Conv: "conv_general_dilated",
    QuantizedLinear: "dot_general",
    QuantizedEinsum: "einsum",
    QuantizedConv: "conv_general_dilated",
}
# Layers with a kernel that quantize() cannot swap: a rule that selects one raises.
_UNSUPPORTED = {
    nnx.LinearGeneral: "dot_general",
    nnx.ConvTranspose: "conv_general_dilated",
}


@dataclass(frozen=True)
class LayerQuantization:
    """What :func:`quantize` did to one layer.

    ``weight_qtype``/``act_qtype`` are ``None`` where that operand stays
    float; ``mode`` is ``'ptq'``, ``'qt'`` or ``'float'``; ``bytes_after``
    counts the kernel as held (packed integer values plus scales for PTQ).
    ``kernel`` is the matmul the layer runs: ``'float'`` (no quantizing
    rule), ``'qwix'`` (Qwix's program), ``'pallas-weight-only'`` or
    ``'pallas-w8a8'``; ``kernel_note`` says why a layer for which ``kernels=``
    asked for Pallas runs Qwix (empty otherwise).
    """

    path: str
    op: str
    layer: str  # the class of the layer found there
    rule: str  # quantrules.explain summary
    mode: str
    weight_qtype: str | None
    act_qtype: str | None
    tile_size: int | float | None
    bytes_before: int
    bytes_after: int
    kernel: str = "qwix"
    kernel_note: str = ""


@dataclass
class QuantizationReport:
    """Per-layer decisions and the kernel bytes before and after."""

    layers: list[LayerQuantization] = field(default_factory=list)

    @property
    def bytes_before(self) -> int:
        return sum(layer.bytes_before for layer in self.layers)

    @property
    def bytes_after(self) -> int:
        return sum(layer.bytes_after for layer in self.layers)

    @property
    def quantized(self) -> list[str]:
        """Paths of the layers that got a quantizing rule."""
        return [layer.path for layer in self.layers if layer.mode != "float"]

    def __str__(self) -> str:
        lines = [f"{'layer':24s} {'op':20s} {'mode':5s} {'weight':>7s} {'act':>7s} "
                 f"{'bytes':>9s}  {'kernel':18s}  rule"]
        for layer in self.layers:
            note = f" [Qwix: {layer.kernel_note}]" if layer.kernel_note else ""
            lines.append(
                f"{layer.path:24s} {layer.op:20s} {layer.mode:5s} "
                f"{layer.weight_qtype or '-':>7s} {layer.act_qtype or '-':>7s} "
                f"{layer.bytes_after:>9d}  {layer.kernel:18s}  {layer.rule}{note}"
            )
        lines.append(f"kernels: {self.bytes_before} -> {self.bytes_after} bytes")
        return "\n".join(lines)


def _path(keys: tuple) -> str:
    return "/".join(str(k) for k in keys)


def _kernel_bytes(kernel: Any) -> int:
    """Bytes as held: a QArray's values at their bit width plus its scales."""
    if isinstance(kernel, QuantizedKernel):
        q = kernel.get_value()
        bits = jnp.iinfo(q.qvalue.dtype).bits if jnp.issubdtype(q.qvalue.dtype, jnp.integer) \
            else jnp.finfo(q.qvalue.dtype).bits
        extra = sum(int(a.nbytes) for a in (q.scale, q.zero_point) if a is not None)
        return (q.qvalue.size * bits + 7) // 8 + extra
    return int(kernel[...].nbytes)


def _check_plain(path: str, layer: nnx.Module) -> None:
    """A plain nnx layer whose options the ops cannot reproduce is refused, by path."""
    defaults = {"dtype": None, "preferred_element_type": None, "mask": None}
    for name, default in defaults.items():
        if getattr(layer, name, default) is not default:
            raise TaktinyOpsError(
                f"{path}: {type(layer).__name__} sets {name}={getattr(layer, name)!r}, which "
                "taktiny_ops.quantize does not support; leave it unset"
            )
    for name, default in (("dot_general", "dot_general"), ("einsum_op", "einsum"),
                          ("conv_general_dilated", "conv_general_dilated")):
        fn = getattr(layer, name, None)
        if fn is not None and getattr(fn, "__name__", "") != default:
            raise TaktinyOpsError(
                f"{path}: {type(layer).__name__} uses a custom {name} ({fn!r}); "
                "taktiny_ops.quantize supports the default only"
            )


def _quantized_form(path: str, layer: nnx.Module, res: quantrules.Resolution,
                    quant: Any, kernels: str) -> tuple[nnx.Module, str]:
    """The layer's quantized form, and why it runs Qwix where ``kernels`` asked
    for Pallas (no kernel for its rule or layout, or one its held kernel does
    not fit, e.g. K tiles not a multiple of 128)."""
    kernel = layer.kernel[...]
    bias = None if layer.bias is None else layer.bias[...]
    common = dict(module_path=path, resolution=res, quant=quant)
    if isinstance(layer, Linear | nnx.Linear):
        new = QuantizedLinear(kernel, bias, precision=layer.precision, **common)
        layout = None
    elif isinstance(layer, Einsum | nnx.Einsum):
        if layer.einsum_str is None:
            raise TaktinyOpsError(f"{path}: nnx.Einsum without an einsum_str is not supported")
        einsum_str = layer.einsum_str.replace(" ", "")
        new = QuantizedEinsum(einsum_str, kernel, bias, precision=layer.precision, **common)
        layout = _plain_layout(einsum_str, None)
    else:
        if isinstance(layer, Conv):
            config = layer.config
        else:
            try:
                config = _conv_config(layer.kernel_size, layer.strides, layer.padding,
                                      layer.input_dilation, layer.kernel_dilation,
                                      layer.feature_group_count, layer.precision)
            except TaktinyOpsError as err:
                raise TaktinyOpsError(f"{path}: {err}") from None
        new = QuantizedConv(kernel, bias, config, **common)
        layout = "no Pallas kernel for convolutions"
    new.matmul_kernel, note = K.choose(kernels, res, layout=layout,
                                       operands=(None, new.kernel.get_value()))
    return new, note


def quantize(model: nnx.Module, quant: Any, *, kernels: str = "qwix") -> QuantizationReport:
    """Quantize the layers of an NNX ``model`` that ``quant``'s rules select, in place.

    ``quant`` is anything :func:`quantrules.resolve` accepts (a qtype
    shorthand, a rule, a rule list, a provider). Each
    :class:`~taktiny_ops.Linear`, :class:`~taktiny_ops.Einsum`,
    :class:`~taktiny_ops.Conv` and plain ``nnx.Linear``/``nnx.Einsum``/
    ``nnx.Conv`` is resolved at its module path (``mlp/fc1`` for
    ``model.mlp.fc1``; list items by index, ``blocks/0/proj``) for op
    ``dot_general``, ``einsum`` or ``conv_general_dilated``. A quantizing rule
    swaps it for a :class:`~taktiny_ops.QuantizedLinear`,
    :class:`~taktiny_ops.QuantizedEinsum` or
    :class:`~taktiny_ops.QuantizedConv`: PTQ rules with a ``weight_qtype``
    quantize the kernel once (the layer holds packed values and scales), QT
    rules keep it float for training. A rule that disables quantization, or
    no match, leaves the layer as it is. The report lists every layer with
    the rule it got (:func:`quantrules.explain`), its kernel bytes and the
    matmul kernel it runs.

    ``kernels`` chooses that kernel. ``'qwix'`` (the default) runs Qwix's
    program, bitwise equal to Qwix's own model path. ``'pallas'`` runs the
    Pallas TPU kernels where one exists for the layer's rule: a PTQ
    ``Linear``, or an ``Einsum`` that is an ``x[..., K] @ w[K, N]``
    contraction (``'btk,kn->btn'``), with int8, int4 or fp8 weight-only
    (channelwise, or K tiles of a multiple of 128), or int8 weights x int8
    activations (w8a8) with channelwise weights and per-token absmax
    activations; every other layer runs Qwix, and the report's
    ``kernel_note`` says why. ``'auto'`` is ``'pallas'`` on a TPU backend and
    ``'qwix'`` otherwise. Off a TPU the Pallas kernels run in Pallas
    interpret mode (correct, slow). They are not bitwise Qwix: the float
    epilogue (scales, summation order) differs, and the w8a8 kernel keeps
    the row scale absmax / 127.5 and the quotient x / s in float32. With
    float32 activations its int8 levels are Qwix's except at rounding
    boundaries; with bfloat16 activations Qwix rounds the scale and the
    quotient to bfloat16, and the levels differ at many elements.

    Raises:
        TaktinyOpsError: for a ``kernels`` other than ``'qwix'``, ``'pallas'``
            or ``'auto'``; naming the layer's path, for a rule this layer
            cannot take (a tile size it cannot tile, mixed conv qtypes,
            stored calibration or random rounding, a contraction XLA on CPU
            lacks), for a supported layer with options the ops cannot
            reproduce, or for a layer ``quantize`` cannot swap
            (``nnx.LinearGeneral``, ``nnx.ConvTranspose``) that a rule selects.

    >>> import jax
    >>> import quantrules as qr
    >>> class Mlp(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.fc1 = Linear(8, 16, rngs=rngs)
    ...         self.fc2 = nnx.Linear(16, 4, rngs=rngs)
    ...     def __call__(self, x):
    ...         return self.fc2(jax.nn.relu(self.fc1(x)))
    >>> model = Mlp(nnx.Rngs(0))
    >>> report = quantize(model, [qr.Rule(module_path="fc2", weight_qtype=None),
    ...                           qr.Rule(weight_qtype="int8")])
    >>> [(layer.path, layer.mode, layer.weight_qtype) for layer in report.layers]
    [('fc1', 'ptq', 'int8'), ('fc2', 'float', None)]
    >>> type(model.fc1).__name__, model(jnp.ones((2, 8))).shape
    ('QuantizedLinear', (2, 4))
    >>> [layer.kernel for layer in report.layers]
    ['qwix', 'float']
    >>> report = quantize(Mlp(nnx.Rngs(0)), [qr.Rule(module_path="fc1", weight_qtype="int8"),
    ...                                      qr.Rule(weight_qtype="int4", tile_size=8)],
    ...                   kernels="pallas")
    >>> [(layer.kernel, layer.kernel_note) for layer in report.layers]
    [('pallas-weight-only', ''), ('qwix', 'the Pallas kernel needs K tiles of a multiple of 128, not 8')]
    """
    K.check_switch(kernels, "kernels")
    try:
        canonical = canonical_rules(quant)  # each layer's static quant
    except quantrules.QuantRulesError as err:
        raise TaktinyOpsError(f"quant: {err}") from None
    report = QuantizationReport()
    swaps = []
    found = []
    for keys, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        kind = type(node)
        if kind in _OPS or kind in _UNSUPPORTED:
            found.append((keys, node))
    found.sort(key=lambda item: item[0])  # by path: lists in index order
    for keys, layer in found:
        path = _path(keys)
        kind = type(layer)
        op = _OPS.get(kind) or _UNSUPPORTED[kind]
        try:
            explanation = quantrules.explain(canonical, module_path=path, op=op)
        except quantrules.QuantRulesError as err:
            raise TaktinyOpsError(f"{path}: {err}") from None
        res = explanation.resolution
        before = _kernel_bytes(layer.kernel)
        if isinstance(layer, QuantizedLinear | QuantizedEinsum | QuantizedConv):
            new, note = layer, ""
            summary = f"rule #{layer.resolution.index} (already quantized)"
        elif res is None or res.disabled:
            report.layers.append(LayerQuantization(path, op, kind.__name__, explanation.summary,
                                                   "float", None, None, None, before, before,
                                                   "float"))
            continue
        else:
            if kind in _UNSUPPORTED:
                raise TaktinyOpsError(
                    f"{path}: rule #{res.index} selects this {kind.__module__}.{kind.__name__}, "
                    "which taktiny_ops.quantize cannot swap (it handles Linear, Einsum and Conv, "
                    "theirs and nnx's); exclude it with a rule that sets no qtype"
                )
            if not keys:
                raise TaktinyOpsError(
                    "model: the model itself is a layer; quantize() swaps layers inside a model, "
                    "so wrap it in a module"
                )
            for unsupported in res.rule.unsupported_stateless_fields():
                raise TaktinyOpsError(
                    f"{path}: rule #{res.index} sets {unsupported}, which taktiny_ops layers do not "
                    "support (it needs stored calibration statistics or a random key)"
                )
            _check_plain(path, layer)
            try:
                check_backend_support(res.rule, False, True)
            except NotImplementedError as err:
                raise TaktinyOpsError(f"{path}: rule #{res.index}: {err}") from None
            new, note = _quantized_form(path, layer, res, canonical, kernels)
            swaps.append((keys, new))
            summary = explanation.summary
        rule = new.resolution.rule
        report.layers.append(LayerQuantization(
            path, op, kind.__name__, summary, new.mode, rule.weight_qtype, rule.act_qtype,
            rule.tile_size, before, _kernel_bytes(new.kernel), new.matmul_kernel, note))
    for keys, new in swaps:
        _replace(model, keys, new)
    return report


def _replace(model: nnx.Module, keys: tuple, layer: nnx.Module) -> None:
    """Put ``layer`` at ``keys`` (attributes, list indices, dict keys)."""
    node: Any = model
    for key in keys[:-1]:
        node = getattr(node, key) if isinstance(node, nnx.Module) and isinstance(key, str) \
            and not isinstance(node, nnx.Dict) else node[key]
    last = keys[-1]
    if isinstance(node, nnx.Module) and isinstance(last, str) and not isinstance(node, nnx.Dict):
        setattr(node, last, layer)
    else:
        node[last] = layer
