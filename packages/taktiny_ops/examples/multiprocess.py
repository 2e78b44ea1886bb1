"""A quantized MLP from ``taktiny_ops`` ops on a mesh that spans processes.

Run once per process (``--process-id`` 0 and 1, same ``--port``), or alone
with ``--single N`` to run the same program on N devices of one process
(``--xla_force_host_platform_device_count``)::

    python multiprocess.py --process-id 0 --num-processes 2 --port 12345 &
    python multiprocess.py --process-id 1 --num-processes 2 --port 12345

Each process owns one CPU device; the mesh has one ``"model"`` axis over all
of them. ``fc1`` is split by output columns and ``fc2`` by input rows, so
the weights live half on each process and ``fc2`` sums partial products
across processes (JAX's CPU collectives, gloo). The forward pass uses PTQ
rules (int8 weights and activations, through ``quantrules``); the training
steps use QT rules (int8 fake-quantized weights and activations with
straight-through gradients) on a batch split across processes.
``jax.distributed.initialize`` binds only 127.0.0.1 here; with several hosts,
pass the coordinator's address instead.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

__all__ = ["main"]

IN, HIDDEN, OUT, BATCH = 64, 128, 16, 32
STEPS, LR = 3, 0.05


def _params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32),
        "b1": (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
        "w2": (rng.standard_normal((HIDDEN, OUT)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": (0.1 * rng.standard_normal(OUT)).astype(np.float32),
    }


def _data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((BATCH, IN)).astype(np.float32)
    y = rng.standard_normal((BATCH, OUT)).astype(np.float32)
    return x, y


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1")
    p.add_argument("--single", type=int, default=None, help="N devices in this one process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=30, help="seconds to wait for the peers")
    p.add_argument("--out", default=None, help="write results to this .npz (process 0 of each run)")
    p.add_argument("--die-before-train", action="store_true", help="(tests) exit after the forward")
    args = p.parse_args(argv)
    if args.single is None and args.num_processes > 1 and args.port is None:
        p.error("--port is required with --num-processes > 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.single is not None:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.single}"
        )
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import quantrules as qr
    import taktiny_ops as tk

    if args.single is None and args.num_processes > 1:
        _join(args, jax)
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("model",), axis_types=(AxisType.Auto,), devices=devices)
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
    shard = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    replicated = NamedSharding(mesh, P())
    batch_split = NamedSharding(mesh, P("model", None))

    def put(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
        # Every process holds the same seeded global array and hands over its shards.
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    host_params = _params(args.seed)
    params = {k: put(v, shard[k]) for k, v in host_params.items()}
    x_np, y_np = _data(args.seed)

    ptq = [qr.Rule(module_path="fc.*", weight_qtype="int8", act_qtype="int8")]
    qt = qr.QtProvider([qr.Rule(module_path="fc.*", weight_qtype="int8", act_qtype="int8")])

    def mlp(p: dict, x: jax.Array, quant: object) -> jax.Array:
        h = jax.nn.relu(tk.linear(x, p["w1"], p["b1"], quant=quant, module_path="fc1"))
        return tk.linear(h, p["w2"], p["b2"], quant=quant, module_path="fc2")

    forward = jax.jit(lambda p, x: mlp(p, x, ptq), out_shardings=replicated)
    float_forward = jax.jit(lambda p, x: mlp(p, x, None), out_shardings=replicated)

    def loss(p: dict, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((mlp(p, x, qt) - y) ** 2)

    @jax.jit
    def train_step(p: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
        value, grads = jax.value_and_grad(loss)(p, x, y)
        return jax.tree.map(lambda a, g: a - LR * g, p, grads), value

    gather = jax.jit(lambda t: t, out_shardings=replicated)

    def local(a: jax.Array) -> np.ndarray:
        return np.asarray(a.addressable_data(0))

    def run(params: dict) -> int:
        start = time.perf_counter()
        x = put(x_np, replicated)
        out = local(forward(params, x))
        out_float = local(float_forward(params, x))
        if args.die_before_train and args.process_id == args.num_processes - 1:
            print(f"process {args.process_id}: exiting on purpose", flush=True)
            os._exit(3)
        xb, yb = put(x_np, batch_split), put(y_np, batch_split)
        losses = []
        for _ in range(STEPS):
            params, value = train_step(params, xb, yb)
            losses.append(float(local(gather(value))))
        trained = {k: local(gather(v)) for k, v in params.items()}
        seconds = time.perf_counter() - start
        w1_shard = params["w1"].addressable_shards[0].data.shape
        print(
            f"process {jax.process_index()}/{jax.process_count()}: {len(devices)} devices on the mesh, "
            f"w1 shard {w1_shard} of {host_params['w1'].shape}; quantized forward max |y| "
            f"{np.abs(out).max():.4f}; QT losses {', '.join(f'{v:.5f}' for v in losses)}; "
            f"{seconds:.2f} s",
            flush=True,
        )
        if args.out and jax.process_index() == 0:
            np.savez(
                args.out,
                forward=out,
                forward_float=out_float,
                losses=np.array(losses),
                **{f"trained_{k}": v for k, v in trained.items()},
            )
        return 0

    try:
        return run(params)
    except jax.errors.JaxRuntimeError as err:
        _fail(args, f"a collective failed; a peer process has probably died: {err}", 1)
        return 1


def _join(args: argparse.Namespace, jax: object) -> None:
    """``jax.distributed.initialize`` with a clear, bounded failure.

    JAX's own failures here are a crash of the coordinator when its port is
    taken and an abort after ``initialization_timeout`` elsewhere; both are
    replaced by a message and exit status 2: the coordinator checks its port
    first, and a timer ends a wait that outlasts ``--timeout`` (JAX's own
    timeout is set later, so the timer fires first).
    """
    where = f"127.0.0.1:{args.port}"
    if args.process_id == 0:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", args.port))
            except OSError as err:
                _fail(args, f"cannot serve as coordinator: {where} is taken ({err}).", 2)
    timer = threading.Timer(
        args.timeout,
        _fail,
        (
            args,
            f"could not join the {args.num_processes} JAX processes at {where} within "
            f"{args.timeout} s (a peer is missing, or the port belongs to another program).",
            2,
        ),
    )
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            coordinator_address=where,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.timeout + 30,
            heartbeat_timeout_seconds=max(5, args.timeout // 2),
        )
    except Exception as err:  # JAX raises several types here; all end the run
        _fail(args, f"could not join the JAX processes at {where}: {err}", 2)
    finally:
        timer.cancel()


def _fail(args: argparse.Namespace, message: str, code: int) -> None:
    """Report and exit at once: a normal exit would first wait in JAX's
    shutdown barrier for the dead peer's heartbeat timeout."""
    sys.stdout.flush()
    print(f"multiprocess: process {args.process_id}: {message}", file=sys.stderr, flush=True)
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
