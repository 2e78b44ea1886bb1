"""Shared test helpers over relations: seeded random relations and the
lists of a built one (loaded by path: this project's pytest runs with
``--import-mode=importlib``, so test files cannot import one another)."""

from __future__ import annotations

import numpy as np

from mlx_lattice.core import KernelRelation, build_kernel_relation

__all__ = ["chain_ref", "edges", "grid_relation", "random_relation", "relation_lists"]


def random_relation(
    rng: np.random.Generator, n_points: int, *, extent: int = 9, batches: int = 2, kernel_size=3
) -> tuple[np.ndarray, KernelRelation]:
    """Up to ``n_points`` distinct cells of an ``extent``³ grid in
    ``batches`` batch entries (drawn: the cells, then the batches), sorted
    (NumPy's unique rows), and their submanifold relation."""
    pts = rng.integers(0, extent, (n_points, 3))
    batch = rng.integers(0, batches, (n_points, 1))
    coords = np.unique(np.concatenate([batch, pts], 1), axis=0).astype(np.int32)
    return coords, build_kernel_relation(coords, kernel_size=kernel_size)


def grid_relation(
    n_points: int,
    side: int,
    kernel_size,
    stride: int,
    transposed: bool,
    seed: int,
    batches: int = 1,
) -> KernelRelation:
    """A relation over up to ``n_points`` distinct voxels of a ``side``³
    grid in ``batches`` batch entries, in the drawn order (dense grids give
    offsets whose edges run over consecutive rows): a submanifold one, or
    with ``stride`` > 1 the strided one or its transpose back onto the
    voxels."""
    rng = np.random.default_rng(seed)
    cells = rng.choice(batches * side**3, size=min(n_points, batches * side**3), replace=False)
    batch, cell = cells // side**3, cells % side**3
    xyz = np.stack([cell // (side * side), (cell // side) % side, cell % side], axis=1)
    coords = np.concatenate([batch[:, None], xyz], axis=1).astype(np.int32)
    if stride == 1:
        return build_kernel_relation(coords, kernel_size=kernel_size)
    rel = build_kernel_relation(coords, kernel_size=kernel_size, stride=stride, kind="forward")
    return rel.transposed() if transposed else rel


def edges(rel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A relation's edges as NumPy arrays: ``(in_rows, out_rows, kernel_ids)``."""
    e = rel.edges
    return np.array(e.in_rows), np.array(e.out_rows), np.array(e.kernel_ids)


def chain_ref(x: np.ndarray, w: np.ndarray, src, dst, k_ids, n_rows: int, channels) -> np.ndarray:
    """float32 sums ``out[dst[e]] += x[src[e]] @ w[k_ids[e]]`` in a
    documented order: offsets ascending, and within one the input channels
    in the order ``channels``, each product exact in float32 (half-precision
    values: 11 or 8 significant bits each) and each add rounded once."""
    acc = np.zeros((n_rows, w.shape[2]), np.float32)
    for k in range(w.shape[0]):
        sel = k_ids == k
        i, o = src[sel], dst[sel]
        assert len(np.unique(o)) == len(o)
        a = acc[o]
        for c in channels:
            a = a + x[i, c][:, None] * w[k, c][None, :]
        acc[o] = a
    return acc


def relation_lists(rel) -> list[list[int]]:
    """Each output row's input rows in kernel-id order (a neighbour relation
    gives every output row's neighbours with kernel id = rank, checked)."""
    out: list[list[int]] = [[] for _ in range(int(rel.n_out_capacity))]
    for i, o, k in zip(*edges(rel), strict=True):
        assert k == len(out[o])  # kernel id = rank
        out[o].append(int(i))
    return out
