"""Benchmark: ``x[M, K] @ w[K, N]`` with bf16 activations, quantized through
taktiny_ops and through Qwix's own API in one run, on the default JAX
backend (a TPU where there is one; any backend runs it).

Shapes K=4096/N=14336 and K=14336/N=4096, M in {16, 128, 1024, 8192}
(``--small``, the default on a CPU backend: K/N of 256/512 and 512/256,
M in {16, 1024}). Modes, each through every implementation that has it:

* ``bf16``: ``x @ w`` in bf16 (the yardstick);
* ``int8``, ``int4`` (tiles of 128 along K), ``fp8`` (e4m3): weights stored
  quantized, per output channel (int4: per tile and channel), activations
  bf16;
* ``w8a8``: int8 weights and int8 activations (per token).

Implementations: ``ours`` (an NNX model quantized by ``taktiny_ops.quantize``:
a ``QuantizedLinear`` holding its kernel quantized), ``ours pallas``
(``taktiny_ops.quantize(model, rules, kernels='pallas')``), ``qwix``
(``qwix.quantize_model`` with a ``qwix.PtqProvider`` on the same
``nnx.Linear``), and the stateless op ``taktiny_ops.linear`` given float
weights (``stateless float w``: quantized on every call) or weights
quantized once (``stateless w once``: ``taktiny_ops.quantize_weight``).
A mode the checkout lacks prints ``n/a (reason)``.

Timing: M <= 128 runs inside one jitted ``lax.fori_loop`` whose trip count
is an argument; each iteration reads its weights and activations through
``lax.optimization_barrier`` together with the loop-carried activations
(so XLA cannot hoist the weight's dequantization out of the loop) and feeds
a reduction of its output back into them. The time per iteration is the
difference of the median times of n and 1 iterations over n - 1 (the
dispatch cost cancels). M >= 1024: calls back to back, one
``block_until_ready`` at the end, median over repeats. Rates: TFLOP/s
(TOP/s for w8a8) = 2·M·K·N / time; GB/s = bytes of the weights as held
(values and scales) / time; ``x bf16`` = bf16's time / this time.

Error: ``rel.err`` = ||y - ref|| / ||ref||, ref the float32 product at
``Precision.HIGHEST`` of the same bf16 activations and weights. ``bound`` is
1.25 × sqrt(q² + r²). q² = E||y_quant - ref||² / ||ref||² is the rounding
model of absmax quantization: each quantized value is off by an error of
at most half its step s, spread uniformly and independently for data like
these (variance s²/12; the value divided by its scale is rounded to bf16
first, which makes ties of the values within half a bf16 spacing g of a
half and adds g²/4, see ``_int_variance``; fp8's step is its own spacing
at the value), so E[e_mn²] = Σ_k x_mk² Var(w_kn) + Var(x_mk) w_kn². r = 2^-7
leaves room for up to 12 roundings to bf16 (relative rms ≤ 2^-7/√12 each)
of the output, partial sums or dequantized weights. The factor 1.25 covers
the sampling spread of a sum over M·N ≥ 8k errors (a few %) and
implementations that round less (a float32 division by the scale).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (python3 benchmarks/tpu_matmul.py)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import qwix
from absl import flags
from flax import nnx

import quantrules as qr
import taktiny_ops as tk
from benchmarks.jax_host import host_lines, is_v5e
from benchmarks.timing import median_s
from examples import cli

FULL_SHAPES = ((4096, 14336), (14336, 4096))
FULL_MS = (16, 128, 1024, 8192)
SMALL_SHAPES = ((256, 512), (512, 256))
SMALL_MS = (16, 1024)
LOOP_MAX_M = 128  # M <= this: timed inside one jitted loop
INT4_TILE = 128
# The rounding allowance r and the model's factor (see the module docstring).
ROUNDING = 2.0**-7
BOUND_FACTOR = 1.25
# TPU v5e limits (per chip): bf16 TFLOP/s, int8 TOP/s, HBM GB/s.
V5E = {"bf16 TFLOP/s": 197.0, "int8 TOP/s": 394.0, "HBM GB/s": 819.0}

MODES = ("bf16", "int8", "int4", "fp8", "w8a8")
IMPLS = ("ours", "ours pallas", "stateless float w", "stateless w once", "qwix")


def impls_for(mode: str) -> tuple[str, ...]:
    """bf16 is one row (the yardstick, ``jnp.dot``); the stateless op is timed for int8 and w8a8."""
    if mode == "bf16":
        return ("jax",)
    if mode in ("int8", "w8a8"):
        return IMPLS
    return tuple(i for i in IMPLS if not i.startswith("stateless"))


_SMALL = flags.DEFINE_boolean(
    "small", None, "small sizes (default: on when the backend is a CPU; --nosmall forces full)")
_JSON = flags.DEFINE_string("json", None, "write every row as JSON to this path")
_MODES = flags.DEFINE_list("modes", list(MODES), f"modes to run, of {','.join(MODES)}")
_SHAPES = flags.DEFINE_list(
    "shapes", None, "KxN shapes, e.g. 4096x14336 (default: the full or small pair)")
_MS = flags.DEFINE_list("ms", None, "values of M (default: 16,128,1024,8192, or 16,1024 small)")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the random activations and weights")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed repeats per row (median)", lower_bound=1)
_TARGET = flags.DEFINE_float(
    "target-ms", 20.0, "about how long one timed repeat runs (loop or calls)", lower_bound=0.1)


class Unavailable(Exception):
    """A mode this checkout (or this backend) cannot run; the row prints n/a."""


@dataclasses.dataclass
class Row:
    """One timed case: shape, M, mode and implementation, and what it measured."""

    k: int
    n: int
    m: int
    mode: str
    impl: str
    us: float | None = None
    rate: float | None = None  # TFLOP/s (TOP/s for w8a8)
    unit: str = "TFLOP/s"
    weight_bytes: int | None = None
    gbs: float | None = None
    x_bf16: float | None = None
    rel_err: float | None = None
    q_model: float | None = None  # the model's q (rounding-free relative error)
    bound: float | None = None
    timed: str = ""
    kernel: str = ""
    na: str | None = None


# ---------------------------------------------------------------------------
# The cases: (weights as held, step(weights, x) -> y, bytes, kernel note).


def _rule(mode: str) -> qr.Rule:
    return {
        "int8": qr.Rule(weight_qtype="int8"),
        "int4": qr.Rule(weight_qtype="int4", tile_size=INT4_TILE),
        "fp8": qr.Rule(weight_qtype="float8_e4m3fn"),
        "w8a8": qr.Rule(weight_qtype="int8", act_qtype="int8"),
    }[mode]


def _qwix_rule(mode: str) -> Any:
    return {
        "int8": qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8),
        "int4": qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int4,
                                      tile_size=INT4_TILE),
        "fp8": qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.float8_e4m3fn),
        "w8a8": qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8,
                                      act_qtype=jnp.int8),
    }[mode]


class _Net(nnx.Module):
    """One bf16 ``nnx.Linear`` without bias, at path ``fc``."""

    def __init__(self, w: jax.Array) -> None:
        k, n = w.shape
        self.fc = nnx.Linear(k, n, use_bias=False, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        self.fc.kernel.set_value(w)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc(x)


def _leaf_bytes(tree: Any) -> int:
    """Bytes as held: each array's elements at their bit width."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        dt = jnp.dtype(leaf.dtype)
        bits = jnp.iinfo(dt).bits if jnp.issubdtype(dt, jnp.integer) else jnp.finfo(dt).bits
        total += (leaf.size * bits + 7) // 8
    return total


def _model_case(model: nnx.Module) -> tuple[Any, Callable, int]:
    graphdef, state = nnx.split(model)
    return state, lambda s, x: nnx.merge(graphdef, s)(x), _leaf_bytes(state)


def _pallas_kernels_supported() -> str | None:
    """None if ``taktiny_ops.quantize`` takes ``kernels=``, else the reason it cannot run."""
    if "kernels" not in inspect.signature(tk.quantize).parameters:
        return "taktiny_ops.quantize has no kernels= option in this checkout"
    return None


def _kernel_note(report: Any) -> str:
    layer = report.layers[0]
    return str(getattr(layer, "kernel", "") or "xla")


def build_case(mode: str, impl: str, w: jax.Array, x16: jax.Array) -> tuple[Any, Callable, int, str]:
    """(weights as held, step(weights, x), weight bytes, kernel note) of one mode and
    implementation; raises :class:`Unavailable` with the reason where it cannot run."""
    if mode == "bf16":
        return w, lambda w_, x: jnp.dot(x, w_), _leaf_bytes(w), "xla dot"
    rule = _rule(mode)
    if impl == "ours":
        model = _Net(w)
        report = tk.quantize(model, rule)
        return (*_model_case(model), _kernel_note(report))
    if impl == "ours pallas":
        reason = _pallas_kernels_supported()
        if reason:
            raise Unavailable(reason)
        model = _Net(w)
        try:
            report = tk.quantize(model, rule, kernels="pallas")
        except (tk.TaktinyOpsError, NotImplementedError) as err:
            raise Unavailable(f"kernels='pallas': {err}") from None
        return (*_model_case(model), _kernel_note(report))
    if impl == "qwix":
        model = qwix.quantize_model(_Net(w), qwix.PtqProvider([_qwix_rule(mode)]), x16)
        return (*_model_case(model), "qwix")
    if impl == "stateless float w":
        return w, lambda w_, x: tk.linear(x, w_, quant=rule), _leaf_bytes(w), "xla"
    if impl == "stateless w once":
        quantize_weight = getattr(tk, "quantize_weight", None)
        if quantize_weight is None:
            raise Unavailable("taktiny_ops.quantize_weight is not in this checkout")
        try:
            wq = quantize_weight(w, rule)
            tk.linear(x16, wq, quant=rule)
        except (TypeError, tk.TaktinyOpsError, NotImplementedError) as err:
            raise Unavailable(f"taktiny_ops.quantize_weight: {err}") from None
        return wq, lambda w_, x: tk.linear(x, w_, quant=rule), _leaf_bytes(wq), "xla"
    raise ValueError(impl)


# ---------------------------------------------------------------------------
# Timing.


def _loop_program(step: Callable) -> Callable:
    """``(weights, x, n) -> (x, y)``: n dependent steps in one jitted loop."""

    def run(weights: Any, x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
        y0 = jax.eval_shape(step, weights, x)

        def body(_: Any, carry: tuple) -> tuple:
            xc, _y = carry
            # The weights pass the barrier with the loop-carried x: for XLA
            # they vary per iteration, so their dequantization stays in the loop.
            xb, wb = jax.lax.optimization_barrier((xc, weights))
            y = step(wb, xb)
            s = jnp.sum(y, axis=-1, keepdims=True, dtype=jnp.float32)  # reads all of y
            return xc + (s * 1e-30).astype(xc.dtype), y

        return jax.lax.fori_loop(0, n, body, (x, jnp.zeros(y0.shape, y0.dtype)))

    return jax.jit(run)


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    return median_s(lambda: jax.block_until_ready(fn()), repeats, warmup=0)


def time_case(step: Callable, weights: Any, x: jax.Array, repeats: int,
              target_s: float) -> tuple[float, jax.Array, str]:
    """(seconds per product, the output for ``x``, how it was timed)."""
    m = x.shape[0]
    if m <= LOOP_MAX_M:
        loop = _loop_program(step)
        _, y = jax.block_until_ready(loop(weights, x, 1))  # compiles; y = step(weights, x)
        probe = 8
        est = _median_s(lambda: loop(weights, x, probe), 1) / probe
        n = int(min(max(target_s / max(est, 1e-7), 16), 20000))
        one = []
        many = []
        for _ in range(repeats):  # interleaved, so a drift moves both
            one.append(_median_s(lambda: loop(weights, x, 1), 1))
            many.append(_median_s(lambda: loop(weights, x, n), 1))
        per = (statistics.median(many) - statistics.median(one)) / (n - 1)
        if per <= 0:  # noise larger than the loop (a loaded host): t(n) / n instead
            return statistics.median(many) / n, y, f"loop n={n}, t(n)/n"
        return per, y, f"loop n={n}"
    call = jax.jit(step)
    y = jax.block_until_ready(call(weights, x))  # compiles
    est = _median_s(lambda: call(weights, x), 1)
    calls = int(min(max(target_s / max(est, 1e-7), 2), 1000))

    def burst() -> Any:
        out = None
        for _ in range(calls):
            out = call(weights, x)
        return out

    return _median_s(burst, repeats) / calls, y, f"calls n={calls}"


# ---------------------------------------------------------------------------
# Error against the float32 reference, and the rounding model's q.


def _int_variance(v: jax.Array, step: jax.Array) -> jax.Array:
    """Var of rounding ``v`` (the value over its scale, |v| <= qmax + 0.5) to an
    integer, in units of ``step``², when ``v`` was first rounded to bf16: 1/12,
    plus g²/4 where g is bf16's spacing at |v| (values within g/2 of a half
    become a tie, which goes to the even neighbour: for g = 1/2, at |v| >= 64,
    the variance is 1/12 + 1/16)."""
    g = 2.0 ** (jnp.floor(jnp.log2(jnp.maximum(jnp.abs(v), 2.0**-100))) - 7)
    return step**2 * (1 / 12 + g**2 / 4)


def _weight_variance(mode: str, w: jax.Array) -> jax.Array:
    """Var of each weight's quantization error (see the module docstring)."""
    w = w.astype(jnp.float32)
    if mode == "bf16":
        return jnp.zeros_like(w)
    absmax = jnp.max(jnp.abs(w), axis=0, keepdims=True)
    if mode in ("int8", "w8a8"):
        step = absmax / 127.5  # Qwix's symmetric bound: qmax + 0.5
        return _int_variance(w / step, step)
    if mode == "int4":
        k, n = w.shape
        tiles = jnp.max(jnp.abs(w).reshape(k // INT4_TILE, INT4_TILE, n), axis=1, keepdims=True)
        step = jnp.broadcast_to(tiles / 7.5, (k // INT4_TILE, INT4_TILE, n)).reshape(k, n)
        return _int_variance(w / step, step)
    if mode == "fp8":  # e4m3: 3 mantissa bits, normal from 2^-6, subnormal step 2^-9
        scale = absmax / 448.0
        v = jnp.abs(w) / scale
        exponent = jnp.floor(jnp.log2(jnp.maximum(v, 2.0**-6)))
        return (scale * 2.0 ** (exponent - 3)) ** 2 / 12
    raise ValueError(mode)


@jax.jit
def _error_stats(x: jax.Array, w: jax.Array, var_w: jax.Array, act_quant: jax.Array,
                 y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(||y - ref|| / ||ref||, the model's q) for bf16 x and the float32 weights ``w``:
    E[e_mn²] = Σ_k x_mk² Var(w_kn) + Var(x_mk) w_kn²."""
    x = x.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    ref = jnp.dot(x, w, precision=hi)
    err = jnp.sqrt(jnp.sum((y.astype(jnp.float32) - ref) ** 2) / jnp.sum(ref**2))
    expected = jnp.dot(x * x, var_w, precision=hi)
    # int8 activations per token (w8a8 only): step absmax / 127.5 per row of x.
    step = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127.5
    var_x = _int_variance(x / step, step) * act_quant
    expected = expected + jnp.dot(var_x, w * w, precision=hi)
    return err, jnp.sqrt(jnp.sum(expected) / jnp.sum(ref**2))


# ---------------------------------------------------------------------------
# The run.


def _fmt(row: Row) -> str:
    head = f"{row.m:>6d} {row.mode:>5s} {row.impl:<18s}"
    if row.na is not None:
        return f"{head} n/a ({row.na})"
    return (
        f"{head} {row.us:>10.1f} {row.rate:>8.3g} {row.unit:<7s} {row.gbs:>7.3g} "
        f"{row.x_bf16:>6.2f} {row.rel_err:>9.2e} {row.bound:>9.2e}  {row.timed}; {row.kernel}"
    )


def run(shapes: Sequence[tuple[int, int]], ms: Sequence[int], modes: Sequence[str],
        seed: int, repeats: int, target_s: float) -> list[Row]:
    """Time every (shape, M, mode, implementation); print each row as it is done."""
    rows: list[Row] = []
    key = jax.random.key(seed)
    for k, n in shapes:
        started = time.perf_counter()
        print(f"\nx[M, {k}] @ w[{k}, {n}], bf16 activations")
        print(f"{'M':>6s} {'mode':>5s} {'impl':<18s} {'µs':>10s} {'rate':>8s} {'':7s} "
              f"{'GB/s':>7s} {'x bf16':>6s} {'rel.err':>9s} {'bound':>9s}  timed; kernel")
        key, kw, kx = jax.random.split(key, 3)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
        w32 = w.astype(jnp.float32)
        xs = {m: jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.bfloat16) for m in ms}
        bf16_us: dict[int, float] = {}
        for mode in modes:
            var_w = jax.jit(_weight_variance, static_argnums=0)(mode, w32)
            act_quant = jnp.float32(mode == "w8a8")
            for impl in impls_for(mode):
                try:
                    weights, step, nbytes, kernel = build_case(mode, impl, w, xs[ms[0]][:16])
                except Unavailable as why:
                    for m in ms:
                        rows.append(Row(k, n, m, mode, impl, na=str(why)))
                        print(_fmt(rows[-1]))
                    continue
                for m in ms:
                    row = Row(k, n, m, mode, impl, weight_bytes=nbytes, kernel=kernel,
                              unit="TOP/s" if mode == "w8a8" else "TFLOP/s")
                    try:
                        secs, y, row.timed = time_case(step, weights, xs[m], repeats, target_s)
                    except Exception as err:
                        row.na = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                        rows.append(row)
                        print(_fmt(row))
                        continue
                    row.us = secs * 1e6
                    row.rate = 2 * m * k * n / secs / 1e12
                    row.gbs = nbytes / secs / 1e9
                    if mode == "bf16":
                        bf16_us[m] = row.us
                    row.x_bf16 = bf16_us[m] / row.us if m in bf16_us else float("nan")
                    err, q = _error_stats(xs[m], w32, var_w, act_quant, y)
                    row.rel_err, row.q_model = float(err), float(q)
                    row.bound = BOUND_FACTOR * math.hypot(row.q_model, ROUNDING)
                    rows.append(row)
                    print(_fmt(row))
                del weights, step
        print(f"(K={k}, N={n}: {time.perf_counter() - started:.0f} s with compilation)")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    cli.parsed(argv)
    start = time.perf_counter()
    small = _SMALL.value if _SMALL.value is not None else jax.default_backend() == "cpu"
    bad = [m for m in _MODES.value if m not in MODES]
    if bad:
        print(f"--modes: unknown mode {bad[0]!r}; choose from {', '.join(MODES)}",
              file=sys.stderr)
        raise SystemExit(2)
    modes = ["bf16", *[m for m in MODES[1:] if m in _MODES.value]]
    host = host_lines()
    for line in host:
        print(line)
    print(f"timing: M <= {LOOP_MAX_M} inside one jitted fori_loop (weights through an "
          "optimization_barrier with the carried x; (t(n) - t(1)) / (n - 1)); larger M calls "
          f"back to back, one block_until_ready; medians of {_REPEATS.value} repeats")
    shapes, ms = (SMALL_SHAPES, SMALL_MS) if small else (FULL_SHAPES, FULL_MS)
    try:
        if _SHAPES.value:
            shapes = tuple(tuple(int(v) for v in s.lower().split("x", 1)) for s in _SHAPES.value)
        if _MS.value:
            ms = tuple(int(v) for v in _MS.value)
    except ValueError:
        print("--shapes: expected KxN values such as 4096x14336; --ms: integers",
              file=sys.stderr)
        raise SystemExit(2) from None
    if any(k % INT4_TILE or k < 1 or n < 1 for k, n in shapes) or any(m < 1 for m in ms):
        print(f"--shapes: K must be a positive multiple of {INT4_TILE} (int4 tiles), N and "
              "--ms positive", file=sys.stderr)
        raise SystemExit(2)
    print(f"sizes: {'small' if small else 'full'}; int4 tiles of {INT4_TILE} along K, "
          "int8/fp8 per output channel, w8a8 activations per token")
    rows = run(shapes, ms, modes, _SEED.value, _REPEATS.value, _TARGET.value / 1e3)
    kind = jax.devices()[0].device_kind
    v5e = is_v5e(kind)
    if v5e:
        print("v5e limits: " + ", ".join(f"{v:g} {k}" for k, v in V5E.items()))
    print(f"bound = {BOUND_FACTOR} x sqrt(q^2 + (2^-7)^2), q the absmax rounding model's "
          f"relative error; total {time.perf_counter() - start:.0f} s")
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps({
            "host": host,
            "device_kind": kind,
            "backend": jax.default_backend(),
            "small": small,
            "limits": V5E if v5e else None,
            "rows": [dataclasses.asdict(r) for r in rows],
        }, indent=1))


if __name__ == "__main__":
    cli.run(main)
