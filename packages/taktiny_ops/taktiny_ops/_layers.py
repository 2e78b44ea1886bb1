"""Flax NNX layers on the taktiny_ops ops, float and quantized.

The float layers (:class:`Linear`, :class:`Einsum`, :class:`Conv`) hold
float parameters and call the ops without a rule. :func:`taktiny_ops.quantize`
swaps them (or plain ``nnx.Linear``/``nnx.Einsum``/``nnx.Conv``) for the
quantized forms, which know their module path: a PTQ form holds its kernel
already quantized (a Qwix ``QArray`` of packed values and scales, in a
:class:`QuantizedKernel` variable) and quantizes activations per call; a QT
form keeps the float kernel and calls the op with the rule, so it trains
through ``nnx.grad``. Either computes exactly what the stateless op computes
for the same rule and inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

import quantrules
from taktiny_ops import _kernels as K
from taktiny_ops import _qwix_private as P
from taktiny_ops._common import (
    DENSE,
    TaktinyOpsError,
    _eager_jit_enabled,
    calibration,
    dequantize,
    finish,
    is_qarray,
    prepare,
    quantize_operand,
    result_dtype,
    select_rule,
)
from taktiny_ops._conv import conv_general_dilated, ptq_conv
from taktiny_ops._dot import linear
from taktiny_ops._einsum import einsum

__all__ = [
    "Conv",
    "Einsum",
    "Linear",
    "QuantizedConv",
    "QuantizedEinsum",
    "QuantizedKernel",
    "QuantizedLinear",
    "quantize_weight",
]

_default_kernel_init = nnx.initializers.lecun_normal()
_zeros = nnx.initializers.zeros_init()


class QuantizedKernel(nnx.Variable):
    """A PTQ layer's kernel: a Qwix ``QArray`` (packed integer values and scales).

    Not an ``nnx.Param``: ``nnx.grad`` (which differentiates ``nnx.Param``)
    leaves it alone, and ``nnx.split`` keeps its values and scales as the
    leaves :func:`taktiny_ops.export_model` writes.
    """


def _value(var: Any) -> Any:
    """A variable's value for a call. ``get_value`` copies the value's pytree
    on every read (microseconds per variable, most of an eager layer call);
    the layers' own variables carry no read hooks, so an array or QArray
    (traced or not) is read as it is held."""
    if var is None:
        return None
    raw = var.get_raw_value()
    if isinstance(raw, jax.Array | qwix.QArray):
        return raw
    return var.get_value()


def _as_tuple(value: int | Sequence[int] | None, count: int, name: str) -> tuple[int, ...]:
    if value is None:
        value = 1
    if isinstance(value, int):
        return (value,) * count
    out = tuple(value)
    if len(out) != count:
        raise TaktinyOpsError(f"{name}: expected an int or {count} ints, got {value!r}")
    return out


def _conv_padding(padding: Any, spatial: int) -> str | tuple[tuple[int, int], ...]:
    """nnx.Conv's padding forms the ops support; CIRCULAR, REFLECT and CAUSAL are not."""
    if isinstance(padding, str):
        if padding.upper() in ("SAME", "VALID", "SAME_LOWER"):
            return padding.upper()
        raise TaktinyOpsError(
            f"padding: {padding!r} is not supported by taktiny_ops layers (use 'SAME', "
            "'VALID', 'SAME_LOWER', an int or (low, high) pairs)"
        )
    try:
        if isinstance(padding, int):
            return ((padding, padding),) * spatial
        items = list(padding)
        if all(isinstance(p, int) for p in items):
            pairs = tuple((operator.index(p), operator.index(p)) for p in items)
        else:
            pairs = tuple((operator.index(lo), operator.index(hi)) for lo, hi in items)
    except (TypeError, ValueError):
        raise TaktinyOpsError(f"padding: expected a string, an int or pairs, got {padding!r}") from None
    if len(pairs) == 1 and spatial > 1:
        pairs = pairs * spatial
    if len(pairs) != spatial:
        raise TaktinyOpsError(f"padding: expected {spatial} (low, high) pairs, got {padding!r}")
    return pairs


def _conv_numbers(spatial: int) -> tuple[str, str, str]:
    """Channel-last layouts (NWC, NHWC, NDHWC) with an HWIO-style kernel."""
    letters = "DHW"[-spatial:] if spatial <= 3 else "".join(chr(ord("a") + i) for i in range(spatial))
    return (f"N{letters}C", f"{letters}IO", f"N{letters}C")


def _einsum_bias_shape(einsum_str: str, kernel_shape: tuple[int, ...], out_ndim: int) -> tuple:
    """The bias broadcast shape nnx.Einsum uses: kernel sizes at the kernel's output axes."""
    inputs, _, output = einsum_str.partition("->")
    rhs = inputs.split(",")[1]
    sizes = dict(zip(rhs, kernel_shape, strict=True))
    head, dots, tail = output.partition("...")
    middle = out_ndim - len(head) - len(tail) if dots else 0
    return tuple([sizes.get(c, 1) for c in head] + [1] * middle + [sizes.get(c, 1) for c in tail])


# ---------------------------------------------------------------------------
# Float layers.


class Linear(nnx.Module):
    """``x @ kernel + bias`` with Taktiny's ``(in_features, out_features)`` kernel.

    The float layer of :func:`taktiny_ops.linear`; :func:`taktiny_ops.quantize`
    turns it into a :class:`QuantizedLinear` where a rule matches its path.

    >>> layer = Linear(3, 4, rngs=nnx.Rngs(0))
    >>> layer.kernel.shape, layer(jnp.ones((2, 3))).shape
    ((3, 4), (2, 4))
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 param_dtype: Any = jnp.float32, precision: Any = None,
                 kernel_init: Any = _default_kernel_init, bias_init: Any = _zeros,
                 rngs: nnx.Rngs) -> None:
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features),
                                            param_dtype))
        self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
                     if use_bias else nnx.data(None))
        self.in_features, self.out_features = in_features, out_features
        self.precision = precision

    def __call__(self, x: jax.Array) -> jax.Array:
        return _dispatch(_linear_forward, (x, _value(self.kernel), _value(self.bias)),
                         (("quant", None), ("module_path", ""), ("precision", self.precision)))


class Einsum(nnx.Module):
    """``einsum(einsum_str, x, kernel) + bias``, as ``nnx.Einsum`` (explicit, two operands).

    The bias, if any, broadcasts over the output axes the kernel does not
    have, exactly as in ``nnx.Einsum``.

    >>> layer = Einsum("btd,dh->bth", (3, 5), (5,), rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 4, 3))).shape
    (2, 4, 5)
    """

    def __init__(self, einsum_str: str, kernel_shape: Sequence[int],
                 bias_shape: Sequence[int] | None = None, *, param_dtype: Any = jnp.float32,
                 precision: Any = None, kernel_init: Any = _default_kernel_init,
                 bias_init: Any = _zeros, rngs: nnx.Rngs) -> None:
        einsum_str = einsum_str.replace(" ", "")
        if "->" not in einsum_str or einsum_str.count(",") != 1:
            raise TaktinyOpsError(
                f"einsum_str: expected an explicit two-operand equation 'x,kernel->out', got "
                f"{einsum_str!r}"
            )
        self.kernel = nnx.Param(kernel_init(rngs.params(), tuple(kernel_shape), param_dtype))
        self.bias = (nnx.Param(bias_init(rngs.params(), tuple(bias_shape), param_dtype))
                     if bias_shape is not None else nnx.data(None))
        self.einsum_str = einsum_str
        self.kernel_shape = tuple(kernel_shape)
        self.precision = precision

    def __call__(self, x: jax.Array) -> jax.Array:
        return _dispatch(_einsum_forward, (x, _value(self.kernel), _value(self.bias)), (
            ("quant", None), ("module_path", ""), ("einsum_str", self.einsum_str),
            ("kernel_shape", self.kernel_shape), ("precision", self.precision)))


class Conv(nnx.Module):
    """A channel-last convolution (``NWC``/``NHWC``/``NDHWC``), as ``nnx.Conv``.

    The kernel is ``(*kernel_size, in_features // feature_group_count,
    out_features)``. Padding is ``'SAME'``, ``'VALID'``, ``'SAME_LOWER'``, an
    int or ``(low, high)`` pairs. Inputs with several (or no) batch axes are
    flattened to one, as ``nnx.Conv`` does.

    >>> layer = Conv(2, 4, (3, 3), rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((1, 5, 5, 2))).shape
    (1, 5, 5, 4)
    """

    def __init__(self, in_features: int, out_features: int, kernel_size: int | Sequence[int],
                 strides: int | Sequence[int] = 1, *, padding: Any = "SAME",
                 input_dilation: int | Sequence[int] = 1,
                 kernel_dilation: int | Sequence[int] = 1, feature_group_count: int = 1,
                 use_bias: bool = True, param_dtype: Any = jnp.float32, precision: Any = None,
                 kernel_init: Any = _default_kernel_init, bias_init: Any = _zeros,
                 rngs: nnx.Rngs) -> None:
        kernel_size = (kernel_size,) if isinstance(kernel_size, int) else tuple(kernel_size)
        if in_features % feature_group_count:
            raise TaktinyOpsError(
                f"feature_group_count: {in_features} input features do not divide into "
                f"{feature_group_count} groups"
            )
        shape = (*kernel_size, in_features // feature_group_count, out_features)
        self.kernel = nnx.Param(kernel_init(rngs.params(), shape, param_dtype))
        self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
                     if use_bias else nnx.data(None))
        self.config = _conv_config(kernel_size, strides, padding, input_dilation,
                                   kernel_dilation, feature_group_count, precision)

    def __call__(self, x: jax.Array) -> jax.Array:
        return _dispatch(_conv_call, (x, _value(self.kernel), _value(self.bias)),
                         (("config", self.config), ("quant", None), ("module_path", "")))


def _conv_config(kernel_size: tuple[int, ...], strides: Any, padding: Any, input_dilation: Any,
                 kernel_dilation: Any, feature_group_count: int, precision: Any) -> tuple:
    """The static conv arguments, checked: (spatial, strides, padding, lhs/rhs dilation, groups, precision)."""
    spatial = len(kernel_size)
    return (spatial, _as_tuple(strides, spatial, "strides"), _conv_padding(padding, spatial),
            _as_tuple(input_dilation, spatial, "input_dilation"),
            _as_tuple(kernel_dilation, spatial, "kernel_dilation"), int(feature_group_count),
            precision)


def _conv_call(x: jax.Array, kernel: Any, bias: Any, *, config: tuple, quant: Any,
               module_path: str) -> jax.Array:
    """nnx.Conv's batch flattening and bias around the stateless op (quant may be a
    prequantized PTQ resolution: see QuantizedConv)."""
    spatial, strides, padding, lhs_dil, rhs_dil, groups, precision = config
    batch_axes = len(x.shape) - (spatial + 1)
    if batch_axes < 0:
        raise TaktinyOpsError(
            f"x: expected (*batch, {spatial} spatial axes, features), got shape {tuple(x.shape)}"
        )
    batch_shape = x.shape[:batch_axes]
    if batch_axes != 1:
        x = jnp.reshape(x, (-1, *x.shape[batch_axes:]))
    numbers = _conv_numbers(spatial)
    if isinstance(quant, _Prequantized):
        features = kernel.qvalue.shape[-2] * groups
        if x.shape[-1] != features:
            raise TaktinyOpsError(
                f"x: expected {features} input features (the last axis), got shape "
                f"{tuple(x.shape)}"
            )
        y = _ptq_conv(x, kernel, res=quant.res, strides=strides, padding=padding,
                      lhs_dilation=lhs_dil, rhs_dilation=rhs_dil, numbers=numbers,
                      groups=groups, precision=precision)
    else:
        y = conv_general_dilated(x, kernel, strides, padding, lhs_dil, rhs_dil, numbers, groups,
                                 precision=precision, quant=quant, module_path=module_path)
    if bias is not None:
        y = y + bias.reshape((1,) * (y.ndim - bias.ndim) + bias.shape)
    if batch_axes != 1:
        y = jnp.reshape(y, (*batch_shape, *y.shape[1:]))
    return y


def _linear_forward(x: jax.Array, kernel: Any, bias: Any, *, quant: Any, module_path: str,
                    precision: Any, impl: str = K.QWIX) -> jax.Array:
    """The stateless op; a PTQ layer's QArray kernel matches its rule, so the op uses it as is."""
    if is_qarray(kernel) and (len(x.shape) < 1 or x.shape[-1] != kernel.shape[0]):
        raise TaktinyOpsError(f"x: expected shape (..., {kernel.shape[0]}), got {tuple(x.shape)}")
    return linear(x, kernel, bias, quant=quant, module_path=module_path, precision=precision,
                  kernel=impl)


def _einsum_forward(x: jax.Array, kernel: Any, bias: Any, *, quant: Any, module_path: str,
                    einsum_str: str, kernel_shape: tuple, precision: Any,
                    impl: str = K.QWIX) -> jax.Array:
    y = einsum(einsum_str, x, kernel, quant=quant, module_path=module_path,
               precision=precision, kernel=impl)
    return _add_einsum_bias(y, bias, einsum_str, kernel_shape)


def _add_einsum_bias(y: jax.Array, bias: Any, einsum_str: str, kernel_shape: tuple) -> jax.Array:
    if bias is None:
        return y
    return y + jnp.reshape(bias, _einsum_bias_shape(einsum_str, kernel_shape, y.ndim))


# ---------------------------------------------------------------------------
# Quantized layers.


@dataclasses.dataclass(frozen=True)
class _Prequantized:
    """Marks a PTQ call whose kernel is already a QArray (the resolution travels along)."""

    res: quantrules.Resolution


class _QuantizedLayer(nnx.Module):
    """Common state: where the layer sits, the rule it got, and the quant the ops see."""

    module_path: str
    resolution: quantrules.Resolution
    quant: Any  # the rule set, as the ops accept it
    matmul_kernel: str  # 'qwix', 'pallas-weight-only' or 'pallas-w8a8'

    def _init_quant(self, module_path: str, resolution: quantrules.Resolution,
                    quant: Any, matmul_kernel: str = K.QWIX) -> None:
        self.module_path = module_path
        self.resolution = resolution
        self.quant = quant
        self.matmul_kernel = matmul_kernel

    def _switch(self) -> str:
        """The ops' ``kernel=`` that gives this layer's :attr:`matmul_kernel`."""
        return K.QWIX if self.matmul_kernel == K.QWIX else "pallas"

    @property
    def mode(self) -> str:
        """``'ptq'`` (kernel held quantized) or ``'qt'`` (float kernel, quantized per call)."""
        return self.resolution.mode

    @property
    def prequantized(self) -> bool:
        """True for a PTQ rule with a ``weight_qtype``: the kernel is held quantized."""
        return self.resolution.mode == "ptq" and self.resolution.rule.weight_qtype is not None

    def _hold(self, kernel: Any, bias: Any, how: Any) -> None:
        """Holds ``bias`` and ``kernel``: quantized once where :attr:`prequantized`
        (``how()`` gives the layer's ``how(qtype, method, tile)``), else float."""
        if self.prequantized:
            self.kernel = QuantizedKernel(_quantize_weight(
                kernel, self.resolution, self.module_path, how()))
        else:
            self.kernel = nnx.Param(kernel)
        self.bias = nnx.Param(bias) if bias is not None else nnx.data(None)

    def _kernel_for_call(self) -> tuple[Any, Any]:
        """(kernel, quant) for the op: a QArray and a PTQ marker, or the float kernel and the rules."""
        if isinstance(self.kernel, QuantizedKernel):
            return _value(self.kernel), _Prequantized(self.resolution)
        return _value(self.kernel), self.quant


class QuantizedLinear(_QuantizedLayer):
    """A :class:`Linear` with the rule its module path selected.

    PTQ: the kernel is held quantized (``weight_qtype``, the rule's tile
    size; as :func:`quantize_weight` makes it), activations take
    ``act_qtype`` per call; QT: the float kernel is quantized per call by
    Qwix's training kernel. Either way the output is bitwise what
    ``taktiny_ops.linear(x, kernel, bias, quant=rules, module_path=path)``
    returns for the float kernel, or for the kernel it holds.
    ``matmul_kernel`` is the kernel :func:`taktiny_ops.quantize` chose
    (``'qwix'``, ``'pallas-weight-only'`` or ``'pallas-w8a8'``).
    """

    def __init__(self, kernel: Any, bias: Any, *, module_path: str,
                 resolution: quantrules.Resolution, quant: Any, precision: Any = None,
                 matmul_kernel: str = K.QWIX) -> None:
        self._init_quant(module_path, resolution, quant, matmul_kernel)
        self.precision = precision
        self.in_features, self.out_features = kernel.shape
        self._hold(kernel, bias, lambda: _weight_how(module_path, resolution))

    def __call__(self, x: jax.Array) -> jax.Array:
        return _dispatch(_linear_forward, (x, _value(self.kernel), _value(self.bias)), (
            ("quant", self.quant), ("module_path", self.module_path),
            ("precision", self.precision), ("impl", self._switch())))


class QuantizedEinsum(_QuantizedLayer):
    """An :class:`Einsum` with the rule its module path selected (see :class:`QuantizedLinear`)."""

    def __init__(self, einsum_str: str, kernel: Any, bias: Any, *, module_path: str,
                 resolution: quantrules.Resolution, quant: Any, precision: Any = None,
                 matmul_kernel: str = K.QWIX) -> None:
        self._init_quant(module_path, resolution, quant, matmul_kernel)
        self.einsum_str = einsum_str
        self.kernel_shape = tuple(kernel.shape)
        self.precision = precision
        self._hold(kernel, bias,
                   lambda: _weight_how(module_path, resolution, einsum_str, "einsum_str"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return _dispatch(_einsum_forward, (x, _value(self.kernel), _value(self.bias)), (
            ("quant", self.quant), ("module_path", self.module_path),
            ("einsum_str", self.einsum_str), ("kernel_shape", self.kernel_shape),
            ("precision", self.precision), ("impl", self._switch())))


class QuantizedConv(_QuantizedLayer):
    """A :class:`Conv` with the rule its module path selected (see :class:`QuantizedLinear`).

    Convolution quantization is channelwise (no ``tile_size``), and
    activations and weights need one qtype when both are set.
    """

    def __init__(self, kernel: Any, bias: Any, config: tuple, *, module_path: str,
                 resolution: quantrules.Resolution, quant: Any) -> None:
        self._init_quant(module_path, resolution, quant)
        self.config = config
        rule = resolution.rule
        if rule.tile_size is not None:
            raise TaktinyOpsError(
                f"{module_path}: rule #{resolution.index} sets tile_size={rule.tile_size}; "
                "convolutions are quantized per channel only"
            )
        if (rule.act_qtype and rule.weight_qtype and quantrules.qwix_qtype(rule.act_qtype)
                != quantrules.qwix_qtype(rule.weight_qtype)):
            raise TaktinyOpsError(
                f"{module_path}: rule #{resolution.index} quantizes activations to "
                f"{rule.act_qtype} and weights to {rule.weight_qtype}; a convolution needs one "
                "integer type for both (or weights only)"
            )

        def how() -> Any:
            numbers = _conv_numbers(config[0])
            dn = jax.lax.conv_dimension_numbers((1,) * kernel.ndim, kernel.shape, numbers)
            return lambda qtype, method, tile: P.conv_how(
                dimension_numbers=dn, for_lhs=False, qtype=qtype, calibration_method=method)

        self._hold(kernel, bias, how)

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel, quant = self._kernel_for_call()
        return _dispatch(_conv_call, (x, kernel, _value(self.bias)), (
            ("config", self.config), ("quant", quant), ("module_path", self.module_path)))


def _weight_how(where: str, res: quantrules.Resolution, einsum_str: str | None = None,
                argument: str = "subscripts") -> Any:
    """``how(qtype, method, tile)``: Qwix's quantization of a linear kernel
    ``(in, out)``, or of an einsum's second operand, as the op quantizes its
    weight (an einsum is checked: a kernel term without '...', no index summed
    away, an index to tile)."""
    if einsum_str is None:
        dnums = (((1,), (0,)), ((), ()))
        return lambda qtype, method, tile: P.dot_how(
            dimension_numbers=dnums, ndims=(2, 2), for_lhs=False, tile_size=tile, qtype=qtype,
            calibration_method=method)
    act_term, weight_term = einsum_str.partition("->")[0].split(",")
    output = einsum_str.partition("->")[2]
    if "..." in weight_term:
        raise TaktinyOpsError(
            f"{where}: {argument} {einsum_str!r}: a PTQ kernel term cannot have '...'"
        )
    private = [c for c in weight_term if c not in act_term and c not in output]
    if private:
        raise TaktinyOpsError(
            f"{where}: {argument} {einsum_str!r} sums kernel index {private[0]!r} away before "
            "contracting; a PTQ layer stores its kernel quantized, so write the kernel without "
            "that axis"
        )
    if res.rule.tile_size is not None and not (set(act_term) & set(weight_term)
                                               - set(output) - {"."}):
        raise TaktinyOpsError(
            f"{where}: rule #{res.index} sets tile_size={res.rule.tile_size} but "
            f"{einsum_str!r} contracts no index to tile"
        )
    ndims = (len(act_term.replace("...", "")), len(weight_term))
    return lambda qtype, method, tile: P.einsum_how(
        einsum_str=einsum_str, ndims=ndims, for_lhs=False, tile_size=tile, qtype=qtype,
        calibration_method=method)


def quantize_weight(w: jax.Array, quant: Any, *, module_path: str = "",
                    op: str = "dot_general", subscripts: str | None = None) -> Any:
    """``w`` as the NNX layer at ``module_path`` holds its kernel, for the stateless ops.

    The rule ``quant`` selects for ``op`` at ``module_path`` decides: a PTQ
    rule with a ``weight_qtype`` gives a Qwix ``QArray`` (packed values and
    scales), bitwise the kernel :class:`QuantizedLinear` (``op='dot_general'``,
    ``w`` of shape ``(in_features, out_features)``) or :class:`QuantizedEinsum`
    (``op='einsum'``, ``w`` the second operand of ``subscripts``) holds; any
    other rule, or none, returns ``w`` unchanged (the layer keeps it float).

    Passed with the same ``quant`` and ``module_path`` to
    :func:`taktiny_ops.linear` (or :func:`taktiny_ops.dot_general` in linear's
    layout) or :func:`taktiny_ops.einsum` (the same ``subscripts``), the
    QArray is used as is: the weight is quantized once instead of per call,
    and the result is bitwise what the layer computes in the same program.

    Raises:
        TaktinyOpsError: for an ``op`` other than ``'dot_general'`` or
            ``'einsum'``, a ``w`` that is not a float array of the layout,
            ``subscripts`` missing or not an explicit two-operand equation,
            or a rule that cannot quantize ``w`` (a tile size that does not
            divide its contraction axis, an empty ``w``).

    >>> import taktiny_ops as tk
    >>> w = jnp.arange(12.0).reshape(4, 3)
    >>> wq = tk.quantize_weight(w, "int8")
    >>> type(wq).__name__, wq.qvalue.dtype, wq.scale.shape
    ('QArray', dtype('int8'), (1, 3))
    >>> tk.linear(jnp.ones((2, 4)), wq, quant="int8").shape
    (2, 3)
    >>> tk.quantize_weight(w, None) is w
    True
    """
    if op not in ("dot_general", "einsum"):
        raise TaktinyOpsError(f"op: expected 'dot_general' or 'einsum', got {op!r}")
    if is_qarray(w) or not hasattr(w, "shape") or not jnp.issubdtype(
            jnp.result_type(w), jnp.floating):
        raise TaktinyOpsError(
            f"w: expected a float array, got {type(w).__name__}"
            + (f" of dtype {jnp.result_type(w)}" if hasattr(w, "dtype") else "")
        )
    if op == "einsum":
        spec = subscripts.replace(" ", "") if isinstance(subscripts, str) else ""
        terms = spec.partition("->")[0].split(",")
        if "->" not in spec or len(terms) != 2:
            raise TaktinyOpsError(
                f"subscripts: op='einsum' needs the explicit two-operand equation "
                f"'x,w->out' of the calls, got {subscripts!r}"
            )
        if len(terms[1].replace("...", "")) != len(w.shape):
            raise TaktinyOpsError(
                f"w: shape {tuple(w.shape)} does not fit the weight term {terms[1]!r} of "
                f"{subscripts!r}"
            )
    elif len(w.shape) != 2:
        raise TaktinyOpsError(
            f"w: expected shape (in_features, out_features), got {tuple(w.shape)}"
        )
    res = select_rule(quant, module_path, op)
    if res is None or res == DENSE or res.mode != "ptq" or res.rule.weight_qtype is None:
        return w
    where = f"w (module_path={module_path!r})" if module_path else "w"
    einsum_str = spec if op == "einsum" else None
    return _quantize_weight(w, res, where, _weight_how(where, res, einsum_str))


def _quantize_weight(kernel: jax.Array, res: quantrules.Resolution, module_path: str,
                     how: Any) -> Any:
    """The kernel as a QArray, quantized as the op quantizes it per call."""
    qtype, method = calibration(res.rule, True)
    if 0 in kernel.shape:
        raise TaktinyOpsError(f"{module_path}: an empty kernel {kernel.shape} has no scale")
    try:
        spec = how(qtype, method, res.rule.tile_size)
        # Compiled, as the op quantizes its weight inside its own jit.
        return jax.jit(lambda k: quantize_operand(k, spec, res, "the kernel"))(kernel)
    except TaktinyOpsError as err:
        raise TaktinyOpsError(f"{module_path}: {err}") from None


# ---------------------------------------------------------------------------
# The PTQ convolution with a prequantized kernel: the op's own PTQ path, minus
# the weight's quantization (done once, bitwise as the op does it). Linear and
# einsum layers need no such path: the ops take a matching QArray as is.


def _dispatch(fn: Any, arrays: tuple, statics: tuple) -> Any:
    """``fn(*arrays, **statics)``; called eagerly, as one cached ``jax.jit`` of it.

    The layers' own, leaner form of the ops' ``eager_jit`` (whose argument
    binding costs more than a layer can spend): the arrays are positional,
    the statics a hashable tuple of pairs. Under a transformation (tracer
    inputs) ``fn`` runs inline, and ``TAKTINY_OPS_EAGER_JIT=0`` runs it op by
    op, as for the ops.
    """
    leaves = jax.tree_util.tree_leaves(arrays)
    if _eager_jit_enabled() and not any(isinstance(a, jax.core.Tracer) for a in leaves):
        return _compiled(fn, statics)(*arrays)
    return fn(*arrays, **dict(statics))


@functools.lru_cache(maxsize=256)
def _compiled(fn: Any, statics: tuple) -> Any:
    return jax.jit(functools.partial(fn, **dict(statics)))


def _ptq_conv(x: Any, w: Any, *, res: quantrules.Resolution, strides: tuple, padding: Any,
              lhs_dilation: tuple, rhs_dilation: tuple, numbers: tuple, groups: int,
              precision: Any = None) -> jax.Array:
    dtype = result_dtype((x, w), quant_set=True, preferred_element_type=None)
    x = prepare(x, dtype)
    common = dict(lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
                  dimension_numbers=numbers, feature_group_count=groups)

    def dense(a: Any, b: Any) -> jax.Array:
        return jax.lax.conv_general_dilated(a, b, strides, padding, precision=precision,
                                            **common)

    kernel_float = jax.ShapeDtypeStruct(w.qvalue.shape, dtype)
    if 0 in x.shape or 0 in jax.eval_shape(dense, x, kernel_float).shape:
        return finish(dense(x, dequantize(w)), dtype, None)
    out = ptq_conv(x, w, res.rule, strides, padding, precision=precision, out_sharding=None,
                   **common)
    return finish(out, dtype, None)
