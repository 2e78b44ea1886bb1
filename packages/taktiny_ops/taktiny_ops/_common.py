"""Shared pieces of the ops: rule selection, QArray handling, result dtypes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import qwix

import quantrules
from quantrules import Resolution

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
