"""Every path of the native training batch norm (``ext.batch_norm_train``
forward and its vjp) against a NumPy emulation of the documented order,
bit for bit: per-channel float64 sums of each 256-row block in row order,
the blocks added in order, two-pass statistics, float32 elementwise maps
rounded per operation, half-precision results rounded from float32.

The in-process run takes this CPU's best path (AVX2 on x86-64 CPUs that
have it); a child process forced to the scalar loops by
``MLX_LATTICE_GEMM_ISA=scalar`` must give the same bits. Channel counts
cover the vector widths and their tails, row counts are not multiples of the
block, and thread counts 1-3 must not change any bit.

Half-precision rows (float16, bfloat16) are read and written in their own
format by the vector loops: under every ISA ceiling their results must be the
float32 path's on the widened inputs, rounded, bit for bit.

Every random input comes from the per-test ``rng`` (its seed is printed on
failure and replayed with ``TEST_SEED``).
"""


import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice._native import ext

BLOCK = 256
EPS = 1e-5
CHANNELS = [1, 3, 8, 15, 16, 17, 33, 64, 128, 130]
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _inputs(rng, n, c):
    """float32 values of x, w, b, g (x far from zero; g with exact zeros)."""
    x = rng.standard_normal((n, c)) * rng.uniform(0.5, 3.0, c) + rng.uniform(-40, 40, c)
    w = rng.uniform(0.5, 1.5, c) * rng.choice([-1.0, 1.0], c)
    b = rng.standard_normal(c)
    g = rng.standard_normal((n, c))
    g[rng.random((n, c)) < 0.05] = 0.0
    return [a.astype(np.float32) for a in (x, w, b, g)]


def _native(x, w, b, g, dtype, relu):
    """y, mean, var, dx, dweight, dbias of the extension, as float32 NumPy."""
    xd = mx.array(x).astype(dtype)
    gd = mx.array(g).astype(dtype)
    wd, bd = mx.array(w), mx.array(b)
    y, mean, var = ext.batch_norm_train(xd, wd, bd, eps=EPS, relu=relu)
    _, (dx, dw, db) = mx.vjp(
        lambda x, w, b: ext.batch_norm_train(x, w, b, eps=EPS, relu=relu)[0], [xd, wd, bd], [gd]
    )
    return [np.array(a.astype(mx.float32)) for a in (y, mean, var, dx, dw, db)]


def _round(values, dtype):
    """float32 values rounded to `dtype` (MLX's cast) and back to float32."""
    return np.array(mx.array(values).astype(dtype).astype(mx.float32))


def _block_sums(rows):
    """Column sums of float64 rows: each 256-row block from 0.0 in row order,
    then the blocks in order."""
    total = np.zeros(rows.shape[1])
    for r0 in range(0, rows.shape[0], BLOCK):
        acc = np.zeros(rows.shape[1])
        for row in rows[r0 : r0 + BLOCK]:
            acc += row
        total += acc
    return total


def _emulate(x, w, b, g, dtype, relu):
    """The documented arithmetic in NumPy (float64 statistics, float32 maps)."""
    n = x.shape[0]
    x32 = _round(x, dtype)
    g32 = _round(g, dtype)
    x64, w64 = x32.astype(np.float64), w.astype(np.float64)
    eps64 = float(np.float32(EPS))
    mu = _block_sums(x64) / float(n)
    v = _block_sums((x64 - mu) * (x64 - mu)) / float(n)
    scale = (w64 / np.sqrt(v + eps64)).astype(np.float32)
    mean, var = mu.astype(np.float32), v.astype(np.float32)
    y = (x32 - mean) * scale + b
    if relu:
        y = np.where(y < 0, np.float32(0), y)
    y = _round(y, dtype)
    gm = np.where(y > 0, g32, np.float32(0)) if relu else g32
    gm64 = gm.astype(np.float64)
    s_g = _block_sums(gm64)
    s_gx = _block_sums(gm64 * (x64 - mean.astype(np.float64)))
    rstd = 1.0 / np.sqrt(var.astype(np.float64) + eps64)
    inv_n = 1.0 / float(n)
    dw = s_gx * rstd
    aj = w64 * rstd
    a = aj.astype(np.float32)
    k = (-aj * rstd * dw * inv_n).astype(np.float32)
    d = (s_g * inv_n).astype(np.float32)
    dx = _round(a * (gm - d) + k * (x32 - mean), dtype)
    return [y, mean, var, dx, dw.astype(np.float32), s_g.astype(np.float32)]


NAMES = ("y", "mean", "var", "dx", "dweight", "dbias")


def _assert_bits(got, want, context):
    for name, a, e in zip(NAMES, got, want, strict=True):
        assert a.dtype == np.float32 and a.shape == e.shape, (context, name)
        mismatch = np.flatnonzero(a.view(np.uint32) != e.view(np.uint32))
        assert mismatch.size == 0, (
            f"{context}: {name} differs at {mismatch.size} of {a.size} elements, first flat "
            f"index {mismatch[0]}: {a.ravel()[mismatch[0]]!r} vs {e.ravel()[mismatch[0]]!r}"
        )


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", [37, 700])
@pytest.mark.parametrize("c", CHANNELS)
def test_default_path_matches_emulation_for_every_thread_count(rng, seed, c, n, dtype, relu):
    x, w, b, g = _inputs(rng, n, c)
    want = _emulate(x, w, b, g, DTYPES[dtype], relu)
    before = mlx_lattice.get_num_threads()
    try:
        for threads in (1, 2, 3):
            mlx_lattice.set_num_threads(threads)
            got = _native(x, w, b, g, DTYPES[dtype], relu)
            _assert_bits(got, want, f"seed={seed} c={c} n={n} {dtype} relu={relu} threads={threads}")
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
    x, w, b, g = (cases[key + "/" + s] for s in "xwbg")
    xd = mx.array(x).astype(getattr(mx, dtype))
    gd = mx.array(g).astype(xd.dtype)
    f = lambda x, w, b: ext.batch_norm_train(x, w, b, eps=1e-5, relu=relu == "1")
    for threads in (1, 2, 3):
        mlx_lattice.set_num_threads(threads)
        y, mean, var = f(xd, mx.array(w), mx.array(b))
        _, grads = mx.vjp(lambda x, w, b: f(x, w, b)[0], [xd, mx.array(w), mx.array(b)], [gd])
        for i, a in enumerate((y, mean, var, *grads)):
            out[f"{key}/{threads}/{i}"] = np.array(a.astype(mx.float32))
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
                x, w, b, g = _inputs(rng, 600, c)
                cases.update({f"{key}/x": x, f"{key}/w": w, f"{key}/b": b, f"{key}/g": g})
                wants[key] = _emulate(x, w, b, g, DTYPES[dtype], relu)
    np.savez(tmp_path / "cases.npz", **cases)
    isa_child(_SCALAR_SCRIPT, "scalar", tmp_path / "cases.npz", tmp_path / "out.npz")
    got = np.load(tmp_path / "out.npz")
    for key, want in wants.items():
        for threads in (1, 2, 3):
            outputs = [got[f"{key}/{threads}/{i}"] for i in range(6)]
            _assert_bits(outputs, want, f"seed={seed} scalar c:dtype:relu={key} threads={threads}")


_WIDENED_SCRIPT = """
import sys
import mlx.core as mx
import numpy as np
import mlx_lattice
from mlx_lattice._native import ext

cases = np.load(sys.argv[1])
out = {}
for key in sorted({k.rsplit("/", 1)[0] for k in cases.files}):
    _, _, dtype, relu = key.split(":")
    x, w, b, g = (mx.array(cases[key + "/" + s]) for s in "xwbg")
    f = lambda x, w, b: ext.batch_norm_train(x, w, b, eps=1e-5, relu=relu == "1")
    half = getattr(mx, dtype)
    widened = [a.astype(half).astype(mx.float32) for a in (x, g)]
    for threads in (1, 2, 3):
        mlx_lattice.set_num_threads(threads)
        for name, (xd, gd) in (("half", (x.astype(half), g.astype(half))), ("f32", widened)):
            y, mean, var = f(xd, w, b)
            _, grads = mx.vjp(lambda x, w, b: f(x, w, b)[0], [xd, w, b], [gd])
            for i, a in enumerate((y, mean, var, *grads)):
                out[f"{key}/{threads}/{name}/{i}"] = np.array(a.astype(mx.float32))
np.savez(sys.argv[2], **out)
"""

# The norm loops exist for the scalar and avx2-fma levels; the CPU's best
# ceiling (e.g. avx512f) must pick the same loops as avx2-fma.
_CEILINGS = sorted(
    {isa for isa in ext.gemm_isas() if isa in ("scalar", "avx2-fma")} | {ext.gemm_isas()[0]}
)


@pytest.mark.parametrize("ceiling", _CEILINGS)
def test_half_rows_match_float32_path_on_widened_inputs(rng, seed, tmp_path, isa_child, ceiling):
    """float16/bfloat16 batch norm (forward and vjp) equals the float32 path
    run on the same inputs widened to float32, with y and dx rounded to the
    half format, for every channel count, relu on and off, 1-3 threads and
    each ISA ceiling (MLX_LATTICE_GEMM_ISA, one child process each). With
    relu the masks agree unless a positive float32 y rounds to 0 in the half
    format, which the test checks does not happen for its inputs."""
    cases = {}
    for c in CHANNELS:
        for n in (37, 700):
            for dtype in ("float16", "bfloat16"):
                for relu in (False, True):
                    key = f"{c}:{n}:{dtype}:{int(relu)}"
                    for name, a in zip("xwbg", _inputs(rng, n, c), strict=True):
                        cases[f"{key}/{name}"] = a
    np.savez(tmp_path / "cases.npz", **cases)
    isa_child(_WIDENED_SCRIPT, ceiling, tmp_path / "cases.npz", tmp_path / "out.npz")
    got = np.load(tmp_path / "out.npz")
    keys = sorted({k.rsplit("/", 1)[0] for k in cases})
    for key in keys:
        dtype = DTYPES[key.split(":")[2]]
        for threads in (1, 2, 3):
            context = f"seed={seed} {ceiling} c:n:dtype:relu={key} threads={threads}"
            half = [got[f"{key}/{threads}/half/{i}"] for i in range(6)]
            ref = [got[f"{key}/{threads}/f32/{i}"] for i in range(6)]
            assert np.array_equal(ref[0] > 0, _round(ref[0], dtype) > 0), context
            ref[0], ref[3] = _round(ref[0], dtype), _round(ref[3], dtype)
            _assert_bits(half, ref, context)
