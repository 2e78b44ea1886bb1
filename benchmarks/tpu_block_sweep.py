"""Block-size sweep of the Pallas TPU matmul kernels of taktiny_ops, against bf16.

Run on a TPU host with taktiny_ops and quantrules on PYTHONPATH::

    PYTHONPATH=packages/quantrules:packages/taktiny_ops python3 benchmarks/tpu_block_sweep.py

For ``x[M, K] @ w[K, N]`` at K=4096/N=14336 and K=14336/N=4096, M in {16,
128, 1024, 8192}, it times bf16 ``x @ w`` (the yardstick), the weight-only
kernel on int8 (channelwise), int4 (K tiles of 128) and float8_e4m3fn
(channelwise) weights, and w8a8, each over a few block configurations (the
table's default first), and prints per line: microseconds per matmul, TFLOP/s
(TOP/s for w8a8), GB/s of weight bytes (values and scales) and the speed-up
over bf16, then the best configuration per row. Each kernel's result is
checked once per row against its plain-JAX reference on the first 128 rows,
both in float32 (max |error| / max |reference|). Past 110 s only the default
blocks are timed, to stay inside 150 s.

Timing: for M <= 128 a matmul takes tens of microseconds, less than a host
dispatch, so ``reps`` matmuls run inside one jitted ``lax.fori_loop`` whose
carry feeds each result back into the next ``x`` (nothing is loop invariant
but the weights, which are arguments, so nothing can be hoisted); larger M is
called back to back and waited for at the end. Each figure is the best of 3.

``--smoke`` runs tiny shapes in Pallas interpret mode (any host), to check the
script itself; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from taktiny_ops._pallas_blocks import plan, tpu_generation
from taktiny_ops._pallas_matmul import reference_weight_only_matmul, weight_only_matmul
from taktiny_ops._pallas_w8a8 import reference_w8a8_matmul, w8a8_matmul

BF16 = jnp.bfloat16
BUDGET_S = 110  # past this, only the default blocks are timed
# mode -> (qtype, K tile or None)
MODES = {"int8": ("int8", None), "int4": ("int4", 128), "fp8": ("float8_e4m3fn", None),
         "w8a8": ("int8", None)}


def weights(key: jax.Array, k: int, n: int, mode: str) -> tuple[jax.Array, jax.Array]:
    qtype, tile = MODES[mode]
    kq, ks = jax.random.split(key)
    if qtype == "float8_e4m3fn":
        q = jnp.clip(jax.random.normal(kq, (k, n), jnp.float32) * 100, -448, 448).astype(qtype)
    else:
        hi = 8 if qtype == "int4" else 128
        q = jax.random.randint(kq, (k, n), -hi, hi, jnp.int32).astype(qtype)
    groups = 1 if tile is None else k // tile
    scale = jax.random.uniform(ks, (groups, n), jnp.float32, 1e-3, 2e-3).astype(BF16)
    return q, scale


def configs(mode: str, m: int, n: int, k: int, smoke: bool) -> list[dict]:
    """The table's default first, then a few alternatives (bm, bn, bk)."""
    if smoke:
        return [{}, {"block_n": 128, "block_k": 128}]
    if m <= 128:
        alts = [(None, 2048, 2048), (None, 4096, 1024)]
        if mode == "w8a8":
            alts = [(None, 2048, 1024), (None, 4096, min(k, 8192))]
    else:
        alts = [(1024, 1024, 1024), (512, 2048, 2048)]
        if mode == "w8a8":  # x quantized once per row block: all of K, or all of N
            alts = [(512, 2048, 1024), (256, 2048, k) if k <= 8192 else (512, n, 1024)]
    return [{}] + [{"block_m": bm, "block_n": bn, "block_k": bk} for bm, bn, bk in alts]


def label(cfg: dict, mode: str, m: int, n: int, k: int) -> str:
    """The blocks the kernel really uses (the table's, legalized, for the default)."""
    tile = MODES[mode][1]
    p = plan("w8a8" if mode == "w8a8" else "weight_only", m, n, k,
             block_m=cfg.get("block_m"), block_n=cfg.get("block_n"),
             block_k=cfg.get("block_k"), m_step=32 if mode == "w8a8" else 16,
             k_step=tile or 128)
    return ("default " if not cfg else "") + f"{p.bm}x{p.bn}x{p.bk}"


def time_us(fn: Callable, args: tuple, m: int, reps: int) -> float:
    """Microseconds per matmul: a jitted loop for small M, back-to-back calls otherwise."""
    if m <= 128:
        def loop(x, *w):
            def body(_, carry):
                y = fn(carry, *w)
                # The result feeds the next x (one element, updated in place, so
                # the loop adds no pass over x): each iteration waits for the last.
                return carry.at[0, 0].add((y[0, 0] * 1e-30).astype(carry.dtype))
            return jax.lax.fori_loop(0, reps, body, x)
        run = jax.jit(loop)
        jax.block_until_ready(run(*args))
        best = np.inf
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(run(*args))
            best = min(best, time.perf_counter() - t0)
        return best / reps * 1e6
    run = jax.jit(fn)
    jax.block_until_ready(run(*args))
    best = np.inf
    for _ in range(3):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = run(*args)
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - t0)
    return best / reps * 1e6


def max_rel_err(fn: Callable, ref: Callable, x: jax.Array, q: jax.Array,
                s: jax.Array) -> float:
    rows = x[:128]
    y = np.asarray(jax.jit(lambda *a: fn(*a, out_dtype=jnp.float32))(rows, q, s))
    r = np.asarray(jax.jit(lambda *a: ref(*a, out_dtype=jnp.float32))(rows, q, s))
    return float(np.max(np.abs(y - r)) / max(np.max(np.abs(r)), 1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode")
    args = ap.parse_args()
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    print(f"{datetime.date.today()} jax {jax.__version__} backend {jax.default_backend()}"
          f" device {dev.device_kind!r} (generation {tpu_generation()})")
    if args.smoke:
        shapes, ms = [(256, 384), (384, 256)], [16, 160]
    else:
        shapes, ms = [(4096, 14336), (14336, 4096)], [16, 128, 1024, 8192]
    print(f"{'K':>5} {'N':>5} {'M':>4} {'mode':<5} {'blocks (m x n x k)':<22} {'us':>9}"
          f" {'T*/s':>7} {'wGB/s':>6} {'xbf16':>6} {'err':>8}")
    best: list[str] = []
    key = jax.random.key(0)
    for k, n in shapes:
        wb = jax.random.normal(key, (k, n), BF16)
        packed = {mode: weights(jax.random.fold_in(key, i), k, n, mode)
                  for i, mode in enumerate(MODES)}
        for m in ms:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), BF16)
            reps = 3 if args.smoke else (50 if m <= 128 else (20 if m <= 1024 else 5))
            flop = 2.0 * m * k * n
            t_bf16 = time_us(lambda x, w: x @ w, (x, wb), m, reps)
            print(f"{k:>5} {n:>5} {m:>4} {'bf16':<5} {'XLA':<22} {t_bf16:9.1f}"
                  f" {flop / t_bf16 / 1e6:7.1f} {2 * k * n / t_bf16 / 1e3:6.0f} {1.0:6.2f}")
            for mode, (q, s) in packed.items():
                op = w8a8_matmul if mode == "w8a8" else weight_only_matmul
                ref = reference_w8a8_matmul if mode == "w8a8" else reference_weight_only_matmul
                wbytes = q.size * jnp.dtype(q.dtype).itemsize * (0.5 if q.dtype == jnp.int4 else 1)
                wbytes += s.size * 2
                err = max_rel_err(op, ref, x, q, s)
                rows = []
                cfgs = configs(mode, m, n, k, args.smoke)
                if time.perf_counter() - t_start > BUDGET_S:
                    cfgs = cfgs[:1]  # keep the whole run inside its time budget
                for cfg in cfgs:
                    name = label(cfg, mode, m, n, k)
                    try:
                        t = time_us(lambda x, q, s, cfg=cfg, op=op: op(x, q, s, **cfg),
                                    (x, q, s), m, reps)
                    except Exception as e:  # a config that fails to compile (VMEM) is reported
                        print(f"{k:>5} {n:>5} {m:>4} {mode:<5} {name:<22} failed:"
                              f" {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                        continue
                    rows.append((t, name))
                    print(f"{k:>5} {n:>5} {m:>4} {mode:<5} {name:<22} {t:9.1f}"
                          f" {flop / t / 1e6:7.1f} {wbytes / t / 1e3:6.0f} {t_bf16 / t:6.2f}"
                          f" {err:8.1e}")
                if rows:
                    t, name = min(rows)
                    best.append(f"{k:>5} {n:>5} {m:>4} {mode:<5} {name:<22} {t:9.1f}"
                                f" {flop / t / 1e6:7.1f} {wbytes / t / 1e3:6.0f}"
                                f" {t_bf16 / t:6.2f} {err:8.1e}")
    print("\nbest per row:")
    print("\n".join(best))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
