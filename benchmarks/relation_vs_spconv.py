"""Relation building against spconv's CPU map, side by side in one process.

spconv is never a dependency of this repository. Install it into a
throwaway environment of the same Python and NumPy, and name that
environment's ``site-packages`` (shell)::

    python3.11 -m venv /tmp/spconv-env
    /tmp/spconv-env/bin/pip install spconv==2.3.8 cumm==0.7.11
    ./bazelw run //benchmarks:relation_vs_spconv -- \\
        --spconv_path=/tmp/spconv-env/lib/python3.11/site-packages

For each built-in scan (the LiDAR scan at 10 cm and 5 cm, a range
camera's depth image of a room at 3.3 cm, the 709k-voxel surface) it
times spconv's ``SpconvOps.generate_subm_conv_inds_cpu`` for a 3x3x3
submanifold convolution (with the allocation of its pair buffer, as
its PyTorch wrapper makes it; spconv stores one of each pair of symmetric
offsets, and runs on one thread) against ``build_kernel_relation`` (every
offset, its CSR groupings, the configured threads), alternating call by
call, and prints the medians and their ratio. The target of issue 35 is
ours >= 5x faster at every size.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from absl import app, flags

import mlx_lattice
from benchmarks.host_class import host_class_line
from benchmarks.scans import range_scan_coords, surface_coords
from mlx_lattice.core import build_kernel_relation
from mlx_lattice.data import synthetic_lidar_scan, voxelize_points

_SPCONV_PATH = flags.DEFINE_string(
    "spconv_path", None, "site-packages folder of an environment with spconv and cumm"
)
_ROUNDS = flags.DEFINE_integer("rounds", 7, "alternating calls per case", lower_bound=1)
_QUICK = flags.DEFINE_boolean(
    "quick", False, "the two LiDAR cases only (no range image, no surface)"
)


def spconv_map(coords: np.ndarray) -> tuple[Callable[[], np.ndarray], Callable[[], int]]:
    """spconv's submanifold map of ``coords`` ((batch, x, y, z) rows): a
    timed call, and a count of the edges it found (every offset, the centre
    and both directions of each pair counted, to compare with ours)."""
    from cumm import tensorview as tv
    from spconv.core_cc.csrc.sparse.all import SpconvOps

    c = np.array(coords, dtype=np.int32)
    c[:, 1:] -= c[:, 1:].min(axis=0)  # spconv indexes a grid from 0
    c = np.ascontiguousarray(c)
    shape = [int(c[:, axis].max()) + 1 for axis in (1, 2, 3)]

    def run() -> np.ndarray:
        # Allocated per call, as spconv's PyTorch wrapper allocates them
        # (torch.full and torch.zeros in spconv.pytorch.ops): a large pair
        # buffer is fresh memory each time, as our relation's arrays are.
        pairs = np.full((2, 27, len(c)), -1, np.int32)
        counts = np.zeros((27,), np.int32)
        SpconvOps.generate_subm_conv_inds_cpu(
            tv.from_numpy(c),
            tv.from_numpy(pairs),
            tv.from_numpy(c),
            tv.from_numpy(counts),
            batch_size=int(c[:, 0].max()) + 1,
            input_dims=shape,
            ksize=[3, 3, 3],
            dilation=[1, 1, 1],
        )
        return counts

    def edges() -> int:
        return 2 * int(run().sum()) + len(c)

    return run, edges


def main(argv: list[str]) -> None:
    del argv
    if _SPCONV_PATH.value is None:
        raise app.UsageError("--spconv_path: name the site-packages folder that holds spconv")
    sys.path.append(_SPCONV_PATH.value)
    print(host_class_line())
    print(f"mlx_lattice threads {mlx_lattice.get_num_threads()}; spconv one thread")
    scan = synthetic_lidar_scan(seed=0)
    cases = [
        ("LiDAR scan, 10 cm", voxelize_points(scan.points, 0.10)),
        ("LiDAR scan, 5 cm", voxelize_points(scan.points, 0.05)),
    ]
    if not _QUICK.value:
        cases.append(("range image, 3.3 cm", range_scan_coords()))
        cases.append(("surface, 512^3 grid", surface_coords(512)))
    for name, coords in cases:
        coords = np.asarray(coords)
        theirs, count_theirs = spconv_map(coords)
        ours_coords = mx.array(coords)
        mx.eval(ours_coords)

        def ours(c: mx.array = ours_coords) -> int:
            return int(build_kernel_relation(c, kernel_size=3).edges.in_rows.shape[0])

        edges_ours, edges_theirs = ours(), count_theirs()
        if edges_ours != edges_theirs:
            raise SystemExit(f"{name}: spconv found {edges_theirs} edges, ours {edges_ours}")
        t_theirs, t_ours = [], []
        for _ in range(_ROUNDS.value):
            start = time.perf_counter()
            theirs()
            t_theirs.append(time.perf_counter() - start)
            start = time.perf_counter()
            ours()
            t_ours.append(time.perf_counter() - start)
        a, b = statistics.median(t_theirs), statistics.median(t_ours)
        print(
            f"{name:20s} {len(coords):7d} voxels, {edges_ours:8d} edges: spconv {a * 1e3:8.1f} ms, "
            f"build_kernel_relation {b * 1e3:7.1f} ms, ours {a / b:5.2f}x faster (target >= 5)"
        )


if __name__ == "__main__":
    app.run(main)
