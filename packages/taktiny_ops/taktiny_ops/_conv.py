"""`conv_general_dilated`."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax
import qwix

from quantrules import qwix_qtype
from taktiny_ops import _qwix_private as P
from taktiny_ops._common import (
    DENSE,
    TaktinyOpsError,
    calibration,
    check_qt_sharding,
    dequantize,
    eager_jit,
    finish,
    is_qarray,
    prepare,
    qt_fields,
    result_dtype,
    select_rule,
)

__all__ = ["conv_general_dilated"]

_PADDINGS = ("VALID", "SAME", "SAME_LOWER")


def _positive_ints(name: str, values: Any, count: int) -> tuple[int, ...]:
    """``values`` as ``count`` integers >= 1, else TaktinyOpsError naming ``name``."""
    try:
        out = tuple(operator.index(v) for v in values)
    except TypeError:
        raise TaktinyOpsError(f"{name}: expected {count} positive integers, got {values!r}") from None
    if len(out) != count or any(v < 1 for v in out):
        raise TaktinyOpsError(f"{name}: expected {count} positive integers, got {values!r}")
    return out


def _check(lhs: Any, rhs: Any, window_strides: Any, padding: Any, lhs_dilation: Any,
           rhs_dilation: Any, dimension_numbers: Any, feature_group_count: Any,
           batch_group_count: Any) -> None:
    """Every argument JAX would reject (some only when lowering, in XLA's
    words) as a TaktinyOpsError naming it."""
    if len(lhs.shape) != len(rhs.shape) or len(lhs.shape) < 3:
        raise TaktinyOpsError(
            f"rhs: lhs and rhs need the same rank (>= 3), got {tuple(lhs.shape)} and "
            f"{tuple(rhs.shape)}"
        )
    spatial = len(lhs.shape) - 2
    _positive_ints("window_strides", window_strides, spatial)
    dilated = False
    if lhs_dilation is not None:
        dilated = any(v != 1 for v in _positive_ints("lhs_dilation", lhs_dilation, spatial))
    if rhs_dilation is not None:
        _positive_ints("rhs_dilation", rhs_dilation, spatial)
    if isinstance(padding, str):
        if padding.upper() not in _PADDINGS:
            raise TaktinyOpsError(
                f"padding: expected one of {_PADDINGS} or (low, high) pairs, got {padding!r}"
            )
        if dilated:
            raise TaktinyOpsError(
                f"padding: {padding!r} is not defined with lhs_dilation={tuple(lhs_dilation)} "
                "(a transposed convolution); give one (low, high) pair per spatial dimension"
            )
    else:
        try:
            pairs = [tuple(operator.index(v) for v in p) for p in padding]
        except TypeError:
            raise TaktinyOpsError(
                f"padding: expected (low, high) integer pairs, got {padding!r}") from None
        if len(pairs) != spatial or any(len(p) != 2 for p in pairs):
            raise TaktinyOpsError(
                f"padding: expected {spatial} (low, high) pairs, got {padding!r}"
            )
    try:
        dn = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    except (TypeError, ValueError) as err:
        raise TaktinyOpsError(f"dimension_numbers: {err}") from None
    groups = {}
    for name, value in (("feature_group_count", feature_group_count),
                        ("batch_group_count", batch_group_count)):
        try:
            groups[name] = operator.index(value)
        except TypeError:
            groups[name] = 0
        if groups[name] < 1:
            raise TaktinyOpsError(f"{name}: expected a positive integer, got {value!r}")
    features, batches = groups["feature_group_count"], groups["batch_group_count"]
    if features > 1 and batches > 1:
        raise TaktinyOpsError(
            f"batch_group_count: at most one of feature_group_count ({features}) and "
            f"batch_group_count ({batches}) may exceed 1"
        )
    lhs_n, lhs_c = lhs.shape[dn.lhs_spec[0]], lhs.shape[dn.lhs_spec[1]]
    rhs_o, rhs_i = rhs.shape[dn.rhs_spec[0]], rhs.shape[dn.rhs_spec[1]]
    if lhs_c % features:
        raise TaktinyOpsError(
            f"feature_group_count: lhs's {lhs_c} input features do not divide into "
            f"{features} groups"
        )
    if lhs_c // features != rhs_i:
        raise TaktinyOpsError(
            f"rhs: lhs has {lhs_c} input features, so with feature_group_count={features} "
            f"rhs needs {lhs_c // features} input features per group, got {rhs_i}"
        )
    for name, count in (("feature_group_count", features), ("batch_group_count", batches)):
        if rhs_o % count:
            raise TaktinyOpsError(
                f"{name}: rhs's {rhs_o} output features do not divide into {count} groups"
            )
    if lhs_n % batches:
        raise TaktinyOpsError(
            f"batch_group_count: lhs's batch of {lhs_n} does not divide into {batches} groups"
        )


def _qt_config(rule: Any) -> Any:
    if rule.additional_qt_config:
        raise NotImplementedError(
            "quant: additional_qt_config is not supported for conv_general_dilated"
        )
    return P.ConvGeneralQtConfig(**qt_fields(rule, False, True))


@eager_jit(("lhs", "rhs"))
def conv_general_dilated(
    lhs: Any,
    rhs: Any,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    out_sharding: Any = None,
    quant: Any = None,
    module_path: str = "",
) -> jax.Array:
    """Convolve activations ``lhs`` with kernel ``rhs`` using JAX or Qwix.

    Layout, strides, dilation and grouping follow
    :func:`jax.lax.conv_general_dilated`. Padding is ``'VALID'``, ``'SAME'``,
    ``'SAME_LOWER'`` or one ``(low, high)`` pair per spatial dimension. Dense
    inputs use JAX; QArrays use Qwix. A rule matching op
    ``conv_general_dilated`` dequantizes existing QArrays, then applies
    ``act_qtype`` to ``lhs`` and ``weight_qtype`` to ``rhs`` (weight-only
    works here, unlike Qwix's ``PtqProvider``). Tiled convolution
    quantization, different activation and weight qtypes, static activation
    scales and QT stochastic rounding raise ``NotImplementedError``; empty
    operands or results are computed exactly, without quantization. Every
    argument JAX would reject (including string padding with
    ``lhs_dilation``, which needs explicit pairs) raises
    :class:`TaktinyOpsError` naming it.

    >>> conv_general_dilated(
    ...     jnp.ones((1, 8, 2)), jnp.ones((3, 2, 4)), (1,), 'SAME',
    ...     dimension_numbers=('NWC', 'WIO', 'NWC'),
    ... ).shape
    (1, 8, 4)
    """
    _check(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
           feature_group_count, batch_group_count)
    res = select_rule(quant, module_path, "conv_general_dilated")
    dtype = result_dtype((lhs, rhs), quant_set=quant is not None,
                         preferred_element_type=preferred_element_type)
    lhs, rhs = prepare(lhs, dtype), prepare(rhs, dtype)
    common = dict(lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
                  dimension_numbers=dimension_numbers, feature_group_count=feature_group_count,
                  batch_group_count=batch_group_count)
    if res is None and (is_qarray(lhs) or is_qarray(rhs)):
        out = qwix.conv_general_dilated(lhs, rhs, window_strides, padding, precision=precision,
                                        out_sharding=out_sharding, **common)
    elif res is None or res == DENSE:
        out = jax.lax.conv_general_dilated(
            dequantize(lhs), dequantize(rhs), window_strides, padding, precision=precision,
            preferred_element_type=preferred_element_type, out_sharding=out_sharding, **common)
    else:
        check_qt_sharding(res, out_sharding)
        rule = res.rule
        if rule.tile_size is not None:
            raise NotImplementedError(
                f"quant: rule #{res.index} sets tile_size={rule.tile_size}; tiled (subchannel) "
                "quantization is not supported for conv_general_dilated"
            )
        lhs, rhs = dequantize(lhs), dequantize(rhs)
        if (rule.act_qtype and rule.weight_qtype
                and qwix_qtype(rule.act_qtype) != qwix_qtype(rule.weight_qtype)):
            raise NotImplementedError(
                f"quant: rule #{res.index} quantizes activations to {rule.act_qtype} and weights "
                f"to {rule.weight_qtype}; jax.lax.conv_general_dilated needs both operands of "
                "one integer type, so give them the same qtype (or quantize weights only)"
            )
        def dense(a: Any, b: Any) -> jax.Array:
            return jax.lax.conv_general_dilated(
                a, b, window_strides, padding, precision=precision,
                preferred_element_type=preferred_element_type, out_sharding=out_sharding,
                **common)

        if 0 in lhs.shape or 0 in rhs.shape or 0 in jax.eval_shape(dense, lhs, rhs).shape:
            # An empty operand has no scale and an empty result no windows
            # (Qwix reshapes both to one): the exact result is empty or
            # zeros, so nothing is quantized.
            return finish(dense(lhs, rhs), dtype, out_sharding)
        if res.mode == "qt":
            out = P.conv_general_qt(lhs, rhs, _qt_config(rule), window_strides, padding,
                                    lhs_dilation, rhs_dilation, dimension_numbers,
                                    feature_group_count, batch_group_count)
        else:
            out = ptq_conv(lhs, rhs, rule, window_strides, padding, precision=precision,
                           out_sharding=out_sharding, **common)
    return finish(out, dtype, out_sharding)


def ptq_conv(lhs: Any, rhs: Any, rule: Any, window_strides: Any, padding: Any, *,
             precision: Any, out_sharding: Any, **common: Any) -> jax.Array:
    """Qwix's PTQ convolution: each operand the rule quantizes, quantized by
    Qwix, except a QArray ``rhs`` (a PTQ layer's kernel, quantized so once)."""
    dn = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, common["dimension_numbers"])
    for_w, for_a = calibration(rule, True), calibration(rule, False)
    if for_w and not is_qarray(rhs):
        rhs = P.quantize(rhs, P.conv_how(dimension_numbers=dn, for_lhs=False,
                                         qtype=for_w[0], calibration_method=for_w[1]))
    if for_a:
        lhs = P.quantize(lhs, P.conv_how(dimension_numbers=dn, for_lhs=True,
                                         qtype=for_a[0], calibration_method=for_a[1]))
    return qwix.conv_general_dilated(lhs, rhs, window_strides, padding, precision=precision,
                                     out_sharding=out_sharding,
                                     **{**common, "dimension_numbers": dn})
