"""Mixed-precision training: float32 weights (and optimizer state) with
float16 or bfloat16 features.

A float32 weight beside half-precision features is read rounded to the
features' dtype, so the forward and input-gradient passes equal the
convolution with the cast weight bit for bit; the weight gradient comes back
in float32 (the float32 accumulation before any rounding). A tiny MinkUNet
trained this way lowers the loss, its gradients stay within a stated bound
of the float32 model's (and as close as the all-float16 model's), and its
weights save and load bit for bit.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import mlx.nn as mlx_nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_lattice
from mlx_lattice.core import ops
from mlx_lattice.data import SceneConfig, labelled_scans, make_batch
from mlx_lattice.models import MinkUNet, cross_entropy, train_step

_spec = importlib.util.spec_from_file_location("refs", Path(__file__).with_name("relation_refs.py"))
relation_refs = importlib.util.module_from_spec(_spec)  # the shared tests/relation_refs.py
_spec.loader.exec_module(relation_refs)

HALF = (mx.float16, mx.bfloat16)


def _case(rng: np.random.Generator, cin: int, cout: int, kernel_size: int = 3):
    coords, rel = relation_refs.random_relation(rng, 600, kernel_size=kernel_size)
    f = rng.standard_normal((len(coords), cin)).astype(np.float32)
    w = (rng.standard_normal((kernel_size**3, cin, cout)) * 0.2).astype(np.float32)
    ct = rng.standard_normal((rel.n_out_capacity, cout)).astype(np.float32)
    return rel, f, w, ct


def _conv_vjp(f: mx.array, w: mx.array, ct: mx.array, rel) -> tuple[mx.array, ...]:
    def fn(f: mx.array, w: mx.array) -> mx.array:
        return ops.sparse_conv_features_from_relation(f, w, rel)

    (out,), (df, dw) = mx.vjp(fn, [f, w], [ct])
    mx.eval(out, df, dw)
    return out, df, dw


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16 if a.dtype in HALF else mx.uint32))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("cin", "cout"), [(16, 24), (7, 33), (2, 8)])
def test_float32_weight_with_half_features_equals_the_cast_weight(rng, seed, dtype, cin, cout):
    rel, f, w, ct = _case(rng, cin, cout)
    f16, ct16, w32 = mx.array(f).astype(dtype), mx.array(ct).astype(dtype), mx.array(w)
    out, df, dw = _conv_vjp(f16, w32, ct16, rel)
    ref_out, ref_df, ref_dw = _conv_vjp(f16, w32.astype(dtype), ct16, rel)
    assert out.dtype == dtype and df.dtype == dtype, (out.dtype, df.dtype)
    assert dw.dtype == mx.float32, f"seed {seed}: weight gradient {dw.dtype}"
    np.testing.assert_array_equal(_bits(out), _bits(ref_out), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(_bits(df), _bits(ref_df), err_msg=f"seed {seed}")
    # The cast path rounds the same float32 accumulation to the half dtype.
    np.testing.assert_array_equal(
        _bits(dw.astype(dtype)), _bits(ref_dw), err_msg=f"seed {seed}"
    )


def test_float32_weight_gradient_against_float64(rng, seed):
    """dW[k] = sum over edges of f[in]^T ct[out] on the half-valued inputs:
    within the float32 accumulation bound n * 2**-24 * sum|terms| (n the
    edges of the offset), far below one float16 rounding of the result."""
    rel, f, w, ct = _case(rng, 12, 20)
    f16, ct16 = mx.array(f).astype(mx.float16), mx.array(ct).astype(mx.float16)
    _, _, dw = _conv_vjp(f16, mx.array(w), ct16, rel)
    fv = np.array(f16.astype(mx.float32)).astype(np.float64)
    cv = np.array(ct16.astype(mx.float32)).astype(np.float64)
    in_rows, out_rows, k_ids = relation_refs.edges(rel)
    exact = np.zeros(w.shape)
    mag = np.zeros(w.shape)
    counts = np.bincount(k_ids, minlength=w.shape[0])
    for k in range(w.shape[0]):
        sel = k_ids == k
        a, g = fv[in_rows[sel]], cv[out_rows[sel]]
        exact[k] = a.T @ g
        mag[k] = np.abs(a).T @ np.abs(g)
    bound = (counts[:, None, None] + 1) * 2.0**-24 * mag + 1e-30
    err = np.abs(np.array(dw).astype(np.float64) - exact)
    assert (err <= bound).all(), f"seed {seed}: worst {np.max(err / bound):.3g} x bound"
    # Not the float16 gradient: the float32 result keeps bits a float16 one drops.
    assert not np.array_equal(np.array(dw), np.array(dw.astype(mx.float16).astype(mx.float32)))


def test_mixed_conv_compiles_and_is_thread_count_independent(rng, seed):
    rel, f, w, ct = _case(rng, 24, 16)
    f16, ct16, w32 = mx.array(f).astype(mx.float16), mx.array(ct).astype(mx.float16), mx.array(w)

    def grads(f: mx.array, w: mx.array) -> tuple[mx.array, mx.array]:
        def loss(f: mx.array, w: mx.array) -> mx.array:
            out = ops.sparse_conv_features_from_relation(f, w, rel)
            return (out.astype(mx.float32) * ct16.astype(mx.float32)).sum()

        return mx.grad(loss, argnums=(0, 1))(f, w)

    eager = grads(f16, w32)
    compiled = mx.compile(grads)(f16, w32)
    previous = mlx_lattice.get_num_threads()
    try:
        mlx_lattice.set_num_threads(1)
        single = grads(f16, w32)
        mx.eval(single)
    finally:
        mlx_lattice.set_num_threads(previous)
    for name, a, b, c in zip(("df", "dw"), eager, compiled, single, strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"seed {seed}: {name} compiled")
        np.testing.assert_array_equal(_bits(a), _bits(c), err_msg=f"seed {seed}: {name} 1 thread")


# ------------------------------------------------------------------ a tiny MinkUNet

SMALL = SceneConfig(beams=16, azimuth_steps=512)
VOXEL = 0.25
WIDTHS = (8, 16, 16)


@pytest.fixture(scope="module")
def scans():
    data = labelled_scans(3, 1, seed=0, config=SMALL)
    return [make_batch([s], VOXEL) for s in data.train], make_batch(data.validation, VOXEL)


def _half(batch, dtype=mx.float16):
    return batch.tensor.replace(batch.tensor.feats.astype(dtype))


def _model() -> MinkUNet:
    mx.random.seed(0)
    model = MinkUNet(2, 5, widths=WIDTHS)
    model.train()
    return model


@pytest.fixture(scope="module")
def mixed_trained(scans):
    """float32 weights and Adam state, float16 features, 40 steps."""
    train, _ = scans
    model = _model()
    opt = optim.Adam(learning_rate=1e-2)
    losses = [
        train_step(model, opt, _half(train[i % 3]), train[i % 3].labels) for i in range(40)
    ]
    return model, opt, losses


def test_mixed_precision_training_lowers_the_loss(mixed_trained):
    model, opt, losses = mixed_trained
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert np.isfinite(losses).all(), losses
    assert last < 0.6 * first, losses
    for name, p in tree_flatten(model.parameters()) + tree_flatten(opt.state):
        if isinstance(p, mx.array) and mx.issubdtype(p.dtype, mx.floating):
            assert p.dtype == mx.float32, (name, p.dtype)


def test_mixed_precision_gradients_match_float32(scans, seed):
    """Same weights, features in float16 vs float32. float16 rounds every
    activation to 2**-11 relative, and the batch norms' backward passes
    (differences of near-equal sums) amplify it with depth: on this seeded
    model and scan the worst parameter gradient is 8.8% (relative L2) from
    the float32 one, the head's 0.02%. Bounds: 15% everywhere, 0.2% for the
    head (one float16 rounding of its input away from the loss), and no
    parameter worse than in the all-float16 model (float16 weights too) by
    more than 10% of that model's error plus 0.1%: float32 master weights
    must not cost accuracy."""
    train, _ = scans
    batch = train[0]

    def grads(x, half_weights: bool = False) -> dict:
        model = _model()
        if half_weights:
            model.apply(lambda p: p.astype(mx.float16))

        def loss(m: mlx_nn.Module) -> mx.array:
            return cross_entropy(m(x).feats, batch.labels)

        _, g = mlx_nn.value_and_grad(model, loss)(model)
        mx.eval(g)
        return dict(tree_flatten(g))

    g32, mixed, pure = grads(batch.tensor), grads(_half(batch)), grads(_half(batch), True)
    assert g32.keys() == mixed.keys() == pure.keys()
    for name in g32:
        assert mixed[name].dtype == mx.float32, (name, mixed[name].dtype)
        a = np.array(g32[name]).astype(np.float64)
        norm = max(np.linalg.norm(a), 1e-12)
        err = np.linalg.norm(np.array(mixed[name]) - a) / norm
        pure_err = np.linalg.norm(np.array(pure[name].astype(mx.float32)) - a) / norm
        bound = 2e-3 if name.startswith("head.") else 0.15
        assert err < bound, f"seed {seed}: {name} relative error {err:.3g} (bound {bound})"
        assert err <= 1.1 * pure_err + 1e-3, f"seed {seed}: {name} {err:.3g} vs {pure_err:.3g}"


def test_mixed_precision_save_load_is_bit_exact(tmp_path, scans, mixed_trained):
    _, val = scans
    model, _, _ = mixed_trained
    model.eval()
    path = tmp_path / "mixed.safetensors"
    model.save_weights(str(path))
    fresh = MinkUNet(2, 5, widths=WIDTHS)
    fresh.load_weights(str(path))
    fresh.eval()
    for (name, a), (_, b) in zip(
        sorted(tree_flatten(model.parameters())), sorted(tree_flatten(fresh.parameters())),
        strict=True,
    ):
        assert a.dtype == b.dtype == mx.float32, name
        assert mx.array_equal(a, b).item(), name
    x = _half(val)
    out, again = model(x).feats, fresh(x).feats
    assert out.dtype == mx.float16
    assert np.array_equal(_bits(out), _bits(again))


# ------------------------------------------------------------ fused.add
#
# The references: NumPy's float16 add (IEEE, round to nearest even) and, for
# bfloat16, the exact float64 sum rounded to bfloat16 by its bits in NumPy.


def _add_operands(rng: np.random.Generator, shape: tuple, dtype: mx.Dtype) -> tuple:
    """Two arrays over magnitudes from subnormal to near overflow (either
    format), with exact cancellations, signed zeros and infinities."""
    top = 14 if dtype == mx.float16 else 120
    a = rng.standard_normal(shape) * 2.0 ** rng.integers(-26 if top == 14 else -130, top, shape)
    b = rng.standard_normal(shape) * 2.0 ** rng.integers(-26 if top == 14 else -130, top, shape)
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    flat_b[::5] = -flat_a[::5]  # exact zeros
    flat_a[1::7], flat_b[1::7] = -0.0, -0.0  # -0 + -0 = -0
    flat_a[2::11], flat_b[2::11] = -0.0, 0.0  # -0 + +0 = +0
    flat_a[3::13] = np.inf
    flat_a[4::17] = -np.inf
    flat_b[3::26] = -np.inf  # inf + -inf = NaN
    return a.astype(np.float32), b.astype(np.float32)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float64 -> bfloat16 bits, rounded to nearest even (finite non-NaN x;
    float64 -> float32 first is exact enough: both roundings are to nearest
    and float32 has more than 2 * 8 + 2 bits)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).astype(np.uint16)


def _add_reference(a: np.ndarray, b: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    """The bits of the correctly rounded sum of the operands as ``dtype``."""
    if dtype == mx.float16:
        return (a.astype(np.float16) + b.astype(np.float16)).view(np.uint16)
    if dtype == mx.bfloat16:
        a16 = np.array(mx.array(a).astype(mx.bfloat16).view(mx.uint16)).astype(np.uint32)
        b16 = np.array(mx.array(b).astype(mx.bfloat16).view(mx.uint16)).astype(np.uint32)
        fa = (a16 << 16).view(np.float32).astype(np.float64)
        fb = (b16 << 16).view(np.float32).astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            s = fa + fb
        bits = _bf16_bits(np.where(np.isfinite(s), s, 0.0))
        bits = np.where(np.isposinf(s), 0x7F80, bits)
        bits = np.where(np.isneginf(s), 0xFF80, bits)
        # Exact zeros: -0 only for -0 + -0 (round to nearest).
        zero = s == 0
        both_neg = np.signbit(fa) & np.signbit(fb)
        bits = np.where(zero, np.where(both_neg, 0x8000, 0x0000), bits)
        return np.where(np.isnan(s), 0x7FC0, bits).astype(np.uint16)
    return (a + b).view(np.uint32)


def _same_bits(got: mx.array, want: np.ndarray, what: str) -> None:
    bits = _bits(got)
    nan = np.isnan(np.array(got.astype(mx.float32)))
    ref_nan = (
        np.isnan(want.view(np.float16))
        if want.dtype == np.uint16 and got.dtype == mx.float16
        else want == 0x7FC0
        if got.dtype == mx.bfloat16
        else np.isnan(want.view(np.float32))
    )
    np.testing.assert_array_equal(nan, ref_nan, err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(bits[~nan], want[~nan], err_msg=what)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("shape", [(5000, 32), (300, 7), (1, 3), (17,), (3, 4, 5)])
def test_fused_add_is_the_correctly_rounded_sum(rng, seed, dtype, shape):
    """fused.add against NumPy's float16 add (bfloat16: the float64 sum
    rounded to bfloat16 in NumPy), bit for bit, signed zeros and infinities
    included (inf + -inf: NaN)."""
    from mlx_lattice import fused

    a, b = _add_operands(rng, shape, dtype)
    ma, mb = mx.array(a).astype(dtype), mx.array(b).astype(dtype)
    got = fused.add(ma, mb)
    assert got.dtype == dtype and got.shape == ma.shape
    ra = np.array(ma.astype(mx.float32))
    rb = np.array(mb.astype(mx.float32))
    want = _add_reference(ra, rb, dtype)
    if got.size > 100:  # the cases are present
        assert (want == 0x8000).any() or dtype == mx.float32, f"seed {seed}: no -0"
    _same_bits(got, want, f"seed {seed}: {dtype} {shape}")


@pytest.mark.parametrize("dtype", HALF)
def test_fused_add_gradients_compile_vmap_and_threads(rng, seed, dtype):
    """The cotangent passes to both operands; mx.compile, jvp and vmap give
    the eager bits; the result is the same for 1, 2, 3 and 7 threads; views
    (transposed, sliced) are read as their values."""
    from mlx_lattice import fused

    a, b = _add_operands(rng, (700, 24), dtype)
    a, b = np.nan_to_num(a, posinf=1.0, neginf=-1.0), np.nan_to_num(b, posinf=1.0, neginf=-1.0)
    ma, mb = mx.array(a).astype(dtype), mx.array(b).astype(dtype)
    g = mx.array(rng.standard_normal((700, 24)).astype(np.float32)).astype(dtype)
    eager = fused.add(ma, mb)
    _, (da, db) = mx.vjp(lambda x, y: [fused.add(x, y)], [ma, mb], [g])
    np.testing.assert_array_equal(_bits(da), _bits(g), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(_bits(db), _bits(g), err_msg=f"seed {seed}")
    # A loss through it: MLX's autodiff of the same loss with MLX's add.
    probe = mx.array(rng.standard_normal((700, 24)).astype(np.float32))

    def loss(add):
        return lambda x, y: (add(x, y).astype(mx.float32) * probe).sum()

    mine = mx.grad(loss(fused.add), argnums=(0, 1))(ma, mb)
    ref = mx.grad(loss(lambda x, y: x + y), argnums=(0, 1))(ma, mb)
    for m, r in zip(mine, ref, strict=True):
        np.testing.assert_array_equal(_bits(m), _bits(r), err_msg=f"seed {seed}")
    compiled = mx.compile(lambda x, y: fused.add(x, y))(ma, mb)
    np.testing.assert_array_equal(_bits(compiled), _bits(eager), err_msg=f"seed {seed}")
    # The tangent of a + b along (b, a) is b + a: the same bits (it commutes).
    _, (tangent,) = mx.jvp(lambda x, y: [fused.add(x, y)], [ma, mb], [mb, ma])
    np.testing.assert_array_equal(_bits(tangent), _bits(eager), err_msg=f"seed {seed}")
    rows = mx.vmap(fused.add)(ma, mb)
    np.testing.assert_array_equal(_bits(rows), _bits(eager), err_msg=f"seed {seed}")
    one = mx.vmap(fused.add, in_axes=(0, None))(ma, mb[0])
    want = _add_reference(
        np.array(ma.astype(mx.float32)), np.broadcast_to(np.array(mb[0].astype(mx.float32)), a.shape),
        dtype,
    )
    _same_bits(one, want, f"seed {seed}: vmap with an unmapped operand")
    views = fused.add(ma.T, mb.T)
    np.testing.assert_array_equal(_bits(views), _bits(eager).T, err_msg=f"seed {seed}")
    before = mlx_lattice.get_num_threads()
    big_a = mx.array(rng.standard_normal((3000, 64)).astype(np.float32)).astype(dtype)
    big_b = mx.array(rng.standard_normal((3000, 64)).astype(np.float32)).astype(dtype)
    results = []
    try:
        for threads in (1, 2, 3, 7):
            mlx_lattice.set_num_threads(threads)
            results.append(_bits(fused.add(big_a, big_b)))
    finally:
        mlx_lattice.set_num_threads(before)
    for other in results[1:]:
        np.testing.assert_array_equal(results[0], other, err_msg=f"seed {seed}")


def test_fused_add_rejects_bad_arguments():
    from mlx_lattice import fused

    x = mx.zeros((4, 3), dtype=mx.float16)
    with pytest.raises(ValueError, match="b must have a's shape"):
        fused.add(x, mx.zeros((3, 4), dtype=mx.float16))
    with pytest.raises(ValueError, match="b must have a's dtype"):
        fused.add(x, mx.zeros((4, 3)))
    with pytest.raises(ValueError, match="a must be float32, float16 or bfloat16"):
        fused.add(mx.zeros((4, 3), dtype=mx.int32), mx.zeros((4, 3), dtype=mx.int32))
    with pytest.raises(ValueError, match=r"b must be an mx\.array"):
        fused.add(x, np.zeros((4, 3), np.float16))
    empty = mx.zeros((0, 3), dtype=mx.float16)
    assert fused.add(empty, empty).shape == (0, 3)
    # The native builder checks on its own (the Python checks come first).
    from mlx_lattice._native import ext

    with pytest.raises(ValueError, match="feature_add: b must have a's shape"):
        ext.feature_add(x, mx.zeros((4, 4), dtype=mx.float16))
    with pytest.raises(ValueError, match="feature_add: b must have a's dtype"):
        ext.feature_add(x, mx.zeros((4, 3), dtype=mx.bfloat16))
    with pytest.raises(ValueError, match="feature_add: a must be float32"):
        ext.feature_add(mx.zeros((2,), dtype=mx.int32), mx.zeros((2,), dtype=mx.int32))


def test_skip_fork_leaves_gradients_bit_identical(scans, seed, monkeypatch):
    from mlx_lattice.models import minkunet

    train, _ = scans
    batch = train[1]

    def grads() -> dict:
        model = _model()

        def loss(m: mlx_nn.Module) -> mx.array:
            return cross_entropy(m(_half(batch)).feats, batch.labels)

        _, g = mlx_nn.value_and_grad(model, loss)(model)
        mx.eval(g)
        return dict(tree_flatten(g))

    forked = grads()
    monkeypatch.setattr(minkunet, "_skip", lambda x: (x, x))
    plain = grads()
    for name in plain:
        np.testing.assert_array_equal(
            _bits(forked[name]), _bits(plain[name]), err_msg=f"seed {seed}: {name}"
        )
