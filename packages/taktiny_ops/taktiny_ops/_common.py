"""Shared pieces of the ops: rule selection, QArray handling, result dtypes."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import qwix

import quantrules
from quantrules import Resolution
from taktiny_ops import _qwix_private as P

__all__ = ["TaktinyOpsError"]

_FP8 = tuple(jnp.dtype(d) for d in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                      "float8_e5m2fnuz", "float8_e4m3b11fnuz"))
DENSE = "dense"  # a rule matched but disables quantization, or nothing matched


class TaktinyOpsError(ValueError):
    """Bad input to a taktiny_ops op; the message names the argument."""


def is_qarray(x: Any) -> bool:
    return isinstance(x, qwix.QArray)


def dequantize(x: Any) -> Any:
    return qwix.dequantize(x) if is_qarray(x) else x


def dtype_of(x: Any) -> jnp.dtype:
    """The logical dtype: a QArray's scale dtype, else the array's dtype."""
    if is_qarray(x):
        return jnp.dtype(x.scale.dtype)
    if isinstance(x, jax.Array):
        return x.dtype
    return jnp.dtype(jnp.result_type(x))


def result_dtype(operands: Sequence[Any], *, quant_set: bool,
                 preferred_element_type: Any) -> jnp.dtype:
    """The seed's dtype rules: preferred type wins; fp8 -> bf16; int + quant -> f32."""
    if preferred_element_type is not None:
        return jnp.dtype(preferred_element_type)
    dtypes = {dtype_of(o) for o in operands if o is not None}
    dt = dtypes.pop() if len(dtypes) == 1 else jnp.dtype(jnp.result_type(*dtypes))
    if dt in _FP8:
        return jnp.dtype(jnp.bfloat16)
    if quant_set and not jnp.issubdtype(dt, jnp.floating):
        return jnp.dtype(jnp.float32)
    return dt


def prepare(x: Any, target: jnp.dtype) -> Any:
    """Raw fp8 and (with quant set) integer inputs compute in the result dtype."""
    if is_qarray(x):
        return x
    if not isinstance(x, jax.Array):
        x = jnp.asarray(x)
    if x.dtype in _FP8 or not jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(target)
    return x


def select_rule(quant: Any, module_path: str, op: str) -> Resolution | str | None:
    """None (quant unset), DENSE (no quantizing rule), or the selected Resolution.

    Runs at trace time: under jit it costs nothing per call.
    """
    if quant is None:
        return None
    res = quantrules.resolve(quant, module_path=module_path, op=op)
    if res is None or res.disabled:
        return DENSE
    for field in res.rule.unsupported_stateless_fields():
        raise NotImplementedError(
            f"quant: rule #{res.index} sets {field}, which stateless taktiny_ops ops do not "
            "support (it needs stored calibration statistics or a random key)"
        )
    return res


_SUB_BYTE = ("int4", "uint4")


def check_backend_support(rule: quantrules.Rule, lhs_weight: bool, rhs_weight: bool) -> None:
    """XLA:CPU cannot contract two 4-bit integer operands; say so instead of an HLO error."""
    lhs = rule.weight_qtype if lhs_weight else rule.act_qtype
    rhs = rule.weight_qtype if rhs_weight else rule.act_qtype
    if lhs in _SUB_BYTE and rhs in _SUB_BYTE and jax.default_backend() == "cpu":
        raise NotImplementedError(
            f"quant: {lhs} x {rhs} contractions are not supported by XLA on CPU; quantize one "
            "operand to int8 (e.g. act_qtype='int8') or run on GPU/TPU"
        )


def quantize_operand(x: Any, how: Any, res: Resolution, operand: str) -> Any:
    """``qwix`` quantization of one operand; a rule Qwix cannot apply to this
    shape (e.g. a tile size that does not divide the contraction axis) is a
    TaktinyOpsError naming the rule and the operand, not Qwix's ValueError."""
    try:
        return P.quantize(x, how)
    except ValueError as err:
        raise TaktinyOpsError(
            f"quant: rule #{res.index} (tile_size={res.rule.tile_size}) cannot quantize "
            f"{operand} of shape {tuple(x.shape)}: {err}"
        ) from None


def check_qt_sharding(res: Resolution, out_sharding: Any) -> None:
    if res.mode == "qt" and out_sharding is not None:
        raise NotImplementedError(
            "out_sharding: QT (training) quantization does not support an explicit "
            "out_sharding; shard the inputs instead"
        )


def finish(out: jax.Array, dtype: jnp.dtype, out_sharding: Any) -> jax.Array:
    """Cast to the result dtype and make sure the requested sharding holds."""
    if out.dtype != dtype:
        out = out.astype(dtype)
    if out_sharding is not None:
        out = jax.sharding.reshard(out, out_sharding)
    return out


def calibration(rule: quantrules.Rule, is_weight: bool) -> tuple[Any, str] | None:
    """(Qwix qtype, calibration method) for one operand role, or None."""
    if is_weight:
        qtype, method = rule.weight_qtype, rule.weight_calibration_method
    else:
        qtype, method = rule.act_qtype, rule.act_calibration_method or "absmax"
    if qtype is None:
        return None
    return quantrules.qwix_qtype(qtype), method


def qt_fields(rule: quantrules.Rule, lhs_weight: bool, rhs_weight: bool) -> dict[str, Any]:
    """The fields of Qwix's QT configs that dot_general and the convolution
    share: each operand's qtype, calibration and channelwise axes, and its
    gradient's (``bwd_qtype``)."""
    fields: dict[str, Any] = {}
    for side, is_weight in (("lhs", lhs_weight), ("rhs", rhs_weight)):
        qtype, method = calibration(rule, is_weight) or (None, None)
        fields.update({
            f"{side}_qtype": qtype, f"{side}_calibration_method": method,
            f"{side}_collect_quant_stat": None,
            f"{side}_disable_channelwise_axes": rule.disable_channelwise_axes,
            f"d{side}_grad_qtype": quantrules.qwix_qtype(rule.bwd_qtype),
            f"d{side}_grad_calibration_method": rule.bwd_calibration_method,
            f"d{side}_grad_disable_channelwise_axes": rule.disable_channelwise_axes})
    return fields


F = TypeVar("F", bound=Callable[..., Any])


def _freeze(value: Any) -> Any:
    """Lists (e.g. dimension numbers, padding) as tuples, so they can be static."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _canonical_quant(quant: Any) -> Any:
    """A hashable ``quant`` that resolves exactly as the given one."""
    if quant is None or isinstance(quant, str | quantrules.Rule):
        return quant
    return canonical_rules(quant)


def canonical_rules(quant: Any) -> Any:
    """``quant``'s rule set as a hashable value the ops accept: a rule tuple or a provider."""
    rules, mode = quantrules.as_rules(quant)
    if mode is None:
        return rules
    return quantrules.QtProvider(rules) if mode == "qt" else quantrules.PtqProvider(rules)


def _eager_jit_enabled() -> bool:
    return os.environ.get("TAKTINY_OPS_EAGER_JIT") != "0"


def eager_jit(array_params: Sequence[str]) -> Callable[[F], F]:
    """Run an op called outside any JAX transformation as one cached ``jax.jit``.

    Called eagerly, an op would dispatch each of its JAX/Qwix primitives
    separately (tens of microseconds each); instead its arrays (the
    ``array_params``) become the jitted function's arguments and everything
    else (rules, dimension numbers, dtypes, shardings) static, so a repeated
    call is one compiled dispatch. Under a transformation (tracer inputs) the
    op runs inline, so a user's ``jax.jit`` sees exactly the hand-written
    program. ``TAKTINY_OPS_EAGER_JIT=0`` turns this off (op-by-op eager).
    """
    array_order = tuple(array_params)
    array_params = frozenset(array_params)

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        params = list(signature.parameters.values())
        positional = [
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        var_positional = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
        names = {p.name for p in params if p.kind != p.VAR_POSITIONAL}
        defaults = {p.name: p.default for p in params if p.default is not p.empty}
        required = {p.name for p in params if p.default is p.empty and p.kind != p.VAR_POSITIONAL}

        def bind(args: tuple, kwargs: dict) -> dict[str, Any] | None:
            """Argument values by name (inspect's bind is ~30 µs); None: let fn raise."""
            values = dict(defaults)
            if var_positional is None and len(args) > len(positional):
                return None
            values.update(zip(positional, args, strict=False))
            if var_positional is not None:
                values[var_positional] = tuple(args[len(positional):])
            for key, value in kwargs.items():
                if key not in names or key in positional[: len(args)]:
                    return None
                values[key] = value
            return values if required <= values.keys() else None

        def call(values: dict[str, Any]) -> Any:
            args = [values[name] for name in positional]
            if var_positional is not None:
                args.extend(values[var_positional])
            kwargs = {k: v for k, v in values.items() if k not in positional and k != var_positional}
            return fn(*args, **kwargs)

        def traced(key: tuple[tuple[str, ...], tuple[tuple[str, Any], ...]], *arrays: Any) -> Any:
            present, statics = key
            values = {**dict(statics), **{name: None for name in array_order}}
            values.update(zip(present, arrays, strict=True))
            return call(values)

        @functools.lru_cache(maxsize=256)
        def compiled_for(key: tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]) -> Any:
            # One jitted function per static configuration, called with
            # positional arrays only: JAX's fastest dispatch path.
            return jax.jit(functools.partial(traced, key))

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = bind(args, kwargs)
            if values is None or not _eager_jit_enabled():
                return fn(*args, **kwargs)
            # Absent optional arrays (None) stay out of the call: each argument costs.
            present = tuple(name for name in array_order if values[name] is not None)
            arrays = [values[name] for name in present]
            if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(arrays)):
                return fn(*args, **kwargs)
            statics = tuple(
                (k, _canonical_quant(v) if k == "quant" else _freeze(v))
                for k, v in values.items()
                if k not in array_params
            )
            try:
                compiled = compiled_for((present, statics))
            except TypeError:  # an unhashable static argument: run op by op
                return fn(*args, **kwargs)
            return compiled(*arrays)

        return wrapper  # type: ignore[return-value]

    return decorate
