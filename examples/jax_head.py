"""The demo's dense JAX head: a Flax NNX model quantized by the rule list
that quantizes the sparse network, and shipped as a ``jax.export`` artifact.

The head is a per-voxel MLP on the U-Net's features: ``mlp/fc1``,
``mlp/fc2`` and ``head`` (:class:`taktiny_ops.Linear` layers). Their paths
come from where they sit in the model, so the demo's rules (``mlp/.*``,
``head``) select them without the model naming them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import quantrules as qr
import taktiny_ops as tk

__all__ = ["DenseHead", "export_head", "run_head", "side_by_side"]


class DenseHead(nnx.Module):
    """``fc1 -> relu -> fc2 -> relu -> head``, with seeded ``N(0, 1/in)`` kernels.

    >>> model = DenseHead(4, 8, 3, seed=0)
    >>> [path for path, _ in model.layers()]
    ['mlp/fc1', 'mlp/fc2', 'head']
    >>> model(jnp.ones((2, 4))).shape
    (2, 3)
    """

    def __init__(self, features: int, hidden: int, classes: int, *, seed: int) -> None:
        rng = np.random.default_rng(seed)

        def layer(a: int, b: int) -> tk.Linear:
            out = tk.Linear(a, b, use_bias=False, rngs=nnx.Rngs(seed))
            out.kernel.set_value(jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a),
                                             jnp.float32))
            return out

        sizes = [features, hidden, hidden, classes]
        fc1, fc2, head = (layer(a, b) for a, b in itertools.pairwise(sizes))
        self.mlp = nnx.Dict(fc1=fc1, fc2=fc2)
        self.head = head

    def layers(self) -> list[tuple[str, Any]]:
        """(module path, layer) in call order."""
        return [("mlp/fc1", self.mlp["fc1"]), ("mlp/fc2", self.mlp["fc2"]), ("head", self.head)]

    def __call__(self, x: jax.Array) -> jax.Array:
        for _, layer in self.layers()[:-1]:
            x = jax.nn.relu(layer(x))
        return self.head(x)


def _rel_error(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _timed(layer: Any, x: jax.Array) -> tuple[jax.Array, float]:
    jax.block_until_ready(layer(x))  # compile (the layer's cached jit) outside the timing
    start = time.perf_counter()
    y = jax.block_until_ready(layer(x))
    return y, time.perf_counter() - start


def run_head(rules: Any, feats: np.ndarray, hidden: int, classes: int, seed: int,
             step: Any) -> tuple[DenseHead, tk.QuantizationReport, list[tuple]]:
    """The float head and a copy quantized by ``rules`` (``taktiny_ops.quantize``),
    run layer by layer on ``feats``; ``step.update`` shows the layer.

    Returns the quantized model, its report and one row per layer: (path,
    rule, relative error vs float, float s, quantized s, float bytes,
    quantized bytes).
    """
    float_model = DenseHead(feats.shape[1], hidden, classes, seed=seed)
    model = DenseHead(feats.shape[1], hidden, classes, seed=seed)
    report = tk.quantize(model, rules)
    by_path = {layer.path: layer for layer in report.layers}
    rows = []
    x_float = x_quant = jnp.asarray(feats)
    pairs = list(zip(float_model.layers(), model.layers(), strict=True))
    for i, ((path, float_layer), (_, layer)) in enumerate(pairs):
        step.update(path)
        y_float, t_float = _timed(float_layer, x_float)
        y_quant, t_quant = _timed(layer, x_quant)
        got = by_path[path]
        rows.append((path, got.rule, _rel_error(y_quant, y_float), t_float, t_quant,
                     got.bytes_before, got.bytes_after))
        if i < len(pairs) - 1:
            x_float, x_quant = jax.nn.relu(y_float), jax.nn.relu(y_quant)
    return model, report, rows


def export_head(model: DenseHead, feats: np.ndarray, path: Any) -> int | str:
    """Write the head as a ``jax.export`` artifact; its size in bytes, or why not."""
    try:
        return tk.export_model(model, jnp.asarray(feats[:2]), path)
    except ImportError as err:  # jax.export's serialization needs flatbuffers
        return f"not written ({err})"


def side_by_side(rules: Any, sparse_report: Any, head_report: tk.QuantizationReport,
                 out: Any) -> None:
    """Both models' layers under the one rule list, with the rule each got."""
    rows: list[Sequence[str]] = []
    for layer in sparse_report.layers:
        weights = "-" if layer.bits is None else f"{layer.bits}-bit"
        acts = "-" if layer.act_bits is None else f"{layer.act_bits}-bit"
        rows.append(("sparse (mlx_lattice)", layer.path, layer.op, weights, acts, layer.rule))
    for layer in head_report.layers:
        rows.append(("dense head (taktiny_ops)", layer.path, layer.op, layer.weight_qtype or "-",
                     layer.act_qtype or "-", layer.rule))
    count = len(qr.as_rules(rules)[0])
    print(f"\none rule list ({count} rules), both models' layers", file=out)
    print(f"{'model':25s} {'layer':22s} {'op':12s} {'weights':>8s} {'acts':>7s}  "
          "rule (quantrules.explain)", file=out)
    for model, path, op, weights, acts, rule in rows:
        print(f"{model:25s} {path:22s} {op:12s} {weights:>8s} {acts:>7s}  {rule}", file=out)
