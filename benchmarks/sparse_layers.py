"""Benchmark: mlx_lattice feature layers next to the convolution they sit between.

One run, one machine, 100k points x 64 channels: forward+backward time of
each feature layer (norms, activations) in float32, in float16 as the library
runs it (activations and BatchNorm computed in float32 and cast back; the
mx.fast norms on half inputs directly), and in float16 through the same MLX
ops directly, as ratios; and each layer's time
as a share of one 3x3x3 64->64 submanifold convolution's forward+backward.
Also the quantized linear layer with and without activation fake-quantization.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as mnn
import numpy as np
from absl import flags

from benchmarks.host_class import host_class_line
from benchmarks.timing import median_s
from examples import cli
from mlx_lattice import SparseTensor, nn, ops

N, C = 100_000, 64

_POINTS = flags.DEFINE_integer(
    "points", N, "random points (before duplicates are merged)", lower_bound=1
)


def _fwd_bwd(fn: Callable[[mx.array], mx.array], feats: mx.array) -> Callable[[], None]:
    grad = mx.grad(lambda f: fn(f).astype(mx.float32).sum())
    return lambda: mx.eval(grad(feats))


def _direct(name: str) -> Callable[[mx.array], mx.array]:
    """The same math on the features' own dtype (no float32 compute)."""
    w, b = mx.ones((C,)), mx.zeros((C,))
    return {
        "relu": lambda f: mx.maximum(f, 0),
        "gelu": mnn.gelu,
        "gelu_tanh": lambda f: 0.5 * f * (1 + mx.tanh(0.7978845608 * (f + 0.044715 * f * f * f))),
        "silu": lambda f: f * mx.sigmoid(f),
        "leaky_relu": lambda f: mx.where(f > 0, f, 0.01 * f),
        "sigmoid": mx.sigmoid,
        "softplus": lambda f: mx.logaddexp(f, mx.zeros_like(f)),
        "layer_norm": lambda f: mx.fast.layer_norm(f, w.astype(f.dtype), b.astype(f.dtype), 1e-5),
        "rms_norm": lambda f: mx.fast.rms_norm(f, w.astype(f.dtype), 1e-5),
        "batch_norm": lambda f: mnn.BatchNorm(C).apply(lambda p: p.astype(f.dtype))(f),
    }[name]


def main(argv: Sequence[str] | None = None) -> None:
    cli.parsed(argv)
    print(host_class_line())
    points = _POINTS.value
    rng = np.random.default_rng(0)
    side = round((points * 8) ** (1 / 3))
    coords = np.unique(
        np.concatenate(
            [np.zeros((points, 1), np.int64), rng.integers(0, side, (points, 3))], 1
        ),
        axis=0,
    ).astype(np.int32)
    x32 = SparseTensor(coords, mx.array(rng.standard_normal((len(coords), C)).astype(np.float32)))
    n = x32.num_points
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {n} points x {C} channels")

    conv = nn.SubMConv3d(C, C)
    conv(x32)  # build the relation once

    def conv_loss(f: mx.array) -> mx.array:
        return conv(x32.replace(f)).feats.sum()

    conv_grad = mx.grad(conv_loss)
    conv_s = median_s(lambda: mx.eval(conv_grad(x32.feats)), repeats=3)
    print(f"subm conv 3x3x3 {C}->{C} float32 forward+backward: {conv_s * 1e3:.0f} ms")

    bn32, bn16 = nn.BatchNorm(C), nn.BatchNorm(C)
    bn16.apply(lambda p: p.astype(mx.float16))
    layers: dict[str, tuple[Callable, Callable]] = {
        "relu": (ops.relu, ops.relu),
        "gelu": (ops.gelu, ops.gelu),
        "gelu_tanh": (lambda t: ops.gelu(t, "tanh"),) * 2,
        "silu": (ops.silu, ops.silu),
        "leaky_relu": (ops.leaky_relu, ops.leaky_relu),
        "sigmoid": (ops.sigmoid, ops.sigmoid),
        "softplus": (ops.softplus, ops.softplus),
        "layer_norm": (ops.layer_norm, ops.layer_norm),
        "rms_norm": (ops.rms_norm, ops.rms_norm),
        "batch_norm": (bn32, bn16),
    }
    print(
        f"{'layer':<12}{'f32 ms':>8}{'f16 ms':>8}{'f16 direct ms':>15}"
        f"{'f16/f32':>9}{'direct/f16':>12}{'f32 / conv':>12}"
    )
    x16 = x32.astype(mx.float16)
    for name, (fn32, fn16) in layers.items():
        t32 = median_s(_fwd_bwd(lambda f, fn=fn32: fn(x32.replace(f)).feats, x32.feats), 3)
        t16 = median_s(_fwd_bwd(lambda f, fn=fn16: fn(x16.replace(f)).feats, x16.feats), 3)
        direct = _direct(name)
        t16d = median_s(_fwd_bwd(direct, x16.feats), 3)
        print(
            f"{name:<12}{t32 * 1e3:>8.1f}{t16 * 1e3:>8.1f}{t16d * 1e3:>15.1f}"
            f"{t16 / t32:>9.2f}{t16d / t16:>12.2f}{t32 / conv_s:>12.2f}"
        )

    # BatchNorm + ReLU as the models run it in training: fused (statistics
    # once in float32, closed-form backward) against mlx.nn.BatchNorm then
    # mx.maximum on float32 features (the previous path), timed round robin.
    fused_bn, plain_bn = nn.BatchNorm(C), mnn.BatchNorm(C)

    def unfused(t: SparseTensor) -> mx.array:
        return mx.maximum(plain_bn(t.feats.astype(mx.float32)), 0).astype(t.dtype)

    for label, x in (("float32", x32), ("float16", x16)):
        calls = (
            _fwd_bwd(lambda f, x=x: fused_bn.relu(x.replace(f)).feats, x.feats),
            _fwd_bwd(lambda f, x=x: unfused(x.replace(f)), x.feats),
        )
        for c in calls:
            c()  # warm-up
        best = [float("inf"), float("inf")]
        for _ in range(5):
            best = [
                min(b, median_s(c, repeats=1, warmup=0)) for b, c in zip(best, calls, strict=True)
            ]
        print(
            f"batch_norm+relu {label} forward+backward: fused {best[0] * 1e3:.1f} ms, "
            f"unfused {best[1] / best[0]:.2f}x that, fused / conv {best[0] / conv_s:.2f}"
        )

    # Linear on sparse features: the library's native 1x1x1 convolution
    # against mx.matmul on the same features (what mlx.nn.Linear does).
    lin = nn.Linear(C, C)
    plain = mnn.Linear(C, C)
    plain.weight, plain.bias = lin.weight, lin.bias
    q = lin.to_quantized(group_size=64, bits=8)
    qa = lin.to_quantized(group_size=64, bits=8, act_bits=8)
    ops.pointwise_relation(x32)  # built once per coordinate set (cached)
    t_native = median_s(_fwd_bwd(lambda f: lin(x32.replace(f)).feats, x32.feats), 3)
    t_matmul = median_s(_fwd_bwd(plain, x32.feats), 3)
    t_fwd = median_s(lambda: mx.eval(lin(x32).feats), 5)
    t_q = median_s(lambda: mx.eval(q(x32).feats), 5)
    t_qa = median_s(lambda: mx.eval(qa(x32).feats), 5)
    t_qmm = median_s(lambda: mx.eval(q(x32.feats)), 5)
    print(
        f"linear {C}->{C} forward+backward: native 1x1x1 {t_native * 1e3:.1f} ms, mx.matmul "
        f"{t_matmul / t_native:.1f}x that"
    )
    print(
        f"linear forward {t_fwd * 1e3:.1f} ms; int8 weights {t_q / t_fwd:.2f}x; int8 weights + "
        f"int8 activation fake-quantization {t_qa / t_fwd:.2f}x; int8 via mx.quantized_matmul "
        f"{t_qmm / t_fwd:.2f}x"
    )


if __name__ == "__main__":
    cli.run(main)
