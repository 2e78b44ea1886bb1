"""Shared test setup of taktiny_ops (every test target ships this file).

- Doctests see ``jnp`` (the seed's examples use it).
- Float32 products: every module of the package's tests (and its doctests)
  runs under ``jax.default_matmul_precision("highest")``. The float bounds of
  the tests are derived for float32 products; a TPU's default precision for
  float32 matmuls rounds the operands to bfloat16 (relative error 2^-9). On a
  CPU, float32 products are what the default gives: nothing changes there.
- ``cross_program_bound``: the bound of a difference between two differently
  compiled programs (see its docstring); bit-for-bit equality is claimed
  within one jitted program on any backend (docs/topics/tpu.rst), and
  between two programs on the CPU: ``programs_agree`` asserts equal bits
  there and the bound elsewhere. ``near_boundary``: the values whose level
  two programs may round differently.
- ``mode``: a test run op by op and again compiled.
- ``conv64``: a float64 convolution on the CPU device (a bound's product;
  an accelerator has no float64 convolution).
"""

from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quantrules as qr


@pytest.fixture(autouse=True)
def _doctest_jnp(doctest_namespace: dict) -> None:
    doctest_namespace["jnp"] = jnp


@pytest.fixture(autouse=True, scope="module")
def _float32_matmuls() -> Iterator[None]:
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(params=["op_by_op", "compiled"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test twice: op by op (``TAKTINY_OPS_EAGER_JIT=0``) and compiled."""
    if request.param == "op_by_op":
        monkeypatch.setenv("TAKTINY_OPS_EAGER_JIT", "0")
    return request.param


# The largest gap between two neighbouring values of each quantized type, as a
# fraction of the absmax the scale maps to the type's largest value: integers
# 1/qmax; float8_e4m3fn's top gap 448 - 416 = 32 of 448; nf4's top gap
# 1 - 0.6962 of 1 (its code book's two largest magnitudes).
TOP_GAP = {"int8": 1 / 127, "int4": 1 / 7, "uint4": 1 / 15, "float8_e4m3fn": 32 / 448,
           "fp8": 32 / 448, "nf4": 0.3038}


# Qwix's symmetric bound of each integer type: a / s with s = absmax / bound
# lies in [-bound, bound], rounded to the nearest level (qmax + 0.5).
SYMMETRIC_BOUND = {"int8": 127.5, "int4": 7.5}
# Relative difference of one program's a / s from the exact quotient: s is one
# division (or a product by a rounded reciprocal: two roundings) and a / s one
# division (or two roundings again), so each program is within 4 u = 2^-22 of
# a / s (u = 2^-24); 2^-21 leaves a factor of two for a backend's division
# being off by an ulp.
_QUOTIENT_REL = 2.0**-21


def _step(a: np.ndarray, qtype: str | None) -> float:
    """One quantization step of ``a`` under ``qtype`` (0 when not quantized)."""
    if not qtype:
        return 0.0
    return float(np.abs(a).max(initial=0.0)) * TOP_GAP[str(qtype)]


def _absmax(a: np.ndarray, axes: tuple[int, ...], tile: int | None) -> np.ndarray:
    """max |a| over ``axes`` (kept, size 1), or with ``tile`` over each run of
    ``tile`` values along the single axis in ``axes`` (Qwix's tiled scales),
    broadcast back to ``a``'s shape."""
    if not tile:
        return np.max(np.abs(a), axis=axes, keepdims=True)
    (ax,) = (axis % a.ndim for axis in axes)
    tiles = np.abs(a).reshape((*a.shape[:ax], a.shape[ax] // tile, tile, *a.shape[ax + 1:]))
    return np.repeat(tiles.max(axis=ax + 1), tile, axis=ax)


def _moved(a: np.ndarray, qtype: str | None, axes: tuple[int, ...] | None,
           err: object, tile: int | None = None) -> np.ndarray:
    """Elementwise bound of |a^1 - a^2|: the dequantized values of two programs
    whose inputs are each within ``err`` of ``a``, quantized under ``qtype``
    with absmax scales over ``axes`` (None: unknown axes, every value may move
    one step, the per-tensor top gap, besides ``err``).

    With the axes known (integer types): s = A / b (A the absmax over the
    axes, b = qmax + 0.5) and v = a / s in float64. Each program's inputs move
    A by at most E = max(err) over the axes and its quotient is within
    err / s + |v| (E / (A - E) + 2^-21) of v (_QUOTIENT_REL). A value whose v
    lies farther than that from every rounding boundary k + 1/2 rounds to the
    same level q in both programs and moves only with the scale,
    (|v| + 1/2) |s1 - s2|; a value that near may round to the neighbouring
    level: one more step s, with |q| <= |v| + 3/2. The scales differ by
    |s1 - s2| <= 2 s (E / A + 2^-22) (the absmax moves by E; each scale is
    within two roundings of A / b).
    """
    err = np.broadcast_to(np.asarray(err, np.float64), a.shape)
    if not qtype:
        return err
    if axes is None or str(qtype) not in SYMMETRIC_BOUND:
        return err + _step(np.abs(a) + err, qtype)
    amax, emax, scale, v, near = _near(a, str(qtype), axes, err, tile)
    ds = 2 * scale * (emax / np.where(amax > 0, amax, 1.0) + 2.0**-22)
    return scale * near + (np.abs(v) + 1.5) * ds


def _near(a: np.ndarray, qtype: str, axes: tuple[int, ...], err: np.ndarray,
          tile: int | None) -> tuple[np.ndarray, ...]:
    """(A, E, s, v, near) of ``_moved``'s derivation: near marks the values
    whose level two programs may round differently."""
    amax = _absmax(a, axes, tile)
    emax = _absmax(err, axes, tile)
    scale = np.where(amax > 0, amax, 1.0) / SYMMETRIC_BOUND[qtype]
    v = a / scale
    drift = np.where(amax > emax, emax / np.maximum(amax - emax, 1e-300), np.inf)
    window = err / scale + np.abs(v) * (drift + _QUOTIENT_REL)
    # The nearest boundary k + 1/2 between two levels the clip keeps (for
    # int8 -127.5 .. 126.5: round(127.5) = 128 clips to 127 like 127.4).
    bmax = SYMMETRIC_BOUND[qtype]
    near = np.abs(v - np.clip(np.floor(v) + 0.5, -bmax, bmax - 1)) <= window
    return amax, emax, scale, v, near


@pytest.fixture
def near_boundary() -> Callable:
    """``near(a, qtype, axes, tile=None)``: the elements of ``a`` (int8 or
    int4, absmax scales over ``axes``, or ``tile``-long runs of the one axis
    given) whose quantized level two programs may round differently: a / s
    within 2^-21 |a / s| of a rounding boundary (``_moved``'s derivation,
    judged in float64). Any other element gets the same level in both."""
    def near(a: object, qtype: str, axes: tuple[int, ...], tile: int | None = None) -> np.ndarray:
        a = np.asarray(a, np.float64)
        return _near(a, str(qtype), axes, np.zeros_like(a), tile)[-1]

    return near


def _bound(product: Callable, x: object, w: object, rule: qr.Rule | None,
           x_err: object = 0.0, *, x_axes: tuple[int, ...] | None = None,
           w_axes: tuple[int, ...] | None = None, tile_size: int | None = None) -> np.ndarray:
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ax = np.abs(x) + x_err
    dx = _step(ax, rule.act_qtype if rule else None)
    dw = _step(w, rule.weight_qtype if rule else None)
    aw = np.abs(w) + dw
    mx = _moved(x, rule.act_qtype if rule else None, x_axes, x_err, tile_size)
    mw = _moved(w, rule.weight_qtype if rule else None, w_axes, 0.0, tile_size)
    moved = product(mx, aw + mw) + product(ax + dx, mw)
    return moved + 1e-5 * product(ax + dx, aw) + 1e-30


@pytest.fixture
def cross_program_bound() -> Callable:
    """``bound(product, x, w, rule, x_err=0)``: elementwise bound of |P1 - P2|
    where P1 and P2 are two differently compiled programs (op by op against
    compiled, this library against Qwix's own model, one backend against
    another) computing the same quantized bilinear ``product`` (a float64
    NumPy function of x and w, each output a sum of x_i * w_j terms) under
    ``rule``, P1 of ``x`` and P2 of an input within ``x_err`` (elementwise)
    of ``x`` (a layer after one whose outputs already differ).

    Derivation. Each program computes sum x^ w^ with x^ = s_x q_x and
    w^ = s_w q_w, q = round(a / s), s = absmax / qmax. The absmax is exact in
    both; s may differ by an ulp (a division against a multiplication by a
    reciprocal) and a / s by a few ulps, so a value that lands within a few
    ulps of a rounding boundary can round to the neighbouring level in one
    program and not in the other: each dequantized value may move by one step
    (at most the type's top gap times the operand's absmax, a bound on every
    per-channel or per-tile step), nothing more. An input that differs by e
    moves its quantized value by at most e + dx (each side is within half a
    step of its input; the step taken from the absmax of |x| + e). With
    |x^| <= |x| + e + dx and |w^| <= |w| + dw:
    |x^' w^' - x^ w^| <= (e + dx) (|w| + 2 dw) + (|x| + e + dx) dw per term.
    Float32 accumulation in either order (with float32 products) adds at most
    2 K 2^-24 sum |x^||w^| for K summed terms; 1e-5 covers K <= 80 and the
    scale ulps (every contraction of these tests is shorter).

    ``x_axes`` / ``w_axes``: the axes each operand's absmax is taken over
    (its calibration). Given them, "may round to the neighbouring level" is
    decided per value instead of granted to every value: only those whose
    a / s lies within a few ulps (plus what e moves it) of a rounding
    boundary (``_moved``); with none near, the bound reduces to the scale
    ulps and the accumulation term. Without them, every value moves one
    step, the bound above (as large as the product itself for int8).
    ``tile_size``: the absmax runs over tiles of that many values along the
    one axis given (the rule's tile_size, on the contracting axis). The
    per-value decision covers the symmetric integer types; float8 and nf4
    keep the per-tensor step.
    """
    return _bound


def _agree(got: object, want: object, limit: object) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    limit = np.asarray(limit() if callable(limit) else limit, np.float64)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want)
        return
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert (err <= limit).all(), (float(err.max()), float((limit - err).min()))


@pytest.fixture
def programs_agree() -> Callable:
    """``agree(got, want, limit)``: two differently compiled programs of the
    same quantized computation agree bit for bit on the CPU (XLA:CPU divides,
    fuses and sums them alike: the guide's claim, held here) and within
    ``limit`` (an array, or a callable giving one: ``cross_program_bound``
    with the operands' absmax axes) elsewhere. The limit is computed on every
    backend, so a broken bound fails in CI too; dtypes and shapes must match.
    """
    return _agree


def _conv64(a: object, b: object, strides: tuple[int, ...],
            dimension_numbers: tuple[str, str, str]) -> np.ndarray:
    with jax.enable_x64(), jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(jax.lax.conv_general_dilated(
            jnp.asarray(a, jnp.float64), jnp.asarray(b, jnp.float64), strides, "SAME",
            dimension_numbers=dimension_numbers, precision=jax.lax.Precision.HIGHEST))


@pytest.fixture
def conv64() -> Callable:
    """``conv64(a, b, strides, dimension_numbers)``: a "SAME" convolution in
    float64 on the CPU device, whatever the default backend."""
    return _conv64
