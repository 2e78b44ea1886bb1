"""Benchmark: the example sparse U-Net end to end on the built-in LiDAR scan.

One run, one machine: forward and forward+backward throughput (voxels/s) for
float32, float16, int8 and int4 models, and the share of a cold forward pass
spent building kernel relations (a fresh coordinate manager) versus running
the network (relations cached).
"""

from __future__ import annotations

import os
import platform

import mlx.core as mx
import mlx.nn as mnn
import numpy as np

import mlx_lattice
import quantrules as qr
from benchmarks.timing import median_s
from examples.sparse_unet import SparseUNet
from mlx_lattice import SparseTensor
from mlx_lattice._native import ext
from mlx_lattice.data import synthetic_lidar_scan

WIDTHS = (32, 64, 96, 128)
VOXEL = 0.05


def _model(kind: str) -> SparseUNet:
    mx.random.seed(0)
    model = SparseUNet(2, 4, WIDTHS)
    if kind == "float16":
        model.apply(lambda p: p.astype(mx.float16))
    elif kind in ("int8", "int4"):
        bits = 8 if kind == "int8" else 4
        mlx_lattice.quantize(model, qr.Rule(weight_qtype=f"int{bits}", tile_size=32))
    model.train()
    return model


def main() -> None:
    points = synthetic_lidar_scan(seed=0).points
    height = (points[:, 2:3] - points[:, 2].mean()) / points[:, 2].std()
    feats = np.concatenate([np.ones_like(height), height], axis=1)
    base = SparseTensor.from_points(points, VOXEL, feats)
    n = base.num_points

    def fresh(dtype: mx.Dtype) -> SparseTensor:
        return SparseTensor(base.coords, base.feats.astype(dtype), check=False)

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; mlx_lattice threads "
        f"{mlx_lattice.get_num_threads()}, micro-kernel {ext.gemm_isa()}"
    )
    print(
        f"scan: {n} voxels at {VOXEL * 100:.0f} cm; U-Net widths {WIDTHS}, 2 input channels, 4 classes"
    )
    print(
        f"{'model':<9}{'forward vox/s':>15}{'fwd+bwd vox/s':>15}{'cold fwd ms':>13}{'warm fwd ms':>13}{'relations':>11}"
    )
    for kind in ("float32", "float16", "int8", "int4"):
        model = _model(kind)
        dtype = mx.float16 if kind == "float16" else mx.float32
        warm_input = fresh(dtype)

        def forward(x: SparseTensor, model: SparseUNet = model) -> None:
            mx.eval(model(x).feats)

        cold = median_s(lambda dtype=dtype, forward=forward: forward(fresh(dtype)), repeats=5)
        warm = median_s(lambda forward=forward, x=warm_input: forward(x), repeats=5)

        def loss(m: SparseUNet, x: SparseTensor = warm_input) -> mx.array:
            return m(x).feats.astype(mx.float32).square().mean()

        step = mnn.value_and_grad(model, loss)
        train = median_s(lambda step=step, model=model: mx.eval(step(model)), repeats=5)
        share = max(cold - warm, 0.0) / cold
        print(
            f"{kind:<9}{n / warm:>15,.0f}{n / train:>15,.0f}{cold * 1e3:>13.1f}{warm * 1e3:>13.1f}{share:>10.0%}"
        )
    print(
        "relations: share of a cold forward (fresh coordinate manager) spent building kernel relations"
    )


if __name__ == "__main__":
    main()
