"""One rank of the data-parallel equivalence test (run by test_distributed.py
through ``spawn_local``), and the single-process reference it is compared to.

The batch is ``SCANS`` small seeded LiDAR scans; rank ``r`` of ``size``
trains on the scans :func:`shard_indices` gives it. The loss is the mean over
scans of each scan's mean cross-entropy, so the average of the ranks' losses
is the loss of the whole batch and averaged gradients are its gradient.

Usage: ``distributed_worker.py MODE STEPS OUT.npz [FAIL-AT-STEP [FAULT
[CHECKPOINT-DIR]]]`` with MODE ``nonorm`` (no batch norm), ``bn`` (per-rank
batch norm) or ``syncbn``. With FAIL-AT-STEP the last rank fails at that step
(0-based): FAULT ``exit`` (the default) exits with status 3 before the step;
``kill`` sends itself SIGKILL and ``raise`` raises a RuntimeError, both in
the middle of the step (after its backward pass, before the gradient
all-reduce). With CHECKPOINT-DIR rank 0 writes, after every completed step
``i``, ``step{i}.safetensors`` (``save_weights``, written to a temporary
name and renamed) and ``step{i}.npz`` (the same parameters as NumPy arrays).
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time

import mlx.core as mx
import mlx.nn as mnn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from mlx_lattice import SparseTensor, distributed, nn, ops, sparse_collate
from mlx_lattice.data import SceneConfig, synthetic_lidar_scan, voxelize_points

SCANS = 4
CLASSES = 4
VOXEL = 0.5
SEED = 1234
LR = 0.05
SMALL_SCENE = SceneConfig(beams=16, azimuth_steps=360, max_range=30.0, buildings=6, cars=6, poles=6)


def scan_batch(indices: list[int]) -> tuple[SparseTensor, list[mx.array], list[mx.array]]:
    """Scans ``indices`` collated (batch index = position), their per-voxel
    seeded targets and the row ranges of each scan."""
    coords, feats, targets = [], [], []
    for i in indices:
        points = synthetic_lidar_scan(seed=SEED + i, config=SMALL_SCENE).points
        cells = voxelize_points(points, VOXEL)[:, 1:]
        height = cells[:, 2:3].astype(np.float32) * VOXEL
        coords.append(cells)
        feats.append(np.concatenate([np.ones_like(height), height], axis=1))
        targets.append(mx.array(np.random.default_rng([SEED, i]).integers(0, CLASSES, len(cells))))
    rows = np.cumsum([0] + [len(c) for c in coords])
    ranges = [mx.arange(int(a), int(b)) for a, b in itertools.pairwise(rows)]
    return sparse_collate(coords, feats), targets, ranges


class _Identity(mnn.Module):
    def __call__(self, x: SparseTensor) -> SparseTensor:
        return x


class SmallUNet(mnn.Module):
    """Submanifold stem, strided down, submanifold, transposed up, skip, head."""

    def __init__(self, norm: bool) -> None:
        super().__init__()

        def bn(c: int) -> mnn.Module:
            return nn.BatchNorm(c) if norm else _Identity()

        self.stem = nn.SubMConv3d(2, 8, 3, bias=not norm)
        self.stem_norm = bn(8)
        self.down = nn.Conv3d(8, 16, kernel_size=2, stride=2, bias=not norm)
        self.down_norm = bn(16)
        self.mid = nn.SubMConv3d(16, 16, 3, bias=not norm)
        self.mid_norm = bn(16)
        self.up = nn.ConvTranspose3d(16, 8, kernel_size=2, stride=2, bias=not norm)
        self.up_norm = bn(8)
        self.head = nn.Linear(16, CLASSES)

    def __call__(self, x: SparseTensor) -> SparseTensor:
        skip = ops.relu(self.stem_norm(self.stem(x)))
        y = ops.relu(self.down_norm(self.down(skip)))
        y = ops.relu(self.mid_norm(self.mid(y)))
        y = ops.relu(self.up_norm(self.up(y)))
        return self.head(ops.cat(y, skip))


def make_model(mode: str) -> SmallUNet:
    mx.random.seed(SEED)
    model = SmallUNet(norm=mode != "nonorm")
    if mode == "syncbn":
        distributed.convert_sync_batchnorm(model)
    model.train()
    return model


def loss_fn(model: SmallUNet, x: SparseTensor, targets: list, ranges: list) -> mx.array:
    logits = model(x).feats
    per_scan = [
        mnn.losses.cross_entropy(logits[r], t, reduction="mean")
        for r, t in zip(ranges, targets, strict=True)
    ]
    return mx.mean(mx.stack(per_scan))


def state(model: SmallUNet) -> dict[str, np.ndarray]:
    """Parameters and batch-norm running statistics, flattened."""
    return {k: np.array(v) for k, v in tree_flatten(model.state) if isinstance(v, mx.array)}


def reference(mode: str, steps: int, parts: int) -> dict[str, np.ndarray]:
    """Single-process training on all scans. ``parts`` > 1 splits the batch
    into that many forward passes whose losses are averaged (what per-rank,
    unsynchronised batch norm computes)."""
    model = make_model("bn" if mode == "syncbn" else mode)
    opt = optim.SGD(learning_rate=LR, momentum=0.9)
    chunks = [list(range(SCANS))[p::parts] for p in range(parts)]
    batches = [scan_batch(c) for c in chunks]

    def total(m: SmallUNet) -> mx.array:
        return mx.mean(mx.stack([loss_fn(m, *b) for b in batches]))

    step = mnn.value_and_grad(model, total)
    for _ in range(steps):
        _, grads = step(model)
        opt.update(model, grads)
        mx.eval(model.state, opt.state)
    return state(model)


def main() -> None:
    mode, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    die_after = int(sys.argv[4]) if len(sys.argv) > 4 else None
    fault = sys.argv[5] if len(sys.argv) > 5 else "exit"
    checkpoints = sys.argv[6] if len(sys.argv) > 6 else None
    group = distributed.init(timeout_s=30)
    rank, size = group.rank(), group.size()
    mine = distributed.shard_indices(SCANS, rank=rank, size=size).tolist()
    x, targets, ranges = scan_batch(mine)
    model = make_model(mode)
    opt = optim.SGD(learning_rate=LR, momentum=0.9)
    step = mnn.value_and_grad(model, lambda m: loss_fn(m, x, targets, ranges))

    # Messages actually sent by average_gradients, and MLX's own averaging as a reference.
    sent = []
    all_sum = mx.distributed.all_sum

    def counting_all_sum(a: mx.array, **kw: object) -> mx.array:
        sent.append(a.nbytes)
        return all_sum(a, **kw)

    extra = {}
    for i in range(steps):
        failing = die_after is not None and i == die_after and rank == size - 1
        if failing and fault == "exit":
            print(f"rank {rank}: exiting on purpose before step {i}", flush=True)
            sys.exit(3)
        with distributed.deadline(30, f"training step {i}"):
            _, grads = step(model)
            if failing:
                mx.eval(grads)
                print(f"rank {rank}: failing ({fault}) in the middle of step {i}", flush=True)
                if fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"rank {rank}: a fault on purpose in step {i}")
            if i == 0:
                mx.distributed.all_sum = counting_all_sum
                averaged = distributed.average_gradients(grads)
                mx.distributed.all_sum = all_sum
                theirs = mnn.average_gradients(grads)
                mx.eval(averaged, theirs)
                diff = max(
                    float(mx.max(mx.abs(a - b)).item())
                    for (_, a), (_, b) in zip(
                        tree_flatten(averaged), tree_flatten(theirs), strict=True
                    )
                )
                extra = {
                    "messages": np.array(len(sent)),
                    "message_bytes": np.array(sum(sent)),
                    "leaves": np.array(len(tree_flatten(grads))),
                    "mlx_average_max_diff": np.array(diff),
                }
            else:
                averaged = distributed.average_gradients(grads)
            opt.update(model, averaged)
            mx.eval(model.state, opt.state)
        if checkpoints is not None and rank == 0:
            path = os.path.join(checkpoints, f"step{i}.safetensors")
            model.save_weights(path + ".tmp.safetensors")
            os.replace(path + ".tmp.safetensors", path)
            np.savez(os.path.join(checkpoints, f"step{i}.npz"), **state(model))
        if die_after is not None:
            time.sleep(0.2)
    np.savez(out, **state(model), **{f"__{k}": v for k, v in extra.items()})
    print(f"rank {rank}/{size}: {steps} steps on scans {mine}", flush=True)


if __name__ == "__main__":
    main()
