"""Bitwise equality with Qwix's own Flax model path (same rule, same inputs),
within one execution mode: op by op (``TAKTINY_OPS_EAGER_JIT=0`` against the
eager model) and compiled (our default eager call, which runs one cached jit,
and ``jax.jit`` gradients against ``nnx.jit`` of the model)."""

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


@pytest.fixture(params=["op_by_op", "compiled"])
def mode(request, monkeypatch):
    if request.param == "op_by_op":
        monkeypatch.setenv("TAKTINY_OPS_EAGER_JIT", "0")
    return request.param


def _qwix_forward(model, rules, x, mode, provider_cls=qwix.PtqProvider):
    qmodel = qwix.quantize_model(model, provider_cls(qr.to_qwix(list(rules))), x)
    out = nnx.jit(lambda m, x: m(x))(qmodel, x) if mode == "compiled" else qmodel(x)
    return qmodel, out


def _qwix_grads(qmodel, x, mode):
    grad = nnx.grad(lambda m: _loss(m(x)))
    return nnx.jit(grad)(qmodel) if mode == "compiled" else grad(qmodel)


def _grad(fn, mode, argnums=0):
    grad = jax.grad(fn, argnums=argnums)
    return jax.jit(grad) if mode == "compiled" else grad


LINEAR_RULES = [
    qr.Rule(module_path=".*", weight_qtype="int8", act_qtype="int8"),
    qr.Rule(weight_qtype="int8"),
    qr.Rule(weight_qtype="int4", tile_size=16),
    qr.Rule(weight_qtype="fp8", act_qtype="fp8"),
    qr.Rule(weight_qtype="nf4", tile_size=32),
]


@pytest.mark.parametrize("rule", LINEAR_RULES, ids=lambda r: f"{r.weight_qtype}-{r.act_qtype}")
def test_linear_ptq_bitwise_equals_qwix(rule, mode, rng):
    model = nnx.Linear(64, 24, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    model.bias.value = _arr(rng, (24,))
    x = _arr(rng, (5, 64))
    kernel, bias = model.kernel.value, model.bias.value
    _, expected = _qwix_forward(model, [rule], x, mode)
    ours = tk.linear(x, kernel, bias, quant=rule)
    assert ours.dtype == expected.dtype
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(expected))
    assert not np.array_equal(np.asarray(ours), np.asarray(x @ kernel + bias))  # it quantized


def test_einsum_ptq_bitwise_equals_qwix(mode, rng):
    model = nnx.Einsum("bti,io->bto", (32, 16), rngs=nnx.Rngs(1))
    model.kernel.value = _arr(rng, (32, 16))
    x = _arr(rng, (2, 3, 32))
    rule = qr.Rule(op_names=("einsum",), weight_qtype="int8", act_qtype="int8")
    _, expected = _qwix_forward(model, [rule], x, mode)
    ours = tk.einsum("bti,io->bto", x, model.kernel.value, quant=rule)
    if model.bias is not None:
        ours = ours + model.bias.value
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(expected))


def test_conv_ptq_bitwise_equals_qwix(mode, rng):
    model = nnx.Conv(4, 8, kernel_size=(3, 3), use_bias=False, rngs=nnx.Rngs(2))
    model.kernel.value = _arr(rng, (3, 3, 4, 8))
    x = _arr(rng, (2, 9, 9, 4))
    rule = qr.Rule(weight_qtype="int8", act_qtype="int8")
    _, expected = _qwix_forward(model, [rule], x, mode)
    ours = tk.conv_general_dilated(
        x,
        model.kernel.value,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        quant=rule,
    )
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(expected))


def _loss(y):
    return jnp.sum(jnp.sin(y) * y)


@pytest.mark.parametrize("bwd", [None, "int8"])
def test_linear_qt_forward_and_grads_bitwise_equal_qwix(bwd, mode, rng):
    model = nnx.Linear(32, 16, rngs=nnx.Rngs(3))
    model.bias.value = _arr(rng, (16,))
    x = _arr(rng, (4, 32))
    rule = qr.Rule(weight_qtype="int8", act_qtype="int8", bwd_qtype=bwd, mode="qt")
    kernel, bias = model.kernel.value, model.bias.value
    qmodel, expected = _qwix_forward(model, [rule], x, mode, qwix.QtProvider)
    grads = _qwix_grads(qmodel, x, mode)

    ours = tk.linear(x, kernel, bias, quant=rule)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(expected))
    gk, gb = _grad(lambda k, b: _loss(tk.linear(x, k, b, quant=rule)), mode, (0, 1))(kernel, bias)
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(grads.kernel.value))
    np.testing.assert_array_equal(np.asarray(gb), np.asarray(grads.bias.value))


def test_conv_qt_grads_bitwise_equal_qwix(mode, rng):
    model = nnx.Conv(3, 4, kernel_size=(3,), use_bias=False, rngs=nnx.Rngs(4))
    model.kernel.value = _arr(rng, (3, 3, 4))
    x = _arr(rng, (2, 10, 3))
    rule = qr.Rule(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8", mode="qt")
    qmodel, expected = _qwix_forward(model, [rule], x, mode, qwix.QtProvider)
    grads = _qwix_grads(qmodel, x, mode)

    def ours(k):
        return tk.conv_general_dilated(
            x, k, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"), quant=rule
        )

    np.testing.assert_array_equal(np.asarray(ours(model.kernel.value)), np.asarray(expected))
    gk = _grad(lambda k: _loss(ours(k)), mode)(model.kernel.value)
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(grads.kernel.value))
