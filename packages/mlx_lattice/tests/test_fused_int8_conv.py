"""The fused static-int8 convolution (``ext.sparse_quantized_conv_fused``)
against the NumPy reference of ``int8_refs.py``: the convolution's sums and
the requantized int8 output bit for bit, float outputs bit for bit against
the reference's float32 arithmetic and within a derived bound of the float
convolution, int8 inputs at a given scale, residual / ReLU combinations,
empty relations, every int8 ISA path, mx.compile, and the errors."""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice._native import ext
from mlx_lattice.core import QuantizedWeight, build_kernel_relation, ops

_spec = importlib.util.spec_from_file_location(
    "int8_refs", Path(__file__).with_name("int8_refs.py")
)
int8_refs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(int8_refs)
int8_conv_ref = int8_refs.int8_conv_ref
fused_epilogue_ref = int8_refs.fused_epilogue_ref
requantize_ref = int8_refs.requantize_ref
quantize_static_ref = int8_refs.quantize_static_ref
make_case = int8_refs.make_case

_INT8_PATHS = {
    "x86_64": ("amx-int8", "avx512-vnni", "avx-vnni", "avx2-fma"),
    "aarch64": ("neon-i8mm", "neon-dotprod"),
    "arm64": ("neon-i8mm", "neon-dotprod"),
}.get(platform.machine(), ())


def static_scale(x: np.ndarray) -> np.float32:
    """The scale calibration records: max|x| / 127 (float32)."""
    return np.float32(np.abs(x).max() / np.float32(127))


# Epilogues: (bias, residual kind, relu, output) with output "int8" (a
# requantized output), or a float dtype name.
EPILOGUES = [
    (False, None, False, "float32"),
    (True, None, False, "float32"),
    (True, None, True, "int8"),
    (True, "float", True, "float32"),
    (False, "int8", True, "int8"),
    (True, "int8", False, "bfloat16"),
    (False, "float", True, "float16"),
    (True, "float", False, "int8"),
]

CASES = [(64, 64, 8, 64), (40, 20, 8, 32), (33, 70, 4, 32)]


def run_case(rng, rel, feats, qw, int8_input, bias, residual, relu, output):
    """The op's output and the NumPy reference's, as NumPy arrays."""
    cout = qw.out_channels
    s_in = static_scale(feats)
    if int8_input:
        codes, _ = quantize_static_ref(feats, s_in)
        x = mx.array(codes.astype(np.int8))
        acc = int8_conv_ref(None, qw, rel, static=s_in, codes=codes)
    else:
        x = mx.array(feats)
        acc = int8_conv_ref(feats, qw, rel, static=s_in)
    kwargs = {"in_scale": float(s_in), "relu": relu}
    b = r = rs = None
    if bias:
        b = rng.standard_normal(cout).astype(np.float32)
        kwargs["bias"] = mx.array(b)
    if residual == "float":
        r = rng.standard_normal((rel.n_out_capacity, cout)).astype(np.float32)
        kwargs["residual"] = mx.array(r)
    elif residual == "int8":
        r = rng.integers(-127, 128, (rel.n_out_capacity, cout)).astype(np.int8)
        rs = np.float32(0.0173)
        kwargs["residual"] = mx.array(r)
        kwargs["residual_scale"] = float(rs)
    y = fused_epilogue_ref(acc, bias=b, residual=r, residual_scale=rs, relu=relu)
    if output == "int8":
        # The next layer's scale: what calibration would record for y.
        s_out = static_scale(np.where(np.isfinite(y), y, 0))
        kwargs["out_scale"] = float(s_out)
        want = requantize_ref(y, s_out)
    else:
        kwargs["out_dtype"] = output
        want = np.array(mx.array(y).astype(getattr(mx, output)).astype(mx.float32))
    got = ext.sparse_quantized_conv_fused(x, qw, rel, **kwargs)
    assert got.dtype == getattr(mx, output)
    got = np.array(got if output == "int8" else got.astype(mx.float32))
    return got, want


@pytest.mark.parametrize(("cin", "cout", "bits", "group"), CASES)
@pytest.mark.parametrize("int8_input", [False, True])
def test_matches_numpy_reference_bit_for_bit(rng, cin, cout, bits, group, int8_input):
    """Every epilogue: the int32 dot products (exact in the reference's
    int64, asserted below 2**31 there), their float32 sums and the
    epilogue's float32 operations give the reference's bits; the int8
    output is the reference's requantization."""
    rel, feats, qw = make_case(rng, 600, cin, cout, bits, group)
    for bias, residual, relu, output in EPILOGUES:
        got, want = run_case(rng, rel, feats, qw, int8_input, bias, residual, relu, output)
        msg = f"bias={bias} residual={residual} relu={relu} out={output}"
        np.testing.assert_array_equal(got, want, err_msg=msg)


@pytest.mark.parametrize(("cin", "group"), [(64, 32), (40, 32)])
def test_int8_codes_of_minus_128_read_as_minus_127(rng, cin, group):
    """Arbitrary int8 codes, -128 among them (the vector loader at C64, the
    scalar one at C40): the reference with -128 read as -127."""
    rel, feats, qw = make_case(rng, 400, cin, 24, 8, group)
    codes = rng.integers(-128, 128, feats.shape).astype(np.int8)
    codes[:, 0] = -128
    want = int8_conv_ref(None, qw, rel, static=np.float32(0.03), codes=codes)
    got = ext.sparse_quantized_conv_fused(mx.array(codes), qw, rel, in_scale=0.03)
    np.testing.assert_array_equal(np.array(got), want)
    clipped = ext.sparse_quantized_conv_fused(
        mx.array(np.maximum(codes, -127)), qw, rel, in_scale=0.03
    )
    np.testing.assert_array_equal(np.array(clipped), want)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_plain_output_is_the_static_int8_convolution(rng, dtype):
    """No epilogue: the bits of act_bits=8 with act_scale, in the features'
    dtype (half features widened to float32 and quantized, the float32 sum
    rounded once to their dtype)."""
    rel, feats, qw = make_case(rng, 500, 64, 48, 4, 32)
    s = static_scale(feats)
    x = mx.array(feats).astype(dtype)
    want = ext.sparse_quantized_conv_features(x, qw, rel, act_bits=8, act_scale=s)
    got = ext.sparse_quantized_conv_fused(x, qw, rel, in_scale=float(s))
    assert got.dtype == dtype
    np.testing.assert_array_equal(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    )


def test_requantization_rounds_half_to_even_saturates_and_zeroes_nan(rng):
    """With a zero weight every sum is 0, so y is the bias: written-out
    ties (y / out_scale = +-0.5, +-1.5, 2.5), saturation at +-127 (no
    -128), infinities and NaN."""
    rel, feats, _ = make_case(rng, 100, 32, 16, 8, 32)
    qw = QuantizedWeight.from_float(mx.zeros((27, 32, 16)), bits=8, group_size=32)
    bias = np.array(
        [0.25, 0.75, -0.25, -0.75, 1.25, 63.75, 100.0, -100.0,
         np.inf, -np.inf, np.nan, 0.1, -63.5, 63.25, 1e30, -1e-30],
        dtype=np.float32,
    )  # fmt: skip
    want = np.array([0, 2, 0, -2, 2, 127, 127, -127, 127, -127, 0, 0, -127, 126, 127, 0])
    got = ext.sparse_quantized_conv_fused(
        mx.array(feats), qw, rel, in_scale=0.1, bias=mx.array(bias), out_scale=0.5
    )
    assert got.dtype == mx.int8
    got = np.array(got)
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape).astype(np.int8))
    # ReLU: the negative ones become 0, NaN stays NaN (then 0).
    got = np.array(
        ext.sparse_quantized_conv_fused(
            mx.array(feats), qw, rel, in_scale=0.1, bias=mx.array(bias), relu=True, out_scale=0.5
        )
    )
    np.testing.assert_array_equal(got[0], np.maximum(want, 0).astype(np.int8))


def test_int8_chain_equals_the_unfused_chain(rng):
    """Two layers: the first requantizes to the second's scale, the second
    reads those codes with an int8 residual. The codes between them are the
    ones the unfused path's static quantization computes from its float
    output, and the second output is the unfused one, bit for bit."""
    rel, feats, qw1 = make_case(rng, 700, 32, 64, 8, 32)
    _, _, qw2 = make_case(rng, 10, 64, 64, 4, 32)
    s0 = static_scale(feats)
    b1 = mx.array(rng.standard_normal(64).astype(np.float32))
    b2 = mx.array(rng.standard_normal(64).astype(np.float32))
    # Unfused: float convolutions, bias, ReLU, the next static quantization.
    y1 = ops.sparse_quantized_conv_features_from_relation(
        mx.array(feats), qw1, rel, act_bits=8, act_scale=float(s0)
    )
    y1 = mx.maximum(y1 + b1, 0)
    s1 = static_scale(np.array(y1))
    res = rng.integers(-127, 128, (rel.n_out_capacity, 64)).astype(np.int8)
    rs = np.float32(0.05)
    y2 = ops.sparse_quantized_conv_features_from_relation(
        y1, qw2, rel, act_bits=8, act_scale=float(s1)
    )
    y2 = (y2 + b2) + mx.array(res).astype(mx.float32) * mx.array(rs)
    # Fused.
    q1 = ext.sparse_quantized_conv_fused(
        mx.array(feats), qw1, rel, in_scale=float(s0), bias=b1, relu=True, out_scale=float(s1)
    )
    codes1, _ = quantize_static_ref(np.array(y1), s1)
    np.testing.assert_array_equal(np.array(q1), codes1.astype(np.int8))
    out = ext.sparse_quantized_conv_fused(
        q1, qw2, rel, in_scale=float(s1), bias=b2, residual=mx.array(res),
        residual_scale=float(rs), out_dtype="float32",
    )  # fmt: skip
    np.testing.assert_array_equal(np.array(out), np.array(y2))


def test_float_output_within_activation_rounding_of_the_float_conv(rng):
    """Against the float convolution with the same dequantized weight (+
    bias, ReLU): each activation moves by at most half a step S / 2, so an
    output by at most sum over its edges of (S / 2) * sum_c |w[k, c, x]|
    (ReLU is 1-Lipschitz); plus float32 rounding of both paths, the
    n * eps * sum|terms| bound for n = K * Cin products and the epilogue's
    few operations (+ 8), once per path."""
    rel, feats, qw = make_case(rng, 600, 48, 40, 8, 16 * 2)
    s = static_scale(feats)
    b = rng.standard_normal(40).astype(np.float32)
    got = ext.sparse_quantized_conv_fused(
        mx.array(feats), qw, rel, in_scale=float(s), bias=mx.array(b), relu=True
    )
    ref = ops.sparse_quantized_conv_features_from_relation(mx.array(feats), qw, rel)
    ref = np.maximum(np.array(ref).astype(np.float64) + b, 0)
    w_abs = np.abs(np.array(qw.dequantize().astype(mx.float32))).astype(np.float64)
    e = rel.edges
    i, o, k = np.array(e.in_rows), np.array(e.out_rows), np.array(e.kernel_ids)
    step = np.zeros_like(ref)
    mag = np.zeros_like(ref)
    np.add.at(step, o, 0.5 * float(s) * w_abs[k].sum(axis=1))
    np.add.at(mag, o, np.einsum("ec,ecx->ex", np.abs(feats[i]).astype(np.float64), w_abs[k]))
    bound = step + 2 * (27 * 48 + 8) * np.finfo(np.float32).eps * (mag + np.abs(b))
    err = np.abs(np.array(got).astype(np.float64) - ref)
    assert (err <= bound).all(), float((err - bound).max())
    assert err.max() > 0  # the activations were rounded: not the float path itself


def test_every_int8_isa_path_gives_the_same_bits(rng):
    """Each int8 path this CPU has, forced in process, gives the reference's
    bits for float and int8 inputs with a requantized output."""
    rel, feats, qw = make_case(rng, 700, 40, 70, 8, 32)
    ran = []
    try:
        for isa in (*_INT8_PATHS, "scalar"):
            mlx_lattice.set_kernel_isa(isa)
            ran.append(ext.int8_isa())
            for int8_input in (False, True):
                args = (rel, feats, qw, int8_input, True, "int8", True, "int8")
                got, want = run_case(np.random.default_rng(1), *args)
                np.testing.assert_array_equal(got, want, err_msg=f"{isa} int8_in={int8_input}")
    finally:
        mlx_lattice.set_kernel_isa(None)
    print("int8 paths run:", ran)


def test_thread_counts_give_the_same_bits(rng):
    rel, feats, qw = make_case(rng, 900, 64, 64, 8, 64)
    s = float(static_scale(feats))
    runs = []
    before = mlx_lattice.get_num_threads()
    try:
        for threads in (1, 2, 3):
            mlx_lattice.set_num_threads(threads)
            runs.append(
                np.array(
                    ext.sparse_quantized_conv_fused(
                        mx.array(feats), qw, rel, in_scale=s, relu=True, out_scale=0.05
                    )
                )
            )
    finally:
        mlx_lattice.set_num_threads(before)
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])


def test_empty_relations(rng):
    """No rows at all; and outputs with no edges (their sums are 0, so the
    output is the epilogue of 0)."""
    empty = build_kernel_relation(np.zeros((0, 4), np.int32), kernel_size=3)
    qw = QuantizedWeight.from_float(mx.ones((27, 32, 16)), bits=8, group_size=32)
    out = ext.sparse_quantized_conv_fused(
        mx.zeros((0, 32), dtype=mx.int8), qw, empty, in_scale=0.1, out_scale=0.1
    )
    assert out.shape == (0, 16) and out.dtype == mx.int8
    mx.eval(out)
    in_coords = np.array([[0, 0, 0, 0], [0, 1, 0, 0]], np.int32)
    far = np.array([[0, 50, 50, 50], [1, 0, 0, 0], [0, 60, 0, 0]], np.int32)
    rel = build_kernel_relation(in_coords, far, kernel_size=3, kind="forward")
    assert np.array(rel.edges.in_rows).size == 0
    b = rng.standard_normal(16).astype(np.float32)
    feats = mx.array(rng.standard_normal((2, 32)).astype(np.float32))
    got = ext.sparse_quantized_conv_fused(
        feats, qw, rel, in_scale=0.1, bias=mx.array(b), relu=True, out_scale=0.01
    )
    want = requantize_ref(np.broadcast_to(np.maximum(b, 0), (3, 16)), np.float32(0.01))
    np.testing.assert_array_equal(np.array(got), want)


def test_compile_and_inference_only_transforms(rng):
    rel, feats, qw = make_case(rng, 300, 32, 16, 8, 32)
    s = float(static_scale(feats))
    b = mx.array(rng.standard_normal(16).astype(np.float32))

    def layer(x, bias):
        return ext.sparse_quantized_conv_fused(x, qw, rel, in_scale=s, bias=bias, out_scale=0.02)

    x = mx.array(feats)
    eager = layer(x, b)
    compiled = mx.compile(layer)(x, b)
    np.testing.assert_array_equal(np.array(compiled), np.array(eager))
    with pytest.raises(mlx_lattice.MlxLatticeError, match="inference-only"):
        mx.grad(lambda x: layer(x, b).astype(mx.float32).sum())(x)
    with pytest.raises(mlx_lattice.MlxLatticeError, match="vmap"):
        mx.vmap(lambda x: layer(x, b))(mx.stack([x, x]))


def test_bad_arguments_raise_naming_them(rng):
    rel, feats, qw = make_case(rng, 200, 32, 16, 8, 32)
    x = mx.array(feats)
    n_out = rel.n_out_capacity
    ok = {"in_scale": 0.1}
    bad = [
        ({"in_scale": 0.0}, "in_scale"),
        ({"in_scale": float("nan")}, "in_scale"),
        ({"in_scale": -1.0}, "in_scale"),
        ({**ok, "bias": mx.zeros((15,))}, "bias"),
        ({**ok, "bias": mx.zeros((16,), dtype=mx.int32)}, "bias"),
        ({**ok, "residual": mx.zeros((n_out, 15))}, "residual"),
        ({**ok, "residual": mx.zeros((n_out, 16), dtype=mx.int32)}, "residual"),
        ({**ok, "residual": mx.zeros((n_out, 16), dtype=mx.int8)}, "residual_scale"),
        ({**ok, "residual": mx.zeros((n_out, 16)), "residual_scale": 0.5}, "residual_scale"),
        ({**ok, "residual_scale": 0.5}, "residual_scale"),
        ({**ok, "out_scale": -1.0}, "out_scale"),
        ({**ok, "out_scale": float("inf")}, "out_scale"),
        ({**ok, "out_dtype": "int8"}, "out_dtype"),
        ({**ok, "out_dtype": "float64"}, "out_dtype"),
        ({**ok, "out_scale": 0.1, "out_dtype": "float32"}, "out_dtype"),
    ]
    for kwargs, name in bad:
        with pytest.raises(mlx_lattice.MlxLatticeError, match=name):
            ext.sparse_quantized_conv_fused(x, qw, rel, **kwargs)
    with pytest.raises(mlx_lattice.MlxLatticeError, match="feats"):
        ext.sparse_quantized_conv_fused(x.astype(mx.int32), qw, rel, in_scale=0.1)
    with pytest.raises(mlx_lattice.MlxLatticeError, match="feats"):
        ext.sparse_quantized_conv_fused(x[1:], qw, rel, in_scale=0.1)
    with pytest.raises(mlx_lattice.MlxLatticeError, match="feats"):
        ext.sparse_quantized_conv_fused(x[:, :20], qw, rel, in_scale=0.1)
