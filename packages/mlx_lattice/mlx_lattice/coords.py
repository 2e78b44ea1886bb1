"""Coordinate algebra on ``(N, 4)`` int32 sets (batch, x, y, z).

Every op is exact (full-coordinate comparisons; no lossy hashing),
batch-aware (rows of different batches never match) and deterministic:
sets come out sorted by ``(batch, x, y, z)`` unless stated otherwise. The
heavy parts (sorting, hashing, merging, Morton codes) are native.

Where the default stream is a GPU one, :func:`lookup_coords`,
:func:`contains_coords`, :func:`union_coords`, :func:`intersection_coords`,
:func:`downsample_coords` and :func:`morton_order` run on it: an exact hash of the rows (the
``GeometryHash`` primitive, Metal kernels) gives each row's first
occurrence and each query's row; sorting and compaction are MLX ops on the
same stream. Sizes that depend on the data (how many distinct rows, how
many shared) are evaluated as a count, read back, and the rows then
gathered: a two-stage evaluation. Results, row order included, are
identical to the CPU route.

Morton codes: each of x, y, z is biased by ``2**20`` (so coordinates in
``[-2**20, 2**20)`` are accepted, negatives included) and its 21 bits are
interleaved with bit ``i`` of x at bit ``3i + 2``, of y at ``3i + 1`` and of
z at ``3i`` of a non-negative int64. The batch is not part of the code;
:func:`morton_order` sorts by ``(batch, code)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_lattice._errors import MlxLatticeError
from mlx_lattice._native import ext
from mlx_lattice.core.coordinates import as_coordinates

__all__ = [
    "CoordinateError",
    "CoordinateJoin",
    "contains_coords",
    "crop",
    "downsample_coords",
    "intersection_coords",
    "inverse_map",
    "lookup_coords",
    "morton_codes",
    "morton_order",
    "morton_sort_coords",
    "reindex",
    "topk_rows",
    "union_coords",
]

ArrayLike = mx.array | np.ndarray


class CoordinateError(MlxLatticeError):
    """A coordinate op got an invalid argument (the message names it)."""


@dataclass(frozen=True)
class CoordinateJoin:
    """A merged coordinate set: ``coords`` sorted, and for each of its rows
    the row in ``a`` and in ``b`` (``-1`` where absent)."""

    coords: mx.array
    a_rows: mx.array
    b_rows: mx.array


def _np_coords(coords: ArrayLike, name: str) -> np.ndarray:
    try:
        return np.ascontiguousarray(np.asarray(as_coordinates(coords, name)))
    except TypeError as err:
        raise CoordinateError(str(err)) from None


def _call(fn, *args):  # noqa: ANN001
    try:
        return fn(*args)
    except ValueError as err:
        raise CoordinateError(str(err)) from None


def _on_gpu() -> bool:
    return bool(ext.geometry_uses_metal())


_NO_ROWS = np.zeros((0, 4), np.int32)


def _hash(coords: mx.array, queries: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """(first occurrence of each row, row of each query or -1), lazily."""
    q = mx.array(_NO_ROWS) if queries is None else queries
    raw = ext.coords_hash(coords, q)
    return raw["first"], raw["rows"]


def _check_unique(coords: np.ndarray, first: mx.array, name: str) -> None:
    """The CPU route's duplicate error: the smallest row repeating an earlier one."""
    n = len(coords)
    if n == 0:
        return
    rows = mx.arange(n, dtype=mx.int32)
    dup = int(mx.min(mx.where(first != rows, rows, n)).item())
    if dup < n:
        c = ", ".join(str(int(v)) for v in coords[dup])
        raise CoordinateError(
            f"{name} has duplicate coordinate ({c}) at rows {int(first[dup].item())} and {dup}."
        )


def _compact(mask: mx.array) -> mx.array:
    """Ascending int32 indices where ``mask`` holds (the count is read back)."""
    n = int(mask.shape[0])
    count = int(mx.sum(mask).item())
    rows = mx.arange(n, dtype=mx.int64)
    return mx.argsort(mx.where(mask, rows, rows + n))[:count].astype(mx.int32)


def _dense_rank(key: mx.array) -> mx.array:
    """Rank of each key among the distinct keys (int64); ties share a rank."""
    order = mx.argsort(key)
    ranked = key[order]
    step = (ranked[1:] != ranked[:-1]).astype(mx.int64)
    rank_sorted = mx.cumsum(mx.concatenate([mx.zeros((1,), mx.int64), step]))
    return rank_sorted[mx.argsort(order)]


def _lex_order(rows: mx.array) -> mx.array:
    """The permutation sorting distinct ``(batch, x, y, z)`` rows ascending.

    Two dense ranks, of ``(batch, x)`` and of ``(y, z)`` packed into uint64,
    combine into one key per row; the rows are distinct, so the keys are and
    the sort needs no stability.
    """
    m = int(rows.shape[0])
    if m < 2:
        return mx.arange(m, dtype=mx.int32)
    biased = (rows.astype(mx.int64) + 2**31).astype(mx.uint64)
    shift = mx.array(2**32, dtype=mx.uint64)
    hi = _dense_rank(biased[:, 0] * shift + biased[:, 1])
    lo = _dense_rank(biased[:, 2] * shift + biased[:, 3])
    return mx.argsort(hi * m + lo).astype(mx.int32)


def _distinct_sorted(c: mx.array) -> tuple[mx.array, mx.array]:
    """(sorted distinct rows, per input row its row in them), on the GPU route."""
    n = int(c.shape[0])
    first, _ = _hash(c)
    is_first = first == mx.arange(n, dtype=mx.int32)
    distinct = mx.take(c, _compact(is_first), axis=0)
    order = _lex_order(distinct)
    rank = mx.argsort(order).astype(mx.int32)  # distinct row -> sorted position
    ordinal = mx.cumsum(is_first.astype(mx.int32)) - 1  # first-occurrence row -> distinct row
    return mx.take(distinct, order, axis=0), rank[ordinal[first]]


def _merge_gpu(a: np.ndarray, b: np.ndarray, intersection: bool) -> CoordinateJoin:
    am, bm = mx.array(a), mx.array(b)
    for arr, m, name in ((a, am, "a"), (b, bm, "b")):
        _check_unique(arr, _hash(m)[0], name)
    merged, _ = _distinct_sorted(mx.concatenate([am, bm]))
    a_rows = _hash(am, merged)[1]
    b_rows = _hash(bm, merged)[1]
    if intersection:
        keep = _compact((a_rows >= 0) & (b_rows >= 0))
        merged, a_rows, b_rows = (mx.take(x, keep, axis=0) for x in (merged, a_rows, b_rows))
    return CoordinateJoin(merged, a_rows, b_rows)


def union_coords(a: ArrayLike, b: ArrayLike) -> CoordinateJoin:
    """The sorted union of two duplicate-free sets with each row's source rows.

    >>> j = union_coords(np.array([[0, 1, 0, 0], [0, 0, 0, 0]]), np.array([[0, 2, 0, 0], [0, 1, 0, 0]]))
    >>> j.coords[:, 1].tolist(), j.a_rows.tolist(), j.b_rows.tolist()
    ([0, 1, 2], [1, 0, -1], [-1, 1, 0])
    """
    an, bn = _np_coords(a, "a"), _np_coords(b, "b")
    if _on_gpu() and len(an) + len(bn):
        return _merge_gpu(an, bn, False)
    raw = _call(ext.coords_merge, an, bn, False)
    return CoordinateJoin(raw["coords"], raw["a_rows"], raw["b_rows"])


def intersection_coords(a: ArrayLike, b: ArrayLike) -> CoordinateJoin:
    """The sorted intersection of two duplicate-free sets with the rows in each.

    >>> j = intersection_coords(np.array([[0, 1, 0, 0], [1, 1, 0, 0]]), np.array([[1, 1, 0, 0]]))
    >>> j.coords.tolist(), j.a_rows.tolist(), j.b_rows.tolist()
    ([[1, 1, 0, 0]], [1], [0])
    """
    an, bn = _np_coords(a, "a"), _np_coords(b, "b")
    if _on_gpu() and len(an) + len(bn):
        return _merge_gpu(an, bn, True)
    raw = _call(ext.coords_merge, an, bn, True)
    return CoordinateJoin(raw["coords"], raw["a_rows"], raw["b_rows"])


def lookup_coords(coords: ArrayLike, queries: ArrayLike) -> mx.array:
    """``(Q,)`` int32: the row of each query in ``coords`` (no duplicates), or -1.

    >>> lookup_coords(np.array([[0, 5, 5, 5], [0, 1, 2, 3]]), np.array([[0, 1, 2, 3], [1, 1, 2, 3]])).tolist()
    [1, -1]
    """
    c, q = _np_coords(coords, "coords"), _np_coords(queries, "queries")
    if _on_gpu():
        first, rows = _hash(mx.array(c), mx.array(q))
        _check_unique(c, first, "coords")
        return rows
    return _call(ext.coords_lookup, c, q)


def contains_coords(coords: ArrayLike, queries: ArrayLike) -> mx.array:
    """``(Q,)`` bool: whether each query is in ``coords``.

    >>> contains_coords(np.array([[0, 1, 2, 3]]), np.array([[0, 1, 2, 3], [0, 0, 0, 0]])).tolist()
    [True, False]
    """
    return lookup_coords(coords, queries) >= 0


def inverse_map(indices: ArrayLike, n: int) -> mx.array:
    """Invert an injective map: ``out[indices[i]] = i``, ``-1`` for targets not hit.

    Raises:
        CoordinateError: if an index is outside ``[0, n)`` or repeats.

    >>> inverse_map(np.array([2, 0]), 4).tolist()
    [1, -1, 0, -1]
    """
    idx = np.asarray(indices)
    if not np.issubdtype(idx.dtype, np.integer) or idx.ndim != 1:
        raise CoordinateError(f"indices must be a 1-D integer array, got {idx.dtype} {idx.shape}.")
    if not isinstance(n, int | np.integer) or n < 0:
        raise CoordinateError(f"n must be a non-negative int, got {n!r}.")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise CoordinateError(f"indices must be in [0, {n}), got range [{idx.min()}, {idx.max()}].")
    out = np.full(int(n), -1, np.int32)
    out[idx] = np.arange(len(idx), dtype=np.int32)
    if int((out >= 0).sum()) != len(idx):
        raise CoordinateError("indices repeats a target; the map is not invertible.")
    return mx.array(out)


def downsample_coords(
    coords: ArrayLike,
    stride: int | Sequence[int],
    *,
    tensor_stride: int | Sequence[int] = 1,
) -> tuple[mx.array, mx.array]:
    """Floor coordinates to multiples of ``tensor_stride * stride`` and deduplicate.

    Returns the sorted coarse set and, per input row, its coarse row.

    >>> c, m = downsample_coords(np.array([[0, 3, -1, 0], [0, 2, -2, 1], [0, 0, 0, 0]]), 2)
    >>> c.tolist(), m.tolist()
    ([[0, 0, 0, 0], [0, 2, -2, 0]], [1, 1, 0])
    """
    c = _np_coords(coords, "coords").astype(np.int64)
    st = np.broadcast_to(np.asarray(stride), (3,)).astype(np.int64)
    ts = np.broadcast_to(np.asarray(tensor_stride), (3,)).astype(np.int64)
    if np.any(st < 1) or np.any(ts < 1):
        raise CoordinateError(
            f"stride and tensor_stride must be >= 1, got {stride!r}, {tensor_stride!r}."
        )
    step = st * ts
    floored = c.copy()
    floored[:, 1:] = np.floor_divide(c[:, 1:], step) * step
    floored32 = np.ascontiguousarray(floored.astype(np.int32))
    if _on_gpu() and len(floored32):
        return _distinct_sorted(mx.array(floored32))
    raw = _call(ext.coords_unique, floored32)
    return raw["coords"], raw["inverse"]


def morton_codes(coords: ArrayLike) -> mx.array:
    """``(N,)`` int64 Morton codes of the spatial part (layout in the module doc).

    An MLX primitive on the default stream (a Metal kernel on GPU streams).

    >>> morton_codes(np.array([[0, -1048576, -1048576, -1048576], [0, -1048575, -1048576, -1048576]])).tolist()
    [0, 4]
    """
    return _call(ext.coords_morton, _np_coords(coords, "coords"))


def morton_order(coords: ArrayLike) -> mx.array:
    """The permutation sorting rows by ``(batch, Morton code)`` (stable).

    >>> morton_order(np.array([[1, 0, 0, 0], [0, 1, 1, 1], [0, 0, 0, 1]])).tolist()
    [2, 1, 0]
    """
    c = _np_coords(coords, "coords")
    if _on_gpu() and len(c) > 1:
        # On the stream: codes (a primitive), then one unique key per row,
        # (dense rank of (batch, code)) * n + row, so the sort is stable
        # by construction.
        n = len(c)
        codes = morton_codes(c)
        pair = _dense_rank(mx.array(c[:, 0]).astype(mx.int64)) * n + _dense_rank(codes)
        key = _dense_rank(pair) * n + mx.arange(n, dtype=mx.int64)
        return mx.argsort(key).astype(mx.int32)
    codes = np.array(morton_codes(c)).astype(np.int64)
    keys = np.stack(
        [c[:, 0], codes >> 42, (codes >> 21) & 0x1FFFFF, codes & 0x1FFFFF], axis=1
    ).astype(np.int32)
    return _call(ext.coords_sort, np.ascontiguousarray(keys))


def morton_sort_coords(coords: ArrayLike) -> tuple[mx.array, mx.array]:
    """``(coords[order], order)`` with ``order = morton_order(coords)``.

    >>> c, order = morton_sort_coords(np.array([[0, 1, 0, 0], [0, 0, 0, 1]]))
    >>> c.tolist(), order.tolist()
    ([[0, 0, 0, 1], [0, 1, 0, 0]], [1, 0])
    """
    c = as_coordinates(coords, "coords")
    order = morton_order(c)
    return mx.take(c, order, axis=0), order


def crop(coords: ArrayLike, min: Sequence[int], max: Sequence[int]) -> mx.array:
    """Ascending rows whose ``(x, y, z)`` lies in ``[min, max]`` (inclusive) per axis.

    >>> crop(np.array([[0, 0, 0, 0], [0, 5, 0, 0], [1, 2, 2, 2]]), (0, 0, 0), (2, 2, 2)).tolist()
    [0, 2]
    """
    c = _np_coords(coords, "coords")
    lo, hi = np.asarray(min, np.int64), np.asarray(max, np.int64)
    if lo.shape != (3,) or hi.shape != (3,):
        raise CoordinateError(f"min and max must be three ints, got {min!r} and {max!r}.")
    if np.any(lo > hi):
        raise CoordinateError(f"min must be <= max per axis, got {min!r} and {max!r}.")
    keep = np.all((c[:, 1:] >= lo) & (c[:, 1:] <= hi), axis=1)
    return mx.array(np.flatnonzero(keep).astype(np.int32))


def topk_rows(scores: ArrayLike, k: int, *, coords: ArrayLike | None = None) -> mx.array:
    """Ascending rows of the ``k`` highest scores (per batch when ``coords`` is given).

    Ties go to the lower row; NaN scores rank lowest.

    >>> topk_rows(np.array([0.5, 2.0, 2.0, 1.0]), 2).tolist()
    [1, 2]
    >>> topk_rows(np.array([0.5, 2.0, 3.0, 1.0]), 1, coords=np.array([[0, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]])).tolist()
    [1, 2]
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1:
        raise CoordinateError(f"scores must be 1-D, got shape {s.shape}.")
    if not isinstance(k, int | np.integer) or isinstance(k, bool) or k < 0:
        raise CoordinateError(f"k must be a non-negative int, got {k!r}.")
    batch = np.zeros(len(s), np.int64)
    if coords is not None:
        c = _np_coords(coords, "coords")
        if len(c) != len(s):
            raise CoordinateError(f"coords has {len(c)} rows but scores has {len(s)}.")
        batch = c[:, 0].astype(np.int64)
    key = np.where(np.isnan(s), -np.inf, s)
    order = np.lexsort((np.arange(len(s)), -key, batch))  # batch, score desc, row
    sorted_batch = batch[order]
    starts = np.searchsorted(sorted_batch, sorted_batch, side="left")
    rank = np.arange(len(s)) - starts
    return mx.array(np.sort(order[rank < k]).astype(np.int32))


def reindex(
    feats: mx.array, coords: ArrayLike, new_coords: ArrayLike, *, fill: float = 0.0
) -> mx.array:
    """Features of ``coords`` moved onto ``new_coords`` (``fill`` where absent).

    Differentiable in ``feats``.

    >>> reindex(mx.array([[1.0], [2.0]]), np.array([[0, 0, 0, 0], [0, 1, 0, 0]]), np.array([[0, 1, 0, 0], [0, 9, 0, 0]])).tolist()
    [[2.0], [0.0]]
    """
    rows = lookup_coords(coords, new_coords)
    if not isinstance(feats, mx.array) or feats.ndim != 2:
        raise CoordinateError("feats must be an (N, C) mx.array.")
    if int(feats.shape[0]) != int(np.asarray(coords).shape[0]):
        raise CoordinateError(
            f"feats has {feats.shape[0]} rows but coords has {np.asarray(coords).shape[0]}."
        )
    taken = (
        mx.take(feats, mx.maximum(rows, 0), axis=0)
        if feats.shape[0]
        else mx.zeros((rows.shape[0], feats.shape[1]), feats.dtype)
    )
    return mx.where((rows >= 0)[:, None], taken, mx.array(fill, dtype=feats.dtype))
