"""taktiny_ops across 2 JAX processes on CPU (jax.distributed on 127.0.0.1,
gloo collectives), against the same program in one process.

Equality: the 2-process run and a single process with 2 host devices
compile the same partitioned program (same mesh, same shardings), and a
2-way sum does not depend on order, so every output must match bit for bit.
Against the unpartitioned 1-device program the quantized outputs differ by a
few int8 rounding steps (the partitioned program has its own partial sums,
collectives and fusions, so a value near a rounding boundary can land on the
other side, as in sharding_test): the float forward agrees to 1e-5, the
quantized forward is as close to the float result as the 1-device one is (2.5x
slack as in sharding_test), and after 3 QT steps parameters agree to 1e-3
(observed 1e-4; learning rate 0.05 times gradients of order 1).

The processes talk over loopback sockets: on a host where a client cannot
connect to a listener on 127.0.0.1 (a sandboxed TPU host, loopback down)
the tests skip and say so. They run on the CPU backend
(``JAX_PLATFORMS=cpu``) wherever the test process runs, so that they never
contend for an accelerator the test process holds.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "multiprocess.py"


def _loopback_error() -> str | None:
    """Why this host cannot talk over a loopback socket, or None if it can.

    A listener alone is not enough: with the loopback interface down, bind
    and listen succeed and connect fails ("Network is unreachable"), so a
    client connects to the listener too, as jax.distributed's will."""
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            with socket.create_connection(server.getsockname(), timeout=5):
                pass
    except OSError as e:
        return (f"needs loopback sockets for jax.distributed; this host cannot connect to "
                f"a listener on 127.0.0.1 ({type(e).__name__}: {e})")
    return None


_NO_LOOPBACK = _loopback_error()
needs_loopback = pytest.mark.skipif(_NO_LOOPBACK is not None, reason=str(_NO_LOOPBACK))


def test_probe_names_an_unreachable_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bind and listen succeed with loopback down; the probe's connect fails
    and its reason names the error. The listener is a stand-in, so the test
    does not depend on this host's sockets (a sandboxed TPU host refuses even
    creating one)."""
    class Listener:
        def __enter__(self) -> Listener:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            self.address = address

        def listen(self, backlog: int) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return self.address

    def unreachable(*args: object, **kwargs: object) -> socket.socket:
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "socket", Listener)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    reason = _loopback_error()
    assert reason is not None and "Network is unreachable" in reason, reason


def test_probe_skips_in_a_network_namespace_without_loopback() -> None:
    """``unshare -rn`` runs the probe in a fresh network namespace, whose
    loopback interface is down (where unprivileged namespaces are allowed)."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rn", "true"],
                                         capture_output=True).returncode != 0:
        pytest.skip("needs unshare -rn (unprivileged network namespaces) to take loopback down")
    probe = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location("
             "'probe', sys.argv[1]); m = importlib.util.module_from_spec(spec); "
             "spec.loader.exec_module(m); print(m._NO_LOOPBACK)")
    done = subprocess.run([unshare, "-rn", sys.executable, "-c", probe, __file__],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cannot connect to a listener on 127.0.0.1" in done.stdout, done.stdout


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONUNBUFFERED="1",
               JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(argvs: list[list[str]], timeout_s: float = 50) -> tuple[list[int], list[str], float]:
    """Start one process per argv, wait at most timeout_s, kill what is left."""
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(EXAMPLE), *argv],
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for argv in argvs
    ]
    outs = []
    try:
        for p in procs:
            left = max(1.0, timeout_s - (time.monotonic() - start))
            outs.append(p.communicate(timeout=left)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [p.returncode for p in procs], outs, time.monotonic() - start


def _two(port: int, *extra: str, out: Path | None = None) -> tuple[list[int], list[str], float]:
    common = ["--num-processes", "2", "--port", str(port), "--timeout", "30", *extra]
    first = [*common, "--process-id", "0"] + (["--out", str(out)] if out else [])
    return _spawn([first, [*common, "--process-id", "1"]])


@needs_loopback
def test_two_processes_equal_the_single_process_program(tmp_path: Path) -> None:
    codes, outs, _ = _two(_free_port(), out=tmp_path / "multi.npz")
    assert codes == [0, 0], "\n".join(outs)
    for r, out in enumerate(outs):
        # Each process holds half of w1: the weights are sharded across processes.
        assert f"process {r}/2: 2 devices on the mesh, w1 shard (64, 64) of (64, 128)" in out, out
        # The cross-process collectives are gloo's (JAX 0.10's CPU default).
        assert f"[Gloo] Rank {r} is connected to 1 peer ranks" in out, out
    losses = [out.split("QT losses ")[1].split(";")[0] for out in outs]
    assert losses[0] == losses[1]

    codes, outs, _ = _spawn(
        [["--single", "2", "--out", str(tmp_path / "two.npz")],
         ["--single", "1", "--out", str(tmp_path / "one.npz")]]
    )  # fmt: skip
    assert codes == [0, 0], "\n".join(outs)
    multi, two, one = (dict(np.load(tmp_path / f)) for f in ("multi.npz", "two.npz", "one.npz"))
    assert set(multi) == set(two) == {
        "forward", "forward_float", "losses",
        "trained_w1", "trained_b1", "trained_w2", "trained_b2",
    }  # fmt: skip
    for k in multi:
        np.testing.assert_array_equal(multi[k], two[k], err_msg=k)

    np.testing.assert_allclose(multi["forward_float"], one["forward_float"], rtol=1e-5, atol=1e-5)
    err_multi = np.abs(multi["forward"] - multi["forward_float"]).max()
    err_one = np.abs(one["forward"] - one["forward_float"]).max()
    assert 0 < err_multi <= 2.5 * err_one + 1e-5, (err_multi, err_one)
    assert multi["losses"][-1] < multi["losses"][0]  # QT training makes progress
    np.testing.assert_allclose(multi["losses"], one["losses"], rtol=1e-3)
    for k in ("trained_w1", "trained_b1", "trained_w2", "trained_b2"):
        np.testing.assert_allclose(multi[k], one[k], atol=1e-3, err_msg=k)


@needs_loopback
def test_peer_death_ends_the_survivor_quickly() -> None:
    codes, outs, seconds = _two(_free_port(), "--die-before-train")
    assert codes[1] == 3, outs[1]
    assert codes[0] == 1, outs[0]
    assert "process 0: a collective failed; a peer process has probably died" in outs[0], outs[0]
    assert seconds < 45


@needs_loopback
def test_taken_coordinator_port_ends_both_processes() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(4)
        codes, outs, seconds = _two(holder.getsockname()[1], "--timeout", "8")
    # Both exit by themselves with a message (JAX alone would crash the
    # coordinator and abort the other process).
    assert codes == [2, 2], (codes, outs)
    assert "process 0: cannot serve as coordinator" in outs[0], outs[0]
    assert "process 1: could not join the 2 JAX processes at 127.0.0.1" in outs[1], outs[1]
    assert seconds < 45
