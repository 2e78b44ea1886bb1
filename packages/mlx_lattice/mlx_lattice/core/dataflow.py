"""Which dataflow a sparse convolution runs: forced explicitly, observed per call.

Dataflows (TorchSparse-style named units):

* ``"generic"``: output-stationary gather-GEMM over the output CSR; every
  dtype, shape and relation.
* ``"sorted"``: the sorted implicit GEMM (TorchSparse++'s sorted dataflow);
  square C32/C64 convolutions with at most 32 kernel offsets, any float dtype.
* ``"padded_c16"``: the output channels padded to a multiple of 16 with zero
  weight columns, run generic and sliced back; output widths that are not a
  multiple of 16.
* ``"denominator_csr"``: the normalization denominator as a dedicated
  output-CSR reduction instead of a full convolution of all-ones features.
* ``"quantized"``: convolution with a quantized weight (its only dataflow).

``"auto"`` (the default) keeps the rules in :mod:`mlx_lattice.core.ops`.
Forcing a dataflow makes every op that has it run it (and raise
``ValueError`` where it cannot apply); ops without it run ``"generic"``.

>>> import mlx.core as mx
>>> from mlx_lattice.core import build_kernel_relation, get_dataflow, ops
>>> from mlx_lattice.core import record_dataflows, use_dataflow
>>> rel = build_kernel_relation(mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32))
>>> f, w = mx.ones((2, 32), mx.float16), mx.ones((27, 32, 32), mx.float16)
>>> with record_dataflows() as runs, use_dataflow("generic"):
...     _ = ops.sparse_conv_features_from_relation(f, w, rel)
>>> runs
[('sparse_conv_features', 'generic')]
>>> get_dataflow()
'auto'
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, cast

from mlx_lattice._errors import MlxLatticeError

__all__ = [
    "DATAFLOWS",
    "Dataflow",
    "DataflowError",
    "get_dataflow",
    "record_dataflows",
    "set_dataflow",
    "use_dataflow",
]

#: A dataflow name (``"auto"`` lets the benchmarked rules choose).
Dataflow = Literal["auto", "generic", "sorted", "padded_c16", "denominator_csr", "quantized"]
#: Every accepted dataflow name, ``"auto"`` first.
DATAFLOWS: tuple[str, ...] = (
    "auto",
    "generic",
    "sorted",
    "padded_c16",
    "denominator_csr",
    "quantized",
)


class DataflowError(MlxLatticeError):
    """A forced dataflow does not apply to this call, or an unknown name."""


class _State(threading.local):
    def __init__(self) -> None:
        self.forced: str = "auto"
        self.recorders: list[list[tuple[str, str]]] = []


_STATE = _State()


def _check(name: object) -> str:
    if not isinstance(name, str) or name not in DATAFLOWS:
        raise DataflowError(f"dataflow must be one of {DATAFLOWS}, got {name!r}.")
    return name


def set_dataflow(name: Dataflow) -> None:
    """Force ``name`` for later calls in this thread (``"auto"`` restores the rules)."""
    _STATE.forced = _check(name)


def get_dataflow() -> Dataflow:
    """The dataflow forced in this thread, or ``"auto"``."""
    return cast(Dataflow, _STATE.forced)


@contextmanager
def use_dataflow(name: Dataflow) -> Iterator[None]:
    """Force ``name`` inside the ``with`` block (this thread), then restore."""
    previous = _STATE.forced
    _STATE.forced = _check(name)
    try:
        yield
    finally:
        _STATE.forced = previous


@contextmanager
def record_dataflows() -> Iterator[list[tuple[str, str]]]:
    """Collect ``(op, dataflow)`` for every op call in the block (this thread).

    Calls are recorded when the graph is built, not when it is evaluated; a
    gradient reuses the dataflow of its forward call.
    """
    runs: list[tuple[str, str]] = []
    _STATE.recorders.append(runs)
    try:
        yield runs
    finally:
        _STATE.recorders.remove(runs)


def note(op: str, dataflow: str) -> None:
    """Record that ``op`` runs ``dataflow`` (for the ops layer)."""
    for runs in _STATE.recorders:
        runs.append((op, dataflow))
