"""Sparse algebra: binary ops and concatenation of tensors on different
coordinate sets (joins), and collation with duplicate reduction.

Joins (rows are matched exactly on ``(batch, x, y, z)``; both tensors must
have the same tensor stride):

* ``"left"``: ``a``'s rows, in ``a``'s order (the result shares ``a``'s
  coordinate set); ``"right"``: ``b``'s rows, in ``b``'s order;
* ``"inner"``: ``a``'s rows that ``b`` also has, in ``a``'s order;
* ``"outer"``: ``a``'s rows, then ``b``'s rows missing from ``a`` in ``b``'s order.

A side without a row contributes ``fill``. Results are differentiable in
both operands' features (gathers and selects, whose gradients scatter back
to the rows used). The Python operators ``+ - *`` on :class:`SparseTensor`
use ``join="outer"`` with ``fill=0`` (absent rows are zeros, as in a sparse
tensor); numbers and arrays apply to the features.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import mlx.core as mx
import numpy as np

from mlx_lattice._native import ext
from mlx_lattice.tensor import SparseTensor, SparseTensorError

__all__ = [
    "Join",
    "add",
    "align",
    "cat",
    "collate",
    "maximum",
    "minimum",
    "mul",
    "sub",
]

#: Which rows a binary op keeps: both inputs' ("inner"), the first's ("left"),
#: the second's ("right") or either's ("outer").
Join = Literal["inner", "left", "right", "outer"]
_JOINS = ("inner", "left", "right", "outer")


def _check_pair(a: SparseTensor, b: SparseTensor, join: str) -> None:
    if not isinstance(a, SparseTensor) or not isinstance(b, SparseTensor):
        raise SparseTensorError(
            f"a and b must be SparseTensors, got {type(a).__name__} and {type(b).__name__}."
        )
    if join not in _JOINS:
        raise SparseTensorError(f"join must be one of {_JOINS}, got {join!r}.")
    if a.tensor_stride != b.tensor_stride:
        raise SparseTensorError(
            f"a and b must have the same tensor_stride, got {a.tensor_stride} and {b.tensor_stride}."
        )


def _same_set(a: SparseTensor, b: SparseTensor) -> bool:
    return a.coords is b.coords or (a.manager is b.manager and a.coordinate_key == b.coordinate_key)


def align(
    a: SparseTensor, b: SparseTensor, join: Join = "outer"
) -> tuple[mx.array, mx.array, mx.array]:
    """The joined coordinates and, per joined row, its row in ``a`` and in ``b`` (or -1).

    >>> a = SparseTensor(mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32), mx.ones((2, 1)))
    >>> b = SparseTensor(mx.array([[0, 2, 0, 0], [0, 1, 0, 0]], dtype=mx.int32), mx.ones((2, 1)))
    >>> coords, ra, rb = align(a, b, "outer")
    >>> coords[:, 1].tolist(), ra.tolist(), rb.tolist()
    ([0, 1, 2], [0, 1, -1], [-1, 1, 0])
    """
    _check_pair(a, b, join)
    na, nb = a.num_points, b.num_points
    if _same_set(a, b):
        rows = mx.arange(na, dtype=mx.int32)
        return a.coords, rows, rows
    ac = np.ascontiguousarray(np.asarray(a.coords))
    bc = np.ascontiguousarray(np.asarray(b.coords))
    if join == "right":
        return b.coords, ext.coords_lookup(ac, bc), mx.arange(nb, dtype=mx.int32)
    b_of_a = np.asarray(ext.coords_lookup(bc, ac))
    if join == "left":
        return a.coords, mx.arange(na, dtype=mx.int32), mx.array(b_of_a)
    if join == "inner":
        keep = np.flatnonzero(b_of_a >= 0).astype(np.int32)
        return mx.array(ac[keep]), mx.array(keep), mx.array(b_of_a[keep])
    b_only = np.flatnonzero(np.asarray(ext.coords_lookup(ac, bc)) < 0).astype(np.int32)
    coords = np.concatenate([ac, bc[b_only]])
    rows_a = np.concatenate([np.arange(na, dtype=np.int32), np.full(len(b_only), -1, np.int32)])
    rows_b = np.concatenate([b_of_a.astype(np.int32), b_only])
    return mx.array(coords), mx.array(rows_a), mx.array(rows_b)


def _gather(feats: mx.array, rows: mx.array, fill: float) -> mx.array:
    if feats.shape[0] == 0:
        return mx.full((rows.shape[0], feats.shape[1]), fill, dtype=feats.dtype)
    taken = mx.take(feats, mx.maximum(rows, 0), axis=0)
    return mx.where((rows >= 0)[:, None], taken, mx.array(fill, dtype=feats.dtype))


def _result(
    a: SparseTensor, b: SparseTensor, join: str, coords: mx.array, feats: mx.array
) -> SparseTensor:
    if join == "left" or _same_set(a, b):
        return a.replace(feats)
    if join == "right":
        return b.replace(feats)
    manager = a.manager
    key = manager.register(coords, a.tensor_stride, manager.new_tag())
    return SparseTensor(
        coords,
        feats,
        tensor_stride=a.tensor_stride,
        manager=manager,
        coordinate_key=key,
        check=False,
    )


def _binary(op: Callable[[mx.array, mx.array], mx.array], name: str) -> Callable[..., SparseTensor]:
    def fn(
        a: SparseTensor, b: SparseTensor, *, join: Join = "outer", fill: float = 0.0
    ) -> SparseTensor:
        _check_pair(a, b, join)
        if a.num_channels != b.num_channels:
            raise SparseTensorError(
                f"{name}: a and b must have the same channels, got {a.num_channels} and {b.num_channels}."
            )
        coords, rows_a, rows_b = align(a, b, join)
        feats = op(_gather(a.feats, rows_a, fill), _gather(b.feats, rows_b, fill))
        return _result(a, b, join, coords, feats)

    fn.__name__ = name
    fn.__qualname__ = name
    return fn


add = _binary(mx.add, "add")
add.__doc__ = """``a + b`` over a join (see the module doc).

>>> a = SparseTensor(mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32), mx.array([[1.0], [2.0]]))
>>> b = SparseTensor(mx.array([[0, 2, 0, 0], [0, 1, 0, 0]], dtype=mx.int32), mx.array([[10.0], [20.0]]))
>>> add(a, b, join="outer").feats.tolist(), add(a, b, join="inner").feats.tolist()
([[1.0], [22.0], [10.0]], [[22.0]])
>>> add(a, b, join="right", fill=-1.0).feats.tolist()
[[9.0], [22.0]]
"""
sub = _binary(mx.subtract, "sub")
sub.__doc__ = """``a - b`` over a join (see the module doc).

>>> a = SparseTensor(mx.array([[0, 0, 0, 0]], dtype=mx.int32), mx.array([[1.0]]))
>>> b = SparseTensor(mx.array([[0, 1, 0, 0]], dtype=mx.int32), mx.array([[5.0]]))
>>> sub(a, b).feats.tolist()
[[1.0], [-5.0]]
"""
mul = _binary(mx.multiply, "mul")
mul.__doc__ = """``a * b`` over a join (see the module doc).

>>> a = SparseTensor(mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32), mx.array([[2.0], [3.0]]))
>>> b = SparseTensor(mx.array([[0, 1, 0, 0]], dtype=mx.int32), mx.array([[5.0]]))
>>> mul(a, b, join="left", fill=1.0).feats.tolist()
[[2.0], [15.0]]
"""
maximum = _binary(mx.maximum, "maximum")
maximum.__doc__ = """Elementwise maximum over a join (see the module doc).

>>> a = SparseTensor(mx.array([[0, 0, 0, 0]], dtype=mx.int32), mx.array([[-1.0]]))
>>> b = SparseTensor(mx.array([[0, 1, 0, 0]], dtype=mx.int32), mx.array([[-5.0]]))
>>> maximum(a, b, fill=-3.0).feats.tolist()
[[-1.0], [-3.0]]
"""
minimum = _binary(mx.minimum, "minimum")
minimum.__doc__ = """Elementwise minimum over a join (see the module doc).

>>> a = SparseTensor(mx.array([[0, 0, 0, 0]], dtype=mx.int32), mx.array([[-1.0]]))
>>> b = SparseTensor(mx.array([[0, 0, 0, 0]], dtype=mx.int32), mx.array([[-5.0]]))
>>> minimum(a, b).feats.tolist()
[[-5.0]]
"""


def cat(
    a: SparseTensor, b: SparseTensor, *, join: Join = "outer", fill: float = 0.0
) -> SparseTensor:
    """Concatenate channels ``[a | b]`` over a join; absent rows hold ``fill``.

    >>> a = SparseTensor(mx.array([[0, 0, 0, 0]], dtype=mx.int32), mx.array([[1.0]]))
    >>> b = SparseTensor(mx.array([[0, 1, 0, 0]], dtype=mx.int32), mx.array([[2.0, 3.0]]))
    >>> cat(a, b).feats.tolist()
    [[1.0, 0.0, 0.0], [0.0, 2.0, 3.0]]
    """
    coords, rows_a, rows_b = align(a, b, join)
    feats = mx.concatenate([_gather(a.feats, rows_a, fill), _gather(b.feats, rows_b, fill)], axis=1)
    return _result(a, b, join, coords, feats)


def collate(
    coords: Sequence[np.ndarray | mx.array],
    feats: Sequence[np.ndarray | mx.array],
    *,
    reduce: Literal["none", "mean", "sum", "max"] = "none",
) -> SparseTensor:
    """Batch per-sample ``(N_i, 3)`` coordinates and ``(N_i, C)`` features.

    Sample ``i`` gets batch index ``i``. Duplicate coordinates inside a
    sample raise with ``reduce="none"``; otherwise they are merged (``mean``,
    ``sum`` or ``max``; rows come out sorted by (batch, x, y, z)).
    Differentiable in the features.

    >>> x = collate([np.array([[1, 0, 0], [0, 0, 0], [1, 0, 0]])], [mx.array([[1.0], [2.0], [5.0]])], reduce="mean")
    >>> x.coords.tolist(), x.feats.tolist()
    ([[0, 0, 0, 0], [0, 1, 0, 0]], [[2.0], [3.0]])
    """
    if reduce not in ("none", "mean", "sum", "max"):
        raise SparseTensorError(f"reduce must be 'none', 'mean', 'sum' or 'max', got {reduce!r}.")
    if len(coords) != len(feats):
        raise SparseTensorError(f"got {len(coords)} coordinate sets but {len(feats)} feature sets.")
    rows, values = [], []
    for i, (c, f) in enumerate(zip(coords, feats, strict=True)):
        c = np.asarray(c)
        if c.ndim != 2 or c.shape[1] != 3 or not np.issubdtype(c.dtype, np.integer):
            raise SparseTensorError(
                f"coords[{i}] must be (N, 3) integers, got {c.dtype} {c.shape}."
            )
        f = f if isinstance(f, mx.array) else mx.array(np.asarray(f, dtype=np.float32))
        if f.ndim != 2 or f.shape[0] != len(c):
            raise SparseTensorError(f"feats[{i}] must be ({len(c)}, C), got {tuple(f.shape)}.")
        rows.append(np.concatenate([np.full((len(c), 1), i), c], axis=1))
        values.append(f)
    if not rows:
        raise SparseTensorError("collate needs at least one sample.")
    keys = np.ascontiguousarray(np.concatenate(rows).astype(np.int32))
    all_feats = mx.concatenate(values, axis=0)
    if reduce == "none":
        return SparseTensor(keys, all_feats)  # raises on duplicates, naming both rows
    raw = ext.coords_unique(keys)
    merged = ext.geometry_voxelize(
        all_feats, raw["offsets"], raw["members"], raw["inverse"], reduce
    )
    return SparseTensor(raw["coords"], merged, check=False)


def _operator(
    op: str, a: SparseTensor, other: SparseTensor | mx.array | float, reflected: bool = False
) -> SparseTensor:
    """The Python operators of :class:`SparseTensor` (``add``, ``sub``, ``mul``)."""
    if isinstance(other, SparseTensor):
        fn = {"add": add, "sub": sub, "mul": mul}[op]
        return fn(other, a) if reflected else fn(a, other)
    arith = {"add": mx.add, "sub": mx.subtract, "mul": mx.multiply}[op]
    return a.replace(arith(other, a.feats) if reflected else arith(a.feats, other))
