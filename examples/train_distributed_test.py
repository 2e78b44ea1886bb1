"""The data-parallel example under MLX's own launcher (``mlx.launch --backend
ring -n 2``) on 127.0.0.1, against the same training in one process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from examples import train_distributed

SCRIPT = Path(train_distributed.__file__)
ARGS = ["--small-scene", "--voxel", "0.5", "--widths", "8,16", "--steps", "3", "--warmup", "0"]


def _two_free_ports() -> int:
    """A port p with p and p + 1 free (mlx.launch uses consecutive ports)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _launcher() -> list[str]:
    script = Path(sys.executable).with_name("mlx.launch")
    if script.exists():
        return [sys.executable, str(script)]
    return [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]


def _mlx_launch(*extra: str, hosts: list[str] | None = None, timeout_s: float = 90) -> str:
    """``mlx.launch`` with ``-n 2``, or with ``hosts`` (a host file path and
    options) instead."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [
        *_launcher(), *(hosts or ["--backend", "ring", "-n", "2"]),
        "--starting-port", str(_two_free_ports()),
        "--python", sys.executable, str(SCRIPT), *ARGS, "--threads", "1", *extra,
    ]  # fmt: skip
    # stdin is a pipe kept open and empty: mlx.launch forwards stdin to the ranks.
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out


def _single(*extra: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert train_distributed.main([*ARGS, *extra]) == 0
    return buf.getvalue()


def _final_loss(out: str) -> float:
    return float(re.findall(r"loss (\d+\.\d+)", out)[-1])


def test_mlx_launch_two_ranks_matches_one_process_with_sync_bn():
    out = _mlx_launch("--sync-bn")
    assert "2 rank(s)" in out, out
    assert re.search(r"^rank 0: +\d+\.\d+ steps/s", out, re.M), out
    assert re.search(r"^rank 1: +\d+\.\d+ steps/s", out, re.M), out
    assert re.search(r"^global: \d+\.\d+ steps/s", out, re.M), out
    one = _single("--sync-bn")
    assert "1 rank(s)" in one
    # Same scans per step, loss normalised by the global voxel count and
    # statistics over all ranks: the same training up to float32 rounding
    # (see mlx_lattice's distributed_tests for the bound on parameters).
    first = [float(v) for v in re.findall(r"loss (\d+\.\d+)", one)]
    assert first[-1] < first[0]
    assert abs(_final_loss(out) - _final_loss(one)) <= 2e-4, (out, one)


def test_host_file_launch_without_sync_bn_trains(tmp_path):
    """The several-hosts route, with both hosts on this machine (mlx.launch
    starts 127.0.0.1 entries locally instead of through ssh)."""
    hostfile = tmp_path / "hosts.json"
    local = {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}
    hostfile.write_text(json.dumps({"backend": "ring", "hosts": [local, local]}))
    out = _mlx_launch(hosts=["--hostfile", str(hostfile)])
    assert "sync-bn False" in out and "rank 1:" in out, out
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) >= 2 and losses[-1] < losses[0], out


def test_bad_arguments_are_refused():
    for bad in (["--steps", "0"], ["--global-batch", "0"], ["--warmup", "-1"]):
        with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as exit_:
            train_distributed.parse_args(bad)
        assert exit_.value.code == 2
