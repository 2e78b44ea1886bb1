"""Shared test setup of taktiny_ops (every test target ships this file).

- Doctests see ``jnp`` (the seed's examples use it).
- Float32 products: every module of the package's tests (and its doctests)
  runs under ``jax.default_matmul_precision("highest")``. The float bounds of
  the tests are derived for float32 products; a TPU's default precision for
  float32 matmuls rounds the operands to bfloat16 (relative error 2^-9). On a
  CPU, float32 products are what the default gives: nothing changes there.
- ``cross_program_bound``: the bound of a difference between two differently
  compiled programs (see its docstring); bit-for-bit equality is claimed
  only within one jitted program (docs/topics/tpu.rst).
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


# The largest gap between two neighbouring values of each quantized type, as a
# fraction of the absmax the scale maps to the type's largest value: integers
# 1/qmax; float8_e4m3fn's top gap 448 - 416 = 32 of 448; nf4's top gap
# 1 - 0.6962 of 1 (its code book's two largest magnitudes).
TOP_GAP = {"int8": 1 / 127, "int4": 1 / 7, "uint4": 1 / 15, "float8_e4m3fn": 32 / 448,
           "fp8": 32 / 448, "nf4": 0.3038}


def _step(a: np.ndarray, qtype: str | None) -> float:
    """One quantization step of ``a`` under ``qtype`` (0 when not quantized)."""
    if not qtype:
        return 0.0
    return float(np.abs(a).max(initial=0.0)) * TOP_GAP[str(qtype)]


def _bound(product: Callable, x: object, w: object, rule: qr.Rule | None,
           x_err: object = 0.0) -> np.ndarray:
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ax = np.abs(x) + x_err
    dx = _step(ax, rule.act_qtype if rule else None)
    dw = _step(w, rule.weight_qtype if rule else None)
    aw = np.abs(w) + dw
    moved = product(x_err + np.full_like(x, dx), aw + dw) + product(ax + dx, np.full_like(w, dw))
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
    """
    return _bound


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
