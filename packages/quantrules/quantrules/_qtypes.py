"""The qtype registry: canonical names, aliases and what each back-end calls them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from quantrules._errors import UnknownQTypeError, UnsupportedQTypeError

__all__ = ["QType", "get_qtype", "qtype_names"]

Kind = Literal["integer", "float", "lookup_table"]


@dataclasses.dataclass(frozen=True)
class QType:
    """One quantized number format.

    Attributes:
      name: canonical name, e.g. ``"int8"``.
      bits: storage bits per element.
      signed: whether the format represents negative values.
      kind: ``"integer"``, ``"float"`` or ``"lookup_table"`` (e.g. NF4).
      qwix_name: how Qwix spells it (a JAX dtype name or a Qwix string).
      aliases: other accepted names (case-insensitive).
      mlx_mode: the ``mode`` of ``mx.quantize``, or ``None`` if MLX has no
        equivalent format.
      mlx_group_size: the default ``group_size`` in that mode.
      block_size: the format's intrinsic block size (MX / NV formats), else None.
    """

    name: str
    bits: int
    signed: bool
    kind: Kind
    qwix_name: str
    aliases: tuple[str, ...] = ()
    mlx_mode: str | None = None
    mlx_group_size: int | None = None
    block_size: int | None = None

    def mlx_quantize_args(self, tile_size: int | float | None = None) -> dict[str, Any]:
        """The ``mx.quantize`` arguments (``bits``, ``group_size``, ``mode``).

        ``tile_size`` (a rule's tile size along the contraction axis) becomes
        the group size; ``None`` uses the mode's default.

        >>> get_qtype("int4").mlx_quantize_args(tile_size=32)
        {'bits': 4, 'group_size': 32, 'mode': 'affine'}
        >>> get_qtype("nf4").mlx_quantize_args()
        Traceback (most recent call last):
        ...
        quantrules._errors.UnsupportedQTypeError: qtype 'nf4' (lookup_table, 4 bits) cannot be represented by MLX's mx.quantize: MLX has no lookup-table mode; use int4 or mxfp4 for MLX
        """
        if self.mlx_mode is None:
            raise UnsupportedQTypeError(
                f"qtype {self.name!r} ({self.kind}, {self.bits} bits) cannot be represented "
                f"by MLX's mx.quantize: {_MLX_REASONS[self.name]}"
            )
        group = self.mlx_group_size
        if tile_size is not None:
            if isinstance(tile_size, float) or self.block_size is not None:
                if tile_size != self.block_size:
                    raise UnsupportedQTypeError(
                        f"tile_size={tile_size!r} cannot be used with qtype {self.name!r} on "
                        f"MLX: expected an integer group size"
                        + (f" equal to the format's block of {self.block_size}"
                           if self.block_size else "")
                    )
            elif tile_size not in _MLX_AFFINE_GROUPS:
                raise UnsupportedQTypeError(
                    f"tile_size={tile_size!r} is not an MLX group size for qtype "
                    f"{self.name!r}: expected one of {_MLX_AFFINE_GROUPS}"
                )
            group = int(tile_size)
        return {"bits": self.bits, "group_size": group, "mode": self.mlx_mode}


_MLX_AFFINE_GROUPS = (32, 64, 128)
_MLX_REASONS = {
    "float8_e4m3fn": "MLX quantizes fp8 only as mxfp8 (block-scaled); use mxfp8",
    "float8_e5m2": "MLX has no e5m2 mode",
    "nf4": "MLX has no lookup-table mode; use int4 or mxfp4 for MLX",
}


def _int(name: str, bits: int, signed: bool, aliases: tuple[str, ...] = ()) -> QType:
    return QType(name, bits, signed, "integer", name, aliases, "affine", 64)


_REGISTRY: tuple[QType, ...] = (
    _int("int2", 2, True),
    _int("int3", 3, True),
    _int("int4", 4, True),
    _int("int5", 5, True),
    _int("int6", 6, True),
    _int("int8", 8, True),
    _int("uint4", 4, False),
    _int("uint8", 8, False),
    QType("float8_e4m3fn", 8, True, "float", "float8_e4m3fn", ("fp8", "float8", "e4m3")),
    QType("float8_e5m2", 8, True, "float", "float8_e5m2", ("e5m2",)),
    QType("nf4", 4, True, "lookup_table", "nf4"),
    QType("mxfp4", 4, True, "float", "mxfp4", (), "mxfp4", 32, 32),
    QType("mxfp8", 8, True, "float", "mxfp8", (), "mxfp8", 32, 32),
    QType("nvfp4", 4, True, "float", "nvfp4", (), "nvfp4", 16, 16),
)

_BY_NAME: Mapping[str, QType] = {
    key: qt for qt in _REGISTRY for key in (qt.name, *qt.aliases)
}


def qtype_names() -> tuple[str, ...]:
    """The canonical qtype names, in registry order.

    >>> qtype_names()[:3]
    ('int2', 'int3', 'int4')
    """
    return tuple(qt.name for qt in _REGISTRY)


def get_qtype(name: str | QType) -> QType:
    """Look up a qtype by canonical name or alias, case-insensitively.

    >>> get_qtype("FP8").name
    'float8_e4m3fn'
    >>> get_qtype("int9")
    Traceback (most recent call last):
    ...
    quantrules._errors.UnknownQTypeError: unknown qtype 'int9'; expected one of int2, int3, int4, int5, int6, int8, uint4, uint8, float8_e4m3fn, float8_e5m2, nf4, mxfp4, mxfp8, nvfp4 (aliases: fp8, float8, e4m3, e5m2)
    """
    if isinstance(name, QType):
        return name
    if not isinstance(name, str):
        raise UnknownQTypeError(f"qtype must be a string, got {type(name).__name__} {name!r}")
    found = _BY_NAME.get(name.strip().lower())
    if found is None:
        aliases = ", ".join(a for qt in _REGISTRY for a in qt.aliases)
        raise UnknownQTypeError(
            f"unknown qtype {name!r}; expected one of {', '.join(qtype_names())} "
            f"(aliases: {aliases})"
        )
    return found
