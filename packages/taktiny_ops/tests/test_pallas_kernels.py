"""The Pallas TPU matmul kernels against NumPy: compiled on a TPU, interpreted elsewhere.

Weights are quantized by Qwix itself (the layout the kernels take); the
references are float64/int64 NumPy. The integer parts of w8a8 (the int8
activation values and the int32 accumulation) are compared bit for bit; float
results within the bounds derived beside each check. A lowering test exports
each kernel for the TPU platform on any host: Pallas lowers to a Mosaic custom
call (Mosaic's own compilation happens on the chip, not here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

import quantrules
from taktiny_ops import _kernels as kernels_module
from taktiny_ops import _pallas_blocks as blocks_module
from taktiny_ops import _qwix_private as P
from taktiny_ops._common import TaktinyOpsError
from taktiny_ops._pallas_blocks import plan, use_interpret
from taktiny_ops._pallas_matmul import reference_weight_only_matmul, weight_only_matmul
from taktiny_ops._pallas_w8a8 import MAX_K, reference_w8a8_matmul, w8a8_matmul, w8a8_parts

U32 = 2.0**-24  # float32 unit roundoff
U_OUT = {"float32": U32, "bfloat16": 2.0**-8}
_S = jax.ShapeDtypeStruct


def qwix_weight(w: jax.Array, qtype: str, tile: int | None) -> qwix.QArray:
    """The rhs of x[M, K] @ w[K, N] quantized as Qwix's dot_general does."""
    how = P.dot_how(dimension_numbers=(((1,), (0,)), ((), ())), ndims=(2, 2),
                    for_lhs=False, tile_size=tile, qtype=qtype, calibration_method="absmax")
    return P.quantize(w, how)


def f64(a: jax.Array) -> np.ndarray:
    return np.asarray(a.astype(jnp.float32), dtype=np.float64)


def dequantized(q: qwix.QArray) -> np.ndarray:
    """Qwix's layout read as documented: rows g*t .. g*t+t-1 use scale[g]."""
    qv, s = f64(q.qvalue), f64(q.scale)
    return qv * np.repeat(s, qv.shape[0] // s.shape[0], axis=0)


# (qtype, tile, x dtype, result dtype, M, K, N, blocks): odd M and N are
# padded; explicit blocks give several K and N steps (the accumulator and the
# scale per K tile) and several row blocks (block_m: 3 to 4 of them, the last
# one padded), int4 with N padded from 200 to 256 among them.
WEIGHT_ONLY = [
    ("int8", None, "bfloat16", "bfloat16", 5, 384, 200, {}),
    ("int8", 128, "float32", "float32", 19, 384, 256, {"block_k": 256, "block_n": 128}),
    ("int8", 128, "float32", "float32", 20, 256, 256,
     {"block_m": 8, "block_k": 128, "block_n": 128}),
    ("int4", None, "bfloat16", "float32", 16, 512, 256, {"block_k": 128}),
    ("int4", 128, "bfloat16", "float32", 3, 512, 384, {"block_k": 256, "block_n": 128}),
    ("int4", None, "bfloat16", "bfloat16", 50, 256, 200, {"block_m": 16, "block_n": 128}),
    ("float8_e4m3fn", 256, "bfloat16", "bfloat16", 7, 512, 130, {}),
    ("float8_e5m2", None, "float32", "float32", 9, 256, 128, {}),
]


@pytest.mark.parametrize(("qtype", "tile", "xdt", "odt", "m", "k", "n", "blocks"), WEIGHT_ONLY)
def test_weight_only_matches_numpy(rng: np.random.Generator, qtype: str, tile: int | None,
                                   xdt: str, odt: str, m: int, k: int, n: int,
                                   blocks: dict) -> None:
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    q = qwix_weight(w, qtype, tile)
    groups = 1 if tile is None else k // tile
    assert q.scale.shape == (groups, n) and q.qvalue.shape == (k, n)
    deq = dequantized(q)
    # The documented layout is Qwix's: its own dequantize gives the same floats.
    np.testing.assert_array_equal(deq.astype(np.float32), np.asarray(qwix.dequantize(q)))
    x = jnp.asarray(rng.standard_normal((m, k)), xdt)
    y = weight_only_matmul(x, q.qvalue, q.scale, out_dtype=odt, **blocks)
    y_ref = reference_weight_only_matmul(x, q.qvalue, q.scale, out_dtype=odt)
    assert y.dtype == y_ref.dtype == jnp.dtype(odt) and y.shape == (m, n)
    exact = f64(x) @ deq
    # Bound: the float32 products x*q (one rounding for float32 x; exact for
    # bf16 x), a float32 sum of at most K terms per output ((K-1)u), one
    # rounding per K tile for the scale and G-1 more additions: at most
    # (2K + G + 2)u times sum_k |x q s|, any summation order; a bf16 result
    # adds its own rounding, 2^-8 of the value.
    mag = np.abs(f64(x)) @ np.abs(deq)
    bound = (2 * k + groups + 2) * U32 * mag
    bound = bound + U_OUT[odt] * (np.abs(exact) + bound) * (odt != "float32")
    assert np.all(np.abs(f64(y) - exact) <= bound)
    assert np.all(np.abs(f64(y_ref) - exact) <= bound)


def _activation(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    x = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.1, 10.0, (m, 1))
    x[1] = 0.0  # an all-zero row: Qwix's scale guard makes its scale 1
    # A row whose absmax is 127.5 has scale 1 and reciprocal 1: x*inv lands on
    # exact halves, which round to even (2.5 -> 2, -3.5 -> -4), and the
    # extremes map to 128 -> clipped 127 and -128.
    x[2] = np.resize(np.array([127.5, -127.5, 2.5, -3.5, 0.5, -0.5, 1.5], np.float32), k)
    return x


def _np_scales(x: np.ndarray) -> np.ndarray:
    """Qwix's absmax rule in float32 NumPy: absmax times float32(1/127.5), guarded."""
    absmax = np.max(np.abs(x), axis=1).astype(np.float32)
    scale = absmax * np.float32(1 / 127.5)
    return np.where(scale < np.sqrt(np.finfo(np.float32).tiny), np.float32(1), scale)


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


# Several K and N blocks (the requantized path), then one K block over two N
# blocks (the int8 activation block made once and kept across N); each again
# over 3 and 4 row blocks of 32 (the kept block remade for every row block).
@pytest.mark.parametrize(("m", "blocks"), [
    (37, {"block_k": 128, "block_n": 128}),
    (37, {"block_n": 128}),
    (70, {"block_m": 32, "block_k": 128, "block_n": 128}),
    (100, {"block_m": 32, "block_n": 128}),
])
@pytest.mark.parametrize("xdt", ["bfloat16", "float32"])
def test_w8a8_integer_parts_bit_for_bit(rng: np.random.Generator, m: int, blocks: dict,
                                        xdt: str) -> None:
    k, n = 384, 200
    x = jnp.asarray(_activation(rng, m, k), xdt)
    q = qwix_weight(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), "int8", None)
    # Everything below comes from ONE program: the kernel's parts, its float32
    # and x.dtype results and the reference's. Within one program the
    # reciprocal that picks each int8 level is the same compiled division;
    # across two, a TPU's division may differ by an ulp and an ulp can move a
    # level, which neither the bit-for-bit check nor the 3.01u bound allows.
    parts, y, y_ref, y16 = jax.jit(lambda a: (
        w8a8_parts(a, q.qvalue, q.scale, **blocks),
        w8a8_matmul(a, q.qvalue, q.scale, out_dtype=jnp.float32, **blocks),
        reference_w8a8_matmul(a, q.qvalue, q.scale, out_dtype=jnp.float32),
        w8a8_matmul(a, q.qvalue, q.scale, **blocks)))(x)
    q_x, x_scale, x_inv, acc = parts
    xf = np.asarray(x.astype(jnp.float32))
    # The scale is one float32 product: bit for bit on every backend.
    np.testing.assert_array_equal(np.asarray(x_scale), _np_scales(xf))
    # The reciprocal is a float32 division, correctly rounded on a CPU; a TPU's
    # division is allowed 1 ulp. It is computed once, before the kernel.
    assert _ulps(np.asarray(x_inv), np.float32(1) / np.asarray(x_scale)).max() <= 1
    # Given x_inv, the int8 values are exact: one product, round half even, clip.
    q_np = np.clip(np.rint(xf * np.asarray(x_inv)[:, None]), -128, 127).astype(np.int8)
    np.testing.assert_array_equal(np.asarray(q_x), q_np)
    assert q_np[2, :7].tolist() == [127, -128, 2, -4, 0, 0, 2] and not q_np[1].any()
    s_np = np.asarray(x_scale)
    acc_np = q_np.astype(np.int64) @ np.asarray(q.qvalue, np.int64)
    np.testing.assert_array_equal(np.asarray(acc, np.int64), acc_np)

    # Bound: acc -> float32 (one rounding), times x_scale, times w_scale: three
    # roundings of a product, so |y - exact| <= ((1+u)^3 - 1)|exact| < 3.01u|exact|.
    exact = acc_np * s_np.astype(np.float64)[:, None] * f64(q.scale)
    assert np.all(np.abs(f64(y) - exact) <= 3.01 * U32 * np.abs(exact))
    # The reference runs the same float32 operations in the same order.
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    assert y16.dtype == jnp.dtype(xdt)
    # A bf16 result: one more rounding of 2^-8 of the value.
    assert np.all(np.abs(f64(y16) - exact)
                  <= (3.01 * U32 + U_OUT[xdt] * (1 + 3.01 * U32)) * np.abs(exact))


def _ops(qtype: str = "int8", groups: int = 1, k: int = 256, n: int = 128):
    x = jnp.ones((4, k), jnp.bfloat16)
    return x, jnp.ones((k, n), qtype), jnp.ones((groups, n), jnp.float32)


@pytest.mark.parametrize(("change", "arg"), [
    (lambda x, q, s: (x[0], q, s), "x"),
    (lambda x, q, s: (x.astype(jnp.int32), q, s), "x"),
    (lambda x, q, s: (x, q.astype(jnp.int16), s), "qvalue"),
    (lambda x, q, s: (x, q[:128], s), "qvalue"),
    (lambda x, q, s: (x, q, s[:, :64]), "scale"),
    (lambda x, q, s: (x, q, jnp.ones((3, 128), jnp.float32)), "scale"),  # 3 does not divide 256
    (lambda x, q, s: (x, q, jnp.ones((4, 128), jnp.float32)), "scale"),  # tile 64
])
def test_bad_operands_raise(change, arg: str) -> None:
    x, q, s = change(*_ops())
    for fn in (weight_only_matmul, reference_weight_only_matmul, w8a8_matmul,
               reference_w8a8_matmul):
        with pytest.raises(TaktinyOpsError, match=rf"^{arg}\b"):  # the message opens with it
            fn(x, q, s)


def test_bad_options_raise() -> None:
    x, q, s = _ops()
    with pytest.raises(TaktinyOpsError, match=r"^block_n\b"):
        weight_only_matmul(x, q, s, block_n=100)
    with pytest.raises(TaktinyOpsError, match=r"^block_m\b"):
        w8a8_matmul(x, q, s, block_m=16)  # its int8 activation block needs 32 rows
    with pytest.raises(TaktinyOpsError, match=r"^block_k\b"):
        weight_only_matmul(*_ops(groups=2, k=512), block_k=128)  # the tile is 256
    with pytest.raises(TaktinyOpsError, match=r"^out_dtype\b"):
        weight_only_matmul(x, q, s, out_dtype=jnp.int32)
    with pytest.raises(TaktinyOpsError, match=r"^scale\b"):
        w8a8_matmul(*_ops(groups=2))  # w8a8 takes channelwise weights only
    with pytest.raises(TaktinyOpsError, match=r"^qvalue\b"):
        w8a8_matmul(*_ops(qtype="int4"))


@pytest.mark.parametrize("fn", [w8a8_matmul, reference_w8a8_matmul])
def test_w8a8_refuses_a_k_its_int32_sum_cannot_hold(fn) -> None:
    # |q_x * qvalue| <= 128 * 128 (both can be -128), so K terms stay within
    # int32 for K <= (2**31 - 1) // 2**14 = 131071; one more could wrap silently.
    assert MAX_K == 131071

    def shapes(k: int) -> tuple:
        return (_S((2, k), jnp.bfloat16), _S((k, 128), jnp.int8), _S((1, 128), jnp.float32))

    with pytest.raises(TaktinyOpsError, match=r"^x\b.*K=131072\b.*131071"):
        jax.eval_shape(fn, *shapes(MAX_K + 1))  # traced only: nothing is allocated
    assert jax.eval_shape(fn, *shapes(MAX_K)).shape == (2, 128)


def _w8a8_resolution(**rule: object) -> quantrules.Resolution:
    return quantrules.resolve(quantrules.PtqProvider(
        [quantrules.Rule(weight_qtype="int8", **rule)]), op="dot_general")


def test_tpu_v4_runs_qwix_for_w8a8(monkeypatch: pytest.MonkeyPatch) -> None:
    # A v4's MXU has no int8 matmul: the w8a8 kernel raises there, so neither
    # 'auto' nor 'pallas' may pick it; weight-only kernels still run.
    w8a8, int8 = _w8a8_resolution(act_qtype="int8"), _w8a8_resolution()
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(blocks_module, "tpu_generation", lambda: "v4")
    for switch in ("auto", "pallas"):
        assert kernels_module.choose(switch, w8a8) == (
            kernels_module.QWIX, "the TPU v4 has no int8 MXU matmul")
        assert kernels_module.choose(switch, int8) == (kernels_module.WEIGHT_ONLY, "")
    monkeypatch.setattr(blocks_module, "tpu_generation", lambda: "v5e")
    assert kernels_module.choose("auto", w8a8) == (kernels_module.W8A8, "")


def test_plan_pads_to_legal_blocks() -> None:
    p = plan("weight_only", 5, 200, 384, block_m=None, block_n=None, block_k=None, m_step=16)
    assert p.bm % 16 == 0 and p.bn % 128 == 0 and p.bk % 128 == 0
    assert (p.m_pad % p.bm, p.n_pad % p.bn, p.k_pad % p.bk) == (0, 0, 0)
    assert p.m_pad >= 5 and p.n_pad >= 200 and p.k_pad >= 384
    assert use_interpret(None) == (jax.default_backend() != "tpu")


def test_v5e_table_quantizes_each_activation_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocks_module, "tpu_generation", lambda: "v5e")
    # K fits one block: the int8 activation block is made once, kept across N.
    p = plan("w8a8", 8192, 14336, 4096, block_m=None, block_n=None, block_k=None, m_step=32)
    assert (p.bm, p.bk, p.k_pad) == (512, 4096, 4096) and 14336 % p.bn == 0
    # K too long for one block: all of N in one block instead.
    p = plan("w8a8", 8192, 4096, 14336, block_m=None, block_n=None, block_k=None, m_step=32)
    assert (p.bn, p.n_pad, p.bk) == (4096, 4096, 2048)
    # Small M: few, large weight blocks that divide the weight exactly.
    p = plan("weight_only", 16, 14336, 4096, block_m=None, block_n=None, block_k=None,
             m_step=16)
    assert p[:3] == (16, 2048, 1024) and (p.n_pad, p.k_pad) == (14336, 4096)


@pytest.mark.parametrize("m", [16, 1024])
@pytest.mark.parametrize(("kernel", "groups"), [
    (kernel, groups) for kernel in ("int8", "int4", "float8_e4m3fn", "float8_e5m2", "w8a8")
    for groups in (1, 32) if (kernel, groups) != ("w8a8", 32)  # w8a8: channelwise only
])
def test_lowers_to_mosaic(kernel: str, groups: int, m: int) -> None:
    k, n = 4096, 14336
    if kernel == "w8a8":
        qtype = "int8"

        def fn(x, q, s):
            return w8a8_matmul(x, q, s, interpret=False)
    else:
        qtype = kernel

        def fn(x, q, s):
            return weight_only_matmul(x, q, s, interpret=False)
    exp = jax.export.export(jax.jit(fn), platforms=["tpu"])(
        _S((m, k), jnp.bfloat16), _S((k, n), jnp.dtype(qtype)), _S((groups, n), jnp.bfloat16))
    assert exp.platforms == ("tpu",)
    assert "tpu_custom_call" in exp.mlir_module()


def test_float32_and_odd_shapes_lower_to_mosaic() -> None:
    def fn(x, q, s):
        return (weight_only_matmul(x, q, s, interpret=False),
                w8a8_matmul(x, q, s[:1], interpret=False))

    exp = jax.export.export(jax.jit(fn), platforms=["tpu"])(
        _S((5, 384), jnp.float32), _S((384, 200), jnp.int8), _S((3, 200), jnp.float32))
    assert exp.mlir_module().count("tpu_custom_call") >= 2


def _kernel_dot_precisions(fn, *args) -> list:
    """The precision of every dot inside the Pallas kernels of ``fn(*args)``'s jaxpr."""
    found = []

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(eqn.params["precision"])
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("kernel", ["weight_only", "w8a8"])
def test_kernel_dots_keep_their_precision_under_a_global_highest(kernel: str) -> None:
    # A TPU rejected the kernels compiled under jax.default_matmul_precision
    # ('highest') (Mosaic: "Bad lhs type"): an unset precision took the global
    # one and asked for a float32 contraction of bf16 or int8 operands. The
    # kernels' dots name DEFAULT (one MXU pass of their bf16/int8 operands).
    x = jnp.ones((16, 256), jnp.bfloat16)
    q = jnp.ones((256, 128), jnp.int8)
    s = jnp.ones((1, 128), jnp.bfloat16)
    fn = weight_only_matmul if kernel == "weight_only" else w8a8_matmul
    with jax.default_matmul_precision("highest"):
        precisions = _kernel_dot_precisions(lambda a, b, c: fn(a, b, c, interpret=True), x, q, s)
    assert precisions, "no dot found inside the kernel"
    default = (jax.lax.Precision.DEFAULT, jax.lax.Precision.DEFAULT)
    assert all(p == default for p in precisions), precisions


@pytest.mark.parametrize("kernel", ["weight_only", "w8a8"])
def test_symbolic_m_exports_and_runs_any_batch(rng: np.random.Generator, kernel: str) -> None:
    """A symbolic M (an artifact's batch) takes the large-M blocks; the padding
    and the grid are symbolic. Exported interpreted for the CPU, the program
    runs batches below and above one block against NumPy; exported for the
    TPU it holds the Mosaic call."""
    k, n = 256, 200
    q = qwix_weight(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), "int8", None)
    fn = weight_only_matmul if kernel == "weight_only" else w8a8_matmul
    (b,) = jax.export.symbolic_shape("b")
    p = plan(kernel, b, n, k, block_m=None, block_n=None, block_k=None, m_step=32)
    assert p.bm == blocks_module.default_blocks(kernel, 1 << 30)[0]
    for platform, interpret in (("tpu", False), ("cpu", True)):
        exp = jax.export.export(
            jax.jit(lambda x, q, s, i=interpret: fn(x, q, s, out_dtype=jnp.float32, interpret=i)),
            platforms=[platform])(_S((b, k), jnp.float32), _S((k, n), jnp.int8),
                                  _S((1, n), jnp.float32))
        assert str(exp.in_avals[0].shape[0]) == "b" and str(exp.out_avals[0].shape) == "(b, 200)"
        assert ("tpu_custom_call" in exp.mlir_module()) == (platform == "tpu")
    # The CPU export runs on the CPU device (a TPU host has one too), with the
    # reference in the same program: one compiled division picks the levels.
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS left the CPU backend out
        pytest.skip("this host's JAX has no CPU backend to run the CPU export on")
    run = jax.jit(lambda x, q, s: (exp.call(x, q, s),
                                   reference_w8a8_matmul(x, q, s, out_dtype=jnp.float32)))
    for m in (3, p.bm + 5):
        x = jnp.asarray(_activation(rng, m, k))
        with jax.default_device(cpu):
            y, y_ref = run(*jax.device_put((x, q.qvalue, q.scale), cpu))
        assert y.shape == (m, n)
        if kernel == "w8a8":  # integer accumulation, the same float epilogue
            np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
        else:  # the bound of test_weight_only_matches_numpy, float32 x, one group
            deq = dequantized(q)
            exact, mag = f64(x) @ deq, np.abs(f64(x)) @ np.abs(deq)
            assert np.all(np.abs(f64(y) - exact) <= (2 * k + 3) * U32 * mag)
