"""Benchmark: quantized training (QT) steps against bf16, through taktiny_ops
and through Qwix's own ``QtProvider``, on the default JAX backend (a TPU
where there is one; any backend runs it).

Models (bf16 parameters and activations, no bias):

* ``mlp``: 4 ``nnx.Linear`` layers of width 4096 with ReLU between them,
  batch 4096 (as 16 × 256 rows: with a 4096 × 4096 input Qwix's QtProvider
  takes the activation for a weight, since it falls back to matching
  shapes);
* ``transformer``: 2 pre-LayerNorm blocks of width 2048, 16 heads of 128,
  sequence 512, batch 8 (``--tf-batch``); attention (non-causal, softmax in float32) and an
  MLP of 4 × 2048; the four projections per block (``qkv``, ``out``, ``up``,
  ``down``) are ``nnx.Einsum`` layers.

``--small`` (the default on a CPU backend): widths 64/64, batch 64, sequence
16, 4 heads, 60 loss-curve steps.

Each model trains with ``optax.adam`` in one jitted step (value and grad,
update; parameters and optimizer state donated) on a mean-squared error.
Variants: ``bf16``; ``int8 QT (ours)``: ``taktiny_ops.quantize`` with one
``quantrules.Rule(weight_qtype='int8', act_qtype='int8', bwd_qtype='int8',
mode='qt')`` on the projections; ``int8 QT (qwix)``: ``qwix.quantize_model``
with ``qwix.QtProvider([qwix.QtRule(...)])``, the same rule in Qwix's terms.
Step time: after a compiling call and a warm-up, steps back to back with one
``block_until_ready`` at the end, median over repeats. Printed: ms per step
and the ratio bf16 / int8.

Then the loss curve: the MLP trained from one seed on a seeded synthetic
regression (targets from a fixed random teacher, ``tanh(x A) B``, a fresh
batch per step), bf16 and both int8 QT variants, written as JSON (``--json``)
and drawn with matplotlib to ``--png``. The two int8 curves come from
programs that compile to the same computation, so on one backend they agree
bit for bit; the run prints whether they do.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (python3 benchmarks/tpu_train.py)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax
import qwix
from absl import flags
from flax import nnx

import quantrules as qr
import taktiny_ops as tk
from benchmarks.jax_host import host_lines
from benchmarks.timing import median_s
from examples import cli

# Issue targets (int8 QT step / bf16 step, on a TPU v5e).
TARGETS = {"mlp": 1.7, "transformer": 1.5}
PROJECTIONS = ".*(fc\\d|qkv|out|up|down)"  # the layers QT quantizes (attention stays bf16)
VARIANTS = ("bf16", "int8 QT (ours)", "int8 QT (qwix)")

_SMALL = flags.DEFINE_boolean(
    "small", None, "small sizes (default: on when the backend is a CPU; --nosmall forces full)")
_JSON = flags.DEFINE_string("json", None, "write step times and loss curves as JSON here")
_PNG = flags.DEFINE_string("png", None, "draw the loss curves (matplotlib) to this PNG")
_STEPS = flags.DEFINE_integer(
    "steps", None, "loss-curve steps (default 300; 60 with --small)", lower_bound=2)
_SEED = flags.DEFINE_integer("seed", 0, "seed of the models, data and teacher")
_LR = flags.DEFINE_float(
    "lr", None, "Adam learning rate (default 3e-4; 3e-3 with --small)", lower_bound=0.0)
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed repeats per variant (median)", lower_bound=1)
_TARGET = flags.DEFINE_float(
    "target-ms", 200.0, "about how long one timed repeat of steps runs", lower_bound=0.1)
_TIMED = flags.DEFINE_list(
    "models", ["mlp", "transformer"],
    "the models whose steps are timed (the loss curve needs mlp)")
flags.register_validator("models", lambda v: bool(v) and set(v) <= {"mlp", "transformer"},
                         message="--models: mlp and/or transformer")
_TF_BATCH = flags.DEFINE_integer(
    "tf-batch", None, "the transformer's batch (sequences of 512 tokens; default 8, 4 with "
    "--small)", lower_bound=1)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Model and data sizes."""

    mlp_width: int
    mlp_batch: int
    mlp_rows: int  # the batch as (mlp_batch / mlp_rows, mlp_rows, width)
    tf_width: int
    tf_heads: int
    tf_seq: int
    tf_batch: int
    teacher: int
    steps: int


FULL = Sizes(mlp_width=4096, mlp_batch=4096, mlp_rows=256, tf_width=2048, tf_heads=16, tf_seq=512,
             tf_batch=8, teacher=256, steps=300)
SMALL = Sizes(mlp_width=64, mlp_batch=64, mlp_rows=16, tf_width=64, tf_heads=4, tf_seq=16, tf_batch=4,
              teacher=16, steps=60)


class Mlp(nnx.Module):
    """4 bf16 ``nnx.Linear`` layers (``fc0``..``fc3``), ReLU between them."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        def make() -> nnx.Linear:
            return nnx.Linear(width, width, use_bias=False, param_dtype=jnp.bfloat16, rngs=rngs)

        self.fc0, self.fc1, self.fc2, self.fc3 = make(), make(), make(), make()

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.fc0(x))
        x = jax.nn.relu(self.fc1(x))
        x = jax.nn.relu(self.fc2(x))
        return self.fc3(x)


class Block(nnx.Module):
    """Pre-LayerNorm attention and MLP; the projections are ``nnx.Einsum`` layers."""

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs) -> None:
        def proj(spec: str, shape: tuple[int, int]) -> nnx.Einsum:
            return nnx.Einsum(spec, shape, param_dtype=jnp.bfloat16, rngs=rngs)

        self.heads = heads
        self.norm1 = nnx.LayerNorm(width, param_dtype=jnp.bfloat16, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, param_dtype=jnp.bfloat16, rngs=rngs)
        self.qkv = proj("btd,dk->btk", (width, 3 * width))
        self.out = proj("btk,kd->btd", (width, width))
        self.up = proj("btd,df->btf", (width, 4 * width))
        self.down = proj("btf,fd->btd", (4 * width, width))

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, t, 3 * self.heads, -1), 3, axis=2)
        logits = jnp.einsum("bqhc,bkhc->bhqk", q, k) / np.sqrt(q.shape[-1])
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
        attn = jnp.einsum("bhqk,bkhc->bqhc", probs, v).reshape(b, t, d)
        x = x + self.out(attn)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
    """Two :class:`Block` layers."""

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([Block(width, heads, rngs), Block(width, heads, rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return x


def quantized(model: nnx.Module, variant: str, example: jax.Array) -> nnx.Module:
    """``model`` as ``variant`` trains it: as is, or int8 QT through either library."""
    if variant == "bf16":
        return model
    if variant == "int8 QT (ours)":
        tk.quantize(model, qr.Rule(module_path=PROJECTIONS, weight_qtype="int8",
                                   act_qtype="int8", bwd_qtype="int8", mode="qt",
                                   act_batch_axes=(0, 1)))
        return model
    rule = qwix.QtRule(module_path=PROJECTIONS, weight_qtype=jnp.int8, act_qtype=jnp.int8,
                       bwd_qtype=jnp.int8, act_batch_axes=(0, 1))
    return qwix.quantize_model(model, qwix.QtProvider([rule]), example)


def train_step(model: nnx.Module, lr: float) -> tuple[Any, Any, Callable]:
    """(params, optimizer state, step): ``step(params, opt, x, y) -> (params, opt, loss)``,
    jitted, parameters and optimizer state donated."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(lr)

    def loss_fn(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        out = nnx.merge(graphdef, p, rest)(x)
        return jnp.mean((out.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p: Any, opt: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, loss

    return params, tx.init(params), step


def _teacher(sizes: Sizes, seed: int) -> Callable[[jax.Array], tuple[jax.Array, jax.Array]]:
    """A jitted ``key -> (x, y)`` of the synthetic regression: x standard normal,
    y = tanh(x A) B with A ~ N(0, 4/d) and B ~ N(0, 1/h), so Var(y) = E[tanh(N(0, 4))²] ≈ 0.8."""
    ka, kb = jax.random.split(jax.random.key(seed + 1))
    d, h = sizes.mlp_width, sizes.teacher
    a = jax.random.normal(ka, (d, h), jnp.float32) * 2 / np.sqrt(d)
    b = jax.random.normal(kb, (h, d), jnp.float32) / np.sqrt(h)

    @jax.jit
    def batch(key: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = jax.random.normal(key, (sizes.mlp_batch // sizes.mlp_rows, sizes.mlp_rows, d),
                              jnp.float32)
        y = jnp.tanh(x @ a) @ b
        return x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)

    return batch


def time_steps(model: nnx.Module, x: jax.Array, y: jax.Array, lr: float, repeats: int,
               target_s: float) -> tuple[float, float, Callable]:
    """(seconds per step, compile + first step seconds, the compiled step) of
    ``model``'s train step."""
    params, opt, step = train_step(model, lr)
    start = time.perf_counter()
    params, opt, loss = step(params, opt, x, y)
    jax.block_until_ready(loss)
    first = time.perf_counter() - start
    start = time.perf_counter()
    params, opt, loss = step(params, opt, x, y)
    jax.block_until_ready(loss)
    n = int(min(max(target_s / max(time.perf_counter() - start, 1e-6), 3), 500))
    state = [params, opt, loss]

    def burst() -> None:
        for _ in range(n):
            state[:] = step(*state[:2], x, y)
        jax.block_until_ready(state[2])

    return median_s(burst, repeats, warmup=0) / n, first, step


def loss_curve(model: nnx.Module, step: Callable, data: Callable, steps: int, lr: float,
               seed: int) -> list[float]:
    """The loss at each of ``steps`` steps of ``model`` trained from its
    initial values by ``step`` (compiled for a model of the same structure),
    a fresh seeded batch per step."""
    params, opt, _ = train_step(model, lr)
    keys = jax.random.split(jax.random.key(seed + 2), steps)
    losses = []
    for i in range(steps):
        x, y = data(keys[i])
        params, opt, loss = step(params, opt, x, y)
        losses.append(loss)
    return [float(v) for v in jax.device_get(losses)]


def _models(sizes: Sizes, seed: int) -> dict[str, tuple[Callable[[], nnx.Module], tuple]]:
    """Per model: a constructor (same seed every time) and the (x, y) batch shapes."""
    mlp_shape = (sizes.mlp_batch // sizes.mlp_rows, sizes.mlp_rows, sizes.mlp_width)
    tf_shape = (sizes.tf_batch, sizes.tf_seq, sizes.tf_width)
    return {
        "mlp": (lambda: Mlp(sizes.mlp_width, nnx.Rngs(seed)), mlp_shape),
        "transformer": (lambda: Transformer(sizes.tf_width, sizes.tf_heads, nnx.Rngs(seed)),
                        tf_shape),
    }


def draw(curves: dict[str, list[float]], path: str, title: str) -> None:
    """The loss curves as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    styles = {"bf16": "-", "int8 QT (ours)": "-", "int8 QT (qwix)": ":"}
    for name, losses in curves.items():
        ax.plot(np.arange(1, len(losses) + 1), losses, styles.get(name, "-"), label=name,
                linewidth=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean squared error (log scale)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    cli.parsed(argv)
    start = time.perf_counter()
    small = _SMALL.value if _SMALL.value is not None else jax.default_backend() == "cpu"
    sizes = SMALL if small else FULL
    if _TF_BATCH.value:
        sizes = dataclasses.replace(sizes, tf_batch=_TF_BATCH.value)
    steps = _STEPS.value or sizes.steps
    seed = _SEED.value
    lr = _LR.value if _LR.value is not None else (3e-3 if small else 3e-4)
    host, kind = host_lines(), jax.devices()[0].device_kind
    for line in host:
        print(line)
    print(f"timing: a compiling call and a warm-up step, then steps back to back with one "
          f"block_until_ready, median of {_REPEATS.value} repeats")
    print(f"sizes: {'small' if small else 'full'}: mlp 4 x {sizes.mlp_width} at batch "
          f"{sizes.mlp_batch}; transformer 2 blocks, width {sizes.tf_width}, {sizes.tf_heads} "
          f"heads, sequence {sizes.tf_seq}, batch {sizes.tf_batch}; adam lr {lr:g}")
    result: dict[str, Any] = {"host": host, "device_kind": kind,
                              "backend": jax.default_backend(), "small": small,
                              "sizes": dataclasses.asdict(sizes), "lr": lr, "steps": {}}
    key = jax.random.key(seed + 3)
    mlp_steps: dict[str, Callable] = {}
    print(f"\n{'model':<12s} {'variant':<16s} {'ms/step':>9s} {'bf16/this':>9s} "
          f"{'compile s':>9s}")
    for name, (make, shape) in _models(sizes, seed).items():
        if name not in _TIMED.value:
            continue
        kx, ky, key = jax.random.split(key, 3)
        x = jax.random.normal(kx, shape, jnp.bfloat16)
        y = jax.random.normal(ky, shape, jnp.bfloat16)
        times = {}
        for variant in VARIANTS:
            model = quantized(make(), variant, x)
            secs, first, step = time_steps(model, x, y, lr, _REPEATS.value,
                                           _TARGET.value / 1e3)
            times[variant] = secs
            if name == "mlp":
                mlp_steps[variant] = step
            ratio = times["bf16"] / secs
            result["steps"].setdefault(name, {})[variant] = {
                "ms": secs * 1e3, "bf16_over_this": ratio, "compile_s": first}
            print(f"{name:<12s} {variant:<16s} {secs * 1e3:9.3f} {ratio:9.2f} {first:9.1f}")
        print(f"{name:<12s} step ratio bf16 / int8 QT: ours {times['bf16'] / times[VARIANTS[1]]:.2f}x"
              f", qwix {times['bf16'] / times[VARIANTS[2]]:.2f}x (issue target on a v5e: "
              f">= {TARGETS[name]}x)")
    if mlp_steps:  # the loss curve (the mlp was timed)
        data = _teacher(sizes, seed)
        curves = {}
        for variant in VARIANTS:
            make, shape = _models(sizes, seed)["mlp"]
            model = quantized(make(), variant, jnp.zeros(shape, jnp.bfloat16))
            curves[variant] = loss_curve(model, mlp_steps[variant], data, steps, lr, seed)
        same = curves[VARIANTS[1]] == curves[VARIANTS[2]]
        tail = max(1, steps // 10)
        late = {v: float(np.mean(c[-tail:])) for v, c in curves.items()}
        print(f"\nloss curve, mlp, {steps} steps (seeded teacher regression): first "
              f"{curves['bf16'][0]:.4f}; mean of the last {tail}: "
              + ", ".join(f"{v} {late[v]:.4f}" for v in VARIANTS)
              + f"; int8 ours and qwix bit for bit: {'yes' if same else 'NO'}")
        result.update(curves=curves, late_mean=late, int8_ours_equals_qwix=same)
        if _PNG.value:
            draw(curves, _PNG.value, f"4-layer MLP, width {sizes.mlp_width}, batch {sizes.mlp_batch}"
                 f" ({kind})")
            print(f"picture: {_PNG.value}")
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps(result, indent=1))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    cli.run(main)
