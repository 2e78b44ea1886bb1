"""Weights quantized once for the stateless ops, and the kernel switch.

* ``quantize_weight`` gives the kernel a PTQ layer holds; the stateless ops
  use it as is and compute bitwise what the layer computes, compared within
  ONE jitted program (any backend). Against the float-weight path, which
  quantizes the weight inside the program, bitwise on XLA:CPU.
* ``kernels=`` / ``kernel=``: the report's kernel column and its notes; the
  Pallas path (interpret mode off a TPU) against the kernels' plain-JAX
  references and against Qwix within derived bounds.
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
from taktiny_ops._pallas_matmul import reference_weight_only_matmul, weight_only_matmul
from taktiny_ops._pallas_w8a8 import reference_w8a8_matmul, w8a8_matmul

U32 = 2.0**-24  # float32 unit roundoff

W8A8 = qr.Rule(weight_qtype="int8", act_qtype="int8")
RULES = {
    "int8": qr.Rule(weight_qtype="int8"),
    "int4_tiled": qr.Rule(weight_qtype="int4", tile_size=128),
    "fp8": qr.Rule(weight_qtype="fp8"),
    "w8a8": W8A8,
}


def _arr(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _only(rule, path):
    """The rule restricted to the layers at ``path`` (a regex): the others stay float."""
    return [dataclasses.replace(rule, module_path=path)]


def _bitwise(a, b):
    """Bit for bit: the same values, shape and dtype."""
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.fc = tk.Linear(256, 128, rngs=rngs)
        self.mix = tk.Einsum("btk,kn->btn", (128, 128), (128,), rngs=rngs)
        self.pair = nnx.Einsum("btk,nk->btn", (64, 128), rngs=rngs)  # weight not [K, N]
        self.conv = tk.Conv(64, 8, 3, rngs=rngs)

    def __call__(self, x):
        return self.conv(self.pair(self.mix(self.fc(x))))


def _in_one_program(model, fn, *args):
    """``fn(model, *args)`` traced once: the model's layers and the references together."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, *a: fn(nnx.merge(graphdef, s), *a))(state, *args)


# ---------------------------------------------------------------- weights quantized once


@pytest.mark.parametrize("name", sorted(RULES))
def test_prequantized_linear_bitwise_equals_ptq_layer(name, rng):
    rule = _only(RULES[name], "fc")
    model = Net(nnx.Rngs(0))
    w, b = model.fc.kernel[...], model.fc.bias[...]
    tk.quantize(model, rule)
    wq = tk.quantize_weight(w, rule, module_path="fc")
    held = model.fc.kernel.get_value()
    _bitwise(wq.qvalue, held.qvalue)  # exactly the kernel the layer holds
    _bitwise(wq.scale, held.scale)
    x = _arr(rng, (2, 3, 256))

    def both(m, x, wq, w):
        return (m.fc(x), tk.linear(x, wq, b, quant=rule, module_path="fc"),
                tk.linear(x, w, b, quant=rule, module_path="fc"))

    layer, once, per_call = _in_one_program(model, both, x, wq, w)
    _bitwise(once, layer)
    # The float weight is quantized inside this program, the QArray outside
    # it: the same values on XLA:CPU (the quantization is one division per
    # element there); another backend may fuse it differently.
    if jax.default_backend() == "cpu":
        _bitwise(per_call, layer)


@pytest.mark.parametrize("name", ["int8", "w8a8", "int4_tiled"])
def test_prequantized_einsum_bitwise_equals_ptq_layer(name, rng):
    rule = _only(RULES[name], "mix")
    model = Net(nnx.Rngs(1))
    w = model.mix.kernel[...]
    tk.quantize(model, rule)
    wq = tk.quantize_weight(w, rule, module_path="mix", op="einsum", subscripts="btk,kn->btn")
    _bitwise(wq.qvalue, model.mix.kernel.get_value().qvalue)
    _bitwise(wq.scale, model.mix.kernel.get_value().scale)
    x = _arr(rng, (2, 3, 128))
    bias = model.mix.bias[...]

    def both(m, x, wq, w):
        ours = tk.einsum("btk,kn->btn", x, wq, quant=rule, module_path="mix") + bias
        float_w = tk.einsum("btk,kn->btn", x, w, quant=rule, module_path="mix") + bias
        return m.mix(x), ours, float_w

    layer, once, per_call = _in_one_program(model, both, x, wq, w)
    _bitwise(once, layer)
    if jax.default_backend() == "cpu":  # see the linear test
        _bitwise(per_call, layer)


def test_matching_qarray_is_used_as_is_others_are_quantized_again(rng):
    """A QArray laid out as the rule quantizes (the same qtype, scale shape and
    zero point) is used as is; the documented fallback: one laid out otherwise
    (another qtype, tiling or channel axis) is dequantized and quantized by the
    rule, and a QT rule dequantizes it."""
    x, w = _arr(rng, (4, 256)), _arr(rng, (256, 128))
    others = [
        tk.quantize_weight(w, "int4"),  # another qtype
        tk.quantize_weight(w, qr.Rule(weight_qtype="int8", tile_size=128)),  # tiled
        qwix.quantize(w, jnp.int8, channelwise_axes=(0,)),  # scales along K
    ]
    for wq in others:
        for rule in ("int8", W8A8):
            _bitwise(tk.linear(x, wq, quant=rule), tk.linear(x, qwix.dequantize(wq), quant=rule))
    qt = qr.QtProvider([qr.Rule(weight_qtype="int8", mode="qt")])
    wq = tk.quantize_weight(w, "int8")
    _bitwise(tk.linear(x, wq, quant=qt), tk.linear(x, qwix.dequantize(wq), quant=qt))
    # A matching QArray is not quantized again: its own (doubled) scale is
    # used, however it was made (Qwix's own quantize spells the qtype jnp.int8),
    # by linear and by einsum (an einsum's weight layout, '...' included).
    for wq in (tk.quantize_weight(w, "int8"),
               qwix.quantize(w, jnp.int8, channelwise_axes=(1,))):
        doubled = qwix.QArray(wq.qvalue, wq.scale * 2, qtype=wq.qtype)
        _bitwise(tk.linear(x, doubled, quant="int8"), 2 * tk.linear(x, wq, quant="int8"))
        for subscripts in ("bk,kn->bn", "...k,kn->...n"):
            _bitwise(tk.einsum(subscripts, x, doubled, quant="int8"),
                     2 * tk.einsum(subscripts, x, wq, quant="int8"))


def test_quantize_weight_keeps_float_where_the_layer_would(rng):
    w = _arr(rng, (32, 16))
    for quant in (None, qr.Rule(weight_qtype=None), qr.Rule(act_qtype="int8"),
                  qr.QtProvider([qr.Rule(weight_qtype="int8", mode="qt")]),
                  [qr.Rule(module_path="other", weight_qtype="int8")]):
        assert tk.quantize_weight(w, quant, module_path="fc") is w


@pytest.mark.parametrize(("call", "match"), [
    (lambda w: tk.quantize_weight(w, "int8", op="conv_general_dilated"), r"^op: "),
    (lambda w: tk.quantize_weight(w[None], "int8"), r"^w: expected shape \(in_features"),
    (lambda w: tk.quantize_weight(w.astype(jnp.int32), "int8"), r"^w: expected a float array"),
    (lambda w: tk.quantize_weight(tk.quantize_weight(w, "int8"), "int8"), r"^w: expected a float"),
    (lambda w: tk.quantize_weight(w, "int8", op="einsum"), r"^subscripts: "),
    (lambda w: tk.quantize_weight(w, "int8", op="einsum", subscripts="ab,bcd->acd"), r"^w: shape"),
    (lambda w: tk.quantize_weight(w, "int8", op="einsum", subscripts="ak,kn,n->an"),
     r"^subscripts: "),
    (lambda w: tk.quantize_weight(w, qr.Rule(weight_qtype="int8", tile_size=5),
                                  module_path="fc"), r"^w \(module_path='fc'\): quant: rule #0"),
    (lambda w: tk.quantize_weight(w, "int8", op="einsum", subscripts="ak,kz->a"),
     r"^w: subscripts 'ak,kz->a' sums kernel index 'z'"),
])
def test_quantize_weight_bad_input_names_the_argument(call, match, rng):
    with pytest.raises(tk.TaktinyOpsError, match=match):
        call(_arr(rng, (32, 16)))


# ---------------------------------------------------------------- the kernel switch


def test_report_says_which_kernel_each_layer_got():
    rules = [qr.Rule(module_path="pair", weight_qtype=None),
             qr.Rule(module_path="mix", weight_qtype="int8", act_qtype="int8", tile_size=128),
             qr.Rule(module_path="conv", weight_qtype="int8"),
             qr.Rule(weight_qtype="int8")]
    report = tk.quantize(Net(nnx.Rngs(0)), rules)  # the default: Qwix everywhere
    assert [(layer.path, layer.kernel, layer.kernel_note) for layer in report.layers] == [
        ("conv", "qwix", ""), ("fc", "qwix", ""), ("mix", "qwix", ""), ("pair", "float", "")]
    rules[0] = qr.Rule(module_path="pair", weight_qtype="int8")
    model = Net(nnx.Rngs(0))
    report = tk.quantize(model, rules, kernels="pallas")
    got = {layer.path: (layer.kernel, layer.kernel_note) for layer in report.layers}
    assert got["fc"] == ("pallas-weight-only", "")
    assert got["mix"] == ("qwix", "no Pallas kernel for tiled w8a8 (tile_size=128)")
    assert got["conv"] == ("qwix", "no Pallas kernel for convolutions")
    assert got["pair"] == ("qwix", "einsum 'btk,nk->btn' is not an x[..., K] @ w[K, N] "
                                   "contraction")
    assert model.fc.matmul_kernel == "pallas-weight-only" and model.mix.matmul_kernel == "qwix"
    text = str(report).splitlines()
    assert text[0].split()[:7] == ["layer", "op", "mode", "weight", "act", "bytes", "kernel"]
    fc = next(line for line in text if line.startswith("fc "))
    assert fc.split()[6] == "pallas-weight-only"
    mix = next(line for line in text if line.startswith("mix "))
    assert mix.split()[6] == "qwix" and mix.endswith(
        "[Qwix: no Pallas kernel for tiled w8a8 (tile_size=128)]")
    # A layer quantized again reports the kernel it holds.
    again = tk.quantize(model, "int8", kernels="qwix")
    assert {layer.path: layer.kernel for layer in again.layers}["fc"] == "pallas-weight-only"


def test_pallas_notes_for_rules_without_a_kernel():
    def fc_kernel(**fields):
        quant = _only(qr.Rule(**fields), "fc")
        if fields.get("mode") == "qt":
            quant = qr.QtProvider(quant)
        layer = tk.quantize(Net(nnx.Rngs(0)), quant, kernels="pallas").layers[1]
        assert layer.path == "fc"
        return layer.kernel, layer.kernel_note

    assert fc_kernel(weight_qtype="int8", act_qtype="int8") == ("pallas-w8a8", "")
    assert fc_kernel(weight_qtype="int4", tile_size=128) == ("pallas-weight-only", "")
    assert fc_kernel(weight_qtype="fp8", tile_size=128) == ("pallas-weight-only", "")
    assert fc_kernel(weight_qtype="int4", tile_size=64) == (
        "qwix", "the Pallas kernel needs K tiles of a multiple of 128, not 64")
    assert fc_kernel(weight_qtype="int4", act_qtype="int8") == (
        "qwix", "no Pallas kernel for int4 weights x int8 activations")
    assert fc_kernel(act_qtype="int8") == (
        "qwix", "no Pallas kernel for activation-only quantization")
    assert fc_kernel(weight_qtype="int8", weight_calibration_method="minmax") == (
        "qwix", "no Pallas kernel for weight calibration 'minmax' (it has a zero point)")
    assert fc_kernel(weight_qtype="int8", act_qtype="int8", act_calibration_method="minmax") == (
        "qwix", "the Pallas w8a8 kernel needs per-token absmax activation scales")
    assert fc_kernel(weight_qtype="int8", mode="qt") == (
        "qwix", "QT (training) rules run Qwix's training kernel")
    auto = tk.quantize(Net(nnx.Rngs(0)), _only(RULES["int8"], "fc"), kernels="auto").layers[1]
    if jax.default_backend() == "tpu":
        assert (auto.kernel, auto.kernel_note) == ("pallas-weight-only", "")
    else:
        assert (auto.kernel, auto.kernel_note) == (
            "qwix", f"kernels='auto' on a {jax.default_backend()} backend runs Qwix")


def _runs_pallas(fn, *args):
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def _gamma(n):
    return n * U32 / (1 - n * U32)


@pytest.mark.parametrize("name", ["int8", "int4_tiled", "fp8"])
def test_pallas_weight_only_matches_the_reference(name, rng):
    rule = _only(RULES[name], "fc")
    model = Net(nnx.Rngs(0))
    w, x = model.fc.kernel[...], _arr(rng, (2, 5, 256))
    wq = tk.quantize_weight(w, rule, module_path="fc")
    x2 = x.reshape(10, 256)

    def both(x, wq):
        return (tk.linear(x, wq, quant=rule, module_path="fc", kernel="pallas"),
                weight_only_matmul(x.reshape(10, 256), wq.qvalue, wq.scale))

    ours, kernel = jax.jit(both)(x, wq)
    _bitwise(ours.reshape(10, 128), kernel)  # the switch runs exactly this kernel
    assert _runs_pallas(lambda x, wq: both(x, wq)[0], x, wq)
    ref = reference_weight_only_matmul(x2, wq.qvalue, wq.scale)
    qwix_path = tk.linear(x, wq, quant=rule, module_path="fc").reshape(10, 128)
    # Each of the three sums K float32 products of x and the exact weight value
    # q * s (q exact in float32), in some order, and scales once per K tile:
    # each is within gamma_{K+2} * sum_k |x_k| |q_kn s_n| of the exact
    # product (K - 1 additions, one product rounding, one scale rounding),
    # so any two differ by at most twice that.
    q = np.asarray(wq.qvalue.astype(jnp.float32), np.float64)
    s = np.repeat(np.asarray(wq.scale, np.float64), 256 // wq.scale.shape[0], axis=0)
    mag = np.abs(np.asarray(x2, np.float64)) @ np.abs(q * s)
    bound = 2 * _gamma(256 + 2) * mag
    for other in (ref, qwix_path):
        assert np.all(np.abs(np.asarray(ours.reshape(10, 128), np.float64)
                             - np.asarray(other, np.float64)) <= bound)
    # the PTQ layer with kernels='pallas' is the stateless call, bit for bit
    tk.quantize(model, rule, kernels="pallas")
    assert model.fc.matmul_kernel == "pallas-weight-only"
    b = model.fc.bias[...]
    layer, stateless = _in_one_program(
        model, lambda m, x, wq: (m.fc(x), tk.linear(x, wq, b, quant=rule, module_path="fc",
                                                    kernel="pallas")),
        x, wq)
    _bitwise(layer, stateless)


def test_pallas_w8a8_matches_the_reference_and_qwix(rng, near_boundary):
    x, w = _arr(rng, (12, 256)), _arr(rng, (256, 128))
    wq = tk.quantize_weight(w, W8A8)

    def both(x, wq):
        return (tk.linear(x, wq, quant=W8A8, kernel="pallas"),
                w8a8_matmul(x, wq.qvalue, wq.scale),
                reference_w8a8_matmul(x, wq.qvalue, wq.scale))

    ours, kernel, ref = jax.jit(both)(x, wq)
    _bitwise(ours, kernel)
    assert _runs_pallas(lambda x, wq: both(x, wq)[0], x, wq)
    ref = np.asarray(ref, np.float64)
    x64, q64 = np.asarray(x, np.float64), np.abs(np.asarray(wq.qvalue, np.float64))
    w_scale = np.asarray(wq.scale, np.float64)[0]
    x_scale = np.abs(x64).max(axis=1, keepdims=True) / 127.5
    # The reference is traced in the same program, but the kernel is Mosaic
    # code (or its interpretation) and the reference XLA's: a reciprocal may
    # be an ulp apart, so an activation whose a / s lies within a few ulps of
    # a rounding boundary (the conftest's near_boundary, from float64) may
    # take the neighbouring level: one step x_scale * |q_kn| * w_scale each.
    # The int32 sums are otherwise the same integers (exact below 2**24); the
    # two float32 scale products may round in another order: each result is
    # within (1 + u)**2 of acc * x_scale * w_scale, 4.01 u of it apart.
    near = near_boundary(x64, "int8", (-1,))
    flips = x_scale * (near @ q64) * w_scale
    limit = flips + 4.01 * U32 * np.abs(ref) + 1e-30
    np.testing.assert_array_less(np.abs(np.asarray(ours, np.float64) - ref), limit)
    # one activation a level off in a row with no value near a boundary fails
    m = int(np.argmin(near.sum(axis=1)))
    assert not near[m].any()
    assert x_scale[m, 0] * q64[:, 0].max() * w_scale[0] > limit[m, 0]
    # Against Qwix's w8a8 (which divides by its row scale, absmax / 127.5,
    # where the kernel multiplies by a reciprocal of absmax * (1 / 127.5)):
    # the two row scales may differ by one ulp (2 u relative), so a quantized
    # activation may differ by one at a rounding boundary, i.e. by at most one
    # step x_scale per element: |ours - qwix| <= x_scale * sum_k |q_kn| *
    # w_scale, plus 2 u |y| for the scales and each side's two epilogue
    # roundings (2 u |y| each): 6.01 u |y| on the larger magnitude.
    qwix_path = np.asarray(tk.linear(x, wq, quant=W8A8), np.float64)
    step = x_scale * q64.sum(axis=0) * w_scale
    bound = step + 6.01 * U32 * np.maximum(np.abs(qwix_path), np.abs(ref)) + 1e-30
    np.testing.assert_array_less(np.abs(np.asarray(ours, np.float64) - qwix_path), bound)


def test_pallas_w8a8_bf16_activations_against_qwix(rng):
    """bfloat16 activations: the kernel keeps the row scale absmax / 127.5 and
    the quotient x / s in float32; Qwix rounds both to bfloat16 (and its int32
    sum and the product by its row scale too), so many levels differ.

    Bound, per output (y = ours, y' = Qwix's): with s, q the kernel's row
    scale and levels and s', q' Qwix's, y - y' = s w_s sum_k (q_k - q'_k) q_kn
    + (s - s') w_s sum_k q'_k q_kn + roundings. |q - q'| <= 1: q is within 1/2
    of v = a / s, and q' within 1/2 of bf16(a / s'), which is within
    |v| 2^-9 (the scale's bfloat16 rounding) + 1/4 (a quotient below 128 in
    bfloat16 is a multiple of 1/2 at most) < 1/2 of v. So one step
    s |q_kn| w_s per element, plus |s - s'| / s' <= 2^-9 (1 + 2^-8) of |y'|.
    Qwix rounds the int32 sum to bfloat16 and multiplies it by s' in
    bfloat16 (2^-9 each), then by w_s in float32 (u); the kernel's float32
    epilogue rounds twice (4 u) and both return float32. Together
    (2^-9 (1 + 2^-8) + 2 2^-9 + 6 u)(1 + 2^-6) of the larger |y|: the 2^-6
    covers the products of these relative errors."""
    x = jnp.asarray(rng.standard_normal((12, 256)), jnp.bfloat16)
    wq = tk.quantize_weight(_arr(rng, (256, 128)), W8A8)
    ours, qwix_path = jax.jit(lambda x, wq: (
        tk.linear(x, wq, quant=W8A8, kernel="pallas"), tk.linear(x, wq, quant=W8A8)))(x, wq)
    x64, q64 = np.asarray(x, np.float64), np.abs(np.asarray(wq.qvalue, np.float64))
    w_scale = np.asarray(wq.scale, np.float64)[0]
    step = np.abs(x64).max(axis=1, keepdims=True) / 127.5 * q64.sum(axis=0) * w_scale
    assert ours.dtype == qwix_path.dtype == jnp.float32
    ours, qwix_path = np.asarray(ours, np.float64), np.asarray(qwix_path, np.float64)
    rel = (2**-9 * (1 + 2**-8) + 2 * 2**-9 + 6 * U32) * (1 + 2**-6)
    bound = step + rel * np.maximum(np.abs(ours), np.abs(qwix_path)) + 1e-30
    np.testing.assert_array_less(np.abs(ours - qwix_path), bound)
    # A layout error (the rows of another token) or a missed row scale fails.
    assert (np.abs(np.roll(ours, 1, axis=0) - qwix_path) > bound).any()
    unscaled = ours / (np.abs(x64).max(axis=1, keepdims=True) / 127.5)
    assert (np.abs(unscaled - qwix_path) > bound).any()
    # The levels differ at many elements (Qwix's bfloat16 scale and quotient).
    s32 = np.abs(x64).max(axis=1, keepdims=True) / 127.5
    s16 = np.asarray(jnp.asarray(s32, jnp.bfloat16), np.float64)
    q_ours = np.clip(np.round(x64 / s32), -128, 127)
    q_qwix = np.clip(np.round(np.asarray(jnp.asarray(x64 / s16, jnp.bfloat16), np.float64)),
                     -128, 127)
    assert (q_ours != q_qwix).mean() > 0.01


def test_pallas_einsum_layer_runs_the_kernel(rng):
    model = Net(nnx.Rngs(2))
    tk.quantize(model, _only(W8A8, "mix"), kernels="pallas")
    assert model.mix.matmul_kernel == "pallas-w8a8"
    held, bias = model.mix.kernel.get_value(), model.mix.bias[...]
    x = _arr(rng, (2, 3, 128))
    layer, kernel = _in_one_program(model, lambda m, x: (
        m.mix(x), w8a8_matmul(x.reshape(6, 128), held.qvalue, held.scale).reshape(2, 3, 128)
        + bias), x)
    _bitwise(layer, kernel)
    graphdef, state = nnx.split(model)
    assert _runs_pallas(lambda s, x: nnx.merge(graphdef, s).mix(x), state, x)


def test_pallas_switch_falls_back_to_qwix_bitwise(rng):
    """Where no kernel exists (tiled w8a8, an einsum that is not x @ w, a float16
    activation) or ``'auto'`` off a TPU, ``kernel='pallas'`` is the Qwix program."""
    x, w = _arr(rng, (4, 256)), _arr(rng, (256, 128))
    tiled = qr.Rule(weight_qtype="int8", act_qtype="int8", tile_size=128)
    _bitwise(tk.linear(x, w, quant=tiled, kernel="pallas"), tk.linear(x, w, quant=tiled))
    assert not _runs_pallas(lambda x, w: tk.linear(x, w, quant=tiled, kernel="pallas"), x, w)
    _bitwise(tk.einsum("bk,nk->bn", x, w.T, quant="int8", kernel="pallas"),
             tk.einsum("bk,nk->bn", x, w.T, quant="int8"))
    x16 = x.astype(jnp.float16)
    _bitwise(tk.linear(x16, w, quant="int8", kernel="pallas"), tk.linear(x16, w, quant="int8"))
    if jax.default_backend() != "tpu":
        _bitwise(tk.linear(x, w, quant="int8", kernel="auto"), tk.linear(x, w, quant="int8"))
    # an empty activation has no scale: the exact (empty) result, as with Qwix
    assert tk.linear(x[:0], w, quant="int8", kernel="pallas").shape == (0, 128)


@pytest.mark.parametrize("value", ["Pallas", "fast", None, 1])
def test_bad_kernel_values_name_the_argument(value, rng):
    x, w = _arr(rng, (2, 8)), _arr(rng, (8, 4))
    with pytest.raises(tk.TaktinyOpsError, match=r"^kernel: expected one of 'qwix', 'pallas'"):
        tk.linear(x, w, quant="int8", kernel=value)
    with pytest.raises(tk.TaktinyOpsError, match=r"^kernel: "):
        tk.einsum("bk,kn->bn", x, w, kernel=value)
    with pytest.raises(tk.TaktinyOpsError, match=r"^kernel: "):
        tk.dot_general(x, w, (((1,), (0,)), ((), ())), kernel=value)
    model = Net(nnx.Rngs(0))
    with pytest.raises(tk.TaktinyOpsError, match=r"^kernels: expected one of"):
        tk.quantize(model, "int8", kernels=value)
    assert type(model.fc) is tk.Linear  # nothing was swapped
