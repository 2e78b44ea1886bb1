"""`dot_general` and `linear`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import qwix

from taktiny_ops import _kernels as K
from taktiny_ops import _qwix_private as P
from taktiny_ops._common import (
    DENSE,
    TaktinyOpsError,
    calibration,
    check_backend_support,
    check_qt_sharding,
    dequantize,
    eager_jit,
    finish,
    is_qarray,
    prepare,
    qt_fields,
    quantize_operand,
    result_dtype,
    select_rule,
)

__all__ = ["dot_general", "linear"]


def _check_dnums(lhs: Any, rhs: Any, dimension_numbers: Any) -> tuple:
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(a) for a in axes) for axes in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise TaktinyOpsError(
            "dimension_numbers: expected ((lhs_contracting, rhs_contracting), "
            f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}"
        ) from None
    for name, x, axes in (("lhs", lhs, lc + lb), ("rhs", rhs, rc + rb)):
        ndim = len(x.shape)
        bad = [a for a in axes if not -ndim <= a < ndim]
        if bad:
            raise TaktinyOpsError(
                f"dimension_numbers: axis {bad[0]} is out of range for {name} of rank {ndim}"
            )
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise TaktinyOpsError(
            f"dimension_numbers: lhs and rhs need as many contracting and batch axes, got "
            f"{dimension_numbers!r}"
        )
    for kind, la, ra in (("contracting", lc, rc), ("batch", lb, rb)):
        for a, b in zip(la, ra, strict=True):
            if lhs.shape[a] != rhs.shape[b]:
                raise TaktinyOpsError(
                    f"dimension_numbers: {kind} dimension sizes differ: lhs axis {a} has "
                    f"{lhs.shape[a]}, rhs axis {b} has {rhs.shape[b]}"
                )
    return ((lc, rc), (lb, rb))


def _qt_config(rule: Any, lhs_weight: bool, rhs_weight: bool) -> Any:
    """Qwix's QtProvider config for one dot_general, operand roles given."""
    bwd = rule.bwd_qtype is not None
    config = P.DotGeneralQtConfig(
        **qt_fields(rule, lhs_weight, rhs_weight),
        tile_size=rule.tile_size,
        dlhs_tile_size=rule.bwd_weight_grad_tile_size if bwd and lhs_weight else None,
        drhs_tile_size=rule.bwd_weight_grad_tile_size if bwd and rhs_weight else None,
        dlhs_stochastic_rounding_noise_fn=None,
        drhs_stochastic_rounding_noise_fn=None,
        use_original_residuals=(rule.weight_qtype is not None or rule.act_qtype is not None)
        and not bwd,
    )
    if rule.additional_qt_config:
        config = dataclasses.replace(config, **dict(rule.additional_qt_config))
    return config


def as_is(x: Any, how: Any) -> bool:
    """True for a QArray laid out as quantizing its float value with ``how`` makes
    one (the same qtype, scale shape and zero point): it is used as given."""
    if not is_qarray(x):
        return False
    try:
        want = jax.eval_shape(lambda a: P.quantize(a, how),
                              jax.ShapeDtypeStruct(x.shape, x.scale.dtype))
    except ValueError:
        return False
    return (K.qtype_name(want.qtype) == K.qtype_name(x.qtype)
            and want.qvalue.dtype == x.qvalue.dtype
            and want.scale.shape == x.scale.shape
            and (want.zero_point is None) == (x.zero_point is None))


def quantize_or_keep(x: Any, how: Any, res: Any, operand: str) -> Any:
    """``x`` as is when it is a QArray that :func:`as_is` accepts, else its
    (dequantized) value quantized with ``how``."""
    return x if as_is(x, how) else quantize_operand(dequantize(x), how, res, operand)


def ptq_contract(lhs: Any, rhs: Any, res: Any, *, weights: tuple[bool, bool],
                 names: tuple[str, str], how: Any, kernel: str, layout: str | None,
                 qwix_op: Any) -> jax.Array:
    """The PTQ contraction of dot_general and einsum: ``rhs`` quantized (a
    matching QArray kept), then the Pallas kernel where the ``kernel`` switch
    chooses one and the operands fit it, else ``lhs`` quantized too and
    ``qwix_op(lhs, rhs)``. ``weights`` marks the weight operands, ``names``
    names both in errors, ``how(for_lhs=, qtype=, calibration_method=)`` is
    Qwix's quantization of one."""

    def quantized(x: Any, i: int) -> Any:
        qtype_method = calibration(res.rule, weights[i])
        if qtype_method is None:
            return dequantize(x)
        return quantize_or_keep(x, how(for_lhs=i == 0, qtype=qtype_method[0],
                                       calibration_method=qtype_method[1]), res, names[i])

    rhs = quantized(rhs, 1)
    chosen, _ = K.choose(kernel, res, layout=layout, operands=(lhs, rhs))
    if chosen != K.QWIX:
        return K.matmul(chosen, dequantize(lhs), rhs, result_dtype(
            (lhs, rhs), quant_set=True, preferred_element_type=None))
    return qwix_op(quantized(lhs, 0), rhs)


def _plain_layout(lhs: Any, rhs: Any, dnums: Any, lhs_weight: bool, rhs_weight: bool,
                  out_sharding: Any) -> str | None:
    """None for ``x[..., K] @ w[K, N]`` (weight second, unsharded), else why not."""
    if out_sharding is not None:
        return "the Pallas kernels take no out_sharding"
    if lhs_weight or not rhs_weight or len(rhs.shape) != 2 or dnums != (
            ((len(lhs.shape) - 1,), (0,)), ((), ())):
        return "not an x[..., K] @ w[K, N] contraction with the weight second"
    return None


def quantized_dot_general(lhs: Any, rhs: Any, dnums: Any, res: Any, *, lhs_weight: bool,
                          rhs_weight: bool, precision: Any, out_sharding: Any,
                          kernel: str = "qwix") -> jax.Array:
    """The selected rule applied to the operands (PTQ or QT); a PTQ operand
    given as a QArray laid out as the rule would make it is used as is."""
    rule = res.rule
    check_backend_support(rule, lhs_weight, rhs_weight)
    if 0 in lhs.shape or 0 in rhs.shape:
        # An empty operand has no scale (Qwix divides by its size); the exact
        # result is empty or zeros, so nothing is quantized.
        return qwix.dot_general(dequantize(lhs), dequantize(rhs), dnums, precision=precision,
                                out_sharding=out_sharding)
    if rule.tile_size is not None and not dnums[0][0]:
        raise TaktinyOpsError(
            f"quant: rule #{res.index} sets tile_size={rule.tile_size} but dimension_numbers "
            f"{dnums!r} contract no axis to tile"
        )
    if res.mode == "qt":
        return P.dot_general_qt(dequantize(lhs), dequantize(rhs), dnums,
                                _qt_config(rule, lhs_weight, rhs_weight))
    return ptq_contract(
        lhs, rhs, res, weights=(lhs_weight, rhs_weight), names=("lhs", "rhs"), kernel=kernel,
        layout=_plain_layout(lhs, rhs, dnums, lhs_weight, rhs_weight, out_sharding),
        how=functools.partial(P.dot_how, dimension_numbers=dnums, tile_size=rule.tile_size,
                              ndims=(len(lhs.shape), len(rhs.shape))),
        qwix_op=functools.partial(qwix.dot_general, dimension_numbers=dnums,
                                  precision=precision, out_sharding=out_sharding))


@eager_jit(("lhs", "rhs"))
def dot_general(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    out_sharding: Any = None,
    quant: Any = None,
    module_path: str = "",
    lhs_weight: bool = False,
    rhs_weight: bool = True,
    kernel: str = "qwix",
) -> jax.Array:
    """Contract two operands using JAX or Qwix dot_general.

    ``dimension_numbers`` has the contracting and batch-axis layout of
    :func:`jax.lax.dot_general`. Dense inputs use JAX; without a rule, QArray
    inputs use Qwix. A selected ``quant`` rule (resolved through
    :mod:`quantrules` for op ``dot_general`` at ``module_path``) gives
    ``weight_qtype`` to the operands marked by ``lhs_weight`` / ``rhs_weight``
    and ``act_qtype`` to the others. A QT rule (``mode='qt'``, or a
    ``QtProvider``) uses Qwix's training kernel with ``bwd_qtype``; others use
    PTQ. QT does not support ``out_sharding``.

    Under a PTQ rule, an operand given as a QArray laid out as the rule would
    quantize it (the same qtype, scale shape and zero point; see
    :func:`quantize_weight`) is used as is, values trusted; any other QArray
    is dequantized and quantized again by the rule. Under a QT rule QArrays
    are dequantized.

    ``kernel`` is ``'qwix'`` (the Qwix-exact program), ``'pallas'`` (a Pallas
    kernel where one exists for the rule: see :func:`quantize`; it needs the
    layout ``x[..., K] @ w[K, N]`` with ``rhs_weight`` and no
    ``out_sharding``) or ``'auto'`` (``'pallas'`` on a TPU).

    The result is dense. Its dtype is ``preferred_element_type`` if given, else
    the promotion of the operand dtypes (QArray scale dtypes), with raw FP8
    promoted to BF16 and integer-only inputs with ``quant`` set to FP32.

    >>> dot_general(
    ...     jnp.ones((2, 3)), jnp.ones((3, 4)),
    ...     (((1,), (0,)), ((), ())),
    ... ).shape
    (2, 4)
    """
    K.check_switch(kernel, "kernel")
    dnums = _check_dnums(lhs, rhs, dimension_numbers)
    res = select_rule(quant, module_path, "dot_general")
    dtype = result_dtype((lhs, rhs), quant_set=quant is not None,
                         preferred_element_type=preferred_element_type)
    lhs, rhs = prepare(lhs, dtype), prepare(rhs, dtype)
    if res is None and (is_qarray(lhs) or is_qarray(rhs)):
        out = qwix.dot_general(lhs, rhs, dnums, precision=precision, out_sharding=out_sharding)
    elif res is None or res == DENSE:
        out = jax.lax.dot_general(
            dequantize(lhs), dequantize(rhs), dnums, precision=precision,
            preferred_element_type=preferred_element_type, out_sharding=out_sharding)
    else:
        check_qt_sharding(res, out_sharding)
        out = quantized_dot_general(lhs, rhs, dnums, res, lhs_weight=lhs_weight,
                                    rhs_weight=rhs_weight, precision=precision,
                                    out_sharding=out_sharding, kernel=kernel)
    return finish(out, dtype, out_sharding)


@eager_jit(("x", "w", "b"))
def linear(
    x: Any,
    w: Any,
    b: Any = None,
    *,
    quant: Any = None,
    module_path: str = "",
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
    kernel: str = "qwix",
) -> jax.Array:
    """Compute ``x @ w + b`` with optional quantized multiplication.

    ``x`` has shape ``(..., in)`` and ``w`` has shape ``(in, out)``; leading
    dimensions of ``x`` are kept. ``b`` must broadcast to the result; a
    quantized bias is dequantized before addition. ``quant`` accepts what
    :func:`dot_general` does (rules match op ``dot_general``); ``w`` takes
    ``weight_qtype`` and ``x`` takes ``act_qtype``. ``preferred_element_type``
    selects the returned dtype, also after the bias.

    A ``w`` from :func:`quantize_weight` (quantized once, as the PTQ layer
    :class:`QuantizedLinear` holds its kernel) is used as is, and the result
    is bitwise what that layer computes; a float ``w`` is quantized on every
    call. ``kernel`` switches the matmul: ``'qwix'`` (default, the Qwix-exact
    program), ``'pallas'`` (the Pallas weight-only or w8a8 kernel where one
    exists for the rule, Qwix elsewhere; interpret mode off a TPU) or
    ``'auto'`` (``'pallas'`` on a TPU backend).

    >>> linear(jnp.ones((2, 3)), jnp.ones((3, 4))).shape
    (2, 4)
    >>> linear(jnp.ones((2, 3)), jnp.ones((3, 4)), quant='int8',
    ...        preferred_element_type=jnp.bfloat16).dtype
    dtype(bfloat16)
    >>> from taktiny_ops import quantize_weight
    >>> wq = quantize_weight(jnp.ones((3, 4)), 'int8')
    >>> bool((linear(jnp.ones((2, 3)), wq, quant='int8')
    ...       == linear(jnp.ones((2, 3)), jnp.ones((3, 4)), quant='int8')).all())
    True
    """
    if len(x.shape) < 1:
        raise TaktinyOpsError(f"x: expected shape (..., in_features), got a scalar {x.shape}")
    if len(w.shape) != 2:
        raise TaktinyOpsError(f"w: expected shape (in_features, out_features), got {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise TaktinyOpsError(
            f"w: in_features {w.shape[0]} does not match the last axis of x, {x.shape[-1]}"
        )
    out_shape = (*x.shape[:-1], w.shape[1])
    if b is not None:
        try:
            jnp.broadcast_shapes(tuple(b.shape), out_shape)
        except ValueError:
            raise TaktinyOpsError(
                f"b: shape {tuple(b.shape)} does not broadcast to the result {out_shape}"
            ) from None
        if jnp.broadcast_shapes(tuple(b.shape), out_shape) != out_shape:
            raise TaktinyOpsError(f"b: shape {tuple(b.shape)} would grow the result {out_shape}")
    dnums = (((len(x.shape) - 1,), (0,)), ((), ()))
    dtype = result_dtype((x, w, b), quant_set=quant is not None,
                         preferred_element_type=preferred_element_type)
    y = dot_general(x, w, dnums, precision, None if b is not None else preferred_element_type,
                    out_sharding=out_sharding, quant=quant, module_path=module_path,
                    kernel=kernel)
    if b is not None:
        y = y + prepare(dequantize(b), dtype)
    return finish(y, dtype, out_sharding)
