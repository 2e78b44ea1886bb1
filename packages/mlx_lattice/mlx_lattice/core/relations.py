"""Kernel relations: the edges between an input and an output coordinate set.

Conventions (fixed, relied on by the weight layout and by every kernel):

* Coordinates are ``(N, 4)`` int32 rows ``(batch, x, y, z)``.
* Kernel offset ``k`` enumerates ``(ix, iy, iz)`` x-major,
  ``k = (ix * ky + iy) * kz + iz``, matching a ``(Cout, kx, ky, kz, Cin)``
  weight flattened to ``(K, Cin, Cout)``.
* Along each axis ``offset(i) = (i - (size - 1) // 2) * dilation * tensor_stride``:
  odd sizes are centred (3 -> -1, 0, +1), even sizes lean forward
  (2 -> 0, +1; 4 -> -1, 0, +1, +2), so a size-2 stride-2 kernel covers
  exactly the 2x2x2 block its output coordinate starts.
* ``submanifold``/``forward``: input ``p`` joins output ``q`` through ``k``
  when ``p == q + offset(k)``; ``target`` (the transpose of ``forward``, for
  transposed convolution back to a finer set): when ``p == q - offset(k)``,
  with ``tensor_stride`` the *output's* (finer) stride. Batches never mix.
  :meth:`KernelRelation.transposed` reverses a built relation into its
  ``target`` relation without a search.
* A ``forward`` relation without given outputs produces the input coordinates
  floored to multiples of ``tensor_stride * stride``, unique and ascending by
  ``(batch, x, y, z)`` (with stride 1: the input coordinates themselves, in
  their order); its output tensor stride is ``tensor_stride * stride``.
  Sorted outputs keep a network's coarser levels sorted, and relations on
  sorted coordinates are built by walking them instead of hashing. A floored coordinate below
  int32 (int32's minimum and a step that does not divide 2^31) raises.
* Edges are grouped by output row, offsets ascending within a row
  (``output_csr.edge_ids`` is the identity); the input and kernel CSR views
  list edge ids grouped by input row / offset, ascending.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import mlx.core as mx
import numpy as np

from mlx_lattice._errors import MlxLatticeError, MlxLatticeTypeError
from mlx_lattice._native import ext
from mlx_lattice.core.coordinates import as_coordinates

__all__ = [
    "KernelRelation",
    "RelationCSR",
    "RelationContract",
    "RelationEdges",
    "RelationKind",
    "SortedImplicitGemmView",
    "build_kernel_relation",
    "kernel_offsets",
    "normalize_triple",
]

#: The relation kinds: "submanifold" (the outputs are the inputs), "forward"
#: (a strided or given output set) and "target" (the transpose of "forward",
#: back onto a given finer set); see the module's conventions.
RelationKind = Literal["submanifold", "forward", "target"]
_KINDS = ("submanifold", "forward", "target")

#: Rows per tile of ``SortedImplicitGemmView.tile_masks``.
SORTED_TILE_ROWS: int = ext.SORTED_TILE_ROWS


def normalize_triple(
    value: int | Sequence[int], name: str, *, low: int = 1, high: int | None = None
) -> tuple[int, int, int]:
    """An int or a 3-sequence of ints -> a checked ``(x, y, z)`` triple."""
    items = (value,) * 3 if isinstance(value, int | np.integer) else tuple(value)
    if len(items) != 3 or not all(
        isinstance(v, int | np.integer) and not isinstance(v, bool) for v in items
    ):
        raise MlxLatticeTypeError(f"{name} must be an int or three ints, got {value!r}.")
    triple = tuple(int(v) for v in items)
    if any(v < low or (high is not None and v > high) for v in triple):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise MlxLatticeError(f"{name} must be {bound} per axis, got {value!r}.")
    return triple  # type: ignore[return-value]


def kernel_offsets(
    kernel_size: int | Sequence[int] = 3,
    dilation: int | Sequence[int] = 1,
    tensor_stride: int | Sequence[int] = 1,
) -> np.ndarray:
    """The ``(K, 3)`` coordinate offsets of kernel indices ``k = 0 .. K-1``.

    >>> kernel_offsets(3)[[0, 13, 26]].tolist()
    [[-1, -1, -1], [0, 0, 0], [1, 1, 1]]
    >>> kernel_offsets(2, tensor_stride=2)[:3].tolist()
    [[0, 0, 0], [0, 0, 2], [0, 2, 0]]
    """
    size = normalize_triple(kernel_size, "kernel_size", high=7)
    dil = normalize_triple(dilation, "dilation")
    ts = normalize_triple(tensor_stride, "tensor_stride")
    axes = [(np.arange(size[a]) - (size[a] - 1) // 2) * dil[a] * ts[a] for a in range(3)]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1)
    return grid.reshape(-1, 3).astype(np.int64)


@dataclass(frozen=True)
class RelationContract:
    """What a relation means: its kind and kernel geometry.

    ``tensor_stride`` is the input's for ``submanifold``/``forward`` and the
    output's for ``target``; ``out_tensor_stride`` is always the output's.
    """

    kind: RelationKind
    kernel_size: tuple[int, int, int]
    stride: tuple[int, int, int]
    dilation: tuple[int, int, int]
    tensor_stride: tuple[int, int, int]
    out_tensor_stride: tuple[int, int, int]


@dataclass(frozen=True)
class RelationEdges:
    """The edge list: edge ``e`` maps input row ``in_rows[e]`` to output row
    ``out_rows[e]`` through kernel offset ``kernel_ids[e]``."""

    in_rows: mx.array
    out_rows: mx.array
    kernel_ids: mx.array


@dataclass(frozen=True)
class RelationCSR:
    """Edges grouped by a key: group ``g`` holds ``edge_ids[row_offsets[g]:row_offsets[g+1]]``."""

    row_offsets: mx.array
    edge_ids: mx.array | None


@dataclass(frozen=True)
class SortedImplicitGemmView:
    """The sorted implicit-GEMM dataflow of a relation (TorchSparse++ style).

    ``out_in_map[o, k]`` is the input row of output ``o`` through offset ``k``
    or -1; rows are stably sorted by their bitmask of present offsets
    (``reorder_rows``: sorted position -> output row), ``sorted_out_in_map`` is
    the permuted map and ``sorted_kv_out_in_map`` its offset-major transpose;
    ``tile_masks[t]`` ORs the bitmasks of sorted rows
    ``[t * SORTED_TILE_ROWS, (t + 1) * SORTED_TILE_ROWS)``.
    """

    sorted_out_in_map: mx.array
    reorder_rows: mx.array
    tile_masks: mx.array

    @property
    def out_in_map(self) -> mx.array:
        """The map in output-row order (derived; no kernel reads it)."""
        return mx.take(self.sorted_out_in_map, mx.argsort(self.reorder_rows), axis=0)

    @property
    def sorted_kv_out_in_map(self) -> mx.array:
        """``sorted_out_in_map`` in offset-major order (derived; no kernel reads it)."""
        return mx.contiguous(self.sorted_out_in_map.T)


@dataclass(frozen=True, eq=False)
class KernelRelation:
    """Edges between ``in_coords`` and ``out_coords`` for one kernel shape.

    Build one with :func:`build_kernel_relation`. Arrays are int32 and
    evaluated; the relation is immutable and safe to share between layers.
    It crosses into the native ops as this one object: they read ``edges``,
    the three ``*_csr`` groupings, ``n_in``, ``n_out_capacity`` and
    ``n_kernels``. The builder's relation is valid by construction and
    carries its native form; the ops validate any other once, and again
    only if an index array is replaced or updated in place.
    """

    contract: RelationContract
    in_coords: mx.array
    out_coords: mx.array
    edges: RelationEdges
    counts: mx.array
    output_csr: RelationCSR
    input_csr: RelationCSR
    kernel_csr: RelationCSR
    n_out_capacity: int | None
    n_kernels: int | None
    _sorted: list[SortedImplicitGemmView] = field(default_factory=list, repr=False, compare=False)
    # The native builder's validated relation (an opaque handle): the ops use
    # it while the arrays above are the built ones, and validate otherwise.
    _native: object = field(default=None, repr=False, compare=False)

    @property
    def n_in(self) -> int:
        """Rows of the input coordinate set."""
        return int(self.in_coords.shape[0])

    @property
    def n_edges(self) -> int:
        """Number of edges."""
        return int(self.edges.in_rows.shape[0])

    @property
    def in_edge_ids(self) -> mx.array | None:
        """Edge ids grouped by input row (``input_csr.edge_ids``)."""
        return self.input_csr.edge_ids

    @property
    def kernel_edge_ids(self) -> mx.array | None:
        """Edge ids grouped by kernel offset (``kernel_csr.edge_ids``)."""
        return self.kernel_csr.edge_ids

    def transposed(self) -> KernelRelation:
        """The ``target`` relation back from this relation's outputs onto its inputs.

        A transposed convolution back onto a finer set uses the edges of the
        strided ``forward`` relation that came down from it, reversed
        (``in == out + offset(k)`` one way is ``out == in - offset(k)`` the
        other). This is that relation, equal array for array to
        ``build_kernel_relation(self.out_coords, self.in_coords,
        kind="target", kernel_size=..., dilation=..., tensor_stride=...)``
        with this relation's kernel and input tensor stride, made natively
        from the edges without searching a coordinate set again.

        Raises:
            ValueError: this relation is a ``target`` relation itself (build
                the ``forward`` relation instead), or its arrays were
                replaced with invalid ones.

        >>> fine = mx.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 2, 2, 2]], dtype=mx.int32)
        >>> down = build_kernel_relation(fine, kernel_size=2, stride=2, kind="forward")
        >>> up = down.transposed()
        >>> up.contract.kind, up.out_coords.shape, up.edges.kernel_ids.tolist()
        ('target', (3, 4), [0, 4, 0])
        >>> direct = build_kernel_relation(down.out_coords, fine, kernel_size=2, kind="target")
        >>> up.edges.in_rows.tolist() == direct.edges.in_rows.tolist()
        True
        """
        c = self.contract
        if c.kind == "target":
            raise MlxLatticeError(
                "transposed() reverses a 'submanifold' or 'forward' relation; this relation is "
                "a 'target' relation already (transpose the forward relation it reverses)."
            )
        ts = c.tensor_stride
        return _built_relation(
            RelationContract("target", c.kernel_size, (1, 1, 1), c.dilation, ts, ts),
            self.out_coords,
            self.in_coords,
            ext.transpose_kernel_relation(self),
        )

    def out_in_map(self) -> mx.array:
        """``(n_out, K)`` input row per (output, offset), or -1."""
        return self.require_sorted_implicit_gemm().out_in_map

    def require_sorted_implicit_gemm(self) -> SortedImplicitGemmView:
        """The sorted implicit-GEMM view, derived on first use and kept.

        Raises:
            ValueError: if the kernel has more than 32 offsets (tile masks
                are 32-bit).
        """
        if self._sorted:
            return self._sorted[0]
        n_out, n_kernels = int(self.n_out_capacity or 0), int(self.n_kernels or 0)
        if n_kernels > 32:
            raise MlxLatticeError(
                f"the sorted implicit-GEMM view supports at most 32 kernel offsets, got {n_kernels}."
            )
        out_in = np.full((n_out, n_kernels), -1, dtype=np.int32)
        out_in[np.array(self.edges.out_rows), np.array(self.edges.kernel_ids)] = np.array(
            self.edges.in_rows
        )
        bits = np.left_shift(np.uint64(1), np.arange(n_kernels, dtype=np.uint64))
        row_masks = ((out_in >= 0).astype(np.uint64) * bits).sum(axis=1, dtype=np.uint64)
        reorder = np.argsort(row_masks, kind="stable").astype(np.int32)
        sorted_map = out_in[reorder]
        sorted_masks = row_masks[reorder].astype(np.uint32)
        tiles = -(-n_out // SORTED_TILE_ROWS)
        if n_out:
            tile_masks = np.bitwise_or.reduceat(sorted_masks, np.arange(0, n_out, SORTED_TILE_ROWS))
        else:
            tile_masks = np.zeros(tiles, dtype=np.uint32)
        view = SortedImplicitGemmView(
            sorted_out_in_map=mx.array(sorted_map),
            reorder_rows=mx.array(reorder),
            tile_masks=mx.array(tile_masks.view(np.int32)),
        )
        mx.eval(
            view.sorted_out_in_map,
            view.reorder_rows,
            view.tile_masks,
        )
        self._sorted.append(view)
        return view


def build_kernel_relation(
    in_coords: mx.array | np.ndarray,
    out_coords: mx.array | np.ndarray | None = None,
    *,
    kernel_size: int | Sequence[int] = 3,
    stride: int | Sequence[int] = 1,
    dilation: int | Sequence[int] = 1,
    tensor_stride: int | Sequence[int] = 1,
    kind: RelationKind = "submanifold",
) -> KernelRelation:
    """Build the kernel relation between two coordinate sets (natively).

    Args:
        in_coords: ``(N, 4)`` int32 input coordinates, no duplicates.
        out_coords: output coordinates; ``None`` for ``submanifold`` (the
            inputs) or a strided ``forward`` (computed); required for ``target``.
        kernel_size: 1-7 per axis (an int or three ints; even sizes allowed).
        stride: ``forward`` only.
        dilation: spacing of kernel taps in units of ``tensor_stride``.
        tensor_stride: grid spacing of the input (``target``: of the output).
        kind: ``'submanifold'``, ``'forward'`` or ``'target'``.

    >>> coords = mx.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 4, 4, 4]], dtype=mx.int32)
    >>> rel = build_kernel_relation(coords, kernel_size=3)
    >>> rel.n_edges, rel.edges.out_rows.tolist(), rel.edges.kernel_ids.tolist()
    (5, [0, 0, 1, 1, 2], [13, 22, 4, 13, 13])
    """
    if kind not in _KINDS:
        raise MlxLatticeError(f"kind must be one of {_KINDS}, got {kind!r}.")
    size = normalize_triple(kernel_size, "kernel_size", high=7)
    strides = normalize_triple(stride, "stride")
    dil = normalize_triple(dilation, "dilation")
    ts = normalize_triple(tensor_stride, "tensor_stride")
    inputs = as_coordinates(in_coords, "in_coords")
    outputs = None if out_coords is None else as_coordinates(out_coords, "out_coords")
    raw = ext.build_kernel_relation(
        inputs, outputs, kernel_size=size, stride=strides, dilation=dil, tensor_stride=ts, kind=kind
    )
    out_ts = tuple(t * s for t, s in zip(ts, strides, strict=True)) if kind == "forward" else ts
    contract = RelationContract(kind, size, strides, dil, ts, out_ts)  # type: ignore[arg-type]
    return _built_relation(contract, inputs, raw["out_coords"], raw)


def _built_relation(
    contract: RelationContract, in_coords: mx.array, out_coords: mx.array, raw: dict
) -> KernelRelation:
    """The KernelRelation of a native builder's arrays (``raw``, with its
    ``native`` handle) between two coordinate sets."""
    size = contract.kernel_size
    return KernelRelation(
        contract=contract,
        in_coords=in_coords,
        out_coords=out_coords,
        edges=RelationEdges(raw["in_rows"], raw["out_rows"], raw["kernel_ids"]),
        # Edges per offset: derived lazily from the kernel grouping (no kernel reads it).
        counts=raw["kernel_row_offsets"][1:] - raw["kernel_row_offsets"][:-1],
        # Edges are stored grouped by output: the output grouping's edge ids are
        # the identity, derived lazily (MLX evaluates them only if read).
        output_csr=RelationCSR(
            raw["output_row_offsets"], mx.arange(int(raw["in_rows"].shape[0]), dtype=mx.int32)
        ),
        input_csr=RelationCSR(raw["input_row_offsets"], raw["input_edge_ids"]),
        kernel_csr=RelationCSR(raw["kernel_row_offsets"], raw["kernel_edge_ids"]),
        n_out_capacity=int(out_coords.shape[0]),
        n_kernels=size[0] * size[1] * size[2],
        _native=raw["native"],
    )
