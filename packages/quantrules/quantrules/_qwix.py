"""Adapters to and from Qwix; Qwix and JAX are imported only when used."""

from __future__ import annotations

import dataclasses
from typing import Any

from quantrules._errors import QuantRulesError
from quantrules._providers import PtqProvider, QtProvider
from quantrules._qtypes import get_qtype
from quantrules._rules import Rule

__all__ = ["from_qwix", "qwix_qtype", "to_qwix"]

_RULE_FIELDS = {f.name for f in dataclasses.fields(Rule)} - {"mode"}
# Qtypes that Qwix takes as JAX dtypes; the others are Qwix strings.
_JAX_DTYPES = ("int4", "int8", "uint4", "uint8", "float8_e4m3fn", "float8_e5m2")


def _qtype_name(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        name = value
    else:
        dtype = getattr(value, "dtype", value)
        name = getattr(dtype, "name", None) or str(value)
    try:
        return get_qtype(name).name
    except QuantRulesError as e:
        raise QuantRulesError(f"{where}: Qwix qtype {value!r} cannot be represented: {e}") from None


def _rule_from_qwix(rule: Any, where: str) -> Rule:
    import qwix

    if type(rule) not in (qwix.QuantizationRule, qwix.QtRule):
        raise QuantRulesError(
            f"{where}: {type(rule).__name__} cannot be represented; only Qwix's "
            "QuantizationRule and QtRule convert to quantrules rules"
        )
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(rule):
        value = getattr(rule, field.name)
        if field.name not in _RULE_FIELDS:
            raise QuantRulesError(
                f"{where}: field {field.name!r} of {type(rule).__name__} cannot be represented"
            )
        if field.name.endswith("_qtype"):
            value = _qtype_name(value, f"{where}.{field.name}")
        elif field.name in ("op_names", "act_batch_axes", "channelwise_noise_axes"):
            value = (value,) if isinstance(value, str) else tuple(value)
        kwargs[field.name] = value
    kwargs["mode"] = "qt" if isinstance(rule, qwix.QtRule) else "ptq"
    try:
        return Rule(**kwargs)
    except QuantRulesError as e:
        raise QuantRulesError(f"{where}: {e}") from None


def from_qwix(obj: Any) -> Rule | tuple[Rule, ...] | PtqProvider | QtProvider:
    """Convert a Qwix rule, rule sequence or provider, field by field.

    Raises instead of dropping anything it cannot represent (e.g. a
    ``LoraRule``'s LoRA fields, or a provider with ``disable_jit=True``).
    """
    import qwix

    if isinstance(obj, qwix.QuantizationRule):
        return _rule_from_qwix(obj, "rule")
    if type(obj) in (qwix.PtqProvider, qwix.QtProvider):
        if getattr(obj, "disable_jit", False):
            raise QuantRulesError(
                f"{type(obj).__name__}.disable_jit=True cannot be represented by quantrules "
                "providers"
            )
        rules = tuple(_rule_from_qwix(r, f"{type(obj).__name__}.rules[{i}]")
                      for i, r in enumerate(obj._rules))
        return QtProvider(rules) if type(obj) is qwix.QtProvider else PtqProvider(rules)
    if isinstance(obj, list | tuple):
        return tuple(_rule_from_qwix(r, f"rules[{i}]") for i, r in enumerate(obj))
    raise QuantRulesError(f"cannot convert {type(obj).__name__} from Qwix")


def qwix_qtype(name: str | None) -> Any:
    """The qtype as Qwix takes it: a JAX dtype for int4/int8/fp8..., else a string."""
    if name is None:
        return None
    qt = get_qtype(name)
    if qt.name in _JAX_DTYPES:
        import jax.numpy as jnp

        return jnp.dtype(qt.qwix_name)
    return qt.qwix_name


def to_qwix(quant: Rule | list[Rule] | tuple[Rule, ...] | PtqProvider | QtProvider) -> Any:
    """Convert quantrules rules or providers to Qwix's objects.

    A rule with ``mode='qt'`` becomes a ``QtRule``, else a ``QuantizationRule``.
    """
    import qwix

    if isinstance(quant, PtqProvider):
        return qwix.PtqProvider([to_qwix(r) for r in quant.rules])
    if isinstance(quant, QtProvider):
        return qwix.QtProvider([to_qwix(r) for r in quant.rules])
    if isinstance(quant, list | tuple):
        return [to_qwix(r) for r in quant]
    if not isinstance(quant, Rule):
        raise QuantRulesError(f"to_qwix: expected a Rule or provider, got {type(quant).__name__}")
    kwargs = {name: getattr(quant, name) for name in _RULE_FIELDS}
    for name in ("weight_qtype", "act_qtype", "bwd_qtype"):
        kwargs[name] = qwix_qtype(kwargs[name])
    if kwargs["additional_qt_config"] is not None:
        kwargs["additional_qt_config"] = dict(kwargs["additional_qt_config"])
    if quant.mode == "qt":
        return qwix.QtRule(**kwargs)
    for name in ("bwd_qtype", "bwd_calibration_method", "bwd_weight_grad_tile_size",
                 "disable_channelwise_axes", "bwd_stochastic_rounding",
                 "channelwise_noise_axes", "additional_qt_config"):
        kwargs.pop(name)
    return qwix.QuantizationRule(**kwargs)
