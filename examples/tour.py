"""A short tour of the three packages: versions and one real computation each.

Run with `./bazelw run //examples:tour`.
"""

from __future__ import annotations

import numpy as np


def main() -> None:
    import quantrules as qr

    rules = [
        qr.Rule(module_path="head"),
        qr.Rule(
            module_path="encoder/.*", op_names=("sparse_conv",), weight_qtype="int4", tile_size=32
        ),
        qr.Rule(weight_qtype="int8"),
    ]
    print(f"quantrules {qr.__version__}")
    for path, op in [
        ("encoder/block1/conv", "sparse_conv"),
        ("head", "dot_general"),
        ("decoder/mlp", "einsum"),
    ]:
        print(f"  {path:22s} {op:12s} -> {qr.explain(rules, module_path=path, op=op).summary}")

    import jax.numpy as jnp

    import taktiny_ops

    print(f"taktiny_ops {taktiny_ops.__version__}")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 32)), jnp.float32)
    ref = x @ w
    for path in ("decoder/mlp", "head"):
        y = taktiny_ops.linear(x, w, quant=rules, module_path=path)
        err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
        print(f"  linear at {path:12s} rel. error vs float = {err:.2e}")

    import time

    import mlx.core as mx

    import mlx_lattice
    from mlx_lattice.core import QuantizedWeight, build_kernel_relation, ops
    from mlx_lattice.data import synthetic_lidar_scan, voxelize_points

    print(f"mlx_lattice {mlx_lattice.__version__}")
    coords = voxelize_points(synthetic_lidar_scan(seed=0).points, 0.05)
    start = time.perf_counter()
    rel = build_kernel_relation(coords, kernel_size=3)
    built = time.perf_counter() - start
    print(f"  LiDAR scan: {rel.n_in} voxels, {rel.n_edges} edges, relation in {built * 1e3:.1f} ms")
    feats = mx.array(rng.standard_normal((rel.n_in, 32)).astype(np.float32))
    weight = mx.array(rng.standard_normal((27, 32, 32)).astype(np.float32) / 30)
    dense = ops.sparse_conv_features_from_relation(feats, weight, rel)
    bits = qr.get_qtype(
        qr.resolve(rules, module_path="encoder/block1/conv", op="sparse_conv").rule.weight_qtype
    ).bits
    quantized = QuantizedWeight.from_float(weight, bits=bits, group_size=32)
    approx = ops.sparse_quantized_conv_features_from_relation(feats, quantized, rel)
    err = float(mx.linalg.norm(approx - dense) / mx.linalg.norm(dense))
    print(
        f"  submanifold conv 32->32, int{bits} weights (rule of encoder/block1/conv): "
        f"rel. error vs float = {err:.2e}"
    )


if __name__ == "__main__":
    main()
