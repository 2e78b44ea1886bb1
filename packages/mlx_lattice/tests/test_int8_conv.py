"""The integer convolution (``act_bits=8``: w8a8 and w4a8) against a NumPy
int64 reference of the same quantized math (bit for bit), against the float
convolution (within the bound activation rounding allows), on every ISA path
and for any thread count."""

from __future__ import annotations

import importlib.util
import os
import platform
import types
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
codes_ref, int8_conv_ref = int8_refs.codes_ref, int8_refs.int8_conv_ref
quantize_rows_ref, quantize_static_ref = int8_refs.quantize_rows_ref, int8_refs.quantize_static_ref


def float_error_bound(
    feats: np.ndarray, qw: QuantizedWeight, rel, step: np.ndarray, term_bound: np.ndarray
) -> np.ndarray:
    """Bound on |int8 path - float path with the same dequantized weight| per
    output: sum over edges (i -> o, k) of (step[i] / 2) * sum_c |w[k, c, x]|
    (each activation moves by at most half a quantization step), plus
    float32 rounding of both paths: the standard n * eps * sum|terms| bound
    for a sum of n = K * Cin products (+ 8 for the epilogue's operations),
    once per path, with sum|terms| = sum over edges of
    term_bound[i] @ |w[k]| (``term_bound`` (n_in, Cin): the magnitude of
    the activations the terms are made of)."""
    w_abs = np.abs(np.array(qw.dequantize().astype(mx.float32))).astype(np.float64)
    in_rows = np.array(rel.edges.in_rows)
    out_rows = np.array(rel.edges.out_rows)
    k_ids = np.array(rel.edges.kernel_ids)
    bound = np.zeros((rel.n_out_capacity, qw.out_channels), dtype=np.float64)
    mag = np.zeros_like(bound)
    for k in range(qw.n_kernels):
        sel = k_ids == k
        i, o = in_rows[sel], out_rows[sel]
        bound[o] += 0.5 * step[i, None].astype(np.float64) * w_abs[k].sum(axis=0)
        mag[o] += term_bound[i].astype(np.float64) @ w_abs[k]
    slack = 2 * (qw.n_kernels * qw.in_channels + 8) * np.finfo(np.float32).eps * mag
    return bound + slack


make_case = int8_refs.make_case


CASES = [
    # (cin, cout, bits, group): padded input channels, column tails, groups.
    (64, 64, 8, 64),
    (64, 64, 4, 32),
    (40, 20, 8, 32),
    (19, 70, 4, 32),
    (128, 48, 8, 64),
    (33, 17, 3, 32),
    # Whole 16-channel vectors short of the padded width (the second group
    # partial, or a whole group of padding).
    (48, 24, 8, 32),
    (80, 16, 4, 64),
]


def large_case(rng, ref, cin: int, cout: int):
    """About 22k output rows: enough for the tiles grown from a forced
    2 MiB+ L2 (cpu/tiles.h keeps 8 tiles per thread) on up to 4 threads."""
    rel = build_kernel_relation(ref.random_coords(rng, 30000, 36), kernel_size=3)
    feats = rng.standard_normal((rel.n_in, cin)).astype(np.float32)
    weight = mx.array(rng.standard_normal((27, cin, cout)).astype(np.float32) * 0.2)
    return rel, feats, QuantizedWeight.from_float(weight, bits=8, group_size=32)


@pytest.mark.parametrize("l2", [0, 64 << 10, 512 << 10, 2 << 20, 64 << 20])
@pytest.mark.parametrize("static", [None, np.float32(0.03)])
def test_tiles_sized_from_any_l2_bit_for_bit(rng, ref, l2, static):
    """Every tile size the L2 rule picks (forced with set_kernel_l2_bytes,
    so hosts with a small L2 run the grown tiles too) gives the reference's
    bits: each output row sums its offsets in the same order. Told of 64
    KiB, the drivers sum the 2.1 MB output in per-thread windows and stream
    it out (cpu/output_window.h)."""
    rel, feats, qw = large_case(rng, ref, 32, 24)
    assert rel.n_out_capacity >= 8 * 4 * 512
    mlx_lattice.set_kernel_l2_bytes(l2)
    try:
        assert mlx_lattice.get_kernel_l2_bytes() == l2
        out = ops.sparse_quantized_conv_features_from_relation(
            mx.array(feats), qw, rel, act_bits=8, act_scale=None if static is None else float(static)
        )
        out = np.array(out)
    finally:
        mlx_lattice.set_kernel_l2_bytes(None)
    np.testing.assert_array_equal(out, int8_conv_ref(feats, qw, rel, static=static))


@pytest.mark.parametrize(("cin", "cout", "bits", "group"), CASES)
def test_matches_int64_reference_bit_for_bit(rng, cin, cout, bits, group):
    rel, feats, qw = make_case(rng, 700, cin, cout, bits, group)
    out = ops.sparse_quantized_conv_features_from_relation(mx.array(feats), qw, rel, act_bits=8)
    np.testing.assert_array_equal(np.array(out), int8_conv_ref(feats, qw, rel))


@pytest.mark.parametrize("cin", [64, 48, 40])
@pytest.mark.parametrize("static", [None, np.float32(2.0)])
def test_rounding_ties_and_saturation_bit_for_bit(rng, seed, cin, static):
    """Activations exactly halfway between two codes round to even (as
    np.rint), and values past 127 steps saturate, on whole 16-channel
    vectors (cin 64, 48) and masked tails (cin 40). Dynamic scales: values
    are multiples of 1/2 and each row's maximum is 127 (scale exactly 1).
    Static scale 2: multiples of 1/2 up to 508 (quarter steps up to 254)."""
    rel, _, qw = make_case(rng, 600, cin, 24, 8, 32)
    top = 254 if static is None else 1016
    x = rng.integers(-top, top + 1, (rel.n_in, cin)).astype(np.float32) / np.float32(2)
    x[1] = np.arange(cin, dtype=np.float32) - np.float32(cin // 2) + np.float32(0.5)
    if static is None:
        x[:, 0] = np.float32(127.0)
    want = int8_conv_ref(x, qw, rel, static=static)
    out = ops.sparse_quantized_conv_features_from_relation(
        mx.array(x), qw, rel, act_bits=8, act_scale=None if static is None else float(static)
    )
    np.testing.assert_array_equal(np.array(out), want, err_msg=f"seed {seed}, cin {cin}")
    # Ties did occur (rint differs from rounding half away from zero), and
    # with the static scale so did saturation.
    steps = x / (np.float32(1) if static is None else static)
    assert np.any(np.rint(steps) != np.trunc(steps + np.copysign(0.5, steps))), f"seed {seed}"
    assert static is None or np.abs(steps).max() > 127, f"seed {seed}"


@pytest.mark.parametrize(("bits", "static"), [(8, False), (4, True)])
def test_dense_block_full_offset_buckets_bit_for_bit(rng, seed, bits, static):
    """A full 11^3 block plus a sparse second batch: every output row of a
    tile has the centre offset (that offset's edges fill all the tile's
    slots) and interior rows have all 27; several tiles, the last one
    partial; the same bits as the int64 reference for 1, 2 and 3 threads."""
    cube = np.stack(np.meshgrid(*[np.arange(11)] * 3, indexing="ij"), -1).reshape(-1, 3)
    sparse = np.unique(rng.integers(0, 30, (400, 3)), axis=0)
    coords = np.concatenate(
        [np.pad(cube, ((0, 0), (1, 0))), np.pad(sparse, ((0, 0), (1, 0)), constant_values=1)]
    ).astype(np.int32)
    rel = build_kernel_relation(coords, kernel_size=3)
    feats = rng.standard_normal((len(coords), 48)).astype(np.float32)
    weight = mx.array(rng.standard_normal((27, 48, 40)).astype(np.float32) * 0.2)
    qw = QuantizedWeight.from_float(weight, bits=bits, group_size=32)
    scale = np.float32(np.abs(feats).max() / 127) if static else None
    want = int8_conv_ref(feats, qw, rel, static=scale)
    counts = np.bincount(np.array(rel.edges.out_rows), minlength=rel.n_out_capacity)
    assert counts.max() == 27 and rel.n_out_capacity > 4 * 256, f"seed {seed}"
    before = mlx_lattice.get_num_threads()
    try:
        for threads in (1, 2, 3):
            mlx_lattice.set_num_threads(threads)
            got = ops.sparse_quantized_conv_features_from_relation(
                mx.array(feats), qw, rel, act_bits=8, act_scale=scale
            )
            np.testing.assert_array_equal(
                np.array(got), want, err_msg=f"seed {seed}, {threads} threads"
            )
    finally:
        mlx_lattice.set_num_threads(before)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize(("cin", "cout", "bits", "group"), CASES)
def test_weight_only_is_the_float_conv_of_the_dequantized_weight(rng, cin, cout, bits, group, dtype):
    """Without act_bits the weight is dequantized once per call (into a
    reused per-thread buffer) to the values s * q + b of a NumPy
    dequantization: the result is the float convolution with that weight,
    bit for bit, for float32 and float16 features and 1 or 2 threads."""
    rel, feats, _ = make_case(rng, 500, cin, cout, bits, group)
    weight = rng.standard_normal((27, cin, cout)).astype(np.float32) * 0.2
    qw = QuantizedWeight.from_float(mx.array(weight).astype(dtype), bits=bits, group_size=group)
    codes = codes_ref(qw)[:, :, :cin].astype(np.float32)  # (K, Cout, Cin)
    g = np.arange(cin) // group
    scales = np.array(qw.scales.astype(mx.float32))[:, :, g]
    biases = np.array(qw.biases.astype(mx.float32))[:, :, g]
    dense = np.ascontiguousarray((scales * codes + biases).transpose(0, 2, 1))  # (K, Cin, Cout)
    f = mx.array(feats).astype(dtype)
    want = ops.sparse_conv_features_from_relation(f.astype(mx.float32), mx.array(dense), rel)
    want = np.array(want.astype(dtype).astype(mx.float32))
    before = mlx_lattice.get_num_threads()
    try:
        for threads in (1, 2):
            mlx_lattice.set_num_threads(threads)
            got = ops.sparse_quantized_conv_features_from_relation(f, qw, rel)
            assert got.dtype == dtype
            np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)
    finally:
        mlx_lattice.set_num_threads(before)


@pytest.mark.parametrize(("cin", "cout", "bits", "group"), CASES[:3])
def test_error_against_float_within_activation_rounding(rng, seed, cin, cout, bits, group):
    """|int8 path - float path with the same dequantized weight| is at most
    sum over edges of (s_a / 2) * sum_c |w[k, c, x]| (each activation moves
    by at most half a step) plus float32 rounding of both sums."""
    rel, feats, qw = make_case(rng, 700, cin, cout, bits, group)
    f = mx.array(feats)
    got = np.array(ops.sparse_quantized_conv_features_from_relation(f, qw, rel, act_bits=8))
    want = np.array(ops.sparse_quantized_conv_features_from_relation(f, qw, rel))
    _, sa = quantize_rows_ref(feats)
    bound = float_error_bound(feats, qw, rel, sa, np.abs(feats))
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), f"seed {seed}: {float((err - bound).max())}"
    # Not vacuous: the quantized result really differs, and much less than the signal.
    assert err.max() > 0, f"seed {seed}"
    assert err.max() < 0.05 * np.abs(want).max(), f"seed {seed}"


_ISA_SCRIPT = """
import sys
import mlx.core as mx
import numpy as np
import mlx_lattice
from mlx_lattice._native import ext
from mlx_lattice.core import QuantizedWeight, build_kernel_relation, ops

rng = np.random.default_rng(int(sys.argv[2]))
pts = rng.integers(0, 9, (800, 3))
coords = np.unique(np.concatenate([rng.integers(0, 2, (800, 1)), pts], 1), axis=0).astype(np.int32)
rel = build_kernel_relation(coords, kernel_size=3)
f = mx.array(rng.standard_normal((len(coords), 40)).astype(np.float32))
results = {"isa": ext.int8_isa()}
for bits, cout in ((8, 70), (4, 64)):
    w = mx.array(rng.standard_normal((27, 40, cout)).astype(np.float32) * 0.2)
    qw = QuantizedWeight.from_float(w, bits=bits, group_size=32)
    for threads in (1, 2, 3):
        mlx_lattice.set_num_threads(threads)
        out = ops.sparse_quantized_conv_features_from_relation(f, qw, rel, act_bits=8)
        results[f"w{bits}_t{threads}"] = np.array(out)
        out = ops.sparse_quantized_conv_features_from_relation(
            f, qw, rel, act_bits=8, act_scale=0.02
        )
        results[f"w{bits}_static_t{threads}"] = np.array(out)
np.savez(sys.argv[1], **results)
"""


# The int8 micro-kernels by architecture, best first (cpu/isa.h's names);
# "scalar" is every platform's fallback.
_INT8_PATHS = {
    "x86_64": ("amx-int8", "avx512-vnni", "avx-vnni", "avx2-fma"),
    "AMD64": ("amx-int8", "avx512-vnni", "avx-vnni", "avx2-fma"),
    "aarch64": ("neon-i8mm", "neon-dotprod"),
    "arm64": ("neon-i8mm", "neon-dotprod"),
}.get(platform.machine(), ())


def test_every_isa_path_and_thread_count_gives_the_same_bits(tmp_path, seed, isa_child):
    """Each int8 micro-kernel of this architecture (forced by
    MLX_LATTICE_GEMM_ISA) and 1, 2 or 3 threads give identical bits, with
    dynamic and with static activation scales."""
    if not _INT8_PATHS:
        pytest.skip(f"no int8 micro-kernel for {platform.machine()}; scalar only")
    results = {}
    for isa in (*_INT8_PATHS, "scalar"):
        path = tmp_path / f"{isa}.npz"
        isa_child(_ISA_SCRIPT, isa, path, seed)
        results[isa] = np.load(path)
    used = [str(r["isa"]) for r in results.values()]
    assert used[-1] == "scalar"
    # Each forced path runs when the CPU has it (a lower one otherwise).
    for i, name in enumerate(used[:-1]):
        assert name in (*_INT8_PATHS[i:], "scalar")
    base = results["scalar"]
    for r in results.values():
        for key in base.files:
            if key != "isa":
                np.testing.assert_array_equal(r[key], base[key], err_msg=f"{r['isa']} {key}")


@pytest.mark.parametrize("saturate", [1.0, 0.4])
@pytest.mark.parametrize(("cin", "cout", "bits", "group"), CASES)
def test_static_scale_matches_int64_reference_bit_for_bit(rng, cin, cout, bits, group, saturate):
    """One static activation scale S (calibrated max|F| / 127, or smaller so
    that the largest rows saturate at +-127): the same bits as the NumPy
    reference that applies S once per output row."""
    rel, feats, qw = make_case(rng, 700, cin, cout, bits, group)
    scale = np.float32(np.abs(feats).max() / 127 * saturate)
    f = mx.array(feats)
    out = ops.sparse_quantized_conv_features_from_relation(f, qw, rel, act_bits=8, act_scale=scale)
    want = int8_conv_ref(feats, qw, rel, static=scale)
    np.testing.assert_array_equal(np.array(out), want)
    # The scale can also come with the weight (as a QuantizedConv passes it).
    qs = QuantizedWeight(**{**qw.__dict__, "act_bits": 8, "act_scale": float(scale)})
    np.testing.assert_array_equal(
        np.array(ops.sparse_quantized_conv_features_from_relation(f, qs, rel)), want
    )


@pytest.mark.parametrize(("cin", "cout", "bits", "group"), CASES[:3])
def test_static_scale_error_against_float(rng, seed, cin, cout, bits, group):
    """With S = max|F| / 127 nothing saturates: |int8 - float| is at most
    sum over edges of (S / 2) * sum_c |w[k, c, x]| plus float32 rounding; a
    static scale is coarser than per-row ones for the small rows, so the
    error is larger than the dynamic path's but within that bound."""
    rel, feats, qw = make_case(rng, 700, cin, cout, bits, group)
    scale = np.float32(np.abs(feats).max() / 127)
    f = mx.array(feats)
    got = np.array(
        ops.sparse_quantized_conv_features_from_relation(f, qw, rel, act_bits=8, act_scale=scale)
    )
    want = np.array(ops.sparse_quantized_conv_features_from_relation(f, qw, rel))
    step = np.full(len(feats), scale, dtype=np.float32)
    # The quantized terms reach 127 S |w| (S is coarser than a row's own scale).
    bound = float_error_bound(feats, qw, rel, step, np.abs(feats) + 127 * float(scale))
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), f"seed {seed}: {float((err - bound).max())}"
    assert err.max() > 0, f"seed {seed}"
    assert err.max() < 0.05 * np.abs(want).max(), f"seed {seed}"


def test_static_scale_bad_values_raise(rng):
    rel, feats, qw = make_case(rng, 200, 32, 8, 8, 32)
    f = mx.array(feats)
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e-60):
        with pytest.raises(ValueError, match="act_scale"):
            ops.sparse_quantized_conv_features_from_relation(f, qw, rel, act_bits=8, act_scale=bad)
    with pytest.raises(ValueError, match="shape"):
        ops.sparse_quantized_conv_features_from_relation(
            f, qw, rel, act_bits=8, act_scale=mx.array([0.1, 0.2])
        )
    with pytest.raises(TypeError, match="act_scale"):
        ops.sparse_quantized_conv_features_from_relation(f, qw, rel, act_bits=8, act_scale="0.1")
    with pytest.raises(ValueError, match="act_bits=8"):
        ops.sparse_quantized_conv_features_from_relation(f, qw, rel, act_scale=0.1)
    with pytest.raises(ValueError, match="act_scale"):
        QuantizedWeight(**{**qw.__dict__, "act_bits": 8, "act_scale": -2.0})
    # The native op validates on its own too.
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="act_scale"):
            ext.sparse_quantized_conv_features(f, qw, rel, act_bits=8, act_scale=bad)
    with pytest.raises(ValueError, match="act_bits=8"):
        ext.sparse_quantized_conv_features(f, qw, rel, act_bits=0, act_scale=0.5)
    # A one-element array is a valid scale.
    one = ops.sparse_quantized_conv_features_from_relation(
        f, qw, rel, act_bits=8, act_scale=mx.array([0.05])
    )
    np.testing.assert_array_equal(np.array(one), int8_conv_ref(feats, qw, rel, np.float32(0.05)))


def test_static_scale_non_finite_rows_compile_vmap_and_threads(rng):
    rel, feats, qw = make_case(rng, 300, 32, 8, 8, 32)
    feats[7, 3] = np.nan
    scale = np.float32(0.05)

    def run(x):
        return ops.sparse_quantized_conv_features_from_relation(
            x, qw, rel, act_bits=8, act_scale=scale
        )

    f = mx.array(feats)
    out = np.array(run(f))
    in_rows = np.array(rel.edges.in_rows)
    touched = np.unique(np.array(rel.edges.out_rows)[in_rows == 7])
    assert np.isnan(out[touched]).all()
    rest = np.setdiff1d(np.arange(rel.n_out_capacity), touched)
    np.testing.assert_array_equal(out[rest], int8_conv_ref(feats, qw, rel, scale)[rest])
    np.testing.assert_array_equal(np.array(mx.compile(run)(f)), out)
    clean = mx.array(np.nan_to_num(feats))
    batched = np.array(mx.vmap(run)(mx.stack([clean, 2 * clean])))
    np.testing.assert_array_equal(batched[1], np.array(run(2 * clean)))
    before = mlx_lattice.get_num_threads()
    try:
        for threads in (1, 3):
            mlx_lattice.set_num_threads(threads)
            np.testing.assert_array_equal(np.array(run(clean)), batched[0])
    finally:
        mlx_lattice.set_num_threads(before)


def test_gradients_compile_and_vmap(rng):
    """Gradient (straight-through: the float-activation one), mx.compile and
    vmap all run through the integer primitive."""
    rel, feats, qw = make_case(rng, 400, 32, 16, 8, 32)
    f = mx.array(feats)
    probe = mx.array(rng.standard_normal((rel.n_out_capacity, 16)).astype(np.float32))

    def loss(x, act_bits):
        out = ops.sparse_quantized_conv_features_from_relation(x, qw, rel, act_bits=act_bits)
        return (out * probe).sum()

    g8 = mx.grad(lambda x: loss(x, 8))(f)
    gf = mx.grad(lambda x: loss(x, None))(f)
    np.testing.assert_array_equal(np.array(g8), np.array(gf))

    def run(x):
        return ops.sparse_quantized_conv_features_from_relation(x, qw, rel, act_bits=8)

    eager = np.array(run(f))
    np.testing.assert_array_equal(np.array(mx.compile(run)(f)), eager)
    stacked = mx.stack([f, 2 * f])
    batched = np.array(mx.vmap(run)(stacked))
    np.testing.assert_array_equal(batched[0], eager)
    np.testing.assert_array_equal(batched[1], np.array(run(2 * f)))


def test_bad_arguments_raise(rng):
    rel, feats, qw = make_case(rng, 200, 32, 8, 8, 32)
    f = mx.array(feats)
    with pytest.raises(ValueError, match="act_bits"):
        ops.sparse_quantized_conv_features_from_relation(f, qw, rel, act_bits=4)
    with pytest.raises(ValueError, match="act_bits"):
        ext.sparse_quantized_conv_features(f, qw, rel, act_bits=5)
    with pytest.raises(ValueError, match="feats"):
        ext.sparse_quantized_conv_features(f[:, :8], qw, rel, act_bits=8)
    # One group of 70,000 channels: 255 * 127 * 70,000 overflows an int32 sum.
    group = 70_000
    wide = types.SimpleNamespace(
        weight=mx.zeros((27, 8, group * 8 // 32), dtype=mx.uint32),
        scales=mx.ones((27, 8, 1)), biases=mx.zeros((27, 8, 1)), in_channels=32,
        out_channels=8, storage_in_channels=group, group_size=group, bits=8,
    )
    with pytest.raises(ValueError, match="at most 65536, got 70000"):
        ext.sparse_quantized_conv_features(f, wide, rel, act_bits=8)


def test_non_finite_rows_give_nan_rows_only(rng):
    rel, feats, qw = make_case(rng, 300, 32, 8, 8, 32)
    feats[7, 3] = np.inf
    out = np.array(
        ops.sparse_quantized_conv_features_from_relation(mx.array(feats), qw, rel, act_bits=8)
    )
    in_rows = np.array(rel.edges.in_rows)
    touched = np.unique(np.array(rel.edges.out_rows)[in_rows == 7])
    assert np.isnan(out[touched]).all()
    # Every other row is the reference's, bit for bit (NaN where it has NaN).
    np.testing.assert_array_equal(out, int8_conv_ref(feats, qw, rel))


def test_isa_name_reported():
    """Uncapped, the int8 kernel is the best level this build, CPU and OS
    can run (ext.isa_supported; the AMX level also needs its drivers and the
    OS permission); capped at scalar, scalar."""
    try:
        if not os.environ.get("MLX_LATTICE_GEMM_ISA"):
            best = next((isa for isa in _INT8_PATHS if ext.isa_supported(isa)), "scalar")
            assert ext.int8_isa() == best
        mlx_lattice.set_kernel_isa("scalar")
        assert ext.int8_isa() == "scalar"
    finally:
        mlx_lattice.set_kernel_isa(None)


_STATIC_SCRIPT = """
import sys
import mlx.core as mx
import numpy as np
import mlx_lattice
from mlx_lattice._native import ext
from mlx_lattice.core import QuantizedWeight, build_kernel_relation, ops

seed = int(sys.argv[2])
rng = np.random.default_rng(seed)
pts = rng.integers(0, 9, (900, 3))
coords = np.unique(np.concatenate([rng.integers(0, 2, (900, 1)), pts], 1), axis=0).astype(np.int32)
# 300 output voxels far from every input: at least one whole 256-row tile
# without an edge (zero rows).
far = coords[:300].copy()
far[:, 1:] += 100
out_coords = np.concatenate([coords, far])
rel = build_kernel_relation(coords, out_coords, kind="target")
results = {"isa": ext.int8_isa(), "coords": coords, "out_coords": out_coords}
for cin, cout, bits, group in ((32, 37, 8, 32), (48, 70, 4, 32), (64, 9, 8, 64)):
    f = rng.standard_normal((len(coords), cin)).astype(np.float32)
    f[:4] *= np.float32(40.0)
    w = rng.standard_normal((27, cin, cout)).astype(np.float32) * 0.2
    bad = f.copy()
    bad[3, 1], bad[11, cin - 1], bad[20, cin // 2] = np.nan, np.inf, -np.inf
    results[f"f{cin}"], results[f"bad{cin}"], results[f"w{cin}"] = f, bad, w
    qw = QuantizedWeight.from_float(mx.array(w), bits=bits, group_size=group)
    scale = float(np.abs(f).max() / 127 * 0.3)
    for threads in (1, 2, 3):
        mlx_lattice.set_num_threads(threads)
        for name, x in (("clean", f), ("bad", bad)):
            out = ops.sparse_quantized_conv_features_from_relation(
                mx.array(x), qw, rel, act_bits=8, act_scale=scale
            )
            results[f"{name}{cin}_t{threads}"] = np.array(out)
np.savez(sys.argv[1], **results)
"""


def test_static_scale_whole_vectors_every_isa_and_thread_count(tmp_path, seed, isa_child):
    """Static scales with whole 16-channel vectors (the one-pass static
    quantizer), odd output widths, rows with NaN / +inf / -inf (the
    kernels then read per-row scales) and without (they read none), and a
    whole output tile without edges: every int8 micro-kernel of this
    architecture and the scalar one at 1, 2 and 3 threads give the int64
    reference's bits, NaN exactly in the rows a non-finite input reaches."""
    results = {}
    for isa in (*_INT8_PATHS, "scalar"):
        path = tmp_path / f"{isa}.npz"
        isa_child(_STATIC_SCRIPT, isa, path, seed)
        results[isa] = np.load(path)
    base = results["scalar"]
    rel = build_kernel_relation(base["coords"], base["out_coords"], kind="target")
    in_rows = np.array(rel.edges.in_rows)
    out_rows = np.array(rel.edges.out_rows)
    assert rel.n_out_capacity - out_rows.max() - 1 >= 256, f"seed {seed}: no empty tile"
    for cin, cout, bits, group in ((32, 37, 8, 32), (48, 70, 4, 32), (64, 9, 8, 64)):
        f, bad = base[f"f{cin}"], base[f"bad{cin}"]
        qw = QuantizedWeight.from_float(mx.array(base[f"w{cin}"]), bits=bits, group_size=group)
        scale = np.float32(float(np.abs(f).max() / 127 * 0.3))
        want = int8_conv_ref(f, qw, rel, static=scale)
        assert not want[out_rows.max() + 1 :].any(), f"seed {seed}"
        touched = np.unique(out_rows[np.isin(in_rows, [3, 11, 20])])
        rest = np.setdiff1d(np.arange(rel.n_out_capacity), touched)
        want_bad = int8_conv_ref(bad, qw, rel, static=scale)
        for r in results.values():
            for threads in (1, 2, 3):
                msg = f"seed {seed} {r['isa']} C{cin}->{cout} t{threads}"
                np.testing.assert_array_equal(r[f"clean{cin}_t{threads}"], want, err_msg=msg)
                got = r[f"bad{cin}_t{threads}"]
                assert np.isnan(got[touched]).all(), msg
                np.testing.assert_array_equal(got[rest], want_bad[rest], err_msg=msg)


def test_set_kernel_isa_forces_each_int8_path_in_process(rng):
    """mlx_lattice.set_kernel_isa caps the int8 kernels at once (no child
    process): each path this CPU has runs when forced (the AMX-INT8 tile
    driver where the host has AMX: CPUID, XCR0 and the OS permission; it
    prints which ran) and all give the NumPy reference's bits, dynamic and
    static scales, 8- and 4-bit codes, 70 output columns (a partial tile)."""
    rel, feats, qw8 = make_case(rng, 700, 40, 70, 8, 32)
    _, _, qw4 = make_case(rng, 700, 40, 70, 4, 32)
    f = mx.array(feats)
    scale = np.float32(np.abs(feats).max() / 127)
    want = {
        (bits, static): int8_conv_ref(feats, qw, rel, static=scale if static else None)
        for bits, qw in ((8, qw8), (4, qw4))
        for static in (False, True)
    }
    ran = []
    try:
        for isa in (*_INT8_PATHS, "scalar"):
            mlx_lattice.set_kernel_isa(isa)
            assert mlx_lattice.get_kernel_isa() == isa
            if ext.isa_supported(isa) or isa == "scalar":
                assert ext.int8_isa() == isa
            ran.append(ext.int8_isa())
            for (bits, static), ref in want.items():
                qw = qw8 if bits == 8 else qw4
                out = ops.sparse_quantized_conv_features_from_relation(
                    f, qw, rel, act_bits=8, act_scale=scale if static else None
                )
                np.testing.assert_array_equal(np.array(out), ref, err_msg=f"{isa} w{bits} {static}")
    finally:
        mlx_lattice.set_kernel_isa(None)
    print("int8 paths run:", ran, "(amx-int8 tiles on the hardware)" if "amx-int8" in ran else
          "(no AMX here: the tile driver runs on the model in //packages/mlx_lattice:amx_int8_test)")
    with pytest.raises(mlx_lattice.MlxLatticeError, match="unknown ISA level"):
        mlx_lattice.set_kernel_isa("avx9")
    with pytest.raises(mlx_lattice.MlxLatticeTypeError, match="name must be a str"):
        mlx_lattice.set_kernel_isa(3)  # type: ignore[arg-type]
