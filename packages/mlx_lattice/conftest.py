"""Shared test support for mlx_lattice: independent references and fixtures.

The references never use the package's relations or kernels: coordinate
neighbourhoods come from brute-force pairwise differences, convolutions from
MLX's dense ``mx.conv_general`` on a scattered grid.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _seed_mlx(seed: int, doctest_namespace: dict) -> int:
    """Seeds MLX's generator for every test and doctest with the test's seed.

    ``seed`` and ``rng`` come from the repository's pytest plugin
    (``tools/pytest_main.py``): stable per test, printed when a test fails,
    replayed everywhere with ``TEST_SEED=<seed>``.
    """
    doctest_namespace["mx"] = mx
    doctest_namespace["np"] = np
    mx.random.seed(seed)
    return seed


def random_coords(
    rng: np.random.Generator,
    n: int,
    extent: int | tuple[int, int, int],
    batches: int = 1,
    step: int = 1,
) -> np.ndarray:
    """Up to n unique (batch, x, y, z) rows on a grid of spacing `step`."""
    ext = (extent,) * 3 if isinstance(extent, int) else extent
    rows = np.stack(
        [rng.integers(0, batches, n)] + [rng.integers(0, e, n) * step for e in ext], axis=1
    )
    rows = np.unique(rows, axis=0)
    return rows[rng.permutation(len(rows))].astype(np.int32)


def offsets_ref(
    kernel_size: tuple[int, int, int], dilation: tuple[int, int, int], ts: tuple[int, int, int]
) -> np.ndarray:
    """Offsets in x-major order, written out from the documented formula."""
    out = []
    for i in itertools.product(*(range(k) for k in kernel_size)):
        out.append([(i[a] - (kernel_size[a] - 1) // 2) * dilation[a] * ts[a] for a in range(3)])
    return np.array(out, dtype=np.int64).reshape(-1, 3)


def brute_force_edges(
    in_coords: np.ndarray, out_coords: np.ndarray, offsets: np.ndarray, sign: int = 1
) -> set:
    """{(in_row, out_row, k)} by comparing every pair of coordinates."""
    diff = in_coords[None, :, 1:].astype(np.int64) - out_coords[:, None, 1:].astype(np.int64)
    same_batch = in_coords[None, :, 0] == out_coords[:, None, 0]
    edges = set()
    for k, off in enumerate(offsets):
        hit = np.all(diff == sign * off, axis=2) & same_batch
        for o, i in zip(*np.nonzero(hit), strict=True):
            edges.add((int(i), int(o), k))
    return edges


def to_dense(
    coords: np.ndarray, feats: mx.array, shape: tuple[int, int, int], batches: int
) -> mx.array:
    """Scatter rows into a zero (B, X, Y, Z, C) grid."""
    c = int(feats.shape[1])
    flat = ((coords[:, 0] * shape[0] + coords[:, 1]) * shape[1] + coords[:, 2]) * shape[2] + coords[
        :, 3
    ]
    grid = mx.zeros((batches * shape[0] * shape[1] * shape[2], c), dtype=feats.dtype)
    grid = grid.at[mx.array(flat.astype(np.int32))].add(feats)
    return grid.reshape(batches, *shape, c)


def dense_conv(
    coords: np.ndarray,
    feats: mx.array,
    weight: mx.array,
    *,
    grid: tuple[int, int, int],
    batches: int,
    out_coords: np.ndarray,
    stride: tuple[int, int, int] = (1, 1, 1),
    dilation: tuple[int, int, int] = (1, 1, 1),
) -> mx.array:
    """Sparse conv through a dense grid: scatter, mx.conv_general, gather.

    weight is (Cout, kx, ky, kz, Cin); out_coords are multiples of stride.
    """
    ks = tuple(int(d) for d in weight.shape[1:4])
    lo = [((k - 1) // 2) * d for k, d in zip(ks, dilation, strict=True)]
    hi = [(k - 1 - (k - 1) // 2) * d for k, d in zip(ks, dilation, strict=True)]
    dense = to_dense(coords, feats, grid, batches)
    out = mx.conv_general(
        dense, weight, stride=list(stride), padding=(lo, hi), kernel_dilation=list(dilation)
    )
    idx = out_coords.astype(np.int64)
    pos = [idx[:, a + 1] // stride[a] for a in range(3)]
    return out[mx.array(idx[:, 0]), mx.array(pos[0]), mx.array(pos[1]), mx.array(pos[2])]


def brute_force_pool(feats: np.ndarray, edges: set, n_out: int, mode: str) -> np.ndarray:
    out = np.zeros((n_out, feats.shape[1]), dtype=np.float64)
    groups: dict[int, list[int]] = {}
    for i, o, _ in edges:
        groups.setdefault(o, []).append(i)
    for o, rows in groups.items():
        vals = feats[rows].astype(np.float64)
        out[o] = vals.max(0) if mode == "max" else vals.sum(0) / (len(rows) if mode == "avg" else 1)
    return out


@pytest.fixture
def ref() -> SimpleNamespace:
    """The independent references, as one namespace."""
    return SimpleNamespace(
        random_coords=random_coords,
        offsets=offsets_ref,
        brute_force_edges=brute_force_edges,
        to_dense=to_dense,
        dense_conv=dense_conv,
        brute_force_pool=brute_force_pool,
    )
