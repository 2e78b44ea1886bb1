"""The error family of mlx_lattice: every bad-input error is a subclass of
:class:`MlxLatticeError` (itself a ``ValueError``), so ``except ValueError``
callers keep working and ``except MlxLatticeError`` catches them all.

>>> from mlx_lattice import MlxLatticeError, SparseTensorError
>>> issubclass(SparseTensorError, MlxLatticeError), issubclass(MlxLatticeError, ValueError)
(True, True)
"""

from __future__ import annotations

__all__ = ["MlxLatticeError", "MlxLatticeTypeError"]


class MlxLatticeError(ValueError):
    """Base class of mlx_lattice's bad-input errors (a ``ValueError``).

    The native layer's argument checks (``std::invalid_argument`` in C++)
    arrive as this class too; the message names the op and the argument.
    """


class MlxLatticeTypeError(MlxLatticeError, TypeError):
    """An argument of the wrong type (also a ``TypeError``)."""
