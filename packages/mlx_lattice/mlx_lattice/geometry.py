"""Points ↔ voxels with gradients, and exact neighbour search.

Conventions (fixed; the native kernels and the tests rely on them):

* Points are ``(P, 3)`` floats with optional ``(P,)`` batch indices (>= 0).
  Voxel ``i`` along an axis covers ``[origin + i * size, origin + (i + 1) * size)``,
  so a point's voxel is ``floor((p - origin) / size)`` computed in float64.
* :func:`quantize_points` returns the occupied voxels sorted by
  ``(batch, x, y, z)`` (a deterministic order), the voxel of every point and
  the points grouped by voxel (ascending point index inside a voxel).
* :func:`point_voxel_map` interpolates between voxel *centres*
  ``origin + (i + 0.5) * size``: a point gets the 8 voxels around it, corner
  ``c = 4 * dx + 2 * dy + dz`` being voxel ``floor(u) + (dx, dy, dz)`` with
  ``u = (p - origin) / size - 0.5``, weighted trilinearly. Voxels absent from
  ``coords`` (or from another batch) get row ``-1`` and weight 0, and the
  remaining weights are divided by their sum, so they add up to 1 whenever
  any of the 8 voxels exists; a point with none of them gets all-zero
  weights (and zero features from :func:`devoxelize`).
* ``interpolation="nearest"`` takes the present corner of largest weight
  (the lowest corner index on ties) — the voxel that contains the point
  whenever that voxel exists.
* Neighbour relations (:func:`knn_relation`, :func:`radius_relation`) never
  cross batches; neighbours are ordered by (squared distance, support row),
  and the rank of a neighbour is its kernel id in the returned
  :class:`~mlx_lattice.core.KernelRelation`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import mlx.core as mx
import numpy as np

from mlx_lattice._errors import MlxLatticeError
from mlx_lattice._native import ext
from mlx_lattice.core.coordinates import as_coordinates
from mlx_lattice.core.relations import (
    KernelRelation,
    RelationContract,
    RelationCSR,
    RelationEdges,
)

__all__ = [
    "GeometryError",
    "PointVoxelMap",
    "VoxelizedPoints",
    "devoxelize",
    "gather_neighbor_features",
    "knn_relation",
    "neighbor_conv",
    "point_voxel_map",
    "quantize_points",
    "radius_relation",
    "voxel_centers",
    "voxelize",
]

Reduce = Literal["sum", "mean", "max", "first"]
Interpolation = Literal["nearest", "linear"]
ArrayLike = mx.array | np.ndarray


class GeometryError(MlxLatticeError):
    """A geometry op got an invalid argument (the message names it)."""


@dataclass(frozen=True)
class VoxelizedPoints:
    """Points quantized to voxels (see :func:`quantize_points`).

    ``coords`` ``(N, 4)`` int32 (batch, x, y, z) sorted; ``point_to_voxel``
    ``(P,)`` int32 row of each point's voxel; ``counts`` ``(N,)`` int32 points
    per voxel; ``voxel_offsets`` ``(N + 1,)`` and ``voxel_points`` ``(P,)``:
    the points of voxel ``v`` are ``voxel_points[voxel_offsets[v]:voxel_offsets[v+1]]``
    in ascending order.
    """

    coords: mx.array
    point_to_voxel: mx.array
    counts: mx.array
    voxel_offsets: mx.array
    voxel_points: mx.array
    voxel_size: tuple[float, float, float]
    origin: tuple[float, float, float]

    @property
    def num_voxels(self) -> int:
        """Number of occupied voxels ``N``."""
        return int(self.coords.shape[0])

    @property
    def num_points(self) -> int:
        """Number of points ``P``."""
        return int(self.point_to_voxel.shape[0])


@dataclass(frozen=True)
class PointVoxelMap:
    """The 8 voxels around each point and their interpolation weights.

    ``rows`` ``(P, 8)`` int32 (``-1`` = missing voxel), ``weights`` ``(P, 8)``
    float32 (renormalised over present voxels), ``nearest`` ``(P,)`` int32
    (the nearest present voxel or -1), ``num_voxels`` the row count of the
    coordinate set it was built against. ``voxel_offsets``/``voxel_entries``
    group the ``(point, corner)`` entries by voxel (flat index ``8 * p + c``,
    ascending) for a deterministic transpose.
    """

    rows: mx.array
    weights: mx.array
    nearest: mx.array
    num_voxels: int
    voxel_offsets: mx.array
    voxel_entries: mx.array

    @property
    def num_points(self) -> int:
        """Number of points ``P``."""
        return int(self.rows.shape[0])


# -- argument checking -------------------------------------------------------------------


def _points(points: ArrayLike, name: str = "points") -> np.ndarray:
    if not isinstance(points, mx.array | np.ndarray):
        raise GeometryError(
            f"{name} must be an mx.array or np.ndarray, got {type(points).__name__}."
        )
    if isinstance(points, mx.array) and points.dtype == mx.bfloat16:
        points = points.astype(mx.float32)  # NumPy has no bfloat16
    arr = np.asarray(points)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise GeometryError(f"{name} must be (P, 3), got shape {arr.shape}.")
    if not np.issubdtype(arr.dtype, np.floating):
        raise GeometryError(f"{name} must hold floats, got dtype {arr.dtype}.")
    arr = arr.astype(np.float64)
    if arr.size and not np.all(np.isfinite(arr)):
        bad = int(np.argwhere(~np.isfinite(arr))[0, 0])
        raise GeometryError(f"{name} must be finite; row {bad} is {arr[bad].tolist()}.")
    return np.ascontiguousarray(arr)


def _triple(
    value: float | Sequence[float] | None, name: str, default: float, *, positive: bool
) -> tuple[float, float, float]:
    if value is None:
        return (default, default, default)
    arr = np.asarray(np.array(value) if isinstance(value, mx.array) else value, dtype=object)
    try:
        vals = np.asarray(
            value if not isinstance(value, mx.array) else np.array(value), dtype=np.float64
        ).reshape(-1)
    except (TypeError, ValueError):
        raise GeometryError(f"{name} must be a number or three numbers, got {value!r}.") from None
    if arr.dtype == bool or vals.size not in (1, 3):
        raise GeometryError(f"{name} must be a number or three numbers, got {value!r}.")
    if vals.size == 1:
        vals = np.repeat(vals, 3)
    if not np.all(np.isfinite(vals)) or (positive and np.any(vals <= 0)):
        what = "positive finite" if positive else "finite"
        raise GeometryError(f"{name} must be {what} per axis, got {value!r}.")
    return (float(vals[0]), float(vals[1]), float(vals[2]))


def _batch(batch: ArrayLike | None, n: int, name: str = "batch") -> np.ndarray:
    if batch is None:
        return np.zeros(n, np.int32)
    arr = np.asarray(batch)
    if not np.issubdtype(arr.dtype, np.integer):
        raise GeometryError(f"{name} must hold integers, got dtype {arr.dtype}.")
    if arr.shape != (n,):
        raise GeometryError(f"{name} must have shape ({n},), got {arr.shape}.")
    if n and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise GeometryError(f"{name} must be in [0, 2**31), got range [{arr.min()}, {arr.max()}].")
    return np.ascontiguousarray(arr.astype(np.int32))


# -- points -> voxels --------------------------------------------------------------------


def quantize_points(
    points: ArrayLike,
    voxel_size: float | Sequence[float],
    *,
    origin: Sequence[float] | None = None,
    batch: ArrayLike | None = None,
) -> VoxelizedPoints:
    """Quantize points to voxels, natively, with the point→voxel map.

    Args:
        points: ``(P, 3)`` finite floats.
        voxel_size: a positive number or one per axis.
        origin: the corner of voxel ``(0, 0, 0)`` (default the origin).
        batch: ``(P,)`` non-negative batch indices (default all 0).

    Raises:
        GeometryError: for non-finite points, sizes <= 0, voxel indices outside
            int32, or a bad shape/dtype.

    On a GPU stream the voxel indices are computed there in float32 (MLX
    ops), deduplicated by the exact coordinate hash and sorted as in
    :mod:`mlx_lattice.coords` (a count read back, then a gather); the map is
    then built with MLX ops. The map is identical to the CPU route for the
    same voxel indices; a point within float32 rounding of a voxel face may
    fall in the neighbouring voxel there (the CPU computes in float64).

    >>> pts = np.array([[0.25, 0.0, 0.0], [0.05, 0.0, 0.0], [0.27, 0.1, 0.0]])
    >>> vox = quantize_points(pts, 0.2)
    >>> vox.coords.tolist(), vox.point_to_voxel.tolist(), vox.counts.tolist()
    ([[0, 0, 0, 0], [0, 1, 0, 0]], [1, 0, 1], [1, 2])
    """
    pts = _points(points)
    size = _triple(voxel_size, "voxel_size", 1.0, positive=True)
    org = _triple(origin, "origin", 0.0, positive=False)
    b = _batch(batch, len(pts))
    if len(pts) and ext.geometry_uses_metal():
        raw = _quantize_on_stream(pts, b, size, org)
    else:
        try:
            raw = ext.geometry_quantize_points(pts, b, size, org)
        except ValueError as err:
            raise GeometryError(str(err)) from None
    return VoxelizedPoints(
        coords=raw["coords"],
        point_to_voxel=raw["point_to_voxel"],
        counts=raw["counts"],
        voxel_offsets=raw["voxel_offsets"],
        voxel_points=raw["voxel_points"],
        voxel_size=size,
        origin=org,
    )


def _quantize_on_stream(
    pts: np.ndarray, b: np.ndarray, size: tuple[float, float, float], org: tuple[float, float, float]
) -> dict[str, mx.array]:
    """quantize_points on the default (GPU) stream; points are finite here."""
    from mlx_lattice import coords as _coords

    n = len(pts)
    cells = mx.floor(
        (mx.array(pts.astype(np.float32)) - mx.array(org, dtype=mx.float32))
        / mx.array(size, dtype=mx.float32)
    )
    inside = mx.all((cells >= -(2.0**31)) & (cells < 2.0**31), axis=1)
    rows = mx.arange(n, dtype=mx.int32)
    bad = int(mx.min(mx.where(inside, n, rows)).item())
    if bad < n:
        # The CPU route's message: the first axis outside int32, in float64.
        g = np.floor((pts[bad] - np.asarray(org)) / np.asarray(size))
        outside = (g < -(2.0**31)) | (g > 2.0**31 - 1)
        value = g[int(np.argmax(outside))] if outside.any() else g[0]
        raise GeometryError(
            f"points row {bad} falls in voxel index {value:g}, outside the int32 "
            "coordinate range."
        )
    keys = mx.concatenate([mx.array(b)[:, None], cells.astype(mx.int32)], axis=1)
    voxel_coords, inverse = _coords._distinct_sorted(keys)
    m = int(voxel_coords.shape[0])
    counts = mx.zeros((m,), mx.int32).at[inverse].add(mx.ones((n,), mx.int32))
    offsets = mx.concatenate([mx.zeros((1,), mx.int32), mx.cumsum(counts)])
    # Points of each voxel in ascending order: one sort of unique keys.
    members = mx.argsort(inverse.astype(mx.int64) * n + rows).astype(mx.int32)
    return {
        "coords": voxel_coords,
        "point_to_voxel": inverse,
        "counts": counts,
        "voxel_offsets": offsets,
        "voxel_points": members,
    }


def voxelize(
    point_features: mx.array, voxels: VoxelizedPoints, reduce: Reduce = "mean"
) -> mx.array:
    """Reduce ``(P, C)`` point features onto the voxels of ``voxels`` -> ``(N, C)``.

    ``reduce`` is ``"sum"``, ``"mean"``, ``"max"`` or ``"first"`` (the
    lowest-index point). A native primitive, differentiable in
    ``point_features``: ``max`` sends the gradient to the first point that
    attains the maximum, ``first`` to the first point. Reduction runs in
    ascending point order per voxel in float32, so results are deterministic.

    >>> vox = quantize_points(np.array([[0.1, 0, 0], [0.9, 0, 0], [1.5, 0, 0]]), 1.0)
    >>> voxelize(mx.array([[1.0], [3.0], [5.0]]), vox, "mean").tolist()
    [[2.0], [5.0]]
    >>> voxelize(mx.array([[1.0], [3.0], [5.0]]), vox, "max").tolist()
    [[3.0], [5.0]]
    """
    if not isinstance(voxels, VoxelizedPoints):
        raise GeometryError(f"voxels must be VoxelizedPoints, got {type(voxels).__name__}.")
    if reduce not in ("sum", "mean", "max", "first"):
        raise GeometryError(f"reduce must be 'sum', 'mean', 'max' or 'first', got {reduce!r}.")
    feats = _features(point_features, voxels.num_points, "point_features", "points")
    return ext.geometry_voxelize(
        feats, voxels.voxel_offsets, voxels.voxel_points, voxels.point_to_voxel, reduce
    )


def _features(feats: mx.array, rows: int, name: str, what: str) -> mx.array:
    if isinstance(feats, np.ndarray):
        feats = mx.array(feats)
    if not isinstance(feats, mx.array):
        raise GeometryError(f"{name} must be an mx.array, got {type(feats).__name__}.")
    if feats.ndim != 2 or int(feats.shape[0]) != rows:
        raise GeometryError(
            f"{name} must be ({rows}, C) (one row per {what}), got {tuple(feats.shape)}."
        )
    if feats.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        raise GeometryError(f"{name} must be float32, float16 or bfloat16, got {feats.dtype}.")
    return feats


# -- voxels -> points --------------------------------------------------------------------


def voxel_centers(
    coords: ArrayLike,
    voxel_size: float | Sequence[float],
    *,
    origin: Sequence[float] | None = None,
) -> mx.array:
    """The ``(N, 3)`` float32 centres ``origin + (i + 0.5) * size`` of voxel coordinates.

    >>> voxel_centers(np.array([[0, 1, 0, -1]]), 2.0).tolist()
    [[3.0, 1.0, -1.0]]
    """
    c = np.asarray(as_coordinates(coords, "coords"))
    size = np.array(_triple(voxel_size, "voxel_size", 1.0, positive=True))
    org = np.array(_triple(origin, "origin", 0.0, positive=False))
    return mx.array((org + (c[:, 1:] + 0.5) * size).astype(np.float32))


def point_voxel_map(
    points: ArrayLike,
    coords: ArrayLike,
    voxel_size: float | Sequence[float],
    *,
    origin: Sequence[float] | None = None,
    batch: ArrayLike | None = None,
) -> PointVoxelMap:
    """Build the reusable point→voxel interpolation map (natively).

    See the module docstring for the corner order and the renormalisation of
    weights over missing voxels. ``coords`` must have no duplicates.

    >>> coords = np.array([[0, 0, 0, 0], [0, 1, 0, 0]])
    >>> pvm = point_voxel_map(np.array([[0.75, 0.5, 0.5]]), coords, 1.0)
    >>> pvm.rows.tolist()
    [[0, -1, -1, -1, 1, -1, -1, -1]]
    >>> pvm.weights.tolist()
    [[0.75, 0.0, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0]]
    """
    pts = _points(points)
    c = as_coordinates(coords, "coords")
    size = _triple(voxel_size, "voxel_size", 1.0, positive=True)
    org = _triple(origin, "origin", 0.0, positive=False)
    b = _batch(batch, len(pts))
    try:
        raw = ext.geometry_point_voxel_map(pts, b, c, size, org)
    except ValueError as err:
        raise GeometryError(str(err)) from None
    return PointVoxelMap(
        rows=raw["rows"],
        weights=raw["weights"],
        nearest=raw["nearest"],
        num_voxels=int(c.shape[0]),
        voxel_offsets=raw["voxel_offsets"],
        voxel_entries=raw["voxel_entries"],
    )


def devoxelize(
    voxel_features: mx.array,
    pvm: PointVoxelMap,
    interpolation: Interpolation = "linear",
    *,
    dtype: mx.Dtype | None = None,
) -> mx.array:
    """Interpolate ``(N, C)`` voxel features at the points of ``pvm`` -> ``(P, C)``.

    ``"linear"``: ``out[p] = sum_c weights[p, c] * voxel_features[rows[p, c]]``
    (trilinear, renormalised over present voxels); ``"nearest"``: the feature
    of ``pvm.nearest`` (zeros where -1). A native primitive with ``vjp`` and
    ``jvp`` in ``voxel_features``; the transpose reduces in ascending
    ``(point, corner)`` order per voxel (deterministic).

    The interpolation runs in float32 whatever the features' dtype; the
    result is in ``dtype`` (float32, float16 or bfloat16; default the
    features' own), rounded once. Half-precision features with
    ``dtype=mx.float32`` give exactly ``devoxelize(voxel_features.astype(
    mx.float32), pvm)``, and the gradient comes back in the features' dtype
    (the float32 transpose rounded once), but on the CPU without the cast
    passes: the native kernel reads and writes the half-precision rows itself.

    >>> coords = np.array([[0, 0, 0, 0], [0, 1, 0, 0]])
    >>> pvm = point_voxel_map(np.array([[0.75, 0.5, 0.5]]), coords, 1.0)
    >>> devoxelize(mx.array([[4.0], [8.0]]), pvm).tolist()
    [[5.0]]
    >>> devoxelize(mx.array([[4.0], [8.0]]), pvm, "nearest").tolist()
    [[4.0]]
    """
    if not isinstance(pvm, PointVoxelMap):
        raise GeometryError(f"pvm must be a PointVoxelMap, got {type(pvm).__name__}.")
    if interpolation not in ("linear", "nearest"):
        raise GeometryError(f"interpolation must be 'linear' or 'nearest', got {interpolation!r}.")
    feats = _features(voxel_features, pvm.num_voxels, "voxel_features", "voxel")
    out_dtype = _DTYPE_NAMES.get(dtype) if dtype is not None else ""
    if out_dtype is None:
        raise GeometryError(f"dtype must be float32, float16 or bfloat16 (or None), got {dtype}.")
    return ext.geometry_devoxelize(
        feats,
        pvm.rows,
        pvm.weights,
        pvm.nearest,
        pvm.voxel_offsets,
        pvm.voxel_entries,
        interpolation == "nearest",
        out_dtype=out_dtype,
    )


_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


# -- neighbours --------------------------------------------------------------------------


def _positions(
    points: ArrayLike, batch: ArrayLike | None, name: str
) -> tuple[np.ndarray, np.ndarray, mx.array]:
    """(positions float64, batch int32, coordinates for the relation)."""
    arr = np.asarray(points) if isinstance(points, mx.array | np.ndarray) else None
    if (
        arr is not None
        and arr.ndim == 2
        and arr.shape[1] == 4
        and np.issubdtype(arr.dtype, np.integer)
    ):
        if batch is not None:
            raise GeometryError(
                f"{name}: integer (N, 4) coordinates carry their own batch; pass no batch."
            )
        coords = as_coordinates(arr, name)
        c = np.asarray(coords)
        if len(c) and c[:, 0].min() < 0:
            raise GeometryError(f"{name} batch indices (column 0) must be >= 0.")
        return (
            np.ascontiguousarray(c[:, 1:].astype(np.float64)),
            np.ascontiguousarray(c[:, 0]),
            coords,
        )
    pts = _points(points, name)  # type: ignore[arg-type]
    b = _batch(batch, len(pts), f"{name}_batch")
    coords = np.zeros((len(pts), 4), np.int32)
    coords[:, 0] = b
    return pts, b, mx.array(coords)


def _neighbor_relation(
    raw: dict, n_kernels: int, in_coords: mx.array, out_coords: mx.array
) -> KernelRelation:
    ones = (1, 1, 1)
    return KernelRelation(
        contract=RelationContract("target", (n_kernels, 1, 1), ones, ones, ones, ones),
        in_coords=in_coords,
        out_coords=out_coords,
        edges=RelationEdges(raw["in_rows"], raw["out_rows"], raw["kernel_ids"]),
        counts=raw["counts"],
        output_csr=RelationCSR(raw["output_row_offsets"], raw["output_edge_ids"]),
        input_csr=RelationCSR(raw["input_row_offsets"], raw["input_edge_ids"]),
        kernel_csr=RelationCSR(raw["kernel_row_offsets"], raw["kernel_edge_ids"]),
        n_out_capacity=int(out_coords.shape[0]),
        n_kernels=n_kernels,
    )


def knn_relation(
    query: ArrayLike,
    support: ArrayLike,
    k: int,
    *,
    query_batch: ArrayLike | None = None,
    support_batch: ArrayLike | None = None,
) -> KernelRelation:
    """Exact k nearest neighbours of every query among the support (natively).

    ``query``/``support`` are ``(P, 3)`` float points (batches given by
    ``query_batch``/``support_batch``) or ``(N, 4)`` integer voxel
    coordinates (distances between voxel centres, in grid units). Neighbours
    never cross batches and are ordered by (squared distance in float64,
    support row); edge ``e`` joins support row ``in_rows[e]`` to query row
    ``out_rows[e]`` with kernel id = its rank (``n_kernels = k``). A query
    whose batch has fewer than ``k`` support points gets them all. The
    relation's ``in_coords``/``out_coords`` are the coordinates, or
    ``(batch, 0, 0, 0)`` rows for float points. The search is an MLX
    primitive on the default stream: on a GPU stream its Metal kernel
    computes distances in float32 (same rows wherever float32 squared
    distances are exact, e.g. voxel centres) and takes ``k <= 64``.

    >>> support = np.array([[0.0, 0, 0], [1.0, 0, 0], [3.0, 0, 0]])
    >>> rel = knn_relation(np.array([[0.9, 0, 0]]), support, 2)
    >>> rel.edges.in_rows.tolist(), rel.edges.kernel_ids.tolist(), rel.n_kernels
    ([1, 0], [0, 1], 2)
    """
    if not isinstance(k, int | np.integer) or isinstance(k, bool) or k < 1:
        raise GeometryError(f"k must be a positive int, got {k!r}.")
    q, qb, qc = _positions(query, query_batch, "query")
    s, sb, sc = _positions(support, support_batch, "support")
    try:
        raw = ext.geometry_knn(q, qb, s, sb, int(k))
    except ValueError as err:
        raise GeometryError(str(err)) from None
    return _neighbor_relation(raw, int(k), sc, qc)


def radius_relation(
    query: ArrayLike,
    support: ArrayLike,
    r: float,
    max_neighbors: int | None = None,
    *,
    query_batch: ArrayLike | None = None,
    support_batch: ArrayLike | None = None,
) -> KernelRelation:
    """All support points within distance ``r`` (inclusive) of each query.

    Same inputs and ordering as :func:`knn_relation`; with ``max_neighbors``
    only the nearest ``max_neighbors`` are kept and ``n_kernels =
    max_neighbors``, else ``n_kernels`` is the largest neighbour count (>= 1).
    On a GPU stream (float32 distances) it runs as the kNN Metal kernel
    bounded by ``r`` when ``max_neighbors <= 64``; otherwise as a two-pass
    radius kernel: neighbour counts and their prefix sum are evaluated and
    the total read back, then each query's range is filled and sorted by
    (distance, row). On CPU streams it runs natively in float64.

    >>> support = np.array([[0.0, 0, 0], [1.0, 0, 0], [3.0, 0, 0]])
    >>> rel = radius_relation(np.array([[0.5, 0, 0]]), support, 0.5)
    >>> rel.edges.in_rows.tolist(), rel.n_kernels
    ([0, 1], 2)
    """
    if not (isinstance(r, int | float | np.floating) and math.isfinite(r) and r > 0):
        raise GeometryError(f"r must be a positive finite number, got {r!r}.")
    if max_neighbors is not None and (
        not isinstance(max_neighbors, int | np.integer)
        or isinstance(max_neighbors, bool)
        or max_neighbors < 1
    ):
        raise GeometryError(f"max_neighbors must be None or a positive int, got {max_neighbors!r}.")
    q, qb, qc = _positions(query, query_batch, "query")
    s, sb, sc = _positions(support, support_batch, "support")
    try:
        raw = ext.geometry_radius(q, qb, s, sb, float(r), int(max_neighbors or 0))
    except ValueError as err:
        raise GeometryError(str(err)) from None
    return _neighbor_relation(raw, int(raw["counts"].shape[0]), sc, qc)


def gather_neighbor_features(
    feats: mx.array, relation: KernelRelation, *, fill: float = 0.0
) -> mx.array:
    """``(n_out, K, C)`` features of each output's neighbours by kernel id.

    Slots without a neighbour hold ``fill``. Differentiable in ``feats``.

    >>> support = np.array([[0.0, 0, 0], [1.0, 0, 0], [3.0, 0, 0]])
    >>> rel = knn_relation(np.array([[2.9, 0, 0]]), support, 2)
    >>> gather_neighbor_features(mx.array([[10.0], [20.0], [30.0]]), rel).tolist()
    [[[30.0], [20.0]]]
    """
    if not isinstance(relation, KernelRelation):
        raise GeometryError(f"relation must be a KernelRelation, got {type(relation).__name__}.")
    feats = _features(feats, relation.n_in, "feats", "support row")
    n_out, n_k = int(relation.n_out_capacity or 0), int(relation.n_kernels or 0)
    channels = int(feats.shape[1])
    slots = relation.edges.out_rows * n_k + relation.edges.kernel_ids
    gathered = mx.take(feats, relation.edges.in_rows, axis=0)
    out = mx.zeros((n_out * n_k, channels), dtype=feats.dtype).at[slots].add(gathered)
    if fill != 0.0:
        present = (
            mx.zeros((n_out * n_k,), dtype=mx.bool_).at[slots].add(mx.ones(slots.shape, mx.bool_))
        )
        out = mx.where(present[:, None], out, mx.array(fill, dtype=feats.dtype))
    return out.reshape(n_out, n_k, channels)


def neighbor_conv(feats: mx.array, weight: mx.array, relation: KernelRelation) -> mx.array:
    """``out[o] = sum over neighbours of feats[in] @ weight[rank]`` -> ``(n_out, Cout)``.

    ``weight`` is ``(K, Cin, Cout)``, one matrix per neighbour rank. Runs as a
    gather and an einsum (kNN and radius relations can hold several edges per
    support row and rank, which the core sparse convolution also accepts).
    Differentiable in ``feats`` and ``weight``.

    >>> support = np.array([[0.0, 0, 0], [1.0, 0, 0], [3.0, 0, 0]])
    >>> rel = knn_relation(np.array([[2.9, 0, 0], [0.1, 0, 0]]), support, 2)
    >>> neighbor_conv(mx.array([[1.0], [2.0], [3.0]]), mx.array([[[1.0]], [[10.0]]]), rel).tolist()
    [[23.0], [21.0]]
    """
    gathered = gather_neighbor_features(feats, relation)
    n_k = int(relation.n_kernels or 0)
    if (
        weight.ndim != 3
        or int(weight.shape[0]) != n_k
        or int(weight.shape[1]) != int(feats.shape[1])
    ):
        raise GeometryError(
            f"weight must be (K={n_k}, Cin={int(feats.shape[1])}, Cout), got {tuple(weight.shape)}."
        )
    return mx.einsum("okc,kcd->od", gathered, weight)
