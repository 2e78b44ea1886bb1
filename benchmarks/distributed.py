"""Benchmark: data-parallel training of the example U-Net over mx.distributed.

One run, one machine, all processes on 127.0.0.1 (MLX's ring back-end):

* training step time and all-reduce time per step, for 1 process x 2 kernel
  threads, 1 process x 1 thread and 2 processes x 1 thread, at the same
  global batch (``examples/train_distributed.py``, timed inside the ranks);
* gradient bytes per step;
* loopback all-reduce bandwidth of ``mx.distributed.all_sum`` between 2
  processes, for message sizes around the gradient size.

On a 2-core machine two processes share the cores one process would use,
so there is no extra hardware to gain from; the ratio shows the cost of
waiting and communicating against what a second process parallelises that
one process's kernel threads do not (batch norm, elementwise ops, loss,
optimizer). Other jobs on the machine move it by tens of percent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
from collections.abc import Sequence

from absl import flags

from benchmarks.host_class import host_class_line
from examples import cli
from mlx_lattice import distributed

SIZES_MB = (0.25, 1.0, 4.0, 16.0)

_STEPS = flags.DEFINE_integer("steps", 5, "timed training steps per configuration", lower_bound=1)
_GLOBAL_BATCH = flags.DEFINE_integer(
    "global-batch", 2, "scans per step over all processes", lower_bound=1
)
_VOXEL = flags.DEFINE_float("voxel", 0.2, "voxel size in metres")
_WIDTHS = flags.DEFINE_string("widths", "16,32,48", "U-Net channel widths per level")
_TIMEOUT = flags.DEFINE_float("timeout", 300, "seconds each launch of the processes may take")
_ALLREDUCE_WORKER = flags.DEFINE_boolean(
    "allreduce-worker", False, "internal: run as one rank of the all-reduce measurement"
)


def _allreduce_worker(sizes_mb: Sequence[float]) -> None:
    import mlx.core as mx

    from benchmarks.timing import best_us

    group = distributed.init(timeout_s=60)
    results = []
    for mb in sizes_mb:
        x = mx.ones((int(mb * 1e6) // 4,), dtype=mx.float32)
        mx.eval(x)

        def reduce(x: mx.array = x) -> None:
            with distributed.deadline(60, "all_sum"):
                mx.eval(mx.distributed.all_sum(x, group=group))

        # Best of rounds: the capability of the link, not the other jobs' noise.
        results.append((x.nbytes, best_us(reduce, number=3, repeat=5) * 1e-6))
    if group.rank() == 0:
        print("JSON " + json.dumps(results), flush=True)


def _json_line(out: str) -> object:
    line = next(x for x in out.splitlines() if x.startswith("JSON "))
    return json.loads(line[5:])


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env["MLX_LATTICE_NUM_THREADS"] = str(threads)
    return env


def _train(ranks: int, threads: int) -> dict:
    # The example runs as a child process only: imported here, its flags
    # (--steps, --voxel, ...) would clash with this program's.
    script = importlib.util.find_spec("examples.train_distributed").origin
    argv = [
        script,
        "--steps", str(_STEPS.value), "--warmup", "2", "--global-batch", str(_GLOBAL_BATCH.value),
        "--voxel", str(_VOXEL.value), "--widths", _WIDTHS.value, "--threads", str(threads), "--json",
    ]  # fmt: skip
    print(f"  training: {ranks} process(es) x {threads} thread(s) ...", flush=True)
    run = distributed.spawn_local(argv, ranks, timeout_s=_TIMEOUT.value, env=_env(threads))
    if not run.ok:
        sys.exit(f"training with {ranks} process(es) failed:\n{run.stdout}\n{run.stderr}")
    return _json_line(run.stdout[0])


def main(argv: Sequence[str] | None = None) -> int:
    cli.parsed(argv)
    if _ALLREDUCE_WORKER.value:
        _allreduce_worker(SIZES_MB)
        return 0

    print(host_class_line())
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}; ring back-end on 127.0.0.1; "
        f"U-Net widths {_WIDTHS.value}, voxel {_VOXEL.value} m, global batch {_GLOBAL_BATCH.value} "
        f"scans, {_STEPS.value} timed steps (timings are noisy while other jobs run)"
    )
    runs = {
        "1 proc x 2 threads": _train(1, 2),
        "1 proc x 1 thread": _train(1, 1),
        "2 procs x 1 thread": _train(2, 1),
    }
    print("  all-reduce: 2 processes ...", flush=True)
    run = distributed.spawn_local(
        [__file__, "--allreduce-worker"], 2, timeout_s=_TIMEOUT.value, env=_env(1)
    )
    if not run.ok:
        sys.exit(f"all-reduce benchmark failed:\n{run.stdout}\n{run.stderr}")
    bandwidth = _json_line(run.stdout[0])

    grad_bytes = runs["2 procs x 1 thread"]["grad_bytes"]
    print(f"\ngradient per step: {grad_bytes / 1e6:.2f} MB float32 (one all_sum message)")
    print(
        f"{'configuration':<22}{'step ms':>10}{'compute ms':>12}{'waiting ms':>12}"
        f"{'all-reduce ms':>15}{'share':>8}{'voxels/s':>12}"
    )
    for name, r in runs.items():
        print(
            f"{name:<22}{r['step_s'] * 1e3:10.1f}{r['compute_s'] * 1e3:12.1f}"
            f"{r['wait_s'] * 1e3:12.1f}{r['allreduce_s'] * 1e3:15.2f}"
            f"{r['allreduce_s'] / r['step_s']:8.1%}{r['voxels_per_step'] / r['step_s']:12.0f}"
        )
    print("(waiting: for the slowest rank before the all-reduce; share: all-reduce / step)")
    base = runs["1 proc x 2 threads"]["step_s"]
    two = runs["2 procs x 1 thread"]["step_s"]
    one = runs["1 proc x 1 thread"]["step_s"]
    print(
        f"\nstep time, 2 procs x 1 thread / 1 proc x 2 threads: {two / base:.2f}x "
        f"(> 1: communication and waiting cost more than two processes gain; < 1: two processes "
        f"keep the cores busier than one process's kernel threads)"
    )
    print(f"step time, 2 procs x 1 thread / 1 proc x 1 thread: {two / one:.2f}x")
    print("\nloopback all_sum between 2 processes (best of 5 rounds of 3 calls):")
    print(f"{'message MB':>12}{'ms':>10}{'GB/s':>8}")
    for nbytes, seconds in bandwidth:
        print(f"{nbytes / 1e6:12.2f}{seconds * 1e3:10.2f}{nbytes / seconds / 1e9:8.2f}")
    achieved = grad_bytes / runs["2 procs x 1 thread"]["allreduce_s"] / 1e9
    print(f"gradient all-reduce inside training: {achieved:.2f} GB/s")
    print(
        f"load average at the end: {os.getloadavg()[0]:.1f}. With more runnable jobs than cores, "
        "2 processes get a larger share of the machine than 1, which can hide their overhead."
    )
    return 0


if __name__ == "__main__":
    cli.run(main)
