"""SparseTensor: integer coordinates, features, a tensor stride, and the
coordinate manager that shares kernel relations between layers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

import mlx.core as mx
import numpy as np

from mlx_lattice._errors import MlxLatticeError
from mlx_lattice.core.coordinates import as_coordinates, check_coordinates
from mlx_lattice.core.relations import KernelRelation, build_kernel_relation, normalize_triple

__all__ = [
    "CoordinateKey",
    "CoordinateManager",
    "SparseTensor",
    "SparseTensorError",
    "sparse_collate",
]

Triple = tuple[int, int, int]
#: A coordinate set inside a manager: its tensor stride and a tag ("" for the
#: sets derived by striding; generative layers add their own).
CoordinateKey = tuple[Triple, str]


class SparseTensorError(MlxLatticeError):
    """A sparse tensor or a sparse op got inconsistent inputs."""


class CoordinateManager:
    """The coordinate sets of one network pass and their kernel relations.

    Sets are keyed by tensor stride (and a tag); relations by (input set,
    output set, kernel size, stride, dilation, kind), so every layer at one
    level reuses one relation. A manager is created with the input tensor and
    shared by every tensor derived from it.

    >>> m = CoordinateManager()
    >>> key = m.register(mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32), (1, 1, 1))
    >>> m.relation(key, kernel_size=3)[0] is m.relation(key, kernel_size=3)[0]
    True
    """

    def __init__(self) -> None:
        self._coords: dict[CoordinateKey, mx.array] = {}
        self._relations: dict[tuple, KernelRelation] = {}
        self._memo: dict[Hashable, Any] = {}
        self._generated = 0
        # One tensor may be used from several threads: what is built on first
        # use (output sets, relations, memos) is built once, under this lock
        # (reentrant: building a relation may register or build another).
        self._lock = threading.RLock()

    def register(self, coords: mx.array, tensor_stride: Triple, tag: str = "") -> CoordinateKey:
        """Add a coordinate set; a key already present must hold the same array."""
        key = (tuple(tensor_stride), tag)
        with self._lock:
            existing = self._coords.get(key)
            if existing is not None and existing is not coords:
                raise SparseTensorError(
                    f"coordinate set {key} is already registered with other coordinates."
                )
            self._coords[key] = coords
        return key  # type: ignore[return-value]

    def new_tag(self) -> str:
        """A fresh tag for a generated coordinate set."""
        with self._lock:
            self._generated += 1
            return f"generated{self._generated}"

    def coords(self, key: CoordinateKey) -> mx.array:
        """The coordinates of ``key``."""
        try:
            return self._coords[key]
        except KeyError:
            raise SparseTensorError(f"no coordinate set {key} in this manager.") from None

    def has(self, key: CoordinateKey) -> bool:
        """Whether ``key`` is registered."""
        return key in self._coords

    def keys(self) -> list[CoordinateKey]:
        """Registered coordinate keys."""
        return list(self._coords)

    @property
    def cached_relations(self) -> int:
        """Number of relations built so far."""
        return len(self._relations)

    def relation(
        self,
        in_key: CoordinateKey,
        out_key: CoordinateKey | None = None,
        *,
        kernel_size: int | Sequence[int] = 3,
        stride: int | Sequence[int] = 1,
        dilation: int | Sequence[int] = 1,
        kind: Literal["submanifold", "forward", "target"] = "submanifold",
        shift: Sequence[int] = (0, 0, 0),
    ) -> tuple[KernelRelation, CoordinateKey]:
        """The relation from ``in_key`` (built once), and its output key.

        ``submanifold``: outputs are the inputs. ``forward``: outputs are the
        set at ``in stride * stride`` (computed and registered on first use,
        or ``out_key``). ``target``: outputs are ``out_key`` (a finer set).
        ``shift`` is added to the input coordinates before they are matched
        (rows keep their order): it moves the kernel window, which is how
        convolution ``padding`` is expressed; a ``submanifold`` relation with
        a shift is a stride-1 ``forward`` relation onto the inputs.
        """
        size = normalize_triple(kernel_size, "kernel_size", high=7)
        strides = normalize_triple(stride, "stride")
        dil = normalize_triple(dilation, "dilation")
        moved = tuple(int(v) for v in shift)
        if len(moved) != 3:
            raise SparseTensorError(f"shift must be three ints, got {shift!r}.")
        in_stride, in_tag = in_key
        if kind == "submanifold":
            out_key = in_key
        elif kind == "forward" and out_key is None:
            out_key = (tuple(s * t for s, t in zip(in_stride, strides, strict=True)), in_tag)  # type: ignore[assignment]
        if out_key is None:
            raise SparseTensorError("a target relation needs the output coordinate key.")
        cache_key = (in_key, out_key, size, strides, dil, kind, moved)
        rel = self._relations.get(cache_key)
        if rel is not None:
            return rel, out_key
        with self._lock:
            rel = self._relations.get(cache_key)  # built meanwhile by another thread?
            if rel is None and kind == "target" and not any(moved):
                rel = self._transposed_forward(in_key, out_key, size, dil)
            if rel is None:
                rel = self._build_relation(in_key, out_key, size, strides, dil, kind, moved)
            self._relations[cache_key] = rel
        return rel, out_key

    def _transposed_forward(
        self, in_key: CoordinateKey, out_key: CoordinateKey, size: Triple, dil: Triple
    ) -> KernelRelation | None:
        """A target relation (unshifted) as the reverse of the forward relation
        that came down from its outputs to its inputs, when this manager built
        that one (as a U-Net's encoder does before its decoder): both have
        the same edges, and transposing them is a gather and two counting
        sorts, with no coordinate search. None when there is no such relation."""
        fine, coarse = out_key[0], in_key[0]
        if any(c % f for c, f in zip(coarse, fine, strict=True)):
            return None
        strides = tuple(c // f for c, f in zip(coarse, fine, strict=True))
        down = self._relations.get((out_key, in_key, size, strides, dil, "forward", (0, 0, 0)))
        return None if down is None else down.transposed()

    def _build_relation(
        self,
        in_key: CoordinateKey,
        out_key: CoordinateKey,
        size: Triple,
        strides: Triple,
        dil: Triple,
        kind: str,
        moved: tuple[int, ...],
    ) -> KernelRelation:
        in_stride = in_key[0]
        in_coords = self.coords(in_key)
        if any(moved):
            if kind == "submanifold" or (kind == "forward" and not self.has(out_key)):
                # The output set does not depend on the shift: make it unshifted first.
                self.relation(
                    in_key, out_key, kernel_size=size, stride=strides, dilation=dil, kind=kind
                )
                if kind == "submanifold":
                    kind = "forward"
            in_coords = _shifted(in_coords, moved)
        if kind == "submanifold":
            rel = build_kernel_relation(
                in_coords, kernel_size=size, dilation=dil, tensor_stride=in_stride
            )
        elif kind == "forward":
            given = self._coords.get(out_key)
            rel = build_kernel_relation(
                in_coords,
                given,
                kernel_size=size,
                stride=strides,
                dilation=dil,
                tensor_stride=in_stride,
                kind="forward",
            )
            if given is None:
                self.register(rel.out_coords, out_key[0], out_key[1])
        else:
            rel = build_kernel_relation(
                in_coords,
                self.coords(out_key),
                kernel_size=size,
                dilation=dil,
                tensor_stride=out_key[0],
                kind="target",
            )
        return rel

    def derived(self, source: Hashable, spec: Hashable, make: Callable) -> CoordinateKey:
        """The key of a coordinate set derived from ``source`` by ``spec`` (e.g.
        a generative layer's outputs), made once by ``make()`` -> (coords,
        tensor stride) and registered under a fresh tag."""
        return self.memo(("derived", source, spec), lambda: self.register(*make(), self.new_tag()))

    def memo(self, key: Hashable, make: Callable) -> Any:
        """``make()`` computed once per ``key`` for this manager (e.g. an
        interpolation map between two of its coordinate sets)."""
        with self._lock:
            if key not in self._memo:
                self._memo[key] = make()
            return self._memo[key]


def _shifted(coords: mx.array, shift: tuple[int, ...]) -> mx.array:
    """``coords`` with ``shift`` added to x, y, z (checked to stay in int32)."""
    c = np.array(coords).astype(np.int64)
    c[:, 1:] += np.asarray(shift, np.int64)
    if c.size and (c.min() < -(2**31) or c.max() >= 2**31):
        raise SparseTensorError("padding moves coordinates out of the int32 range.")
    return mx.array(c.astype(np.int32))


class SparseTensor:
    """A sparse 3-D tensor: ``coords`` ``(N, 4)`` int32 rows (batch, x, y, z)
    on a grid of spacing ``tensor_stride``, and ``feats`` ``(N, C)``.

    Tensors derived by sparse ops share the input's :class:`CoordinateManager`
    (and so its cached relations).

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0], [1, 2, 0, 0]], dtype=mx.int32), mx.ones((2, 3)))
    >>> x.num_points, x.num_channels, x.batch_size, x.tensor_stride
    (2, 3, 2, (1, 1, 1))
    """

    def __init__(
        self,
        coords: mx.array | np.ndarray,
        feats: mx.array | np.ndarray,
        *,
        tensor_stride: int | Sequence[int] = 1,
        manager: CoordinateManager | None = None,
        coordinate_key: CoordinateKey | None = None,
        check: bool = True,
    ) -> None:
        stride = normalize_triple(tensor_stride, "tensor_stride")
        coords = check_coordinates(coords, "coords") if check else as_coordinates(coords, "coords")
        if isinstance(feats, np.ndarray):
            feats = mx.array(feats)
        if not isinstance(feats, mx.array) or feats.ndim != 2:
            raise SparseTensorError(
                f"feats must be an (N, C) array, got {getattr(feats, 'shape', type(feats))}."
            )
        if int(feats.shape[0]) != int(coords.shape[0]):
            raise SparseTensorError(
                f"feats has {feats.shape[0]} rows but coords has {coords.shape[0]}; they must match."
            )
        if check and coords.shape[0]:
            spatial = np.array(coords[:, 1:])
            if np.any(spatial % np.array(stride)):
                raise SparseTensorError(f"coords must be multiples of tensor_stride {stride}.")
            if int(np.array(coords[:, 0]).min()) < 0:
                raise SparseTensorError("batch indices (coords[:, 0]) must be >= 0.")
        self.coords = coords
        self.feats = feats
        self.tensor_stride: Triple = stride
        self.manager = manager or CoordinateManager()
        self.coordinate_key: CoordinateKey = coordinate_key or self.manager.register(coords, stride)

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_points(
        cls,
        points: np.ndarray | mx.array | Sequence[np.ndarray],
        voxel_size: float,
        features: np.ndarray | mx.array | Sequence[np.ndarray] | None = None,
        *,
        reduce: Literal["mean", "max", "sum", "first"] = "mean",
        batch: np.ndarray | None = None,
    ) -> SparseTensor:
        """Voxelize float point clouds.

        ``points`` is ``(M, 3)`` (with ``batch`` ``(M,)`` indices, default all
        0) or a list of ``(M_i, 3)`` clouds, one per batch item. Voxel
        ``floor(p / voxel_size)`` gets the ``reduce`` of its points'
        ``features`` (default: ones, an occupancy channel).

        >>> pts = np.array([[0.01, 0.0, 0.0], [0.02, 0.0, 0.0], [0.35, 0.0, 0.0]])
        >>> x = SparseTensor.from_points(pts, 0.1, features=np.array([[1.0], [3.0], [5.0]]))
        >>> x.coords.tolist(), x.feats.tolist()
        ([[0, 0, 0, 0], [0, 3, 0, 0]], [[2.0], [5.0]])
        """
        if not (isinstance(voxel_size, int | float) and np.isfinite(voxel_size) and voxel_size > 0):
            raise SparseTensorError(
                f"voxel_size must be a positive finite number, got {voxel_size!r}."
            )
        if isinstance(points, list | tuple):
            clouds = [np.asarray(p, dtype=np.float64) for p in points]
            batch = np.concatenate([np.full(len(p), i) for i, p in enumerate(clouds)]).astype(
                np.int64
            )
            pts = np.concatenate(clouds) if clouds else np.zeros((0, 3))
            if features is not None and isinstance(features, list | tuple):
                features = np.concatenate([np.asarray(f) for f in features])
        else:
            pts = np.asarray(points, dtype=np.float64)
        if pts.ndim != 2 or pts.shape[1] != 3:
            raise SparseTensorError(f"points must be (M, 3), got shape {pts.shape}.")
        if not np.all(np.isfinite(pts)):
            raise SparseTensorError("points must be finite.")
        m = len(pts)
        batch = np.zeros(m, np.int64) if batch is None else np.asarray(batch, np.int64)
        if batch.shape != (m,) or (m and batch.min() < 0):
            raise SparseTensorError(
                f"batch must be ({m},) non-negative indices, got shape {batch.shape}."
            )
        feats = (
            np.ones((m, 1), np.float32)
            if features is None
            else np.asarray(features, dtype=np.float32)
        )
        if feats.ndim != 2 or len(feats) != m:
            raise SparseTensorError(
                f"features must be (M, C) with M = {m}, got shape {feats.shape}."
            )
        cells = np.floor(pts / voxel_size)
        if m and np.abs(cells).max() >= 2**31:
            raise SparseTensorError("points / voxel_size exceeds the int32 coordinate range.")
        keys = np.concatenate([batch[:, None], cells.astype(np.int64)], axis=1)
        coords, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        n = len(coords)
        if reduce == "first":
            out = feats[first]
        elif reduce == "max":
            out = np.full((n, feats.shape[1]), -np.inf, np.float32)
            np.maximum.at(out, inverse, feats)
        elif reduce in ("mean", "sum"):
            out = np.zeros((n, feats.shape[1]), np.float64)
            np.add.at(out, inverse, feats)
            if reduce == "mean":
                out /= np.bincount(inverse, minlength=n)[:, None]
        else:
            raise SparseTensorError(
                f"reduce must be 'mean', 'max', 'sum' or 'first', got {reduce!r}."
            )
        return cls(mx.array(coords.astype(np.int32)), mx.array(out.astype(np.float32)), check=False)

    @classmethod
    def from_dense(
        cls,
        dense: mx.array | np.ndarray,
        *,
        tensor_stride: int | Sequence[int] = 1,
        origin: Sequence[int] = (0, 0, 0),
    ) -> SparseTensor:
        """The voxels of a dense ``(B, X, Y, Z, C)`` grid with any non-zero channel.

        Voxel ``[b, i, j, k]`` gets coordinate ``origin + (i, j, k) * tensor_stride``.
        """
        grid = np.asarray(dense)
        if grid.ndim != 5:
            raise SparseTensorError(f"dense must be (B, X, Y, Z, C), got shape {grid.shape}.")
        stride = np.array(normalize_triple(tensor_stride, "tensor_stride"))
        idx = np.argwhere(np.any(grid != 0, axis=-1))
        coords = np.concatenate([idx[:, :1], np.asarray(origin) + idx[:, 1:] * stride], axis=1)
        feats = grid[tuple(idx.T)]
        return cls(
            mx.array(coords.astype(np.int32)), mx.array(feats), tensor_stride=tuple(stride.tolist())
        )

    def to_dense(
        self, shape: Sequence[int] | None = None, origin: Sequence[int] | None = None
    ) -> tuple[mx.array, tuple[int, int, int]]:
        """Scatter into a zero ``(B, X, Y, Z, C)`` grid; returns it and its origin.

        Cell ``[b, i, j, k]`` holds coordinate ``origin + (i, j, k) * tensor_stride``.
        ``origin`` defaults to the minimum coordinate, ``shape`` to the extent.
        """
        coords = np.array(self.coords).astype(np.int64)
        stride = np.array(self.tensor_stride)
        lo = (
            np.asarray(origin, np.int64)
            if origin is not None
            else (coords[:, 1:].min(0) if len(coords) else np.zeros(3, np.int64))
        )
        cells = (coords[:, 1:] - lo) // stride
        extent = cells.max(0) + 1 if len(coords) else np.zeros(3, np.int64)
        grid = tuple(int(s) for s in (shape if shape is not None else extent))
        if len(coords) and (np.any(cells < 0) or np.any(cells >= np.array(grid))):
            raise SparseTensorError(
                f"coordinates fall outside the dense grid {grid} at origin {tuple(lo)}."
            )
        b = self.batch_size
        flat = ((coords[:, 0] * grid[0] + cells[:, 0]) * grid[1] + cells[:, 1]) * grid[2] + cells[
            :, 2
        ]
        out = mx.zeros((b * grid[0] * grid[1] * grid[2], self.num_channels), dtype=self.feats.dtype)
        out = out.at[mx.array(flat.astype(np.int32))].add(self.feats)
        return out.reshape(b, *grid, self.num_channels), tuple(int(v) for v in lo)  # type: ignore[return-value]

    # -- properties and derived tensors ---------------------------------------------------

    @property
    def num_points(self) -> int:
        """Rows N."""
        return int(self.coords.shape[0])

    @property
    def num_channels(self) -> int:
        """Feature channels C."""
        return int(self.feats.shape[1])

    @property
    def batch_size(self) -> int:
        """1 + the largest batch index (0 when empty)."""
        return int(self.coords[:, 0].max()) + 1 if self.num_points else 0

    @property
    def dtype(self) -> mx.Dtype:
        """The features' dtype."""
        return self.feats.dtype

    def replace(self, feats: mx.array) -> SparseTensor:
        """The same coordinates with new features (rows must match)."""
        return SparseTensor(
            self.coords,
            feats,
            tensor_stride=self.tensor_stride,
            manager=self.manager,
            coordinate_key=self.coordinate_key,
            check=False,
        )

    def at(self, key: CoordinateKey, feats: mx.array) -> SparseTensor:
        """A tensor on another coordinate set of the same manager."""
        return SparseTensor(
            self.manager.coords(key),
            feats,
            tensor_stride=key[0],
            manager=self.manager,
            coordinate_key=key,
            check=False,
        )

    def astype(self, dtype: mx.Dtype) -> SparseTensor:
        """Features cast to ``dtype``."""
        return self.replace(self.feats.astype(dtype))

    # Arithmetic: another SparseTensor joins on coordinates (outer, fill 0;
    # mlx_lattice.algebra has the other joins); numbers/arrays act on feats.
    def __add__(self, other: SparseTensor | mx.array | float) -> SparseTensor:
        from mlx_lattice.algebra import _operator

        return _operator("add", self, other)

    def __radd__(self, other: mx.array | float) -> SparseTensor:
        from mlx_lattice.algebra import _operator

        return _operator("add", self, other, reflected=True)

    def __sub__(self, other: SparseTensor | mx.array | float) -> SparseTensor:
        from mlx_lattice.algebra import _operator

        return _operator("sub", self, other)

    def __rsub__(self, other: mx.array | float) -> SparseTensor:
        from mlx_lattice.algebra import _operator

        return _operator("sub", self, other, reflected=True)

    def __mul__(self, other: SparseTensor | mx.array | float) -> SparseTensor:
        from mlx_lattice.algebra import _operator

        return _operator("mul", self, other)

    def __rmul__(self, other: mx.array | float) -> SparseTensor:
        from mlx_lattice.algebra import _operator

        return _operator("mul", self, other, reflected=True)

    def __neg__(self) -> SparseTensor:
        return self.replace(-self.feats)

    def __repr__(self) -> str:
        return (
            f"SparseTensor(num_points={self.num_points}, num_channels={self.num_channels}, "
            f"tensor_stride={self.tensor_stride}, dtype={self.dtype})"
        )


def sparse_collate(
    coords: Sequence[np.ndarray | mx.array], feats: Sequence[np.ndarray | mx.array]
) -> SparseTensor:
    """Batch per-sample ``(N_i, 3)`` coordinates and ``(N_i, C)`` features.

    Sample ``i`` gets batch index ``i``.

    >>> x = sparse_collate([np.array([[0, 0, 0]]), np.array([[0, 0, 0], [1, 0, 0]])],
    ...                    [np.ones((1, 2)), np.zeros((2, 2))])
    >>> x.coords[:, 0].tolist()
    [0, 1, 1]
    """
    if len(coords) != len(feats):
        raise SparseTensorError(f"got {len(coords)} coordinate sets but {len(feats)} feature sets.")
    rows, values = [], []
    for i, (c, f) in enumerate(zip(coords, feats, strict=True)):
        c = np.asarray(c)
        f = np.asarray(f, dtype=np.float32)
        if c.ndim != 2 or c.shape[1] != 3:
            raise SparseTensorError(f"coords[{i}] must be (N, 3), got shape {c.shape}.")
        if len(f) != len(c):
            raise SparseTensorError(f"feats[{i}] has {len(f)} rows but coords[{i}] has {len(c)}.")
        rows.append(np.concatenate([np.full((len(c), 1), i), c], axis=1))
        values.append(f)
    return SparseTensor(np.concatenate(rows).astype(np.int32), mx.array(np.concatenate(values)))
