"""Rules: which ops get quantized and how, matched by module path and op name."""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from quantrules._errors import QuantRulesError, RuleError
from quantrules._ops import OP_ALIASES, check_op
from quantrules._qtypes import get_qtype

__all__ = ["Mode", "Rule"]

#: How a rule quantizes: post-training ("ptq") or quantized training ("qt").
Mode = Literal["ptq", "qt"]

_CALIBRATION_ARGS = {"absmax": (0, 1), "minmax": (0, 1), "rms": (1, 1), "fixed": (1, 2)}
_STOCHASTIC_ROUNDING = ("uniform", "low_bit_uniform")

# QT-only fields and their defaults: set on a PTQ rule they are an error.
_QT_DEFAULTS: dict[str, Any] = {
    "bwd_qtype": None,
    "bwd_calibration_method": "absmax",
    "bwd_weight_grad_tile_size": None,
    "disable_channelwise_axes": False,
    "bwd_stochastic_rounding": None,
    "channelwise_noise_axes": (0,),
    "additional_qt_config": None,
}


def _check_calibration(field: str, method: str | None) -> None:
    if method is None:
        return
    if not isinstance(method, str):
        raise RuleError(f"Rule.{field}: expected a string like 'absmax', got {method!r}")
    name, *args = method.lower().split(",")
    if name not in _CALIBRATION_ARGS:
        raise RuleError(
            f"Rule.{field}: unknown calibration method {method!r}; expected "
            "'absmax[,scale]', 'minmax[,scale]', 'rms,scale' or 'fixed,bound' / 'fixed,lo,hi'"
        )
    lo, hi = _CALIBRATION_ARGS[name]
    if not lo <= len(args) <= hi:
        raise RuleError(
            f"Rule.{field}: {name!r} takes {lo}..{hi} numeric arguments, got {method!r}"
        )
    try:
        values = [float(a) for a in args]
    except ValueError:
        raise RuleError(f"Rule.{field}: arguments of {method!r} must be numbers") from None
    if name == "fixed":
        low, high = (-values[0], values[0]) if len(values) == 1 else values
        if low > 0 or high < 0 or low >= high:
            raise RuleError(f"Rule.{field}: the fixed range of {method!r} must contain 0")


def _check_tile(field: str, tile: int | float | None) -> None:
    if tile is None:
        return
    if isinstance(tile, bool) or not isinstance(tile, int | float):
        raise RuleError(f"Rule.{field}: expected a positive int or a float in (0, 1], got {tile!r}")
    if isinstance(tile, int) and tile <= 0:
        raise RuleError(f"Rule.{field}: tile size must be positive, got {tile}")
    if isinstance(tile, float) and not 0.0 < tile <= 1.0:
        raise RuleError(
            f"Rule.{field}: a float tile size is a fraction of the axis and must be in "
            f"(0, 1], got {tile}"
        )


def _int_tuple(field: str, value: Iterable[int]) -> tuple[int, ...]:
    try:
        out = tuple(value)
    except TypeError:
        raise RuleError(f"Rule.{field}: expected a sequence of ints, got {value!r}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
        raise RuleError(f"Rule.{field}: expected a sequence of ints, got {value!r}")
    return out


@dataclasses.dataclass(frozen=True, kw_only=True, eq=True)
class Rule:
    """One quantization rule (immutable, validated at construction).

    A rule matches an op when ``re.fullmatch(module_path, path)`` holds for the
    op's ``/``-joined module path and the op's name is in ``op_names`` (empty
    means every op). Among rules, the first match wins. A rule whose qtypes are
    all unset matches and *disables* quantization of that op.

    Fields mirror Qwix's ``QuantizationRule`` and ``QtRule`` so that Qwix
    objects convert without loss; ``mode`` says whether the rule is for
    training (``"qt"``, Qwix's ``QtRule``) or post-training (``"ptq"``).

    >>> r = Rule(module_path="encoder/.*", op_names=("dot_general",), weight_qtype="INT8")
    >>> r.weight_qtype, r.mode, r.disabled
    ('int8', 'ptq', False)
    >>> Rule(weight_qtype="int8", bwd_qtype="int8")
    Traceback (most recent call last):
    ...
    quantrules._errors.RuleError: Rule.bwd_qtype is a training (QT) field but the rule has mode='ptq'; use mode='qt'
    """

    module_path: str = ".*"
    op_names: tuple[str, ...] = ()
    weight_qtype: str | None = None
    act_qtype: str | None = None
    bwd_qtype: str | None = None
    tile_size: int | float | None = None
    weight_calibration_method: str = "absmax"
    act_calibration_method: str | None = None
    act_batch_axes: tuple[int, ...] = (0,)
    act_static_scale: bool | None = None
    mode: Mode = "ptq"
    bwd_calibration_method: str = "absmax"
    bwd_weight_grad_tile_size: int | float | None = None
    disable_channelwise_axes: bool = False
    bwd_stochastic_rounding: str | None = None
    channelwise_noise_axes: tuple[int, ...] = (0,)
    additional_qt_config: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not isinstance(self.module_path, str):
            raise RuleError(f"Rule.module_path: expected a regex string, got {self.module_path!r}")
        try:
            set_(self, "_pattern", re.compile(self.module_path))
        except re.error as e:
            raise RuleError(
                f"Rule.module_path: invalid regular expression {self.module_path!r}: {e}"
            ) from None
        ops = (self.op_names,) if isinstance(self.op_names, str) else self.op_names
        try:
            ops = tuple(ops)
        except TypeError:
            raise RuleError(f"Rule.op_names: expected a sequence of op names, got {ops!r}") from None
        for op in ops:
            check_op(op, arg="Rule.op_names")
        set_(self, "op_names", ops)
        for field in ("weight_qtype", "act_qtype", "bwd_qtype"):
            value = getattr(self, field)
            if value is not None:
                try:
                    set_(self, field, get_qtype(value).name)
                except QuantRulesError as e:
                    raise RuleError(f"Rule.{field}: {e}") from None
        if self.mode not in ("ptq", "qt"):
            raise RuleError(f"Rule.mode: expected 'ptq' or 'qt', got {self.mode!r}")
        _check_tile("tile_size", self.tile_size)
        _check_tile("bwd_weight_grad_tile_size", self.bwd_weight_grad_tile_size)
        for field in ("weight_calibration_method", "act_calibration_method",
                      "bwd_calibration_method"):
            _check_calibration(field, getattr(self, field))
        set_(self, "act_batch_axes", _int_tuple("act_batch_axes", self.act_batch_axes))
        set_(self, "channelwise_noise_axes",
             _int_tuple("channelwise_noise_axes", self.channelwise_noise_axes))
        if self.act_static_scale is not None and not isinstance(self.act_static_scale, bool):
            raise RuleError(f"Rule.act_static_scale: expected a bool, got {self.act_static_scale!r}")
        if self.act_static_scale and self.act_qtype is None:
            raise RuleError(
                "Rule.act_static_scale is set but act_qtype is None; a static activation "
                "scale needs an activation qtype"
            )
        if self.bwd_stochastic_rounding not in (None, *_STOCHASTIC_ROUNDING):
            raise RuleError(
                f"Rule.bwd_stochastic_rounding: expected None or one of {_STOCHASTIC_ROUNDING}, "
                f"got {self.bwd_stochastic_rounding!r}"
            )
        if self.additional_qt_config is not None:
            if not isinstance(self.additional_qt_config, Mapping):
                raise RuleError(
                    "Rule.additional_qt_config: expected a mapping, got "
                    f"{self.additional_qt_config!r}"
                )
            set_(self, "additional_qt_config",
                 types.MappingProxyType(dict(self.additional_qt_config)))
        if self.mode == "ptq":
            for field, default in _QT_DEFAULTS.items():
                if getattr(self, field) != default:
                    raise RuleError(
                        f"Rule.{field} is a training (QT) field but the rule has mode='ptq'; "
                        "use mode='qt'"
                    )

    def __hash__(self) -> int:
        # Cached: resolve() hashes rules on every call.
        cached = self.__dict__.get("_hash")
        if cached is None:
            values = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
            try:
                cached = hash(tuple(
                    tuple(sorted(v.items())) if isinstance(v, Mapping) else v for v in values
                ))
            except TypeError:  # unhashable values inside additional_qt_config
                cached = hash(repr(values))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def pattern(self) -> re.Pattern[str]:
        """The compiled ``module_path``."""
        return self.__dict__["_pattern"]

    @property
    def disabled(self) -> bool:
        """True when no qtype is set: matching ops stay in float."""
        return self.weight_qtype is None and self.act_qtype is None and self.bwd_qtype is None

    def matches_op(self, op: str) -> bool:
        """Whether ``op`` is among ``op_names`` (``einsum`` also matches ``dot_general``)."""
        if not self.op_names:
            return True
        return any(name in self.op_names for name in OP_ALIASES.get(op, (op,)))

    def replace(self, **changes: Any) -> Rule:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def unsupported_stateless_fields(self) -> tuple[str, ...]:
        """Fields set that stateless consumers reject (they need state or RNG).

        >>> Rule(weight_qtype="int8", act_qtype="int8", act_static_scale=True
        ...      ).unsupported_stateless_fields()
        ('act_static_scale',)
        """
        out = []
        if self.act_static_scale:
            out.append("act_static_scale")
        if self.bwd_stochastic_rounding is not None:
            out.append("bwd_stochastic_rounding")
        return tuple(out)
