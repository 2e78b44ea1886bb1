"""`einsum`."""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import qwix

from taktiny_ops import _kernels as K
from taktiny_ops import _qwix_private as P
from taktiny_ops._common import (
    DENSE,
    TaktinyOpsError,
    check_backend_support,
    check_qt_sharding,
    dequantize,
    eager_jit,
    finish,
    is_qarray,
    prepare,
    result_dtype,
    select_rule,
)
from taktiny_ops._dot import _qt_config, ptq_contract

__all__ = ["einsum"]

_TERM = re.compile(r"[A-Za-z]*(\.\.\.)?[A-Za-z]*")


def _check_subscripts(subscripts: Any, operands: tuple) -> None:
    if not isinstance(subscripts, str):
        raise TaktinyOpsError(
            f"subscripts: expected an einsum equation string, got {type(subscripts).__name__}"
        )
    spec = subscripts.replace(" ", "")
    inputs, _, output = spec.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(operands):
        raise TaktinyOpsError(
            f"subscripts: {subscripts!r} names {len(terms)} operand(s) but {len(operands)} "
            "were given"
        )
    sizes: dict[str, int] = {}
    ellipses: list[tuple[int, tuple[int, ...]]] = []
    for i, (term, op) in enumerate(zip(terms, operands, strict=True)):
        if not _TERM.fullmatch(term):
            raise TaktinyOpsError(f"subscripts: term {term!r} of {subscripts!r} is not valid")
        letters = term.replace("...", "")
        ndim = len(op.shape)
        if ("..." in term and len(letters) > ndim) or ("..." not in term and len(letters) != ndim):
            raise TaktinyOpsError(
                f"subscripts: term {term!r} does not fit operand {i} of shape {tuple(op.shape)}"
            )
        head = term.split("...")[0]
        tail = term.split("...")[1] if "..." in term else ""
        dims = list(op.shape[:len(head)]) + (list(op.shape[ndim - len(tail):]) if tail else [])
        if "..." in term:
            ellipses.append((i, tuple(op.shape[len(head):ndim - len(tail)])))
        for letter, dim in zip(head + tail, dims, strict=True):
            if sizes.setdefault(letter, dim) != dim and 1 not in (dim, sizes[letter]):
                raise TaktinyOpsError(
                    f"subscripts: index {letter!r} has size {sizes[letter]} in one operand and "
                    f"{dim} in operand {i}"
                )
    width = max((len(shape) for _, shape in ellipses), default=0)
    for k in range(1, width + 1):  # NumPy broadcasting, from the right
        if len({shape[-k] for _, shape in ellipses if len(shape) >= k} - {1}) > 1:
            shown = ", ".join(f"{shape} in operand {i}" for i, shape in ellipses)
            raise TaktinyOpsError(
                f"subscripts: the dimensions '...' stands for do not broadcast: {shown}"
            )
    if output and not _TERM.fullmatch(output):
        raise TaktinyOpsError(f"subscripts: output {output!r} of {subscripts!r} is not valid")


def _sum_private_indices(subscripts: str, act: jax.Array,
                         weight: jax.Array) -> tuple[str, jax.Array, jax.Array]:
    """Sum out each index that only one operand has and the output lacks.

    Qwix's einsum contracts two operands without such a reduction and returns
    the wrong shape (``'ab,b->'`` gives shape ``(a,)``), and jnp.einsum's own
    pre-reduction hides the operands from the QT path; reduced first (in
    float, before quantization) both are the two-operand contraction they
    expect. An implicit output (no ``->``) has no such index.
    """
    spec = subscripts.replace(" ", "")
    inputs, arrow, output = spec.partition("->")
    if not arrow:
        return subscripts, act, weight
    terms = inputs.split(",")
    operands = [act, weight]
    changed = False
    for i, term in enumerate(terms):
        other = terms[1 - i]
        head, _, tail = term.partition("...")
        ndim = len(operands[i].shape)
        positions = {**{c: k for k, c in enumerate(head)},
                     **{c: ndim - len(tail) + k for k, c in enumerate(tail)}}
        private = [c for c in dict.fromkeys(head + tail)
                   if c not in other and c not in output and (head + tail).count(c) == 1]
        if private:
            operands[i] = jnp.sum(dequantize(operands[i]),
                                  axis=tuple(positions[c] for c in private))
            terms[i] = "".join(c for c in term if c not in private)
            changed = True
    if not changed:
        return subscripts, act, weight
    return f"{','.join(terms)}->{output}", operands[0], operands[1]


def _contracted(subscripts: str) -> set[str]:
    """The indices both operands share that the output lacks."""
    spec = subscripts.replace(" ", "")
    inputs, arrow, output = spec.partition("->")
    a, b = (set(t.replace("...", "")) for t in inputs.split(","))
    if not arrow:
        return a & b
    return (a & b) - set(output)


def _plain_layout(subscripts: str, out_sharding: Any) -> str | None:
    """None for ``x[..., K] @ w[K, N]`` written as an einsum ('...k,kn->...n',
    'btk,kn->btn'), else why the Pallas kernels cannot run it."""
    if out_sharding is not None:
        return "the Pallas kernels take no out_sharding"
    inputs, _, output = subscripts.replace(" ", "").partition("->")
    act, weight = inputs.split(",")
    letters = act.replace("...", "")
    plain = (len(weight) == 2 and act.endswith(weight[0]) and weight[1] not in act
             and len(set(letters)) == len(letters) and output == act[:-1] + weight[1])
    if plain:
        return None
    return f"einsum {subscripts!r} is not an x[..., K] @ w[K, N] contraction"


def _qt_einsum(subscripts: str, act: jax.Array, weight: jax.Array, rule: Any,
               precision: Any) -> jax.Array:
    """Qwix's QT einsum: jnp.einsum with a training dot_general, roles kept by identity."""

    def qt_dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                       preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
        if lhs is act and rhs is weight:
            roles = (False, True)
        elif lhs is weight and rhs is act:
            roles = (True, False)
        else:
            raise TaktinyOpsError(
                f"subscripts: jnp.einsum transforms the operands of {subscripts!r} before "
                "contracting, which hides which one is the weight; write the contraction "
                "so that each operand enters the dot product unchanged"
            )
        config = _qt_config(rule, *roles)
        return P.dot_general_qt(lhs, rhs, dimension_numbers, config)

    with jax.disable_jit():
        return jnp.einsum(subscripts, act, weight, precision=precision,
                          _dot_general=qt_dot_general)


@eager_jit(("operands",))
def einsum(
    subscripts: str,
    *operands: Any,
    quant: Any = None,
    module_path: str = "",
    optimize: Any = "auto",
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
    kernel: str = "qwix",
) -> jax.Array:
    """Evaluate an Einstein summation with optional quantized contractions.

    Uses the string-equation form of :func:`jax.numpy.einsum`. With ``quant``
    and ``out_sharding`` unset, QArray inputs select ``qwix.einsum`` (which
    manages its own contraction path: ``optimize`` must be ``'auto'``); with
    ``out_sharding`` set and no ``quant``, QArrays are dequantized and the
    dense einsum runs. ``quant`` rules match op ``einsum`` or ``dot_general``.
    In two-operand expressions the first operand is the activation and the
    second the weight, whatever order JAX contracts them in. With a rule,
    at most two operands are allowed; unary expressions stay plain JAX. An
    index that only one operand has and the output lacks is summed out of
    that operand (in float) before quantization. Note that Qwix's own
    providers ignore an activation-only rule; here it quantizes the
    activation.

    Under a PTQ rule, an operand given as a QArray laid out as the rule would
    quantize it (for the weight: :func:`quantize_weight` with op ``'einsum'``
    and these subscripts) is used as is, and the result is bitwise what
    :class:`QuantizedEinsum` computes; other QArrays are dequantized and
    quantized again. ``kernel`` is the switch of :func:`linear`; the Pallas
    kernels run ``x[..., K] @ w[K, N]`` contractions (``'btk,kn->btn'``).

    >>> einsum('...i,io->...o', jnp.ones((2, 3)), jnp.ones((3, 4))).shape
    (2, 4)
    """
    K.check_switch(kernel, "kernel")
    _check_subscripts(subscripts, operands)
    res = select_rule(quant, module_path, "einsum")
    dtype = result_dtype(operands, quant_set=quant is not None,
                         preferred_element_type=preferred_element_type)
    operands = tuple(prepare(op, dtype) for op in operands)
    has_q = any(is_qarray(op) for op in operands)
    if res is None and has_q and out_sharding is None:
        if optimize != "auto":
            raise TaktinyOpsError(
                f"optimize: QArray inputs without quant need optimize='auto' (Qwix manages "
                f"its own contraction path), got {optimize!r}"
            )
        out = qwix.einsum(subscripts, *operands, precision=precision)
    elif res is None or res == DENSE or len(operands) == 1:
        out = jnp.einsum(subscripts, *map(dequantize, operands), optimize=optimize,
                         precision=precision, preferred_element_type=preferred_element_type,
                         out_sharding=out_sharding)
    else:
        if len(operands) != 2:
            raise TaktinyOpsError(
                f"operands: a quantization rule needs a two-operand expression (activation, "
                f"weight), got {len(operands)} operands for {subscripts!r}"
            )
        check_qt_sharding(res, out_sharding)
        act, weight = operands
        rule = res.rule
        check_backend_support(rule, False, True)
        given = subscripts
        subscripts, act, weight = _sum_private_indices(subscripts, act, weight)
        if rule.tile_size is not None and not _contracted(subscripts):
            raise TaktinyOpsError(
                f"quant: rule #{res.index} sets tile_size={rule.tile_size} but {given!r} "
                "contracts no index to tile"
            )
        if 0 in act.shape or 0 in weight.shape:
            # An empty operand has no scale: the exact result is empty or zeros.
            out = jnp.einsum(subscripts, dequantize(act), dequantize(weight), precision=precision)
        elif res.mode == "qt":
            out = _qt_einsum(subscripts, dequantize(act), dequantize(weight), rule, precision)
        else:  # qwix.einsum mishandles out_sharding; finish() reshards instead
            out = ptq_contract(
                act, weight, res, weights=(False, True), names=("the activation", "the weight"),
                kernel=kernel, layout=_plain_layout(subscripts, out_sharding),
                how=functools.partial(P.einsum_how, einsum_str=subscripts,
                                      ndims=(len(act.shape), len(weight.shape)),
                                      tile_size=rule.tile_size),
                qwix_op=functools.partial(qwix.einsum, subscripts, precision=precision))
    return finish(out, dtype, out_sharding)

