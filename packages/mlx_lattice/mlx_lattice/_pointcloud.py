"""Points with their features and their voxels, ready for SPVCNN's point
branch, and the point <-> voxel moves between them (kept outside
:mod:`mlx_lattice.models` so that :mod:`mlx_lattice.export` runs an exported
SPVCNN without the model classes). Public as
:class:`mlx_lattice.models.PointCloudInput` and
:func:`mlx_lattice.models.point_cloud_input`."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlx_lattice import geometry
from mlx_lattice.tensor import SparseTensor, SparseTensorError

__all__ = ["PointCloudInput", "point_cloud_input"]


def _as(a: mx.array, dtype: mx.Dtype) -> mx.array:
    """``a`` in ``dtype``; no cast node (forward or backward) when it
    already is."""
    return a if a.dtype == dtype else a.astype(dtype)


@mx.custom_function
def _permute_rows(a: mx.array, rows: mx.array, inverse_rows: mx.array) -> mx.array:
    """``a[rows]`` for a permutation ``rows`` built by :class:`PointCloudInput`
    (valid by construction), with ``g[inverse_rows]`` as its gradient: MLX
    differentiates a gather into a scatter-add, slower than the inverse gather."""
    return mx.take(a, rows, axis=0)


@_permute_rows.vjp
def _permute_rows_vjp(
    primals: tuple[mx.array, ...], cotangent: mx.array | tuple, output: object
) -> tuple[mx.array, ...]:
    _, rows, inverse_rows = primals
    g = cotangent[0] if isinstance(cotangent, tuple | list) else cotangent
    return mx.take(g, inverse_rows, axis=0), mx.zeros_like(rows), mx.zeros_like(inverse_rows)


@dataclass
class PointCloudInput:
    """Points, their features and their level-0 voxels, ready for
    :class:`~mlx_lattice.models.SPVCNN`.

    ``tensor`` holds the voxels (rows in ``voxels.coords`` order) with the
    mean of their points' features. The per-level point-voxel maps are built
    on first use and kept here, so repeated passes over one input reuse them
    (as the tensor's coordinate manager reuses kernel relations).
    """

    points: np.ndarray
    feats: mx.array
    batch: np.ndarray
    voxel_size: float
    voxels: geometry.VoxelizedPoints
    tensor: SparseTensor
    _levels: dict = field(default_factory=dict, repr=False)

    @property
    def num_points(self) -> int:
        return len(self.points)

    def level(
        self, x: SparseTensor
    ) -> tuple[geometry.VoxelizedPoints, mx.array, geometry.PointVoxelMap]:
        """For ``x`` (a tensor of this input's coordinate manager): the points
        quantized at its stride, for each row of ``x`` its voxel's row among
        those, and the point-voxel map onto ``x``'s rows."""
        stride = x.tensor_stride
        if len(set(stride)) != 1:
            raise SparseTensorError(f"SPVCNN needs isotropic tensor strides, got {stride}.")
        s = stride[0]
        cached = self._levels.get(s)
        if cached is not None and cached[3] is x.coords:
            return cached[:3]
        if s == 1 and x.coords is self.tensor.coords:
            # This input's own voxels, in their own order: no permutation
            # (and the coordinates are the voxel indices as they are).
            rows = mx.arange(x.num_points, dtype=mx.int32)
            pvm = geometry.point_voxel_map(self.points, x.coords, self.voxel_size, batch=self.batch)
            self._levels[s] = (self.voxels, rows, pvm, x.coords, None)
            return self.voxels, rows, pvm
        coords = np.array(x.coords).astype(np.int64)
        index = np.concatenate([coords[:, :1], coords[:, 1:] // s], axis=1)
        vox = (
            self.voxels
            if s == 1
            else geometry.quantize_points(self.points, self.voxel_size * s, batch=self.batch)
        )
        # vox.coords are sorted (batch, x, y, z); find each one's row in x.
        order = np.lexsort(index[:, ::-1].T)
        sorted_rows = index[order]
        vox_coords = np.array(vox.coords).astype(np.int64)
        if len(vox_coords) != len(index) or not np.array_equal(sorted_rows, vox_coords):
            raise SparseTensorError(
                f"the tensor at stride {s} does not hold exactly the voxels of this input's points."
            )
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))  # row r of x is voxel inverse[r] of vox
        pvm = geometry.point_voxel_map(self.points, index, self.voxel_size * s, batch=self.batch)
        entry = (
            vox,
            mx.array(inverse.astype(np.int32)),
            pvm,
            x.coords,
            mx.array(order.astype(np.int32)),
        )
        self._levels[s] = entry
        return entry[:3]

    def to_points(self, x: SparseTensor, dtype: mx.Dtype | None = None) -> mx.array:
        """``x``'s features interpolated at the points (trilinear), ``(P, C)``,
        in ``dtype`` (default ``x``'s; the interpolation runs in float32, and
        on the CPU the native kernel reads half-precision rows and writes
        ``dtype`` itself, its gradient in ``x``'s dtype: no cast passes)."""
        _, _, pvm = self.level(x)
        return geometry.devoxelize(x.feats, pvm, "linear", dtype=dtype)

    def to_voxels(self, x: SparseTensor, point_feats: mx.array) -> SparseTensor:
        """Point features averaged onto ``x``'s voxels (same rows as ``x``, in
        ``x``'s dtype)."""
        vox, inverse, _ = self.level(x)
        order = self._levels[x.tensor_stride[0]][4]
        feats = _as(geometry.voxelize(point_feats, vox, "mean"), x.dtype)
        if order is None:  # x's rows are the voxels' rows
            return x.replace(feats)
        # A permutation: its gradient is the inverse gather, not a scatter-add.
        return x.replace(_permute_rows(feats, inverse, order))


def point_cloud_input(
    points: np.ndarray,
    feats: np.ndarray | mx.array,
    voxel_size: float,
    *,
    batch: np.ndarray | None = None,
) -> PointCloudInput:
    """Voxelize ``(P, 3)`` points with ``(P, C)`` features for :class:`~mlx_lattice.models.SPVCNN`.

    >>> pts = np.array([[0.1, 0.1, 0.1], [0.3, 0.1, 0.1], [1.2, 0.1, 0.1]], np.float32)
    >>> inp = point_cloud_input(pts, np.ones((3, 2), np.float32), 0.5)
    >>> inp.tensor.coords.tolist(), inp.num_points
    ([[0, 0, 0, 0], [0, 2, 0, 0]], 3)
    """
    pts = np.asarray(points, np.float32)
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise SparseTensorError(f"points must be (P, 3), got shape {pts.shape}.")
    b = np.zeros(len(pts), np.int32) if batch is None else np.asarray(batch, np.int32)
    f = mx.array(feats) if isinstance(feats, np.ndarray) else feats
    if f.ndim != 2 or int(f.shape[0]) != len(pts):
        raise SparseTensorError(
            f"feats must be ({len(pts)}, C) (one row per point), got {tuple(f.shape)}."
        )
    vox = geometry.quantize_points(pts, voxel_size, batch=b)
    tensor = SparseTensor(vox.coords, geometry.voxelize(f, vox, "mean"), check=False)
    return PointCloudInput(pts, f, b, float(voxel_size), vox, tensor)
