"""Data-parallel training of the sparse U-Net on synthetic LiDAR scans.

One process trains alone; under MLX's launcher every process is a rank that
trains on its shard of the scans and averages gradients with the others
(``mlx_lattice.distributed``)::

    ./bazelw build //examples:train_distributed
    # one host, two processes (ring back-end over 127.0.0.1):
    mlx.launch --backend ring -n 2 --python <venv python> bazel-bin/examples/train_distributed --steps 20
    # several hosts: a host file lists them (mlx.distributed_config writes one)
    mlx.launch --backend ring --hostfile hosts.json --python <python> train_distributed.py

Each step uses ``--global-batch`` scans split evenly over the ranks, so the
step is the same whatever the number of processes. Rank 0 prints every
rank's throughput and the global steps/s; ``--json`` adds one machine-readable
line (used by ``//benchmarks:distributed``).
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Iterator, Sequence

import mlx.core as mx
import mlx.nn as mnn
import mlx.optimizers as optim
import numpy as np
from absl import flags
from mlx.utils import tree_flatten
from tqdm import tqdm

import mlx_lattice
from examples import cli
from examples.sparse_unet import SparseUNet
from mlx_lattice import SparseTensor, distributed, sparse_collate
from mlx_lattice.data import CLASS_NAMES, SceneConfig, synthetic_lidar_scan

__all__ = ["load_scan", "main", "parse_args"]

CLASSES = len(CLASS_NAMES)  # every label the built-in scans carry


_STEPS = flags.DEFINE_integer("steps", 10, "training steps", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 2, "untimed first steps", lower_bound=0)
_GLOBAL_BATCH = flags.DEFINE_integer(
    "global-batch", 4, "scans per step over all ranks", lower_bound=1
)
_SCANS = flags.DEFINE_integer("scans", 16, "scans in the dataset", lower_bound=1)
_VOXEL = flags.DEFINE_float("voxel", 0.2, "voxel size in metres")
_WIDTHS = flags.DEFINE_string("widths", "16,32,48", "U-Net channel widths per level")
_SMALL_SCENE = flags.DEFINE_boolean("small-scene", False, "a 16-beam sensor (fast tests)")
_SYNC_BN = flags.DEFINE_boolean("sync-bn", False, "synchronised batch norm")
_LR = flags.DEFINE_float("lr", 0.05, "SGD learning rate")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the weights and the scan order")
_THREADS = flags.DEFINE_integer("threads", None, "mlx_lattice kernel threads")
_TIMEOUT = flags.DEFINE_float("timeout", 120.0, "seconds any one step may take")
_JSON = flags.DEFINE_boolean("json", False, "print a JSON summary line on rank 0")


def parse_args(argv: Sequence[str] | None = None) -> None:
    """Parse the flags ``argv`` (without the program name; ``None``: the
    command line); a bad one exits with status 2."""
    cli.parsed(argv)


def load_scan(index: int, voxel: float, small: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Voxel coordinates ``(N, 3)``, features (occupancy, height) and the
    label of each voxel's first point, for scan ``index``.

    >>> coords, feats, labels = load_scan(0, 0.5, small=True)
    >>> coords.shape[1], feats.shape[1], len(labels) == len(coords)
    (3, 2, True)
    """
    config = SceneConfig(beams=16, azimuth_steps=500) if small else None
    scan = synthetic_lidar_scan(seed=index, config=config)
    cells = np.floor(scan.points / voxel).astype(np.int32)
    coords, first = np.unique(cells, axis=0, return_index=True)
    height = scan.points[first, 2:3]
    feats = np.concatenate([np.ones_like(height), height], axis=1).astype(np.float32)
    return coords, feats, scan.labels[first].astype(np.int32)


def _scan_order(n: int, rank: int, size: int, seed: int) -> Iterator[int]:
    """This rank's scans, epoch after epoch, reshuffled each epoch."""
    for epoch in itertools.count():
        yield from distributed.shard_indices(
            n, rank=rank, size=size, seed=seed, epoch=epoch
        ).tolist()


def _batch(scans: list) -> tuple[SparseTensor, mx.array]:
    x = sparse_collate([s[0] for s in scans], [s[1] for s in scans])
    return x, mx.array(np.concatenate([s[2] for s in scans]))


def main(argv: Sequence[str] | None = None) -> int:
    parse_args(argv)
    # Freed arrays stay in the process for the next step (no fresh page faults).
    mlx_lattice.retain_freed_memory()
    if _THREADS.value is not None:
        mlx_lattice.set_num_threads(_THREADS.value)
    group = distributed.init(timeout_s=_TIMEOUT.value)
    rank, size = group.rank(), group.size()
    if _GLOBAL_BATCH.value % size:
        print(
            f"--global-batch {_GLOBAL_BATCH.value} must be a multiple of the {size} ranks",
            file=sys.stderr,
        )
        return 2
    per_rank = _GLOBAL_BATCH.value // size

    mx.random.seed(_SEED.value)  # every rank starts from the same weights
    widths = tuple(int(w) for w in _WIDTHS.value.split(","))
    model = SparseUNet(2, CLASSES, widths)
    if _SYNC_BN.value:
        distributed.convert_sync_batchnorm(model)
    model.train()
    opt = optim.SGD(learning_rate=_LR.value, momentum=0.9)
    scans = {}

    def loss_fn(m: SparseUNet, x: SparseTensor, y: mx.array, scale: mx.array) -> mx.array:
        # Sum over this rank's voxels times size / (voxels of all ranks): the
        # average over ranks is the mean over the global batch.
        return mnn.losses.cross_entropy(m(x).feats, y, reduction="sum") * scale

    step = mnn.value_and_grad(model, loss_fn)
    compute_s = wait_s = reduce_s = 0.0
    voxels = 0
    grad_bytes = 0
    loss = float("nan")
    order = _scan_order(_SCANS.value, rank, size, _SEED.value)
    total_steps = _WARMUP.value + _STEPS.value
    # Rank 0's bar of steps on a terminal (silent otherwise and on other ranks).
    bar = tqdm(range(total_steps), desc="training", unit="step", leave=False,
               disable=None if rank == 0 else True, file=sys.stderr)  # fmt: skip
    for i in bar:
        picked = [next(order) for _ in range(per_rank)]
        for j in picked:
            if j not in scans:
                scans[j] = load_scan(j, _VOXEL.value, _SMALL_SCENE.value)
        x, y = _batch([scans[j] for j in picked])

        with distributed.deadline(_TIMEOUT.value, f"training step {i}"):
            count = mx.distributed.all_sum(mx.array(float(x.num_points)), group=group)
            mx.eval(count)
            t0 = time.perf_counter()
            value, grads = step(model, x, y, size / count)
            mx.eval(value, grads)
            t1 = time.perf_counter()
            # A one-number all_sum first: waiting for the slowest rank is
            # counted apart from moving the gradients.
            mx.eval(mx.distributed.all_sum(mx.zeros((1,)), group=group))
            t1b = time.perf_counter()
            grads = distributed.average_gradients(grads)
            mx.eval(grads)
            t2 = time.perf_counter()
            opt.update(model, grads)
            mx.eval(model.state, opt.state)
            t3 = time.perf_counter()
        if i >= _WARMUP.value:
            compute_s += (t1 - t0) + (t3 - t2)
            wait_s += t1b - t1
            reduce_s += t2 - t1b
            voxels += x.num_points
        grad_bytes = sum(g.nbytes for _, g in tree_flatten(grads))
        if i == 0 or (i + 1) % max(1, total_steps // 5) == 0 or i + 1 == total_steps:
            with distributed.deadline(_TIMEOUT.value, "averaging the loss"):
                loss = float((mx.distributed.all_sum(value, group=group) / size).item())
            if rank == 0:
                bar.write(f"step {i + 1}/{total_steps}  loss {loss:.4f}", file=sys.stdout)
                sys.stdout.flush()
    bar.close()

    # Every rank's numbers, gathered (a tiny message).
    mine = mx.array([compute_s, wait_s, reduce_s, float(voxels)], dtype=mx.float32)
    with distributed.deadline(_TIMEOUT.value, "gathering throughput"):
        table = np.array(mx.distributed.all_gather(mine[None], group=group)).reshape(size, 4)
    if rank != 0:
        return 0
    n = _STEPS.value
    print(
        f"{size} rank(s), {mlx_lattice.get_num_threads()} kernel thread(s) each; "
        f"global batch {_GLOBAL_BATCH.value} scans, {per_rank} per rank; sync-bn {_SYNC_BN.value}"
    )
    for r, (c, w, a, v) in enumerate(table):
        step_s = (c + w + a) / n
        print(
            f"rank {r}: {1 / step_s:6.2f} steps/s  {v / (step_s * n):10.0f} voxels/s  "
            f"compute {c / n * 1e3:7.1f} ms/step  waiting {w / n * 1e3:6.1f} ms/step  "
            f"all-reduce {a / n * 1e3:6.2f} ms/step"
        )
    slowest = float(np.max(table[:, :3].sum(axis=1))) / n
    print(
        f"global: {1 / slowest:.2f} steps/s, {float(table[:, 3].sum()) / (slowest * n):.0f} voxels/s; "
        f"gradient {grad_bytes / 1e6:.2f} MB/step; final loss {loss:.4f}"
    )
    if _JSON.value:
        print(
            "JSON "
            + json.dumps(
                {
                    "ranks": size,
                    "threads": mlx_lattice.get_num_threads(),
                    "step_s": slowest,
                    "compute_s": float(np.max(table[:, 0])) / n,
                    "wait_s": float(np.max(table[:, 1])) / n,
                    "allreduce_s": float(np.max(table[:, 2])) / n,
                    "grad_bytes": grad_bytes,
                    "voxels_per_step": float(table[:, 3].sum()) / n,
                    "loss": loss,
                }
            )
        )
    return 0


if __name__ == "__main__":
    cli.run(main)
