"""Equality with Qwix's own Flax model path (same rule, same inputs).

Compiled: ours and Qwix's model are traced into ONE jitted program (forward
and gradients) and must agree bit for bit, on any backend; that is the
contract (docs/topics/tpu.rst). A PTQ model of Qwix holds weights it
quantized in quantize_model, another program: the linear and einsum tests
hand that very QArray to our op (which takes a matching QArray as is); the
convolution, which takes float weights, is held to the two-program bound.
Op by op (``TAKTINY_OPS_EAGER_JIT=0`` against the eager model): the two
sides are differently compiled programs: bit for bit on the CPU, elsewhere
within a flipped rounding of the values near a rounding boundary (the
conftest's ``cross_program_bound`` with each operand's absmax axes, derived
there; ``programs_agree``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

import quantrules as qr
import taktiny_ops as tk


def _arr(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _qwix_model(model, rules, x, provider_cls=qwix.PtqProvider):
    return qwix.quantize_model(model, provider_cls(qr.to_qwix(list(rules))), x)


def _both(mode, fn, qmodel, *args):
    """``fn(qmodel, *args)``: one jitted program when compiled, else op by op."""
    return nnx.jit(fn)(qmodel, *args) if mode == "compiled" else fn(qmodel, *args)


def _held(qmodel):
    """The QArray a Qwix PTQ model holds as its kernel (values read in a trace too)."""
    arr = qmodel.kernel.array
    return dataclasses.replace(arr, qvalue=arr.qvalue[...], scale=arr.scale[...])


def _check(mode, ours, theirs, bound, agree):
    """Bit for bit within one program; across programs (op by op) bit for bit
    on the CPU and within ``bound`` (a callable) elsewhere (``agree``: the
    conftest's ``programs_agree``)."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    if mode == "compiled":
        np.testing.assert_array_equal(ours, theirs)
    else:
        agree(ours, theirs, bound)


def _axes(rule, x_axes, w_axes):
    """The bound's absmax axes of each operand (Qwix's calibration: dot_general
    and einsum keep the non-contracting axes, a convolution the batch axis of
    x and the output features of w), the rule's tile size on both."""
    return dict(x_axes=x_axes, w_axes=w_axes, tile_size=rule.tile_size)


LINEAR_RULES = [
    qr.Rule(module_path=".*", weight_qtype="int8", act_qtype="int8"),
    qr.Rule(weight_qtype="int8"),
    qr.Rule(weight_qtype="int4", tile_size=16),
    qr.Rule(weight_qtype="fp8", act_qtype="fp8"),
    qr.Rule(weight_qtype="nf4", tile_size=32),
]


@pytest.mark.parametrize("rule", LINEAR_RULES, ids=lambda r: f"{r.weight_qtype}-{r.act_qtype}")
def test_linear_ptq_bitwise_equals_qwix(rule, mode, rng, cross_program_bound, programs_agree):
    model = nnx.Linear(64, 24, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    model.bias.value = _arr(rng, (24,))
    x = _arr(rng, (5, 64))
    kernel, bias = model.kernel.value, model.bias.value
    qmodel = _qwix_model(model, [rule], x)

    def pair(m, x, k, b):
        if mode == "compiled":  # Qwix's weights, quantized in quantize_model
            k = _held(m)
        return tk.linear(x, k, b, quant=rule), m(x)

    ours, expected = _both(mode, pair, qmodel, x, kernel, bias)
    # the bias add rounds once more: half an ulp of |y| <= |s| + |bias|
    _check(mode, ours, expected, lambda: cross_program_bound(
        np.matmul, x, kernel, rule, **_axes(rule, (-1,), (0,)))
        + 2**-23 * np.abs(np.asarray(bias)), programs_agree)
    assert not np.array_equal(np.asarray(ours), np.asarray(x @ kernel + bias))  # it quantized


def test_einsum_ptq_bitwise_equals_qwix(mode, rng, cross_program_bound, programs_agree):
    model = nnx.Einsum("bti,io->bto", (32, 16), rngs=nnx.Rngs(1))
    model.kernel.value = _arr(rng, (32, 16))
    x = _arr(rng, (2, 3, 32))
    rule = qr.Rule(op_names=("einsum",), weight_qtype="int8", act_qtype="int8")
    qmodel = _qwix_model(model, [rule], x)
    assert model.bias is None  # nnx.Einsum without bias_shape

    def pair(m, x, k):
        if mode == "compiled":  # Qwix's weights, quantized in quantize_model
            k = _held(m)
        return tk.einsum("bti,io->bto", x, k, quant=rule), m(x)

    ours, expected = _both(mode, pair, qmodel, x, model.kernel.value)
    _check(mode, ours, expected, lambda: cross_program_bound(
        lambda a, b: np.einsum("bti,io->bto", a, b), x, model.kernel.value, rule,
        **_axes(rule, (-1,), (0,))), programs_agree)


def test_conv_ptq_bitwise_equals_qwix(mode, rng, cross_program_bound, conv64, programs_agree):
    model = nnx.Conv(4, 8, kernel_size=(3, 3), use_bias=False, rngs=nnx.Rngs(2))
    model.kernel.value = _arr(rng, (3, 3, 4, 8))
    x = _arr(rng, (2, 9, 9, 4))
    rule = qr.Rule(weight_qtype="int8", act_qtype="int8")
    qmodel = _qwix_model(model, [rule], x)
    dn = ("NHWC", "HWIO", "NHWC")

    def pair(m, x, k):
        return tk.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=dn,
                                       quant=rule), m(x)

    ours, expected = _both(mode, pair, qmodel, x, model.kernel.value)
    # Qwix's weights were quantized in quantize_model, ours in this program:
    # two programs for the weights in either mode.
    _check("op_by_op", ours, expected, lambda: cross_program_bound(
        lambda a, b: conv64(a, b, (1, 1), dn), x, model.kernel.value, rule,
        **_axes(rule, (1, 2, 3), (0, 1, 2))), programs_agree)


def _loss(y):
    return jnp.sum(jnp.sin(y) * y)


@pytest.mark.parametrize("bwd", [None, "int8"])
def test_linear_qt_forward_and_grads_bitwise_equal_qwix(bwd, mode, rng, cross_program_bound,
                                                        programs_agree):
    """Gradients are compared within one program only: across programs a
    flipped forward rounding moves the loss's derivative too, with no useful
    bound of its own."""
    model = nnx.Linear(32, 16, rngs=nnx.Rngs(3))
    model.bias.value = _arr(rng, (16,))
    x = _arr(rng, (4, 32))
    rule = qr.Rule(weight_qtype="int8", act_qtype="int8", bwd_qtype=bwd, mode="qt")
    kernel, bias = model.kernel.value, model.bias.value
    qmodel = _qwix_model(model, [rule], x, qwix.QtProvider)

    def pair(m, x, k, b):
        return tk.linear(x, k, b, quant=rule), m(x)

    ours, expected = _both(mode, pair, qmodel, x, kernel, bias)
    _check(mode, ours, expected, lambda: cross_program_bound(
        np.matmul, x, kernel, rule, **_axes(rule, (-1,), (0,)))
        + 2**-23 * np.abs(np.asarray(bias)), programs_agree)
    if mode != "compiled":
        return

    def grads(m, x, k, b):
        theirs = nnx.grad(lambda m: _loss(m(x)))(m)
        ours = jax.grad(lambda k, b: _loss(tk.linear(x, k, b, quant=rule)), (0, 1))(k, b)
        return ours, (theirs.kernel.value, theirs.bias.value)

    ours, theirs = _both(mode, grads, qmodel, x, kernel, bias)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_conv_qt_grads_bitwise_equal_qwix(mode, rng, cross_program_bound, conv64,
                                          programs_agree):
    """Gradients within one program only (as for the linear layer)."""
    model = nnx.Conv(3, 4, kernel_size=(3,), use_bias=False, rngs=nnx.Rngs(4))
    model.kernel.value = _arr(rng, (3, 3, 4))
    x = _arr(rng, (2, 10, 3))
    rule = qr.Rule(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8", mode="qt")
    qmodel = _qwix_model(model, [rule], x, qwix.QtProvider)
    dn = ("NWC", "WIO", "NWC")

    def ours(x, k):
        return tk.conv_general_dilated(x, k, (1,), "SAME", dimension_numbers=dn, quant=rule)

    got, expected = _both(mode, lambda m, x, k: (ours(x, k), m(x)), qmodel, x,
                          model.kernel.value)
    _check(mode, got, expected, lambda: cross_program_bound(
        lambda a, b: conv64(a, b, (1,), dn), x, model.kernel.value, rule,
        **_axes(rule, (1, 2), (0, 1))), programs_agree)
    if mode != "compiled":
        return

    def grads(m, x, k):
        theirs = nnx.grad(lambda m: _loss(m(x)))(m)
        return jax.grad(lambda k: _loss(ours(x, k)))(k), theirs.kernel.value

    gk, theirs = _both(mode, grads, qmodel, x, model.kernel.value)
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(theirs))
