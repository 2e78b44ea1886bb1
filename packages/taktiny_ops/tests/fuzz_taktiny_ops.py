"""Fuzz targets of taktiny_ops' ops (Hypothesis), small shapes to bound JAX
compile time. Budget and replay: ``tools/fuzzing.py``.

Error bound used (elementwise, from absmax rounding): a quantized operand
``q`` of ``a`` with any tile or channel grouping satisfies
``|a - q| <= max|a| / (2 * qmax)`` (qmax 127 for int8, 7 for int4), so
``|x @ w - xq @ wq| <= sum_i (|x_i| + dx) * dw + dx * |w_i|`` plus float32
rounding of the float product.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from fuzzing import fuzz
from hypothesis import strategies as st
from numpy.lib.stride_tricks import sliding_window_view

import quantrules as qr
import taktiny_ops as tk

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
# The general contraction and convolution targets also run Qwix's training
# (QT) path and a rule for another op (nothing matches: the float result).
QUANTS_ALL = {
    **QUANTS,
    "qt_w8a8": qr.QtProvider([qr.Rule(weight_qtype="int8", act_qtype="int8")]),
    "qt_w8": qr.QtProvider([qr.Rule(weight_qtype="int8")]),
    "other_op": qr.PtqProvider([qr.Rule(op_names=("sparse_conv",), weight_qtype="int4")]),
}
# Hypothesis draws the first entries most often: the quantizing rules first.
QUANT_ORDER = ["int8", "w8a8", "qt_w8a8", "none", "qt_w8", "w4a8", "disabled", "other_op",
               "int4", "w8_tile4", "bogus", "not_a_rule"]


def _rule_of(quant, op: str) -> qr.Rule | None:
    """The rule ``quant`` selects for ``op`` (None: no quantization)."""
    try:
        res = qr.resolve(quant, op=op) if quant is not None else None
    except qr.QuantRulesError:
        return None
    return None if res is None or res.disabled else res.rule


def _multilinear_bound(product, x: np.ndarray, w: np.ndarray, rule: qr.Rule | None) -> np.ndarray:
    """The elementwise bound of |product(xq, wq) - product(x, w)| for a
    bilinear ``product`` (each output a sum of x_i * w_j terms): with
    |x - xq| <= dx and |w - wq| <= dw per element,
    |xq wq - x w| <= dx |w| + dw (|x| + dx); plus float32 rounding."""
    dx = dw = 0.0
    if rule is not None and rule.weight_qtype:
        dw = np.abs(w).max(initial=0.0) / (2 * QMAX[rule.weight_qtype])
    if rule is not None and rule.act_qtype:
        dx = np.abs(x).max(initial=0.0) / (2 * QMAX[rule.act_qtype])
    ax, aw = np.abs(x), np.abs(w)
    quant_err = product(ax, np.full_like(w, dw)) + product(np.full_like(x, dx), aw + dw)
    return quant_err * (1 + 1e-3) + 1e-5 * product(ax, aw) + 1e-6


def _rare(one_in: int) -> st.SearchStrategy[bool]:
    """True about once in ``one_in`` draws."""
    return st.integers(0, one_in - 1).map(lambda v: v == 0)


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
    bound = _multilinear_bound(np.matmul, x.astype(np.float64), w.astype(np.float64),
                               _rule_of(q, "dot_general"))  # every QUANTS rule matches any op
    assert (err <= bound).all(), (err.max(), bound.min())


@fuzz(
    150,
    op=st.sampled_from(["einsum", "dot_general"]),
    n_batch=st.integers(0, 2),
    n_contract=st.integers(0, 2),
    n_free_x=st.integers(0, 2),
    n_free_w=st.integers(0, 2),
    n_summed=st.integers(0, 1),
    ellipsis=st.booleans(),
    corrupt=_rare(6),
    quant=st.sampled_from(QUANT_ORDER),
    dtype=st.sampled_from(["float32", "float32", "bfloat16", "int32"]),
    data_seed=st.integers(0, 2**32 - 1),
)
def test_general_contractions_within_bound_or_documented_error(
        op, n_batch, n_contract, n_free_x, n_free_w, n_summed, ellipsis, corrupt, quant, dtype,
        data_seed):
    """einsum and dot_general on random two-operand contractions: batch
    indices (optionally as ``...``), several or no contracted indices, free
    indices on either side in any order, an index summed out of one operand
    alone (einsum), a transposed output; a mismatched size (corrupt) must
    raise TaktinyOpsError. Otherwise the result has NumPy's shape and is
    within the multilinear rounding bound of the float64 ``np.einsum``, or
    the call raises TaktinyOpsError / a QuantRulesError /
    NotImplementedError."""
    rng = np.random.default_rng(data_seed)
    letters = iter("abcdefghijkl")
    batch = [next(letters) for _ in range(n_batch)]
    contract = [next(letters) for _ in range(n_contract)]
    free_x = [next(letters) for _ in range(n_free_x)]
    free_w = [next(letters) for _ in range(n_free_w)]
    summed = [next(letters) for _ in range(n_summed)] if op == "einsum" else []
    size = {c: int(rng.integers(1, 4)) for c in batch + contract + free_x + free_w + summed}
    w_size = dict(size)
    if corrupt and batch + contract:
        bad = (batch + contract)[int(rng.integers(len(batch + contract)))]
        size[bad] = w_size[bad] = max(2, size[bad])
        w_size[bad] += 1
    corrupt = size != w_size

    def shuffled(seq):
        return [seq[i] for i in rng.permutation(len(seq))]

    x_axes = shuffled(batch + contract + free_x + summed)
    w_axes = shuffled(batch + contract + free_w)
    if op == "einsum":
        lead = batch if ellipsis and batch else []
        x_axes = lead + [c for c in x_axes if c not in lead]
        w_axes = lead + [c for c in w_axes if c not in lead]
        out_axes = lead + shuffled([c for c in batch if c not in lead] + free_x + free_w)
    else:
        lead = []
        out_axes = ([c for c in x_axes if c in batch] + [c for c in x_axes if c in free_x]
                    + [c for c in w_axes if c in free_w])
    x = rng.standard_normal([size[c] for c in x_axes]).astype(np.float32)
    w = rng.standard_normal([w_size[c] for c in w_axes]).astype(np.float32)

    def term(axes):
        return ("..." if lead else "") + "".join(axes[len(lead):])

    spec = f"{term(x_axes)},{term(w_axes)}->{term(out_axes)}"
    plain = f"{''.join(x_axes)},{''.join(w_axes)}->{''.join(out_axes)}"
    jx, jw = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    q = QUANTS_ALL[quant]
    try:
        if op == "einsum":
            got = tk.einsum(spec, jx, jw, quant=q)
        else:
            x_batch = [x_axes.index(c) for c in x_axes if c in batch]
            w_batch = [w_axes.index(x_axes[a]) for a in x_batch]
            x_con = [x_axes.index(c) for c in contract]
            w_con = [w_axes.index(c) for c in contract]
            got = tk.dot_general(jx, jw, ((x_con, w_con), (x_batch, w_batch)), quant=q)
    except (tk.TaktinyOpsError, qr.QuantRulesError, NotImplementedError):
        return
    assert not corrupt, f"{spec}: mismatched sizes {size} vs {w_size} were accepted"
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = np.einsum(plain, x64, w64)
    assert got.shape == ref.shape, (spec, got.shape, ref.shape)
    if dtype != "float32":
        return  # the bound is for float32 inputs
    rule = _rule_of(q, op)
    bound = _multilinear_bound(lambda a, b: np.einsum(plain, a, b), x64, w64, rule)
    err = np.abs(np.asarray(got, np.float64) - ref)
    assert (err <= bound).all(), (spec, float(err.max()), float((bound - err).min()))


def _same_pads(size: int, kernel: int, stride: int, lower: bool) -> tuple[int, int]:
    """SAME / SAME_LOWER padding as the XLA convention defines it."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    small, large = total // 2, total - total // 2
    return (large, small) if lower else (small, large)


def _dilate(a: np.ndarray, dilation: tuple[int, ...]) -> np.ndarray:
    """Insert dilation - 1 zeros between the elements of each spatial axis (2...)."""
    for axis, d in enumerate(dilation, start=2):
        if d > 1 and a.shape[axis] > 0:
            shape = list(a.shape)
            shape[axis] = (a.shape[axis] - 1) * d + 1
            out = np.zeros(shape, a.dtype)
            index = [slice(None)] * a.ndim
            index[axis] = slice(None, None, d)
            out[tuple(index)] = a
            a = out
    return a


def _conv_reference(x, k, strides, pads, lhs_dilation, rhs_dilation, groups):
    """Grouped, dilated, padded cross-correlation in float64 NumPy: x is
    (N, C, *spatial), k is (O, C // groups, *kernel); result (N, O, *out)."""
    nsp = x.ndim - 2
    x, k = _dilate(x, lhs_dilation), _dilate(k, rhs_dilation)
    x = np.pad(x, [(0, 0), (0, 0), *((max(lo, 0), max(hi, 0)) for lo, hi in pads)])
    x = x[(slice(None), slice(None), *(
        slice(max(-lo, 0), x.shape[2 + i] - max(-hi, 0)) for i, (lo, hi) in enumerate(pads)))]
    out_sp = [max((x.shape[2 + i] - k.shape[2 + i]) // strides[i] + 1, 0) if
              x.shape[2 + i] >= k.shape[2 + i] else 0 for i in range(nsp)]
    n, o = x.shape[0], k.shape[0]
    if 0 in out_sp or n == 0:
        return np.zeros([n, o, *out_sp])
    win = sliding_window_view(x, k.shape[2:], axis=tuple(range(2, 2 + nsp)))
    win = win[(slice(None), slice(None), *(slice(None, s * (m - 1) + 1, s)
                                           for s, m in zip(strides, out_sp, strict=True)))]
    win = win.reshape(n, groups, x.shape[1] // groups, *win.shape[2:])
    k = k.reshape(groups, o // groups, *k.shape[1:])
    sp, kl = "pq"[:nsp], "uv"[:nsp]
    out = np.einsum(f"ngi{sp}{kl},goi{kl}->ngo{sp}", win, k)
    return out.reshape(n, o, *out_sp)


@fuzz(
    150,
    nsp=st.integers(1, 2),
    lhs_last=st.booleans(),
    rhs_last=st.booleans(),
    out_last=st.booleans(),
    default_layout=st.booleans(),
    batch=st.integers(0, 2),
    groups=st.integers(1, 2),
    cin=st.integers(1, 3),
    cout=st.integers(1, 2),
    size=st.lists(st.integers(1, 6), min_size=2, max_size=2),
    kernel=st.lists(st.integers(1, 3), min_size=2, max_size=2),
    strides=st.lists(st.integers(1, 2), min_size=2, max_size=2),
    lhs_dilation=st.lists(st.sampled_from([1, 1, 1, 2]), min_size=2, max_size=2),
    rhs_dilation=st.lists(st.integers(1, 2), min_size=2, max_size=2),
    padding=st.sampled_from(["VALID", "SAME", "SAME_LOWER", "pairs", "pairs"]),
    pairs=st.lists(st.integers(-1, 2), min_size=4, max_size=4),
    damage=st.sampled_from([None] * 12 + ["channels", "groups", "stride", "dilation",
                                         "padding", "layout", "rank", "batch_groups"]),
    quant=st.sampled_from(QUANT_ORDER),
    dtype=st.sampled_from(["float32", "float32", "bfloat16", "int32"]),
    data_seed=st.integers(0, 2**32 - 1),
)
def test_conv_within_bound_or_documented_error(nsp, lhs_last, rhs_last, out_last,
                                               default_layout, batch, groups, cin, cout, size,
                                               kernel, strides, lhs_dilation, rhs_dilation,
                                               padding, pairs, damage, quant, dtype, data_seed):
    """conv_general_dilated on 1-D and 2-D inputs with random layouts
    (channels first or last per operand), feature groups, strides, lhs
    (transposed) and rhs (atrous) dilation, string or explicit (also
    negative) padding, empty batches, dtypes and rules. A damaged argument
    (channel count, group count, stride 0, dilation 0, unknown padding,
    repeated layout letter, rank, batch groups with feature groups) must
    raise TaktinyOpsError naming it. Otherwise the result has the float64
    NumPy reference's shape (in the output layout) and is within its
    multilinear rounding bound, or the call raises TaktinyOpsError / a
    QuantRulesError / NotImplementedError."""
    rng = np.random.default_rng(data_seed)
    spatial = "HW"[2 - nsp:]
    size, kernel = size[:nsp], kernel[:nsp]
    strides, lhs_dilation, rhs_dilation = strides[:nsp], lhs_dilation[:nsp], rhs_dilation[:nsp]
    specs = ("N" + spatial + "C" if lhs_last and not default_layout else "NC" + spatial,
             spatial + "IO" if rhs_last and not default_layout else "OI" + spatial,
             "N" + spatial + "C" if out_last and not default_layout else "NC" + spatial)
    dn = None if default_layout else specs
    x = rng.standard_normal([batch, cin * groups, *size]).astype(np.float32)
    k = rng.standard_normal([cout * groups, cin, *kernel]).astype(np.float32)
    pad_arg = padding if padding != "pairs" else [tuple(pairs[2 * i:2 * i + 2]) for i in range(nsp)]
    kwargs = dict(lhs_dilation=tuple(lhs_dilation), rhs_dilation=tuple(rhs_dilation),
                  feature_group_count=groups)
    stride_arg = tuple(strides)
    if damage == "channels":
        k = rng.standard_normal([cout * groups, cin + 1, *kernel]).astype(np.float32)
    elif damage == "groups":
        kwargs["feature_group_count"] = [0, -1, cin * groups + 1][int(rng.integers(3))]
    elif damage == "stride":
        stride_arg = (0, *stride_arg[1:])
    elif damage == "dilation":
        kwargs["rhs_dilation" if rng.integers(2) else "lhs_dilation"] = (0,) * nsp
    elif damage == "padding":
        pad_arg = "FULL"
    elif damage == "layout":
        dn = ("N" + "C" * (nsp + 1), specs[1], specs[2])
    elif damage == "rank":
        x = x[..., 0]
    elif damage == "batch_groups":
        kwargs["batch_group_count"] = 2
        kwargs["feature_group_count"] = 2
    if damage == "groups" and kwargs["feature_group_count"] == 1:
        damage = None

    def to_layout(a, spec, canonical):
        return np.transpose(a, [canonical.index(c) for c in spec])

    canon = ("NC" + spatial, "OI" + spatial, "NC" + spatial)
    x_in = to_layout(x, specs[0], canon[0]) if dn is not None and damage != "rank" else x
    k_in = to_layout(k, specs[1], canon[1]) if dn is not None else k
    q = QUANTS_ALL[quant]
    try:
        got = tk.conv_general_dilated(jnp.asarray(x_in, dtype), jnp.asarray(k_in, dtype),
                                      stride_arg, pad_arg, dimension_numbers=dn, quant=q,
                                      **kwargs)
    except (tk.TaktinyOpsError, qr.QuantRulesError, NotImplementedError):
        return
    assert damage is None, f"damaged argument ({damage}) was accepted"
    if padding == "pairs":
        pads = pad_arg
    elif padding == "VALID":
        pads = [(0, 0)] * nsp
    else:
        eff = [(kk - 1) * d + 1 for kk, d in zip(kernel, rhs_dilation, strict=True)]
        pads = [_same_pads(n, e, s, padding == "SAME_LOWER")
                for n, e, s in zip(size, eff, strides, strict=True)]

    def conv(a, b):
        return _conv_reference(a, b, strides, pads, lhs_dilation, rhs_dilation, groups)

    x64, k64 = x.astype(np.float64), k.astype(np.float64)
    ref = conv(x64, k64)
    got = np.asarray(got, np.float64)
    if dn is not None:
        got = np.transpose(got, [specs[2].index(c) for c in canon[2]])
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if dtype != "float32":
        return  # the bound is for float32 inputs
    rule = _rule_of(q, "conv_general_dilated")
    bound = _multilinear_bound(conv, x64, k64, rule)
    err = np.abs(got - ref)
    assert (err <= bound).all(), (float(err.max()), float((bound - err).min()))
