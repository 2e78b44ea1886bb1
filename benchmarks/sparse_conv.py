"""Benchmark: mlx_lattice's sparse convolution on a synthetic LiDAR scan.

One run, one machine: the built-in 64-beam scan voxelized at 5 cm, a
submanifold 3x3x3 relation, 64 -> 64 channels. Prints the relation build
time and, per kernel, the useful rate 2 * edges * Cin * Cout / time as
GFLOP/s and as a fraction of NumPy's sgemm rate measured in the same run
(a large square sgemm, the machine's practical peak, and a same-shape
(edges x 64) @ (64 x 64) sgemm).

Then every dataflow (``mlx_lattice.core.dataflow``) for every dtype it
applies to, forced, as a time ratio to ``generic`` measured in the same run,
with the dataflow ``"auto"`` picks: the C64 -> C64 convolution (``generic``,
``sorted``), a C64 -> C14 head (``generic``, ``padded_c16``) and its
normalization denominator (``generic`` = the full convolution of ones,
``denominator_csr``).
"""

from __future__ import annotations

import os
import platform

import mlx.core as mx
import numpy as np

import mlx_lattice
from benchmarks.timing import median_s
from mlx_lattice._native import ext
from mlx_lattice.core import (
    QuantizedWeight,
    build_kernel_relation,
    ops,
    record_dataflows,
    use_dataflow,
)
from mlx_lattice.data import synthetic_lidar_scan, voxelize_points

CHANNELS = 64


def _sgemm_rate(m: int, k: int, n: int) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    return 2 * m * k * n / median_s(lambda: a @ b) / 1e9


def main() -> None:
    rng = np.random.default_rng(0)
    scan = synthetic_lidar_scan(seed=0)
    coords = mx.array(voxelize_points(scan.points, 0.05))
    mx.eval(coords)
    build_s = median_s(lambda: build_kernel_relation(coords, kernel_size=3))
    rel = build_kernel_relation(coords, kernel_size=3)
    n, edges = rel.n_in, rel.n_edges
    flops = 2 * edges * CHANNELS * CHANNELS

    peak = _sgemm_rate(2048, 2048, 2048)
    shaped = _sgemm_rate(edges, CHANNELS, CHANNELS)

    feats = mx.array(rng.standard_normal((n, CHANNELS), dtype=np.float32))
    weight = mx.array(rng.standard_normal((27, CHANNELS, CHANNELS), dtype=np.float32) / 40)
    cotangent = mx.array(rng.standard_normal((n, CHANNELS), dtype=np.float32))

    def conv(f, w):
        return ops.sparse_conv_features_from_relation(f, w, rel)

    f16, w16 = feats.astype(mx.float16), weight.astype(mx.float16)
    q8 = QuantizedWeight.from_float(w16, bits=8, group_size=64)
    q4 = QuantizedWeight.from_float(w16, bits=4, group_size=64)
    cases = {
        "fp32 forward": lambda: mx.eval(conv(feats, weight)),
        "fp32 feature grad": lambda: mx.eval(
            mx.vjp(lambda f: conv(f, weight), [feats], [cotangent])[1]
        ),
        "fp32 weight grad": lambda: mx.eval(
            mx.vjp(lambda w: conv(feats, w), [weight], [cotangent])[1]
        ),
        "fp16 forward (auto)": lambda: mx.eval(conv(f16, w16)),
        "int8 forward": lambda: mx.eval(
            ops.sparse_quantized_conv_features_from_relation(f16, q8, rel)
        ),
        "int4 forward": lambda: mx.eval(
            ops.sparse_quantized_conv_features_from_relation(f16, q4, rel)
        ),
    }
    times = {name: median_s(fn) for name, fn in cases.items()}

    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores; "
        f"mlx_lattice threads {mlx_lattice.get_num_threads()}, micro-kernel {ext.gemm_isa()}"
    )
    print(
        f"scan: {n} voxels at 5 cm, {edges} edges ({edges / n:.2f} per voxel), 3x3x3 submanifold, C{CHANNELS}"
    )
    print(f"relation build: {build_s * 1e3:.1f} ms (target <= 25 ms)")
    print(
        f"numpy sgemm: {peak:.1f} GFLOP/s (2048^3), {shaped:.1f} GFLOP/s ({edges}x{CHANNELS} @ {CHANNELS}x{CHANNELS})"
    )
    print(
        f"{'kernel':<24}{'ms':>9}{'GFLOP/s':>10}{'/sgemm':>9}{'/same-shape':>13}{'/fp32 fwd':>11}"
    )
    forward = times["fp32 forward"]
    for name, seconds in times.items():
        rate = flops / seconds / 1e9
        print(
            f"{name:<24}{seconds * 1e3:>9.2f}{rate:>10.1f}{rate / peak:>9.2f}{rate / shaped:>13.2f}"
            f"{seconds / forward:>11.2f}"
        )
    print(
        "targets: fp32 forward >= 0.70 x sgemm (>= 100 GFLOP/s); each gradient <= 1.5 x forward time"
    )
    _dataflows(rel, rng)


def _forced(flow: str, fn) -> float:
    def run() -> None:
        with use_dataflow(flow):
            mx.eval(fn())

    return median_s(run, repeats=5)


def _auto(fn) -> str:
    with record_dataflows() as runs:
        mx.eval(fn())
    return ",".join(flow for _, flow in runs) or "generic"


def _dataflows(rel, rng: np.random.Generator) -> None:
    """Every dataflow x dtype, as time / generic time in this run."""
    n = rel.n_in
    feats = rng.standard_normal((n, CHANNELS), dtype=np.float32)
    square = rng.standard_normal((27, CHANNELS, CHANNELS), dtype=np.float32) / 40
    head = rng.standard_normal((27, CHANNELS, 14), dtype=np.float32) / 40
    print("dataflows (forced; time ratio to generic in this run; 'auto' = what the rules pick):")
    print(f"{'case':<28}{'dtype':<10}{'dataflow':<17}{'ms':>9}{'/generic':>10}  auto")
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        f = mx.array(feats).astype(dtype)
        ones = mx.ones((n, CHANNELS), dtype=dtype)
        w_sq, w_head = mx.array(square).astype(dtype), mx.array(head).astype(dtype)
        mx.eval(f, ones, w_sq, w_head)
        cases = {
            "conv C64->C64": (
                lambda f=f, w=w_sq: ops.sparse_conv_features_from_relation(f, w, rel),
                ("generic", "sorted"),
            ),
            "conv C64->C14 head": (
                lambda f=f, w=w_head: ops.sparse_conv_features_from_relation(f, w, rel),
                ("generic", "padded_c16"),
            ),
            "denominator C64->C14": (
                lambda o=ones, w=w_head: _denominator(o, w * w, rel),
                ("generic", "denominator_csr"),
            ),
        }
        name_of = {mx.float32: "fp32", mx.float16: "fp16", mx.bfloat16: "bf16"}[dtype]
        for case, (fn, flows) in cases.items():
            auto = _auto(fn)
            times = {flow: _forced(flow, fn) for flow in flows}
            for flow, seconds in times.items():
                print(
                    f"{case:<28}{name_of:<10}{flow:<17}{seconds * 1e3:>9.2f}"
                    f"{seconds / times['generic']:>10.2f}  {auto if flow == flows[0] else ''}"
                )


def _denominator(ones: mx.array, squared: mx.array, rel) -> mx.array:
    den = ops.sparse_conv_normalization_denominator_from_relation(ones, squared, rel)
    return ops.sparse_conv_features_from_relation(ones, squared, rel) if den is None else den


if __name__ == "__main__":
    main()
