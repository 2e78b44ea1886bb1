"""The NNX layers and taktiny_ops.quantize: bitwise equal to the stateless ops
(same rules, same inputs) and to Qwix's own ``quantize_model`` where Qwix can
express the rules, PTQ and QT (gradients through ``nnx.grad``); bad rules and
unsupported layers raise TaktinyOpsError by path.

Bit for bit is claimed within ONE jitted program (the model and its
reference traced together), on any backend, for the same quantized weights
(a PTQ model quantizes them once, in a program of its own). Layers called eagerly, op by op
(``TAKTINY_OPS_EAGER_JIT=0``) or as one cached jit per layer, are other
programs: each layer is checked on a seeded input against the stateless op,
bit for bit on the CPU and elsewhere within a flipped rounding of the values
near a rounding boundary (the conftest's ``cross_program_bound`` with the
operands' absmax axes, derived there; ``programs_agree``). Op-by-op comparison with Qwix's
model is per layer in test_oracle_qwix.py.
"""

import dataclasses
import functools

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


def _run(model, x, mode):
    return nnx.jit(lambda m, x: m(x))(model, x) if mode == "compiled" else model(x)


def _bitwise(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


class Net(nnx.Module):
    """Taktiny's own layers at mlp/fc1, mlp/fc2, mix and convs/0."""

    def __init__(self, rngs):
        self.mlp = nnx.Dict(fc1=tk.Linear(32, 48, rngs=rngs), fc2=tk.Linear(48, 16, rngs=rngs))
        self.mix = tk.Einsum("btd,dh->bth", (16, 24), (24,), rngs=rngs)
        self.convs = nnx.List([tk.Conv(24, 8, (3,), strides=2, padding="SAME", rngs=rngs)])

    def __call__(self, x):
        h = jax.nn.relu(self.mlp["fc1"](x))
        h = self.mix(self.mlp["fc2"](h))
        return self.convs[0](h)


def _randomize(model, rng):
    """Random kernels and biases (zero biases would hide a missing bias add)."""
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            var.set_value(_arr(rng, var.shape))


CONV_DN = ("NWC", "WIO", "NWC")


def _stateless_layer(path, params, h, quant):
    """One layer of Net from the stateless ops, at its hand-written path."""
    k, b = params[f"{path}/kernel"], params[f"{path}/bias"]
    if path.startswith("mlp/"):
        return tk.linear(h, k, b, quant=quant, module_path=path)
    if path == "mix":
        return tk.einsum("btd,dh->bth", h, k, quant=quant, module_path=path) + b.reshape(1, 1, -1)
    y = tk.conv_general_dilated(h, k, (2,), "SAME", dimension_numbers=CONV_DN, quant=quant,
                                module_path=path)
    return y + b.reshape(1, 1, -1)


def _stateless(params, x, quant):
    """Net's forward from the stateless ops."""
    h = jax.nn.relu(_stateless_layer("mlp/fc1", params, x, quant))
    for path in ("mlp/fc2", "mix", "convs/0"):
        h = _stateless_layer(path, params, h, quant)
    return h


# Each layer of Net: its input shape, its op, its bilinear product in float64
# (None: the convolution, the conv64 fixture's), the absmax axes of its input
# and of its kernel (Qwix's calibration: a dot_general or einsum keeps the
# non-contracting axes, a convolution the batch axis of x and the output
# features of w).
LAYERS = {
    "mlp/fc1": ((2, 6, 32), "dot_general", np.matmul, (-1,), (0,)),
    "mlp/fc2": ((2, 6, 48), "dot_general", np.matmul, (-1,), (0,)),
    "mix": ((2, 6, 16), "einsum", lambda a, b: np.einsum("btd,dh->bth", a, b), (-1,), (0,)),
    "convs/0": ((2, 6, 24), "conv_general_dilated", None, (1, 2), (0, 1)),
}


def _layer(model, path):
    return model.convs[0] if path == "convs/0" else (
        model.mix if path == "mix" else model.mlp[path.split("/")[1]])


def _each_layer_within_bound(model, params, rules, rng, bound, conv64, agree, mode):
    """Every layer called eagerly agrees with its stateless op run the same
    way (op by op: both op by op; compiled: the layer's cached jit against
    the stateless op in a jit), on a seeded input: bit for bit on the CPU,
    elsewhere within ``bound`` with the operands' absmax axes (``agree``: the
    conftest's ``programs_agree``). An op-by-op w8a8 layer against a compiled
    one differs on the CPU too (the float epilogue rounds in another order),
    so op by op is compared with op by op."""
    for path, (shape, op, product, x_axes, w_axes) in LAYERS.items():
        product = product or (lambda a, b: conv64(a, b, (2,), CONV_DN))
        h = _arr(rng, shape)
        got = _layer(model, path)(h)
        stateless = functools.partial(_stateless_layer, path, quant=rules)
        want = stateless(params, h) if mode == "op_by_op" else jax.jit(stateless)(params, h)
        res = qr.resolve(rules, module_path=path, op=op)
        rule = None if res is None or res.disabled else res.rule

        def limit(h=h, path=path, product=product, rule=rule, x_axes=x_axes, w_axes=w_axes):
            bias = np.abs(np.asarray(params[f"{path}/bias"]))
            # the bias add rounds once more: half an ulp of |y| <= |s| + |bias|
            return bound(product, h, params[f"{path}/kernel"], rule, x_axes=x_axes,
                         w_axes=w_axes, tile_size=rule.tile_size if rule else None) + 2**-23 * bias

        agree(got, want, limit)


def _params(model):
    return {"/".join(map(str, path)): var[...] for path, var in nnx.iter_graph(model)
            if isinstance(var, nnx.Param)}


RULE_SETS = {
    "int8": [qr.Rule(weight_qtype="int8")],
    "int4-tiles": [qr.Rule(op_names=("conv_general_dilated",), weight_qtype="int8"),
                   qr.Rule(weight_qtype="int4", tile_size=8)],
    "w8a8": [qr.Rule(weight_qtype="int8", act_qtype="int8")],
    "mixed-paths": [qr.Rule(module_path="mlp/fc2", weight_qtype=None),
                    qr.Rule(module_path="mlp/.*", weight_qtype="int8", act_qtype="int8"),
                    qr.Rule(op_names=("einsum",), weight_qtype="int4"),
                    qr.Rule(weight_qtype="float8_e4m3fn", act_qtype="float8_e4m3fn")],
}


def _one_program(model, params, x, quant):
    """(model(x), the stateless forward) traced into one jitted program."""
    return nnx.jit(lambda m, p, x: (m(x), _stateless(p, x, quant)))(model, params, x)


@pytest.mark.parametrize("name", list(RULE_SETS))
def test_ptq_layers_bitwise_equal_stateless_ops(name, mode, rng, cross_program_bound, conv64,
                                                programs_agree):
    rules = RULE_SETS[name]
    model = Net(nnx.Rngs(int(rng.integers(1 << 30))))
    _randomize(model, rng)
    params = _params(model)
    x = _arr(rng, (2, 6, 32))
    report = tk.quantize(model, rules)
    if mode == "compiled":
        _bitwise(*_one_program(model, params, x, rules))
    # called eagerly, each layer runs op by op or as one cached jit of itself
    _each_layer_within_bound(model, params, rules, rng, cross_program_bound, conv64,
                             programs_agree, mode)
    paths = [layer.path for layer in report.layers]
    assert paths == ["convs/0", "mix", "mlp/fc1", "mlp/fc2"]
    for layer in report.layers:
        want = qr.explain(rules, module_path=layer.path, op=layer.op).summary
        assert layer.rule == want
    quantized, float_out = jax.jit(lambda p, x: (_stateless(p, x, tuple(rules)),
                                                 _stateless(p, x, None)))(params, x)
    assert not np.array_equal(np.asarray(_run(model, x, mode)), np.asarray(float_out))
    assert not np.array_equal(np.asarray(quantized), np.asarray(float_out))


def test_ptq_kernel_is_held_packed(rng):
    model = Net(nnx.Rngs(0))
    report = tk.quantize(model, RULE_SETS["int4-tiles"])
    fc1 = model.mlp["fc1"]
    assert isinstance(fc1, tk.QuantizedLinear) and isinstance(fc1.kernel, tk.QuantizedKernel)
    q = fc1.kernel.get_value()
    assert q.qvalue.dtype == jnp.int4 and q.qvalue.shape == (32, 48)
    assert q.scale.shape == (32 // 8, 48)
    by_path = {layer.path: layer for layer in report.layers}
    assert by_path["mlp/fc1"].bytes_after == 32 * 48 // 2 + q.scale.nbytes
    assert by_path["mlp/fc1"].bytes_before == 32 * 48 * 4


@pytest.mark.parametrize("bwd", [None, "int8"])
def test_qt_layers_and_grads_bitwise_equal_stateless_ops(bwd, mode, rng, cross_program_bound,
                                                         conv64, programs_agree):
    """Gradients within one program only: across programs a flipped forward
    rounding moves the loss's derivative too, with no useful bound."""
    rules = qr.QtProvider([qr.Rule(weight_qtype="int8", act_qtype="int8", bwd_qtype=bwd,
                                   mode="qt")])
    model = Net(nnx.Rngs(1))
    _randomize(model, rng)
    params = _params(model)
    x = _arr(rng, (2, 6, 32))
    tk.quantize(model, rules)
    assert isinstance(model.mlp["fc1"].kernel, nnx.Param)  # QT keeps the float kernel
    _each_layer_within_bound(model, params, rules, rng, cross_program_bound, conv64,
                             programs_agree, mode)
    if mode != "compiled":
        return

    def forward_and_grads(m, p, x):
        ours = _params(nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(m))
        theirs = jax.grad(lambda p: jnp.sum(jnp.sin(_stateless(p, x, rules))))(p)
        return (m(x), _stateless(p, x, rules)), ours, theirs

    outputs, ours, theirs = nnx.jit(forward_and_grads)(model, params, x)
    _bitwise(*outputs)
    assert ours.keys() == theirs.keys()
    for key in ours:
        _bitwise(ours[key], theirs[key])


class Plain(nnx.Module):
    """Flax's own layers, as Qwix quantizes them."""

    def __init__(self, rngs):
        self.fc1 = nnx.Linear(32, 48, rngs=rngs)
        self.ein = nnx.Einsum("btd,dh->bth", (48, 16), (16,), rngs=rngs)
        self.conv = nnx.Conv(16, 8, (3, 3), strides=(1, 2), rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.fc1(x))
        h = self.ein(h)  # (b, t, 16)
        h = self.conv(h.reshape(h.shape[0], 2, -1, 16))
        return self.head(h)


QWIX_RULE_SETS = {
    "int8-weights": [qr.Rule(module_path="conv", weight_qtype="int8", act_qtype="int8"),
                     qr.Rule(weight_qtype="int8")],
    "int4-tiles": [qr.Rule(module_path="head", weight_qtype=None),
                   qr.Rule(module_path="conv", weight_qtype="int8", act_qtype="int8"),
                   qr.Rule(weight_qtype="int4", tile_size=16)],
    "w8a8": [qr.Rule(weight_qtype="int8", act_qtype="int8")],
}


def _with_qwix(ours, theirs, x):
    """(ours(x), theirs(x)) traced into one jitted program."""
    return nnx.jit(lambda a, b, x: (a(x), b(x)))(ours, theirs, x)


def _scale_axes(q):
    """(axes, tile) of a QArray's absmax: the axes its scale keeps at size 1,
    or the one axis it tiles and the tile length."""
    pairs = list(zip(q.qvalue.shape, q.scale.shape, strict=True))
    tiled = [(i, n // m) for i, (n, m) in enumerate(pairs) if 1 < m < n]
    if tiled:
        (axis, tile), = tiled
        return (axis,), tile
    return tuple(i for i, (n, m) in enumerate(pairs) if m == 1 < n), None


def _take_qwix_weights(ours, qmodel, floats, near_boundary):
    """Give our PTQ layers the QArrays Qwix's model holds.

    Each side quantized its weights once, eagerly, in a program of its own
    (quantize / quantize_model). On the CPU they are equal, values and
    scales. Elsewhere a level may differ, by one, only where the float weight
    (``floats``: path to kernel) lies within a few ulps of a rounding
    boundary (the conftest's ``near_boundary``, from the float64 weights),
    and a scale by two roundings (2^-22). Checked so, then Qwix's are taken,
    so that the one-program comparison covers everything that runs per call."""
    for name in ("fc1", "ein", "conv", "head"):
        layer = getattr(ours, name)
        if not isinstance(layer.kernel, tk.QuantizedKernel):
            continue
        mine, held = layer.kernel.get_value(), getattr(qmodel, name).kernel.array
        theirs = dataclasses.replace(held, qvalue=held.qvalue[...], scale=held.scale[...])
        assert mine.qvalue.shape == theirs.qvalue.shape and mine.scale.shape == theirs.scale.shape
        q_mine, q_theirs = (np.asarray(q.qvalue, np.int32) for q in (mine, theirs))
        axes, tile = _scale_axes(mine)
        near = near_boundary(floats[f"{name}/kernel"], mine.qvalue.dtype.name, axes, tile)
        # Near: each group's absmax where negative (-A / s = -b exactly, the
        # boundary between -2^(n-1) and the next level); any other Gaussian
        # weight that near (2^-21 of its index) with probability about 1e-4.
        assert near.sum() <= mine.scale.size + 0.01 * near.size, (name, int(near.sum()))
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(q_mine, q_theirs, err_msg=name)
            np.testing.assert_array_equal(np.asarray(mine.scale), np.asarray(theirs.scale))
        else:
            levels = np.abs(q_mine - q_theirs)
            assert levels.max(initial=0) <= 1, (name, int(levels.max()))
            assert not (levels[~near]).any(), (name, int((levels > 0).sum()), int(near.sum()))
            np.testing.assert_allclose(np.asarray(mine.scale), np.asarray(theirs.scale),
                                       rtol=2**-22)
        layer.kernel.set_value(theirs)


@pytest.mark.parametrize("name", list(QWIX_RULE_SETS))
def test_ptq_bitwise_equals_qwix_quantize_model(name, rng, near_boundary):
    rules = QWIX_RULE_SETS[name]
    seed = int(rng.integers(1 << 30))
    x = _arr(rng, (2, 6, 32))
    ours, theirs = Plain(nnx.Rngs(seed)), Plain(nnx.Rngs(seed))
    state_rng = np.random.default_rng(seed)
    _randomize(ours, state_rng)
    nnx.update(theirs, nnx.state(ours, nnx.Param))
    qmodel = qwix.quantize_model(theirs, qwix.PtqProvider(qr.to_qwix(rules)), x)
    floats = _params(ours)
    report = tk.quantize(ours, rules)
    assert {layer.path: layer.mode for layer in report.layers}["head"] == (
        "float" if name == "int4-tiles" else "ptq")
    _take_qwix_weights(ours, qmodel, floats, near_boundary)
    _bitwise(*_with_qwix(ours, qmodel, x))


def test_qt_forward_and_grads_bitwise_equal_qwix_quantize_model(rng):
    rules = [qr.Rule(module_path="ein", weight_qtype=None),
             qr.Rule(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8", mode="qt")]
    seed = int(rng.integers(1 << 30))
    x = _arr(rng, (2, 6, 32))
    ours, theirs = Plain(nnx.Rngs(seed)), Plain(nnx.Rngs(seed))
    _randomize(ours, np.random.default_rng(seed))
    nnx.update(theirs, nnx.state(ours, nnx.Param))
    qmodel = qwix.quantize_model(theirs, qwix.QtProvider(qr.to_qwix(rules)), x)
    tk.quantize(ours, rules)
    _bitwise(*_with_qwix(ours, qmodel, x))

    def grads(a, b, x):
        fn = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x)) * m(x)))
        return _params(fn(a)), _params(fn(b))

    g_ours, g_theirs = nnx.jit(grads)(ours, qmodel, x)
    assert g_ours.keys() == g_theirs.keys()
    for key in g_ours:
        _bitwise(g_ours[key], g_theirs[key])


def test_batch_axes_and_unbatched_inputs_match_nnx_conv(rng):
    """Several (or no) batch axes are flattened as nnx.Conv does."""
    ours = tk.Conv(3, 5, (3, 3), padding=1, rngs=nnx.Rngs(0))
    ref = nnx.Conv(3, 5, (3, 3), padding=1, rngs=nnx.Rngs(0))
    _randomize(ours, rng)
    nnx.update(ref, nnx.state(ours, nnx.Param))
    for shape in ((2, 3, 6, 6, 3), (6, 6, 3)):
        x = _arr(rng, shape)
        _bitwise(ours(x), ref(x))


def test_already_quantized_layers_are_reported_not_requantized():
    model = Net(nnx.Rngs(0))
    tk.quantize(model, "int8")
    kernel = model.mlp["fc1"].kernel.get_value()
    report = tk.quantize(model, "int4")
    again = model.mlp["fc1"].kernel.get_value()
    assert again.qvalue.dtype == jnp.int8
    _bitwise(again.qvalue, kernel.qvalue)
    assert all("already quantized" in layer.rule for layer in report.layers)


def _error(model, rules, match):
    with pytest.raises(tk.TaktinyOpsError, match=match):
        tk.quantize(model, rules)


def test_bad_rules_raise_naming_the_layer_path():
    _error(Net(nnx.Rngs(0)), [qr.Rule(module_path="mlp/.*", weight_qtype="int8", tile_size=7)],
           r"^mlp/fc1: .*tile_size=7")
    _error(Net(nnx.Rngs(0)), [qr.Rule(op_names=("conv_general_dilated",),
                                      weight_qtype="int8", tile_size=8)],
           r"^convs/0: rule #0 sets tile_size=8")
    _error(Net(nnx.Rngs(0)), [qr.Rule(module_path="convs/.*", weight_qtype="int8",
                                      act_qtype="int4")],
           r"^convs/0: .*one integer type")
    _error(Net(nnx.Rngs(0)), [qr.Rule(weight_qtype="int8", act_qtype="int8",
                                      act_static_scale=True)],
           r"^convs/0: rule #0 sets act_static_scale")
    if jax.default_backend() == "cpu":
        _error(Net(nnx.Rngs(0)), [qr.Rule(module_path="mix", weight_qtype="int4",
                                          act_qtype="int4")], r"^mix: rule #0: .*int4 x int4")
    _error(Net(nnx.Rngs(0)), 42, r"^quant: ")


def test_unsupported_layers_raise_naming_the_layer_path():
    class Odd(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([nnx.LinearGeneral(4, (2, 3), rngs=rngs)])
            self.up = nnx.ConvTranspose(3, 2, (3,), rngs=rngs)
            self.circ = nnx.Conv(3, 2, (3,), padding="CIRCULAR", rngs=rngs)
            self.low = nnx.Linear(3, 2, dtype=jnp.bfloat16, rngs=rngs)

    _error(Odd(nnx.Rngs(0)), [qr.Rule(module_path="blocks/.*", weight_qtype="int8")],
           r"^blocks/0: rule #0 selects this flax.nnx.*LinearGeneral")
    _error(Odd(nnx.Rngs(0)), [qr.Rule(module_path="up", weight_qtype="int8")],
           r"^up: .*ConvTranspose")
    _error(Odd(nnx.Rngs(0)), [qr.Rule(module_path="circ", weight_qtype="int8")],
           r"^circ: padding: 'CIRCULAR' is not supported")
    _error(Odd(nnx.Rngs(0)), [qr.Rule(module_path="low", weight_qtype="int8")],
           r"^low: Linear sets dtype=")
    report = tk.quantize(Odd(nnx.Rngs(0)), [qr.Rule(module_path="(up|circ|low|blocks/.*)",
                                                    weight_qtype=None)])
    assert [layer.mode for layer in report.layers] == ["float"] * 4
    _error(tk.Linear(2, 2, rngs=nnx.Rngs(0)), "int8", r"^model: the model itself is a layer")


def test_wrong_inputs_raise_taktiny_ops_error(rng):
    model = Net(nnx.Rngs(0))
    tk.quantize(model, "int8")
    with pytest.raises(tk.TaktinyOpsError, match=r"^x: expected shape \(\.\.\., 32\)"):
        model.mlp["fc1"](_arr(rng, (2, 31)))
    with pytest.raises(tk.TaktinyOpsError, match=r"^subscripts: "):
        model.mix(_arr(rng, (2, 17)))
    with pytest.raises(tk.TaktinyOpsError, match=r"^x: expected 24 input features"):
        model.convs[0](_arr(rng, (2, 9, 23)))
