"""A short tour of the three packages: versions and one real computation each.

Run with `./bazelw run //examples:tour`.
"""

from __future__ import annotations

import numpy as np


def main() -> None:
    import quantrules as qr

    rules = [
        qr.Rule(module_path="head"),
        qr.Rule(module_path="encoder/.*", op_names=("sparse_conv",), weight_qtype="int4",
                tile_size=32),
        qr.Rule(weight_qtype="int8"),
    ]
    print(f"quantrules {qr.__version__}")
    for path, op in [("encoder/block1/conv", "sparse_conv"), ("head", "dot_general"),
                     ("decoder/mlp", "einsum")]:
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

    import mlx.core as mx

    import mlx_lattice
    from mlx_lattice._native import ext

    print(f"mlx_lattice {mlx_lattice.__version__}")
    a = mx.array(np.arange(4, dtype=np.float32))
    out = ext.scaled_add(a, mx.ones(4), alpha=2.0, beta=0.5)
    print(f"  native primitive 2*[0,1,2,3] + 0.5 = {out.tolist()}")


if __name__ == "__main__":
    main()
