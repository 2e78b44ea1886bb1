"""Run by an installed environment's interpreter (tools/install_matrix.sh): the
three packages import from that environment at the release's version, a
sparse convolution matches MLX's dense `mx.conv_general` on the scattered
grid, and an int8 `taktiny_ops.linear` stays within its bound of `jnp.dot`.

    python install_check.py VERSION [SEED]

Needs only what the wheels install (NumPy, MLX, JAX): no pytest, no sources.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

# taktiny_ops' tests hold int8 weight quantization to this relative error
# (BOUNDS in packages/taktiny_ops/tests/test_ops.py).
INT8_BOUND = 0.02
GRID = 10


class CheckFailed(AssertionError):
    """An installed package computed a wrong answer."""


def check_imports(version: str) -> None:
    import mlx_lattice
    import quantrules
    import taktiny_ops

    prefix = pathlib.Path(sys.prefix).resolve()
    for module in (quantrules, taktiny_ops, mlx_lattice):
        path = pathlib.Path(module.__file__).resolve()
        if not path.is_relative_to(prefix):
            raise CheckFailed(f"{module.__name__} imported from {path}, not from {prefix}")
        if module.__version__ != version:
            raise CheckFailed(f"{module.__name__} {module.__version__}, expected {version}")
        print(f"{module.__name__} {module.__version__} from {path.parent}")


def check_sparse_conv(rng: np.random.Generator) -> float:
    """Submanifold 3x3x3 conv of ~500 random voxels against the dense conv."""
    import mlx.core as mx

    from mlx_lattice.core import build_kernel_relation, ops

    batches, c_in, c_out = 2, 8, 16
    rows = np.stack(
        [rng.integers(0, batches, 600)] + [rng.integers(0, GRID, 600) for _ in range(3)], axis=1
    )
    coords = np.unique(rows, axis=0).astype(np.int32)
    feats = mx.array(rng.standard_normal((len(coords), c_in)).astype(np.float32))
    weight = mx.array(rng.standard_normal((c_out, 3, 3, 3, c_in)).astype(np.float32) / 10)
    rel = build_kernel_relation(coords, kernel_size=3)
    out = ops.sparse_conv_features_from_relation(feats, weight, rel)

    flat = ((coords[:, 0] * GRID + coords[:, 1]) * GRID + coords[:, 2]) * GRID + coords[:, 3]
    grid = mx.zeros((batches * GRID**3, c_in)).at[mx.array(flat)].add(feats)
    dense = mx.conv_general(grid.reshape(batches, GRID, GRID, GRID, c_in), weight, padding=1)
    ref = dense[tuple(mx.array(coords[:, a]) for a in range(4))]
    out, ref = np.array(out), np.array(ref)
    if out.shape != ref.shape:
        raise CheckFailed(f"sparse conv: shape {out.shape}, dense {ref.shape}")
    err = float(np.abs(out - ref).max() / np.abs(ref).max())
    if not err < 1e-4:  # the conv tests' tolerance: float32 sums in another order
        raise CheckFailed(f"sparse conv differs from the dense conv: max rel. error {err:.2e}")
    print(f"sparse conv {len(coords)} voxels {c_in}->{c_out}: max rel. error vs dense {err:.1e}")
    return err


def check_int8_linear(rng: np.random.Generator) -> float:
    import jax
    import jax.numpy as jnp

    import taktiny_ops

    x = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 32)), jnp.float32)
    ref = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    y = taktiny_ops.linear(x, w, quant="int8")
    err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    if not 0 < err < INT8_BOUND:  # 0 would mean nothing was quantized
        raise CheckFailed(f"int8 linear: rel. error {err:.2e} vs jnp.dot, bound (0, {INT8_BOUND})")
    print(f"taktiny_ops.linear int8: rel. error vs jnp.dot {err:.2e} (bound {INT8_BOUND})")
    return err


def main(argv: list[str]) -> int:
    version = argv[1]
    seed = int(argv[2]) if len(argv) > 2 else 20261204
    print(f"Python {sys.version.split()[0]} at {sys.prefix}; seed {seed}")
    rng = np.random.default_rng(seed)
    try:
        check_imports(version)
        check_sparse_conv(rng)
        check_int8_linear(rng)
    except CheckFailed as e:
        print(f"FAIL (seed {seed}): {e}", file=sys.stderr)
        return 1
    print("install check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
