"""Smoke run of ``sparse_unet --threads`` (``--quick``, a 5k-voxel scan,
threads 1 and 2) as a child process (the program defines its own absl
flags), checking that the printed rows are consistent, not only that they
printed: each count's speed-up recomputed from the printed times, its
voxels/s from the voxel count, its efficiency from the speed-up, the thread
count read back and restored, the skipped counts and the target line for
this host. (A bad ``--threads`` is ``examples/cli_test.py``'s.)
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

KINDS = ("float32", "compiled w8a8 static")
ROW = re.compile(
    r"^(float32|compiled w8a8 static)\s+(\d+)\s+([\d.]+)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)$"
)


def _run(*args: str) -> str:
    script = importlib.util.find_spec("benchmarks.sparse_unet").origin
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def test_thread_sweep_rows_are_consistent():
    out = _run("--quick", "--threads=2,1,64", "--sweep-voxels=1000", "--rounds=1")
    lines = out.splitlines()
    assert lines[0].startswith("host class: "), lines[0]  # the host class line stays first
    n = int(re.search(r"thread sweep \(MinkUNet, eval mode; (\d+) voxels", out).group(1))
    assert n >= 1000
    cpus = _cpus()
    counts = [t for t in (1, 2) if t <= cpus]
    skipped = [t for t in (2, 64) if t > cpus]
    assert f"skipped: {', '.join(map(str, skipped))} threads (above this host's {cpus} CPUs)" in out
    rows = [ROW.match(line) for line in lines]
    rows = [m.groups() for m in rows if m]
    # One row per model and measured count, in that order (1 thread first).
    assert [(kind, int(t)) for kind, t, *_ in rows] == [(k, t) for k in KINDS for t in counts]
    for kind in KINDS:
        mine = [r for r in rows if r[0] == kind]
        t1 = float(mine[0][2])
        for _, threads, ms, rate, speedup, efficiency in mine:
            threads, ms = int(threads), float(ms)
            # The row's numbers from its printed ms (rounded to 0.01 ms, so
            # each printed time is off by at most 0.005 ms). voxels/s is
            # printed from that rounded ms, to the unit: within 0.5.
            assert abs(int(rate.replace(",", "")) - n / ms * 1e3) <= 0.5
            # speed-up = t1 / tn: the program divides the printed (rounded)
            # times, so the only error is the speed-up's own rounding to
            # 0.01 (at most 0.005); efficiency is that unrounded quotient
            # over threads, rounded to 0.01 likewise.
            assert abs(float(speedup) - t1 / ms) <= 0.005 + 1e-9, (kind, threads)
            assert abs(float(efficiency) - t1 / ms / threads) <= 0.005 + 1e-9, (kind, threads)
            assert ms > 0
        assert float(mine[0][4]) == 1.0  # one thread against itself
    # The kernels' thread count, set for the sweep, is restored after it.
    before = int(re.search(r"mlx_lattice threads (\d+)", out).group(1))
    assert f"restored to {before} after" in out
    if cpus < 8:
        assert f"not measurable here ({cpus} CPUs)" in out
    else:
        assert "8 threads not in --threads" in out

