"""Shared test support for mlx_lattice: independent references and fixtures.

The references never use the package's relations or kernels: coordinate
neighbourhoods come from brute-force pairwise differences, convolutions from
MLX's dense ``mx.conv_general`` on a scattered grid.
"""

from __future__ import annotations

import itertools
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
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


# The child of ``conv_per_isa``: one forward convolution of the saved case in
# the given dtype, its output as 16-bit patterns, and the paths that ran it.
_CONV_CHILD = """
import sys
import mlx.core as mx
import numpy as np
from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation, ops

data = np.load(sys.argv[1])
dtype = getattr(mx, sys.argv[3])
rel = build_kernel_relation(data["coords"], kernel_size=3)
f = mx.array(data["f"]).astype(dtype)
w = mx.array(data["w"]).astype(dtype)
out = ops.sparse_conv_features_from_relation(f, w, rel).view(mx.uint16)
np.savez(
    sys.argv[2], out=np.array(out), bf16=ext.bf16_isa(), fp16=ext.fp16_isa(), gemm=ext.gemm_isa()
)
"""


@pytest.fixture
def isa_child() -> Callable[..., None]:
    """Runs ``python -c script *args`` in a child process with the
    micro-kernels capped at an ISA: ``run(script, isa, *args)``.

    The kernels are picked once per process, so each ceiling
    (``MLX_LATTICE_GEMM_ISA``) needs its own child; under user-mode emulation
    (tools/arm64) the child needs the emulator in front of it, which
    ``MLX_LATTICE_TEST_LAUNCHER`` names.
    """
    launcher = shlex.split(os.environ.get("MLX_LATTICE_TEST_LAUNCHER", ""))

    def run(script: str, isa: str, *args: object) -> None:
        subprocess.run(
            [*launcher, sys.executable, "-c", script, *map(str, args)],
            env=dict(os.environ, MLX_LATTICE_GEMM_ISA=isa),
            check=True,
        )

    return run


@pytest.fixture
def conv_per_isa(
    tmp_path: Path, isa_child: Callable[..., None]
) -> Callable[..., dict[str, dict[str, object]]]:
    """Runs one half-precision forward convolution once per ISA ceiling.

    The micro-kernels are picked once per process, so each ceiling
    (``MLX_LATTICE_GEMM_ISA``) runs in a child Python (under
    ``MLX_LATTICE_TEST_LAUNCHER`` when set, e.g. qemu for tools/arm64).
    ``run(coords, f, w, dtype, isas)`` returns, per ISA name, ``out`` (the
    output's uint16 bit patterns) and the paths the child used: ``bf16``,
    ``fp16`` (``ext.bf16_isa()``, ``ext.fp16_isa()``) and ``gemm``.
    """

    def run(
        coords: np.ndarray, f: np.ndarray, w: np.ndarray, dtype: str, isas: Iterable[str]
    ) -> dict[str, dict[str, object]]:
        case = tmp_path / "case.npz"
        np.savez(case, coords=coords, f=f, w=w)
        results = {}
        for isa in isas:
            out = tmp_path / f"{isa}.npz"
            isa_child(_CONV_CHILD, isa, case, out, dtype)
            with np.load(out) as data:
                results[isa] = {
                    "out": data["out"],
                    **{key: str(data[key]) for key in ("bf16", "fp16", "gemm")},
                }
        return results

    return run
