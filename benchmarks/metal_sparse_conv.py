"""Benchmark: the Metal sparse convolution against MLX's own kernels.

On an Apple GPU (the GPU stream) it times, on the built-in scan (C64, fp16,
3x3x3 submanifold), in one run:
* our sorted implicit-GEMM kernel (the ``"sorted"`` dataflow, forced),
* MLX's built-in gather-GEMM-scatter (``mx.gather_mm`` with sorted kernel
  indices, then a scatter-add), the baseline the kernel must beat,
* MLX's dense ``mx.matmul`` of the same FLOPs (edges x 64 @ 64 x 64),
and prints GFLOP/s and the ratios. Without a Metal device it runs the same
comparison on the CPU stream (our CPU kernels against MLX's CPU kernels), so
the script itself is checked everywhere; the Metal numbers need macOS.
"""

from __future__ import annotations

import platform

import mlx.core as mx
import numpy as np

from benchmarks.host_class import host_class_line
from benchmarks.timing import median_s
from mlx_lattice.core import build_kernel_relation, ops, use_dataflow
from mlx_lattice.data import synthetic_lidar_scan, voxelize_points

CHANNELS = 64


def main() -> None:
    print(host_class_line())
    on_gpu = mx.metal.is_available()
    device = mx.gpu if on_gpu else mx.cpu
    rel = build_kernel_relation(voxelize_points(synthetic_lidar_scan(seed=0).points, 0.05))
    n, edges = rel.n_in, rel.n_edges
    flops = 2 * edges * CHANNELS * CHANNELS
    rng = np.random.default_rng(0)
    feats = mx.array(rng.standard_normal((n, CHANNELS), dtype=np.float32)).astype(mx.float16)
    weight = mx.array(rng.standard_normal((27, CHANNELS, CHANNELS), dtype=np.float32) / 40).astype(
        mx.float16
    )
    # Edges in kernel order for gather_mm's sorted indices.
    order = rel.kernel_csr.edge_ids
    in_rows = rel.edges.in_rows[order]
    out_rows = rel.edges.out_rows[order]
    kernel_ids = rel.edges.kernel_ids[order]
    lhs = mx.ones((edges, CHANNELS), dtype=mx.float16 if on_gpu else mx.float32)

    with mx.stream(device):

        def ours() -> None:
            with use_dataflow("sorted"):
                mx.eval(ops.sparse_conv_features_from_relation(feats, weight, rel))

        # MLX's CPU gather_mm takes float32 only.
        base_feats = feats if on_gpu else feats.astype(mx.float32)
        base_weight = weight if on_gpu else weight.astype(mx.float32)

        def gather_mm() -> None:
            gathered = base_feats[in_rows][:, None, :]
            products = mx.gather_mm(
                gathered, base_weight, rhs_indices=kernel_ids, sorted_indices=True
            )
            out = (
                mx.zeros((n, CHANNELS), dtype=mx.float32)
                .at[out_rows]
                .add(products[:, 0, :].astype(mx.float32))
            )
            mx.eval(out)

        def dense() -> None:
            mx.eval(mx.matmul(lhs, weight[0].astype(lhs.dtype)))

        times = {
            "ours (sorted implicit GEMM)": median_s(ours, repeats=5),
            "mx.gather_mm + scatter": median_s(gather_mm, repeats=5),
            "mx.matmul, same FLOPs": median_s(dense, repeats=5),
        }

    where = (
        "Metal GPU"
        if on_gpu
        else "CPU stream (no Metal device here: the Metal kernels are not measured)"
    )
    print(f"machine: {platform.machine()} {platform.platform()}; {where}")
    print(f"scan: {n} voxels, {edges} edges; fp16, C{CHANNELS}, 3x3x3 submanifold")
    dense_rate = flops / times["mx.matmul, same FLOPs"] / 1e9
    for name, seconds in times.items():
        rate = flops / seconds / 1e9
        print(
            f"{name:30s} {seconds * 1e3:9.2f} ms {rate:9.1f} GFLOP/s  {rate / dense_rate:5.2f} x matmul"
        )
    print(
        f"ours / gather_mm: {times['mx.gather_mm + scatter'] / times['ours (sorted implicit GEMM)']:.2f}x faster"
    )


if __name__ == "__main__":
    main()
