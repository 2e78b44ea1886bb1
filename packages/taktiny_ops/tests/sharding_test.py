"""out_sharding on 4 host CPU devices under an explicit mesh (its own test target).

The 4 devices are forced host CPU devices (``XLA_FLAGS`` below, read when the
CPU backend starts): where the default backend is an accelerator with fewer
devices (one TPU chip), or where another module started the CPU backend
first (the TPU lane runs every suite in one process), the tests skip and say so.

Inputs come from the seeded ``rng`` fixture (``tools/pytest_main.py``): a
seed fixed per test, printed on failure, replayable with ``TEST_SEED``.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import quantrules as qr
import taktiny_ops as tk


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices()
    if len(devices) != 4:
        pytest.skip("needs 4 devices (forced host CPU devices, XLA_FLAGS="
                    "--xla_force_host_platform_device_count=4); this "
                    f"process has {len(devices)} {jax.default_backend()} device(s)")
    return jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Explicit, AxisType.Explicit))


def _put(mesh, a, spec):
    return jax.device_put(jnp.asarray(a, jnp.float32), NamedSharding(mesh, spec))


QUANTS = [None, "int8", qr.Rule(weight_qtype="int8", act_qtype="int8")]


def _one_step_bound(x, w, quant):
    """Largest |sharded - unsharded| if every quantized operand element rounded
    to a neighbouring integer, plus float32 accumulation slack.

    XLA compiles the partitioned program separately from the unpartitioned
    one and may compute a quantized value as ``x / scale`` in one and as
    ``x * (1 / scale)`` in the other; the two can differ by an ulp and so round
    an element of ``x / scale`` sitting at .5 to the other neighbour: one
    quantization step (the per-row or per-column scale ``absmax / 127``).
    Summed over the contraction that bounds the difference elementwise.
    """
    abs_x, abs_w = np.abs(x), np.abs(w)
    s_w = abs_w.max(axis=0, keepdims=True) / 127  # weight: per output column
    s_x = abs_x.max(axis=1, keepdims=True) / 127 if quant.act_qtype else np.zeros((len(x), 1))
    k = x.shape[1]
    steps = s_x * (abs_w + s_w).sum(0, keepdims=True) + (abs_x + s_x).sum(1, keepdims=True) * s_w
    return steps + k * s_x * s_w + 1e-5 * (abs_x @ abs_w)


@pytest.mark.parametrize("quant", QUANTS, ids=["dense", "w8", "w8a8"])
def test_every_op_returns_the_requested_sharding(mesh, quant, rng):
    x_np, w_np = rng.standard_normal((8, 64)), rng.standard_normal((64, 16))
    x_np, w_np = x_np.astype(np.float32), w_np.astype(np.float32)
    want = NamedSharding(mesh, P("x", "y"))
    with jax.set_mesh(mesh):
        x, w = _put(mesh, x_np, P("x", None)), _put(mesh, w_np, P(None, "y"))
        outs = {
            "linear": tk.linear(x, w, quant=quant, out_sharding=want),
            "einsum": tk.einsum("bi,io->bo", x, w, quant=quant, out_sharding=want),
            "dot_general": tk.dot_general(x, w, (((1,), (0,)), ((), ())), quant=quant,
                                          out_sharding=want),
        }
    unsharded = np.asarray(tk.linear(jnp.asarray(x_np), jnp.asarray(w_np), quant=quant))
    ref = x_np @ w_np
    for name, out in outs.items():
        assert out.sharding.spec == want.spec, name
        got = np.asarray(out)
        if quant is None:
            np.testing.assert_allclose(got, unsharded, rtol=1e-5, atol=1e-5)
            continue
        rule = qr.Rule(weight_qtype="int8") if quant == "int8" else quant
        bound = _one_step_bound(x_np, w_np, rule)
        assert (np.abs(got - unsharded) <= bound).all(), (name, np.abs(got - unsharded).max())
        # and it is a quantized result as good as the unsharded one
        assert np.abs(got - ref).max() <= 2.5 * np.abs(unsharded - ref).max() + 1e-5, name
        assert np.abs(got - ref).max() > 0, name  # it quantized


def test_qarray_einsum_sharded_path_dequantizes(mesh, rng):
    x_np, w_np = rng.standard_normal((8, 32)), rng.standard_normal((32, 8))
    want = NamedSharding(mesh, P("x", None))
    wq = qwix.quantize(jnp.asarray(w_np, jnp.float32), jnp.int8, channelwise_axes=(1,))
    with jax.set_mesh(mesh):
        x = _put(mesh, x_np, P("x", None))
        out = tk.einsum("bi,io->bo", x, wq, out_sharding=want)
    assert out.sharding.spec == want.spec
    ref = jnp.asarray(x_np, jnp.float32) @ qwix.dequantize(wq)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_conv_out_sharding(mesh, rng):
    a_np, k_np = rng.standard_normal((4, 16, 8)), rng.standard_normal((3, 8, 4))
    want = NamedSharding(mesh, P("x", None, None))
    w8a8 = qr.Rule(weight_qtype="int8", act_qtype="int8")
    conv = dict(dimension_numbers=("NWC", "WIO", "NWC"), quant=w8a8)
    with jax.set_mesh(mesh):
        a, k = _put(mesh, a_np, P("x", None, None)), _put(mesh, k_np, P())
        out = tk.conv_general_dilated(a, k, (1,), "SAME", out_sharding=want, **conv)
    assert out.sharding.spec == want.spec
    unsharded = tk.conv_general_dilated(jnp.asarray(a_np, jnp.float32),
                                        jnp.asarray(k_np, jnp.float32), (1,), "SAME", **conv)
    dense = jax.lax.conv_general_dilated(jnp.asarray(a_np, jnp.float32),
                                         jnp.asarray(k_np, jnp.float32), (1,), "SAME",
                                         dimension_numbers=("NWC", "WIO", "NWC"))
    # The batch axis is split across devices, so each device runs the same
    # per-example program: rounding may still differ (see _one_step_bound), so
    # hold the sharded result to the unsharded one's accuracy.
    err = float(jnp.abs(out - dense).max())
    assert 0 < err <= 2.5 * float(jnp.abs(unsharded - dense).max()) + 1e-5
    np.testing.assert_allclose(np.asarray(out), np.asarray(unsharded), rtol=0.05, atol=0.05)


def test_qt_with_out_sharding_raises(mesh):
    with jax.set_mesh(mesh), pytest.raises(NotImplementedError, match="out_sharding"):
        tk.einsum("bi,io->bo", _put(mesh, np.ones((4, 8)), P("x", None)),
                  _put(mesh, np.ones((8, 4)), P()),
                  quant=qr.QtProvider([qr.Rule(weight_qtype="int8")]),
                  out_sharding=NamedSharding(mesh, P("x", None)))
