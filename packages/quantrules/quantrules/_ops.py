"""The registry of op names that rules may name.

Back-ends register the ops they resolve rules for. This is the one piece of
module-level mutable state in quantrules: rule validation must know the ops of
every back-end that is loaded, and back-ends are loaded independently.
"""

from __future__ import annotations

import re

from quantrules._errors import UnknownOpError

__all__ = ["OP_ALIASES", "known_ops", "register_op"]

_OPS: dict[str, None] = dict.fromkeys(
    ("dot_general", "einsum", "conv_general_dilated", "sparse_conv")
)

#: An op also matches rules naming these ops (einsum is a dot_general).
OP_ALIASES: dict[str, tuple[str, ...]] = {"einsum": ("einsum", "dot_general")}

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def known_ops() -> tuple[str, ...]:
    """The registered op names, in registration order.

    >>> known_ops()[:4]
    ('dot_general', 'einsum', 'conv_general_dilated', 'sparse_conv')
    """
    return tuple(_OPS)


def register_op(name: str) -> str:
    """Register an op name so rules may name it; idempotent.

    >>> register_op("ragged_dot")
    'ragged_dot'
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UnknownOpError(f"op name must be an identifier string, got {name!r}")
    _OPS.setdefault(name, None)
    return name


def check_op(name: str, *, arg: str = "op") -> str:
    if not isinstance(name, str) or name not in _OPS:
        raise UnknownOpError(
            f"{arg}: unknown op {name!r}; expected one of {', '.join(_OPS)} "
            "(back-ends add ops with quantrules.register_op)"
        )
    return name
