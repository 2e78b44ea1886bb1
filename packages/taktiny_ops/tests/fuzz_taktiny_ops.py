"""Fuzz targets of taktiny_ops' ops (Hypothesis), small shapes to bound JAX
compile time. Budget and replay: ``tools/fuzzing.py``.

Error bound used (elementwise, from absmax rounding): a quantized operand
``q`` of ``a`` with any tile or channel grouping satisfies
``|a - q| <= max|a| / (2 * qmax)`` (qmax 127 for int8, 7 for int4), so
``|x @ w - xq @ wq| <= sum_i (|x_i| + dx) * dw + dx * |w_i|`` plus float32
rounding of the float product.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import quantrules as qr
import taktiny_ops as tk


def _load_fuzzing():
    path = Path(__file__).parents[3] / "tools" / "fuzzing.py"
    spec = importlib.util.spec_from_file_location("quantlattice_fuzzing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fuzz = _load_fuzzing().fuzz

QMAX = {"int8": 127, "int4": 7}
QUANTS = {
    "none": None,
    "int8": "int8",
    "int4": "int4",
    "w8_tile4": qr.Rule(weight_qtype="int8", tile_size=4),
    "w8a8": qr.Rule(weight_qtype="int8", act_qtype="int8"),
    "w4a8": qr.Rule(weight_qtype="int4", act_qtype="int8"),
    "disabled": qr.Rule(),
    "bogus": "int9",
    "not_a_rule": 3,
}


def _bound(x: np.ndarray, w: np.ndarray, quant) -> np.ndarray:
    """The elementwise bound of |op(x, w) - x @ w| for ``quant``."""
    rule = None
    if isinstance(quant, str):
        rule = qr.weight_only(quant)
    elif isinstance(quant, qr.Rule):
        rule = quant
    dx = dw = 0.0
    if rule is not None and rule.weight_qtype:
        dw = np.abs(w).max(initial=0.0) / (2 * QMAX[rule.weight_qtype])
    if rule is not None and rule.act_qtype:
        dx = np.abs(x).max(initial=0.0) / (2 * QMAX[rule.act_qtype])
    ax, aw = np.abs(x), np.abs(w)
    quant_err = (ax + dx).sum(-1, keepdims=True) * dw + dx * aw.sum(0)
    float_err = 1e-5 * (ax @ aw) + 1e-6
    return quant_err * (1 + 1e-3) + float_err


@fuzz(
    40,
    op=st.sampled_from(["linear", "einsum", "dot_general"]),
    rows=st.integers(0, 3),
    inner=st.integers(1, 8),
    inner_w=st.integers(1, 8) | st.none(),
    out=st.integers(1, 4),
    quant=st.sampled_from(sorted(QUANTS)),
    dtype=st.sampled_from(["float32", "bfloat16", "int32"]),
    data_seed=st.integers(0, 2**32 - 1),
)
def test_contractions_within_bound_or_documented_error(op, rows, inner, inner_w, out, quant,
                                                       dtype, data_seed):
    """linear / einsum('bi,io->bo') / dot_general on random shapes (also
    mismatched contraction sizes and empty batches), dtypes and rules return
    the (rows, out) float result (einsum broadcasts a size-1 index) within the rounding bound above of the
    float64 reference, or raise TaktinyOpsError / a QuantRulesError /
    NotImplementedError (documented unsupported combinations)."""
    rng = np.random.default_rng(data_seed)
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    w = rng.standard_normal((inner_w or inner, out)).astype(np.float32)
    jx, jw = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    q = QUANTS[quant]
    try:
        if op == "linear":
            got = tk.linear(jx, jw, quant=q)
        elif op == "einsum":
            got = tk.einsum("bi,io->bo", jx, jw, quant=q)
        else:
            got = tk.dot_general(jx, jw, (((1,), (0,)), ((), ())), quant=q)
    except (tk.TaktinyOpsError, qr.QuantRulesError, NotImplementedError):
        return
    n = inner_w or inner
    if n != inner:
        # Only einsum accepts it: a size-1 index broadcasts, as in jnp.einsum.
        assert op == "einsum" and 1 in (n, inner), "a mismatched contraction was accepted"
        n = max(n, inner)
        x, w = np.broadcast_to(x, (rows, n)), np.broadcast_to(w, (n, out))
    assert got.shape == (rows, out)
    if dtype != "float32" or rows == 0:
        return  # the bound is for float32 inputs
    ref = x.astype(np.float64) @ w.astype(np.float64)
    err = np.abs(np.asarray(got, np.float64) - ref)
    bound = _bound(x.astype(np.float64), w.astype(np.float64), q)
    assert (err <= bound).all(), (err.max(), bound.min())
