"""Data-parallel training over ``mx.distributed`` (MLX's own back-ends).

Every process (rank) holds a full copy of the model, trains on its own shard
of the data and, after each backward pass, the gradients are averaged over
all ranks with ``mx.distributed.all_sum`` so every copy takes the same step.
Nothing here opens sockets of its own: communication is MLX's ``ring`` (TCP,
any machine), ``mpi``, ``nccl`` or ``jaccl`` back-end, started by MLX's
launcher, e.g. ``mlx.launch --backend ring -n 2 train.py`` on one host.

* :func:`init`: join the group, with a handshake and a bounded wait;
* :func:`average_gradients`: ``all_sum / size`` over a gradient tree,
  flattened into few large messages (one per ``bucket_bytes`` and dtype);
* :func:`shard_indices`: this rank's part of a dataset;
* :class:`SyncBatchNorm` and :func:`convert_sync_batchnorm`: batch norm whose
  statistics are reduced over all ranks;
* :func:`deadline`: exit with a clear message instead of hanging when a peer
  dies, hangs or cannot be reached;
* :func:`spawn_local`: run ``n`` local ranks on the loopback interface (tests
  and benchmarks; ``mlx.launch`` is the launcher for real runs).

On one process (no launcher) the group has size 1 and everything here is a
no-op, so one script serves both.

>>> group = init()
>>> group.size()
1
>>> shard_indices(10, rank=1, size=4).tolist()
[1, 5, 9]
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as mlx_nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlx_lattice import nn as lattice_nn
from mlx_lattice._errors import MlxLatticeError
from mlx_lattice.tensor import SparseTensor

__all__ = [
    "EXIT_TIMEOUT",
    "DistributedError",
    "DistributedUsageError",
    "LocalRun",
    "SyncBatchNorm",
    "all_sum_differentiable",
    "average_gradients",
    "convert_sync_batchnorm",
    "deadline",
    "gradient_buckets",
    "init",
    "shard_indices",
    "spawn_local",
]

#: Exit status of a rank that :func:`deadline` stopped (as ``EX_TEMPFAIL``).
EXIT_TIMEOUT = 75

_DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024


class DistributedUsageError(MlxLatticeError):
    """A distributed helper got a bad argument."""


class DistributedError(RuntimeError):
    """Communication with the other ranks failed (a peer died or is unreachable)."""


# ---------------------------------------------------------------------------
# Bounded waits


class _Watchdog:
    """One daemon thread that ends the process when a deadline passes.

    A rank blocked in a collective (its peer hung, or the socket it connected
    to is not a peer) cannot be interrupted from Python; exiting is the only
    bounded way out, and the launcher then stops the other ranks.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: dict[int, tuple[float, str]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None

    def push(self, seconds: float, what: str) -> int:
        with self._cond:
            token = self._next
            self._next += 1
            self._active[token] = (time.monotonic() + seconds, what)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="mlx_lattice-deadline", daemon=True
                )
                self._thread.start()
            self._cond.notify()
            return token

    def pop(self, token: int) -> None:
        with self._cond:
            self._active.pop(token, None)
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._active:
                    self._cond.wait()
                    continue
                _token, (due, what) = min(self._active.items(), key=lambda kv: kv[1][0])
                left = due - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                _fatal(
                    f"{what} did not finish within its deadline; {_peers_label()} has probably "
                    "died or hung, or an address in the host file is not a peer (check the "
                    "hosts, ports and network). Exiting."
                )


_WATCHDOG = _Watchdog()


def _rank_label() -> str:
    rank = os.environ.get("MLX_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "?"
    return f"rank {rank}"


def _world() -> tuple[int, int] | None:
    """(rank, size) from the launcher's environment (MLX's ring host file or
    Open MPI's variables), without calling into MLX: the watchdog runs while
    the main thread may be inside ``mx.distributed.init``."""
    try:
        if "OMPI_COMM_WORLD_SIZE" in os.environ:
            return int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
        with open(os.environ["MLX_HOSTFILE"]) as f:
            return int(os.environ["MLX_RANK"]), len(json.load(f))
    except (KeyError, OSError, ValueError, TypeError):
        return None


def _peers_label() -> str:
    """The ranks this one talks to, for messages about a lost peer: with two
    ranks the other one is named (it is the one that failed); with more, the
    ring back-end cannot tell which one broke the chain."""
    world = _world()
    if world is None:
        return "a peer process"
    rank, size = world
    others = [r for r in range(size) if r != rank]
    if len(others) == 1:
        return f"its peer, rank {others[0]},"
    return f"one of ranks {others}" if others else "a peer process"


def _fatal(message: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"mlx_lattice.distributed: {_rank_label()}: {message}\n")
    sys.stderr.flush()
    os._exit(EXIT_TIMEOUT)


@contextlib.contextmanager
def deadline(seconds: float | None, what: str) -> Iterator[None]:
    """Bound a block that talks to other ranks (evaluate collectives inside it).

    If the block has not finished after ``seconds``, the process prints
    ``mlx_lattice.distributed: rank R: <what> did not finish ...`` to stderr
    and exits with :data:`EXIT_TIMEOUT` (a blocked collective cannot be
    interrupted). A peer that closed its connection makes MLX raise; that
    error is re-raised as :class:`DistributedError` naming ``what``.
    ``seconds=None`` only translates errors.

    >>> with deadline(5.0, "a quick step"):
    ...     mx.eval(mx.ones(3))
    >>> try:
    ...     with deadline(0, "x"):
    ...         pass
    ... except DistributedUsageError as err:
    ...     print(err)
    deadline: seconds must be a positive number or None, got 0.
    """
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0
    ):
        raise DistributedUsageError(
            f"deadline: seconds must be a positive number or None, got {seconds!r}."
        )
    token = None if seconds is None else _WATCHDOG.push(float(seconds), f"{what} ({seconds:g} s)")
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, DistributedError) or not _is_comm_error(err):
            raise
        raise DistributedError(
            f"{_rank_label()}: {what} failed: {err} ({_peers_label()} has probably exited)."
        ) from err
    finally:
        if token is not None:
            _WATCHDOG.pop(token)


def _is_comm_error(err: BaseException) -> bool:
    text = str(err)
    return any(tag in text for tag in ("[ring]", "[mpi]", "[nccl]", "[jaccl]", "distributed"))


# ---------------------------------------------------------------------------
# Group


def init(
    *,
    backend: str = "any",
    timeout_s: float | None = 60.0,
    strict: bool = False,
) -> mx.distributed.Group:
    """Join the process group that the launcher describes (``mx.distributed.init``).

    Without a launcher the group has size 1. With one, all ranks then sum a
    handshake vector (their count), so a rank that cannot reach its peers
    stops within ``timeout_s`` with a clear message instead of waiting
    forever (see :func:`deadline`). ``strict=True`` raises if no distributed
    back-end is configured.

    >>> init(backend="any").rank()
    0
    >>> try:
    ...     init(backend="carrier-pigeon")
    ... except DistributedUsageError as err:
    ...     print(err)
    init: backend must be one of ['any', 'jaccl', 'mpi', 'nccl', 'ring'], got 'carrier-pigeon'.
    """
    backends = ["any", "jaccl", "mpi", "nccl", "ring"]
    if backend not in backends:
        raise DistributedUsageError(f"init: backend must be one of {backends}, got {backend!r}.")
    with deadline(timeout_s, "joining the process group"):
        try:
            group = mx.distributed.init(strict=strict, backend=backend)
        except RuntimeError as err:
            raise DistributedError(
                f"{_rank_label()}: joining the process group failed: {err}"
            ) from err
        if group.size() > 1:
            ones = mx.distributed.all_sum(mx.ones((1,), dtype=mx.int32), group=group)
            if int(ones.item()) != group.size():
                raise DistributedError(
                    f"rank {group.rank()}: handshake counted {int(ones.item())} ranks, "
                    f"expected {group.size()}."
                )
    return group


def _group(group: mx.distributed.Group | None) -> mx.distributed.Group:
    return group if group is not None else mx.distributed.init()


# ---------------------------------------------------------------------------
# Gradients


def gradient_buckets(tree: Any, bucket_bytes: int = _DEFAULT_BUCKET_BYTES) -> list[list[str]]:
    """The messages :func:`average_gradients` sends: leaf paths grouped by
    dtype, in tree order, each group filled up to ``bucket_bytes`` (a single
    larger leaf is one message).

    >>> grads = {"a": mx.zeros((4,)), "b": {"c": mx.zeros((2, 2)), "d": mx.zeros((3,), mx.float16)}}
    >>> gradient_buckets(grads)
    [['a', 'b.c'], ['b.d']]
    >>> gradient_buckets(grads, bucket_bytes=16)
    [['a'], ['b.c'], ['b.d']]
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise DistributedUsageError(
            f"gradient_buckets: bucket_bytes must be a positive int, got {bucket_bytes!r}."
        )
    by_dtype: dict[mx.Dtype, list[list[str]]] = {}
    filled: dict[mx.Dtype, int] = {}
    for key, leaf in tree_flatten(tree):
        if not isinstance(leaf, mx.array):
            raise DistributedUsageError(
                f"average_gradients: grads leaf {key!r} must be an mx.array, got {type(leaf).__name__}."
            )
        buckets = by_dtype.setdefault(leaf.dtype, [])
        if not buckets or (
            filled[leaf.dtype] + leaf.nbytes > bucket_bytes and filled[leaf.dtype] > 0
        ):
            buckets.append([])
            filled[leaf.dtype] = 0
        buckets[-1].append(key)
        filled[leaf.dtype] += leaf.nbytes
    return [bucket for buckets in by_dtype.values() for bucket in buckets]


def average_gradients(
    grads: Any,
    *,
    group: mx.distributed.Group | None = None,
    bucket_bytes: int = _DEFAULT_BUCKET_BYTES,
) -> Any:
    """Average a gradient tree over the ranks of ``group``: ``all_sum / size``.

    Leaves are flattened and concatenated into the messages of
    :func:`gradient_buckets` (few large messages, not one per parameter),
    reduced, and split back into the tree's structure. The result is lazy;
    evaluate it inside a :func:`deadline` to bound a wait on a dead peer.
    Every rank must pass a tree of the same structure, shapes and dtypes.

    >>> g = {"w": mx.array([1.0, 2.0]), "b": mx.array([3.0])}
    >>> average_gradients(g)["w"].tolist()  # one process: unchanged
    [1.0, 2.0]
    """
    group = _group(group)
    buckets = gradient_buckets(grads, bucket_bytes)
    n = group.size()
    if n == 1:
        return grads
    flat = dict(tree_flatten(grads))
    out: dict[str, mx.array] = {}
    for keys in buckets:
        leaves = [flat[k] for k in keys]
        message = mx.concatenate([leaf.reshape(-1) for leaf in leaves])
        reduced = mx.distributed.all_sum(message, group=group) / n
        offsets = np.cumsum([leaf.size for leaf in leaves])[:-1].tolist()
        for key, leaf, part in zip(keys, leaves, mx.split(reduced, offsets), strict=True):
            out[key] = part.reshape(leaf.shape).astype(leaf.dtype)
    return tree_unflatten([(k, out[k]) for k, _ in tree_flatten(grads)])


# ---------------------------------------------------------------------------
# Data


def shard_indices(
    n: int,
    *,
    rank: int | None = None,
    size: int | None = None,
    seed: int | None = None,
    epoch: int = 0,
    remainder: Literal["pad", "drop"] = "pad",
) -> np.ndarray:
    """This rank's indices into a dataset of ``n`` items (e.g. scans).

    Rank ``r`` of ``size`` takes every ``size``-th index starting at ``r``
    (of a permutation of ``range(n)`` seeded by ``seed + epoch`` when ``seed``
    is given). Every rank gets the same count, so all ranks run the same
    number of steps: ``remainder="pad"`` repeats the first indices to fill the
    last round, ``"drop"`` leaves the last ``n % size`` out. Defaults:
    ``rank``/``size`` of the global group.

    >>> shard_indices(5, rank=0, size=2).tolist(), shard_indices(5, rank=1, size=2).tolist()
    ([0, 2, 4], [1, 3, 0])
    >>> shard_indices(5, rank=1, size=2, remainder="drop").tolist()
    [1, 3]
    >>> try:
    ...     shard_indices(4, rank=2, size=2)
    ... except DistributedUsageError as err:
    ...     print(err)
    shard_indices: rank must be in [0, 2), got 2.
    """
    for name, value in (("n", n), ("epoch", epoch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise DistributedUsageError(
                f"shard_indices: {name} must be an int >= 0, got {value!r}."
            )
    if rank is None or size is None:
        group = mx.distributed.init()
        rank = group.rank() if rank is None else rank
        size = group.size() if size is None else size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise DistributedUsageError(f"shard_indices: size must be an int >= 1, got {size!r}.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise DistributedUsageError(f"shard_indices: rank must be in [0, {size}), got {rank!r}.")
    if remainder not in ("pad", "drop"):
        raise DistributedUsageError(
            f"shard_indices: remainder must be 'pad' or 'drop', got {remainder!r}."
        )
    order = np.arange(n) if seed is None else np.random.default_rng([seed, epoch]).permutation(n)
    if remainder == "drop":
        order = order[: n - n % size]
    elif n % size and n:
        order = np.concatenate([order, np.resize(order, size - n % size)])
    return order[rank::size].astype(np.int64)


# ---------------------------------------------------------------------------
# Synchronised batch norm


@mx.custom_function
def _all_sum(x: mx.array) -> mx.array:
    return mx.distributed.all_sum(x)


@_all_sum.vjp
def _all_sum_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> mx.array:
    return mx.distributed.all_sum(cotangent)


def all_sum_differentiable(x: mx.array) -> mx.array:
    """``mx.distributed.all_sum`` over the global group whose gradient is the
    all-sum of the cotangents (each rank's loss depends on every rank's
    input). MLX's own ``all_sum`` passes the cotangent through unchanged,
    which is right only when the result feeds one rank's loss.

    >>> mx.grad(lambda x: (all_sum_differentiable(x) * 3).sum())(mx.ones(2)).tolist()
    [3.0, 3.0]
    """
    return _all_sum(x)


class SyncBatchNorm(lattice_nn.BatchNorm):
    """Batch norm over the features of a sparse tensor whose training
    statistics cover the whole global batch: per-channel sums, then sums of
    squared deviations, are all-summed over the ranks (two small messages per
    layer and pass), and the backward pass reduces their gradients too. With
    one process it equals :class:`mlx_lattice.nn.BatchNorm`; in ``eval()`` it
    uses the running statistics and does not communicate.

    >>> import numpy as np
    >>> x = SparseTensor(mx.array(np.array([[0, i, 0, 0] for i in range(4)], np.int32)),
    ...                  mx.array([[1.0], [2.0], [3.0], [4.0]]))
    >>> [round(v, 4) for v in SyncBatchNorm(1)(x).feats.reshape(-1).tolist()]
    [-1.3416, -0.4472, 0.4472, 1.3416]
    """

    def __call__(self, x: SparseTensor) -> SparseTensor:  # type: ignore[override]
        if not isinstance(x, SparseTensor):
            raise DistributedUsageError(
                f"SyncBatchNorm: x must be a SparseTensor, got {type(x).__name__}."
            )
        if not self.training:
            return super().__call__(x)
        feats = x.feats
        local = feats.sum(axis=0)
        count = mx.array([feats.shape[0]], dtype=feats.dtype)
        totals = all_sum_differentiable(mx.concatenate([local, count]))
        n = mx.stop_gradient(totals[-1])
        mean = totals[:-1] / n
        squares = all_sum_differentiable(mx.square(feats - mean).sum(axis=0))
        var = squares / n
        if self.track_running_stats:
            mu = self.momentum
            unbiased = mx.stop_gradient(squares / mx.maximum(n - 1, 1))
            self.running_mean = (1 - mu) * self.running_mean + mu * mx.stop_gradient(mean)
            self.running_var = (1 - mu) * self.running_var + mu * unbiased
        y = (feats - mean) * mx.rsqrt(var + self.eps)
        if "weight" in self:
            y = self.weight * y + self.bias
        return x.replace(y)

    def relu(self, x: SparseTensor) -> SparseTensor:
        """``relu(self(x))``, for models that fuse the two (``MinkUNet``)."""
        y = self(x)
        return y.replace(mx.maximum(y.feats, 0))


def convert_sync_batchnorm(model: mlx_nn.Module) -> mlx_nn.Module:
    """Replace every :class:`mlx_lattice.nn.BatchNorm` (subclasses such as
    :class:`mlx_lattice.models.FloatBatchNorm` included) in ``model`` (in place)
    by a :class:`SyncBatchNorm` with the same parameters, running statistics
    and mode; returns ``model``.

    >>> m = mlx_nn.Sequential(lattice_nn.BatchNorm(3))
    >>> type(convert_sync_batchnorm(m).layers[0]).__name__
    'SyncBatchNorm'
    """
    if not isinstance(model, mlx_nn.Module):
        raise DistributedUsageError(
            f"convert_sync_batchnorm: model must be an mlx.nn.Module, got {type(model).__name__}."
        )

    def convert(module: mlx_nn.Module) -> mlx_nn.Module:
        if not isinstance(module, lattice_nn.BatchNorm) or isinstance(module, SyncBatchNorm):
            return module
        sync = SyncBatchNorm(
            int(module.running_mean.shape[0])
            if "running_mean" in module
            else int(module.weight.shape[0]),
            eps=module.eps,
            momentum=module.momentum,
            affine="weight" in module,
            track_running_stats="running_mean" in module,
        )
        sync.update(module.parameters())
        for name in ("running_mean", "running_var"):
            if name in module:
                setattr(sync, name, module[name])
        sync.train(module.training)
        return sync

    def walk(module: mlx_nn.Module) -> None:
        for name in list(module.children()):
            child = module[name]  # children() copies lists and dicts
            # Modules are dicts too: test for them first.
            if isinstance(child, mlx_nn.Module):
                new = convert(child)
                if new is not child:
                    setattr(module, name, new)
                walk(new)
            elif isinstance(child, list):
                for i, item in enumerate(child):
                    if isinstance(item, mlx_nn.Module):
                        child[i] = convert(item)
                        walk(child[i])
            elif isinstance(child, dict):
                for key, item in child.items():
                    if isinstance(item, mlx_nn.Module):
                        child[key] = convert(item)
                        walk(child[key])

    walk(model)
    return model


# ---------------------------------------------------------------------------
# Local launcher (tests, benchmarks)


def _free_loopback_ports(n: int) -> list[int]:
    """Ports the kernel hands out as free right now (held open together so
    they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class LocalRun:
    """Outcome of :func:`spawn_local`: per-rank exit status and output, the
    wall time, and whether the timeout stopped it."""

    returncodes: tuple[int, ...]
    stdout: tuple[str, ...]
    stderr: tuple[str, ...]
    seconds: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)


def spawn_local(
    argv: Sequence[str],
    n: int,
    *,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    ports: Sequence[int] | None = None,
    python: str | None = None,
) -> LocalRun:
    """Run ``python argv...`` as ``n`` ranks of MLX's ``ring`` back-end on
    127.0.0.1, as ``mlx.launch --backend ring -n N`` does (a JSON host file
    in ``MLX_HOSTFILE``, ``MLX_RANK`` per process), with free ports (or
    ``ports``), and wait at most ``timeout_s``. When one rank fails, the others
    get 10 s to finish before they are killed; on timeout all are killed. No
    child outlives this call.

    >>> run = spawn_local(["-c", "import os; print(os.environ['MLX_RANK'])"], 2, timeout_s=30)
    >>> run.ok, run.stdout
    (True, ('0\\n', '1\\n'))
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DistributedUsageError(f"spawn_local: n must be an int >= 1, got {n!r}.")
    if not timeout_s > 0:
        raise DistributedUsageError(f"spawn_local: timeout_s must be > 0, got {timeout_s!r}.")
    ports = list(ports) if ports is not None else _free_loopback_ports(n)
    if len(ports) != n:
        raise DistributedUsageError(f"spawn_local: ports must hold {n} ports, got {len(ports)}.")
    with tempfile.TemporaryDirectory(prefix="mlx_lattice_ring_") as tmp:
        hostfile = os.path.join(tmp, "hosts.json")
        with open(hostfile, "w") as f:
            json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
        procs: list[subprocess.Popen] = []
        outs = [os.path.join(tmp, f"out{r}") for r in range(n)]
        errs = [os.path.join(tmp, f"err{r}") for r in range(n)]
        start = time.monotonic()
        timed_out = False
        try:
            for r in range(n):
                child_env = dict(os.environ if env is None else env)
                child_env.pop("MLX_HOSTFILE", None)
                child_env.update(MLX_RANK=str(r))
                if n > 1:  # one rank alone: no host file, as mlx.launch does
                    child_env["MLX_HOSTFILE"] = hostfile
                with open(outs[r], "w") as out, open(errs[r], "w") as err:
                    procs.append(
                        subprocess.Popen(
                            [python or sys.executable, *argv],
                            env=child_env,
                            stdin=subprocess.DEVNULL,
                            stdout=out,
                            stderr=err,
                            start_new_session=True,
                        )
                    )
            failed_at = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if now - start > timeout_s:
                    timed_out = True
                    break
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                if failed_at is not None and now - failed_at > 10:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        seconds = time.monotonic() - start

        def read(path: str) -> str:
            with open(path, errors="replace") as f:
                return f.read()

        return LocalRun(
            returncodes=tuple(int(p.returncode) for p in procs),
            stdout=tuple(read(o) for o in outs),
            stderr=tuple(read(e) for e in errs),
            seconds=seconds,
            timed_out=timed_out,
        )
