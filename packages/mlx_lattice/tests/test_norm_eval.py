"""The native eval-mode batch norm (``ext.batch_norm_eval``, used by
``mlx_lattice.fused.batch_norm_eval`` and by ``nn.BatchNorm`` in eval mode)
against independent references: ``mlx.nn.BatchNorm`` in eval mode (+ ReLU)
as MLX float32 ops on the same inputs, within a bound derived from the
formats' unit roundoff; a NumPy float32 emulation of the documented
expression, bit for bit, under the default and the scalar path and for
thread counts 1-3; MLX autodiff of the unfused float32 form for ``vjp`` and
``jvp``; edge sizes and bad arguments.

Every random input comes from the per-test ``rng`` (its seed is printed on
failure and replayed with ``TEST_SEED``).
"""

import mlx.core as mx
import mlx.nn as mnn
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice import MlxLatticeError, fused, nn
from mlx_lattice._native import ext

EPS = 1e-5
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# Unit roundoff of the result's format (float32 results are not rounded again)
# and half the format's smallest subnormal (the absolute error of rounding
# near zero).
UNIT = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}
TINY = {"float32": 0.0, "float16": 2.0**-25, "bfloat16": 2.0**-134}
# Channel counts around the 8-wide vector loop and its tail; row counts
# around the 256-row blocks the work is split into.
CHANNELS = [1, 7, 8, 9, 16, 17, 33, 128]
ROWS = [1, 255, 256, 257, 700]


def _inputs(rng, n, c):
    """float32 NumPy x, mean, var, weight, bias (x far from zero)."""
    centre = rng.uniform(-40, 40, c)
    x = rng.standard_normal((n, c)) * rng.uniform(0.5, 3.0, c) + centre
    mean = centre + rng.standard_normal(c) * 0.1
    var = rng.uniform(0.25, 9.0, c)
    w = rng.uniform(0.5, 1.5, c) * rng.choice([-1.0, 1.0], c)
    b = rng.standard_normal(c)
    return [a.astype(np.float32) for a in (x, mean, var, w, b)]


def _mlx_reference(x32, mean, var, w, b, relu):
    """mlx.nn.BatchNorm in eval mode on float32 features, then the ReLU."""
    norm = mnn.BatchNorm(int(x32.shape[1]), eps=EPS)
    norm.update({"weight": w, "bias": b, "running_mean": mean, "running_var": var})
    norm.eval()
    y = norm(x32)
    return mx.maximum(y, 0) if relu else y


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("c", CHANNELS)
def test_matches_mlx_batch_norm_within_the_format_bound(rng, seed, c, n, dtype, relu):
    """|y - ref| <= u |ref| + 2 e32 + tiny: y is the float32 value of
    (x - mean) * scale + bias rounded once to the format (u |y32|, plus half a
    subnormal near zero); y32 and MLX's ((x - mean) * rsqrt) * weight + bias
    each stay within 4 float32 roundings of the exact value, so they differ by
    at most e32 = 8 * 2^-24 (|x - mean| |scale| + |bias|) (a factor 2 for
    the second-order terms). The ReLU is 1-Lipschitz and keeps the bound."""
    x, mean, var, w, b = _inputs(rng, n, c)
    xd = mx.array(x).astype(DTYPES[dtype])
    m, v, wa, ba = (mx.array(a) for a in (mean, var, w, b))
    y = ext.batch_norm_eval(xd, m, v, wa, ba, eps=EPS, relu=relu)
    assert y.dtype == DTYPES[dtype] and y.shape == (n, c)
    x32 = xd.astype(mx.float32)
    ref = np.array(_mlx_reference(x32, m, v, wa, ba, relu)).astype(np.float64)
    xv = np.array(x32).astype(np.float64)
    scale = np.abs(w.astype(np.float64)) / np.sqrt(var.astype(np.float64) + EPS)
    e32 = 8 * 2.0**-24 * (np.abs(xv - mean) * scale + np.abs(b))
    bound = UNIT[dtype] * np.abs(ref) + 2 * e32 + TINY[dtype]
    err = np.abs(np.array(y.astype(mx.float32)).astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (
        f"seed={seed} c={c} n={n} {dtype} relu={relu}: |y - ref| = {err[worst]} > bound "
        f"{bound[worst]} at {worst}"
    )


def _emulate(x, mean, var, w, b, dtype, relu):
    """The documented expression in NumPy float32 (each operation rounded),
    scale formed as the builder forms it (MLX's rsqrt: both sides share it),
    the result rounded to `dtype` by MLX's cast."""
    scale = np.array(mx.array(w) * mx.rsqrt(mx.array(var) + EPS))
    x32 = np.array(mx.array(x).astype(dtype).astype(mx.float32))
    y = (x32 - mean) * scale + b
    if relu:
        y = np.maximum(y, np.float32(0))
    return np.array(mx.array(y).astype(dtype).astype(mx.float32))


def _assert_bits(got, want, context):
    assert got.dtype == np.float32 and got.shape == want.shape, context
    mismatch = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert mismatch.size == 0, (
        f"{context}: y differs at {mismatch.size} of {got.size} elements, first flat index "
        f"{mismatch[0]}: {got.ravel()[mismatch[0]]!r} vs {want.ravel()[mismatch[0]]!r}"
    )


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("c", CHANNELS)
def test_default_path_matches_emulation_for_every_thread_count(rng, seed, c, dtype, relu):
    x, mean, var, w, b = _inputs(rng, 700, c)
    want = _emulate(x, mean, var, w, b, DTYPES[dtype], relu)
    xd = mx.array(x).astype(DTYPES[dtype])
    args = [mx.array(a) for a in (mean, var, w, b)]
    before = mlx_lattice.get_num_threads()
    try:
        for threads in (1, 2, 3):
            mlx_lattice.set_num_threads(threads)
            y = ext.batch_norm_eval(xd, *args, eps=EPS, relu=relu)
            got = np.array(y.astype(mx.float32))
            _assert_bits(got, want, f"seed={seed} c={c} {dtype} relu={relu} threads={threads}")
    finally:
        mlx_lattice.set_num_threads(before)


_SCALAR_SCRIPT = """
import sys
import mlx.core as mx
import numpy as np
import mlx_lattice
from mlx_lattice._native import ext

cases = np.load(sys.argv[1])
out = {}
for key in sorted({k.rsplit("/", 1)[0] for k in cases.files}):
    _, dtype, relu = key.split(":")
    x, mean, var, w, b = (cases[key + "/" + s] for s in ("x", "mean", "var", "w", "b"))
    xd = mx.array(x).astype(getattr(mx, dtype))
    for threads in (1, 2, 3):
        mlx_lattice.set_num_threads(threads)
        y = ext.batch_norm_eval(xd, *(mx.array(a) for a in (mean, var, w, b)), eps=1e-5,
                                relu=relu == "1")
        out[f"{key}/{threads}"] = np.array(y.astype(mx.float32))
np.savez(sys.argv[2], **out)
"""


def test_scalar_path_matches_emulation(rng, seed, tmp_path, isa_child):
    """MLX_LATTICE_GEMM_ISA=scalar forces the portable loops (the only ones on
    other CPUs and on aarch64): the same bits as the emulation."""
    cases, wants = {}, {}
    for c in CHANNELS:
        for dtype in DTYPES:
            for relu in (False, True):
                key = f"{c}:{dtype}:{int(relu)}"
                x, mean, var, w, b = _inputs(rng, 300, c)
                for name, a in zip(
                    ("x", "mean", "var", "w", "b"), (x, mean, var, w, b), strict=True
                ):
                    cases[f"{key}/{name}"] = a
                wants[key] = _emulate(x, mean, var, w, b, DTYPES[dtype], relu)
    np.savez(tmp_path / "cases.npz", **cases)
    isa_child(_SCALAR_SCRIPT, "scalar", tmp_path / "cases.npz", tmp_path / "out.npz")
    got = np.load(tmp_path / "out.npz")
    for key, want in wants.items():
        for threads in (1, 2, 3):
            _assert_bits(got[f"{key}/{threads}"], want, f"seed={seed} scalar {key} t={threads}")


@pytest.mark.parametrize("relu", [False, True])
def test_vjp_and_jvp_match_mlx_autodiff_of_the_unfused_form(rng, seed, relu):
    x, mean, var, w, b = (mx.array(a) for a in _inputs(rng, 300, 17))
    primals = [x, mean, var, w, b]
    native = lambda *p: ext.batch_norm_eval(*p, eps=EPS, relu=relu)  # noqa: E731
    unfused = lambda x, m, v, w, b: _mlx_reference(x, m, v, w, b, relu)  # noqa: E731
    g = mx.array(rng.standard_normal((300, 17)).astype(np.float32))
    _, got = mx.vjp(native, primals, [g])
    _, want = mx.vjp(unfused, primals, [g])
    for name, a, e in zip(("x", "mean", "var", "weight", "bias"), got, want, strict=True):
        scale = float(mx.abs(e).max()) + 1.0
        # float32 sums over 300 rows in two different orders.
        np.testing.assert_allclose(
            np.array(a), np.array(e), rtol=0, atol=1e-5 * scale, err_msg=f"seed={seed} d{name}"
        )
    tangents = [mx.array(rng.standard_normal(p.shape).astype(np.float32)) for p in primals]
    _, (jn,) = mx.jvp(native, primals, tangents)
    _, (ju,) = mx.jvp(unfused, primals, tangents)
    np.testing.assert_allclose(
        np.array(jn),
        np.array(ju),
        rtol=0,
        atol=1e-5 * (float(mx.abs(ju).max()) + 1.0),
        err_msg=f"seed={seed} jvp",
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_gradient_keeps_the_dtype(rng, dtype):
    x, mean, var, w, b = (mx.array(a) for a in _inputs(rng, 40, 9))
    xh = x.astype(DTYPES[dtype])
    dx = mx.grad(
        lambda x: (
            ext.batch_norm_eval(x, mean, var, w, b, eps=EPS, relu=True).astype(mx.float32).sum()
        )
    )(xh)
    assert dx.dtype == DTYPES[dtype]
    y = ext.batch_norm_eval(xh, mean, var, w, b, eps=EPS, relu=True)
    want = mx.where(y.astype(mx.float32) > 0, w * mx.rsqrt(var + EPS), 0)
    np.testing.assert_array_equal(
        np.array(dx.astype(mx.float32)), np.array(want.astype(xh.dtype).astype(mx.float32))
    )


def test_optional_affine_compile_and_empty(rng):
    x, mean, var, w, b = (mx.array(a) for a in _inputs(rng, 50, 8))
    norm = mnn.BatchNorm(8, eps=EPS, affine=False)
    norm.update({"running_mean": mean, "running_var": var})
    norm.eval()
    got = ext.batch_norm_eval(x, mean, var, None, None, eps=EPS, relu=False)
    np.testing.assert_allclose(np.array(got), np.array(norm(x)), rtol=1e-6, atol=1e-6)
    f = lambda x: ext.batch_norm_eval(x, mean, var, w, b, eps=EPS, relu=True)  # noqa: E731
    assert mx.array_equal(mx.compile(f)(x), f(x))
    # Broadcast (stride-0) statistics and a missing bias read as full rows.
    level = mx.broadcast_to(mx.array(2.0), (8,))
    got = ext.batch_norm_eval(x, level, level, w, None, eps=EPS, relu=False)
    # The documented float32 expression (a zero bias adds nothing).
    want = (x - 2.0) * (w * mx.rsqrt(mx.array(2.0) + EPS))
    assert mx.array_equal(got, want)
    for shape in ((0, 8),):
        assert (
            ext.batch_norm_eval(mx.zeros(shape), mean, var, w, b, eps=EPS, relu=True).shape == shape
        )
    empty = mx.zeros((5, 0), mx.float16)
    z = mx.zeros((0,))
    assert ext.batch_norm_eval(empty, z, z, z, z, eps=EPS, relu=False).shape == (5, 0)


def test_bad_arguments_raise_naming_them():
    x = mx.zeros((4, 3))
    c = mx.ones((3,))
    cases = [
        ((mx.zeros((4,)), c, c, c, c), 1e-5, r"x must be \(N, C\)"),
        ((mx.zeros((2, 4, 3)), c, c, c, c), 1e-5, r"x must be \(N, C\)"),
        ((mx.zeros((4, 3), mx.int32), c, c, c, c), 1e-5, "x must be float32"),
        ((x, mx.ones((4,)), c, c, c), 1e-5, r"mean must be \(3,\)"),
        ((x, c, mx.ones((3, 1)), c, c), 1e-5, r"var must be \(3,\)"),
        ((x, c, mx.ones((3,), mx.int32), c, c), 1e-5, "var must be float32"),
        ((x, c, c, mx.ones((2,)), c), 1e-5, r"weight must be \(3,\)"),
        ((x, c, c, c, mx.ones((5,))), 1e-5, r"bias must be \(3,\)"),
        ((x, c, c, c, c), -1.0, "eps must be finite"),
        ((x, c, c, c, c), float("nan"), "eps must be finite"),
    ]
    for args, eps, message in cases:
        with pytest.raises(MlxLatticeError, match="batch_norm_eval: " + message):
            ext.batch_norm_eval(*args, eps=eps, relu=False)
    with pytest.raises(MlxLatticeError, match=r"BatchNormEval \(batch_norm_eval\): vmap"):
        mx.vmap(lambda x: ext.batch_norm_eval(x, c, c, c, c, eps=1e-5, relu=False))(
            mx.zeros((2, 4, 3))
        )


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_batch_norm_layer_in_eval_mode_runs_native_and_keeps_statistics(rng, seed, dtype):
    x, mean, var, w, b = (mx.array(a) for a in _inputs(rng, 300, 16))
    layer = nn.BatchNorm(16, eps=EPS)
    layer.update({"weight": w, "bias": b, "running_mean": mean, "running_var": var})
    layer.eval()
    feats = x.astype(DTYPES[dtype])
    got = nn.batch_norm_features(layer, feats, relu=True)
    assert got.dtype == feats.dtype
    want = ext.batch_norm_eval(feats, mean, var, w, b, eps=EPS, relu=True)
    assert mx.array_equal(got, want), f"seed={seed}"
    assert mx.array_equal(layer.running_mean, mean) and mx.array_equal(layer.running_var, var)
    # Without running statistics eval mode normalizes by the batch (mlx.nn's path).
    plain = nn.BatchNorm(16, eps=EPS, track_running_stats=False)
    plain.eval()
    ref = mnn.BatchNorm(16, eps=EPS, track_running_stats=False)
    ref.eval()
    np.testing.assert_allclose(
        np.array(nn.batch_norm_features(plain, x)), np.array(ref(x)), rtol=1e-5, atol=1e-5
    )


def test_fallback_without_native_kernels_matches_native(rng, seed, monkeypatch):
    """Devices without the native kernels run the expression as MLX ops."""
    x, mean, var, w, b = (mx.array(a) for a in _inputs(rng, 100, 12))
    native = fused.batch_norm_eval(x, mean, var, w, b, eps=EPS, relu=True)
    monkeypatch.setattr(fused, "native_norms", lambda: False)
    other = fused.batch_norm_eval(x, mean, var, w, b, eps=EPS, relu=True)
    np.testing.assert_allclose(
        np.array(other), np.array(native), rtol=0, atol=1e-5, err_msg=f"seed={seed}"
    )
