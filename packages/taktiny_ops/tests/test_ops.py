"""Behaviour of the four ops against dense JAX, with seeded random inputs.

Every test draws from the ``rng`` fixture of the repository's pytest plugin
(``tools/pytest_main.py``): a seed stable per test, printed when it fails.

Bit-for-bit claims compare results of ONE jitted program (``_one_program``):
two differently compiled programs may fuse, order and round differently on
an accelerator. Float references are float32 products (the package's
conftest sets ``jax.default_matmul_precision("highest")``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

import quantrules as qr
import taktiny_ops as tk

_DRAW: dict[str, np.random.Generator] = {}


@pytest.fixture(autouse=True)
def _seeded_inputs(rng):
    """Every ``arr`` draw of a test comes from that test's seeded generator."""
    _DRAW["rng"] = rng
    yield
    _DRAW.clear()


def arr(*shape, dtype=jnp.float32):
    return jnp.asarray(_DRAW["rng"].standard_normal(shape), dtype)


def _one_program(fn, *args):
    """``fn(*args)`` (a tuple of results) traced and compiled as one program."""
    return jax.jit(fn)(*args)


# ---------------------------------------------------------------- quant=None is plain JAX


def test_dense_paths_equal_jax_exactly():
    x, w, b = arr(3, 5, 8), arr(8, 6), arr(6)
    dn = (((2,), (0,)), ((), ()))
    a, k = arr(2, 11, 3), arr(3, 3, 4)
    args = ((2,), [(1, 1)])
    kw = dict(rhs_dilation=(2,), dimension_numbers=("NWC", "WIO", "NWC"))
    pairs = _one_program(lambda x, w, b, a, k: (
        (tk.linear(x, w, b), jnp.matmul(x, w) + b),
        (tk.dot_general(x, w, dn), jax.lax.dot_general(x, w, dn)),
        (tk.einsum("bti,io->bto", x, w), jnp.einsum("bti,io->bto", x, w)),
        (tk.conv_general_dilated(a, k, *args, **kw), jax.lax.conv_general_dilated(a, k, *args, **kw)),
    ), x, w, b, a, k)
    for ours, theirs in pairs:
        np.testing.assert_array_equal(ours, theirs)


def test_three_operand_dense_einsum_with_optimize():
    a, b, c = arr(4, 5), arr(5, 6), arr(6, 3)
    np.testing.assert_allclose(
        tk.einsum("ij,jk,kl->il", a, b, c, optimize="greedy"), a @ b @ c, rtol=1e-5, atol=1e-5
    )


def test_qarray_inputs_use_qwix_without_quant():
    x, w = arr(4, 32), arr(32, 8)
    wq = qwix.quantize(w, jnp.int8, channelwise_axes=(1,))
    dn = (((1,), (0,)), ((), ()))
    ours, expected = _one_program(lambda a, b: (
        (tk.dot_general(a, b, dn), tk.einsum("bi,io->bo", a, b)),
        (qwix.dot_general(a, b, dn), qwix.einsum("bi,io->bo", a, b))), x, wq)
    for got, want in zip(ours, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="optimize: QArray inputs without quant need"):
        tk.einsum("bi,io->bo", x, wq, optimize="greedy")
    # a selected rule the QArray matches (qtype, channel axis) takes it as is:
    # Qwix's own product of the QArray; another rule dequantizes it first,
    # then quantizes again
    w4 = qr.Rule(weight_qtype="int4")  # channelwise int4: not the QArray's qtype
    as_is, qwix_product, ours, requantized = _one_program(lambda a, b: (
        tk.linear(a, b, quant="int8"), qwix.dot_general(a, b, dn),
        tk.linear(a, b, quant=w4), tk.linear(a, qwix.dequantize(b), quant=w4)), x, wq)
    np.testing.assert_array_equal(as_is, qwix_product)
    np.testing.assert_array_equal(ours, requantized)
    assert not np.array_equal(ours, as_is)


# ---------------------------------------------------------------- quantized error bounds

BOUNDS = {"int8": 0.02, "fp8": 0.08, "int4": 0.25, "nf4": 0.25}


@pytest.mark.parametrize("qtype", sorted(BOUNDS))
def test_quantized_error_within_documented_bounds(qtype):
    x, w = arr(16, 256), arr(256, 32)
    ref = x @ w
    for out in (
        tk.linear(x, w, quant=qtype),
        tk.einsum("bi,io->bo", x, w, quant=qtype),
        tk.dot_general(x, w, (((1,), (0,)), ((), ())), quant=qtype),
    ):
        rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        assert 0 < rel < BOUNDS[qtype], (qtype, rel)


def test_weight_only_conv_works():
    x, k = arr(2, 12, 3), arr(3, 3, 8)
    ref = jax.lax.conv_general_dilated(x, k, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
    out = tk.conv_general_dilated(
        x, k, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"), quant="int8"
    )
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert 0 < rel < 0.02


def test_activation_only_rule_quantizes_the_activation():
    x, w = arr(8, 64), arr(64, 4)
    rule = qr.Rule(act_qtype="int8")
    # One program: the reference's quantized activation is the op's (another
    # program may round a value at a boundary the other way).
    out, ref, plain = _one_program(lambda x, w: (
        tk.linear(x, w, quant=rule),
        qwix.dequantize(qwix.quantize(x, jnp.int8, channelwise_axes=(0,))) @ w, x @ w), x, w)
    assert not np.array_equal(out, plain)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_rules_match_path_and_disable():
    x, w = arr(4, 64), arr(64, 4)
    rules = [qr.Rule(module_path="head"), qr.Rule(module_path="enc/.*", weight_qtype="int8")]
    dg = [qr.Rule(op_names=("dot_general",), weight_qtype="int8")]
    conv_only = [qr.Rule(op_names=("conv_general_dilated",), weight_qtype="int8")]
    plain, head, dec, enc, ein_dg, ein_conv = _one_program(lambda x, w: (
        x @ w,
        tk.linear(x, w, quant=rules, module_path="head"),
        tk.linear(x, w, quant=rules, module_path="dec/1"),
        tk.linear(x, w, quant=rules, module_path="enc.1"),
        tk.einsum("bi,io->bo", x, w, quant=dg),  # einsum matches dot_general rules
        tk.einsum("bi,io->bo", x, w, quant=conv_only)), x, w)
    np.testing.assert_array_equal(head, plain)
    np.testing.assert_array_equal(dec, plain)
    assert not np.array_equal(enc, plain)
    assert not np.array_equal(ein_dg, plain)
    np.testing.assert_array_equal(ein_conv, plain)


def test_dot_general_operand_roles():
    a, b = arr(4, 64), arr(64, 4)
    dn = (((1,), (0,)), ((), ()))
    rule = qr.Rule(weight_qtype="int4", tile_size=16)
    lhs_w, ref = _one_program(lambda a, b: (
        tk.dot_general(a, b, dn, quant=rule, lhs_weight=True, rhs_weight=False),
        qwix.dequantize(qwix.quantize(a, jnp.int4, channelwise_axes=(0,), tiled_axes={1: 16}))
        @ b), a, b)
    np.testing.assert_allclose(lhs_w, ref, rtol=1e-5, atol=1e-5)


def test_einsum_roles_follow_operand_order_not_contraction_order():
    x, w = arr(3, 64), arr(64, 5)
    rule = qr.Rule(weight_qtype="int4", tile_size=16)
    # the weight is the second operand even when the subscripts put it first in the output
    out, ref = _one_program(lambda x, w: (
        tk.einsum("bi,io->ob", x, w, quant=rule),
        (x @ qwix.dequantize(qwix.quantize(w, jnp.int4, channelwise_axes=(1,),
                                           tiled_axes={0: 16}))).T), x, w)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_qt_einsum_gradients_when_jax_swaps_operands():
    x, w = arr(6, 32), arr(32, 4)
    rule = qr.Rule(weight_qtype="int8", act_qtype="int8", mode="qt")
    for spec in ("bi,io->bo", "bi,io->ob"):
        gx, gw = jax.grad(
            lambda a, b, s=spec: jnp.sum(tk.einsum(s, a, b, quant=rule) ** 2), argnums=(0, 1)
        )(x, w)
        rx, rw = jax.grad(lambda a, b, s=spec: jnp.sum(jnp.einsum(s, a, b) ** 2), argnums=(0, 1))(
            x, w
        )
        for g, r in ((gx, rx), (gw, rw)):
            assert g.shape == r.shape
            rel = float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))
            assert rel < 0.05, (spec, rel)


def test_qt_linear_grad_flows():
    x, w = arr(8, 32), arr(32, 4)
    rule = qr.Rule(weight_qtype="int8", mode="qt", bwd_qtype="int8")
    g = jax.grad(lambda k: jnp.sum(tk.linear(x, k, quant=qr.QtProvider([rule]))))(w)
    ref = jax.grad(lambda k: jnp.sum(x @ k))(w)
    assert float(jnp.linalg.norm(g - ref) / jnp.linalg.norm(ref)) < 0.05


def test_unary_einsum_with_rule_stays_jax():
    x = arr(4, 5)
    np.testing.assert_array_equal(tk.einsum("ij->ji", x, quant="int8"), x.T)


def test_more_than_two_operands_with_rule_raise():
    with pytest.raises(ValueError, match="operands: a quantization rule needs a two-operand"):
        tk.einsum("ij,jk,kl->il", arr(2, 3), arr(3, 4), arr(4, 5), quant="int8")


# ---------------------------------------------------------------- dtypes (the seed's table)


@pytest.mark.parametrize(
    ("inputs", "quant", "preferred", "expected"),
    [
        ((jnp.float32, jnp.float32), None, None, jnp.float32),
        ((jnp.bfloat16, jnp.bfloat16), None, None, jnp.bfloat16),
        ((jnp.bfloat16, jnp.float32), None, None, jnp.float32),
        ((jnp.float32, jnp.float32), "int8", jnp.bfloat16, jnp.bfloat16),
        ((jnp.bfloat16, jnp.bfloat16), "int8", None, jnp.bfloat16),
        ((jnp.float8_e4m3fn, jnp.float8_e4m3fn), None, None, jnp.bfloat16),
        ((jnp.int8, jnp.int8), "int8", None, jnp.float32),
        ((jnp.int32, jnp.int32), None, None, jnp.int32),
        ((jnp.float16, jnp.float16), None, jnp.float32, jnp.float32),
    ],
)
def test_dtype_table(inputs, quant, preferred, expected):
    x = jnp.asarray(_DRAW["rng"].integers(-3, 3, (2, 32)), inputs[0])
    w = jnp.asarray(_DRAW["rng"].integers(-3, 3, (32, 4)), inputs[1])
    for out in (
        tk.linear(x, w, quant=quant, preferred_element_type=preferred),
        tk.einsum("bi,io->bo", x, w, quant=quant, preferred_element_type=preferred),
        tk.dot_general(
            x, w, (((1,), (0,)), ((), ())), quant=quant, preferred_element_type=preferred
        ),
    ):
        assert out.dtype == expected


def test_bias_dtype_and_quantized_bias():
    x, w = arr(2, 8, dtype=jnp.bfloat16), arr(8, 3, dtype=jnp.bfloat16)
    b = arr(3)
    assert tk.linear(x, w, b).dtype == jnp.float32
    assert tk.linear(x, w, b, preferred_element_type=jnp.bfloat16).dtype == jnp.bfloat16
    bq = qwix.quantize(arr(1, 3), jnp.int8, channelwise_axes=(1,))
    x32, w32 = arr(2, 8), arr(8, 3)
    out = tk.linear(x32, w32, bq)
    assert out.dtype == jnp.float32
    # a quantized bias is dequantized and added: the dense product plus its value
    np.testing.assert_allclose(out, x32 @ w32 + qwix.dequantize(bq)[0], rtol=1e-5, atol=1e-5)


def test_qarray_scale_dtype_promotes():
    wq = qwix.quantize(arr(32, 4, dtype=jnp.bfloat16), jnp.int8, channelwise_axes=(1,))
    assert tk.linear(arr(2, 32, dtype=jnp.bfloat16), wq).dtype == jnp.bfloat16


# ---------------------------------------------------------------- transformations


def test_jit_grad_vmap_through_every_op(cross_program_bound, programs_agree):
    x, w = arr(4, 32), arr(32, 8)
    rule = qr.Rule(weight_qtype="int8", act_qtype="int8")
    lin = jax.jit(lambda a, b: tk.linear(a, b, quant=rule))
    # The op inside a user's jit and the eager call are two programs: equal
    # bits on the CPU, elsewhere within a flipped rounding of the values near
    # a rounding boundary (per row of x, per column of w: conftest).
    programs_agree(lin(x, w), tk.linear(x, w, quant=rule), lambda: cross_program_bound(
        np.matmul, x, w, rule, x_axes=(-1,), w_axes=(0,)))
    ein = jax.vmap(lambda a: tk.einsum("i,io->o", a, w, quant="int8"))(x)
    # vmapped rows equal the batched weight-only call (the weight is quantized
    # the same way) up to the two-program bound on every backend: a vector
    # product and a matrix product sum in another order even on the CPU
    # (the bound's accumulation term; a flipped weight only near a boundary).
    err = np.abs(np.asarray(ein, np.float64) - np.asarray(tk.einsum("bi,io->bo", x, w,
                                                                    quant="int8")))
    assert (err <= cross_program_bound(np.matmul, x, w, qr.weight_only("int8"),
                                       w_axes=(0,))).all()
    g = jax.grad(lambda a: jnp.sum(tk.dot_general(a, w, (((1,), (0,)), ((), ())))))(x)
    # Row sums of w cancel to near zero for some rows, so the rounding bound is
    # absolute: a float32 sum of 8 terms is off by at most ~8 ulp of sum(|w|).
    atol = 8 * float(np.finfo(np.float32).eps) * float(jnp.abs(w).sum(1).max())
    np.testing.assert_allclose(g, jnp.broadcast_to(w.sum(1), x.shape), rtol=1e-5, atol=atol)
    lhs, kernel = arr(1, 8, 2), arr(3, 2, 4)
    conv_kw = dict(window_strides=(1,), padding="VALID", dimension_numbers=("NWC", "WIO", "NWC"))
    qt = qr.Rule(weight_qtype="int8", act_qtype="int8", mode="qt")
    c = jax.jit(jax.grad(lambda k: jnp.sum(tk.conv_general_dilated(lhs, k, quant=qt, **conv_kw))))(
        kernel
    )
    # QT differentiates through the fake-quantized operands: the kernel gradient
    # stays within the int8 bound (BOUNDS) of the dense gradient.
    dense = jax.grad(lambda k: jnp.sum(jax.lax.conv_general_dilated(lhs, k, **conv_kw)))(kernel)
    rel = float(jnp.linalg.norm(c - dense) / jnp.linalg.norm(dense))
    assert 0 < rel < BOUNDS["int8"], rel


def test_two_program_bound_rejects_another_mode(cross_program_bound):
    """With the operands' absmax axes the two-program bound can fail: a
    weight-only result is outside the w8a8 bound of the w8a8 result, and the
    float product outside the int8 weight-only bound (without the axes every
    value may move a step, and both passed)."""
    x, w = arr(8, 64), arr(64, 16)
    w8a8 = qr.Rule(weight_qtype="int8", act_qtype="int8")
    both, weights, dense = _one_program(lambda a, b: (
        tk.linear(a, b, quant=w8a8), tk.linear(a, b, quant="int8"), a @ b), x, w)
    limit = cross_program_bound(np.matmul, x, w, w8a8, x_axes=(-1,), w_axes=(0,))
    assert (np.abs(np.asarray(weights, np.float64) - np.asarray(both)) > limit).any()
    limit = cross_program_bound(np.matmul, x, w, qr.weight_only("int8"), w_axes=(0,))
    assert (np.abs(np.asarray(dense, np.float64) - np.asarray(weights)) > limit).any()
    # one step of one weight (its column's absmax / 127.5) fails it too
    planted = np.asarray(weights, np.float64).copy()
    planted[0, 0] += np.abs(np.asarray(x[0], np.float64)).max() * np.abs(w[:, 0]).max() / 127.5
    assert abs(planted[0, 0] - float(weights[0, 0])) > limit[0, 0]


def test_rule_resolution_happens_at_trace_time(monkeypatch):
    calls = []
    real = qr.resolve
    monkeypatch.setattr(qr, "resolve", lambda *a, **k: calls.append(1) or real(*a, **k))
    f = jax.jit(lambda a, b: tk.linear(a, b, quant="int8"))
    x, w = arr(2, 16), arr(16, 4)
    f(x, w)
    f(x + 1, w)
    f(x * 2, w)
    assert len(calls) == 1


# ---------------------------------------------------------------- unsupported features


def test_int4_by_int4_on_cpu_raises_clearly():
    """XLA:CPU cannot contract two int4 operands: a clear error there; other
    backends contract them (integer sums, exact) and scale."""
    w4a4 = qr.Rule(weight_qtype="int4", act_qtype="int4")
    x, w = arr(2, 32), arr(32, 4)
    if jax.default_backend() == "cpu":
        with pytest.raises(NotImplementedError, match="int4 x int4 contractions are not supported"):
            tk.linear(x, w, quant=w4a4)
        with pytest.raises(NotImplementedError, match="int4 x int4"):
            tk.einsum("bi,io->bo", x, w, quant=w4a4)
    else:
        # One program (the reference's quantized values are the op's). The
        # integer sum is exact; both sides then round a float32 product of
        # 32 terms (relative 2^-24 each): 1e-4 is far above that.
        *outs, ref = _one_program(lambda x, w: (
            tk.linear(x, w, quant=w4a4), tk.einsum("bi,io->bo", x, w, quant=w4a4),
            qwix.dequantize(qwix.quantize(x, jnp.int4, channelwise_axes=(0,)))
            @ qwix.dequantize(qwix.quantize(w, jnp.int4, channelwise_axes=(1,)))), x, w)
        for out in outs:
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    # one 4-bit operand is fine (one program, as above)
    out, ref = _one_program(lambda x, w: (
        tk.linear(x, w, quant=qr.Rule(weight_qtype="int4", act_qtype="int8")),
        qwix.dequantize(qwix.quantize(x, jnp.int8, channelwise_axes=(0,)))
        @ qwix.dequantize(qwix.quantize(w, jnp.int4, channelwise_axes=(1,)))), x, w)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_stateless_limits_raise_not_implemented():
    x, w = arr(2, 16), arr(16, 4)
    with pytest.raises(NotImplementedError, match="act_static_scale"):
        tk.linear(x, w, quant=qr.Rule(weight_qtype="int8", act_qtype="int8", act_static_scale=True))
    with pytest.raises(NotImplementedError, match="bwd_stochastic_rounding"):
        tk.linear(
            x, w, quant=qr.Rule(weight_qtype="int8", mode="qt", bwd_stochastic_rounding="uniform")
        )
    with pytest.raises(NotImplementedError, match="tile_size=8; tiled"):
        tk.conv_general_dilated(
            arr(1, 8, 16),
            arr(3, 16, 4),
            (1,),
            "SAME",
            dimension_numbers=("NWC", "WIO", "NWC"),
            quant=qr.Rule(weight_qtype="int8", tile_size=8),
        )
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    with pytest.raises(NotImplementedError, match="out_sharding: QT"):
        tk.linear(
            x,
            w,
            quant=qr.Rule(weight_qtype="int8", mode="qt"),
            out_sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
        )


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (lambda: tk.linear(arr(2, 3), arr(4, 5)), ValueError, "w: in_features 4 does not match"),
        (lambda: tk.linear(arr(2, 3), arr(3)), ValueError, r"w: expected shape \(in_features"),
        (lambda: tk.linear(arr(2, 3), arr(3, 4), arr(5)), ValueError, "b: shape"),
        (
            lambda: tk.dot_general(arr(2, 3), arr(4, 5), (((1,), (0,)), ((), ()))),
            ValueError,
            "contracting dimension sizes differ: lhs axis 1 has 3, rhs axis 0 has 4",
        ),
        (
            lambda: tk.dot_general(arr(2, 3), arr(3, 5), (((2,), (0,)), ((), ()))),
            ValueError,
            "axis 2 is out of range for lhs of rank 2",
        ),
        (
            lambda: tk.dot_general(arr(2, 3), arr(3, 5), "ij,jk"),
            ValueError,
            "dimension_numbers: expected",
        ),
        (lambda: tk.einsum("ij,jk->ik", arr(2, 3)), ValueError, "names 2 operand"),
        (lambda: tk.einsum("ij,jk->ik", arr(2, 3), arr(4, 5)), ValueError, "index 'j' has size 3"),
        (
            lambda: tk.einsum("ijk,jk->i", arr(2, 3), arr(3, 4)),
            ValueError,
            "term 'ijk' does not fit operand 0",
        ),
        (lambda: tk.einsum(3, arr(2, 3)), ValueError, "subscripts: expected an einsum"),
        (
            lambda: tk.conv_general_dilated(arr(1, 8, 2), arr(3, 2, 4), (1,), "FULL"),
            ValueError,
            "padding: expected one of",
        ),
        (
            lambda: tk.conv_general_dilated(arr(1, 8, 2), arr(3, 2, 4), (1,), [(1, 1), (0, 0)]),
            ValueError,
            r"padding: expected 1 \(low, high\) pairs",
        ),
        (
            lambda: tk.conv_general_dilated(arr(1, 8, 2), arr(3, 2, 4), (1, 1), "SAME"),
            ValueError,
            "window_strides: expected 1 positive integers",
        ),
        (
            lambda: tk.conv_general_dilated(arr(1, 8, 2), arr(3, 4), (1,), "SAME"),
            ValueError,
            "rhs: lhs and rhs need the same rank",
        ),
        (lambda: tk.linear(arr(2, 3), arr(3, 4), quant="int9"), ValueError, "unknown qtype 'int9'"),
        (lambda: tk.linear(arr(2, 3), arr(3, 4), quant=7), ValueError, "quant: expected None"),
    ],
)
def test_bad_input_raises_clearly(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


# ---------------------------------------------------------------- eager calls run compiled


def test_eager_calls_run_one_cached_jit(monkeypatch):
    import taktiny_ops._dot as dot_module

    calls = []
    real = dot_module.select_rule

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(dot_module, "select_rule", counting)
    x, w = arr(6, 32), arr(32, 8)
    rules = [qr.Rule(module_path="enc/.*", weight_qtype="int8", act_qtype="int8")]
    first = tk.linear(x, w, quant=rules, module_path="enc/fc")
    again = tk.linear(x, w, quant=list(rules), module_path="enc/fc")  # an equal, new list
    assert len(calls) == 1  # resolved once, at trace time; the second call hit the cache
    np.testing.assert_array_equal(first, again)
    tk.linear(x, w, quant=rules, module_path="dec/fc")  # another static argument: a new trace
    assert len(calls) == 2
    np.testing.assert_array_equal(
        first, jax.jit(lambda a, b: tk.linear(a, b, quant=rules, module_path="enc/fc"))(x, w)
    )


def test_eager_jit_can_be_turned_off(monkeypatch, cross_program_bound, programs_agree):
    x, w = arr(6, 32), arr(32, 8)
    compiled = tk.linear(x, w, quant="int8")
    monkeypatch.setenv("TAKTINY_OPS_EAGER_JIT", "0")
    op_by_op = tk.linear(x, w, quant="int8")
    # Two programs: equal bits on the CPU, elsewhere within a flipped
    # rounding of the weights near a rounding boundary (conftest).
    programs_agree(op_by_op, compiled, lambda: cross_program_bound(
        np.matmul, x, w, qr.weight_only("int8"), w_axes=(0,)))
    # Errors are the same either way.
    with pytest.raises(ValueError, match="w: in_features"):
        tk.linear(x, arr(16, 8))
    monkeypatch.delenv("TAKTINY_OPS_EAGER_JIT")
    with pytest.raises(ValueError, match="w: in_features"):
        tk.linear(x, arr(16, 8))
    with pytest.raises(TypeError):
        tk.linear(x, w, bogus=1)


@pytest.mark.parametrize("op", ["linear", "einsum", "dot_general"])
def test_tile_that_does_not_divide_the_axis_is_taktiny_error(op):
    """Found by fuzzing: the int4 shorthand (tile 128) on a 1-wide contraction
    raised Qwix's bare ValueError; it is a TaktinyOpsError naming the rule."""
    x, w = arr(2, 1), arr(1, 3)
    call = {
        "linear": lambda: tk.linear(x, w, quant="int4"),
        "einsum": lambda: tk.einsum("bi,io->bo", x, w, quant="int4"),
        "dot_general": lambda: tk.dot_general(x, w, (((1,), (0,)), ((), ())), quant="int4"),
    }[op]
    with pytest.raises(tk.TaktinyOpsError, match=r"quant: rule #0 \(tile_size=128\)"):
        call()


@pytest.mark.parametrize("quant", ["int8", qr.Rule(weight_qtype="int4", act_qtype="int8"),
                                   qr.Rule(weight_qtype="int8", act_qtype="int8", mode="qt")])
@pytest.mark.parametrize(("x_shape", "w_shape"), [((0, 8), (8, 3)), ((2, 0), (0, 3))])
def test_empty_operands_give_the_exact_empty_or_zero_result(quant, x_shape, w_shape):
    """Found by fuzzing: an empty batch with activation quantization raised
    ZeroDivisionError inside Qwix; empty operands now skip quantization."""
    x, w = jnp.ones(x_shape), jnp.ones(w_shape)
    expected = np.zeros((x_shape[0], w_shape[1]), np.float32)
    for out in (
        tk.linear(x, w, quant=quant),
        tk.einsum("bi,io->bo", x, w, quant=quant),
        tk.dot_general(x, w, (((1,), (0,)), ((), ())), quant=quant),
    ):
        np.testing.assert_array_equal(np.asarray(out, np.float32), expected)


@pytest.mark.parametrize(("spec", "x_shape", "w_shape"), [
    ("ab,b->", (2, 3), (3,)),
    ("ab,c->ca", (2, 3), (4,)),
    ("a,->", (3,), ()),
    ("...ab,...b->...", (5, 2, 3), (5, 3)),
])
@pytest.mark.parametrize("quant", ["int8", qr.Rule(weight_qtype="int8", act_qtype="int8"),
                                   qr.QtProvider([qr.Rule(weight_qtype="int8")])])
def test_index_summed_out_of_one_operand(spec, x_shape, w_shape, quant):
    """Found by fuzzing: an index only one operand has and the output lacks
    gave Qwix's einsum the wrong result shape ('ab,b->' returned shape (2,))
    and the QT path a TaktinyOpsError; it is summed out first, and the result
    matches NumPy within the int8 rounding bound."""
    x, w = arr(*x_shape), arr(*w_shape)
    out = tk.einsum(spec, x, w, quant=quant)
    ref = np.einsum(spec, np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert out.shape == ref.shape
    # Each of the (at most 3) summed products is off by at most
    # dx |w| + dw (|x| + dx) with dx, dw <= max|.| / 254 (the summed
    # operand's absmax grows at most 3x).
    mx, mw = 3 * float(np.abs(x).max()), float(np.abs(w).max())
    bound = 3 * (mx / 254 * mw + mw / 254 * (mx + mx / 254)) + 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=0, atol=bound)


def test_tile_without_a_contraction_is_taktiny_error():
    """Found by fuzzing: a tiled rule on an outer product raised IndexError
    inside Qwix (no contracting axis to tile)."""
    x, w = arr(2, 3), arr(4)
    with pytest.raises(tk.TaktinyOpsError, match="contract no axis to tile"):
        tk.dot_general(x, w, (((), ()), ((), ())), quant="int4")
    with pytest.raises(tk.TaktinyOpsError, match="'ab,c->abc' contracts no index to tile"):
        tk.einsum("ab,c->abc", x, w, quant="int4")


def test_ellipsis_dimensions_that_do_not_broadcast_are_taktiny_error():
    """Found by fuzzing: '...' standing for (4,) in one operand and (3,) in
    the other reached Qwix's and opt_einsum's own ValueErrors."""
    with pytest.raises(tk.TaktinyOpsError, match=r"'\.\.\.' stands for do not broadcast"):
        tk.einsum("...a,...a->...", arr(4, 2), arr(3, 2), quant="int8")
    out = tk.einsum("...a,...a->...", arr(4, 2), arr(1, 2), quant="int8")  # 1 broadcasts
    assert out.shape == (4,)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(window_strides=(0,)), r"window_strides: expected 1 positive integers"),
    (dict(rhs_dilation=(0,)), r"rhs_dilation: expected 1 positive integers"),
    (dict(lhs_dilation=(2,)), r"padding: 'SAME' is not defined with lhs_dilation=\(2,\)"),
    (dict(feature_group_count=0), "feature_group_count: expected a positive integer"),
    (dict(feature_group_count=3), "feature_group_count: lhs's 2 input features do not divide"),
    (dict(feature_group_count=2, batch_group_count=2), "batch_group_count: at most one"),
    (dict(dimension_numbers=("NCC", "OIW", "NCW")), "dimension_numbers: convolution"),
    (dict(rhs_shape=(4, 3, 3)), "rhs: lhs has 2 input features, so with feature_group_count=1"),
])
def test_conv_arguments_jax_rejects_are_taktiny_errors(kwargs, message):
    """Found by fuzzing: each of these reached JAX's TypeError/ValueError
    (a zero stride only when XLA lowered it, as a verifier error)."""
    args = dict(window_strides=(1,), padding="SAME")
    args.update(kwargs)
    rhs = arr(*args.pop("rhs_shape", (4, 2, 3)))
    with pytest.raises(tk.TaktinyOpsError, match=message):
        tk.conv_general_dilated(arr(1, 2, 8), rhs, **args)


def test_conv_transposed_with_explicit_padding_matches_dense():
    x, k = arr(1, 2, 5), arr(3, 2, 2)
    out = tk.conv_general_dilated(x, k, (1,), [(1, 1)], lhs_dilation=(2,), quant=None)
    ref = jax.lax.conv_general_dilated(x, k, (1,), [(1, 1)], lhs_dilation=(2,))
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("quant", [qr.Rule(weight_qtype="int8", act_qtype="int8"),
                                   qr.QtProvider([qr.Rule(weight_qtype="int8",
                                                          act_qtype="int8")])])
@pytest.mark.parametrize(("x_shape", "k_shape"), [((0, 2, 5), (3, 2, 2)),
                                                  ((1, 2, 1), (3, 2, 2))])
def test_conv_empty_input_or_result_is_exact(quant, x_shape, k_shape):
    """Found by fuzzing: an empty batch, or a kernel wider than the input
    (an empty result), made Qwix reshape a size-0 array into a scale; the
    exact (empty) result comes back."""
    out = tk.conv_general_dilated(jnp.ones(x_shape), jnp.ones(k_shape), (1,), "VALID", quant=quant)
    expected = jax.lax.conv_general_dilated(jnp.ones(x_shape), jnp.ones(k_shape), (1,), "VALID")
    assert out.shape == expected.shape and 0 in out.shape


def test_conv_mixed_integer_qtypes_raise_not_implemented():
    """Found by fuzzing: int8 activations with int4 weights reached JAX's
    'requires arguments to have the same dtypes' TypeError."""
    with pytest.raises(NotImplementedError, match="int8 and weights to int4"):
        tk.conv_general_dilated(arr(1, 2, 8), arr(3, 2, 3), (1,), "SAME",
                                quant=qr.Rule(weight_qtype="int4", act_qtype="int8"))
