"""out_sharding on 4 host CPU devices under an explicit mesh (its own test target)."""

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

RNG = np.random.default_rng()


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) == 4
    return jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Explicit, AxisType.Explicit))


def _put(mesh, a, spec):
    return jax.device_put(jnp.asarray(a, jnp.float32), NamedSharding(mesh, spec))


QUANTS = [None, "int8", qr.Rule(weight_qtype="int8", act_qtype="int8")]


@pytest.mark.parametrize("quant", QUANTS, ids=["dense", "w8", "w8a8"])
def test_every_op_returns_the_requested_sharding(mesh, quant):
    x_np, w_np = RNG.standard_normal((8, 64)), RNG.standard_normal((64, 16))
    want = NamedSharding(mesh, P("x", "y"))
    with jax.set_mesh(mesh):
        x, w = _put(mesh, x_np, P("x", None)), _put(mesh, w_np, P(None, "y"))
        outs = {
            "linear": tk.linear(x, w, quant=quant, out_sharding=want),
            "einsum": tk.einsum("bi,io->bo", x, w, quant=quant, out_sharding=want),
            "dot_general": tk.dot_general(x, w, (((1,), (0,)), ((), ())), quant=quant,
                                          out_sharding=want),
        }
    unsharded = tk.linear(jnp.asarray(x_np, jnp.float32), jnp.asarray(w_np, jnp.float32),
                          quant=quant)
    ref = x_np @ w_np
    for name, out in outs.items():
        assert out.sharding.spec == want.spec, name
        if quant is None:
            np.testing.assert_allclose(np.asarray(out), np.asarray(unsharded), rtol=1e-5, atol=1e-5)
        else:
            # Partitioned and unpartitioned programs may round a quantized
            # value differently (division vs reciprocal); both must be equally
            # good quantized results.
            bound = 2.5 * np.abs(np.asarray(unsharded) - ref).max() + 1e-5
            assert np.abs(np.asarray(out) - ref).max() <= bound, name
            assert np.abs(np.asarray(out) - ref).max() > 0  # it quantized


def test_qarray_einsum_sharded_path_dequantizes(mesh):
    x_np, w_np = RNG.standard_normal((8, 32)), RNG.standard_normal((32, 8))
    want = NamedSharding(mesh, P("x", None))
    wq = qwix.quantize(jnp.asarray(w_np, jnp.float32), jnp.int8, channelwise_axes=(1,))
    with jax.set_mesh(mesh):
        x = _put(mesh, x_np, P("x", None))
        out = tk.einsum("bi,io->bo", x, wq, out_sharding=want)
    assert out.sharding.spec == want.spec
    ref = jnp.asarray(x_np, jnp.float32) @ qwix.dequantize(wq)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_conv_out_sharding(mesh):
    a_np, k_np = RNG.standard_normal((4, 16, 8)), RNG.standard_normal((3, 8, 4))
    want = NamedSharding(mesh, P("x", None, None))
    with jax.set_mesh(mesh):
        a, k = _put(mesh, a_np, P("x", None, None)), _put(mesh, k_np, P())
        out = tk.conv_general_dilated(a, k, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
                                      quant=qr.Rule(weight_qtype="int8", act_qtype="int8"),
                                      out_sharding=want)
    assert out.sharding.spec == want.spec


def test_qt_with_out_sharding_raises(mesh):
    with jax.set_mesh(mesh), pytest.raises(NotImplementedError, match="out_sharding"):
        tk.einsum("bi,io->bo", _put(mesh, np.ones((4, 8)), P("x", None)),
                  _put(mesh, np.ones((8, 4)), P()),
                  quant=qr.QtProvider([qr.Rule(weight_qtype="int8")]),
                  out_sharding=NamedSharding(mesh, P("x", None)))
