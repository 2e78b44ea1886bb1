"""Benchmark: taktiny_ops against the equivalent hand-written Qwix call.

For each op (w8a8 int8 PTQ, and quant=None against plain JAX), in one run:
* whether the jitted programs lower to identical StableHLO;
* the jit time ratio ours / hand-written (expected 1.00 ± noise);
* eager calls, on small operands so that dispatch, not arithmetic,
  dominates: ours (one cached compiled call), the hand-written call op by
  op, and our overhead in µs over a compiled dispatch of the hand-written
  program (target < 20 µs).
"""

from __future__ import annotations

import platform
import re
import timeit

import jax
import jax.numpy as jnp
import numpy as np
import qwix

import quantrules as qr
import taktiny_ops as tk
from benchmarks.timing import best_us

W8A8 = qr.Rule(weight_qtype="int8", act_qtype="int8")
DN = (((1,), (0,)), ((), ()))


def _hand_dot(x, w):
    wq = qwix.quantize(w, jnp.int8, channelwise_axes=(1,))  # weight first, as Qwix's provider
    xq = qwix.quantize(x, jnp.int8, channelwise_axes=(0,))
    return qwix.dot_general(xq, wq, DN)


def _hand_einsum(x, w):
    wq = qwix.quantize(w, jnp.int8, channelwise_axes=(1,))  # weight first, as Qwix's provider
    xq = qwix.quantize(x, jnp.int8, channelwise_axes=(0,))
    return qwix.einsum("bi,io->bo", xq, wq)


def _hand_conv(a, k):
    kq = qwix.quantize(k, jnp.int8, channelwise_axes=(2,))
    aq = qwix.quantize(a, jnp.int8, channelwise_axes=(0,))
    return qwix.conv_general_dilated(
        aq,
        kq,
        (1,),
        "SAME",
        dimension_numbers=jax.lax.conv_dimension_numbers(a.shape, k.shape, ("NWC", "WIO", "NWC")),
    )


def _hlo(fn, *args) -> str:
    text = jax.jit(fn).lower(*args).as_text()
    text = re.sub(r"@jit_\w+", "@jit_f", text)
    return re.sub(r"loc\(.*?\)", "", text)


def _best_us(fn, *args) -> float:
    return best_us(lambda: jax.block_until_ready(fn(*args)), number=200)


def _dispatch_us(fn, *args, number=500, repeat=15) -> float:
    """Per-call cost of issuing ``number`` calls back to back (blocking once at
    the end), median over ``repeat`` rounds: the host-side cost of a call,
    without the jitter of waiting on every result."""
    jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(repeat):
        start = timeit.default_timer()
        for _ in range(number):
            out = fn(*args)
        jax.block_until_ready(out)
        rounds.append((timeit.default_timer() - start) / number * 1e6)
    return sorted(rounds)[len(rounds) // 2]


def _cases(rng, scale: int) -> list:
    x = jnp.asarray(rng.standard_normal((32 * scale, 64 * scale)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64 * scale, 64 * scale)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((scale, 16 * scale, 8 * scale)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, 8 * scale, 8 * scale)), jnp.float32)
    return [
        ("linear w8a8", lambda x, w: tk.linear(x, w, quant=W8A8), _hand_dot, (x, w)),
        ("dot_general w8a8", lambda x, w: tk.dot_general(x, w, DN, quant=W8A8), _hand_dot, (x, w)),
        (
            "einsum w8a8",
            lambda x, w: tk.einsum("bi,io->bo", x, w, quant=W8A8),
            _hand_einsum,
            (x, w),
        ),
        (
            "conv w8a8",
            lambda a, k: tk.conv_general_dilated(
                a, k, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"), quant=W8A8
            ),
            _hand_conv,
            (a, k),
        ),
        ("linear dense", lambda x, w: tk.linear(x, w), lambda x, w: x @ w, (x, w)),
        (
            "einsum dense",
            lambda x, w: tk.einsum("bi,io->bo", x, w),
            lambda x, w: jnp.einsum("bi,io->bo", x, w),
            (x, w),
        ),
    ]


def main() -> None:
    rng = np.random.default_rng(0)
    big, small = _cases(rng, 8), _cases(rng, 1)
    print(
        f"taktiny_ops vs hand-written Qwix/JAX on {platform.machine()}, "
        f"{jax.device_count()} {jax.default_backend()} device(s), jax {jax.__version__}"
    )
    print(
        f"{'op':18s} {'same HLO':>8s} {'jit ours µs':>12s} {'jit hand µs':>12s} {'ratio':>6s} "
        f"{'eager ours µs':>14s} {'hand op-by-op µs':>17s} {'overhead µs':>12s} {'noise µs':>9s}"
    )
    for (name, ours, hand, args), (_, _, _, small_args) in zip(big, small, strict=True):
        same = _hlo(ours, *args) == _hlo(hand, *args)
        j_ours, j_hand = _best_us(jax.jit(ours), *args), _best_us(jax.jit(hand), *args)
        # Eager: ours runs one cached compiled call; its overhead is measured
        # against dispatching the hand-written program compiled (the floor of
        # any compiled call), with the op-by-op hand-written call alongside.
        hand_jit = jax.jit(hand)
        e_ours = _dispatch_us(ours, *small_args)
        e_floor = _dispatch_us(hand_jit, *small_args)
        e_hand = _dispatch_us(hand, *small_args, number=50)
        noise = abs(_dispatch_us(hand_jit, *small_args) - e_floor)
        print(
            f"{name:18s} {'yes' if same else 'NO':>8s} {j_ours:12.1f} {j_hand:12.1f} "
            f"{j_ours / j_hand:6.2f} {e_ours:14.1f} {e_hand:17.1f} {e_ours - e_floor:12.1f} {noise:9.1f}"
        )
    print(
        "eager columns: per-call cost of back-to-back calls on small operands; overhead: eager "
        "ours minus a compiled call of the hand-written program (target < 20 µs)"
    )


if __name__ == "__main__":
    main()
