"""quantrules, taktiny_ops and mlx_lattice imported through quantlattice's targets."""

import mlx.core as mx
import numpy as np

import mlx_lattice
import quantrules as qr
import taktiny_ops as tk
from mlx_lattice.core import build_kernel_relation, ops

rules = [qr.Rule(module_path="head"), qr.Rule(weight_qtype="int8")]
resolution = qr.resolve(rules, module_path="encoder/0", op="dot_general")
assert resolution.index == 1, resolution

x = np.linspace(-1.0, 1.0, 4 * 16, dtype=np.float32).reshape(4, 16)
w = np.linspace(-0.5, 0.5, 16 * 8, dtype=np.float32).reshape(16, 8)
y = np.asarray(tk.linear(x, w, quant="int8"))
error = np.abs(y - x @ w).max() / np.abs(x @ w).max()
assert y.shape == (4, 8) and 0 < error < 0.05, error

coords = mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32)
relation = build_kernel_relation(coords)
out = ops.sparse_conv_features_from_relation(mx.ones((2, 1)), mx.ones((27, 1, 1)), relation)
assert out.tolist() == [[2.0], [2.0]], out

print(
    "quantrules",
    qr.__version__,
    "taktiny_ops",
    tk.__version__,
    "mlx_lattice",
    mlx_lattice.__version__,
)
