"""Data parallelism with real processes: 2 ranks of MLX's ring back-end on
127.0.0.1 against single-process training on the whole batch.

Tolerance: the data-parallel run adds each rank's partial gradient (and,
with synchronised batch norm, partial sums and squared deviations) after the
fact, where the single process accumulates all rows in one pass; float32
re-association changes the last bits, and three SGD steps with momentum carry
that forward. Observed maximum absolute differences of parameters: 2e-8
without batch norm, 1.2e-6 with synchronised batch norm (normalising by a
standard deviation over a few hundred rows amplifies the rounding of the
statistics). The bounds are about 10x those: ``atol`` 2e-7 and 1e-5 (``rtol``
1e-5). Per-rank, unsynchronised batch norm moves the same parameters by about
7e-4, 70x the batch-norm bound (checked below: more than 20x).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as mnn
import numpy as np
import pytest

from mlx_lattice import distributed

WORKER = Path(__file__).with_name("distributed_worker.py")
STEPS = 3
RTOL = 1e-5
ATOL = {"nonorm": 2e-7, "syncbn": 1e-5, "bn": 1e-5}

_spec = importlib.util.spec_from_file_location("distributed_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # Two ranks share the two cores: one kernel thread each.
    env["MLX_LATTICE_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return env


def _run_ranks(tmp_path: Path, mode: str, *extra: str, timeout_s: float = 50):
    outs = [tmp_path / f"{mode}_rank{r}.npz" for r in range(2)]
    # Each rank writes to its own file: the worker appends its rank below.
    script = (
        "import os, sys; sys.argv = sys.argv[:3] + "
        "[sys.argv[3].replace('RANK', os.environ['MLX_RANK'])] + sys.argv[4:]; "
        f"import runpy; runpy.run_path({str(WORKER)!r}, run_name='__main__')"
    )
    run = distributed.spawn_local(
        ["-c", script, mode, str(STEPS), str(tmp_path / f"{mode}_rankRANK.npz"), *extra],
        2,
        timeout_s=timeout_s,
        env=_env(),
    )
    return run, outs


def _report(run) -> str:
    return "\n".join(
        f"--- rank {r} rc={rc}\n{out}\n{err[-3000:]}"
        for r, (rc, out, err) in enumerate(
            zip(run.returncodes, run.stdout, run.stderr, strict=True)
        )
    )


def _max_abs(a: dict, b: dict, keys) -> float:
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in keys)


@pytest.mark.parametrize("mode", ["nonorm", "syncbn"])
def test_two_ranks_equal_whole_batch(tmp_path: Path, mode: str) -> None:
    run, outs = _run_ranks(tmp_path, mode)
    assert run.ok, _report(run)
    ranks = [dict(np.load(o)) for o in outs]
    meta = {k: ranks[0].pop(k) for k in list(ranks[0]) if k.startswith("__")}
    for k in [k for k in ranks[1] if k.startswith("__")]:
        ranks[1].pop(k)
    # Both ranks took identical steps.
    for k in ranks[0]:
        np.testing.assert_array_equal(ranks[0][k], ranks[1][k], err_msg=k)
    # Few large messages: one per dtype here (all float32), not one per parameter.
    assert int(meta["__leaves"]) >= 10
    assert int(meta["__messages"]) == 1, meta
    grads_bytes = sum(v.nbytes for k, v in ranks[0].items() if "running" not in k)
    assert int(meta["__message_bytes"]) == grads_bytes
    # Same averages as MLX's own mlx.nn.average_gradients.
    assert float(meta["__mlx_average_max_diff"]) == 0.0

    ref = worker.reference(mode, STEPS, parts=1)
    assert set(ref) == set(ranks[0])
    worst = _max_abs(ranks[0], ref, ref)
    for k in ref:
        np.testing.assert_allclose(
            ranks[0][k], ref[k], rtol=RTOL, atol=ATOL[mode], err_msg=f"{k} (worst abs {worst:.2e})"
        )
    # Training moved the parameters well beyond the tolerance.
    init = worker.state(worker.make_model("bn" if mode == "syncbn" else mode))
    assert max(float(np.max(np.abs(ref[k] - init[k]))) for k in ref) > 1e-2


def test_per_rank_batch_norm_is_not_whole_batch(tmp_path: Path) -> None:
    """Without SyncBatchNorm each rank normalises with its own statistics:
    the result equals the single process averaging two half-batch losses,
    and differs from whole-batch training by far more than the tolerance."""
    run, outs = _run_ranks(tmp_path, "bn")
    assert run.ok, _report(run)
    got = {k: v for k, v in np.load(outs[0]).items() if not k.startswith("__")}
    params = [k for k in got if "running" not in k]
    halves = worker.reference("bn", STEPS, parts=2)
    for k in params:
        np.testing.assert_allclose(got[k], halves[k], rtol=RTOL, atol=ATOL["bn"], err_msg=k)
    whole = worker.reference("bn", STEPS, parts=1)
    assert _max_abs(got, whole, params) > 20 * ATOL["bn"]


def test_peer_exit_stops_survivor_with_clear_error(tmp_path: Path) -> None:
    run, _ = _run_ranks(tmp_path, "nonorm", "1", timeout_s=50)
    assert not run.timed_out, _report(run)
    assert run.returncodes[1] == 3, _report(run)
    # The survivor stopped by itself (not killed by the launcher) with our error.
    assert run.returncodes[0] in (1, distributed.EXIT_TIMEOUT), _report(run)
    assert "DistributedError" in run.stderr[0] or "did not finish" in run.stderr[0], _report(run)
    assert "training step 1" in run.stderr[0], _report(run)
    assert "its peer, rank 1," in run.stderr[0], _report(run)
    assert run.seconds < 40


# A rank failing in the middle of a step: the survivor's step (under a 30 s
# deadline in the worker) ends with an error naming the failed rank. Bound
# on the whole run: 60 s (start-up and two steps take ~5-15 s here, the
# deadline 30 s at worst, the launcher's grace after a failure 10 s).
FAULT_BOUND_S = 60


@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_rank_failing_mid_step_stops_survivor_and_checkpoint_loads_exactly(
    tmp_path: Path, fault: str
) -> None:
    """Rank 1 is SIGKILLed (or raises) after its backward pass of step 2,
    before the gradient all-reduce; rank 0 must stop by itself with a
    DistributedError (or the deadline's message) naming rank 1 and the step,
    and the checkpoint rank 0 wrote after step 1 must load bit for bit."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    run, _ = _run_ranks(tmp_path, "nonorm", "2", fault, str(ckpt), timeout_s=2 * FAULT_BOUND_S)
    last = run.stderr[0].strip().splitlines()[-1:] or [""]
    print(f"{fault}: ended after {run.seconds:.1f} s, codes {run.returncodes}; rank 0: {last[0]}")
    assert not run.timed_out, _report(run)
    if fault == "kill":
        assert run.returncodes[1] == -signal.SIGKILL, _report(run)
    else:
        assert run.returncodes[1] == 1, _report(run)
        assert "a fault on purpose in step 2" in run.stderr[1], _report(run)
    assert run.returncodes[0] in (1, distributed.EXIT_TIMEOUT), _report(run)
    survivor = run.stderr[0]
    assert "DistributedError" in survivor or "did not finish" in survivor, _report(run)
    assert "training step 2" in survivor, _report(run)
    assert "its peer, rank 1," in survivor, _report(run)
    assert run.seconds < FAULT_BOUND_S, _report(run)

    # Steps 0 and 1 were checkpointed, step 2 never completed.
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "step0.npz",
        "step0.safetensors",
        "step1.npz",
        "step1.safetensors",
    ]
    dumped = dict(np.load(ckpt / "step1.npz"))
    model = worker.make_model("nonorm")
    init = worker.state(model)
    model.load_weights(str(ckpt / "step1.safetensors"))
    loaded = worker.state(model)
    assert set(loaded) == set(dumped)
    for k, v in dumped.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape, k
        assert loaded[k].tobytes() == v.tobytes(), k
    # It is the state after two steps: away from the initial one, and within
    # the data-parallel tolerance of the single process's two steps.
    assert max(float(np.max(np.abs(loaded[k] - init[k]))) for k in init) > 1e-3
    ref = worker.reference("nonorm", 2, parts=1)
    for k in ref:
        np.testing.assert_allclose(loaded[k], ref[k], rtol=RTOL, atol=ATOL["nonorm"], err_msg=k)


def test_hung_peer_ends_at_the_deadline() -> None:
    """Rank 1 stays alive but stops taking part (its sockets stay open, as
    with a stopped or deadlocked process): rank 0's collective would block
    forever; its deadline ends the process with a message and EXIT_TIMEOUT."""
    code = textwrap.dedent(
        """
        import time
        import mlx.core as mx
        from mlx_lattice import distributed
        group = distributed.init(backend="ring", timeout_s=20)
        if group.rank() == 1:
            time.sleep(6)
        else:
            with distributed.deadline(2, "the gradient all-reduce"):
                mx.eval(mx.distributed.all_sum(mx.ones(4)))
        """
    )
    run = distributed.spawn_local(["-c", code], 2, timeout_s=40, env=_env())
    assert not run.timed_out, _report(run)
    assert run.returncodes[0] == distributed.EXIT_TIMEOUT, _report(run)
    assert "rank 0: the gradient all-reduce (2 s) did not finish" in run.stderr[0], _report(run)
    assert "its peer, rank 1, has probably died or hung" in run.stderr[0], _report(run)


def test_port_taken_stops_every_rank(tmp_path: Path) -> None:
    """Rank 1's port is held by a socket that accepts but never speaks: rank 1
    cannot bind; rank 0 either sees the lost peer (an error) or is connected
    to the impostor and would wait forever in its first collective, which
    init's handshake deadline ends. Either way both stop, with a message."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(4)
    try:
        free = distributed._free_loopback_ports(1)[0]
        code = (
            "from mlx_lattice import distributed; "
            "distributed.init(backend='ring', timeout_s=5); print('joined')"
        )
        run = distributed.spawn_local(
            ["-c", code], 2, timeout_s=40, env=_env(), ports=[free, holder.getsockname()[1]]
        )
    finally:
        holder.close()
    assert not run.timed_out, _report(run)
    assert all(rc != 0 for rc in run.returncodes), _report(run)
    assert "joined" not in "".join(run.stdout)
    assert "bind" in run.stderr[1].lower(), _report(run)
    assert run.returncodes[0] in (1, distributed.EXIT_TIMEOUT), _report(run)
    assert "joining the process group" in run.stderr[0], _report(run)
    assert run.seconds < 30


def test_sync_batch_norm_gradient_single_process_matches_batch_norm() -> None:
    """With one process SyncBatchNorm is BatchNorm, forward and backward."""
    seed = 7
    x, _, _ = worker.scan_batch([0])
    feats = mx.array(np.random.default_rng(seed).normal(size=(x.num_points, 3)).astype(np.float32))
    x = x.replace(feats)
    plain = worker.nn.BatchNorm(3)
    sync = distributed.SyncBatchNorm(3)
    # A per-row cotangent: with one constant per channel the exact gradient is
    # zero and both sides would compare float32 cancellation noise.
    direction = mx.array(np.random.default_rng(seed + 1).normal(size=feats.shape).astype(np.float32))

    def f(m: mnn.Module, a: mx.array) -> mx.array:
        return (m(x.replace(a)).feats * direction).sum()

    # Mean as sum / n and variance from a second pass, where mx.mean / mx.var
    # round differently: float32 agreement, not bits.
    g_plain = mx.grad(lambda a: f(plain, a))(feats)
    g_sync = mx.grad(lambda a: f(sync, a))(feats)
    np.testing.assert_allclose(
        np.array(g_sync), np.array(g_plain), rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}"
    )
    mx.eval(plain(x), sync(x))
    np.testing.assert_allclose(np.array(sync.running_var), np.array(plain.running_var), rtol=1e-5)


def test_bad_arguments_raise_named_errors() -> None:
    with pytest.raises(distributed.DistributedUsageError, match="bucket_bytes"):
        distributed.average_gradients({"a": mx.ones(2)}, bucket_bytes=0)
    with pytest.raises(distributed.DistributedUsageError, match="grads leaf 'a'"):
        distributed.average_gradients({"a": 3.0})
    with pytest.raises(distributed.DistributedUsageError, match="remainder"):
        distributed.shard_indices(4, rank=0, size=2, remainder="wrap")
    with pytest.raises(distributed.DistributedUsageError, match="size"):
        distributed.shard_indices(4, rank=0, size=0)
    with pytest.raises(distributed.DistributedUsageError, match="SparseTensor"):
        distributed.SyncBatchNorm(2)(mx.ones((3, 2)))
    with pytest.raises(distributed.DistributedUsageError, match="model"):
        distributed.convert_sync_batchnorm("not a model")
    with pytest.raises(distributed.DistributedUsageError, match="n must"):
        distributed.spawn_local(["-c", "pass"], 0)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_shards_cover_dataset_evenly(size: int) -> None:
    for n in (0, 1, 7, 12):
        for seed in (None, 3):
            parts = [
                distributed.shard_indices(n, rank=r, size=size, seed=seed) for r in range(size)
            ]
            assert len({len(p) for p in parts}) == 1
            covered = np.concatenate(parts)
            assert set(covered.tolist()) == set(range(n))
            assert len(covered) == -(-n // size) * size if n else len(covered) == 0
            dropped = [
                distributed.shard_indices(n, rank=r, size=size, seed=seed, remainder="drop")
                for r in range(size)
            ]
            flat = np.concatenate(dropped)
            assert len(flat) == n - n % size and len(set(flat.tolist())) == len(flat)
    # Epochs reshuffle when seeded.
    a = distributed.shard_indices(100, rank=0, size=2, seed=1, epoch=0)
    b = distributed.shard_indices(100, rank=0, size=2, seed=1, epoch=1)
    assert not np.array_equal(a, b)
