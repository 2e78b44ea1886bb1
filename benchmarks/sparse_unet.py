"""Benchmark: sparse segmentation networks end to end on the built-in LiDAR scan.

One run, one machine, ~100k voxels:

* training step time (forward + backward + Adam update) of MinkUNet for
  float32, float16 and int8 weights, with relations cached (``warm``, the same
  scan again) and built in the step (``cold``, a new coordinate set, as when
  every step sees a new scan);
* the share of a cold step spent outside the convolutions (norms,
  activations, concatenation, loss, update and relation building): one minus
  the summed time of every convolution layer's forward and backward run alone
  on its recorded input;
* forward throughput (voxels/s) for float32, float16, int8 and int4.

Pass ``--quick`` for a small scan (a smoke run).
"""

from __future__ import annotations

import argparse
import os
import platform

import mlx.core as mx
import mlx.nn as mlx_nn
import mlx.optimizers as optim

import mlx_lattice
import quantrules as qr
from benchmarks.timing import median_s
from mlx_lattice import SparseTensor
from mlx_lattice._native import ext
from mlx_lattice.data import SceneConfig, labelled_scans, make_batch
from mlx_lattice.models import MinkUNet, cross_entropy
from mlx_lattice.nn import is_sparse_conv

WIDTHS = (32, 64, 96, 128)
VOXEL = 0.05
CLASSES = 5


def _model(kind: str, widths: tuple[int, ...]) -> MinkUNet:
    mx.random.seed(0)
    model = MinkUNet(2, CLASSES, widths)
    if kind == "float16":
        model.apply(lambda p: p.astype(mx.float16))
    elif kind in ("int8", "int4"):
        rules = [
            qr.Rule(module_path="stem/.*"),  # Cin=2: packing would grow it
            qr.Rule(op_names=("sparse_conv",), weight_qtype=kind, tile_size=32),
        ]
        mlx_lattice.quantize(model, rules)
    model.train()
    return model


class _Recorder(mlx_nn.Module):
    """Stands in for a conv layer for one pass and records its input."""

    def __init__(self, inner: mlx_nn.Module, log: list) -> None:
        super().__init__()
        self.inner = inner
        self._record = log.append  # a method, not a list: kept out of the parameter tree

    def __call__(self, x: SparseTensor) -> SparseTensor:
        self._record((self.inner, x))
        return self.inner(x)


def _conv_inputs(model: mlx_nn.Module, x: SparseTensor) -> list:
    """(layer, input) for every convolution of one forward pass."""
    log: list = []
    swapped = []
    for name, module in model.named_modules():
        if name and is_sparse_conv(module):
            *parent, last = name.split(".")
            node = model
            for part in parent:
                node = node[part]
            swapped.append((node, last, module))
    for node, last, module in swapped:
        setattr(node, last, _Recorder(module, log))
    try:
        mx.eval(model(x).feats)
    finally:
        for node, last, module in swapped:
            setattr(node, last, module)
    return log


def _conv_seconds(layer: mlx_nn.Module, x: SparseTensor) -> float:
    """Forward and backward (input and, when trainable, weight gradients) of one layer."""
    params = layer.trainable_parameters()
    cot = mx.ones((1,), dtype=x.dtype)

    def loss(feats: mx.array, p: dict) -> mx.array:
        layer.update(p)
        return (layer(x.replace(feats)).feats * cot).sum()

    grad = mx.value_and_grad(loss, argnums=(0, 1) if params else 0)
    return median_s(lambda: mx.eval(grad(x.feats, params)), repeats=3)


def _train_step(
    model: MinkUNet, optimizer: optim.Optimizer, x: SparseTensor, labels: mx.array
) -> None:
    def loss(m: MinkUNet) -> mx.array:
        return cross_entropy(m(x).feats, labels)

    value, grads = mlx_nn.value_and_grad(model, loss)(model)
    optimizer.update(model, grads)
    mx.eval(value, model.parameters(), optimizer.state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small scan and model (smoke run)")
    args = parser.parse_args()
    widths = (8, 16, 16) if args.quick else WIDTHS
    config = SceneConfig(beams=16, azimuth_steps=512) if args.quick else None
    batch = make_batch(
        labelled_scans(1, 0, seed=0, config=config).train, 0.25 if args.quick else VOXEL
    )
    base, labels = batch.tensor, batch.labels
    n = base.num_points

    def fresh(dtype: mx.Dtype) -> SparseTensor:
        return SparseTensor(base.coords, base.feats.astype(dtype), check=False)

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; mlx_lattice threads "
        f"{mlx_lattice.get_num_threads()}, micro-kernel {ext.gemm_isa()}"
    )
    print(f"scan: {n} voxels; MinkUNet widths {widths}, 2 input channels, {CLASSES} classes")

    print("\ntraining step (forward + backward + Adam update)")
    print(
        f"{'model':<18}{'warm ms':>9}{'cold ms':>9}{'convs ms':>10}{'outside convs':>15}"
        f"{'vs float32':>12}"
    )
    base_cold = None
    for kind in ("float32", "float16", "int8"):
        model = _model(kind, widths)
        dtype = mx.float16 if kind == "float16" else mx.float32
        opt = optim.Adam(learning_rate=1e-3)
        warm_x = fresh(dtype)
        warm = median_s(lambda m=model, o=opt, x=warm_x: _train_step(m, o, x, labels), repeats=5)
        cold = median_s(
            lambda m=model, o=opt, d=dtype: _train_step(m, o, fresh(d), labels), repeats=5
        )
        convs = sum(_conv_seconds(layer, x) for layer, x in _conv_inputs(model, warm_x))
        base_cold = base_cold or cold
        print(
            f"{'MinkUNet ' + kind:<18}{warm * 1e3:>9.1f}{cold * 1e3:>9.1f}{convs * 1e3:>10.1f}"
            f"{1 - convs / cold:>15.0%}{cold / base_cold:>12.2f}"
        )
    print(
        "cold: relations built inside the step (a new coordinate set each step); outside convs: "
        "1 - convs / cold, convs = every conv layer's forward + backward timed alone"
    )

    print("\nforward")
    print(
        f"{'model':<9}{'forward vox/s':>15}{'cold fwd ms':>13}{'warm fwd ms':>13}{'relations':>11}"
    )
    for kind in ("float32", "float16", "int8", "int4"):
        model = _model(kind, widths)
        model.eval()
        dtype = mx.float16 if kind == "float16" else mx.float32
        warm_input = fresh(dtype)

        def forward(x: SparseTensor, model: MinkUNet = model) -> None:
            mx.eval(model(x).feats)

        cold = median_s(lambda dtype=dtype, forward=forward: forward(fresh(dtype)), repeats=5)
        warm = median_s(lambda forward=forward, x=warm_input: forward(x), repeats=5)
        share = max(cold - warm, 0.0) / cold
        print(f"{kind:<9}{n / warm:>15,.0f}{cold * 1e3:>13.1f}{warm * 1e3:>13.1f}{share:>10.0%}")
    print(
        "relations: share of a cold forward (fresh coordinate manager) spent building kernel relations"
    )


if __name__ == "__main__":
    main()
